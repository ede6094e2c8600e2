"""``tex.split_quantize`` with NVFP4 quantizers: TE 2.20's multi-tensor NVFP4 cast, per split.

Why a module of its own: TE's ``GroupedLinear`` (megatron's ``TEGroupedMLP`` with discrete
expert weights) casts its input and its gradient with ``split_quantize``, and for NVFP4 TE's C++
(``pytorch/csrc/extensions/cast.cpp``: ``split_quantize``, ``bulk_allocate_nvfp4_tensors``,
``split_quantize_nvfp4_impl`` and its two helpers) does not call the single-tensor cast but
grouped kernels (``common/hadamard_transform/group_hadamard_transform.cu``,
``group_row_cast_col_hadamard_transform_cast_fusion.cu``, ``cast/cast_grouped.cu``). What they
compute, read from that source (docs/nvfp4.md, "Grouped experts"):

* **Allocation.** Unless ``disable_bulk_allocation``, all outputs are ``NVFP4TensorStorage``
  (whatever ``internal`` says) with one group-wide ``with_gemm_swizzled_scales``: set only when
  the quantizers have ``optimize_for_gemm`` and ``with_rht`` and every split is eligible for the
  *grouped* fused RHT cast (rows a multiple of 128, not 64 as for one tensor; columns of 128;
  SM 10.0 to 11.0). The quantizers must agree on both flags (TE's error otherwise).
* **Dispatch.** The fused NVFP4 path runs when the outputs are bulk-allocated, not row-scaled,
  the inner dim is a multiple of 128 and the buffers are contiguous (always so once the inner dim
  is a multiple of 128 and the rows of 16). Otherwise each split goes to the single-tensor cast
  (``multi_tensor_quantize_impl`` -> ``NVFP4Quantizer::quantize``): exactly ``tex.quantize``.
* **Amax: one per split, never shared.** The grouped amax kernel maps each 64-row chunk to its
  split (``split_sections_range``) and reduces into that split's buffers, zeroed first (empty
  splits are skipped: their buffers are not written). Without the RHT (``nvte_group_amax``) it is
  ``max |x|`` of the split's bf16 values (``max.xorsign.abs.bf16x2``, the instruction of the
  single-tensor amax), copied to the columnwise amax; with the RHT
  (``nvte_group_hadamard_transform_amax``) the rowwise amax is ``max |x|`` and the columnwise one
  ``max |RHT(x^T)|`` over the bf16 transform, as for one tensor.
* **Cast.** Without the RHT, ``nvte_quantize_v2`` per non-empty split with that amax: the plain
  1x16 cast of the split. With the RHT on SM 10.0-11.0: every split a multiple of 128 rows ->
  ``nvte_group_hadamard_transform_cast_fusion`` (rowwise cast and columnwise RHT cast in one
  kernel, the same per-split arithmetic as the single fused kernel: the encode scale
  ``448 * 6 / amax`` capped, the block scale ``e4m3(block_amax * S_enc / 6)``, the accumulator
  rounded to bf16 and back unless fast math); otherwise ``nvte_group_nvfp4_quantize_with_amax``
  (rowwise) and ``nvte_group_hadamard_transform_cast_fusion_columnwise``. Either way each split's
  bytes are those of the single-tensor cast of that split, in the group's scale layout. Off
  SM 10.0-11.0 the RHT splits take the single-tensor path.
* **Checks TE makes** (raised with TE's words): 16x16 blocks ("does not support 2D
  quantization"), non-bf16 input (RHT, and the grouped amax without it), a split that is not a
  multiple of 64 rows (the grouped amax kernel), more than 64 splits.

Refused by name (not compared): non-finite input on the grouped kernels (the bf16x2 max and the
fused kernel's NaN handling differ from the plain cast's), the grouped amax without the RHT off
SM >= 10.0 (its kernel body is compiled for SM 10.0+ only), quantizers of one list that differ in
their usages, and everything :func:`.cast_nvfp4.check_supported` refuses (stochastic
rounding, row-scaled, 4over6, amax reduction, fast math).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nemo_lw_fp8.cpu.formats import nvfp4 as _fp4
from nemo_lw_fp8.cpu.te.tex.cast_nvfp4 import (
    _empty_data,
    _not_emulated,
    _swizzle,
    _wrap,
    check_supported,
    nvfp4_classes,
    quantize_nvfp4,
)
from nemo_lw_fp8.cpu.te.tex.common import BACKEND, plain_source

__all__ = ["grouped_swizzled_scales", "is_nvfp4_list", "split_quantize_nvfp4"]

#: ``kMaxTensorsPerKernel`` of TE's grouped amax and grouped RHT cast kernels.
MAX_SPLITS = 64


def is_nvfp4_list(quantizers: Sequence[Any]) -> bool:
    """Whether any quantizer of the list is an ``NVFP4Quantizer`` (then all must be)."""
    qcls = nvfp4_classes()[0]
    found = [isinstance(q, qcls) for q in quantizers]
    if any(found) and not all(found):
        raise NotImplementedError(
            f"tex.split_quantize with NVFP4 quantizers beside other kinds is not emulated by "
            f"{BACKEND}"
        )
    return any(found)


def _target_sm() -> int:
    from nemo_lw_fp8.cpu.te.device import require_target

    major, minor = require_target("tex.split_quantize (sm_arch)").compute_capability
    return major * 10 + minor


def grouped_swizzled_scales(quantizers: Sequence[Any], rows: Sequence[int], cols: int) -> bool:
    """``bulk_allocate_nvfp4_tensors``'s group-wide ``with_gemm_swizzled_scales``: the quantizers
    agree on ``optimize_for_gemm`` and ``with_rht`` (TE's error otherwise), both set, and every
    split eligible for the grouped fused RHT cast (``is_eligible_for_rht_cast_fusion(...,
    for_grouped_kernel=true)``: rows % 128, cols % 128, SM 10.0 to 11.0)."""
    head = quantizers[0]
    for i, q in enumerate(quantizers[1:], start=1):
        for flag in ("optimize_for_gemm", "with_rht"):
            if bool(getattr(q, flag)) != bool(getattr(head, flag)):
                raise RuntimeError(
                    "NVFP4 bulk allocation requires all quantizers in the group to share the "
                    f"same {flag} value (tensor 0={int(bool(getattr(head, flag)))}, tensor {i}="
                    f"{int(bool(getattr(q, flag)))})."
                )
    if not (head.optimize_for_gemm and head.with_rht):
        return False
    sm = _target_sm()
    aligned = all(r % 128 == 0 for r in rows) and cols % 128 == 0
    return aligned and 100 <= sm <= 110


def _check_group_kernel(src: torch.Tensor, sizes: Sequence[int]) -> None:
    """What ``group_hadamard_transform_amax`` checks (TE's words), and non-finite input."""
    if src.dtype != torch.bfloat16:
        raise RuntimeError(f"Input tensor must be BF16 tensor, but dtype is {src.dtype}.")
    if len(sizes) > MAX_SPLITS:
        raise RuntimeError(f"Number of tensors should be less than or equal to {MAX_SPLITS}")
    for i, rows in enumerate(sizes):
        if rows % 64:
            raise RuntimeError(f"component {i} of split_sections should be 64 multiple")
    if not bool(torch.isfinite(src).all()):
        raise _not_emulated("grouped split_quantize of non-finite input")


def _bulk(
    quantizers: Sequence[Any],
    datas: list[_fp4.NVFP4Data],
    src: torch.Tensor,
    swizzled: bool,
) -> list[Any]:
    """``bulk_allocate_nvfp4_tensors``' Python objects: ``NVFP4TensorStorage`` each, the group's
    scale layout."""
    out = []
    for q, data in zip(quantizers, datas, strict=True):
        rows, cols = _fp4.flat_2d(data.shape)
        if swizzled and rows * cols:
            data = _swizzle(data)
        out.append(_wrap(q, data, src.dtype, src.device, swizzled=swizzled, storage=True))
    return out


def split_quantize_nvfp4(
    tensor: torch.Tensor,
    sizes: Sequence[int],
    quantizers: Sequence[Any],
    disable_bulk_allocation: bool = False,
) -> list[Any]:
    """``tex.split_quantize`` for a list of ``NVFP4Quantizer``: the rows of ``tensor`` split by
    ``sizes``, split ``i`` cast with its own amax into ``quantizers[i]``'s usages (module doc)."""
    for q in quantizers:
        check_supported(q)
    src = plain_source(tensor).contiguous()
    parts = [p.contiguous() for p in torch.split(src, list(sizes))]
    if disable_bulk_allocation:
        return [quantize_nvfp4(p, q) for p, q in zip(parts, quantizers, strict=True)]
    head = quantizers[0]
    usages = (bool(head.rowwise_usage), bool(head.columnwise_usage))
    if any((bool(q.rowwise_usage), bool(q.columnwise_usage)) != usages for q in quantizers):
        raise _not_emulated("split_quantize with quantizers of different usages")
    cols = int(src.shape[-1]) if src.dim() else 1
    shapes = [tuple(int(d) for d in p.shape) for p in parts]
    swizzled = grouped_swizzled_scales(quantizers, [_fp4.flat_2d(s)[0] for s in shapes], cols)
    if src.numel() == 0:
        # split_quantize_nvfp4_impl returns at once: the bulk buffers as allocated
        datas = [_empty_data(head, s, src.device) for s in shapes]
        return _bulk(quantizers, datas, src, swizzled)
    if cols % 128:
        # TE warns and falls back to multi_tensor_quantize_impl: each split's own cast into the
        # bulk buffers (never swizzled here: the single-tensor rule needs 128 columns too)
        datas = [_single(p, q) for p, q in zip(parts, quantizers, strict=True)]
        return _bulk(quantizers, datas, src, swizzled)
    if head.with_2d_quantization:
        raise RuntimeError("NVFP4 split-quantize does not support 2D quantization")
    mask = None
    if head.with_rht:
        if src.dtype != torch.bfloat16:
            raise RuntimeError("RHT is only supported for bfloat16 input")
        if not 100 <= _target_sm() <= 110:
            # no grouped Hadamard kernels there: each split through the single-tensor path
            datas = [_single(p, q) for p, q in zip(parts, quantizers, strict=True)]
            return _bulk(quantizers, datas, src, swizzled)
        mask = int(head.rht_matrix_random_sign_mask_t)
    elif _target_sm() < 100:
        raise _not_emulated("grouped split_quantize without the RHT below SM 10.0")
    _check_group_kernel(src, sizes)
    datas = []
    for part, shape in zip(parts, shapes, strict=True):
        if part.numel() == 0:
            datas.append(_empty_data(head, shape, src.device))
            continue
        datas.append(
            _fp4.quantize(part, rowwise=usages[0], columnwise=usages[1], rht_sign_mask=mask)
        )
    return _bulk(quantizers, datas, src, swizzled)


def _single(part: torch.Tensor, quantizer: Any) -> _fp4.NVFP4Data:
    """``NVFP4Quantizer::quantize`` of one split into a bulk-allocated output (its own amax,
    its own kernel choice; an empty split is not written)."""
    shape = tuple(int(d) for d in part.shape)
    if part.numel() == 0:
        return _empty_data(quantizer, shape, part.device)
    from nemo_lw_fp8.cpu.te.tex.cast_nvfp4 import _cast

    return _cast(part, quantizer, shape)
