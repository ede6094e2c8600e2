"""Bit-exact CPU emulation of Transformer Engine 2.20's blockwise FP8 ("Float8BlockScaling").

Why: Hopper GPUs (H100/H200) have no MXFP8 but do have TE's blockwise FP8. A layer-wise owner
that quantises a whole weight can send its FP8 bytes plus one fp32 scale per 128x128 tile
instead of bf16. This module produces, on CPU, the bytes TE's CUDA kernels produce, so that CI
and the CPU multi-rank harness can test that path without a GPU. It holds the format (shapes,
scales, the element cast) and the full quantise / dequantise; the distributed-optimizer cast
of a flat shard is in :mod:`nemo_lw_fp8.cpu.formats.blockwise_sharded_cast`.

What TE 2.20 does (read from ``transpose/quantize_transpose_square_blockwise.cu`` (2-D),
``transpose/quantize_transpose_vector_blockwise.cu`` (1-D), ``recipe/recipe_common.cuh``,
``recipe/fp8_block_scaling.cu``, ``multi_tensor/compute_scale.cu`` and the Python classes
``Float8BlockQuantizer`` / ``Float8BlockwiseQTensorStorage``):

* The tensor is flattened to ``[M, K]`` (``K`` = last dim, ``M`` = product of the others).
* Blocks of 128: ``block_dim=2`` uses 128x128 tiles (the recipe's weights,
  ``w_block_scaling_dim=2``); ``block_dim=1`` uses 1x128 along ``K`` rowwise and 128x1 along
  ``M`` columnwise (the recipe's inputs and gradients, ``x_/grad_block_scaling_dim=1``).
  Shapes that are not multiples of 128 are accepted: edge blocks simply hold fewer elements.
* ``amax = max |x|`` over the block in fp32, NaN ignored (``fmaxf``).
* The scale (TE's ``compute_scale_from_amax``), in fp32::

      amax  = epsilon                  if amax < epsilon
      scale = 1                        if amax is inf, 0 or NaN
      scale = fp32(fp8_max / amax)     otherwise (round-to-nearest division)
      scale = value_for_inf            if that division overflowed to inf
      scale = bits(bits(scale) & 0xFF800000)   if force_pow_2_scales (the default):
                                               the mantissa is dropped, i.e. rounded DOWN
                                               to a power of two

  ``fp8_max`` is 448 (e4m3) or 57344 (e5m2); ``value_for_inf`` is the input type's largest
  finite value in the quantise kernels (bf16 ``0x1.FEp127``, fp16 65504, fp32 ``FLT_MAX``)
  and ``FLT_MAX`` in the distributed-optimizer kernel. With power-of-two scales this is
  ``scale = 2^floor(log2(fp8_max / amax))``, so ``amax * scale <= fp8_max``.
* ``scale_inv = fp32(1 / scale)`` is what is stored (fp32). The 2-D kernel divides in fp32, the
  1-D kernel in fp64 and rounds to fp32; both equal the correctly rounded fp32 reciprocal.
* Codes: ``fp8 = static_cast<fp8>(fp32(x) * scale)``, i.e. round-to-nearest-even with
  saturation to the largest finite value (``__NV_SATFINITE``; inf -> +-max), NaN -> 0x7F.
* Layouts: rowwise data ``[*shape]`` uint8; columnwise data TRANSPOSED, ``[K, *shape[:-1]]``.
  fp32 scale_inv tensors (``Float8BlockQuantizer.get_scale_shape``)::

      block_dim=2  rowwise    (ceil(M/128), roundup(ceil(K/128), 4))   [m_tile, k_tile]
                   columnwise (ceil(K/128), roundup(ceil(M/128), 4))   [k_tile, m_tile]
      block_dim=1  rowwise    (ceil(K/128), roundup(M, 4))             [k_block, row]
                   columnwise (ceil(M/128), roundup(K, 4))             [m_block, column]

  The padding TE leaves uninitialised (``at::empty``); this emulation writes zeros there.
* 2-D tiles use one scale for both directions, so the columnwise codes and scales are an exact
  transpose of the rowwise ones (TE's ``_create_columnwise`` relies on this):
  :func:`columnwise_from_rowwise`.
* Dequantisation (done by TE's Python in torch, not by a kernel):
  ``out = OType(fp32(code) * scale_inv)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nemo_lw_fp8.cpu.formats import mxfp8_layout as _mxf
from nemo_lw_fp8.cpu.formats.mxfp8 import scaled_cast
from nemo_lw_fp8.cpu.formats.mxfp8_layout import round_up

__all__ = [
    "BLOCK_LEN",
    "FLT_MAX",
    "FP8_DTYPES",
    "BlockwiseData",
    "columnwise_data_shape",
    "columnwise_from_rowwise",
    "columnwise_scale_shape",
    "compute_scale",
    "dequantize",
    "dequantize_codes",
    "flat_2d_shape",
    "fp8_max",
    "quantize",
    "rowwise_scale_shape",
    "saturating_cast",
    "scale_inv_from_scale",
    "valid_scale_shape",
    "value_for_inf",
    "wire_bytes",
]

BLOCK_LEN = 128
"""Elements per block side (TE's ``Float8BlockQuantizer.block_len``; fixed)."""

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

FLT_MAX = float.fromhex("0x1.fffffep127")
"""``FLT_MAX``: the scale substituted for an infinite ``fp8_max / amax`` in the
distributed-optimizer kernel (and for fp32 inputs in the quantise kernels)."""

_VALUE_FOR_INF = {
    torch.bfloat16: float.fromhex("0x1.FEp127"),
    torch.float16: float.fromhex("0x1.FFCp15"),
    torch.float32: FLT_MAX,
}

_POW2_MASK = -0x800000  # 0xFF800000 as a signed int32: sign and exponent bits kept


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of the FP8 format (448 or 57344); refuses other dtypes."""
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(
            f"blockwise FP8 elements must be torch.float8_e4m3fn or torch.float8_e5m2, "
            f"got {fp8_dtype}"
        )
    return _mxf.fp8_max(fp8_dtype)


def value_for_inf(input_dtype: torch.dtype) -> float:
    """``TypeInfo<IType>::max_finite_value``: the scale used when ``fp8_max / amax`` is inf."""
    try:
        return _VALUE_FOR_INF[input_dtype]
    except KeyError:
        raise ValueError(
            f"blockwise FP8 quantises bf16, fp16 or fp32 tensors, got {input_dtype}"
        ) from None


def ceil_div(a: int, b: int) -> int:
    """How many blocks of ``b`` cover ``a`` elements (edge blocks may be partial)."""
    return (a + b - 1) // b


def _check_block_dim(block_dim: int) -> int:
    if block_dim not in (1, 2):
        raise ValueError(
            f"block_dim must be 1 (1x128 blocks) or 2 (128x128 tiles), got {block_dim}"
        )
    return block_dim


def flat_2d_shape(shape: Sequence[int]) -> tuple[int, int]:
    """``(M, K)`` as TE flattens a shape: ``K`` the last dim (1 for 0-d), ``M`` the rest."""
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"invalid shape {shape}")
    cols = shape[-1] if shape else 1
    return math.prod(shape[:-1]), cols


def columnwise_data_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of the (transposed) columnwise data: ``(shape[-1], *shape[:-1])``."""
    shape = tuple(int(s) for s in shape)
    return (shape[-1], *shape[:-1]) if shape else ()


def rowwise_scale_shape(shape: Sequence[int], block_dim: int = 2) -> tuple[int, int]:
    """Padded fp32 shape of rowwise scale_inv (``get_scale_shape(shape, columnwise=False)``)."""
    rows, cols = flat_2d_shape(shape)
    if _check_block_dim(block_dim) == 2:
        return ceil_div(rows, BLOCK_LEN), round_up(ceil_div(cols, BLOCK_LEN), 4)
    return ceil_div(cols, BLOCK_LEN), round_up(rows, 4)


def columnwise_scale_shape(shape: Sequence[int], block_dim: int = 2) -> tuple[int, int]:
    """Padded fp32 shape of columnwise scale_inv (``get_scale_shape(shape, columnwise=True)``)."""
    rows, cols = flat_2d_shape(shape)
    if _check_block_dim(block_dim) == 2:
        return ceil_div(cols, BLOCK_LEN), round_up(ceil_div(rows, BLOCK_LEN), 4)
    return ceil_div(rows, BLOCK_LEN), round_up(cols, 4)


def valid_scale_shape(
    shape: Sequence[int], block_dim: int = 2, columnwise: bool = False
) -> tuple[int, int]:
    """The region of a scale_inv tensor that holds scales (the rest is round-up padding)."""
    rows, cols = flat_2d_shape(shape)
    m_tiles, k_tiles = ceil_div(rows, BLOCK_LEN), ceil_div(cols, BLOCK_LEN)
    if _check_block_dim(block_dim) == 2:
        return (k_tiles, m_tiles) if columnwise else (m_tiles, k_tiles)
    return (m_tiles, cols) if columnwise else (k_tiles, rows)


def wire_bytes(shape: Sequence[int], block_dim: int = 2, padded: bool = True) -> int:
    """Bytes of one direction of a blockwise tensor: FP8 codes plus fp32 scales.

    ``padded`` counts TE's scale buffer with its round-up-to-4 padding; otherwise only the
    scales that carry information (one per block).
    """
    rows, cols = flat_2d_shape(shape)
    if padded:
        scales = math.prod(rowwise_scale_shape(shape, block_dim))
    elif block_dim == 2:
        scales = ceil_div(rows, BLOCK_LEN) * ceil_div(cols, BLOCK_LEN)
    else:
        scales = rows * ceil_div(cols, BLOCK_LEN)
    return rows * cols + 4 * scales


# --------------------------------------------------------------------------------------------
# Scales and the element cast
# --------------------------------------------------------------------------------------------


def compute_scale(
    amax: torch.Tensor,
    fp8_dtype_or_max: torch.dtype | float = torch.float8_e4m3fn,
    force_pow_2_scales: bool = True,
    amax_epsilon: float = 0.0,
    inf_value: float = FLT_MAX,
) -> torch.Tensor:
    """TE's ``compute_scale_from_amax`` on a tensor of block amaxes (fp32 result).

    ``fp8_dtype_or_max`` is an FP8 dtype or the ``max_fp8`` float the distributed path passes;
    ``inf_value`` replaces a scale that overflowed (see :func:`value_for_inf`).
    """
    if isinstance(fp8_dtype_or_max, torch.dtype):
        limit = fp8_max(fp8_dtype_or_max)
    else:
        limit = float(fp8_dtype_or_max)
    amax = amax.detach().to(torch.float32)
    eps = torch.tensor(amax_epsilon, dtype=torch.float32, device=amax.device)
    amax = torch.where(amax < eps, eps, amax)  # NaN compares false and stays NaN
    special = torch.isinf(amax) | (amax == 0) | torch.isnan(amax)
    numerator = torch.tensor(limit, dtype=torch.float32, device=amax.device)
    scale = numerator / torch.where(special, 1.0, amax)
    scale = torch.where(
        torch.isinf(scale), torch.tensor(inf_value, dtype=torch.float32, device=amax.device), scale
    )
    if force_pow_2_scales:
        scale = (scale.view(torch.int32) & _POW2_MASK).view(torch.float32)
    return torch.where(special, 1.0, scale)


def scale_inv_from_scale(scale: torch.Tensor) -> torch.Tensor:
    """``fp32(1 / scale)``, correctly rounded (TE: ``1.0f / scale``, ``1.0 / scale`` in the
    1-D kernel, ``__frcp_rn`` in the distributed path -- all the same value)."""
    return torch.reciprocal(scale.to(torch.float64)).to(torch.float32)


def saturating_cast(values: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """uint8 codes of ``static_cast<fp8>(values)``: RNE, saturating, NaN -> 0x7F.

    Reuses the MXFP8 module's cast (:func:`~.mxfp8.scaled_cast` with multiplier 1), which clamps to
    the largest finite value before torch's round-nearest-even FP8 conversion.
    """
    fp8_max(fp8_dtype)
    one = torch.ones((), dtype=values.dtype, device=values.device)
    return scaled_cast(values, one, fp8_dtype, saturate=True, canonicalize_nan=True)


def abs_ignoring_nan(x: torch.Tensor) -> torch.Tensor:
    """``|x|`` with NaN as 0, so a block's amax ignores NaN as TE's ``fmaxf`` does."""
    mag = x.abs()
    return torch.where(torch.isnan(mag), 0.0, mag)


def pad2d(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D tensor at the bottom/right to ``(rows, cols)`` (no copy if not needed)."""
    r, c = x.shape
    if (r, c) == (rows, cols):
        return x
    out = torch.zeros((rows, cols), dtype=x.dtype, device=x.device)
    out[:r, :c] = x
    return out


# --------------------------------------------------------------------------------------------
# Quantise / dequantise
# --------------------------------------------------------------------------------------------


@dataclass
class BlockwiseData:
    """Raw buffers of a blockwise FP8 tensor in TE's layout.

    ``rowwise_data``: uint8 codes in ``shape``; ``columnwise_data``: uint8 codes in
    :func:`columnwise_data_shape` (transposed); scale_inv tensors: padded fp32.
    """

    shape: tuple[int, ...]
    fp8_dtype: torch.dtype
    block_dim: int
    rowwise_data: torch.Tensor | None
    rowwise_scale_inv: torch.Tensor | None
    columnwise_data: torch.Tensor | None
    columnwise_scale_inv: torch.Tensor | None


def _check_input(x: torch.Tensor) -> None:
    if x.dtype not in _VALUE_FOR_INF:
        raise ValueError(f"blockwise FP8 quantises bf16, fp16 or fp32 tensors, got {x.dtype}")


def quantize(
    x: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    block_dim: int = 2,
    rowwise: bool = True,
    columnwise: bool = True,
    force_pow_2_scales: bool = True,
    amax_epsilon: float = 0.0,
) -> BlockwiseData:
    """Quantise ``x`` (bf16, fp16 or fp32) exactly as TE 2.20's blockwise kernels.

    ``block_dim=2``: 128x128 tiles (weights); ``block_dim=1``: 1x128 rowwise and 128x1
    columnwise blocks (activations, gradients). Any shape is accepted, as in TE.
    """
    fp8_max(fp8_dtype)
    _check_block_dim(block_dim)
    _check_input(x)
    shape = tuple(x.shape)
    rows, cols = flat_2d_shape(shape)
    device = x.device
    result = BlockwiseData(shape, fp8_dtype, block_dim, None, None, None, None)
    if rowwise:
        result.rowwise_scale_inv = torch.zeros(
            rowwise_scale_shape(shape, block_dim), dtype=torch.float32, device=device
        )
    if columnwise:
        result.columnwise_scale_inv = torch.zeros(
            columnwise_scale_shape(shape, block_dim), dtype=torch.float32, device=device
        )
    if x.numel() == 0:
        if rowwise:
            result.rowwise_data = torch.zeros(shape, dtype=torch.uint8, device=device)
        if columnwise:
            result.columnwise_data = torch.zeros(
                columnwise_data_shape(shape), dtype=torch.uint8, device=device
            )
        return result
    if not (rowwise or columnwise):
        return result

    x32 = x.detach().reshape(rows, cols).to(torch.float32)
    inf_value = value_for_inf(x.dtype)
    m_tiles, k_tiles = ceil_div(rows, BLOCK_LEN), ceil_div(cols, BLOCK_LEN)
    rows_p, cols_p = m_tiles * BLOCK_LEN, k_tiles * BLOCK_LEN

    def scales(amax: torch.Tensor) -> torch.Tensor:
        return compute_scale(amax, fp8_dtype, force_pow_2_scales, amax_epsilon, inf_value)

    if block_dim == 2:
        xp = pad2d(x32, rows_p, cols_p)
        tiles = xp.view(m_tiles, BLOCK_LEN, k_tiles, BLOCK_LEN)
        amax = abs_ignoring_nan(tiles).amax(dim=(1, 3))
        scale = scales(amax)
        scale_inv = scale_inv_from_scale(scale)
        codes = saturating_cast(tiles * scale[:, None, :, None], fp8_dtype)
        codes = codes.view(rows_p, cols_p)[:rows, :cols]
        if rowwise:
            result.rowwise_data = codes.contiguous().view(shape)
            result.rowwise_scale_inv[:, :k_tiles] = scale_inv
        if columnwise:
            result.columnwise_data = codes.t().contiguous().view(columnwise_data_shape(shape))
            result.columnwise_scale_inv[:, :m_tiles] = scale_inv.t()
        return result

    if rowwise:
        xr = pad2d(x32, rows, cols_p).view(rows, k_tiles, BLOCK_LEN)
        scale = scales(abs_ignoring_nan(xr).amax(dim=-1))  # [rows, k_tiles]
        codes = saturating_cast(xr * scale[:, :, None], fp8_dtype).view(rows, cols_p)
        result.rowwise_data = codes[:, :cols].contiguous().view(shape)
        result.rowwise_scale_inv[:, :rows] = scale_inv_from_scale(scale).t()
    if columnwise:
        xc = pad2d(x32, rows_p, cols).view(m_tiles, BLOCK_LEN, cols)
        scale = scales(abs_ignoring_nan(xc).amax(dim=1))  # [m_tiles, cols]
        codes = saturating_cast(xc * scale[:, None, :], fp8_dtype).view(rows_p, cols)
        result.columnwise_data = codes[:rows].t().contiguous().view(columnwise_data_shape(shape))
        result.columnwise_scale_inv[:, :cols] = scale_inv_from_scale(scale)
    return result


def columnwise_from_rowwise(
    rowwise_data: torch.Tensor, rowwise_scale_inv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Columnwise codes and scale_inv of a 2-D (128x128) tensor from its rowwise form.

    With 128x128 tiles both directions share each tile's scale, so the columnwise form is the
    exact transpose: codes ``[M, K] -> [K, M]`` (in ``columnwise_data_shape``) and scales
    ``[m_tile, k_tile] -> [k_tile, m_tile]`` (padding zero). This is what TE's
    ``_create_columnwise`` does after an all-gather of the rowwise bytes (``tex.fp8_transpose``
    plus a transposed copy of the scales). 1x128 blocks have different scales per direction,
    so there the columnwise form cannot be derived.
    """
    shape = tuple(rowwise_data.shape)
    rows, cols = flat_2d_shape(shape)
    m_tiles, k_tiles = ceil_div(rows, BLOCK_LEN), ceil_div(cols, BLOCK_LEN)
    expected = rowwise_scale_shape(shape, 2)
    if rowwise_scale_inv.dim() != 2 or rowwise_scale_inv.shape[0] != expected[0]:
        raise ValueError(
            f"rowwise_scale_inv of shape {tuple(rowwise_scale_inv.shape)} is not the 128x128 "
            f"scale tensor of data shaped {shape} (expected {expected})"
        )
    codes = rowwise_data.reshape(rows, cols).t().contiguous().view(columnwise_data_shape(shape))
    scale_inv = torch.zeros(
        columnwise_scale_shape(shape, 2), dtype=rowwise_scale_inv.dtype, device=codes.device
    )
    scale_inv[:, :m_tiles] = rowwise_scale_inv[:, :k_tiles].t()
    return codes, scale_inv


def dequantize_codes(
    codes: torch.Tensor,
    scale_inv: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    block_dim: int,
    columnwise: bool,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """One direction's codes back to ``dtype`` in the logical (rowwise) shape.

    ``OType(fp32(code) * scale_inv)`` as TE's ``_FromFloat8BlockwiseFunc`` /
    ``_dequantize_vectorwise``; columnwise codes are given in their transposed layout.
    """
    fp8_max(fp8_dtype)
    _check_block_dim(block_dim)
    stored = tuple(codes.shape)
    logical = stored[1:] + stored[:1] if columnwise else stored  # back to [*leading, K]
    # The stored codes as a 2-D [A, B] matrix (B blocked for 1-D scales).
    if columnwise:
        a, b = (stored[0] if stored else 1), math.prod(stored[1:])
    else:
        a, b = flat_2d_shape(stored)
    if codes.numel() == 0:
        return torch.empty(logical, dtype=dtype, device=codes.device)
    values = codes.contiguous().view(torch.uint8).view(fp8_dtype).reshape(a, b)
    a_tiles, b_tiles = ceil_div(a, BLOCK_LEN), ceil_div(b, BLOCK_LEN)
    if block_dim == 2:
        tiles = pad2d(values.to(torch.float32), a_tiles * BLOCK_LEN, b_tiles * BLOCK_LEN)
        tiles = tiles.view(a_tiles, BLOCK_LEN, b_tiles, BLOCK_LEN)
        scale = scale_inv[:a_tiles, :b_tiles].to(torch.float32)
        out = (tiles * scale[:, None, :, None]).view(a_tiles * BLOCK_LEN, b_tiles * BLOCK_LEN)
    else:
        blocks = pad2d(values.to(torch.float32), a, b_tiles * BLOCK_LEN).view(a, b_tiles, BLOCK_LEN)
        scale = scale_inv[:b_tiles, :a].to(torch.float32).t()
        out = (blocks * scale[:, :, None]).view(a, b_tiles * BLOCK_LEN)
    out = out[:a, :b].to(dtype)
    if columnwise:
        out = out.t()
    return out.contiguous().view(logical)


def dequantize(
    data: BlockwiseData, dtype: torch.dtype = torch.bfloat16, *, use: str | None = None
) -> torch.Tensor:
    """Dequantise, from rowwise data when present (as TE) unless ``use`` names a direction."""
    if use is None:
        use = "rowwise" if data.rowwise_data is not None else "columnwise"
    if use not in ("rowwise", "columnwise"):
        raise ValueError(f"use must be 'rowwise', 'columnwise' or None, got {use!r}")
    codes = getattr(data, f"{use}_data")
    scales = getattr(data, f"{use}_scale_inv")
    if codes is None or scales is None:
        raise ValueError(f"blockwise data has no {use} buffers to dequantise")
    return dequantize_codes(
        codes,
        scales,
        data.fp8_dtype,
        block_dim=data.block_dim,
        columnwise=use == "columnwise",
        dtype=dtype,
    )
