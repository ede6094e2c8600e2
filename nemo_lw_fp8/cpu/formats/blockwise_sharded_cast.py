"""The distributed-optimizer blockwise FP8 cast (2-D, 128x128 tiles) of one rank's flat shard.

Why a module of its own: with a distributed optimizer a rank holds a contiguous slice of the
flattened master weight, which cuts through tiles. TE's ``quantize_master_weights`` for
``Float8BlockwiseQTensor`` (``recipe/fp8_block_scaling.cu``, ``multi_tensor/compute_scale.cu``)
then takes partial 128x128 tile amaxes of the shard (tiles it does not touch get 0), a MAX
all-reduce, ``compute_scale_from_amax`` for every entry of the padded amax buffer (padding:
amax 0 -> scale 1, scale_inv 1), and a cast of the shard with the tile *scale*. Cut anywhere,
the shards' codes concatenate to the full :func:`nemo_lw_fp8.cpu.formats.blockwise.quantize`
rowwise bytes. The MAX all-reduce hook is the MXFP8 one
(:func:`nemo_lw_fp8.cpu.formats.mxfp8_sharded_cast.torch_distributed_max_all_reduce`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nemo_lw_fp8.cpu.formats.blockwise import (
    BLOCK_LEN,
    FLT_MAX,
    abs_ignoring_nan,
    ceil_div,
    compute_scale,
    fp8_max,
    pad2d,
    rowwise_scale_shape,
    saturating_cast,
    scale_inv_from_scale,
)
from nemo_lw_fp8.cpu.formats.mxfp8_layout import round_up
from nemo_lw_fp8.cpu.formats.mxfp8_sharded_cast import AllReduceMax

__all__ = [
    "ShardQuantization",
    "compute_partial_amax",
    "partial_cast",
    "quantize_shard",
]


def _check_weight_shape(shape: Sequence[int]) -> tuple[int, int]:
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2 or shape[0] <= 0 or shape[1] <= 0:
        raise ValueError(
            f"the distributed blockwise path works on non-empty 2-D weights, got shape {shape}"
        )
    return shape


def _tile_segment(
    shard: torch.Tensor, rows: int, cols: int, start_offset: int, fill: torch.Tensor
) -> tuple[int, int, torch.Tensor]:
    """The tile rows ``[t0, t1)`` a flat shard touches, as a zero-padded ``[.., cols_p]`` block
    holding ``fill`` (the shard's values in some form) at the shard's positions."""
    n = shard.numel()
    end = start_offset + n
    if start_offset < 0 or end > rows * cols:
        raise ValueError(f"shard [{start_offset}, {end}) does not fit a {rows} x {cols} tensor")
    t0 = (start_offset // cols) // BLOCK_LEN
    t1 = ((end - 1) // cols) // BLOCK_LEN + 1
    r0, r1 = t0 * BLOCK_LEN, min(t1 * BLOCK_LEN, rows)
    segment = torch.zeros((r1 - r0) * cols, dtype=fill.dtype, device=fill.device)
    offset = start_offset - r0 * cols
    segment[offset : offset + n] = fill
    padded = pad2d(segment.view(r1 - r0, cols), (t1 - t0) * BLOCK_LEN, round_up(cols, BLOCK_LEN))
    return t0, t1, padded


def compute_partial_amax(
    shard: torch.Tensor,
    shape: Sequence[int],
    start_offset: int,
    amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """128x128 tile amaxes of a flat shard (TE's ``fp8_block_scaling_compute_partial_amax``).

    The shard holds elements ``[start_offset, start_offset + numel)`` of the flattened weight.
    Every tile's entry ``amax[m_tile, k_tile]`` is written (0 for tiles the shard does not
    touch, NaN ignored); the round-up-to-4 padding columns are left as they are (zeros when
    ``amax`` is allocated here, with the rowwise scale shape, fp32).
    """
    rows, cols = _check_weight_shape(shape)
    m_tiles, k_tiles = ceil_div(rows, BLOCK_LEN), ceil_div(cols, BLOCK_LEN)
    if amax is None:
        amax = torch.zeros(
            rowwise_scale_shape((rows, cols), 2), dtype=torch.float32, device=shard.device
        )
    with torch.no_grad():
        amax[:m_tiles, :k_tiles] = 0
        shard = shard.detach().reshape(-1)
        if shard.numel() == 0:
            return amax
        mag = abs_ignoring_nan(shard.to(torch.float32))
        t0, t1, block = _tile_segment(shard, rows, cols, start_offset, mag)
        tiles = block.view(t1 - t0, BLOCK_LEN, k_tiles, BLOCK_LEN).amax(dim=(1, 3))
        amax[t0:t1, :k_tiles] = tiles.to(amax.dtype)
    return amax


def partial_cast(
    shard: torch.Tensor,
    scale: torch.Tensor,
    shape: Sequence[int],
    start_offset: int,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> torch.Tensor:
    """uint8 rowwise codes of a flat shard (TE's ``fp8_block_scaling_partial_cast``).

    ``scale`` is the per-tile *scale* (not scale_inv), indexed ``[m_tile, k_tile]``; each
    element becomes ``static_cast<fp8>(fp32(x) * scale)`` (saturating).
    """
    rows, cols = _check_weight_shape(shape)
    fp8_max(fp8_dtype)
    shard = shard.detach().reshape(-1)
    n = shard.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=shard.device)
    k_tiles = ceil_div(cols, BLOCK_LEN)
    t0, t1, block = _tile_segment(shard, rows, cols, start_offset, shard.to(torch.float32))
    tiles = block.view(t1 - t0, BLOCK_LEN, k_tiles, BLOCK_LEN)
    tile_scale = scale[t0:t1, :k_tiles].to(torch.float32)
    codes = saturating_cast(tiles * tile_scale[:, None, :, None], fp8_dtype)
    codes = codes.view((t1 - t0) * BLOCK_LEN, k_tiles * BLOCK_LEN)[:, :cols].reshape(-1)
    offset = start_offset - t0 * BLOCK_LEN * cols
    return codes[offset : offset + n].clone()


@dataclass
class ShardQuantization:
    """One rank's result of the distributed path: full (padded) scales, its shard's codes."""

    scale: torch.Tensor
    scale_inv: torch.Tensor
    codes: torch.Tensor


def quantize_shard(
    shard: torch.Tensor,
    shape: Sequence[int],
    start_offset: int,
    all_reduce_max: AllReduceMax,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    force_pow_2_scales: bool = True,
    amax_epsilon: float = 0.0,
) -> ShardQuantization:
    """The distributed-optimizer cast of one rank's flat shard of a 2-D weight, as TE's
    ``quantize_master_weights`` for ``Float8BlockwiseQTensor`` (pass the shard already in the
    weight's dtype, bf16 in TE, which casts the fp32 master first).

    Partial tile amaxes, one MAX all-reduce through ``all_reduce_max``, scales for every entry
    of the padded buffer (``inf_value = FLT_MAX``), then the cast. The scale_inv's valid region
    equals a full :func:`quantize`'s rowwise scale_inv; its padding is 1.0 (amax 0 -> scale 1),
    where TE's direct quantise leaves it uninitialised.
    """
    amax = compute_partial_amax(shard, shape, start_offset)
    reduced = all_reduce_max(amax)
    if reduced is not None:
        amax = reduced
    scale = compute_scale(amax, fp8_max(fp8_dtype), force_pow_2_scales, amax_epsilon, FLT_MAX)
    scale_inv = scale_inv_from_scale(scale)
    codes = partial_cast(shard, scale, shape, start_offset, fp8_dtype)
    return ShardQuantization(scale, scale_inv, codes)
