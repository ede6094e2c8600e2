"""Stand-in for Transformer Engine 2.20.2's compiled extension ``transformer_engine_torch``.

:func:`nemo_lw_fp8.emulation.te_backend.activate` registers this module as
``sys.modules["transformer_engine_torch"]`` on machines where TE's CUDA extension cannot load,
so TE's own Python classes run on CPU. It implements the kernels those classes call for MXFP8
with :mod:`nemo_lw_fp8.emulation.mxfp8` (bit-exact with TE's kernels) and a few multi-tensor
helpers megatron-core uses (grad-norm and clipping), and nothing else:

* ``create_empty_quantized_tensor`` (``Quantizer.make_empty``: megatron's checkpoint loader
  and ``torch.empty_like`` / ``new_empty`` of a quantized tensor) for MXFP8, blockwise FP8 and
  NVFP4,
  with the buffers TE's C++ ``create_tensor`` allocates (zeroed, where TE leaves them
  uninitialised);
* ``quantize`` (MXFP8: compact or GEMM-swizzled scales as the quantizer asks; blockwise FP8
  ``Float8BlockQuantizer``: 1x128 / 128x128 blocks via :mod:`nemo_lw_fp8.emulation.blockwise`),
  ``dequantize`` (MXFP8 only: TE dequantises blockwise tensors in its own Python code, and its
  compiled ``dequantize`` has no blockwise kernel either);
* NVFP4 (``NVFP4Quantizer``, issue 30) in :mod:`.te_extension_nvfp4` over
  :mod:`nemo_lw_fp8.emulation.nvfp4`: ``quantize`` (1x16 or 16x16 blocks, rowwise and
  transposed columnwise), ``dequantize`` (rowwise), ``nvfp4_data_transpose`` and
  ``nvfp4_2d_scale_transpose``, compact or GEMM-swizzled scales, the random Hadamard transform
  of the columnwise copy (docs/nvfp4.md); stochastic rounding, row-scaled and 4over6 NVFP4 and
  amax reduction are refused by name;
* blockwise FP8 helpers TE's Python calls: ``fp8_transpose`` (``_create_columnwise``),
  ``fp8_block_scaling_compute_partial_amax``, ``multi_tensor_compute_scale_and_scale_inv`` and
  ``fp8_block_scaling_partial_cast`` (the distributed-optimizer cast of blockwise weights);
* ``multi_tensor_l2norm``, ``multi_tensor_scale``, ``multi_tensor_scale_tensor``;
* the distributed-optimizer cast: ``mxfp8_scaling_compute_partial_amax``,
  ``multi_tensor_compute_scale_inv_e8m0``, ``mxfp8_scaling_partial_cast``;
* the kernels TE 2.20.2's own modules call (issue 28), in ``te_kernels_*.py`` and registered
  here from their ``TEX_KERNELS``: ``generic_gemm``, ``bgrad_quantize``, the norms, SwiGLU, the
  unfused-attention softmax kernels, the discrete grouped GEMM with ``split_quantize`` and row
  padding, and the version / workspace / attention-backend queries (answered as the target GPU
  of :mod:`nemo_lw_fp8.cpu.te_device`); docs/testing.md, "TE's kernels, emulated", lists each as
  exact or stand-in;
* the ``DType`` enum with exactly the members TE's Python side mirrors, and the other enums TE
  reads at import time (values of enums no emulated kernel uses are placeholders);
* strict dummies for the other names TE imports at module load: calling one, or constructing
  one of the dummy classes, raises ``NotImplementedError`` naming it. Any other attribute raises
  ``AttributeError``, so ``hasattr`` checks in TE and megatron see it as absent.

Where each part lives: the MXFP8 kernels in :mod:`.te_extension_mxfp8`, the blockwise FP8
kernels in :mod:`.te_extension_blockwise`, the enums and shared argument handling in
:mod:`.te_extension_common`. This module is the one TE imports: it gathers those names, adds
the multi-tensor helpers and the strict dummies, and refuses everything else.

The argument conventions follow TE 2.20's bindings (``pybind.cpp`` / ``registration.cpp``) and
their Python call sites (``tensor/mxfp8_tensor.py``, ``tensor/utils.py``,
``optimizers/multi_tensor_apply.py``, megatron's ``clip_grads.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import te_extension_blockwise as _blockwise
from . import te_extension_mxfp8 as _mxfp8
from . import te_extension_nvfp4 as _nvfp4
from .te_extension_blockwise import (
    fp8_block_scaling_compute_partial_amax,
    fp8_block_scaling_partial_cast,
    fp8_transpose,
    multi_tensor_compute_scale_and_scale_inv,
)
from .te_extension_common import BACKEND as _BACKEND
from .te_extension_common import (
    CommOverlapType,
    DType,
    FP8BwdTensors,
    FP8FwdTensors,
    NVTE_Bias_Type,
    NVTE_Fused_Attn_Backend,
    NVTE_Mask_Type,
    NVTE_QKV_Format,
    NVTE_QKV_Layout,
    NVTE_Softmax_Type,
    NVTEQBHistogramMode,
    NVTERoutingMapFormat,
    NVTEScalingMode,
)
from .te_extension_mxfp8 import (
    multi_tensor_compute_scale_inv_e8m0,
    mxfp8_scaling_compute_partial_amax,
    mxfp8_scaling_partial_cast,
)
from .te_extension_nvfp4 import nvfp4_2d_scale_transpose, nvfp4_data_transpose

# --------------------------------------------------------------------------------------------
# Strict dummies
# --------------------------------------------------------------------------------------------


class _StrictDummy:
    """A kernel TE imports at load time but the emulation does not provide."""

    def __init__(self, name: str) -> None:
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"transformer_engine_torch.{self.__name__} is not implemented by {_BACKEND} "
            '(see docs/testing.md, "TE\'s kernels, emulated", for those that are); this code '
            "path needs a GPU with real Transformer Engine"
        )

    def __repr__(self) -> str:
        return f"<emulated transformer_engine_torch.{self.__name__}: not implemented>"


def _dummy_class(name: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"transformer_engine_torch.{name} is not implemented by {_BACKEND}; "
            "this code path needs a GPU with real Transformer Engine"
        )

    return type(name, (), {"__init__": __init__, "__doc__": f"Not emulated: {name}."})


CommOverlap = _dummy_class("CommOverlap")
CommOverlapP2P = _dummy_class("CommOverlapP2P")
CommOverlapHelper = _dummy_class("CommOverlapHelper")
FP8TensorMeta = _dummy_class("FP8TensorMeta")

_DUMMY_FUNCTIONS = (
    "bulk_overlap_ag_with_external_gemm",
    "dbias_dgelu",
    "dbias_drelu",
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_adam_fp8",
    "multi_tensor_sgd",
    "multi_tensor_unscale_l2norm",
)
for _name in _DUMMY_FUNCTIONS:
    globals()[_name] = _StrictDummy(_name)
del _name


# --------------------------------------------------------------------------------------------
# quantize
# --------------------------------------------------------------------------------------------


def quantize(
    tensor: torch.Tensor, quantizer: Any, output: Any = None, noop: torch.Tensor | None = None
) -> Any:
    """``tex.quantize``: MXFP8 or blockwise FP8, into a new tensor or in place into ``output``.

    ``noop`` (a float tensor) set to 1 skips the cast, as TE's kernels do.
    """
    if isinstance(quantizer, _blockwise.blockwise_classes()[0]):
        return _blockwise.quantize_blockwise(tensor, quantizer, output, noop)
    if isinstance(quantizer, _mxfp8.mxfp8_classes()[0]):
        return _mxfp8.quantize_mxfp8(tensor, quantizer, output, noop)
    if isinstance(quantizer, _nvfp4.nvfp4_classes()[0]):
        return _nvfp4.quantize_nvfp4(tensor, quantizer, output, noop)
    raise NotImplementedError(
        f"tex.quantize with {type(quantizer).__name__} is not implemented by {_BACKEND}; "
        "only MXFP8Quantizer, Float8BlockQuantizer and NVFP4Quantizer are"
    )


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
    """``quantize`` as the emulated TE-module kernels (``te_kernels_*.py``) call it for their
    quantized outputs. NVFP4 goes through only for the kernels in
    :data:`NVFP4_OUTPUT_IS_THE_CAST` (TE's C++ read: the output is the plain cast of the
    kernel's unquantized output) and is refused by name elsewhere: TE's fused NVFP4 paths of
    SwiGLU and GEMM outputs have not been read yet. ``split_quantize`` does not come here for
    NVFP4: TE's grouped NVFP4 cast has its own module (``te_kernels_grouped_nvfp4``).
    ``bgrad_quantize`` does not come here for NVFP4: ``bias.cpp`` has no fused NVFP4 kernel and
    calls the plain cast (``te_kernels_gemm.bgrad_quantize``)."""
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
    size = tuple(int(dim) for dim in shape)
    where = torch.device(device)
    if isinstance(quantizer, _blockwise.blockwise_classes()[0]):
        return _blockwise.empty_blockwise(quantizer, size, dtype, where)
    if isinstance(quantizer, _mxfp8.mxfp8_classes()[0]):
        return _mxfp8.empty_mxfp8(quantizer, size, dtype, where)
    if isinstance(quantizer, _nvfp4.nvfp4_classes()[0]):
        return _nvfp4.empty_nvfp4(quantizer, size, dtype, where)
    raise NotImplementedError(
        f"tex.create_empty_quantized_tensor with {type(quantizer).__name__} is not implemented "
        f"by {_BACKEND}; only MXFP8Quantizer, Float8BlockQuantizer and NVFP4Quantizer are"
    )


# --------------------------------------------------------------------------------------------
# Multi-tensor helpers
# --------------------------------------------------------------------------------------------


def multi_tensor_l2norm(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    per_tensor: bool | None = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 L2 norm of all tensors together, and per tensor when ``per_tensor`` (else empty)."""
    tensors = list(tensor_lists[0])
    device = tensors[0].device if tensors else torch.device("cpu")
    norms = (
        torch.stack([torch.linalg.vector_norm(t.detach().float().reshape(-1)) for t in tensors])
        if tensors
        else torch.zeros(0, device=device)
    )
    total = torch.linalg.vector_norm(norms).reshape(1)
    per = norms if per_tensor else torch.empty(0, dtype=torch.float32, device=device)
    return total, per


def _scale_lists(
    noop_flag: torch.Tensor | None,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    scale: torch.Tensor,
) -> None:
    finite = True
    with torch.no_grad():
        for src, dst in zip(tensor_lists[0], tensor_lists[1], strict=True):
            src32 = src.float()
            finite = finite and bool(torch.isfinite(src32).all())
            dst.copy_(src32 * scale)
    if not finite and noop_flag is not None:
        noop_flag.fill_(1)


def multi_tensor_scale(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    scale: float,
) -> None:
    """``out = fp32(in) * fp32(scale)`` per pair; ``noop_flag = 1`` if an input is not finite."""
    _scale_lists(noop_flag, tensor_lists, torch.tensor(scale, dtype=torch.float32))


def multi_tensor_scale_tensor(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    scale: torch.Tensor,
) -> None:
    """As :func:`multi_tensor_scale` with the scale read from a one-element tensor."""
    _scale_lists(noop_flag, tensor_lists, scale.detach().float().reshape(-1)[0])


from . import (  # noqa: E402
    te_kernels_activation,
    te_kernels_comm,
    te_kernels_gemm,
    te_kernels_grouped,
    te_kernels_grouped_tensor,
    te_kernels_norm,
    te_kernels_queries,
    te_kernels_softmax,
)

#: The modules of TE-module kernels (issue 28); each lists the ``tex`` names it serves in
#: ``TEX_KERNELS``, registered here before TE is imported (``ops/basic`` imports some by name).
_KERNEL_MODULES = (
    te_kernels_gemm,
    te_kernels_grouped,
    te_kernels_grouped_tensor,
    te_kernels_norm,
    te_kernels_activation,
    te_kernels_softmax,
    te_kernels_queries,
    te_kernels_comm,
)
_KERNELS = tuple(name for module in _KERNEL_MODULES for name in module.TEX_KERNELS)
for _module in _KERNEL_MODULES:
    for _name in _module.TEX_KERNELS:
        globals()[_name] = getattr(_module, _name)
del _module, _name


__all__ = [
    "CommOverlap",
    "CommOverlapHelper",
    "CommOverlapP2P",
    "CommOverlapType",
    "DType",
    "FP8BwdTensors",
    "FP8FwdTensors",
    "FP8TensorMeta",
    "create_empty_quantized_tensor",
    "NVTEQBHistogramMode",
    "NVTERoutingMapFormat",
    "NVTEScalingMode",
    "NVTE_Bias_Type",
    "NVTE_Fused_Attn_Backend",
    "NVTE_Mask_Type",
    "NVTE_QKV_Format",
    "NVTE_QKV_Layout",
    "NVTE_Softmax_Type",
    "dequantize",
    "fp8_block_scaling_compute_partial_amax",
    "fp8_block_scaling_partial_cast",
    "fp8_transpose",
    "multi_tensor_compute_scale_and_scale_inv",
    "multi_tensor_compute_scale_inv_e8m0",
    "multi_tensor_l2norm",
    "multi_tensor_scale",
    "multi_tensor_scale_tensor",
    "mxfp8_scaling_compute_partial_amax",
    "mxfp8_scaling_partial_cast",
    "nvfp4_2d_scale_transpose",
    "nvfp4_data_transpose",
    "quantize",
    *_KERNELS,
    *_DUMMY_FUNCTIONS,
]

EMULATED = True
"""Marker: this module is the emulation, not TE's compiled extension."""


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"transformer_engine_torch.{name} is not provided by {_BACKEND}; only the kernels listed "
        'in docs/testing.md ("TE\'s kernels, emulated") and the names TE 2.20.2 reads at import '
        "time are"
    )
