"""The MXFP8 emulation on the distributed-optimizer path: a tensor quantised as shards cut at
random offsets (partial block amaxes, their MAX all-reduce, E8M0 scales, each shard cast into
its slice) gives the bytes of a full quantise, with simulated ranks as threads; controls for
each, and shards that do not fit refused.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable

import pytest
import torch

from nemo_lw_fp8.cpu.formats import mxfp8 as mx
from nemo_lw_fp8.cpu.formats import mxfp8_layout as mxf
from nemo_lw_fp8.cpu.formats import mxfp8_sharded_cast as mxs
from tests.support.fp8_reference import random_cuts, run_as_threads
from tests.support.mxfp8_reference import wide_range
from tests.support.te_test_support import ThreadedMaxAllReduce

# --------------------------------------------------------------------------------------------
# Distributed-optimizer path
# --------------------------------------------------------------------------------------------


def _shard_cut_mismatches(
    ranks: int, trial: int, offset_of: Callable[[int], int] = lambda start: start
) -> list[str]:
    """Quantise a tensor as ``ranks`` shards cut at random offsets (partial block amaxes, their
    MAX, E8M0 scales, each shard cast into its slice) and name what differs from a full
    quantise (empty: none). ``offset_of`` maps a shard's start to the offset it is processed
    at (the identity, or a control's mutation)."""
    rng = random.Random(100 * ranks + trial)
    shape = rng.choice([(64, 96), (96, 160), (32, 256), (160, 64)])
    x = wide_range(shape, trial) if trial % 2 else torch.randn(shape).bfloat16()
    if trial == 3:
        x.view(-1)[rng.randrange(x.numel())] = math.nan
    full = mx.quantize(x)
    flat = x.reshape(-1)
    cuts = random_cuts(flat.numel(), ranks, rng)
    if trial == 0:
        cuts[1] = cuts[2] if ranks > 2 else cuts[1]  # an empty shard
    shards = list(itertools.pairwise(cuts))
    partial = [mxs.compute_partial_amax(flat[a:b], shape, offset_of(a)) for a, b in shards]
    amax_row = torch.stack([p[0] for p in partial]).amax(0)  # the MAX all-reduce
    amax_col = torch.stack([p[1] for p in partial]).amax(0)
    scale_row, scale_col = mxf.e8m0_from_amax(amax_row), mxf.e8m0_from_amax(amax_col)
    bad = []
    if not torch.equal(scale_row, full.rowwise_scale_inv):
        bad.append("rowwise scales")
    if not torch.equal(scale_col, full.columnwise_scale_inv):
        bad.append("columnwise scales")
    rows, cols = [], []
    for a, b in shards:
        rc, cc = mxs.partial_cast(flat[a:b], scale_row, scale_col, shape, offset_of(a))
        assert rc.numel() == b - a
        rows.append(rc)
        cols.append(cc)
    if not torch.equal(torch.cat(rows), full.rowwise_data.reshape(-1)):
        bad.append("rowwise codes")
    if not torch.equal(torch.cat(cols), full.columnwise_data.reshape(-1)):
        bad.append("columnwise codes")
    return bad


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("trial", range(6))
def test_shard_cuts_give_full_quantize_bytes(ranks, trial):
    assert _shard_cut_mismatches(ranks, trial) == []


@pytest.mark.parametrize("ranks", [2, 4])
def test_control_shards_processed_at_offset_zero_differ(ranks: int) -> None:
    """Control of ``test_shard_cuts_give_full_quantize_bytes``: when every shard is taken for
    the start of the tensor (offset 0), its elements fall into other blocks; the same
    comparison fails in every scale and code."""
    assert _shard_cut_mismatches(ranks, 1, offset_of=lambda start: 0) == [
        "rowwise scales",
        "columnwise scales",
        "rowwise codes",
        "columnwise codes",
    ]


def _sharded_hook_mismatches(ranks: int, hook: Callable[[torch.Tensor], None]) -> list[str]:
    """``quantize_shard`` on ``ranks`` threads (random cuts of one tensor) with the amax
    all-reduce ``hook``: what differs from a full quantise (any rank's scales, the gathered
    codes); empty when nothing does."""
    rng = random.Random(ranks)
    shape = (128, 96)
    x = wide_range(shape, 7)
    full = mx.quantize(x)
    flat = x.reshape(-1)
    cuts = random_cuts(flat.numel(), ranks, rng)
    results: dict[int, mxs.ShardQuantization] = {}

    def rank(i: int) -> None:
        a, b = cuts[i], cuts[i + 1]
        results[i] = mxs.quantize_shard(flat[a:b], shape, a, hook)

    run_as_threads(ranks, rank)
    assert sorted(results) == list(range(ranks)), "a rank did not finish"
    bad = []
    for i in range(ranks):
        if not torch.equal(results[i].rowwise_scale_inv, full.rowwise_scale_inv):
            bad.append(f"rank {i} rowwise scales")
        if not torch.equal(results[i].columnwise_scale_inv, full.columnwise_scale_inv):
            bad.append(f"rank {i} columnwise scales")
    codes = torch.cat([results[i].rowwise_codes for i in range(ranks)])
    if not torch.equal(codes, full.rowwise_data.reshape(-1)):
        bad.append("rowwise codes")
    codes = torch.cat([results[i].columnwise_codes for i in range(ranks)])
    if not torch.equal(codes, full.columnwise_data.reshape(-1)):
        bad.append("columnwise codes")
    return bad


@pytest.mark.parametrize("ranks", [2, 4])
def test_quantize_shard_with_all_reduce_hook(ranks):
    assert _sharded_hook_mismatches(ranks, ThreadedMaxAllReduce(ranks)) == []


@pytest.mark.parametrize("ranks", [2, 4])
def test_control_quantize_shard_without_the_all_reduce_differs(ranks: int) -> None:
    """Control of ``test_quantize_shard_with_all_reduce_hook``: with an all-reduce that does
    nothing each rank scales by the amaxes of its own shard (blocks it does not touch count
    0); the same comparison fails on every rank's scales and in the columnwise codes (a
    32-row block spans the cuts)."""
    bad = _sharded_hook_mismatches(ranks, lambda buffer: None)
    assert {f"rank {i} columnwise scales" for i in range(ranks)} <= set(bad), bad
    assert "columnwise codes" in bad, bad


def test_shard_outside_tensor_refused():
    with pytest.raises(ValueError, match="does not fit"):
        mxs.compute_partial_amax(torch.zeros(10, dtype=torch.bfloat16), (32, 32), 1020)
    with pytest.raises(ValueError, match="2-D"):
        mxs.compute_partial_amax(torch.zeros(10, dtype=torch.bfloat16), (2, 32, 32), 0)
