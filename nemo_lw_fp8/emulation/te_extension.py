"""Stand-in for Transformer Engine 2.20.2's compiled extension ``transformer_engine_torch``.

:func:`nemo_lw_fp8.emulation.te_backend.activate` registers this module as
``sys.modules["transformer_engine_torch"]`` on machines where TE's CUDA extension cannot load,
so TE's own Python classes run on CPU. It implements the kernels those classes call for MXFP8
with :mod:`nemo_lw_fp8.emulation.mxfp8` (bit-exact with TE's kernels) and a few multi-tensor
helpers megatron-core uses (grad-norm and clipping), and nothing else:

* ``quantize`` (MXFP8: compact or GEMM-swizzled scales as the quantizer asks; blockwise FP8
  ``Float8BlockQuantizer``: 1x128 / 128x128 blocks via :mod:`nemo_lw_fp8.emulation.blockwise`),
  ``dequantize`` (MXFP8 only: TE dequantises blockwise tensors in its own Python code, and its
  compiled ``dequantize`` has no blockwise kernel either);
* blockwise FP8 helpers TE's Python calls: ``fp8_transpose`` (``_create_columnwise``),
  ``fp8_block_scaling_compute_partial_amax``, ``multi_tensor_compute_scale_and_scale_inv`` and
  ``fp8_block_scaling_partial_cast`` (the distributed-optimizer cast of blockwise weights);
* ``multi_tensor_l2norm``, ``multi_tensor_scale``, ``multi_tensor_scale_tensor``;
* the distributed-optimizer cast: ``mxfp8_scaling_compute_partial_amax``,
  ``multi_tensor_compute_scale_inv_e8m0``, ``mxfp8_scaling_partial_cast``;
* the ``DType`` enum with exactly the members TE's Python side mirrors, and the other enums TE
  reads at import time (values of enums no emulated kernel uses are placeholders);
* strict dummies for the other names TE imports at module load: calling one, or constructing
  one of the dummy classes, raises ``NotImplementedError`` naming it. Any other attribute raises
  ``AttributeError``, so ``hasattr`` checks in TE and megatron see it as absent.

The argument conventions follow TE 2.20's bindings (``pybind.cpp`` / ``registration.cpp``) and
their Python call sites (``tensor/mxfp8_tensor.py``, ``tensor/utils.py``,
``optimizers/multi_tensor_apply.py``, megatron's ``clip_grads.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import torch

from . import blockwise as _bw
from . import mxfp8 as _mx

# --------------------------------------------------------------------------------------------
# Enums
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Strict dummies
# --------------------------------------------------------------------------------------------

_BACKEND = "the nemo_lw_fp8 CPU emulation of transformer_engine_torch"


class _StrictDummy:
    """A kernel TE imports at load time but the emulation does not provide."""

    def __init__(self, name: str) -> None:
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"transformer_engine_torch.{self.__name__} is not implemented by {_BACKEND} "
            "(only the MXFP8 and blockwise FP8 quantize/dequantize, multi-tensor norm/scale "
            "and MXFP8/blockwise distributed-cast kernels are); this code path needs a GPU with "
            "real Transformer Engine"
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
    "layernorm_bwd",
    "layernorm_fwd",
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_adam_fp8",
    "multi_tensor_sgd",
    "multi_tensor_unscale_l2norm",
    "rmsnorm_bwd",
    "rmsnorm_fwd",
)
for _name in _DUMMY_FUNCTIONS:
    globals()[_name] = _StrictDummy(_name)
del _name


# --------------------------------------------------------------------------------------------
# dtype helpers
# --------------------------------------------------------------------------------------------

_TORCH_DTYPE = {
    DType.kByte: torch.uint8,
    DType.kInt32: torch.int32,
    DType.kFloat32: torch.float32,
    DType.kFloat16: torch.float16,
    DType.kBFloat16: torch.bfloat16,
    DType.kFloat8E4M3: torch.float8_e4m3fn,
    DType.kFloat8E5M2: torch.float8_e5m2,
}


def _torch_dtype(te_dtype: Any) -> torch.dtype:
    try:
        return _TORCH_DTYPE[DType(int(te_dtype))]
    except (KeyError, ValueError):
        raise NotImplementedError(
            f"{_BACKEND} has no torch dtype for TE dtype {te_dtype!r}"
        ) from None


def _mxfp8_classes() -> tuple[type, type, type]:
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer, MXFP8Tensor
    from transformer_engine.pytorch.tensor.storage.mxfp8_tensor_storage import (
        MXFP8TensorStorage,
    )

    return MXFP8Quantizer, MXFP8Tensor, MXFP8TensorStorage


# --------------------------------------------------------------------------------------------
# quantize / dequantize
# --------------------------------------------------------------------------------------------


def _scale_buffer(shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.uint8, device=device)


def _prepare_output(quantizer: Any, output: Any, shape: tuple[int, ...]) -> Any:
    """Make an existing MXFP8 tensor match the quantizer's usages (TE's convert_and_update)."""
    _, _, storage_cls = _mxfp8_classes()
    if not isinstance(output, storage_cls):
        raise TypeError(f"MXFP8Quantizer must output to an MXFP8 tensor, got {type(output)}")
    existing = output._columnwise_data
    if existing is None:
        existing = output._rowwise_data
    if existing is None:
        raise ValueError("MXFP8Tensor has no data")
    if tuple(existing.shape) != tuple(shape):
        raise ValueError(
            f"cannot quantize a tensor of shape {tuple(shape)} into an MXFP8 tensor of shape "
            f"{tuple(existing.shape)}"
        )
    device = existing.device
    for usage, data, scale, scale_shape in (
        (quantizer.rowwise_usage, "_rowwise_data", "_rowwise_scale_inv", _mx.rowwise_scale_shape),
        (
            quantizer.columnwise_usage,
            "_columnwise_data",
            "_columnwise_scale_inv",
            _mx.columnwise_scale_shape,
        ),
    ):
        if usage:
            if getattr(output, data) is None:
                setattr(output, data, torch.empty(shape, dtype=torch.uint8, device=device))
            if getattr(output, scale) is None:
                setattr(output, scale, _scale_buffer(scale_shape(shape), device))
        else:
            setattr(output, data, None)
            setattr(output, scale, None)
    output._fp8_dtype = quantizer.dtype
    output._with_gemm_swizzled_scales = bool(quantizer.optimize_for_gemm)
    return output


def _new_output(quantizer: Any, data: _mx.MXFP8Data, dtype: torch.dtype, device: torch.device):
    """Wrap fresh buffers the way TE's ``MXFP8Quantizer::create_tensor`` does."""
    _, tensor_cls, storage_cls = _mxfp8_classes()
    buffers = {
        "rowwise_data": data.rowwise_data,
        "rowwise_scale_inv": data.rowwise_scale_inv,
        "columnwise_data": data.columnwise_data,
        "columnwise_scale_inv": data.columnwise_scale_inv,
        "fp8_dtype": quantizer.dtype,
        "quantizer": quantizer,
        "with_gemm_swizzled_scales": bool(quantizer.optimize_for_gemm),
    }
    if quantizer.internal:
        return storage_cls(fake_dtype=dtype, **buffers)
    return tensor_cls(shape=data.shape, dtype=dtype, device=device, **buffers)


def _empty_data(quantizer: Any, shape: tuple[int, ...], device: torch.device) -> _mx.MXFP8Data:
    fp8 = _torch_dtype(quantizer.dtype)
    data = _mx.MXFP8Data(shape, fp8, None, None, None, None, bool(quantizer.optimize_for_gemm))
    if quantizer.rowwise_usage:
        data.rowwise_data = torch.zeros(shape, dtype=torch.uint8, device=device)
        data.rowwise_scale_inv = _scale_buffer(_mx.rowwise_scale_shape(shape), device)
    if quantizer.columnwise_usage:
        data.columnwise_data = torch.zeros(shape, dtype=torch.uint8, device=device)
        data.columnwise_scale_inv = _scale_buffer(_mx.columnwise_scale_shape(shape), device)
    return data


def quantize(
    tensor: torch.Tensor, quantizer: Any, output: Any = None, noop: torch.Tensor | None = None
) -> Any:
    """``tex.quantize``: MXFP8 or blockwise FP8, into a new tensor or in place into ``output``.

    ``noop`` (a float tensor) set to 1 skips the cast, as TE's kernels do.
    """
    if isinstance(quantizer, _blockwise_classes()[0]):
        return _blockwise_quantize(tensor, quantizer, output, noop)
    quantizer_cls, _, _ = _mxfp8_classes()
    if not isinstance(quantizer, quantizer_cls):
        raise NotImplementedError(
            f"tex.quantize with {type(quantizer).__name__} is not implemented by {_BACKEND}; "
            "only MXFP8Quantizer and Float8BlockQuantizer are"
        )
    if not isinstance(tensor, torch.Tensor) or hasattr(tensor, "_quantizer"):
        raise TypeError("tex.quantize expects a plain high-precision torch.Tensor")
    src = tensor.detach().contiguous()
    shape = tuple(src.shape)
    _mx.flat_2d_shape(shape)
    skip = noop is not None and bool((noop.reshape(-1)[:1] == 1.0).all())
    if output is None:
        if skip or src.numel() == 0:
            data = _empty_data(quantizer, shape, src.device)
        else:
            data = _mx.quantize(
                src,
                _torch_dtype(quantizer.dtype),
                rowwise=quantizer.rowwise_usage,
                columnwise=quantizer.columnwise_usage,
                two_d=bool(quantizer.with_2d_quantization),
                swizzle=bool(quantizer.optimize_for_gemm),
            )
        return _new_output(quantizer, data, src.dtype, src.device)

    out = _prepare_output(quantizer, output, shape)
    if skip or src.numel() == 0:
        return out
    names = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
    buffers = {name: getattr(out, "_" + name) for name in names}
    expected = {
        "rowwise_data": shape,
        "columnwise_data": shape,
        "rowwise_scale_inv": _mx.rowwise_scale_shape(shape),
        "columnwise_scale_inv": _mx.columnwise_scale_shape(shape),
    }
    # In place (megatron and TE keep views of these buffers). Non-contiguous buffers, and
    # scale buffers cut to fewer rows (e.g. by a split), are filled through a copy.
    direct = {
        name: buf
        if buf is not None and buf.is_contiguous() and tuple(buf.shape) == tuple(expected[name])
        else None
        for name, buf in buffers.items()
    }
    fp8 = _torch_dtype(quantizer.dtype)
    with torch.no_grad():
        data = _mx.quantize(
            src,
            fp8,
            rowwise=quantizer.rowwise_usage,
            columnwise=quantizer.columnwise_usage,
            two_d=bool(quantizer.with_2d_quantization),
            swizzle=bool(quantizer.optimize_for_gemm),
            out=_mx.MXFP8Data(shape, fp8, **direct),
        )
        for name, buf in buffers.items():
            if buf is not None and direct[name] is None:
                _copy_into(buf, getattr(data, name), name, bool(quantizer.optimize_for_gemm))
    return out


def _copy_into(buf: torch.Tensor, value: torch.Tensor, name: str, swizzled: bool) -> None:
    """Copy ``value`` into an existing buffer; a scale buffer may hold a top-left region."""
    target = buf.view(torch.uint8)
    if tuple(target.shape) == tuple(value.shape) or "scale" not in name:
        target.copy_(value.view(target.shape))
        return
    rows, cols = target.shape
    if swizzled or rows > value.shape[0] or cols > value.shape[1]:
        raise ValueError(
            f"cannot write {name} of shape {tuple(value.shape)} into a buffer of shape "
            f"{tuple(target.shape)}"
        )
    target.copy_(value[:rows, :cols])


def dequantize(input: Any, otype: Any) -> torch.Tensor:  # noqa: A002 - TE's argument name
    """``tex.dequantize``: MXFP8 only, from rowwise data when present, else columnwise."""
    _, _, storage_cls = _mxfp8_classes()
    if not isinstance(input, storage_cls):
        raise NotImplementedError(
            f"tex.dequantize of {type(input).__name__} is not implemented by {_BACKEND}; "
            "only MXFP8 tensors are"
        )
    dtype = _torch_dtype(otype)
    fp8 = _torch_dtype(input._fp8_dtype)
    swizzled = bool(input._with_gemm_swizzled_scales)
    if input._rowwise_data is not None:
        codes, scales, columnwise = input._rowwise_data, input._rowwise_scale_inv, False
    elif input._columnwise_data is not None:
        codes, scales, columnwise = input._columnwise_data, input._columnwise_scale_inv, True
    else:
        raise ValueError("Cannot dequantize an MXFP8 tensor that holds no data")
    if codes.numel() == 0:
        return torch.empty(codes.shape, dtype=dtype, device=codes.device)
    return _mx.dequantize_codes(codes, scales, fp8, columnwise, dtype, swizzled)


# --------------------------------------------------------------------------------------------
# Blockwise FP8 (Float8BlockQuantizer / Float8BlockwiseQTensor)
# --------------------------------------------------------------------------------------------


def _blockwise_classes() -> tuple[type, type, type]:
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import (
        Float8BlockQuantizer,
        Float8BlockwiseQTensor,
    )
    from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
        Float8BlockwiseQTensorStorage,
    )

    return Float8BlockQuantizer, Float8BlockwiseQTensor, Float8BlockwiseQTensorStorage


def _block_dim(quantizer: Any) -> int:
    block_dim = int(quantizer.block_scaling_dim)
    if block_dim not in (1, 2):
        raise ValueError(f"Unsupported block scaling dim: {block_dim} (expected 1 or 2)")
    return block_dim


def _noop_set(noop: torch.Tensor | None) -> bool:
    return noop is not None and bool((noop.reshape(-1)[:1] == 1.0).all())


def _blockwise_empty(
    quantizer: Any, shape: tuple[int, ...], block_dim: int, device: torch.device
) -> _bw.BlockwiseData:
    """Zeroed buffers in TE's layout (TE allocates them uninitialised)."""
    data = _bw.BlockwiseData(
        shape, _torch_dtype(quantizer.dtype), block_dim, None, None, None, None
    )
    f32 = torch.float32
    if quantizer.rowwise_usage:
        data.rowwise_data = torch.zeros(shape, dtype=torch.uint8, device=device)
        data.rowwise_scale_inv = torch.zeros(
            _bw.rowwise_scale_shape(shape, block_dim), dtype=f32, device=device
        )
    if quantizer.columnwise_usage:
        data.columnwise_data = torch.zeros(
            _bw.columnwise_data_shape(shape), dtype=torch.uint8, device=device
        )
        data.columnwise_scale_inv = torch.zeros(
            _bw.columnwise_scale_shape(shape, block_dim), dtype=f32, device=device
        )
    return data


def _blockwise_quantize_data(
    src: torch.Tensor, quantizer: Any, fp8: torch.dtype, block_dim: int, rowwise: bool, cols: bool
) -> _bw.BlockwiseData:
    return _bw.quantize(
        src,
        fp8,
        block_dim=block_dim,
        rowwise=rowwise,
        columnwise=cols,
        # TE's C++ quantizer reads both attributes (the epsilon as a C float).
        force_pow_2_scales=bool(quantizer.force_pow_2_scales),
        amax_epsilon=float(quantizer.amax_epsilon),
    )


def _blockwise_new_output(src: torch.Tensor, quantizer: Any, skip: bool) -> Any:
    """``Float8BlockQuantizer::create_tensor`` plus the quantise kernel."""
    _, tensor_cls, storage_cls = _blockwise_classes()
    shape = tuple(src.shape)
    block_dim = _block_dim(quantizer)
    if not (quantizer.rowwise_usage or quantizer.columnwise_usage):
        raise ValueError("Either rowwise or columnwise output data need to be allocated.")
    if skip or src.numel() == 0:
        data = _blockwise_empty(quantizer, shape, block_dim, src.device)
    else:
        data = _blockwise_quantize_data(
            src,
            quantizer,
            _torch_dtype(quantizer.dtype),
            block_dim,
            quantizer.rowwise_usage,
            quantizer.columnwise_usage,
        )
    buffers = {
        "rowwise_data": data.rowwise_data,
        "rowwise_scale_inv": data.rowwise_scale_inv,
        "columnwise_data": data.columnwise_data,
        "columnwise_scale_inv": data.columnwise_scale_inv,
        "fp8_dtype": quantizer.dtype,
        "quantizer": quantizer,
        "is_2D_scaled": block_dim == 2,
    }
    if quantizer.internal:
        return storage_cls(fake_dtype=src.dtype, **buffers)
    return tensor_cls(shape=shape, dtype=src.dtype, device=src.device, **buffers)


def _write_codes(buf: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if buf.dtype not in (torch.uint8, *_bw.FP8_DTYPES) or not buf.is_contiguous():
        raise ValueError(
            f"blockwise {name} must be a contiguous uint8 tensor, got {buf.dtype} with strides "
            f"{tuple(buf.stride())}"
        )
    if buf.numel() != value.numel():
        raise ValueError(
            f"blockwise {name} of shape {tuple(buf.shape)} cannot hold {tuple(value.shape)}"
        )
    buf.view(torch.uint8).view(-1).copy_(value.reshape(-1))


def _write_scales(buf: torch.Tensor, value: torch.Tensor, valid: tuple[int, int], name: str):
    """The kernels write only the scales' valid region, indexed by the buffer's own 2-D shape."""
    rows, cols = valid
    if buf.dim() != 2 or buf.shape[0] < rows or buf.shape[1] < cols or buf.dtype != torch.float32:
        raise ValueError(
            f"blockwise {name} must be a 2-D fp32 tensor with at least {rows} x {cols} entries, "
            f"got {tuple(buf.shape)} {buf.dtype}"
        )
    buf[:rows, :cols] = value[:rows, :cols]


def _blockwise_update(src: torch.Tensor, quantizer: Any, output: Any, skip: bool) -> Any:
    """``Float8BlockQuantizer::convert_and_update_tensor`` plus the kernel, in place.

    As TE: the FP8 format and 1-D/2-D mode come from the *output* tensor (``_fp8_dtype``,
    ``_is_2D_scaled``); the quantizer's usages decide which directions exist afterwards
    (missing buffers are created, unused ones dropped), and its ``force_pow_2_scales`` /
    ``amax_epsilon`` are used.
    """
    _, _, storage_cls = _blockwise_classes()
    if not isinstance(output, storage_cls):
        raise TypeError(
            f"Float8BlockQuantizer must output to a Float8BlockwiseQTensor, got {type(output)}"
        )
    fp8 = _torch_dtype(output._fp8_dtype)
    block_dim = 2 if output._is_2D_scaled else 1
    row_data, col_data = output._rowwise_data, output._columnwise_data
    if row_data is None and col_data is None:
        raise ValueError("FP8BlockwiseTensor has no data.")
    if row_data is not None:
        shape = tuple(row_data.shape)
    else:
        stored = tuple(col_data.shape)
        shape = (*stored[1:], stored[0]) if stored else ()
    if shape != tuple(src.shape):
        raise ValueError(
            f"cannot quantize a tensor of shape {tuple(src.shape)} into a blockwise FP8 tensor "
            f"of shape {shape}"
        )
    device = (row_data if row_data is not None else col_data).device
    if quantizer.rowwise_usage:
        if output._rowwise_data is None:
            output._rowwise_data = torch.zeros(shape, dtype=torch.uint8, device=device)
        if output._rowwise_scale_inv is None:
            output._rowwise_scale_inv = torch.zeros(
                quantizer.get_scale_shape(shape, False), dtype=torch.float32, device=device
            )
    else:
        output._rowwise_data = output._rowwise_scale_inv = None
    if quantizer.columnwise_usage:
        if output._columnwise_data is None:
            output._columnwise_data = torch.zeros(
                _bw.columnwise_data_shape(shape), dtype=torch.uint8, device=device
            )
        if output._columnwise_scale_inv is None:
            output._columnwise_scale_inv = torch.zeros(
                quantizer.get_scale_shape(shape, True), dtype=torch.float32, device=device
            )
    else:
        output._columnwise_data = output._columnwise_scale_inv = None
    if skip or src.numel() == 0:
        return output
    if not (quantizer.rowwise_usage or quantizer.columnwise_usage):
        raise ValueError("Either rowwise or columnwise output data need to be allocated.")
    data = _blockwise_quantize_data(
        src.to(device),
        quantizer,
        fp8,
        block_dim,
        quantizer.rowwise_usage,
        quantizer.columnwise_usage,
    )
    with torch.no_grad():
        for direction in ("rowwise", "columnwise"):
            codes = getattr(data, f"{direction}_data")
            if codes is None:
                continue
            _write_codes(getattr(output, f"_{direction}_data"), codes, f"{direction}_data")
            _write_scales(
                getattr(output, f"_{direction}_scale_inv"),
                getattr(data, f"{direction}_scale_inv"),
                _bw.valid_scale_shape(shape, block_dim, direction == "columnwise"),
                f"{direction}_scale_inv",
            )
    return output


def _blockwise_quantize(
    tensor: torch.Tensor, quantizer: Any, output: Any, noop: torch.Tensor | None
) -> Any:
    if not isinstance(tensor, torch.Tensor) or hasattr(tensor, "_quantizer"):
        raise TypeError("tex.quantize expects a plain high-precision torch.Tensor")
    src = tensor.detach().contiguous()
    if src.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"blockwise FP8 quantizes bf16, fp16 or fp32 tensors, got {src.dtype}")
    skip = _noop_set(noop)
    if output is None:
        return _blockwise_new_output(src, quantizer, skip)
    return _blockwise_update(src, quantizer, output, skip)


def fp8_transpose(input: torch.Tensor, dtype: Any, *, out: torch.Tensor | None):  # noqa: A002
    """``tex.fp8_transpose``: the ``[M, N]`` byte matrix of ``input`` (``N`` its last dim)
    transposed into ``out`` (a new uint8 ``[N, *leading]`` tensor when None). As in TE's
    binding, ``out`` is a required keyword argument."""
    if int(dtype) not in (int(DType.kFloat8E4M3), int(DType.kFloat8E5M2), int(DType.kByte)):
        raise ValueError(f"fp8_transpose expects an FP8 dtype, got {dtype!r}")
    shape = tuple(input.shape)
    rows, cols = _bw.flat_2d_shape(shape)
    if out is None:
        out = torch.empty(_bw.columnwise_data_shape(shape), dtype=torch.uint8, device=input.device)
    if rows == 0 or cols == 0:
        return out
    if input.element_size() != 1:
        raise ValueError(f"fp8_transpose expects 1-byte elements, got {input.dtype}")
    if not out.is_contiguous() or out.numel() != rows * cols or out.element_size() != 1:
        raise ValueError(
            f"fp8_transpose output must be a contiguous 1-byte tensor of {rows * cols} elements, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    source = input.contiguous().view(torch.uint8).reshape(rows, cols)
    with torch.no_grad():
        out.view(torch.uint8).view(cols, rows).copy_(source.t())
    return out


def _check_block_len(block_len: int) -> None:
    if int(block_len) != _bw.BLOCK_LEN:
        raise ValueError("Currently only block_len = 128 is supported")


def _check_block_shard(input: torch.Tensor, h: int, w: int, start_offset: int) -> None:  # noqa: A002
    if input.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"input must be a float or bfloat16 tensor, got {input.dtype}")
    if h <= 0 or w <= 0 or start_offset < 0 or start_offset + input.numel() > h * w:
        raise ValueError(
            f"a shard of {input.numel()} elements at offset {start_offset} does not fit a "
            f"{h} x {w} weight"
        )


def _check_tile_grid(buf: torch.Tensor, h: int, w: int, name: str) -> None:
    need = (-(-h // _bw.BLOCK_LEN), -(-w // _bw.BLOCK_LEN))
    if buf.dim() != 2 or buf.dtype != torch.float32:
        raise ValueError(f"{name} must be a 2D float tensor, got {tuple(buf.shape)} {buf.dtype}")
    if buf.shape[0] < need[0] or buf.shape[1] < need[1]:
        raise ValueError(f"{name} of shape {tuple(buf.shape)} cannot index {need} tiles")


def fp8_block_scaling_compute_partial_amax(
    tensor: torch.Tensor, amax: torch.Tensor, h: int, w: int, start_offset: int, block_len: int
) -> None:
    """128x128 tile amaxes of a flat shard of an ``h x w`` weight, written into ``amax``
    (``[m_tile, k_tile]``, every tile: 0 where the shard has no element; padding untouched)."""
    _check_block_len(block_len)
    _check_block_shard(tensor, int(h), int(w), int(start_offset))
    _check_tile_grid(amax, int(h), int(w), "amax")
    _bw.compute_partial_amax(tensor, (int(h), int(w)), int(start_offset), amax)


def fp8_block_scaling_partial_cast(
    inp: torch.Tensor,
    out: torch.Tensor,
    scale: torch.Tensor,
    h: int,
    w: int,
    start_offset: int,
    block_len: int,
    out_dtype: Any,
) -> None:
    """FP8 codes of a flat shard with the per-tile *scale*, written into ``out`` (the shard's
    slice of the weight's rowwise data). TE's kernel may also write bytes of the touched tiles
    outside the shard (overwritten by the all-gather that follows); the emulation writes only
    the shard."""
    _check_block_len(block_len)
    if int(out_dtype) not in (int(DType.kFloat8E4M3), int(DType.kFloat8E5M2)):
        raise ValueError("out_dtype must be kFloat8E4M3 or kFloat8E5M2")
    if out.dtype != torch.uint8:
        raise ValueError(f"output must be a uint8 tensor, got {out.dtype}")
    _check_block_shard(inp, int(h), int(w), int(start_offset))
    _check_tile_grid(scale, int(h), int(w), "scale")
    if out.numel() != inp.numel():
        raise ValueError(f"output holds {out.numel()} elements, the shard {inp.numel()}")
    codes = _bw.partial_cast(
        inp, scale, (int(h), int(w)), int(start_offset), _torch_dtype(out_dtype)
    )
    with torch.no_grad():
        out.copy_(codes.view(out.shape))


def multi_tensor_compute_scale_and_scale_inv(
    chunk_size: int,
    noop_flag: Any,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    max_fp8: float,
    force_pow_2_scales: bool,
    epsilon: float,
) -> None:
    """``scale = compute_scale_from_amax(amax, max_fp8, pow2, epsilon, FLT_MAX)`` and
    ``scale_inv = 1 / scale`` for every element of each (amax, scale, scale_inv) triple."""
    for amax, scale, scale_inv in zip(*tensor_lists[:3], strict=True):
        for name, t in (("amax", amax), ("scale", scale), ("scale_inv", scale_inv)):
            if t.dtype != torch.float32 or t.numel() != amax.numel():
                raise ValueError(f"{name} must be fp32 with {amax.numel()} elements")
        value = _bw.compute_scale(
            amax, float(max_fp8), bool(force_pow_2_scales), float(epsilon), _bw.FLT_MAX
        )
        with torch.no_grad():
            scale.copy_(value.reshape(scale.shape))
            scale_inv.copy_(_bw.scale_inv_from_scale(value).reshape(scale_inv.shape))


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


def multi_tensor_compute_scale_inv_e8m0(
    chunk_size: int, dummy: Any, tensor_lists: Sequence[Sequence[torch.Tensor]]
) -> None:
    """E8M0 scales from bf16 block amaxes, always for e4m3 (as TE's kernel)."""
    if dummy is not None:
        raise ValueError("multi_tensor_compute_scale_inv_e8m0: No-op flag is not supported.")
    for amax, scale_inv in zip(tensor_lists[0], tensor_lists[1], strict=True):
        if amax.dtype != torch.bfloat16:
            raise ValueError(f"amax should be bf16, got {amax.dtype}")
        with torch.no_grad():
            scale_inv.view(torch.uint8).copy_(_mx.e8m0_from_amax(amax, torch.float8_e4m3fn))


def _check_partial_args(input: torch.Tensor, rows: int, cols: int, start_offset: int) -> None:  # noqa: A002
    if input.dim() != 1:
        raise ValueError(f"input must be a 1D tensor, got shape {tuple(input.shape)}")
    if rows % 32 or cols % 32:
        raise ValueError(f"rows and cols must be divisible by 32, got {rows} x {cols}")
    if start_offset + input.numel() > rows * cols:
        raise ValueError("Invalid start_offset")


def mxfp8_scaling_compute_partial_amax(
    input: torch.Tensor,  # noqa: A002 - TE's argument name
    amax_rowwise: torch.Tensor,
    amax_colwise: torch.Tensor,
    rows: int,
    cols: int,
    start_offset: int,
) -> None:
    """Block amaxes of a flat master-weight shard, written into padded amax buffers."""
    _check_partial_args(input, rows, cols, start_offset)
    for name, amax in (("amax_rowwise", amax_rowwise), ("amax_colwise", amax_colwise)):
        if amax.dtype != input.dtype:
            raise ValueError(f"Wrong dtype of {name}: {amax.dtype}, input is {input.dtype}")
    with torch.no_grad():
        _mx.compute_partial_amax(input, (rows, cols), start_offset, amax_rowwise, amax_colwise)


def mxfp8_scaling_partial_cast(
    input: torch.Tensor,  # noqa: A002 - TE's argument name
    output_rowwise: torch.Tensor,
    output_colwise: torch.Tensor,
    scale_inv_rowwise: torch.Tensor,
    scale_inv_colwise: torch.Tensor,
    rows: int,
    cols: int,
    start_offset: int,
) -> None:
    """e4m3 codes of a flat master-weight shard, written into flat slices of the weight data."""
    _check_partial_args(input, rows, cols, start_offset)
    for name, out in (("output_rowwise", output_rowwise), ("output_colwise", output_colwise)):
        if out.dim() != 1 or out.numel() != input.numel():
            raise ValueError(f"Size of input and {name} mismatch")
    row_codes, col_codes = _mx.partial_cast(
        input,
        scale_inv_rowwise.view(torch.uint8),
        scale_inv_colwise.view(torch.uint8),
        (rows, cols),
        start_offset,
        torch.float8_e4m3fn,
    )
    with torch.no_grad():
        output_rowwise.view(torch.uint8).copy_(row_codes)
        output_colwise.view(torch.uint8).copy_(col_codes)


__all__ = [
    "CommOverlap",
    "CommOverlapHelper",
    "CommOverlapP2P",
    "CommOverlapType",
    "DType",
    "FP8BwdTensors",
    "FP8FwdTensors",
    "FP8TensorMeta",
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
    "quantize",
    *_DUMMY_FUNCTIONS,
]

EMULATED = True
"""Marker: this module is the emulation, not TE's compiled extension."""


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"transformer_engine_torch.{name} is not provided by {_BACKEND}; only the MXFP8 and "
        "blockwise FP8 kernels and the names TE 2.20.2 reads at import time are"
    )
