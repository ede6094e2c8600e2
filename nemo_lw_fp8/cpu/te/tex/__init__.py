"""Stand-in for Transformer Engine 2.20.2's compiled extension ``transformer_engine_torch``.

:func:`nemo_lw_fp8.cpu.te.backend.activate` registers this module as
``sys.modules["transformer_engine_torch"]`` on machines where TE's CUDA extension cannot load,
so TE's own Python classes run on CPU. It implements the kernels those classes call for MXFP8
with :mod:`nemo_lw_fp8.cpu.formats.mxfp8` (bit-exact with TE's kernels) and a few multi-tensor
helpers megatron-core uses (grad-norm and clipping), and nothing else:

* ``create_empty_quantized_tensor`` (``Quantizer.make_empty``: megatron's checkpoint loader
  and ``torch.empty_like`` / ``new_empty`` of a quantized tensor) for MXFP8, blockwise FP8 and
  NVFP4,
  with the buffers TE's C++ ``create_tensor`` allocates (zeroed, where TE leaves them
  uninitialised);
* ``quantize`` (MXFP8: compact or GEMM-swizzled scales as the quantizer asks; blockwise FP8
  ``Float8BlockQuantizer``: 1x128 / 128x128 blocks via :mod:`nemo_lw_fp8.cpu.formats.blockwise`),
  ``dequantize`` (MXFP8 only: TE dequantises blockwise tensors in its own Python code, and its
  compiled ``dequantize`` has no blockwise kernel either);
* NVFP4 (``NVFP4Quantizer``, issue 30) in :mod:`.cast_nvfp4` over
  :mod:`nemo_lw_fp8.cpu.formats.nvfp4`: ``quantize`` (1x16 or 16x16 blocks, rowwise and
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
* the kernels TE 2.20.2's own modules call (issue 28), in one module per kernel family,
  registered here from their ``TEX_KERNELS``: ``generic_gemm``, ``bgrad_quantize``, the norms,
  SwiGLU, the unfused-attention softmax kernels, the discrete grouped GEMM with ``split_quantize``
  and row padding, and the version / workspace / attention-backend queries (answered as the target
  GPU of :mod:`nemo_lw_fp8.cpu.te.device`); docs/testing.md, "TE's kernels, emulated", lists each as
  exact or stand-in;
* the ``DType`` enum with exactly the members TE's Python side mirrors, and the other enums TE
  reads at import time (values of enums no emulated kernel uses are placeholders);
* strict dummies for the other names TE imports at module load: calling one, or constructing
  one of the dummy classes, raises ``NotImplementedError`` naming it. Any other attribute raises
  ``AttributeError``, so ``hasattr`` checks in TE and megatron see it as absent.

Where each part lives: the casts in :mod:`.cast` over :mod:`.cast_mxfp8`, :mod:`.cast_blockwise`
and :mod:`.cast_nvfp4`, the multi-tensor helpers in :mod:`.multi_tensor`, the enums and shared
argument handling in :mod:`.common`. This module is the one TE imports: it gathers those names, adds
the multi-tensor helpers and the strict dummies, and refuses everything else.

The argument conventions follow TE 2.20's bindings (``pybind.cpp`` / ``registration.cpp``) and
their Python call sites (``tensor/mxfp8_tensor.py``, ``tensor/utils.py``,
``optimizers/multi_tensor_apply.py``, megatron's ``clip_grads.py``).
"""

from __future__ import annotations

from typing import Any

from nemo_lw_fp8.cpu.te.tex.cast_blockwise import (
    fp8_block_scaling_compute_partial_amax,
    fp8_block_scaling_partial_cast,
    fp8_transpose,
    multi_tensor_compute_scale_and_scale_inv,
)
from nemo_lw_fp8.cpu.te.tex.cast_mxfp8 import (
    multi_tensor_compute_scale_inv_e8m0,
    mxfp8_scaling_compute_partial_amax,
    mxfp8_scaling_partial_cast,
)
from nemo_lw_fp8.cpu.te.tex.cast_nvfp4 import nvfp4_2d_scale_transpose, nvfp4_data_transpose
from nemo_lw_fp8.cpu.te.tex.common import BACKEND as _BACKEND
from nemo_lw_fp8.cpu.te.tex.common import (
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


from nemo_lw_fp8.cpu.te.tex import (  # noqa: E402
    activation,
    comm,
    gemm,
    grouped_gemm,
    grouped_tensor,
    normalization,
    queries,
    softmax,
)
from nemo_lw_fp8.cpu.te.tex.cast import (  # noqa: E402
    create_empty_quantized_tensor,
    dequantize,
    quantize,
)
from nemo_lw_fp8.cpu.te.tex.multi_tensor import (  # noqa: E402
    multi_tensor_l2norm,
    multi_tensor_scale,
    multi_tensor_scale_tensor,
)

#: The modules of TE-module kernels (issue 28); each lists the ``tex`` names it serves in
#: ``TEX_KERNELS``, registered here before TE is imported (``ops/basic`` imports some by name).
_KERNEL_MODULES = (
    gemm,
    grouped_gemm,
    grouped_tensor,
    normalization,
    activation,
    softmax,
    queries,
    comm,
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
