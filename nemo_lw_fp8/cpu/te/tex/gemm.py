"""TE 2.20.2's GEMM kernels for the ``transformer_engine_torch`` stand-in: ``generic_gemm`` and
``bgrad_quantize``.

Why: TE's ``Linear`` / ``LayerNormLinear`` (``module/linear.py``, ``module/layernorm_linear.py``)
and megatron's TE linears run every product through ``cpp_extensions.general_gemm`` ->
``tex.generic_gemm``, and TE's MXFP8 backward computes the bias gradient with
``tex.bgrad_quantize`` (``module/base.py``, ``grad_output_preprocess``).

The computation (a stand-in: a GPU's accumulation order is unknowable on CPU), documented so it
can be matched exactly:

* TE's convention (C++ ``gemm`` in ``pytorch/csrc/extensions/gemm.cpp``):
  ``D = alpha * op(B) @ op(A) + beta * C`` with ``op(A) = A^T`` if ``transa`` and ``op(B) = B^T``
  if ``transb``; A and B flattened to 2-D over their leading dimensions; D's shape is
  ``[B1]`` (``transb``) or B's leading dims, then ``A0`` (``transa``) or ``A1``.
* Each operand is read in the usage the GEMM reads (as ``general_gemm``'s ``_unwrap_tensor``
  chooses and the tensor cores see it): A rowwise if ``transa`` else columnwise, B columnwise if
  ``transb`` else rowwise. Quantized operands (MXFP8, blockwise FP8 1D / 2D) are dequantized
  exactly to fp32 from *that* copy (a stale columnwise copy therefore changes dgrad / wgrad, as
  on a GPU); plain operands are upcast to fp32.
* NVFP4 operands (both must be NVFP4, as ``CanonicalizeGemmInput`` in
  ``common/gemm/cublaslt_gemm.cu`` pairs them): each usage is read as the tensor cores read it,
  ``e2m1 * e4m3`` block scale (exact in fp32), from compact or GEMM-swizzled scales (the latter
  un-swizzled first, as cuBLAS reads them), *without* the tensor's global scale. TE does not
  fold the global scales into the operands: ``cublas_gemm`` replaces alpha with
  ``nvte_nvfp4_compute_per_tensor_scale``'s ``fp32(fp32(fp32(alpha * amax_A) * amax_B) *
  fp32(1 / (6 * 6 * 448 * 448)))``, A's rowwise amax if ``transa`` else its columnwise one, B's
  columnwise if ``transb`` else its rowwise one. The emulation does the same: that alpha
  multiplies the fp32 product in the epilogue below (which rounds differently from a matmul of
  ``dequantize()``'d operands). Row-scaled / 4over6 operands, an NVFP4 operand beside another
  kind, and fp16 output (TE's "FP4 GEMM does not support FP16 output") are refused.
* ``torch.matmul`` in fp32 on those operands (written ``matmul(op(B), op(A))`` with
  transposes as views, a columnwise usage decoded as its stored ``(K, M)`` matrix and viewed
  transposed), then the fp32 epilogue: ``* alpha`` (the NVFP4 alpha above for NVFP4
  operands, always applied); ``+ bias`` (fp32); with
  ``accumulate``, ``+ beta * out`` in fp32 (``main_grad`` accumulation of
  ``gradient_accumulation_fusion``); a single cast to the output dtype, then the output quantizer
  (TE quantizes GEMM outputs unfused, after the cast) with the project's exact quantizers.
* ``grad=True`` with a bias: the bias gradient (cuBLAS ``BGRADB`` epilogue) is the fp32 sum of
  B's rows (the high-precision ``dy`` of the bf16 wgrad GEMM), cast to the output dtype.

Refused by name: blockwise operands when the target GPU is SM >= 10.0 (TE's C++ converts them
to MXFP8 scaling there, ``convert_block_scaling_to_mxfp8_tensor``: another computation), comm
overlap (userbuffers), bulk overlap, the GELU epilogues, operands of
recipes other than MXFP8, blockwise FP8 and NVFP4 (delayed / current per-tensor scaling),
output quantizers other than MXFP8 and blockwise (an NVFP4 output quantizer included).
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_lw_fp8.cpu.formats import blockwise as bw
from nemo_lw_fp8.cpu.formats import mxfp8 as mx
from nemo_lw_fp8.cpu.te.tex.common import BACKEND, torch_dtype

__all__ = [
    "bgrad_quantize",
    "dequantize_operand",
    "generic_gemm",
    "nvfp4_alpha",
    "operand_shape",
]

TEX_KERNELS = ("bgrad_quantize", "generic_gemm")
"""The ``transformer_engine_torch`` names this module provides."""


def _refuse(what: str) -> NotImplementedError:
    return NotImplementedError(f"tex.generic_gemm with {what} is not implemented by {BACKEND}")


def _storage_kind(tensor: Any) -> str:
    """``"plain"``, ``"mxfp8"`` or ``"blockwise"``; anything else is refused by name."""
    if isinstance(tensor, torch.Tensor) and not hasattr(tensor, "_quantizer"):
        return "plain"
    from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
        Float8BlockwiseQTensorStorage,
    )
    from transformer_engine.pytorch.tensor.storage.mxfp8_tensor_storage import MXFP8TensorStorage
    from transformer_engine.pytorch.tensor.storage.nvfp4_tensor_storage import NVFP4TensorStorage

    if isinstance(tensor, MXFP8TensorStorage):
        return "mxfp8"
    if isinstance(tensor, Float8BlockwiseQTensorStorage):
        return "blockwise"
    if isinstance(tensor, NVFP4TensorStorage):
        return "nvfp4"
    raise _refuse(
        f"a {type(tensor).__name__} operand (only bf16/fp16/fp32, MXFP8, blockwise and NVFP4)"
    )


def operand_shape(tensor: Any) -> tuple[int, ...]:
    """The logical shape of a GEMM operand (a quantized one's high-precision shape)."""
    kind = _storage_kind(tensor)
    if kind == "plain":
        return tuple(tensor.shape)
    if kind == "nvfp4" and tensor._rowwise_data is None and tensor._columnwise_data is not None:
        # the C++ GEMM reads the (K, M/2) bytes as (M, K); TE's Python size() would warn
        cols, half_rows = tensor._columnwise_data.shape
        return (int(half_rows) * 2, int(cols))
    return tuple(tensor.size())


def _flat2d(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 0:
        raise ValueError("GEMM operand needs at least 1 dimension")
    rows = 1
    for dim in shape[:-1]:
        rows *= int(dim)
    return rows, int(shape[-1])


def dequantize_operand(tensor: Any, usage: str) -> torch.Tensor:
    """The operand as the GEMM reads it in ``usage`` (``"rowwise"`` / ``"columnwise"``): fp32,
    2-D ``(prod(leading dims), last dim)`` in the logical (untransposed) orientation."""
    kind = _storage_kind(tensor)
    rows, cols = _flat2d(operand_shape(tensor))
    if kind == "plain":
        return tensor.detach().reshape(rows, cols).float()
    columnwise = usage == "columnwise"
    codes = tensor._columnwise_data if columnwise else tensor._rowwise_data
    scales = tensor._columnwise_scale_inv if columnwise else tensor._rowwise_scale_inv
    if codes is None or scales is None:
        raise RuntimeError(
            f"GEMM requested the {usage} representation of a {type(tensor).__name__}, but it "
            "is unavailable (as TE's general_gemm refuses)"
        )
    if rows * cols == 0:
        return torch.zeros(rows, cols, dtype=torch.float32, device=codes.device)
    if kind == "nvfp4":
        return _nvfp4_operand(tensor, codes, scales, columnwise, rows, cols)
    fp8 = torch_dtype(tensor._fp8_dtype)
    if kind == "mxfp8":
        values = mx.dequantize_codes(
            codes.reshape(rows, cols),
            scales,
            fp8,
            columnwise,
            torch.float32,
            bool(tensor._with_gemm_swizzled_scales),
        )
    else:
        data_format = getattr(tensor, "_data_format", None)
        if data_format is not None and "COMPACT" in str(data_format).upper():
            raise _refuse("a compact-format blockwise operand")
        block_dim = 2 if tensor._is_2D_scaled else 1
        shaped = codes.reshape(cols, rows) if columnwise else codes.reshape(rows, cols)
        values = bw.dequantize_codes(
            shaped, scales, fp8, block_dim=block_dim, columnwise=columnwise, dtype=torch.float32
        )
    return values.reshape(rows, cols)


def _nvfp4_operand(
    tensor: Any, codes: torch.Tensor, scales: torch.Tensor, columnwise: bool, rows: int, cols: int
) -> torch.Tensor:
    """An NVFP4 usage as the tensor cores read it: ``e2m1 * e4m3`` (exact in fp32), the global
    scale left to the GEMM's alpha (:func:`nvfp4_alpha`); compact or GEMM-swizzled scales."""
    from nemo_lw_fp8.cpu.formats import nvfp4 as fp4

    if tensor._row_scaled_nvfp4 or tensor._nvfp4_use_4over6:
        raise _refuse("a row-scaled or 4over6 NVFP4 operand")
    if int(tensor._nvfp4_e4m3_max) != 448:
        raise _refuse(f"an NVFP4 operand with nvfp4_e4m3_max={tensor._nvfp4_e4m3_max}")
    swizzled = bool(tensor._with_gemm_swizzled_scales)
    values = fp4.decode_block_scaled(codes, scales, swizzled)
    return values.t() if columnwise else values.reshape(rows, cols)


def nvfp4_alpha(alpha: float, A: Any, transa: bool, B: Any, transb: bool) -> torch.Tensor:  # noqa: N803
    """The alpha cuBLAS gets for an NVFP4 x NVFP4 GEMM (``cublaslt_gemm.cu`` via
    ``nvte_nvfp4_compute_per_tensor_scale``): ``alpha`` times the amaxes of the usages read
    (A's rowwise amax if ``transa`` else its columnwise one; B's columnwise if ``transb`` else
    its rowwise one) times ``1 / (6 * 6 * 448 * 448)``, in fp32 left to right."""
    from nemo_lw_fp8.cpu.formats import nvfp4 as fp4

    amax_a = A._amax_rowwise if transa else A._amax_columnwise
    amax_b = B._amax_columnwise if transb else B._amax_rowwise
    if amax_a is None or amax_b is None:
        raise RuntimeError("NVFP4 GEMM operand has no amax for the usage the GEMM reads")
    return fp4.gemm_alpha(alpha, amax_a, amax_b)


def _output_shape(
    a_shape: tuple[int, ...], transa: bool, b_shape: tuple[int, ...], transb: bool
) -> tuple[int, ...]:
    """TE's ``getGemmOutputShape`` (tensor-parallel size 1), with its dimension check."""
    a0, a1 = _flat2d(a_shape)
    b0, b1 = _flat2d(b_shape)
    if (a1 if transa else a0) != (b0 if transb else b1):
        raise ValueError(
            f"Invalid matrix dimensions for GEMM (A=({a0},{a1}), transa={transa}, "
            f"B=({b0},{b1}), transb={transb})"
        )
    lead = (b1,) if transb else tuple(b_shape[:-1])
    return (*lead, a0 if transa else a1)


def _quantize_output(value: torch.Tensor, quantizer: Any, out: Any) -> Any:
    from nemo_lw_fp8.cpu.te.tex import cast

    try:
        return cast.kernel_quantize("generic_gemm", value, quantizer, out)
    except NotImplementedError as exc:
        raise _refuse(f"output quantizer {type(quantizer).__name__}") from exc


def generic_gemm(
    A: Any,  # noqa: N803 - TE's argument names
    transa: bool,
    B: Any,  # noqa: N803
    transb: bool,
    D: Any,  # noqa: N803
    quantizer: Any,
    out_dtype: Any,
    bias: torch.Tensor | None,
    bias_type: Any,
    gelu: bool,
    gelu_in: torch.Tensor | None,
    grad: bool,
    workspace: torch.Tensor,
    workspace_size: int,
    accumulate: bool,
    use_split_accumulator: bool,
    comm_overlap: Any = None,
    comm_type: Any = None,
    extra_output: torch.Tensor | None = None,
    bulk_overlap: bool = False,
    alpha: float = 1.0,
    beta: float | None = None,
) -> list[Any]:
    """``tex.generic_gemm`` (TE 2.20.2 binding order; call site ``cpp_extensions.general_gemm``):
    returns ``[D, bias_grad, gelu_input, extra_output]``. See the module doc for the computation."""
    if comm_overlap is not None or comm_type is not None or bulk_overlap:
        raise _refuse("communication overlap (userbuffers)")
    if gelu:
        raise _refuse("a GELU epilogue")
    if beta is None:
        beta = 1.0 if accumulate else 0.0
    elif not accumulate and beta != 0.0:
        raise ValueError("Trying to use non-zero beta while not accumulating into D tensor.")
    a_kind, b_kind = _storage_kind(A), _storage_kind(B)
    a_shape, b_shape = operand_shape(A), operand_shape(B)
    shape = _output_shape(a_shape, transa, b_shape, transb)
    if out_dtype is not None:
        dtype = torch_dtype(out_dtype)
    elif a_kind == "plain":
        dtype = A.dtype
    else:
        raise _refuse("a quantized A and no out_dtype")
    if D is not None and not hasattr(D, "_quantizer"):
        if tuple(D.shape) != shape:
            raise ValueError(
                f"GEMM output has invalid dims (expected {shape}, got {tuple(D.shape)})"
            )
        if out_dtype is not None and D.dtype != dtype:
            raise ValueError(f"GEMM output has invalid dtype (expected {dtype}, found {D.dtype})")
        dtype = D.dtype

    if "blockwise" in (a_kind, b_kind):
        from nemo_lw_fp8.cpu.te.device import active_target

        target = active_target()
        if target is not None and target.compute_capability >= (10, 0):
            # TE's C++ GEMM converts blockwise operands to MXFP8 on SM >= 10.0 (not emulated).
            raise _refuse(f"blockwise FP8 operands on SM {target.compute_capability} (Blackwell)")
    nvfp4 = "nvfp4" in (a_kind, b_kind)
    if nvfp4 and a_kind != b_kind:
        raise _refuse(f"an NVFP4 operand beside a {b_kind if a_kind == 'nvfp4' else a_kind} one")
    if nvfp4 and dtype == torch.float16:
        raise ValueError("FP4 GEMM does not support FP16 output!")
    a = dequantize_operand(A, "rowwise" if transa else "columnwise")
    b = dequantize_operand(B, "columnwise" if transb else "rowwise")
    op_a = a.t() if transa else a
    op_b = b.t() if transb else b
    acc = torch.matmul(op_b, op_a)
    if nvfp4:
        acc = acc * nvfp4_alpha(alpha, A, transa, B, transb)
    elif alpha != 1.0:
        acc = acc * alpha
    bias_grad = None
    if bias is not None:
        if grad:
            if b_kind != "plain":
                raise _refuse("a bias gradient of a quantized B")
            bias_grad = b.sum(0).to(dtype)
        else:
            acc = acc + bias.detach().float()
    acc = acc.reshape(shape)
    if accumulate and D is not None and not hasattr(D, "_quantizer"):
        previous = D.detach().float()
        acc = acc + (previous if beta == 1.0 else previous * beta)
    elif accumulate:
        raise _refuse("accumulate without a plain output tensor")
    value = acc.to(dtype)
    if quantizer is not None:
        out = _quantize_output(value, quantizer, D)
    elif D is not None:
        with torch.no_grad():
            D.copy_(value)
        out = D
    else:
        out = value
    return [out, bias_grad, None, extra_output]


def bgrad_quantize(grad_output: torch.Tensor, quantizer: Any) -> list[Any]:
    """``tex.bgrad_quantize`` (``grad_output_preprocess`` in ``module/base.py``, MXFP8 and NVFP4
    backward): ``[dbias, quantized dy]``; dbias is the fp32 column sum of ``dy`` cast to ``dy``'s
    dtype (the fused MXFP8 kernel's fp32 reduction; for NVFP4 ``bias.cpp`` takes its unfused path,
    ``at::sum_out`` in ``dy``'s dtype, which reduces in fp32 too), the quantization the project's
    exact one (for NVFP4 the plain ``tex.quantize`` cast, as ``bias.cpp`` calls it)."""
    dy = grad_output.detach().contiguous()
    size = int(dy.shape[-1])
    if dy.numel() == 0:
        dbias = torch.zeros(size, dtype=dy.dtype, device=dy.device)
    else:
        dbias = dy.reshape(-1, size).float().sum(0).to(dy.dtype)
    if quantizer is None:
        return [dbias, dy]
    from nemo_lw_fp8.cpu.te.tex import cast
    from nemo_lw_fp8.cpu.te.tex.cast_nvfp4 import nvfp4_classes

    if isinstance(quantizer, nvfp4_classes()[0]):
        # bias.cpp has no fused NVFP4 kernel: ``at::sum_out`` then the quantizer's plain cast
        return [dbias, cast.quantize(dy, quantizer)]
    return [dbias, cast.kernel_quantize("bgrad_quantize", dy, quantizer)]
