"""``owner_reduce.reduce_spans``, the owner reduce's collectives, against the rank-order sum.

gloo at DP 4: each reduce gloo really runs, on its owner, against the rank-order sum that every
DP 4 parity compares with (``ordered_grad_sync`` in ``test_compact_grad_sync.py``), under the
bound of the arithmetic (``tests/support/owner_reduce_probe.py``). NCCL: the branch every GPU run
of the compact layout's default gradient sync executes (``owner_reduce._coalesced``: the
reduces under one coalescing manager, one launch). Everything of ``reduce_spans`` but that
branch runs on CPU in every compact test; the branch needs NCCL (gloo has no coalescing), so it
runs here on 2 GPUs, against gloo and the rank-order sum (``tests/support/nccl_owner_reduce.py``);
the CPU test runs the same comparison with a gloo group in NCCL's place, so the GPU test's own
code is not new on a GPU.
"""

from __future__ import annotations

import json
import socket

import pytest
import torch

from tests.support import nccl_owner_reduce
from tests.support import owner_reduce_probe as probe
from tests.support.harness import run_on_ranks


def test_gloo_reduces_at_dp4_equal_the_rank_order_sum_within_the_rounding_bound():
    """fp32 values over 25 binades, 4 ranks, 9 spans owned in turn, synchronous and overlapped:
    on each owner, gloo's sum is the rank-order sum bit for bit where no order can change it,
    else within ``2 gamma(3) sum |x_i|`` (``gamma(3) = 3u / (1 - 3u)``, ``u = 2^-24``): two
    orders of summing four fp32 terms, each rounded to at most ``gamma(3) sum |x_i|`` from the
    exact sum. gloo does sum in another order (many elements differ), and leaving out one
    addend breaks the bound on 9 elements in 10 at least (the bound's control)."""
    found = run_on_ranks(probe.gloo_reduce_against_rank_order, world_size=4)
    for rank, stats in enumerate(found):
        assert stats["syncs"] == 2 and stats["elements"] > 0, (rank, stats)
        assert stats["over"] == 0 and stats["worst"] <= 1.0, (rank, stats)
        assert 0 < stats["order_free"] < stats["elements"], (rank, stats)
        assert stats["dropped_within"] * 10 <= stats["dropped"], (rank, stats)
    assert sum(stats["elements"] for stats in found) == 2 * 20000
    assert all(stats["differing"] > stats["elements"] // 10 for stats in found), found


def test_branch_comparison_runs_on_cpu_ranks():
    """The GPU test's comparison with gloo in NCCL's place: both groups take the gloo branch
    (no coalesced launch) and equal the rank-order sum bit for bit on every span's owner."""
    found = run_on_ranks(nccl_owner_reduce.on_cpu_ranks)
    for rank, result in enumerate(found):
        assert result["coalesced_main"] == result["coalesced_gloo"] == 0, (rank, result)
    total = sum(end - start for _, start, end in nccl_owner_reduce.SPANS)
    assert sum(result["compared"] for result in found) == total


def _free_port() -> int:
    with socket.socket() as handle:
        handle.bind(("127.0.0.1", 0))
        return handle.getsockname()[1]


@pytest.mark.gpu
def test_nccl_owner_reduce_equals_gloo_and_rank_order_on_two_gpus(tmp_path):
    """On 2 GPUs: the spans reduced over NCCL through the coalesced branch (synchronous and
    overlapped, one coalesced launch each) equal, on each span's owner, gloo's owner reduce of
    the same values and their rank-order sum, bit for bit (two addends: one rounding)."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs; {torch.cuda.device_count()} visible")
    if not torch.distributed.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    import torch.multiprocessing as mp

    mp.spawn(nccl_owner_reduce.run_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2)
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(found):
        assert result["coalesced_main"] == 2 and result["coalesced_gloo"] == 0, (rank, result)
    total = sum(end - start for _, start, end in nccl_owner_reduce.SPANS)
    assert sum(result["compared"] for result in found) == total
