"""What every part of the ``transformer_engine_torch`` stand-in shares: TE's enums and dtypes.

Why a module of its own: the MXFP8 kernels (:mod:`.cast_mxfp8`), the blockwise FP8
kernels (:mod:`.cast_blockwise`) and the module TE imports
(:mod:`nemo_lw_fp8.cpu.te.tex`) all read the same ``DType`` tags, refuse the same
arguments the same way and wrap quantised buffers in TE's own tensor classes alike. The enums
mirror TE 2.20's ``pytorch/csrc/common.h`` and ``transformer_engine.h``; values of enums no
emulated kernel uses are placeholders.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import torch

BACKEND = "the nemo_lw_fp8 CPU emulation of transformer_engine_torch"
"""How error messages name this stand-in."""


class DType(enum.IntEnum):
    """TE's element-type tag; exactly the members ``transformer_engine.pytorch.DType`` mirrors."""

    kByte = 0
    kInt32 = 2
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat4E2M1 = 10


class FP8FwdTensors(enum.IntEnum):
    """Forward FP8 meta indices (values as in TE's ``pytorch/csrc/common.h``)."""

    GEMM1_INPUT = 0
    GEMM1_WEIGHT = 1
    GEMM1_OUTPUT = 2
    GEMM2_INPUT = 3
    GEMM2_WEIGHT = 4
    GEMM2_OUTPUT = 5
    GEMM3_INPUT = 6
    GEMM3_WEIGHT = 7
    GEMM3_OUTPUT = 8


class FP8BwdTensors(enum.IntEnum):
    """Backward FP8 meta indices (values as in TE's ``pytorch/csrc/common.h``)."""

    GRAD_OUTPUT1 = 0
    GRAD_INPUT1 = 1
    GRAD_OUTPUT2 = 2
    GRAD_INPUT2 = 3
    GRAD_OUTPUT3 = 4
    GRAD_INPUT3 = 5


class NVTEScalingMode(enum.IntEnum):
    """Scaling modes (values as in TE's ``transformer_engine.h``)."""

    NVTE_DELAYED_TENSOR_SCALING = 0
    NVTE_MXFP8_1D_SCALING = 1
    NVTE_BLOCK_SCALING_1D = 2
    NVTE_BLOCK_SCALING_2D = 3
    NVTE_NVFP4_1D_SCALING = 4
    NVTE_INVALID_SCALING = 100


class CommOverlapType(enum.IntEnum):
    """Userbuffers overlap kinds (read at import; no emulated kernel uses them)."""

    RS = 0
    AG = 1


class NVTE_Fused_Attn_Backend(enum.IntEnum):  # noqa: N801 - TE's name
    """Fused-attention backends; TE asserts at import that these are exactly the members."""

    NVTE_No_Backend = -1
    NVTE_F16_arbitrary_seqlen = 1
    NVTE_FP8 = 2


def _placeholder_enum(name: str, members: Sequence[str]) -> type[enum.IntEnum]:
    """An IntEnum TE reads at import time only; the values are placeholders, never used."""
    return enum.IntEnum(name, {member: index for index, member in enumerate(members)})


NVTE_QKV_Layout = _placeholder_enum(
    "NVTE_QKV_Layout",
    [
        "NVTE_SB3HD", "NVTE_SBH3D", "NVTE_SBHD_SB2HD", "NVTE_SBHD_SBH2D", "NVTE_SBHD_SBHD_SBHD",
        "NVTE_BS3HD", "NVTE_BSH3D", "NVTE_BSHD_BS2HD", "NVTE_BSHD_BSH2D", "NVTE_BSHD_BSHD_BSHD",
        "NVTE_T3HD", "NVTE_TH3D", "NVTE_THD_T2HD", "NVTE_THD_TH2D", "NVTE_THD_THD_THD",
        "NVTE_SBHD_BSHD_BSHD", "NVTE_BSHD_SBHD_SBHD", "NVTE_THD_BSHD_BSHD", "NVTE_THD_SBHD_SBHD",
        "NVTE_Paged_KV_BSHD_BSHD_BSHD", "NVTE_Paged_KV_BSHD_SBHD_SBHD",
        "NVTE_Paged_KV_SBHD_BSHD_BSHD", "NVTE_Paged_KV_SBHD_SBHD_SBHD",
        "NVTE_Paged_KV_THD_BSHD_BSHD", "NVTE_Paged_KV_THD_SBHD_SBHD", "NVTE_BHSD_BHSD_BHSD",
        "NVTE_QKV_Layout_NOT_SET",
    ],
)  # fmt: skip
NVTE_QKV_Format = _placeholder_enum(
    "NVTE_QKV_Format",
    [
        "NVTE_SBHD", "NVTE_BSHD", "NVTE_THD", "NVTE_SBHD_2BSHD", "NVTE_BSHD_2SBHD",
        "NVTE_THD_2BSHD", "NVTE_THD_2SBHD", "NVTE_BHSD", "NVTE_QKV_Format_NOT_SET",
    ],
)  # fmt: skip
NVTE_Bias_Type = _placeholder_enum(
    "NVTE_Bias_Type", ["NVTE_NO_BIAS", "NVTE_PRE_SCALE_BIAS", "NVTE_POST_SCALE_BIAS", "NVTE_ALIBI"]
)
NVTE_Mask_Type = _placeholder_enum(
    "NVTE_Mask_Type",
    [
        "NVTE_NO_MASK", "NVTE_PADDING_MASK", "NVTE_CAUSAL_MASK", "NVTE_PADDING_CAUSAL_MASK",
        "NVTE_CAUSAL_BOTTOM_RIGHT_MASK", "NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK",
    ],
)  # fmt: skip
NVTE_Softmax_Type = _placeholder_enum(
    "NVTE_Softmax_Type",
    ["NVTE_VANILLA_SOFTMAX", "NVTE_OFF_BY_ONE_SOFTMAX", "NVTE_LEARNABLE_SOFTMAX"],
)
NVTEQBHistogramMode = _placeholder_enum("NVTEQBHistogramMode", ["FUSED_ATOMIC", "TWO_KERNEL"])
NVTERoutingMapFormat = _placeholder_enum("NVTERoutingMapFormat", ["BITMAP_U8", "BYTEMAP"])


_TORCH_DTYPE = {
    DType.kByte: torch.uint8,
    DType.kInt32: torch.int32,
    DType.kFloat32: torch.float32,
    DType.kFloat16: torch.float16,
    DType.kBFloat16: torch.bfloat16,
    DType.kFloat8E4M3: torch.float8_e4m3fn,
    DType.kFloat8E5M2: torch.float8_e5m2,
}


def torch_dtype(te_dtype: Any) -> torch.dtype:
    """The torch dtype of a TE ``DType`` tag (or its int value)."""
    try:
        return _TORCH_DTYPE[DType(int(te_dtype))]
    except (KeyError, ValueError):
        raise NotImplementedError(
            f"{BACKEND} has no torch dtype for TE dtype {te_dtype!r}"
        ) from None


def te_dtype(dtype: torch.dtype) -> Any:
    """The TE ``DType`` tag of a torch dtype (what TE's Python passes as ``out_dtype``)."""
    for tag, value in _TORCH_DTYPE.items():
        if value == dtype:
            return tag
    raise NotImplementedError(f"{BACKEND} has no TE dtype for torch dtype {dtype}")


def noop_set(noop: torch.Tensor | None) -> bool:
    """Whether TE's ``noop`` flag (a float tensor) asks the kernel to skip its work."""
    return noop is not None and bool((noop.reshape(-1)[:1] == 1.0).all())


def plain_source(tensor: Any) -> torch.Tensor:
    """The detached, contiguous input of ``tex.quantize``; refuses already-quantised tensors."""
    if not isinstance(tensor, torch.Tensor) or hasattr(tensor, "_quantizer"):
        raise TypeError("tex.quantize expects a plain high-precision torch.Tensor")
    return tensor.detach().contiguous()


def wrap_quantized(
    classes: tuple[type, type, type],
    quantizer: Any,
    data: Any,
    fake_dtype: torch.dtype,
    device: torch.device,
    **format_args: Any,
) -> Any:
    """Fresh buffers in TE's tensor class, as its quantizers' C++ ``create_tensor`` does.

    ``classes`` is (quantizer, tensor, storage) class; an ``internal`` quantizer gets the
    storage class. ``data`` holds the four buffers and the logical ``shape``;
    ``format_args`` are the class's own flags (swizzled scales, 2-D scaling).
    """
    _, tensor_cls, storage_cls = classes
    buffers = {
        "rowwise_data": data.rowwise_data,
        "rowwise_scale_inv": data.rowwise_scale_inv,
        "columnwise_data": data.columnwise_data,
        "columnwise_scale_inv": data.columnwise_scale_inv,
        "fp8_dtype": quantizer.dtype,
        "quantizer": quantizer,
        **format_args,
    }
    if quantizer.internal:
        return storage_cls(fake_dtype=fake_dtype, **buffers)
    return tensor_cls(shape=data.shape, dtype=fake_dtype, device=device, **buffers)
