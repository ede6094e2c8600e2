"""The NVFP4 kernels of the ``transformer_engine_torch`` stand-in, over TE's own NVFP4 classes.

Why a module of its own: this is the glue between TE 2.20's Python ``NVFP4Quantizer`` /
``NVFP4Tensor`` (``tensor/nvfp4_tensor.py``, ``tensor/storage/nvfp4_tensor_storage.py``) and the
cast in :mod:`nemo_lw_fp8.cpu.formats.nvfp4` (bit-exact per TE 2.20.2's source): the NVFP4 side
of ``tex.quantize``, ``tex.dequantize`` and ``tex.create_empty_quantized_tensor``, and the two
helpers ``NVFP4TensorStorage._create_columnwise`` calls (``nvfp4_data_transpose``,
``nvfp4_2d_scale_transpose``). What each replaces in TE's C++: ``NVFP4Quantizer::create_tensor``
and ``NVFP4Quantizer::quantize_impl`` (``pytorch/csrc/quantizer.cpp``), ``nvte_dequantize``'s
NVFP4 kernel (``common/cast/nvfp4/dequantize_nvfp4.cuh``), ``nvfp4_data_transpose`` /
``nvfp4_2d_scale_transpose`` (``pytorch/csrc/extensions/transpose.cpp``,
``common/recipe/nvfp4.cu``).

The quantizer options the emulation does not reproduce are refused by name before any byte is
written (:func:`check_supported`), never approximated.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from nemo_lw_fp8.cpu.formats import nvfp4 as _fp4
from nemo_lw_fp8.cpu.te.tex.common import BACKEND, noop_set, plain_source, torch_dtype

__all__ = [
    "check_supported",
    "dequantize_nvfp4",
    "emits_swizzled_scales",
    "empty_nvfp4",
    "nvfp4_2d_scale_transpose",
    "nvfp4_classes",
    "nvfp4_data_transpose",
    "quantize_nvfp4",
]

_FP4_DTYPE = 10  # DType.kFloat4E2M1

#: What of TE's NVFP4 runs on CPU (``doctor`` prints it; docs/nvfp4.md has the detail). "Per TE
#: 2.20.2's source": the bytes follow TE's kernels as read (and torchao's reference where the two
#: define the same arithmetic); no GPU has compared them yet (tests/cpu/test_nvfp4_gpu_bytes.py).
EMULATED = (
    "NVFP4Quantizer casts (1x16 and 16x16 blocks, rowwise / columnwise, compact and "
    "GEMM-swizzled scales), per TE 2.20.2's source",
    "random Hadamard transform of the columnwise copy (with_rht, post-RHT amax, bf16 input, "
    "1x16 blocks), per TE 2.20.2's source where a group's 16 terms span at most 12 binades",
    "generic_gemm on NVFP4 x NVFP4 operands (TE Linear's fprop, dgrad, wgrad): exact operands, "
    "fp32 product",
    "bgrad_quantize with an NVFP4 quantizer",
    "NVFP4 outputs of rmsnorm_fwd / layernorm_fwd (TE LayerNormLinear's input): the norm cast "
    "to its out_dtype, then the cast above, as TE's normalization.cpp does",
    "split_quantize with NVFP4 quantizers (TE GroupedLinear's input and gradient): one amax per "
    "split, the grouped RHT path and its group-wide scale layout, per TE 2.20.2's source as the "
    "casts above",
    "te_general_grouped_gemm on NVFP4 operands: one generic_gemm per expert, each with its own "
    "operands' alpha",
    "group_quantize with an RHT NVFP4Quantizer (the op-fuser GroupedLinear's grouped-tensor "
    "path: input and gradient) and the grouped-tensor GEMMs on NVFP4 members, FP4 primary single "
    "grouped weights included",
)
#: What is refused by name (:func:`check_supported`, the GEMM and the output-quantizing kernels).
REFUSED = (
    "stochastic rounding (set NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1 on CPU)",
    "RHT with 16x16 blocks, non-finite input, a set noop flag or a changed rht_matrix",
    "row-scaled NVFP4, 4over6, amax reduction across ranks, fast-math casts",
    "NVFP4 outputs of SwiGLU and of GEMMs; grouped split_quantize of non-finite input; "
    "group_quantize of members not a multiple of 128 rows; bf16 single grouped weights "
    "(TE 2.20.2's group_quantize has no kernel for the 16x16 / no-RHT weight quantizer)",
)


def nvfp4_classes() -> tuple[type, type, type]:
    """TE's (quantizer, tensor, storage) NVFP4 classes, imported when first needed."""
    from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer, NVFP4Tensor
    from transformer_engine.pytorch.tensor.storage.nvfp4_tensor_storage import (
        NVFP4TensorStorage,
    )

    return NVFP4Quantizer, NVFP4Tensor, NVFP4TensorStorage


def _not_emulated(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"NVFP4 {what} is not emulated yet by {BACKEND}; this code path needs a GPU with real "
        "Transformer Engine"
    )


def check_supported(quantizer: Any) -> None:
    """Refuse the ``NVFP4Quantizer`` options whose kernels are not emulated, by name."""
    if int(quantizer.dtype) != _FP4_DTYPE:
        raise ValueError(f"NVFP4Quantizer with dtype {quantizer.dtype!r}: only kFloat4E2M1 exists")
    if quantizer.with_rht:
        _check_rht(quantizer)
    if quantizer.stochastic_rounding:
        raise _not_emulated("stochastic rounding")
    if quantizer.row_scaled_nvfp4:
        raise _not_emulated("row-scaled quantization (row_scaled_nvfp4)")
    if quantizer.nvfp4_use_4over6:
        raise _not_emulated("4over6 block selection (nvfp4_use_4over6)")
    if quantizer.with_amax_reduction:
        raise _not_emulated("amax reduction across ranks (with_amax_reduction)")
    if os.environ.get("NVTE_USE_FAST_MATH", "0") not in ("", "0"):
        # the tuned 1D kernel then scales by a bf16 coefficient instead of an fp32 one
        raise _not_emulated("fast-math cast (NVTE_USE_FAST_MATH)")


def _check_rht(quantizer: Any) -> None:
    """What of ``with_rht`` is not emulated, refused by name (TE's own errors where TE has one).

    16x16 blocks: TE's fused RHT kernel ignores ``nvfp4_2d_quantization`` while its unfused path
    honours it, so the bytes would depend on the path (TE's recipe never asks for both). The
    fused kernel takes ``quantizer.rht_matrix`` and the unfused one the sign mask: a matrix that
    is not the mask's would make the two paths differ, so it is refused too."""
    if not quantizer.with_post_rht_amax:
        raise RuntimeError(
            "NVFP4 RHT cast with the amax taken before the transform: TE builds no such kernel; "
            "set with_post_rht_amax=True"
        )
    if quantizer.with_2d_quantization:
        raise _not_emulated("random Hadamard transform with 16x16 blocks (with_2d_quantization)")
    expected = _fp4.rht_matrix(quantizer.rht_matrix_random_sign_mask_t).bfloat16()
    matrix = getattr(quantizer, "rht_matrix", None)
    if matrix is None or not torch.equal(matrix.detach().cpu(), expected):
        raise _not_emulated("random Hadamard transform with an rht_matrix not of its sign mask")


def _rht_eligible_for_fusion(shape: tuple[int, ...]) -> bool:
    """``is_eligible_for_rht_cast_fusion`` (single tensor): rows % 64, cols % 128, SM 10.0-11.0."""
    rows, cols = _fp4.flat_2d(shape)
    if rows % 64 or cols % 128:
        return False
    from nemo_lw_fp8.cpu.te.device import require_target

    major, minor = require_target("NVFP4Quantizer (sm_arch)").compute_capability
    return 100 <= major * 10 + minor <= 110


def emits_swizzled_scales(quantizer: Any, shape: tuple[int, ...]) -> bool:
    """``nvfp4_emits_gemm_swizzled_scales`` (``pytorch/csrc/quantizer.cpp``): only with
    ``optimize_for_gemm``; with RHT, when the shape is eligible for the fused RHT cast (rows a
    multiple of 64, columns of 128, SM 10.0 to 11.0: that kernel writes both usages' scales
    swizzled); without, the plain 2D kernel when both flattened dims are multiples of 128 on
    SM 10.0 to 11.0 (``is_eligible_for_2d_swizzle_fusion``). Every other cast writes compact
    scales (the GEMM swizzles those itself)."""
    if not quantizer.optimize_for_gemm:
        return False
    if quantizer.with_rht:
        return _rht_eligible_for_fusion(shape)
    if not quantizer.with_2d_quantization:
        return False
    rows, cols = _fp4.flat_2d(shape)
    if rows % 128 or cols % 128:
        return False
    from nemo_lw_fp8.cpu.te.device import require_target

    major, minor = require_target("NVFP4Quantizer::create_tensor (sm_arch)").compute_capability
    return 100 <= major * 10 + minor <= 110


def _swizzle(data: _fp4.NVFP4Data) -> _fp4.NVFP4Data:
    """The scales of ``data`` rewritten in the GEMM-swizzled order (the 2D kernel's
    ``WITH_GEMM_SWIZZLED_SCALES`` stores)."""
    if data.rowwise_scale_inv is not None:
        data.rowwise_scale_inv = _fp4.swizzle_scales(data.rowwise_scale_inv)
    if data.columnwise_scale_inv is not None:
        data.columnwise_scale_inv = _fp4.swizzle_scales(data.columnwise_scale_inv)
    return data


def _wrap(
    quantizer: Any,
    data: _fp4.NVFP4Data,
    fake_dtype: torch.dtype,
    device: Any,
    swizzled: bool | None = None,
    storage: bool | None = None,
) -> Any:
    """``NVFP4Quantizer::create_tensor``'s Python object around ``data``'s buffers; ``swizzled``
    and ``storage`` override the quantizer's answers (``bulk_allocate_nvfp4_tensors`` decides
    them for a whole group)."""
    _, tensor_cls, storage_cls = nvfp4_classes()
    if swizzled is None:
        swizzled = emits_swizzled_scales(quantizer, data.shape)
    kwargs = {
        "rowwise_data": data.rowwise_data,
        "rowwise_scale_inv": data.rowwise_scale_inv,
        "columnwise_data": data.columnwise_data,
        "columnwise_scale_inv": data.columnwise_scale_inv,
        "amax_rowwise": data.amax_rowwise,
        "amax_columnwise": data.amax_columnwise,
        "fp4_dtype": quantizer.dtype,
        "quantizer": quantizer,
        "with_gemm_swizzled_scales": swizzled,
        "row_scaled_nvfp4": False,
        "nvfp4_use_4over6": False,
        "nvfp4_e4m3_max": 448,
    }
    if quantizer.internal if storage is None else storage:
        return storage_cls(fake_dtype=fake_dtype, **kwargs)
    return tensor_cls(shape=data.shape, dtype=fake_dtype, device=device, **kwargs)


def _empty_data(quantizer: Any, shape: tuple[int, ...], device: Any) -> _fp4.NVFP4Data:
    rows, cols = _fp4.flat_2d(shape)
    data = _fp4.NVFP4Data(shape, None, None, None, None, None, None)
    u8 = {"dtype": torch.uint8, "device": device}
    if quantizer.rowwise_usage:
        data.rowwise_data = torch.zeros((*shape[:-1], cols // 2), **u8)
        data.rowwise_scale_inv = torch.zeros(_fp4.scale_shape(rows, cols), **u8)
        data.amax_rowwise = torch.zeros(1, dtype=torch.float32, device=device)
    if quantizer.columnwise_usage:
        data.columnwise_data = torch.zeros((cols, rows // 2), **u8)
        data.columnwise_scale_inv = torch.zeros(_fp4.scale_shape(cols, rows), **u8)
        data.amax_columnwise = torch.zeros(1, dtype=torch.float32, device=device)
    return data


def empty_nvfp4(
    quantizer: Any, shape: tuple[int, ...], fake_dtype: torch.dtype, device: Any
) -> Any:
    """``NVFP4Quantizer::create_tensor`` without a cast: zeroed buffers for the usages (TE leaves
    them uninitialised), in TE's NVFP4 tensor (or storage) class."""
    check_supported(quantizer)
    return _wrap(quantizer, _empty_data(quantizer, shape, device), fake_dtype, device)


_BUFFERS = (
    "rowwise_data",
    "rowwise_scale_inv",
    "columnwise_data",
    "columnwise_scale_inv",
    "amax_rowwise",
    "amax_columnwise",
)


def _fill(output: Any, quantizer: Any, fresh: _fp4.NVFP4Data) -> Any:
    """Copy a fresh cast into an existing NVFP4 tensor (``update_quantized``), in place where the
    buffer exists (TE and megatron keep views of them), allocating the usages it lacks."""
    _, _, storage_cls = nvfp4_classes()
    if not isinstance(output, storage_cls):
        raise TypeError(f"NVFP4Quantizer must output to an NVFP4 tensor, got {type(output)}")
    if _fp4.flat_2d(tuple(output.size())) != _fp4.flat_2d(fresh.shape):
        raise ValueError(
            f"cannot quantize a tensor of shape {fresh.shape} into an NVFP4 tensor of shape "
            f"{tuple(output.size())}"
        )
    with torch.no_grad():
        for name in _BUFFERS:
            value = getattr(fresh, name)
            attr = "_" + name
            if value is None:
                setattr(output, attr, None)
                continue
            current = getattr(output, attr)
            if current is None:
                setattr(output, attr, value)
            else:
                current.view(value.dtype).copy_(value.view(current.shape))
    output._with_gemm_swizzled_scales = emits_swizzled_scales(quantizer, fresh.shape)
    return output


def _cast(src: torch.Tensor, quantizer: Any, shape: tuple[int, ...]) -> _fp4.NVFP4Data:
    mask = None
    if quantizer.with_rht:
        if src.dtype != torch.bfloat16:
            raise RuntimeError(f"NVFP4 RHT cast: TE's transform takes bf16 input, not {src.dtype}")
        if not bool(torch.isfinite(src).all()):
            # the fused kernel keeps NaN in its block amax and gives a zero global scale for an
            # infinite amax, unlike the plain cast: path-dependent, not compared
            raise _not_emulated("random Hadamard transform of non-finite input")
        mask = int(quantizer.rht_matrix_random_sign_mask_t)
    data = _fp4.quantize(
        src,
        rowwise=quantizer.rowwise_usage,
        columnwise=quantizer.columnwise_usage,
        two_d=bool(quantizer.with_2d_quantization),
        rht_sign_mask=mask,
    )
    return _swizzle(data) if emits_swizzled_scales(quantizer, shape) else data


def quantize_nvfp4(
    tensor: torch.Tensor, quantizer: Any, output: Any = None, noop: torch.Tensor | None = None
) -> Any:
    """``tex.quantize`` for an ``NVFP4Quantizer`` (``NVFP4Quantizer::quantize_impl``: without RHT
    ``nvte_compute_amax`` then ``nvte_quantize_v2``; with RHT ``nvte_hadamard_transform_amax``,
    then the fused or unfused RHT cast, the same bytes): a new tensor, or in place into
    ``output``.

    ``noop`` set to 1 skips both the amax and the cast, as TE's kernels do."""
    check_supported(quantizer)
    src = plain_source(tensor)
    shape = tuple(int(d) for d in src.shape)
    _fp4.flat_2d(shape)
    if quantizer.with_rht and noop_set(noop) and src.numel():
        # TE's Hadamard amax kernel and its fused RHT cast do not read the flag
        raise _not_emulated("random Hadamard transform with a set noop flag")
    skip = noop_set(noop) or src.numel() == 0
    if output is None:
        data = _empty_data(quantizer, shape, src.device) if skip else _cast(src, quantizer, shape)
        return _wrap(quantizer, data, src.dtype, src.device)
    if skip:
        return output
    fresh = _cast(src, quantizer, shape)
    return _fill(output, quantizer, fresh)


def dequantize_nvfp4(input: Any, otype: Any) -> torch.Tensor:  # noqa: A002 - TE's argument name
    """``tex.dequantize`` of an NVFP4 tensor: from its rowwise data, as TE's kernel (TE's Python
    refuses columnwise-only tensors before calling it). TE's ``dequantize_fp4_kernel`` reads the
    scales as compact; swizzled ones are refused by name rather than misread."""
    if input._with_gemm_swizzled_scales:
        raise _not_emulated("dequantize of GEMM-swizzled scales")
    if input._row_scaled_nvfp4 or input._nvfp4_use_4over6:
        raise _not_emulated("dequantize of row-scaled or 4over6 tensors")
    dtype = torch_dtype(otype)
    if input._rowwise_data is None:
        raise NotImplementedError("Dequantizing column-wise NVFP4 data is not implemented yet!")
    data = input._rowwise_data
    shape = (*data.shape[:-1], data.shape[-1] * 2)
    if data.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=data.device)
    out = _fp4.dequantize_codes(data, input._rowwise_scale_inv, input._amax_rowwise, dtype)
    return out.reshape(shape)


def nvfp4_data_transpose(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:  # noqa: A002
    """``tex.nvfp4_data_transpose``: ``(M, K/2)`` FP4 bytes to ``(K, M/2)``, into ``out``."""
    if input.dim() != 2:
        raise ValueError("NVFP4 transpose expects 2D input (packed storage).")
    rows, cols = input.shape[0], input.shape[1] * 2
    if rows % 2:
        raise ValueError(f"NVFP4 transpose requires M ({rows}) to be even.")
    result = (
        _fp4.transpose_packed(input)
        if rows and cols
        else torch.empty((cols, rows // 2), dtype=torch.uint8, device=input.device)
    )
    if out is None:
        return result
    if tuple(out.shape) != (cols, rows // 2):
        raise ValueError("Output shape mismatch for NVFP4 transpose.")
    with torch.no_grad():
        out.view(torch.uint8).copy_(result)
    return out


def nvfp4_2d_scale_transpose(
    input: torch.Tensor,  # noqa: A002 - TE's argument name
    output: torch.Tensor,
    M_tiles: int,  # noqa: N803 - TE's argument name
    K_tiles: int,  # noqa: N803 - TE's argument name
) -> None:
    """``tex.nvfp4_2d_scale_transpose`` (``nvfp4_scale_transpose_kernel``): for the first
    ``M_tiles`` columns, ``output[k, m] = input[16 m, k // 16]`` where ``k // 16 < K_tiles``, else
    0; other columns untouched."""
    if input.dim() != 2 or output.dim() != 2:
        raise ValueError("NVFP4 scale transpose expects 2D input and output.")
    if input.dtype != torch.uint8 or output.dtype != torch.uint8:
        raise ValueError("NVFP4 scale transpose input and output must be uint8 (E4M3).")
    k_padded = output.shape[0]
    if M_tiles == 0 or K_tiles == 0 or k_padded == 0:
        return
    block = _fp4.BLOCK
    k_tile = torch.arange(k_padded) // block
    valid = k_tile < K_tiles
    firsts = input[torch.arange(M_tiles) * block]  # (M_tiles, K_tiles_padded)
    values = firsts[:, k_tile.clamp(max=K_tiles - 1)].t()  # (K_padded, M_tiles)
    values = torch.where(valid[:, None], values, torch.zeros_like(values))
    with torch.no_grad():
        output[:, :M_tiles].copy_(values)
