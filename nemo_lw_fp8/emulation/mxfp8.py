"""Bit-exact, vectorised CPU emulation of Transformer Engine 2.20 MXFP8 quantisation.

Why: the plugin trains with MXFP8 parameters on machines without a Blackwell GPU (CI, laptops,
the CPU multi-rank harness). Every byte this module produces is meant to equal what TE 2.20's
CUDA kernels produce, so that a CPU run and a GPU run of the same recipe agree bit for bit.

What TE does (read from its kernels ``quantize_mxfp8.cuh``, ``recipe/mxfp8_scaling.cu``,
``multi_tensor/compute_scale.cu`` and ``util/ptx.cuh``):

* Blocks of 32 elements: 1x32 along the last dim ("rowwise"), 32x1 along the flattened leading
  dims ("columnwise", stored in the same ``[M, K]`` layout, *not* transposed), or 32x32 tiles
  when 2-D quantisation is on (both directions then share the tile's scale).
* ``amax = max |x|`` over the block; NaN elements are ignored (``fmaxf``/``__hmax`` semantics).
* ``e8m0 = float_to_e8m0(fp32(amax * fp32(1 / fp8_max)))``: the fp32 exponent bits, plus one when
  the mantissa is non-zero (round *up* to a power of two), NaN -> 0xFF, inf -> 0xFE, 0 -> 0x00,
  saturating at 0xFE, and never rounding up from the subnormal range below 2^-127.
  ``torch``'s own cast to ``float8_e8m0fnu`` rounds differently, so it is never used here.
* Element codes: ``cvt.rn.satfinite(x * exp2f_rcp(e8m0))`` where ``exp2f_rcp`` is TE's bit trick
  ``e == 0 ? 1.0 : bits((254 - e) << 23)``. Note the quirks this implies and which are kept:
  a zero exponent multiplies by 1 (not 2^127), 0xFE multiplies by +0.0 and 0xFF by -inf.
  The GPU turns every NaN into the canonical NaN, so a NaN code is always 0x7F.
* Dequantisation: ``out = OType(q * bits(e << 23))`` (so e8m0 0 dequantises to zero).
* Scales are stored as uint8, padded to ``(roundup(M, 128), roundup(K / 32, 4))`` rowwise and
  ``(roundup(M / 32, 4), roundup(K, 128))`` columnwise. TE leaves compact padding uninitialised;
  this emulation writes zeros there (as TE itself does for GEMM-swizzled scales).

The GEMM-swizzled scale layout (cuBLAS "block scaling factors layout", TE's
``gemm_swizzled_scale_idx``): the padded scale matrix is cut into tiles of 128 rows x 4 columns;
tiles are stored row-major (``num_tiles_x = padded_cols / 4`` per tile row) and, inside a tile,
element ``(r, c)`` goes to ``(r % 32) * 16 + (r // 32) * 4 + c``. Rowwise scales are indexed
``(row, block_col)``; columnwise scales are indexed transposed, ``(col, block_row)``, with
``num_tiles_x = roundup(M / 32, 4) / 4``. See :func:`gemm_swizzled_scale_index`.

Exactness of the arithmetic on CPU: ``x * 2^k`` is exact for every input whose scaled value can
round to a non-zero FP8 code, so the element multiply is done in bf16 for bf16 inputs (fast) and
in fp32 otherwise; the FP8 cast is torch's round-nearest-even conversion, which never overflows
because the scale was rounded up. The distributed-optimizer path (:func:`partial_cast`) clamps
first, since its scales come from outside.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "BLOCK_SIZE",
    "FP8_DTYPES",
    "MXFP8Data",
    "columnwise_scale_shape",
    "compute_partial_amax",
    "dequantize",
    "dequantize_multipliers",
    "e8m0_from_amax",
    "e8m0_round_up",
    "flat_2d_shape",
    "fp8_max",
    "gemm_swizzled_scale_index",
    "partial_cast",
    "quantize",
    "quantize_multipliers",
    "quantize_shard",
    "rowwise_scale_shape",
    "swizzle_scales",
    "torch_distributed_max_all_reduce",
    "unswizzle_scales",
]

BLOCK_SIZE = 32
"""Elements per MXFP8 scaling block (and the side of a 2-D tile)."""

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

# Bit patterns of |x| above which a value is NaN (per storage dtype of the input).
_INF_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000}
_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_ABS_MASK = {torch.int16: 0x7FFF, torch.int32: 0x7FFFFFFF}

# The canonical NaN the GPU's cvt instructions produce, for both FP8 formats.
_FP8_CANONICAL_NAN = 0x7F

# Scale row/column paddings of TE's compact layouts.
_ROWWISE_PAD = (128, 4)
_COLWISE_PAD = (4, 128)


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 format; refuses anything but e4m3fn / e5m2."""
    try:
        return _FP8_MAX[fp8_dtype]
    except KeyError:
        raise ValueError(
            f"MXFP8 elements must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}"
        ) from None


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def flat_2d_shape(shape: Sequence[int]) -> tuple[int, int]:
    """``(prod(leading dims), last dim)``, refusing shapes TE cannot quantise to MXFP8.

    TE needs both numbers to be multiples of 32 (``MXFP8Quantizer.is_quantizable`` and the C++
    ``create_tensor`` check); we raise a ``ValueError`` naming the shape instead of its assert.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        raise ValueError("MXFP8 cannot quantise a 0-d tensor (shape ())")
    cols = shape[-1]
    rows = math.prod(shape[:-1])
    if cols % BLOCK_SIZE != 0 or rows % BLOCK_SIZE != 0:
        raise ValueError(
            f"MXFP8 needs the last dimension and the product of the leading dimensions to be "
            f"multiples of {BLOCK_SIZE}; got shape {shape} (flattened {rows} x {cols})"
        )
    return rows, cols


def rowwise_scale_shape(shape: Sequence[int]) -> tuple[int, int]:
    """Padded uint8 shape of rowwise (1x32) scales: ``(roundup(M,128), roundup(K/32,4))``."""
    rows, cols = flat_2d_shape(shape)
    return _round_up(rows, _ROWWISE_PAD[0]), _round_up(cols // BLOCK_SIZE, _ROWWISE_PAD[1])


def columnwise_scale_shape(shape: Sequence[int]) -> tuple[int, int]:
    """Padded uint8 shape of columnwise (32x1) scales: ``(roundup(M/32,4), roundup(K,128))``."""
    rows, cols = flat_2d_shape(shape)
    return _round_up(rows // BLOCK_SIZE, _COLWISE_PAD[0]), _round_up(cols, _COLWISE_PAD[1])


# --------------------------------------------------------------------------------------------
# E8M0 scales
# --------------------------------------------------------------------------------------------

_RCP_CACHE: dict[torch.dtype, torch.Tensor] = {}


def _fp8_max_rcp(fp8_dtype: torch.dtype) -> torch.Tensor:
    """``fp32(1 / fp8_max)`` as TE's ``Quantized_Limits<T>::max_norm_rcp`` (a 0-d fp32 tensor)."""
    rcp = _RCP_CACHE.get(fp8_dtype)
    if rcp is None:
        rcp = torch.tensor(1.0 / fp8_max(fp8_dtype), dtype=torch.float32)
        _RCP_CACHE[fp8_dtype] = rcp
    return rcp


def e8m0_round_up(v: torch.Tensor) -> torch.Tensor:
    """TE's ``float_to_e8m0`` on fp32 values: the power of two at or above ``v``, as uint8.

    NaN -> 0xFF, inf -> 0xFE, otherwise the fp32 exponent field plus one when the mantissa is
    non-zero, except at 0xFE (saturation) and for subnormal ``v <= 2^-127`` (mantissa
    <= 0x400000), which stay at 0x00. Same result as ``cvt.rp.satfinite.ue8m0x2.f32``.
    """
    v = v.to(torch.float32)
    bits = v.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    e8m0 = exponent + round_up.to(torch.int32)
    e8m0 = torch.where(torch.isinf(v), 0xFE, e8m0)
    e8m0 = torch.where(torch.isnan(v), 0xFF, e8m0)
    return e8m0.to(torch.uint8)


def e8m0_from_amax(
    amax: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn
) -> torch.Tensor:
    """E8M0 scales (uint8) for block amaxes: ``e8m0_round_up(fp32(amax * fp32(1/fp8_max)))``."""
    return e8m0_round_up(amax.to(torch.float32) * _fp8_max_rcp(fp8_dtype).to(amax.device))


def _multiplier_table(dequant: bool) -> torch.Tensor:
    """The 256 fp32 multipliers TE derives from an E8M0 byte.

    Quantise (``exp2f_rcp``): ``e == 0 -> 1.0`` else the float with bits ``(254 - e) << 23``
    (``254 -> +0.0``, ``255 -> -inf``). Dequantise (``exp2f``): the float with bits ``e << 23``
    (``0 -> 0.0``, ``255 -> inf``).
    """
    e = torch.arange(256, dtype=torch.int32)
    if dequant:
        return (e << 23).view(torch.float32).clone()
    table = ((254 - e) << 23).view(torch.float32).clone()
    table[0] = 1.0
    return table


_QUANT_MULT = _multiplier_table(dequant=False)
_DEQUANT_MULT = _multiplier_table(dequant=True)
_TABLE_CACHE: dict[tuple[bool, torch.dtype, torch.device], torch.Tensor] = {}


def _table(dequant: bool, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dequant, dtype, device)
    table = _TABLE_CACHE.get(key)
    if table is None:
        base = _DEQUANT_MULT if dequant else _QUANT_MULT
        # Every entry is 0, +-inf or a power of two in [2^-127, 2^127]; the powers that bf16
        # cannot hold (2^-127) never occur with bf16 arithmetic, so the cast is exact.
        table = base.to(device=device, dtype=dtype)
        _TABLE_CACHE[key] = table
    return table


def quantize_multipliers(e8m0: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What each element of a block is multiplied by before the FP8 cast (TE's ``exp2f_rcp``)."""
    return _table(False, dtype, e8m0.device)[e8m0.long()]


def dequantize_multipliers(e8m0: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``2^(e - 127)`` as TE's dequantise kernel computes it (``e == 0`` gives 0.0)."""
    return _table(True, dtype, e8m0.device)[e8m0.long()]


# --------------------------------------------------------------------------------------------
# GEMM-swizzled scale layout
# --------------------------------------------------------------------------------------------


def gemm_swizzled_scale_index(i: int, j: int, num_tiles_x: int) -> int:
    """Flat position of compact scale ``(i, j)`` in TE's GEMM-swizzled layout.

    Tiles are 128 (in ``i``) x 4 (in ``j``) scales = 512 bytes, laid out row-major with
    ``num_tiles_x`` tiles per tile row; inside a tile the 128 rows are interleaved in four
    groups of 32: ``(i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4``. For rowwise scales
    ``i`` is the row and ``j`` the block column (``num_tiles_x = padded_cols / 4``); for
    columnwise scales ``i`` is the column and ``j`` the block row
    (``num_tiles_x = padded_block_rows / 4``).
    """
    tile = (i // 128) * num_tiles_x + j // 4
    return tile * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4


def _swizzle_rows_major(compact: torch.Tensor) -> torch.Tensor:
    rows, cols = compact.shape
    if rows % 128 or cols % 4:
        raise ValueError(f"swizzling needs a (128k, 4m) scale matrix, got {tuple(compact.shape)}")
    tiles = compact.reshape(rows // 128, 4, 32, cols // 4, 4)
    # (tile_row, tile_col, i % 32, (i % 128) // 32, j % 4) is exactly the swizzled byte order.
    return tiles.permute(0, 3, 2, 1, 4).reshape(-1)


def _unswizzle_rows_major(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    tiles = flat.reshape(rows // 128, cols // 4, 32, 4, 4)
    return tiles.permute(0, 3, 2, 1, 4).reshape(rows, cols)


def swizzle_scales(compact: torch.Tensor, columnwise: bool) -> torch.Tensor:
    """Reorder a padded compact scale matrix into the GEMM-swizzled byte order (same shape)."""
    rows, cols = compact.shape
    source = compact.t() if columnwise else compact
    return _swizzle_rows_major(source.contiguous()).view(rows, cols)


def unswizzle_scales(swizzled: torch.Tensor, columnwise: bool) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`."""
    rows, cols = swizzled.shape
    flat = swizzled.reshape(-1)
    if columnwise:
        return _unswizzle_rows_major(flat, cols, rows).t().contiguous()
    return _unswizzle_rows_major(flat, rows, cols).contiguous()


# --------------------------------------------------------------------------------------------
# Quantise / dequantise
# --------------------------------------------------------------------------------------------


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


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
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
        lut = (e8m0, _table(False, _work_dtype(in_dtype), device)[e8m0.long()])
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
    return e8m0, quantize_multipliers(e8m0, _work_dtype(in_dtype))


def _scaled_cast(
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
    work = _work_dtype(x.dtype)
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
            _scaled_cast(
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
                _scaled_cast(
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


# --------------------------------------------------------------------------------------------
# Distributed-optimizer path: partial amax / all-reduce / scales / partial cast
# --------------------------------------------------------------------------------------------


def _segment(shard: torch.Tensor, rows: int, cols: int, start_offset: int) -> tuple[int, int, int]:
    """Block-row aligned row range ``[r0, r1)`` covering a flat shard, and its offset in it."""
    n = shard.numel()
    end = start_offset + n
    if start_offset < 0 or end > rows * cols:
        raise ValueError(f"shard [{start_offset}, {end}) does not fit a {rows} x {cols} tensor")
    r0 = (start_offset // cols) // BLOCK_SIZE * BLOCK_SIZE
    r1 = _round_up((end - 1) // cols + 1, BLOCK_SIZE)
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
    work = _work_dtype(shard.dtype)
    segment = torch.zeros((r1 - r0) * cols, dtype=work, device=shard.device)
    segment[offset : offset + n] = shard.to(work)
    special = not bool(torch.isfinite(shard).all())
    table = _table(False, work, shard.device)
    row_mult = table[scale_inv_rowwise[r0:r1, : cols // BLOCK_SIZE].long()].unsqueeze(-1)
    row_codes = _scaled_cast(
        segment.view(r1 - r0, cols // BLOCK_SIZE, BLOCK_SIZE),
        row_mult,
        fp8_dtype,
        saturate=True,
        canonicalize_nan=special,
    )
    col_mult = table[
        scale_inv_colwise[r0 // BLOCK_SIZE : r1 // BLOCK_SIZE, :cols].long()
    ].unsqueeze(1)
    col_codes = _scaled_cast(
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
