"""The blockwise FP8 kernels of the ``transformer_engine_torch`` stand-in, over TE's classes.

Why a module of its own: this is the glue between TE 2.20's Python ``Float8BlockQuantizer`` /
``Float8BlockwiseQTensor`` and the bit-exact emulation in :mod:`nemo_lw_fp8.cpu.formats.blockwise`
(sharded cast in :mod:`.blockwise_sharded_cast`): the blockwise side of ``tex.quantize`` (1x128
and 128x128 blocks), ``fp8_transpose`` (TE's ``_create_columnwise``) and the
distributed-optimizer cast kernels (``fp8_block_scaling_compute_partial_amax``,
``multi_tensor_compute_scale_and_scale_inv``, ``fp8_block_scaling_partial_cast``). There is no
blockwise ``dequantize``: TE dequantises blockwise tensors in its own Python code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nemo_lw_fp8.cpu.formats import blockwise as _bw
from nemo_lw_fp8.cpu.formats import blockwise_sharded_cast as _bws
from nemo_lw_fp8.cpu.te.tex.common import DType, noop_set, plain_source, torch_dtype, wrap_quantized

__all__ = [
    "blockwise_classes",
    "fp8_block_scaling_compute_partial_amax",
    "fp8_block_scaling_partial_cast",
    "fp8_transpose",
    "multi_tensor_compute_scale_and_scale_inv",
    "quantize_blockwise",
]


def blockwise_classes() -> tuple[type, type, type]:
    """TE's (quantizer, tensor, storage) blockwise FP8 classes, imported when first needed."""
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


def _blockwise_empty(
    quantizer: Any, shape: tuple[int, ...], block_dim: int, device: torch.device
) -> _bw.BlockwiseData:
    """Zeroed buffers in TE's layout (TE allocates them uninitialised)."""
    data = _bw.BlockwiseData(shape, torch_dtype(quantizer.dtype), block_dim, None, None, None, None)
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


def empty_blockwise(
    quantizer: Any, shape: tuple[int, ...], fake_dtype: torch.dtype, device: torch.device
) -> Any:
    """``Float8BlockQuantizer::create_tensor`` without a cast: the buffers of the quantizer's
    usages (rowwise data, transposed columnwise data, fp32 scales) in TE's blockwise class."""
    if not (quantizer.rowwise_usage or quantizer.columnwise_usage):
        raise ValueError("Either rowwise or columnwise output data need to be allocated.")
    block_dim = _block_dim(quantizer)
    data = _blockwise_empty(quantizer, shape, block_dim, device)
    return wrap_quantized(
        blockwise_classes(), quantizer, data, fake_dtype, device, is_2D_scaled=block_dim == 2
    )


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
            torch_dtype(quantizer.dtype),
            block_dim,
            quantizer.rowwise_usage,
            quantizer.columnwise_usage,
        )
    return wrap_quantized(
        blockwise_classes(), quantizer, data, src.dtype, src.device, is_2D_scaled=block_dim == 2
    )


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
    _, _, storage_cls = blockwise_classes()
    if not isinstance(output, storage_cls):
        raise TypeError(
            f"Float8BlockQuantizer must output to a Float8BlockwiseQTensor, got {type(output)}"
        )
    fp8 = torch_dtype(output._fp8_dtype)
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


def quantize_blockwise(
    tensor: torch.Tensor, quantizer: Any, output: Any, noop: torch.Tensor | None
) -> Any:
    """``tex.quantize`` for a ``Float8BlockQuantizer``: a new tensor, or in place into
    ``output``."""
    src = plain_source(tensor)
    if src.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"blockwise FP8 quantizes bf16, fp16 or fp32 tensors, got {src.dtype}")
    skip = noop_set(noop)
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
    _bws.compute_partial_amax(tensor, (int(h), int(w)), int(start_offset), amax)


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
    codes = _bws.partial_cast(
        inp, scale, (int(h), int(w)), int(start_offset), torch_dtype(out_dtype)
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
