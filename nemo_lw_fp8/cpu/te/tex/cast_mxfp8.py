"""The MXFP8 kernels of the ``transformer_engine_torch`` stand-in, over TE's own MXFP8 classes.

Why a module of its own: this is the glue between TE 2.20's Python ``MXFP8Quantizer`` /
``MXFP8Tensor`` and the bit-exact emulation in :mod:`nemo_lw_fp8.cpu.formats.mxfp8` (format in
:mod:`.mxfp8_layout`, sharded cast in :mod:`.mxfp8_sharded_cast`): the MXFP8 side of
``tex.quantize``, ``tex.dequantize`` and the distributed-optimizer cast kernels
(``mxfp8_scaling_compute_partial_amax``, ``multi_tensor_compute_scale_inv_e8m0``,
``mxfp8_scaling_partial_cast``). Argument conventions follow TE's bindings and their call sites
(``tensor/mxfp8_tensor.py``, ``tensor/utils.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nemo_lw_fp8.cpu.formats import mxfp8 as _mx
from nemo_lw_fp8.cpu.formats import mxfp8_layout as _mxf
from nemo_lw_fp8.cpu.formats import mxfp8_sharded_cast as _mxs
from nemo_lw_fp8.cpu.te.tex.common import (
    BACKEND,
    noop_set,
    plain_source,
    torch_dtype,
    wrap_quantized,
)

__all__ = [
    "dequantize",
    "empty_mxfp8",
    "multi_tensor_compute_scale_inv_e8m0",
    "mxfp8_classes",
    "mxfp8_scaling_compute_partial_amax",
    "mxfp8_scaling_partial_cast",
    "quantize_mxfp8",
]


def mxfp8_classes() -> tuple[type, type, type]:
    """TE's (quantizer, tensor, storage) MXFP8 classes, imported when first needed."""
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer, MXFP8Tensor
    from transformer_engine.pytorch.tensor.storage.mxfp8_tensor_storage import (
        MXFP8TensorStorage,
    )

    return MXFP8Quantizer, MXFP8Tensor, MXFP8TensorStorage


def _scale_buffer(shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """Zeroed uint8 E8M0 scales (TE leaves compact padding uninitialised)."""
    return torch.zeros(shape, dtype=torch.uint8, device=device)


def _prepare_output(quantizer: Any, output: Any, shape: tuple[int, ...]) -> Any:
    """Make an existing MXFP8 tensor match the quantizer's usages (TE's convert_and_update)."""
    _, _, storage_cls = mxfp8_classes()
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
        (quantizer.rowwise_usage, "_rowwise_data", "_rowwise_scale_inv", _mxf.rowwise_scale_shape),
        (
            quantizer.columnwise_usage,
            "_columnwise_data",
            "_columnwise_scale_inv",
            _mxf.columnwise_scale_shape,
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


def _empty_data(quantizer: Any, shape: tuple[int, ...], device: torch.device) -> _mx.MXFP8Data:
    fp8 = torch_dtype(quantizer.dtype)
    data = _mx.MXFP8Data(shape, fp8, None, None, None, None, bool(quantizer.optimize_for_gemm))
    if quantizer.rowwise_usage:
        data.rowwise_data = torch.zeros(shape, dtype=torch.uint8, device=device)
        data.rowwise_scale_inv = _scale_buffer(_mxf.rowwise_scale_shape(shape), device)
    if quantizer.columnwise_usage:
        data.columnwise_data = torch.zeros(shape, dtype=torch.uint8, device=device)
        data.columnwise_scale_inv = _scale_buffer(_mxf.columnwise_scale_shape(shape), device)
    return data


def empty_mxfp8(
    quantizer: Any, shape: tuple[int, ...], fake_dtype: torch.dtype, device: torch.device
) -> Any:
    """``MXFP8Quantizer::create_tensor`` without a cast: the buffers of the quantizer's usages
    (uint8 data of ``shape``, padded uint8 scales) in TE's MXFP8 tensor (or storage) class."""
    _mxf.flat_2d_shape(shape)
    return wrap_quantized(
        mxfp8_classes(),
        quantizer,
        _empty_data(quantizer, shape, device),
        fake_dtype,
        device,
        with_gemm_swizzled_scales=bool(quantizer.optimize_for_gemm),
    )


def quantize_mxfp8(
    tensor: torch.Tensor, quantizer: Any, output: Any = None, noop: torch.Tensor | None = None
) -> Any:
    """``tex.quantize`` for an ``MXFP8Quantizer``: a new tensor, or in place into ``output``."""
    src = plain_source(tensor)
    shape = tuple(src.shape)
    _mxf.flat_2d_shape(shape)
    skip = noop_set(noop)
    if output is None:
        if skip or src.numel() == 0:
            data = _empty_data(quantizer, shape, src.device)
        else:
            data = _mx.quantize(
                src,
                torch_dtype(quantizer.dtype),
                rowwise=quantizer.rowwise_usage,
                columnwise=quantizer.columnwise_usage,
                two_d=bool(quantizer.with_2d_quantization),
                swizzle=bool(quantizer.optimize_for_gemm),
            )
        return wrap_quantized(
            mxfp8_classes(),
            quantizer,
            data,
            src.dtype,
            src.device,
            with_gemm_swizzled_scales=bool(quantizer.optimize_for_gemm),
        )

    out = _prepare_output(quantizer, output, shape)
    if skip or src.numel() == 0:
        return out
    names = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
    buffers = {name: getattr(out, "_" + name) for name in names}
    expected = {
        "rowwise_data": shape,
        "columnwise_data": shape,
        "rowwise_scale_inv": _mxf.rowwise_scale_shape(shape),
        "columnwise_scale_inv": _mxf.columnwise_scale_shape(shape),
    }
    # In place (megatron and TE keep views of these buffers). Non-contiguous buffers, and
    # scale buffers cut to fewer rows (e.g. by a split), are filled through a copy.
    direct = {
        name: buf
        if buf is not None and buf.is_contiguous() and tuple(buf.shape) == tuple(expected[name])
        else None
        for name, buf in buffers.items()
    }
    fp8 = torch_dtype(quantizer.dtype)
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
    _, _, storage_cls = mxfp8_classes()
    if not isinstance(input, storage_cls):
        raise NotImplementedError(
            f"tex.dequantize of {type(input).__name__} is not implemented by {BACKEND}; "
            "only MXFP8 tensors are"
        )
    dtype = torch_dtype(otype)
    fp8 = torch_dtype(input._fp8_dtype)
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
            scale_inv.view(torch.uint8).copy_(_mxf.e8m0_from_amax(amax, torch.float8_e4m3fn))


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
        _mxs.compute_partial_amax(input, (rows, cols), start_offset, amax_rowwise, amax_colwise)


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
    row_codes, col_codes = _mxs.partial_cast(
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
