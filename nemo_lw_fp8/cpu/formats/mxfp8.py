"""Bit-exact, vectorised CPU emulation of Transformer Engine 2.20 MXFP8 quantise / dequantise.

Why: the plugin trains with MXFP8 parameters on machines without a Blackwell GPU (CI, laptops,
the CPU multi-rank harness). Every byte this module produces is meant to equal what TE 2.20's
CUDA kernels produce, so that a CPU run and a GPU run of the same recipe agree bit for bit.
The format's rules (shapes, E8M0 scales, scale layouts) are in
:mod:`nemo_lw_fp8.cpu.formats.mxfp8_layout`; the distributed-optimizer cast of a flat shard is in
:mod:`nemo_lw_fp8.cpu.formats.mxfp8_sharded_cast`.

What TE's kernel does (``quantize_mxfp8.cuh``):

* Blocks of 32 elements: 1x32 along the last dim ("rowwise"), 32x1 along the flattened leading
  dims ("columnwise", stored in the same ``[M, K]`` layout, *not* transposed), or 32x32 tiles
  when 2-D quantisation is on (both directions then share the tile's scale).
* ``amax = max |x|`` over the block; NaN elements are ignored (``fmaxf``/``__hmax`` semantics),
  and the block's E8M0 scale follows from it (:func:`~.mxfp8_layout.e8m0_from_amax`).
* Element codes: ``cvt.rn.satfinite(x * exp2f_rcp(e8m0))`` (see
  :func:`~.mxfp8_layout.quantize_multipliers` for the multiplier's quirks, which are kept).
  The GPU turns every NaN into the canonical NaN, so a NaN code is always 0x7F.
* Dequantisation: ``out = OType(q * bits(e << 23))`` (so e8m0 0 dequantises to zero).

Exactness of the arithmetic on CPU: ``x * 2^k`` is exact for every input whose scaled value can
round to a non-zero FP8 code, so the element multiply is done in bf16 for bf16 inputs (fast) and
in fp32 otherwise; the FP8 cast is torch's round-nearest-even conversion, which never overflows
because the scale was rounded up. The distributed-optimizer cast clamps first
(``scaled_cast(..., saturate=True)``), since its scales come from outside.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nemo_lw_fp8.cpu.formats.mxfp8_layout import (
    BLOCK_SIZE,
    FP8_DTYPES,
    columnwise_scale_shape,
    dequantize_multipliers,
    e8m0_from_amax,
    flat_2d_shape,
    fp8_max,
    quantize_multipliers,
    rowwise_scale_shape,
    swizzle_scales,
    unswizzle_scales,
)

__all__ = [
    "MXFP8Data",
    "dequantize",
    "dequantize_codes",
    "quantize",
    "scaled_cast",
    "work_dtype",
]

# Bit patterns of |x| above which a value is NaN (per storage dtype of the input).
_INF_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000}
_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_ABS_MASK = {torch.int16: 0x7FFF, torch.int32: 0x7FFFFFFF}

# The canonical NaN the GPU's cvt instructions produce, for both FP8 formats.
_FP8_CANONICAL_NAN = 0x7F


@dataclass
class MXFP8Data:
    """Raw MXFP8 buffers in TE's layout (uint8 codes in the input's shape, padded uint8 scales)."""

    shape: tuple[int, ...]
    fp8_dtype: torch.dtype
    rowwise_data: torch.Tensor | None
    rowwise_scale_inv: torch.Tensor | None
    columnwise_data: torch.Tensor | None
    columnwise_scale_inv: torch.Tensor | None
    with_gemm_swizzled_scales: bool = False


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the element multiply: bf16 stays bf16 (exact, fast), others go to fp32."""
    if dtype == torch.bfloat16:
        return torch.bfloat16
    if dtype in (torch.float16, torch.float32):
        return torch.float32
    raise ValueError(f"MXFP8 quantises bf16, fp16 or fp32 tensors, got {dtype}")


def _row_block_max(mag: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Max over each 1x32 block, by halving folds (faster on CPU than a 32-wide reduction)."""
    folded = mag.view(rows * cols // BLOCK_SIZE, BLOCK_SIZE)
    width = BLOCK_SIZE
    while width > 1:
        width //= 2
        folded = torch.maximum(folded[:, :width], folded[:, width:])
    return folded.view(rows, cols // BLOCK_SIZE)


def _block_amax_bits(
    mag: torch.Tensor, rows: int, cols: int, rowwise: bool, columnwise: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Max of ``|x|`` bit patterns per 1x32 and per 32x1 block (ordered like the floats)."""
    row = _row_block_max(mag, rows, cols) if rowwise else None
    col = mag.view(rows // BLOCK_SIZE, BLOCK_SIZE, cols).amax(1) if columnwise else None
    return row, col


_AMAX_LUT: dict[
    tuple[torch.dtype, torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]
] = {}


def _amax_lut(
    in_dtype: torch.dtype, fp8_dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """For 16-bit inputs: every |x| bit pattern -> (E8M0 byte, element multiplier).

    Built once with :func:`e8m0_from_amax` itself, so a lookup is the same computation.
    """
    key = (in_dtype, fp8_dtype, device)
    lut = _AMAX_LUT.get(key)
    if lut is None:
        magnitudes = torch.arange(0x8000, dtype=torch.int16, device=device).view(in_dtype)
        e8m0 = e8m0_from_amax(magnitudes, fp8_dtype)
        lut = (e8m0, quantize_multipliers(e8m0, work_dtype(in_dtype)))
        _AMAX_LUT[key] = lut
    return lut


def _scales_and_multipliers(
    amax_bits: torch.Tensor, in_dtype: torch.dtype, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """E8M0 bytes and element multipliers for blocks given their max ``|x|`` bit patterns."""
    if amax_bits.dtype == torch.int16:
        e8m0_lut, mult_lut = _amax_lut(in_dtype, fp8_dtype, amax_bits.device)
        index = amax_bits.reshape(-1).to(torch.int32)
        e8m0 = torch.index_select(e8m0_lut, 0, index).view(amax_bits.shape)
        mult = torch.index_select(mult_lut, 0, index).view(amax_bits.shape)
        return e8m0, mult
    e8m0 = e8m0_from_amax(amax_bits.view(in_dtype), fp8_dtype)
    return e8m0, quantize_multipliers(e8m0, work_dtype(in_dtype))


def scaled_cast(
    blocks: torch.Tensor,
    multipliers: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    scratch: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    saturate: bool = False,
    canonicalize_nan: bool = False,
) -> torch.Tensor:
    """``satfinite_rne_cast(blocks * multipliers)`` as uint8 codes (broadcasting multiply).

    ``scratch`` receives the scaled values, ``out`` (a uint8 buffer of ``blocks``' numel) the
    codes; both are optional and only avoid allocations.
    """
    if scratch is not None:
        scaled = torch.mul(blocks, multipliers, out=scratch.view(blocks.shape))
    else:
        scaled = blocks * multipliers
    if saturate:
        limit = fp8_max(fp8_dtype)
        scaled = scaled.clamp(-limit, limit)
    if out is None:
        codes = scaled.to(fp8_dtype).view(torch.uint8)
    else:
        out.view(fp8_dtype).view(scaled.shape).copy_(scaled)
        codes = out.view(scaled.shape)
    if canonicalize_nan:
        nan = torch.isnan(scaled)
        if bool(nan.any()):
            codes.masked_fill_(nan, _FP8_CANONICAL_NAN)
    return codes


_CHUNK_ELEMENTS = 1 << 20
"""Elements per slab in :func:`quantize`, so that its temporaries stay in cache."""


def quantize(
    x: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    two_d: bool = False,
    swizzle: bool = False,
    out: MXFP8Data | None = None,
) -> MXFP8Data:
    """Quantise ``x`` exactly as TE 2.20's MXFP8 kernel (bf16, fp16 or fp32 input).

    ``two_d`` uses 32x32 tiles for both directions (TE's ``with_2d_quantization``);
    ``swizzle`` stores the scales in the GEMM-swizzled order (TE's ``optimize_for_gemm``).
    ``out`` writes in place into existing buffers (contiguous, uint8 or FP8 views; codes in
    ``x``'s shape, padded scales) for the directions requested, and returns it.
    The work is done in slabs of whole 32-row block rows, so temporaries stay small.
    """
    fp8_max(fp8_dtype)
    shape = tuple(x.shape)
    rows, cols = flat_2d_shape(shape)
    work = work_dtype(x.dtype)
    device = x.device
    x2 = x.detach().contiguous().view(rows, cols)
    result = MXFP8Data(shape, fp8_dtype, None, None, None, None, swizzle)
    if not (rowwise or columnwise):
        return result
    row_codes = col_codes = row_scales = col_scales = None
    if rowwise:
        row_codes = _code_buffer(out, "rowwise_data", shape, device)
        row_scales = torch.zeros(rowwise_scale_shape(shape), dtype=torch.uint8, device=device)
    if columnwise:
        col_codes = _code_buffer(out, "columnwise_data", shape, device)
        col_scales = torch.zeros(columnwise_scale_shape(shape), dtype=torch.uint8, device=device)

    if x2.numel() == 0:
        rows = 0  # nothing to quantise; the (zero) scales and empty codes are final
    int_dtype = _INT_VIEW[x2.dtype]
    inf_bits = _INF_BITS[x2.dtype]
    xi = x2.view(int_dtype)
    slab = max(BLOCK_SIZE, _CHUNK_ELEMENTS // max(cols, 1) // BLOCK_SIZE * BLOCK_SIZE)
    slab = min(slab, rows) if rows else 0
    mag_buffer = torch.empty(slab * cols, dtype=int_dtype, device=device)
    mul_buffer = torch.empty(slab * cols, dtype=work, device=device)
    need_row = rowwise or two_d
    need_col = columnwise and not two_d
    blocks_per_row = cols // BLOCK_SIZE

    for r0 in range(0, rows, max(slab, 1)):
        n = min(slab, rows - r0)
        b0, b1 = r0 // BLOCK_SIZE, (r0 + n) // BLOCK_SIZE
        # |x| as integer bit patterns: same order as the floats, NaN sorts above inf.
        mag = torch.bitwise_and(
            xi[r0 : r0 + n], _ABS_MASK[int_dtype], out=mag_buffer[: n * cols].view(n, cols)
        )
        row_bits, col_bits = _block_amax_bits(mag, n, cols, need_row, need_col)
        top = max(int(bits.max()) for bits in (row_bits, col_bits) if bits is not None)
        special = top >= inf_bits
        if top > inf_bits:
            # TE ignores NaN in the amax: recompute with NaN magnitudes set to zero.
            mag.masked_fill_(mag > inf_bits, 0)
            row_bits, col_bits = _block_amax_bits(mag, n, cols, need_row, need_col)
        row_mult = col_mult = None
        if two_d:
            tile_bits = row_bits.view(n // BLOCK_SIZE, BLOCK_SIZE, blocks_per_row).amax(1)
            tile_e8m0, tile_mult = _scales_and_multipliers(tile_bits, x2.dtype, fp8_dtype)
            if rowwise:
                row_scales[r0 : r0 + n, :blocks_per_row] = tile_e8m0.repeat_interleave(
                    BLOCK_SIZE, dim=0
                )
                row_mult = tile_mult.repeat_interleave(BLOCK_SIZE, dim=0)
            if columnwise:
                col_scales[b0:b1, :cols] = tile_e8m0.repeat_interleave(BLOCK_SIZE, dim=1)
                col_mult = tile_mult.repeat_interleave(BLOCK_SIZE, dim=1)
        else:
            if rowwise:
                row_e8m0, row_mult = _scales_and_multipliers(row_bits, x2.dtype, fp8_dtype)
                row_scales[r0 : r0 + n, :blocks_per_row] = row_e8m0
            if columnwise:
                col_e8m0, col_mult = _scales_and_multipliers(col_bits, x2.dtype, fp8_dtype)
                col_scales[b0:b1, :cols] = col_e8m0

        x_slab = x2[r0 : r0 + n]
        if work != x2.dtype:
            x_slab = x_slab.to(work)
        scratch = mul_buffer[: n * cols]
        if rowwise:
            scaled_cast(
                x_slab.view(n, blocks_per_row, BLOCK_SIZE),
                row_mult.unsqueeze(-1),
                fp8_dtype,
                scratch=scratch,
                out=row_codes[r0 : r0 + n],
                canonicalize_nan=special,
            )
        if columnwise:
            if two_d and rowwise:
                # 32x32 tiles: the columnwise codes are the rowwise codes.
                col_codes[r0 : r0 + n] = row_codes[r0 : r0 + n]
            else:
                scaled_cast(
                    x_slab.view(n // BLOCK_SIZE, BLOCK_SIZE, cols),
                    col_mult.unsqueeze(1),
                    fp8_dtype,
                    scratch=scratch,
                    out=col_codes[r0 : r0 + n],
                    canonicalize_nan=special,
                )

    if rowwise:
        result.rowwise_data = row_codes.view(shape)
        result.rowwise_scale_inv = swizzle_scales(row_scales, False) if swizzle else row_scales
    if columnwise:
        result.columnwise_data = col_codes.view(shape)
        result.columnwise_scale_inv = swizzle_scales(col_scales, True) if swizzle else col_scales
    if out is None:
        return result
    for name in ("rowwise_data", "columnwise_data", "rowwise_scale_inv", "columnwise_scale_inv"):
        value, target = getattr(result, name), getattr(out, name)
        if value is None:
            continue
        if target is None:
            setattr(out, name, value)
        elif "scale" in name:  # codes were written in place already
            _as_uint8(target, value.shape).copy_(value)
    out.fp8_dtype = fp8_dtype
    out.with_gemm_swizzled_scales = swizzle
    return out


def _as_uint8(buffer: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    if buffer.dtype not in (torch.uint8, *FP8_DTYPES) or not buffer.is_contiguous():
        raise ValueError(
            f"MXFP8 output buffers must be contiguous uint8/FP8 tensors, got {buffer.dtype} "
            f"with strides {tuple(buffer.stride())}"
        )
    if buffer.numel() != math.prod(shape):
        raise ValueError(
            f"MXFP8 output buffer of shape {tuple(buffer.shape)} cannot hold {tuple(shape)}"
        )
    return buffer.view(torch.uint8).view(tuple(shape))


def _code_buffer(
    out: MXFP8Data | None, name: str, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    rows, cols = flat_2d_shape(shape)
    target = getattr(out, name) if out is not None else None
    if target is None:
        return torch.empty((rows, cols), dtype=torch.uint8, device=device)
    return _as_uint8(target, (rows, cols))


def dequantize_codes(
    codes: torch.Tensor,
    scale_inv: torch.Tensor,
    fp8_dtype: torch.dtype,
    columnwise: bool,
    dtype: torch.dtype = torch.bfloat16,
    swizzled: bool = False,
) -> torch.Tensor:
    """Dequantise one direction's uint8 codes with its (padded) uint8 scales."""
    shape = tuple(codes.shape)
    rows, cols = flat_2d_shape(shape)
    if swizzled:
        scale_inv = unswizzle_scales(scale_inv, columnwise=columnwise)
    work = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    values = codes.contiguous().view(fp8_dtype).view(rows, cols).to(work)
    if columnwise:
        mult = dequantize_multipliers(scale_inv[: rows // BLOCK_SIZE, :cols], work).unsqueeze(1)
        out = values.view(rows // BLOCK_SIZE, BLOCK_SIZE, cols) * mult
    else:
        mult = dequantize_multipliers(scale_inv[:rows, : cols // BLOCK_SIZE], work).unsqueeze(-1)
        out = values.view(rows, cols // BLOCK_SIZE, BLOCK_SIZE) * mult
    return out.to(dtype).view(shape)


def dequantize(
    data: MXFP8Data, dtype: torch.dtype = torch.bfloat16, *, use: str | None = None
) -> torch.Tensor:
    """Dequantise, from rowwise data when present (as TE) unless ``use`` names a direction."""
    if use is None:
        use = "rowwise" if data.rowwise_data is not None else "columnwise"
    if use == "rowwise":
        codes, scales = data.rowwise_data, data.rowwise_scale_inv
    elif use == "columnwise":
        codes, scales = data.columnwise_data, data.columnwise_scale_inv
    else:
        raise ValueError(f"use must be 'rowwise', 'columnwise' or None, got {use!r}")
    if codes is None or scales is None:
        raise ValueError(f"MXFP8 data has no {use} buffers to dequantise")
    return dequantize_codes(
        codes, scales, data.fp8_dtype, use == "columnwise", dtype, data.with_gemm_swizzled_scales
    )
