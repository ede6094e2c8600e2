"""``tex.group_quantize`` with an ``NVFP4Quantizer`` and NVFP4 members of grouped GEMM operands.

Why a module of its own: TE 2.20.2's op-fuser ``ops.GroupedLinear`` takes its grouped-tensor
path under ``NVFP4BlockScaling`` on an SM 10.x target whenever the RHT is on
(``is_op_fuser_grouped_tensor_path_supported``), and so does the module ``GroupedLinear`` with
``use_grouped_tensor=True``. That path casts the input and the gradient with ``group_quantize``
and multiplies with ``te_general_grouped_gemm_for_grouped_tensor`` (and its discrete-in /
discrete-out variants, :mod:`.grouped_tensor`). What TE's C++ does, read from
``pytorch/csrc/extensions/cast.cpp`` (``group_quantize``, ``group_quantize_nvfp4_impl``),
``pytorch/csrc/quantizer.cpp`` (``NVFP4Quantizer::create_grouped_tensor``),
``common/hadamard_transform/graph_safe_group_hadamard_transform.cu`` and
``graph_safe_group_row_cast_col_hadamard_transform_cast_fusion.cu`` (docs/nvfp4.md, "Single
grouped weights (the grouped-tensor path)"):

* **Only the RHT cast exists.** ``group_quantize_nvfp4_impl`` checks, in this order, that the
  quantizer has no 16x16 blocks ("2D scaling grouped quant kernel is not ready yet"), no 4over6,
  the RHT ("graph safe grouped quant kernel for non-RHT path is not ready yet") and the post-RHT
  amax. A weight quantizer of ``NVFP4BlockScaling`` (16x16 blocks, or with
  ``disable_2d_quantization`` 1x16 blocks without the RHT) therefore fails there: bf16 single
  grouped weights, which ``_get_grouped_weight_for_gemm`` casts with ``group_quantize``, do not
  run in TE 2.20.2 under NVFP4. The emulation raises TE's words (``RuntimeError``).
* **Amax: one per member.** ``nvte_group_hadamard_transform_amax_graph_safe`` zeroes every
  member's two amaxes, then reduces each 64-row chunk into the member its first row belongs to:
  the rowwise amax ``max |x|`` of the member, the columnwise one ``max |RHT(x^T)|`` over the bf16
  transform (the mask ``rht_matrix_random_sign_mask_t``), as for one tensor.
* **Cast.** ``nvte_group_hadamard_transform_cast_fusion_graph_safe``: per 128-token tile, the
  member of its first token; the rowwise plain 1x16 cast of the member with its rowwise amax,
  and the columnwise 1x16 cast of the member's bf16 RHT with its columnwise amax, in the
  arithmetic of the single fused kernel (the encode scale ``2688 / amax`` capped, 1 for a zero
  amax; the accumulator rounded to bf16 and back; ``e4m3(block_amax * S_enc / 6)``). So each
  member's bytes are :func:`.nvfp4.quantize` of the member with ``rht_sign_mask``, exactly.
* **Layout.** Rowwise data and scales are written as one matrix over all tokens (row-major data,
  scales compact or in cuBLAS's 128x4 tiles over the whole matrix); columnwise data and scales
  per member at ``tensor_offset / 2`` and ``tensor_offset / 16``, each member's ``(K, rows / 16)``
  scales compact or swizzled on their own. TE's Python (``make_grouped_tensor``,
  ``split_into_quantized_tensors``) and the grouped GEMM place member ``i``'s scales after the
  previous members' padded blocks (``round_up(rows, 128) x round_up(cols / 16, 4)``). Both agree
  when every member's rows and the columns are multiples of 128: the emulation writes each
  member's own cast into TE's Python member views. ``with_gemm_swizzled_scales`` is the
  quantizer's ``optimize_for_gemm`` (``create_grouped_tensor``).

TE's own checks, raised with TE's words: total rows and columns multiples of 128, at most 64
members, the quantizer checks above; varying last dimensions. Refused by name (not compared):
members whose rows are not a multiple of 128 (TE's kernels look up a 64-row chunk's and a
128-token tile's member by its first row, so a member boundary inside one would be cast with the
other member's amax), non-bf16 or non-finite input, a target outside SM 10.0-11.0 (the kernels
are built for it only), uniform members without ``first_dims`` (TE's cast reads them), a set
``noop`` flag (TE's NVFP4 path ignores it), an output to reuse, and everything
:func:`.cast_nvfp4.check_supported` refuses (stochastic rounding among them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nemo_lw_fp8.cpu.formats import nvfp4 as _fp4
from nemo_lw_fp8.cpu.te.tex.cast_nvfp4 import _not_emulated, check_supported, nvfp4_classes
from nemo_lw_fp8.cpu.te.tex.common import BACKEND, noop_set

__all__ = ["group_quantize_nvfp4", "is_nvfp4", "nvfp4_members"]

#: ``kMaxTensorsPerKernel`` of TE's graph-safe grouped Hadamard kernels.
MAX_MEMBERS = 64
#: Rows per member (and columns) for which TE's kernels and TE's Python place the same bytes.
ALIGN = 128


def is_nvfp4(quantizer: Any) -> bool:
    """Whether ``quantizer`` is TE's ``NVFP4Quantizer``."""
    return quantizer is not None and isinstance(quantizer, nvfp4_classes()[0])


def _check_te(quantizer: Any) -> None:
    """``group_quantize_nvfp4_impl``'s checks, in TE's order, with TE's words."""
    if quantizer.with_2d_quantization:
        raise RuntimeError("2D scaling grouped quant kernel is not ready yet")
    if quantizer.nvfp4_use_4over6:
        raise RuntimeError("NVFP4 4over6 quantization is not supported for grouped quantization.")
    if not quantizer.with_rht:
        raise RuntimeError("graph safe grouped quant kernel for non-RHT path is not ready yet")
    if not quantizer.with_post_rht_amax:
        raise RuntimeError("grouped NVFP4 RHT quantization expects post-RHT amax buffers.")


def _check_kernels(src: torch.Tensor, counts: Sequence[int], first_dims: Any) -> None:
    """What the graph-safe kernels check (TE's words), then what is refused by name."""
    rows, cols = (int(d) for d in src.shape)
    if rows % ALIGN:
        raise RuntimeError("First dimension of a grouped tensor should be divisible by 128.")
    if cols % ALIGN:
        raise RuntimeError("Last dimension of a grouped tensor should be divisible by 128.")
    if len(counts) > MAX_MEMBERS:
        raise RuntimeError(f"Number of tensors should be less than or equal to {MAX_MEMBERS}")
    from nemo_lw_fp8.cpu.te.device import require_target

    major, minor = require_target("tex.group_quantize (sm_arch)").compute_capability
    if not 100 <= major * 10 + minor <= 110:
        raise _not_emulated("grouped-tensor cast off SM 10.0-11.0 (TE builds it for those only)")
    if first_dims is None:
        raise _not_emulated("grouped-tensor RHT cast without first_dims (TE's kernel reads them)")
    bad = [c for c in counts if c % ALIGN]
    if bad:
        raise _not_emulated(
            f"grouped-tensor cast of members of {list(counts)} rows (TE's kernels assign each "
            f"64-row chunk and 128-token tile to the member of its first row; only multiples of "
            f"{ALIGN} are compared)"
        )
    if src.dtype != torch.bfloat16:
        raise _not_emulated(f"grouped-tensor RHT cast of {src.dtype} input (TE reads bf16)")
    if not bool(torch.isfinite(src).all()):
        raise _not_emulated("grouped-tensor cast of non-finite input")


def _store(member: Any, data: _fp4.NVFP4Data, swizzled: bool) -> None:
    """Write one member's cast into its views of the grouped buffers (TE's Python layout)."""
    pairs = (
        ("_rowwise_data", data.rowwise_data, False),
        ("_rowwise_scale_inv", data.rowwise_scale_inv, True),
        ("_columnwise_data", data.columnwise_data, False),
        ("_columnwise_scale_inv", data.columnwise_scale_inv, True),
        ("_amax_rowwise", data.amax_rowwise, False),
        ("_amax_columnwise", data.amax_columnwise, False),
    )
    with torch.no_grad():
        for name, value, is_scale in pairs:
            view = getattr(member, name)
            if view is None or value is None:
                continue
            if is_scale and swizzled:
                value = _fp4.swizzle_scales(value)
            view.copy_(value.reshape(view.shape))


def group_quantize_nvfp4(
    tensor: torch.Tensor,
    quantizer: Any,
    counts: Sequence[int],
    first_dims: torch.Tensor | None,
    tensor_offsets: torch.Tensor | None,
    noop_flag: torch.Tensor | None,
) -> Any:
    """``tex.group_quantize`` for an ``NVFP4Quantizer``: a ``GroupedTensor`` (TE's
    ``make_grouped_tensor``) whose member ``i`` holds the exact RHT cast of rows
    ``offsets[i]..`` of ``tensor`` with its own two amaxes (module doc)."""
    from transformer_engine.pytorch.tensor.storage.grouped_tensor_storage import (
        GroupedTensorStorage,
    )

    rows, cols = (int(d) for d in tensor.shape)
    grouped = GroupedTensorStorage.make_grouped_tensor(
        len(counts), first_dims, None, rows, cols, quantizer=quantizer, device=tensor.device,
        dtype=tensor.dtype,
    )  # fmt: skip
    if tensor_offsets is not None:
        grouped.tensor_offsets = tensor_offsets
    if rows == 0 or cols == 0:
        return grouped  # TE returns the allocation before any check or kernel
    _check_te(quantizer)
    check_supported(quantizer)
    if noop_set(noop_flag):
        raise _not_emulated("grouped-tensor cast with a set noop flag (TE's NVFP4 path ignores it)")
    src = tensor.detach().contiguous()
    _check_kernels(src, counts, first_dims)
    mask = int(quantizer.rht_matrix_random_sign_mask_t)
    swizzled = bool(grouped._with_gemm_swizzled_scales)
    usage = {
        "rowwise": bool(quantizer.rowwise_usage),
        "columnwise": bool(quantizer.columnwise_usage),
    }
    start = 0
    for count, member in zip(counts, grouped.quantized_tensors, strict=True):
        if count == 0:
            # the amax kernel zeroes every member's amaxes first; nothing else is written
            for name in ("_amax_rowwise", "_amax_columnwise"):
                if getattr(member, name) is not None:
                    with torch.no_grad():
                        getattr(member, name).zero_()
            continue
        part = src[start : start + count]
        _store(member, _fp4.quantize(part, rht_sign_mask=mask, **usage), swizzled)
        start += count
    return grouped


def nvfp4_members(grouped: Any, shapes: Sequence[tuple[int, int]]) -> list[Any]:
    """Per-member GEMM operands over a grouped NVFP4 tensor's buffers (views, no copy): TE's
    ``NVFP4TensorStorage`` with the member's data, scales at TE's padded offsets (the grouped
    GEMM's ``padded_nvfp4_scale_inv_bytes``), and its own amaxes (the grouped GEMM's alpha reads
    ``amax[i]`` of the usage it reads, as ``generic_gemm`` does for one tensor)."""
    if grouped.row_scaled_nvfp4 or grouped.nvfp4_use_4over6:
        raise _not_emulated("grouped GEMM on row-scaled or 4over6 operands")
    storage_cls = nvfp4_classes()[2]
    quantizer = grouped.quantizer
    bounds, row_sc, col_sc = [0], [0], [0]
    for r, c in shapes:
        bounds.append(bounds[-1] + r * c // 2)
        row_sc.append(row_sc[-1] + _numel(_fp4.scale_shape(r, c)))
        col_sc.append(col_sc[-1] + _numel(_fp4.scale_shape(c, r)))
    members = []
    for i, (r, c) in enumerate(shapes):
        members.append(
            storage_cls(
                rowwise_data=_cut(grouped.rowwise_data, bounds, i, (r, c // 2)),
                rowwise_scale_inv=_cut(grouped.scale_inv, row_sc, i, _fp4.scale_shape(r, c)),
                columnwise_data=_cut(grouped.columnwise_data, bounds, i, (c, r // 2)),
                columnwise_scale_inv=_cut(
                    grouped.columnwise_scale_inv, col_sc, i, _fp4.scale_shape(c, r)
                ),
                amax_rowwise=_amax(grouped.amax, i),
                amax_columnwise=_amax(grouped.columnwise_amax, i),
                fp4_dtype=quantizer.dtype,
                quantizer=quantizer,
                with_gemm_swizzled_scales=bool(grouped._with_gemm_swizzled_scales),
                row_scaled_nvfp4=False,
                nvfp4_use_4over6=False,
                nvfp4_e4m3_max=448,
                fake_dtype=grouped.fake_dtype,
            )
        )
    return members


def _cut(
    buf: torch.Tensor | None, bounds: Sequence[int], i: int, shape: Sequence[int]
) -> torch.Tensor | None:
    return None if buf is None else buf[bounds[i] : bounds[i + 1]].view(*shape)


def _amax(buf: torch.Tensor | None, i: int) -> torch.Tensor | None:
    return None if buf is None else buf[i : i + 1]


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for d in shape:
        count *= int(d)
    return count


def refuse_bias(kernel: str) -> NotImplementedError:
    """A bias on a grouped GEMM with NVFP4 operands: TE adds it in its own kernel after the
    GEMM has written D in the output dtype (``nvte_grouped_bias_add``), not in the GEMM's
    epilogue as ``generic_gemm`` does; not compared."""
    return NotImplementedError(
        f"tex.{kernel} with NVFP4 operands and a bias is not implemented by {BACKEND}"
    )
