"""NVFP4 (E2M1 data, E4M3 block scales, FP32 tensor amax) in plain torch, per TE 2.20.2's source.

Why this exists: TE's NVFP4 cast runs only as CUDA kernels; on CPU the ``transformer_engine_torch``
stand-in (:mod:`.cast_nvfp4`) needs the same bytes from plain torch. Each rule below names
the TE 2.20.2 source it reproduces (paths under ``transformer_engine/common/``):

* tensor amax (``recipe/current_scaling.cu``, ``amax_kernel``): max of ``|x|`` with ``fmaxf`` /
  ``__hmax``, which skip NaN; ``NVFP4Quantizer::quantize_impl`` (``pytorch/csrc/quantizer.cpp``)
  writes the same value to the rowwise and the columnwise amax;
* global encode scale (``cast/nvfp4/core_nvfp4.cuh``,
  ``compute_global_encode_scaling_factor_FP4``): ``S_enc = fp32(448 * 6 / amax)``, capped at
  FLT_MAX, and 1 when the amax is 0 or the quotient is 0 (an infinite amax);
  ``S_dec = fp32(1.0 / S_enc)`` (a double division in ``quantize_transpose_nvfp4.cuh``, fp32 in
  the tuned 1D kernel: the same value, as double rounding of a quotient is innocuous);
* block decode scale (``compute_decoding_scaling_factor``): the E4M3 (round to nearest even,
  saturating at 448) of ``fp32(block_amax * fp32(S_enc * fp32(1/6)))``, capped at FLT_MAX first;
  a block is 16 consecutive elements of a row (1D) or a 16x16 tile (2D, ``with_2d_quantization``);
* block encode scale: ``fminf(fp32(1 / fp32(e4m3 * S_dec)), FLT_MAX)`` (so an all-zero block
  gets FLT_MAX, and its zeros stay zeros);
* element (``util/ptx_arch_spec.cuh``, ``mul_cvt_*_to_fp4_*x_with_rn`` and the tuned kernel's
  ``mul_cvt_bf16_to_fp4_8x_round_to_nearest``): ``fp32(x) * encode_scale`` in fp32, then
  ``cvt.rn.satfinite.e2m1x2.f32``: round to nearest even on the E2M1 grid
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}, magnitudes above 6 (and infinities) saturate to 6 with their
  sign, NaN becomes +6 (``cuda_fp4.hpp``: "NaN converts to positive FP4_MAXNORM"), the sign of
  zero is kept;
* packing: two codes per byte, the element with the even index in the low nibble (the ``{v1, v0}``
  reordering before ``cvt ... e2m1x2``, whose first operand lands in the high nibble);
* columnwise data: the same cast of the transposed 2-D view ``(K, M)``, its own 16-element blocks
  along ``M`` (1D) or the same 16x16 tiles (2D); scales are ``(round_up(rows, 128),
  round_up(cols / 16, 4))`` uint8, zero in the padding (TE leaves it uninitialised);
* dequantize (``cast/nvfp4/dequantize_nvfp4.cuh``): ``e2m1 * fp32(fp32(e4m3 * amax) *
  fp32(1 / (6 * 448)))``, then a round-to-nearest cast to the output dtype;
* GEMM-swizzled scales (``cast/nvfp4/swizzle.cuh``, ``gemm_swizzled_scale_idx``, written by the
  2D kernel when ``optimize_for_gemm`` asks for them): each usage's compact ``(R, C/16)`` matrix
  cut into 128x4 tiles stored row-major, rows interleaved in four groups of 32 inside a tile
  (cuBLAS's layout, the same as MXFP8's rowwise one);
* the NVFP4 GEMM (``common/gemm/cublaslt_gemm.cu``): the tensor cores multiply ``e2m1 * e4m3``
  products; the two tensors' global scales enter through cuBLAS's alpha,
  ``compute_nvfp4_per_tensor_scale_kernel`` (``recipe/nvfp4.cu``):
  ``fp32(fp32(fp32(alpha * amax_A) * amax_B) * fp32(1 / (36 * 448 * 448)))``.

The random Hadamard transform (``with_rht``, :func:`hadamard_transform`; TE applies it to the
columnwise copy only, ``NVFP4Quantizer::quantize_impl``):

* the matrix (``hadamard_transform/hadamard_transform_utils.cuh``,
  ``get_hadamard_matrix_fragment``; ``tensor/nvfp4_tensor.py``, ``get_rht_matrix``):
  ``M[k, n] = s_k * (-1)^popcount(k & n) / 4``, the Sylvester Hadamard matrix of order 16
  normalised by ``1/sqrt(16)``, its row ``k`` (the input element's index in its group) negated
  where bit ``k`` of the quantizer's ``rht_matrix_random_sign_mask_t`` is set; every entry is
  +-0.25, exact in bf16;
* where: each group of 16 consecutive elements of a row of ``x^T`` (16 consecutive rows of
  ``x``, one column), ``y = v @ M``; the result is stored as bf16 (``cvt.rn.bf16x2.f32`` of the
  MMA's fp32 accumulator in ``hadamard_transform.cu``; the fused ``row_cast_col_hadamard_
  transform_cast_fusion.cu`` rounds its accumulator to bf16 and back "for bit-wise
  compatibility with unfused kernels" unless ``NVTE_USE_FAST_MATH``);
* accumulation: each product ``x * (+-0.25)`` has 8 significant bits and is exact; the
  emulation sums the 16 of a group in float64 (exact unless they span more than 41 binades),
  rounds to fp32, then to bf16. When the 16 terms span at most 12 binades every partial sum
  fits fp32's 24 bits, so any summation order or alignment gives the exact sum and this is the
  GPU's result; beyond that the tensor cores' internal alignment and truncation (not
  documented) decide the fp32 accumulator, and this is a documented deterministic computation
  there, not a claim about the hardware;
* amaxes (``nvte_hadamard_transform_amax``, ``with_post_rht_amax``): the rowwise one is
  ``max |x|`` (the pre-RHT amax), the columnwise one ``max |y|`` over the bf16 outputs; each
  copy's global scale comes from its own amax;
* casts: the rowwise copy is the plain cast of ``x``; the columnwise copy is the plain 1x16
  cast of the bf16 ``y`` as a ``(K, M)`` matrix (the unfused path's ``nvte_quantize_v2`` on the
  transposed RHT output, and the fused kernel's epilogue, whose steps are the same operations);
  bf16 input only (TE's check).

Not emulated, refused by name where TE's quantizer asks for them: stochastic rounding, row-scaled
NVFP4, the 4over6 block selection, RHT with 16x16 blocks or non-finite input (see
:mod:`.cast_nvfp4`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 16
"""Elements per NVFP4 scaling block (``NVFP4_BLOCK_SCALING_SIZE``)."""
HADAMARD_DIM = 16
"""Order of TE's random Hadamard transform (``kHadamardDimension``)."""
HADAMARD_SCALE = 0.25
"""``1 / sqrt(16)`` (``k16x16HadamardScale``)."""
FP4_MAX = 6.0
E4M3_MAX = 448.0
FLT_MAX = torch.finfo(torch.float32).max

#: Magnitudes of the eight E2M1 codes 0..7 (code | 8 is the negative value).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

#: Round-to-nearest-even decision points between consecutive E2M1 magnitudes. At a point marked
#: True the tie goes up (the upper code is even), at False it stays down (the lower is even).
_THRESHOLDS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)

__all__ = [
    "BLOCK",
    "NVFP4Data",
    "block_scales",
    "decode_block_scaled",
    "decode_e2m1",
    "dequantize",
    "dequantize_codes",
    "encode_e2m1",
    "gemm_alpha",
    "global_encode_scale",
    "hadamard_transform",
    "pack_fp4",
    "quantize",
    "rht_matrix",
    "scale_shape",
    "swizzle_scales",
    "tensor_amax",
    "transpose_packed",
    "unpack_fp4",
    "unswizzle_scales",
]


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of fp32 values: ``cvt.rn.satfinite.e2m1x2.f32`` per element."""
    x = x.float()
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8)
    for point, tie_up in _THRESHOLDS:
        step = (mag >= point) if tie_up else (mag > point)
        code += step.to(torch.uint8)
    negative = torch.signbit(x)
    nan = torch.isnan(x)
    code = torch.where(nan, torch.full_like(code, 7), code)
    sign = (negative & ~nan).to(torch.uint8) << 3
    return code | sign


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes (exact: every E2M1 value is an fp32)."""
    table = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32)
    return table[codes.long() & 0xF]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dimension, the even index in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd last dimension {codes.shape[-1]} into FP4 bytes")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """The codes of :func:`pack_fp4`'s bytes, last dimension doubled."""
    packed = packed.view(torch.uint8)
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def transpose_packed(packed: torch.Tensor) -> torch.Tensor:
    """``(M, K/2)`` FP4 bytes to the ``(K, M/2)`` bytes of the transpose (``tex.nvfp4_data_
    transpose``: nibbles regrouped, not bytes moved)."""
    codes = unpack_fp4(packed.reshape(-1, packed.shape[-1]))
    return pack_fp4(codes.t().contiguous())


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``max |x|`` skipping NaN (``amax_kernel``'s ``fmaxf`` / ``__hmax``), shape (1,)."""
    mag = x.detach().float().abs().reshape(-1)
    mag = torch.where(torch.isnan(mag), torch.zeros_like(mag), mag)
    if mag.numel() == 0:
        return torch.zeros(1, dtype=torch.float32)
    return mag.max().reshape(1)


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """``compute_global_encode_scaling_factor_FP4``: fp32 ``2688 / amax``, capped, 1 when the
    amax is 0 or infinite."""
    amax = amax.float().reshape(())
    scale = torch.minimum(_f32(E4M3_MAX * FP4_MAX) / amax, _f32(FLT_MAX))
    if bool(amax == 0) or bool(scale == 0):
        return _f32(1.0)
    return scale


def _e4m3_bits(value: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even E4M3 (torch's cast would give NaN above 464)."""
    clamped = torch.clamp(value, max=E4M3_MAX)
    return clamped.to(torch.float8_e4m3fn).view(torch.uint8)


def _e4m3_values(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float8_e4m3fn).float()


def _cast_rows(rows: torch.Tensor, block_amax: torch.Tensor, s_enc: torch.Tensor):
    """Codes and E4M3 scale bits of ``rows`` (R, C) with one amax per (row, 16-block)."""
    fp4_max_inv = _f32(1.0 / FP4_MAX)
    s_dec = torch.tensor(1.0 / float(s_enc), dtype=torch.float64).float()
    multiplier = s_enc * fp4_max_inv
    decode = torch.minimum(block_amax * multiplier, _f32(FLT_MAX))
    bits = _e4m3_bits(decode)
    encode = torch.minimum(_f32(1.0) / (_e4m3_values(bits) * s_dec), _f32(FLT_MAX))
    expanded = encode.repeat_interleave(BLOCK, dim=1)
    codes = encode_e2m1(rows * expanded)
    return codes, bits


def _block_amax_1d(x2: torch.Tensor) -> torch.Tensor:
    rows, cols = x2.shape
    mag = x2.abs().reshape(rows, cols // BLOCK, BLOCK)
    mag = torch.where(torch.isnan(mag), torch.zeros_like(mag), mag)
    return mag.amax(dim=-1)


def _tile_amax_2d(x2: torch.Tensor) -> torch.Tensor:
    rows, cols = x2.shape
    mag = x2.abs().reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    mag = torch.where(torch.isnan(mag), torch.zeros_like(mag), mag)
    return mag.amax(dim=(1, 3))


def scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """``NVFP4Quantizer.get_scale_shape``: ``(round_up(rows, 128), round_up(cols / 16, 4))``."""
    blocks = -(-cols // BLOCK)
    return (-(-rows // 128) * 128, -(-blocks // 4) * 4)


def _padded(bits: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(scale_shape(bits.shape[0], bits.shape[1] * BLOCK), dtype=torch.uint8)
    out[: bits.shape[0], : bits.shape[1]] = bits
    return out


@dataclass
class NVFP4Data:
    """The buffers of an NVFP4 tensor, as TE's ``NVFP4TensorStorage`` holds them."""

    shape: tuple[int, ...]
    rowwise_data: torch.Tensor | None
    rowwise_scale_inv: torch.Tensor | None
    columnwise_data: torch.Tensor | None
    columnwise_scale_inv: torch.Tensor | None
    amax_rowwise: torch.Tensor | None
    amax_columnwise: torch.Tensor | None


def flat_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """``get_2d_dims`` with ``NVFP4Quantizer::create_tensor``'s checks: both multiples of 16."""
    if len(shape) == 0:
        raise ValueError("NVFP4 needs a tensor of at least one dimension")
    cols = int(shape[-1])
    rows = 1
    for dim in shape[:-1]:
        rows *= int(dim)
    if rows % BLOCK:
        raise ValueError(f"First dim for NVFP4 must be divisible by {BLOCK} (got shape={shape})")
    if cols % BLOCK:
        raise ValueError(
            f"NVFP4 requires tensor dims that are divisible by {BLOCK} (got shape={shape})"
        )
    return rows, cols


def rht_matrix(sign_mask: int) -> torch.Tensor:
    """fp32 ``(16, 16)`` matrix of TE's RHT: ``M[k, n] = s_k * (-1)^popcount(k & n) * 0.25``,
    ``s_k = -1`` where bit ``k`` of ``sign_mask`` is set (``get_hadamard_matrix_fragment``)."""
    idx = torch.arange(HADAMARD_DIM)
    both = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(both)
    for bit in range(4):
        parity ^= (both >> bit) & 1
    flip = ((int(sign_mask) >> idx) & 1)[:, None]
    negative = (parity ^ flip).bool()
    scale = torch.full((HADAMARD_DIM, HADAMARD_DIM), HADAMARD_SCALE, dtype=torch.float32)
    return torch.where(negative, -scale, scale)


def hadamard_transform(x2: torch.Tensor, sign_mask: int) -> torch.Tensor:
    """The bf16 RHT of each group of 16 consecutive elements along the last dimension of a bf16
    ``(R, C)`` matrix: ``v @ rht_matrix(sign_mask)``, summed in float64 (exact for the 16 exact
    products unless they span more than 41 binades), rounded to fp32, then to bf16 (the
    accumulator's ``cvt.rn.bf16x2.f32``). See the module docstring for what is TE's here."""
    if x2.dtype != torch.bfloat16:
        raise ValueError(f"RHT is only supported for bfloat16 input, got {x2.dtype}")
    rows, cols = x2.shape
    if cols % HADAMARD_DIM or rows % HADAMARD_DIM:
        raise ValueError("row_length and num_rows must be divisible by hadamard_dimension")
    groups = x2.reshape(-1, HADAMARD_DIM).double()
    out = groups @ rht_matrix(sign_mask).double()
    return out.float().bfloat16().reshape(rows, cols)


def quantize(
    x: torch.Tensor,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    two_d: bool = False,
    amax: torch.Tensor | None = None,
    rht_sign_mask: int | None = None,
) -> NVFP4Data:
    """TE's NVFP4 cast of ``x`` (any float dtype, flattened to 2-D): data, scales and amaxes.

    ``amax`` overrides the tensor amax (what an amax reduction across ranks would produce).
    ``rht_sign_mask`` (an int, 0 for no sign flips) casts the columnwise copy from the random
    Hadamard transform of ``x^T`` with its own post-RHT amax (bf16 ``x`` and 1x16 blocks only)."""
    shape = tuple(int(d) for d in x.shape)
    rows, cols = flat_2d(shape)
    if rht_sign_mask is not None:
        return _quantize_rht(x, shape, rows, cols, rowwise, columnwise, two_d, amax, rht_sign_mask)
    x2 = x.detach().reshape(rows, cols).float()
    global_amax = tensor_amax(x2) if amax is None else amax.detach().float().reshape(1).clone()
    s_enc = global_encode_scale(global_amax)
    row_data = row_scale = col_data = col_scale = None
    if two_d:
        tiles = _tile_amax_2d(x2)
        row_amax = tiles.repeat_interleave(BLOCK, dim=0)
        col_amax = tiles.t().repeat_interleave(BLOCK, dim=0)
    else:
        row_amax = _block_amax_1d(x2) if rowwise else None
        col_amax = _block_amax_1d(x2.t().contiguous()) if columnwise else None
    if rowwise:
        codes, bits = _cast_rows(x2, row_amax, s_enc)
        row_data = pack_fp4(codes).reshape(*shape[:-1], cols // 2)
        row_scale = _padded(bits)
    if columnwise:
        codes, bits = _cast_rows(x2.t().contiguous(), col_amax, s_enc)
        col_data = pack_fp4(codes)
        col_scale = _padded(bits)
    return NVFP4Data(
        shape,
        row_data,
        row_scale,
        col_data,
        col_scale,
        global_amax.clone() if rowwise else None,
        global_amax.clone() if columnwise else None,
    )


def _quantize_rht(x, shape, rows, cols, rowwise, columnwise, two_d, amax, sign_mask):
    """``quantize`` with the RHT: rowwise the plain cast of ``x`` (pre-RHT amax), columnwise the
    plain cast of the bf16 RHT of ``x^T`` (its own amax)."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"RHT is only supported for bfloat16 input, got {x.dtype}")
    if two_d or amax is not None:
        raise ValueError("the RHT cast takes 1x16 blocks and its own amaxes")
    x2 = x.detach().reshape(rows, cols)
    out = NVFP4Data(shape, None, None, None, None, None, None)
    if rowwise:
        plain = quantize(x, rowwise=True, columnwise=False)
        out.rowwise_data, out.rowwise_scale_inv = plain.rowwise_data, plain.rowwise_scale_inv
        out.amax_rowwise = plain.amax_rowwise
    if columnwise:
        y = hadamard_transform(x2.t().contiguous(), sign_mask)
        cast = quantize(y, rowwise=True, columnwise=False)
        out.columnwise_data, out.columnwise_scale_inv = cast.rowwise_data, cast.rowwise_scale_inv
        out.amax_columnwise = cast.amax_rowwise
    return out


def swizzle_scales(compact: torch.Tensor) -> torch.Tensor:
    """A usage's padded compact scales ``(R, C/16)`` in the GEMM-swizzled byte order (same shape).

    ``gemm_swizzled_scale_idx`` (``cast/nvfp4/swizzle.cuh``) indexes both usages by (row of the
    usage's data, block column), i.e. the compact matrix as stored, so this is the MXFP8 helper's
    rowwise case (128x4 tiles, rows interleaved in four groups of 32)."""
    from nemo_lw_fp8.cpu.formats.mxfp8_layout import swizzle_scales as _swizzle

    return _swizzle(compact.view(torch.uint8), False)


def unswizzle_scales(swizzled: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`."""
    from nemo_lw_fp8.cpu.formats.mxfp8_layout import unswizzle_scales as _unswizzle

    return _unswizzle(swizzled.view(torch.uint8), False)


def block_scales(
    scale_inv: torch.Tensor, rows: int, cols: int, swizzled: bool = False
) -> torch.Tensor:
    """fp32 values of the E4M3 block scales of a ``(rows, cols)`` usage, ``(rows, cols / 16)``."""
    scale_inv = scale_inv.view(torch.uint8)
    if swizzled:
        scale_inv = unswizzle_scales(scale_inv)
    return _e4m3_values(scale_inv[:rows, : cols // BLOCK].contiguous())


def decode_block_scaled(
    packed: torch.Tensor, scale_inv: torch.Tensor, swizzled: bool = False
) -> torch.Tensor:
    """``e2m1 * e4m3`` (exact in fp32) of one usage's (R, C/2) bytes: what the tensor cores
    multiply, the tensor's global scale left out (the GEMM applies it through alpha)."""
    packed2 = packed.view(torch.uint8).reshape(-1, packed.shape[-1])
    rows, cols = packed2.shape[0], packed2.shape[1] * 2
    values = decode_e2m1(unpack_fp4(packed2))
    scales = block_scales(scale_inv, rows, cols, swizzled)
    return values * scales.repeat_interleave(BLOCK, dim=1)


def gemm_alpha(alpha: float, amax_a: torch.Tensor, amax_b: torch.Tensor) -> torch.Tensor:
    """``compute_nvfp4_per_tensor_scale_kernel`` (``recipe/nvfp4.cu``): the fp32 alpha cuBLAS
    gets for an NVFP4 GEMM, ``((alpha * amax_A) * amax_B) * fp32(1 / (6 * 6 * 448 * 448))``."""
    factor_inv = _f32(1.0 / (FP4_MAX * FP4_MAX * E4M3_MAX * E4M3_MAX))
    value = _f32(alpha) * amax_a.float().reshape(()) * amax_b.float().reshape(())
    return value * factor_inv


def dequantize_codes(
    packed: torch.Tensor,
    scale_inv: torch.Tensor,
    amax: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    swizzled: bool = False,
) -> torch.Tensor:
    """``dequantize_fp4_kernel`` on one usage's (R, C/2) bytes: (R, C) values. ``swizzled``
    reads GEMM-swizzled scales (un-swizzled first; TE's kernel only reads compact ones)."""
    packed2 = packed.view(torch.uint8).reshape(-1, packed.shape[-1])
    rows, cols = packed2.shape[0], packed2.shape[1] * 2
    values = decode_e2m1(unpack_fp4(packed2))
    scales = block_scales(scale_inv, rows, cols, swizzled)
    factor_inv = _f32(1.0 / (FP4_MAX * E4M3_MAX))
    final = (scales * amax.float().reshape(())) * factor_inv
    out = values * final.repeat_interleave(BLOCK, dim=1)
    return out.to(dtype)


def dequantize(
    data: NVFP4Data, dtype: torch.dtype = torch.float32, use: str = "rowwise"
) -> torch.Tensor:
    """High-precision values of ``data`` in its logical shape, from one usage's bytes."""
    if use == "rowwise":
        if data.rowwise_data is None:
            raise ValueError("NVFP4 data holds no rowwise usage")
        out = dequantize_codes(data.rowwise_data, data.rowwise_scale_inv, data.amax_rowwise, dtype)
        return out.reshape(data.shape)
    if use == "columnwise":
        if data.columnwise_data is None:
            raise ValueError("NVFP4 data holds no columnwise usage")
        out = dequantize_codes(
            data.columnwise_data, data.columnwise_scale_inv, data.amax_columnwise, dtype
        )
        return out.t().contiguous().reshape(data.shape)
    raise ValueError(f"use must be 'rowwise' or 'columnwise', got {use!r}")
