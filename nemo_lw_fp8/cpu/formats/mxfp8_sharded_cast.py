"""The distributed-optimizer MXFP8 cast: each rank quantises only its flat shard of a weight.

Why a module of its own: with a distributed optimizer a rank holds a contiguous slice of the
flattened master weight, not whole blocks. TE (``quantize_master_weights``) then computes
partial block amaxes of the shard, MAX all-reduces them over the data-parallel ranks, derives
E8M0 scales and casts the shard alone (``recipe/mxfp8_scaling.cu``,
``multi_tensor/compute_scale.cu``). This module does the same on CPU, bit for bit: cut
anywhere, the shards' codes concatenate to the full :func:`nemo_lw_fp8.cpu.formats.mxfp8.quantize`
bytes. The MAX all-reduce is a hook (:data:`AllReduceMax`), so tests can reduce in-process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from nemo_lw_fp8.cpu.formats.mxfp8 import scaled_cast, work_dtype
from nemo_lw_fp8.cpu.formats.mxfp8_layout import (
    BLOCK_SIZE,
    columnwise_scale_shape,
    e8m0_from_amax,
    flat_2d_shape,
    quantize_multipliers,
    round_up,
    rowwise_scale_shape,
)

__all__ = [
    "AllReduceMax",
    "ShardQuantization",
    "compute_partial_amax",
    "partial_cast",
    "quantize_shard",
    "torch_distributed_max_all_reduce",
]


def _segment(shard: torch.Tensor, rows: int, cols: int, start_offset: int) -> tuple[int, int, int]:
    """Block-row aligned row range ``[r0, r1)`` covering a flat shard, and its offset in it."""
    n = shard.numel()
    end = start_offset + n
    if start_offset < 0 or end > rows * cols:
        raise ValueError(f"shard [{start_offset}, {end}) does not fit a {rows} x {cols} tensor")
    r0 = (start_offset // cols) // BLOCK_SIZE * BLOCK_SIZE
    r1 = round_up((end - 1) // cols + 1, BLOCK_SIZE)
    return r0, r1, start_offset - r0 * cols


def _check_2d(shape: Sequence[int]) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(
            f"the distributed MXFP8 path works on 2-D weights, got shape {tuple(shape)}"
        )
    return flat_2d_shape(shape)


def compute_partial_amax(
    shard: torch.Tensor,
    shape: Sequence[int],
    start_offset: int,
    amax_rowwise: torch.Tensor | None = None,
    amax_colwise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block amaxes of a flat shard of a 2-D tensor (TE's ``mxfp8_scaling_compute_partial_amax``).

    The shard holds elements ``[start_offset, start_offset + numel)`` of the flattened tensor.
    Blocks it does not touch get amax 0; NaN is ignored. Results have the padded scale shapes and
    the shard's dtype, so a MAX all-reduce over ranks gives the full tensor's block amaxes.
    """
    rows, cols = _check_2d(shape)
    shard = shard.reshape(-1)
    if amax_rowwise is None:
        amax_rowwise = torch.zeros(
            rowwise_scale_shape(shape), dtype=shard.dtype, device=shard.device
        )
    if amax_colwise is None:
        amax_colwise = torch.zeros(
            columnwise_scale_shape(shape), dtype=shard.dtype, device=shard.device
        )
    amax_rowwise.zero_()
    amax_colwise.zero_()
    if shard.numel() == 0:
        return amax_rowwise, amax_colwise
    r0, r1, offset = _segment(shard, rows, cols, start_offset)
    magnitude = shard.abs()
    magnitude = torch.where(torch.isnan(magnitude), 0, magnitude).to(shard.dtype)
    segment = torch.zeros((r1 - r0) * cols, dtype=shard.dtype, device=shard.device)
    segment[offset : offset + shard.numel()] = magnitude
    segment = segment.view(r1 - r0, cols)
    amax_rowwise[r0:r1, : cols // BLOCK_SIZE] = segment.view(
        r1 - r0, cols // BLOCK_SIZE, BLOCK_SIZE
    ).amax(-1)
    amax_colwise[r0 // BLOCK_SIZE : r1 // BLOCK_SIZE, :cols] = segment.view(
        (r1 - r0) // BLOCK_SIZE, BLOCK_SIZE, cols
    ).amax(1)
    return amax_rowwise, amax_colwise


def partial_cast(
    shard: torch.Tensor,
    scale_inv_rowwise: torch.Tensor,
    scale_inv_colwise: torch.Tensor,
    shape: Sequence[int],
    start_offset: int,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise and columnwise uint8 codes of a flat shard (TE's ``mxfp8_scaling_partial_cast``).

    Uses compact (unswizzled) padded scales. TE's kernel always writes e4m3; other formats are
    offered here for completeness. Casts saturate, since the scales are given.
    """
    rows, cols = _check_2d(shape)
    shard = shard.reshape(-1)
    n = shard.numel()
    if n == 0:
        empty = torch.empty(0, dtype=torch.uint8, device=shard.device)
        return empty, empty.clone()
    r0, r1, offset = _segment(shard, rows, cols, start_offset)
    work = work_dtype(shard.dtype)
    segment = torch.zeros((r1 - r0) * cols, dtype=work, device=shard.device)
    segment[offset : offset + n] = shard.to(work)
    special = not bool(torch.isfinite(shard).all())
    row_scales = scale_inv_rowwise[r0:r1, : cols // BLOCK_SIZE]
    row_mult = quantize_multipliers(row_scales, work).unsqueeze(-1)
    row_codes = scaled_cast(
        segment.view(r1 - r0, cols // BLOCK_SIZE, BLOCK_SIZE),
        row_mult,
        fp8_dtype,
        saturate=True,
        canonicalize_nan=special,
    )
    col_scales = scale_inv_colwise[r0 // BLOCK_SIZE : r1 // BLOCK_SIZE, :cols]
    col_mult = quantize_multipliers(col_scales, work).unsqueeze(1)
    col_codes = scaled_cast(
        segment.view((r1 - r0) // BLOCK_SIZE, BLOCK_SIZE, cols),
        col_mult,
        fp8_dtype,
        saturate=True,
        canonicalize_nan=special,
    )
    return (
        row_codes.reshape(-1)[offset : offset + n],
        col_codes.reshape(-1)[offset : offset + n],
    )


AllReduceMax = Callable[[torch.Tensor], "torch.Tensor | None"]
"""A MAX all-reduce over data-parallel ranks: reduces its argument in place (or returns it)."""


def torch_distributed_max_all_reduce(group: object | None = None) -> AllReduceMax:
    """The hook for real runs: ``torch.distributed.all_reduce(..., op=MAX, group=group)``."""

    def _reduce(buffer: torch.Tensor) -> None:
        torch.distributed.all_reduce(buffer, op=torch.distributed.ReduceOp.MAX, group=group)

    return _reduce


@dataclass
class ShardQuantization:
    """A rank's result of the distributed path: full scales and its shard's codes."""

    rowwise_scale_inv: torch.Tensor
    columnwise_scale_inv: torch.Tensor
    rowwise_codes: torch.Tensor
    columnwise_codes: torch.Tensor


def quantize_shard(
    shard: torch.Tensor,
    shape: Sequence[int],
    start_offset: int,
    all_reduce_max: AllReduceMax,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> ShardQuantization:
    """The distributed-optimizer cast of one rank's flat shard, as TE's ``quantize_master_weights``.

    Partial amax of the shard (in the shard's dtype, bf16 in TE), one MAX all-reduce of the packed
    ``[rowwise | columnwise]`` amaxes through ``all_reduce_max``, E8M0 scales, then the partial
    cast. Whatever the cut points, the shards' codes concatenate to the full quantise's bytes.
    """
    amax_row, amax_col = compute_partial_amax(shard, shape, start_offset)
    packed = torch.cat([amax_row.reshape(-1), amax_col.reshape(-1)])
    reduced = all_reduce_max(packed)
    if reduced is not None:
        packed = reduced
    amax_row = packed[: amax_row.numel()].view(amax_row.shape)
    amax_col = packed[amax_row.numel() :].view(amax_col.shape)
    scale_row = e8m0_from_amax(amax_row, fp8_dtype)
    scale_col = e8m0_from_amax(amax_col, fp8_dtype)
    row_codes, col_codes = partial_cast(shard, scale_row, scale_col, shape, start_offset, fp8_dtype)
    return ShardQuantization(scale_row, scale_col, row_codes, col_codes)
