"""TE 2.20.2's grouped-tensor kernels for the ``transformer_engine_torch`` stand-in.

Why: TE's op-fuser ``ops.GroupedLinear`` (megatron's ``TEGroupedMLP`` with
``use_transformer_engine_op_fuser``, the MXFP8 recipes' experts) takes its graph-safe
grouped-tensor path (``_fuser_forward_grouped_tensor`` / ``_fuser_backward_grouped_tensor``)
whenever ``is_op_fuser_grouped_tensor_path_supported`` says so: MXFP8 on an SM 10.x / 11.0
target with cuBLASLt >= 13.3. Single grouped weights (``NVTE_GROUPED_LINEAR_SINGLE_PARAM=1``)
have no other path. That path calls:

* ``splits_to_offsets_multi`` (exact): per output ``i``, the inclusive prefix sum of the split
  sizes times ``strides[i]``, with a leading zero when asked, in ``dtypes[i]``; returns the split
  sizes as int64 and the outputs (``nvte_splits_to_offsets_multi``).
* ``group_quantize`` / ``bgrad_group_quantize`` (exact; MXFP8, and NVFP4 for
  ``group_quantize`` in :mod:`.grouped_tensor_nvfp4`): each member (a split of the
  rows) quantized by the project's exact MXFP8 quantizer into a ``GroupedTensor`` built by TE's
  own ``make_grouped_tensor``; ``bgrad_group_quantize`` also returns each member's bias gradient,
  the fp32 column sum of its rows cast to the input's dtype (the fused kernel's fp32 reduction).
  TE's ``bgrad_group_quantize`` takes no NVFP4 quantizer (its error is raised).
* ``te_general_grouped_gemm_for_grouped_tensor`` and its ``_for_discrete_in`` (list of weights)
  and ``_for_discrete_out`` (list of weight gradients) variants: per member, exactly the
  computation of :func:`.gemm.generic_gemm` (the documented fp32 stand-in) with the
  member's ``alpha`` / ``beta`` (one per member from SM 10.0, one shared before), the member's
  bias; a member without rows zeroes its output unless accumulating. Grouped NVFP4 operands
  are read member by member with their own amaxes (the grouped GEMM's per-group alpha,
  ``alpha[i] * amax_A[i] * amax_B[i] / (6 * 6 * 448 * 448)``, the single GEMM's); a bias beside
  NVFP4 operands is refused by name (TE adds it after the GEMM's cast, in its own kernel).

Scale layout: TE's grouped MXFP8 kernel places member ``i``'s scales at ``tensor_offset_i / 32``
(``cast/mxfp8/group_quantize_mxfp8.cuh``) while TE's Python (``split_into_quantized_tensors``,
``make_grouped_tensor``) places them after the previous members' padded scale blocks. The two
agree exactly when every member's rows and columns are multiples of 128, which megatron's
op-fuser experts always satisfy (``get_align_size_for_quantization``: 256 tokens per expert).
Other shapes are refused by name rather than laid out one way or the other.

Refused by name: recipes other than MXFP8 and NVFP4 on this path (per-tensor current scaling,
blockwise, whose Hopper grouped path needs cuBLASLt >= 13.6), ``bias_scale`` (the scaled-bias
MoE variant), varying last dimensions, ``group_requantize_inplace`` (pre-quantized token
dispatch; absent).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nemo_lw_fp8.cpu.formats import mxfp8_layout as _mxf
from nemo_lw_fp8.cpu.te.tex import grouped_tensor_nvfp4 as _nvfp4
from nemo_lw_fp8.cpu.te.tex.common import BACKEND, te_dtype
from nemo_lw_fp8.cpu.te.tex.gemm import generic_gemm

__all__ = [
    "bgrad_group_quantize",
    "group_quantize",
    "splits_to_offsets_multi",
    "te_general_grouped_gemm_for_discrete_in",
    "te_general_grouped_gemm_for_discrete_out",
    "te_general_grouped_gemm_for_grouped_tensor",
]
TEX_KERNELS = tuple(__all__)
"""The ``transformer_engine_torch`` names this module provides."""

_ALIGN = 128
"""Rows and columns of a grouped MXFP8 member for which TE's kernel and Python scale layouts
coincide (see the module doc)."""


def _refuse(kernel: str, what: str) -> NotImplementedError:
    return NotImplementedError(f"tex.{kernel} with {what} is not implemented by {BACKEND}")


def splits_to_offsets_multi(
    split_sizes: torch.Tensor,
    device: Any,
    *,
    strides: Sequence[int],
    include_leading_zero: Sequence[bool],
    dtypes: Sequence[torch.dtype],
    bulk_allocate: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``tex.splits_to_offsets_multi`` (``ops.GroupedLinear._fuser_forward_grouped_tensor``):
    the split sizes as int64 and, per output, ``cumsum(split_sizes) * stride`` (with a leading
    zero when asked) in its dtype. ``bulk_allocate`` only changes TE's allocation."""
    del bulk_allocate
    if not len(strides) == len(include_leading_zero) == len(dtypes):
        raise ValueError(
            "strides, include_leading_zero, and dtypes must have matching lengths, but got "
            f"{len(strides)}, {len(include_leading_zero)}, and {len(dtypes)}."
        )
    sizes = split_sizes.detach().to(torch.int64).reshape(-1)
    scan = torch.cumsum(sizes, 0)
    outputs = []
    for stride, leading, dtype in zip(strides, include_leading_zero, dtypes, strict=True):
        values = scan * int(stride)
        if leading:
            values = torch.cat([values.new_zeros(1), values])
        outputs.append(values.to(dtype))
    return sizes, outputs


def _is_mxfp8_quantizer(quantizer: Any) -> bool:
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

    return isinstance(quantizer, MXFP8Quantizer)


def _member_rows(num_tensors: int, rows: int, first_dims: torch.Tensor | None) -> list[int]:
    if first_dims is None:
        if rows % num_tensors:
            raise ValueError(f"{rows} rows do not split into {num_tensors} equal members")
        return [rows // num_tensors] * num_tensors
    counts = [int(r) for r in first_dims.tolist()]
    if len(counts) != num_tensors or sum(counts) != rows:
        raise ValueError(f"first_dims {counts} do not split {rows} rows into {num_tensors}")
    return counts


def _check_alignment(kernel: str, rows: Sequence[int], cols: int) -> None:
    bad = [r for r in rows if r % _ALIGN]
    if bad or cols % _ALIGN:
        raise _refuse(
            kernel,
            f"MXFP8 members of {list(rows)} rows and {cols} columns (TE's grouped kernel and "
            f"its Python agree on the scale layout only for multiples of {_ALIGN}; megatron "
            "aligns op-fuser expert tokens to 256)",
        )


def group_quantize(
    tensor: torch.Tensor,
    quantizer: Any,
    num_tensors: int,
    first_dims: torch.Tensor | None,
    last_dims: torch.Tensor | None = None,
    tensor_offsets: torch.Tensor | None = None,
    noop_flag: torch.Tensor | None = None,
    output: Any = None,
) -> Any:
    """``tex.group_quantize`` for an ``MXFP8Quantizer``: a ``GroupedTensor`` (TE's class, from
    TE's ``make_grouped_tensor``) whose member ``i`` holds rows ``offsets[i]..`` of ``tensor``
    quantized exactly, in the quantizer's usages and scale layout."""
    from transformer_engine.pytorch.tensor.storage.grouped_tensor_storage import (
        GroupedTensorStorage,
    )

    from nemo_lw_fp8.cpu.te.tex.cast_mxfp8 import quantize_mxfp8

    if tensor.dim() != 2:
        raise ValueError("Tensor must be 2D")
    nvfp4 = _nvfp4.is_nvfp4(quantizer)
    if not (nvfp4 or _is_mxfp8_quantizer(quantizer)):
        raise _refuse("group_quantize", f"a {type(quantizer).__name__} (only MXFP8 and NVFP4)")
    if last_dims is not None:
        raise _refuse("group_quantize", "varying last dimensions")
    if output is not None:
        raise _refuse("group_quantize", "an output to reuse (CUDA-graph weight caching)")
    rows, cols = (int(d) for d in tensor.shape)
    counts = _member_rows(num_tensors, rows, first_dims)
    if nvfp4:
        _check_offsets(tensor_offsets, counts, cols)
        return _nvfp4.group_quantize_nvfp4(
            tensor, quantizer, counts, first_dims, tensor_offsets, noop_flag
        )
    if rows and cols:
        _check_alignment("group_quantize", counts, cols)
    grouped = GroupedTensorStorage.make_grouped_tensor(
        num_tensors,
        first_dims,
        None,
        rows,
        cols,
        quantizer=quantizer,
        device=tensor.device,
        dtype=tensor.dtype,
    )
    if tensor_offsets is not None:
        _check_offsets(tensor_offsets, counts, cols)
        grouped.tensor_offsets = tensor_offsets
    if rows == 0 or cols == 0 or (noop_flag is not None and bool(noop_flag.item() == 1.0)):
        return grouped
    src = tensor.detach()
    start = 0
    for count, member in zip(counts, grouped.quantized_tensors, strict=True):
        if count:
            quantize_mxfp8(src[start : start + count].contiguous(), quantizer, member)
        start += count
    return grouped


def _check_offsets(tensor_offsets: torch.Tensor | None, counts: Sequence[int], cols: int) -> None:
    """The caller's ``tensor_offsets`` must be the members' element offsets."""
    if tensor_offsets is None:
        return
    expected = [0, *torch.cumsum(torch.tensor(counts), 0).mul(cols).tolist()]
    given = [int(v) for v in tensor_offsets.tolist()]
    if given[: len(expected)] != expected:
        raise ValueError(f"tensor_offsets {given} do not match the splits {counts}")


def bgrad_group_quantize(
    tensor: torch.Tensor,
    quantizer: Any,
    num_tensors: int,
    first_dims: torch.Tensor | None,
    last_dims: torch.Tensor | None = None,
    tensor_offsets: torch.Tensor | None = None,
) -> tuple[Any, torch.Tensor]:
    """``tex.bgrad_group_quantize`` (``_fuser_backward_grouped_tensor`` with a bias):
    :func:`group_quantize` and each member's bias gradient ``[num_tensors, cols]`` (fp32 column
    sum of the member's rows, cast to the input's dtype; zero for an empty member)."""
    if last_dims is not None:
        raise _refuse("bgrad_group_quantize", "varying last dimensions")
    if _nvfp4.is_nvfp4(quantizer):
        # TE's C++ takes MXFP8 and FP8 block scaling only (its Python never asks for NVFP4)
        raise RuntimeError(
            "bgrad_group_quantize: only MXFP8 and FP8 block-scaling quantizers are supported."
        )
    grouped = group_quantize(tensor, quantizer, num_tensors, first_dims, None, tensor_offsets)
    rows, cols = (int(d) for d in tensor.shape)
    counts = _member_rows(num_tensors, rows, first_dims)
    dbias = torch.zeros(num_tensors, cols, dtype=tensor.dtype, device=tensor.device)
    start = 0
    for i, count in enumerate(counts):
        if count:
            dbias[i] = tensor[start : start + count].detach().float().sum(0).to(tensor.dtype)
        start += count
    return grouped, dbias


def _member_shapes(grouped: Any) -> list[tuple[int, int]]:
    """Each member's (rows, columns), as TE's grouped GEMM reads them from the metadata."""
    if grouped.last_dims is not None:
        raise _refuse("te_general_grouped_gemm_for_grouped_tensor", "varying last dimensions")
    rows, cols = (int(d) for d in grouped.logical_shape)
    if grouped.tensor_shapes:
        return [(int(r), int(c)) for r, c in grouped.tensor_shapes]
    return [(r, cols) for r in _member_rows(grouped.num_tensors, rows, grouped.first_dims)]


def _members(grouped: Any) -> list[Any]:
    """Per-member GEMM operands over the grouped buffers (views, no copy): plain tensors, or
    TE ``MXFP8TensorStorage`` objects with the member's data and scales in the grouped
    tensor's scale layout (swizzled or compact)."""
    shapes = _member_shapes(grouped)
    quantizer = grouped.quantizer
    offsets = [0]
    for r, c in shapes:
        offsets.append(offsets[-1] + r * c)
    if quantizer is None:
        data = grouped.rowwise_data
        if data is None:
            data = grouped.columnwise_data
        return [data[offsets[i] : offsets[i + 1]].view(s) for i, s in enumerate(shapes)]
    if _nvfp4.is_nvfp4(quantizer):
        return _nvfp4.nvfp4_members(grouped, shapes)
    if not _is_mxfp8_quantizer(quantizer):
        raise _refuse(
            "te_general_grouped_gemm_for_grouped_tensor",
            f"a grouped {type(quantizer).__name__} operand (only MXFP8, NVFP4 and unquantized)",
        )
    from transformer_engine.pytorch.tensor.storage.mxfp8_tensor_storage import (
        MXFP8TensorStorage,
    )

    if any(r for r, _ in shapes):
        _check_alignment(
            "te_general_grouped_gemm_for_grouped_tensor", [r for r, _ in shapes], shapes[0][1]
        )
    scale_offsets = {False: [0], True: [0]}
    for s in shapes:
        scale_offsets[False].append(scale_offsets[False][-1] + _numel(_mxf.rowwise_scale_shape(s)))
        scale_offsets[True].append(scale_offsets[True][-1] + _numel(_mxf.columnwise_scale_shape(s)))
    members = []
    rows_scales, cols_scales = scale_offsets[False], scale_offsets[True]
    for i, s in enumerate(shapes):
        members.append(
            MXFP8TensorStorage(
                rowwise_data=_cut(grouped.rowwise_data, offsets, i, s),
                rowwise_scale_inv=_cut(
                    grouped.scale_inv, rows_scales, i, _mxf.rowwise_scale_shape(s)
                ),
                columnwise_data=_cut(grouped.columnwise_data, offsets, i, s),
                columnwise_scale_inv=_cut(
                    grouped.columnwise_scale_inv, cols_scales, i, _mxf.columnwise_scale_shape(s)
                ),
                fp8_dtype=quantizer.dtype,
                quantizer=quantizer,
                with_gemm_swizzled_scales=bool(grouped._with_gemm_swizzled_scales),
            )
        )
    return members


def _cut(
    buf: torch.Tensor | None, bounds: Sequence[int], i: int, shape: Sequence[int]
) -> torch.Tensor | None:
    """Member ``i``'s view of a flat grouped buffer (``None`` for an absent usage)."""
    return None if buf is None else buf[bounds[i] : bounds[i + 1]].view(*shape)


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for d in shape:
        count *= int(d)
    return count


def _grouped_gemm(
    kernel: str,
    a_members: Sequence[Any],
    transa: bool,
    b_members: Sequence[Any],
    transb: bool,
    d_members: Sequence[torch.Tensor],
    bias: Any,
    bias_scale: torch.Tensor | None,
    alpha: torch.Tensor,
    beta: torch.Tensor,
) -> None:
    if bias_scale is not None:
        raise _refuse(kernel, "bias_scale (scaled-bias experts)")
    count = len(d_members)
    if not len(a_members) == len(b_members) == count:
        raise ValueError(f"{kernel}: {len(a_members)} A, {len(b_members)} B and {count} D members")
    if bias is not None and any(_is_nvfp4_operand(t) for t in (*a_members, *b_members)):
        raise _nvfp4.refuse_bias(kernel)
    biases = None if bias is None else _members(bias)
    alphas = [float(v) for v in alpha.reshape(-1).tolist()]
    betas = [float(v) for v in beta.reshape(-1).tolist()]
    if len(alphas) not in (1, count) or len(betas) not in (1, count):
        raise ValueError(f"{kernel}: {len(alphas)} alphas / {len(betas)} betas for {count}")
    for i, (a, b, d) in enumerate(zip(a_members, b_members, d_members, strict=True)):
        a_i, b_i = alphas[i % len(alphas)], betas[i % len(betas)]
        accumulate = b_i != 0.0
        if d.numel() == 0:
            continue
        if _is_empty(a) or _is_empty(b):
            if not accumulate:
                with torch.no_grad():
                    d.zero_()
            continue
        member_bias = None if biases is None else biases[i].reshape(-1)
        generic_gemm(
            a, transa, b, transb, d, None, te_dtype(d.dtype), member_bias, None, False, None, False,
            None, 0, accumulate, False, None, None, None, False, a_i, b_i if accumulate else None,
        )  # fmt: skip


def _is_empty(operand: Any) -> bool:
    """Whether a GEMM operand has no elements (read from its buffers: TE warns when asked the
    shape of an NVFP4 tensor that holds only its columnwise copy)."""
    if isinstance(operand, torch.Tensor) and not hasattr(operand, "_quantizer"):
        return operand.numel() == 0
    if _is_nvfp4_operand(operand):
        data = [getattr(operand, n) for n in ("_rowwise_data", "_columnwise_data")]
        return any(d is not None and d.numel() == 0 for d in data)
    return 0 in tuple(operand.size())


def _is_nvfp4_operand(tensor: Any) -> bool:
    return type(tensor).__name__.startswith("NVFP4")


def te_general_grouped_gemm_for_grouped_tensor(
    A: Any,  # noqa: N803 - TE's argument names
    transa: bool,
    B: Any,  # noqa: N803
    transb: bool,
    D: Any,  # noqa: N803
    bias: Any,
    bias_scale: torch.Tensor | None,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    workspace_setup: torch.Tensor,
    workspace_cublas: torch.Tensor,
    use_split_accumulator: bool,
    sm_count: int,
) -> Any:
    """``tex.te_general_grouped_gemm_for_grouped_tensor`` (``general_grouped_gemm_for_grouped_
    tensor``: single grouped weights, fprop ``TN`` / dgrad ``NN`` / wgrad ``NT``): per member,
    ``generic_gemm``'s computation into D's member (module doc)."""
    _grouped_gemm(
        "te_general_grouped_gemm_for_grouped_tensor",
        _members(A), transa, _members(B), transb, _members(D), bias, bias_scale, alpha, beta,
    )  # fmt: skip
    return D


def te_general_grouped_gemm_for_discrete_in(
    A: Sequence[Any],  # noqa: N803
    transa: bool,
    B: Any,  # noqa: N803
    transb: bool,
    D: Any,  # noqa: N803
    bias: Any,
    bias_scale: torch.Tensor | None,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    workspace_setup: torch.Tensor,
    workspace_cublas: torch.Tensor,
    use_split_accumulator: bool,
    sm_count: int,
) -> Any:
    """``tex.te_general_grouped_gemm_for_discrete_in``: A a list of per-expert weights."""
    _grouped_gemm(
        "te_general_grouped_gemm_for_discrete_in",
        list(A), transa, _members(B), transb, _members(D), bias, bias_scale, alpha, beta,
    )  # fmt: skip
    return D


def te_general_grouped_gemm_for_discrete_out(
    A: Any,  # noqa: N803
    transa: bool,
    B: Any,  # noqa: N803
    transb: bool,
    D: Sequence[torch.Tensor],  # noqa: N803
    bias: Any,
    bias_scale: torch.Tensor | None,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    workspace_setup: torch.Tensor,
    workspace_cublas: torch.Tensor,
    use_split_accumulator: bool,
    sm_count: int,
) -> Sequence[torch.Tensor]:
    """``tex.te_general_grouped_gemm_for_discrete_out``: D a list of per-expert outputs (the
    weight gradients, or ``main_grad`` when accumulating)."""
    if bias is not None:
        raise ValueError("Bias is not supported when out is a list (discrete_out mode) yet.")
    _grouped_gemm(
        "te_general_grouped_gemm_for_discrete_out",
        _members(A), transa, _members(B), transb, list(D), None, bias_scale, alpha, beta,
    )  # fmt: skip
    return D
