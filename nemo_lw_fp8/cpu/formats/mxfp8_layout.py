"""The MXFP8 format as TE 2.20 lays it out: block size, shapes, E8M0 scales, scale layouts.

Why a module of its own: these are the rules every MXFP8 byte follows, shared by the full
quantise (:mod:`nemo_lw_fp8.cpu.formats.mxfp8`), the distributed-optimizer cast
(:mod:`nemo_lw_fp8.cpu.formats.mxfp8_sharded_cast`), TE's classes on the CPU stand-in and the
tests that compare them. Nothing here touches element data.

What TE does (``quantize_mxfp8.cuh``, ``recipe/mxfp8_scaling.cu``, ``util/ptx.cuh``):

* ``e8m0 = float_to_e8m0(fp32(amax * fp32(1 / fp8_max)))``: the fp32 exponent bits, plus one when
  the mantissa is non-zero (round *up* to a power of two), NaN -> 0xFF, inf -> 0xFE, 0 -> 0x00,
  saturating at 0xFE, and never rounding up from the subnormal range below 2^-127.
  ``torch``'s own cast to ``float8_e8m0fnu`` rounds differently, so it is never used here.
* The multiplier applied before the FP8 cast is TE's ``exp2f_rcp`` bit trick
  ``e == 0 ? 1.0 : bits((254 - e) << 23)`` (so a zero exponent multiplies by 1, not 2^127,
  0xFE by +0.0 and 0xFF by -inf); dequantisation multiplies by ``bits(e << 23)``.
* Scales are stored as uint8, padded to ``(roundup(M, 128), roundup(K / 32, 4))`` rowwise and
  ``(roundup(M / 32, 4), roundup(K, 128))`` columnwise. TE leaves compact padding uninitialised;
  this emulation writes zeros there (as TE itself does for GEMM-swizzled scales).

The GEMM-swizzled scale layout (cuBLAS "block scaling factors layout", TE's
``gemm_swizzled_scale_idx``): the padded scale matrix is cut into tiles of 128 rows x 4 columns;
tiles are stored row-major (``num_tiles_x = padded_cols / 4`` per tile row) and, inside a tile,
element ``(r, c)`` goes to ``(r % 32) * 16 + (r // 32) * 4 + c``. Rowwise scales are indexed
``(row, block_col)``; columnwise scales are indexed transposed, ``(col, block_row)``, with
``num_tiles_x = roundup(M / 32, 4) / 4``. See :func:`gemm_swizzled_scale_index`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "BLOCK_SIZE",
    "FP8_DTYPES",
    "columnwise_scale_shape",
    "dequantize_multipliers",
    "e8m0_from_amax",
    "e8m0_round_up",
    "flat_2d_shape",
    "fp8_max",
    "gemm_swizzled_scale_index",
    "quantize_multipliers",
    "round_up",
    "rowwise_scale_shape",
    "swizzle_scales",
    "unswizzle_scales",
]

BLOCK_SIZE = 32
"""Elements per MXFP8 scaling block (and the side of a 2-D tile)."""

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

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


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple`` (non-negative integers)."""
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
    return round_up(rows, _ROWWISE_PAD[0]), round_up(cols // BLOCK_SIZE, _ROWWISE_PAD[1])


def columnwise_scale_shape(shape: Sequence[int]) -> tuple[int, int]:
    """Padded uint8 shape of columnwise (32x1) scales: ``(roundup(M/32,4), roundup(K,128))``."""
    rows, cols = flat_2d_shape(shape)
    return round_up(rows // BLOCK_SIZE, _COLWISE_PAD[0]), round_up(cols, _COLWISE_PAD[1])


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
