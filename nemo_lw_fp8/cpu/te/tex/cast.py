"""``tex``'s cast entry points over the three formats: ``quantize``, ``dequantize`` and
``create_empty_quantized_tensor`` dispatch on the quantizer's class to the MXFP8
(:mod:`.cast_mxfp8`), blockwise FP8 (:mod:`.cast_blockwise`) or NVFP4 (:mod:`.cast_nvfp4`)
kernels. The emulated TE-module kernels that quantize their outputs call
:func:`kernel_quantize` from here, below the face (:mod:`nemo_lw_fp8.cpu.te.tex`) that TE imports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from nemo_lw_fp8.cpu.te.tex import cast_blockwise as _blockwise
from nemo_lw_fp8.cpu.te.tex import cast_mxfp8 as _mxfp8
from nemo_lw_fp8.cpu.te.tex import cast_nvfp4 as _nvfp4
from nemo_lw_fp8.cpu.te.tex.common import BACKEND as _BACKEND


def _kernels_of(quantizer: Any, kernel: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The ``(quantize, create_empty)`` kernels of ``quantizer``'s format, looked up when called;
    ``tex.<kernel>`` with any other quantizer is refused by name."""
    if isinstance(quantizer, _blockwise.blockwise_classes()[0]):
        return _blockwise.quantize_blockwise, _blockwise.empty_blockwise
    if isinstance(quantizer, _mxfp8.mxfp8_classes()[0]):
        return _mxfp8.quantize_mxfp8, _mxfp8.empty_mxfp8
    if isinstance(quantizer, _nvfp4.nvfp4_classes()[0]):
        return _nvfp4.quantize_nvfp4, _nvfp4.empty_nvfp4
    raise NotImplementedError(
        f"tex.{kernel} with {type(quantizer).__name__} is not implemented by {_BACKEND}; "
        "only MXFP8Quantizer, Float8BlockQuantizer and NVFP4Quantizer are"
    )


def quantize(
    tensor: torch.Tensor, quantizer: Any, output: Any = None, noop: torch.Tensor | None = None
) -> Any:
    """``tex.quantize``: MXFP8, blockwise FP8 or NVFP4, into a new tensor or in place into
    ``output``. ``noop`` (a float tensor) set to 1 skips the cast, as TE's kernels do."""
    cast, _ = _kernels_of(quantizer, "quantize")
    return cast(tensor, quantizer, output, noop)


#: Kernels whose NVFP4 output TE 2.20.2's C++ produces as the plain cast of the kernel's
#: high-precision output, so ``tex.quantize``'s emulation is theirs too (why, per kernel).
NVFP4_OUTPUT_IS_THE_CAST = {
    "norm forward": (
        "pytorch/csrc/extensions/normalization.cpp: no norm kernel writes NVFP4. layernorm_fwd / "
        "rmsnorm_fwd write the norm into an unquantized out_dtype tensor, then quantize it: "
        "Impl::UNFUSED (the quantizer applies the RHT with post-RHT amax) calls the plain cast; "
        "Impl::FUSED_NORM_AMAX_NVFP4 (no RHT) has the norm kernel record amax = max "
        "|output_t(y)| (common/normalization, since TE #2355), the value the cast computes from "
        "that tensor, and quantize_with_amax then casts with it"
    ),
}


def kernel_quantize(kernel: str, tensor: torch.Tensor, quantizer: Any, output: Any = None) -> Any:
    """``quantize`` as the emulated TE-module kernels (one module per kernel family) call it for
    their quantized outputs. NVFP4 goes through only for the kernels in
    :data:`NVFP4_OUTPUT_IS_THE_CAST` (TE's C++ read: the output is the plain cast of the
    kernel's unquantized output) and is refused by name elsewhere: TE's fused NVFP4 paths of
    SwiGLU and GEMM outputs have not been read yet. ``split_quantize`` does not come here for
    NVFP4: TE's grouped NVFP4 cast has its own module (``split_quantize_nvfp4``).
    ``bgrad_quantize`` does not come here for NVFP4: ``bias.cpp`` has no fused NVFP4 kernel and
    calls the plain cast (``gemm.bgrad_quantize``)."""
    if isinstance(quantizer, _nvfp4.nvfp4_classes()[0]) and kernel not in NVFP4_OUTPUT_IS_THE_CAST:
        raise NotImplementedError(
            f"tex.{kernel} with an NVFP4Quantizer is not emulated yet by {_BACKEND}; only "
            "tex.quantize and the norms' outputs are (docs/nvfp4.md)"
        )
    return quantize(tensor, quantizer, output)


def dequantize(input: Any, otype: Any) -> torch.Tensor:  # noqa: A002 - TE's argument name
    """``tex.dequantize``: NVFP4 tensors (rowwise) here, everything else to the MXFP8 kernel,
    which refuses what it does not know."""
    if isinstance(input, _nvfp4.nvfp4_classes()[2]):
        return _nvfp4.dequantize_nvfp4(input, otype)
    return _mxfp8.dequantize(input, otype)


def create_empty_quantized_tensor(
    quantizer: Any,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    pin_memory: bool = False,
) -> Any:
    """``tex.create_empty_quantized_tensor``: the quantizer's tensor class with fresh buffers for
    its usages and no cast. ``pin_memory`` has no meaning without a GPU: ordinary host memory."""
    _, empty = _kernels_of(quantizer, "create_empty_quantized_tensor")
    return empty(quantizer, tuple(int(dim) for dim in shape), dtype, torch.device(device))
