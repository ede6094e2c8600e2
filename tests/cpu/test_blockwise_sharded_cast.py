"""Blockwise FP8 emulation on the distributed-optimizer path: a tensor quantised as shards cut
at random offsets (partial amaxes, their MAX all-reduce, each shard cast into its slice) gives
the bytes of a full quantise, with simulated ranks as threads; controls for each.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable

import pytest
import torch

from nemo_lw_fp8.cpu.formats import blockwise as bw
from nemo_lw_fp8.cpu.formats import blockwise_sharded_cast as bws
from tests.support.blockwise_reference import wide
from tests.support.fp8_reference import E4M3, random_cuts, run_as_threads
from tests.support.te_test_support import ThreadedMaxAllReduce

# --------------------------------------------------------------------------------------------
# Distributed-optimizer path
# --------------------------------------------------------------------------------------------


def _shard_cut_mismatches(
    ranks: int, trial: int, offset_of: Callable[[int], int] = lambda start: start
) -> list[str]:
    """Quantise a tensor as ``ranks`` shards cut at random offsets (partial amaxes, their MAX,
    each shard cast into its slice) and name what differs from a full quantise (empty: none).
    ``offset_of`` maps a shard's start to the offset it is processed at (the identity, or a
    control's mutation)."""
    rng = random.Random(10 * ranks + trial)
    shape = [(256, 384), (200, 300), (128, 128), (384, 136), (130, 1000)][trial]
    master = wide(shape, trial, torch.float32)
    if trial == 1:
        master.view(-1)[rng.randrange(master.numel())] = math.nan
    x = master.bfloat16()  # TE casts the fp32 master shard to the weight's dtype first
    full = bw.quantize(x)
    flat = x.reshape(-1)
    cuts = random_cuts(flat.numel(), ranks, rng)
    if trial == 0 and ranks == 4:
        cuts[2] = cuts[1]  # an empty shard
    shards = list(itertools.pairwise(cuts))
    partial = [bws.compute_partial_amax(flat[a:b], shape, offset_of(a)) for a, b in shards]
    amax = torch.stack(partial).amax(0)  # the MAX all-reduce
    scale = bw.compute_scale(amax, E4M3, True, 0.0, bw.FLT_MAX)
    scale_inv = bw.scale_inv_from_scale(scale)
    h, w = bw.valid_scale_shape(shape)
    bad = []
    if not torch.equal(scale_inv[:h, :w], full.rowwise_scale_inv[:h, :w]):
        bad.append("scales")
    if not bool((scale_inv[:, w:] == 1.0).all()):  # padding: amax 0 -> scale 1
        bad.append("scale padding")
    codes = [bws.partial_cast(flat[a:b], scale, shape, offset_of(a)) for a, b in shards]
    assert [c.numel() for c in codes] == [b - a for a, b in shards]
    if not torch.equal(torch.cat(codes), full.rowwise_data.reshape(-1)):
        bad.append("codes")
    return bad


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("trial", range(5))
def test_shard_cuts_give_full_quantize_bytes(ranks, trial):
    assert _shard_cut_mismatches(ranks, trial) == []


@pytest.mark.parametrize("ranks", [2, 4])
def test_control_shards_processed_at_offset_zero_differ(ranks: int) -> None:
    """Control of ``test_shard_cuts_give_full_quantize_bytes``: when every shard is taken for
    the start of the tensor (offset 0), its elements fall into other tiles; the same
    comparison fails in the codes (in the scales too where a moved element carries a tile's
    amax, as at 4 ranks)."""
    bad = _shard_cut_mismatches(ranks, 0, offset_of=lambda start: 0)
    assert "codes" in bad, bad


def _sharded_hook_mismatches(ranks: int, hook: Callable[[torch.Tensor], None]) -> list[str]:
    """``quantize_shard`` on ``ranks`` threads (random cuts of one tensor) with the amax
    all-reduce ``hook``: what differs from a full quantise (scales on any rank, the gathered
    codes, the columnwise form derived from them); empty when nothing does."""
    rng = random.Random(ranks)
    shape = (384, 260)
    x = wide(shape, 7)
    full = bw.quantize(x)
    flat = x.reshape(-1)
    cuts = random_cuts(flat.numel(), ranks, rng)
    results: dict[int, bws.ShardQuantization] = {}

    def rank(i: int) -> None:
        results[i] = bws.quantize_shard(flat[cuts[i] : cuts[i + 1]], shape, cuts[i], hook)

    run_as_threads(ranks, rank)
    assert sorted(results) == list(range(ranks)), "a rank did not finish"
    h, w = bw.valid_scale_shape(shape)
    bad = []
    if not all(
        torch.equal(results[i].scale_inv[:h, :w], full.rowwise_scale_inv[:h, :w])
        for i in range(ranks)
    ):
        bad.append("scales")
    gathered = torch.cat([results[i].codes for i in range(ranks)]).view(shape)
    if not torch.equal(gathered, full.rowwise_data):
        bad.append("codes")
    # what the owner would do after the gather: derive the columnwise form locally
    data, scale_inv = bw.columnwise_from_rowwise(gathered, results[0].scale_inv)
    if not torch.equal(data, full.columnwise_data):
        bad.append("columnwise codes")
    if not torch.equal(scale_inv[:w, :h], full.columnwise_scale_inv[:w, :h]):
        bad.append("columnwise scales")
    return bad


@pytest.mark.parametrize("ranks", [2, 4])
def test_quantize_shard_with_all_reduce_hook(ranks):
    assert _sharded_hook_mismatches(ranks, ThreadedMaxAllReduce(ranks)) == []


@pytest.mark.parametrize("ranks", [2, 4])
def test_control_quantize_shard_without_the_all_reduce_differs(ranks: int) -> None:
    """Control of ``test_quantize_shard_with_all_reduce_hook``: with an all-reduce that does
    nothing each rank scales by the amaxes of its own shard (tiles it does not touch count 0);
    the same comparison fails in the scales and in the codes of the tiles a cut splits."""
    bad = _sharded_hook_mismatches(ranks, lambda buffer: None)
    assert "scales" in bad and "codes" in bad, bad
