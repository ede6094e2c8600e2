"""TE 2.20.2's discrete grouped-GEMM kernels for the ``transformer_engine_torch`` stand-in.

Why: TE's ``GroupedLinear`` (``module/grouped_linear.py``, megatron's ``TEGroupedMLP`` /
``TEColumnParallelGroupedLinear``) on its legacy discrete path, taken where the grouped-tensor
GEMM is unavailable (Hopper before cuBLASLt 13.4, the blockwise recipes), splits and quantizes
its input per expert with ``split_quantize`` (``module/_split_quantization.py``), runs one GEMM
per expert through ``cpp_extensions.general_grouped_gemm`` -> ``te_general_grouped_gemm``, and
megatron's FP8 padding modules (``module/fp8_padding.py``, ``fp8_unpadding.py``) pad each
expert's rows with ``fused_multi_row_padding`` / ``fused_multi_row_unpadding``.

* ``split_quantize``: exact; each split quantized by its own quantizer with the project's exact
  quantizers (what TE's bulk kernel writes per split). NVFP4 quantizers go to TE's grouped NVFP4
  path, :mod:`.split_quantize_nvfp4` (one amax per split, the group's scale layout).
* ``fused_multi_row_padding`` / ``_unpadding``: exact data movement (padding rows are zero).
* ``te_general_grouped_gemm``: per expert, exactly the computation of
  :func:`.gemm.generic_gemm` (the documented fp32 stand-in), into the expert's output
  (its rows of the single output when ``single_output``); empty experts zero their output unless
  accumulating, and their bias gradient. NVFP4 operands too: TE's ``nvte_multi_tensor_gemm``
  runs ``multi_stream_cublas_gemm``, one ``nvte_cublas_gemm_v2`` per expert with alpha 1, so
  each expert's NVFP4 alpha comes from its own two operands' amaxes, as in ``generic_gemm``.

The grouped-tensor path's kernels (``group_quantize``, ``splits_to_offsets_multi``,
``te_general_grouped_gemm_for_grouped_tensor`` and its discrete variants), which TE takes on an
SM 10.0 target with cuBLASLt >= 13.3, are in :mod:`.grouped_tensor`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nemo_lw_fp8.cpu.te.tex.common import BACKEND, torch_dtype
from nemo_lw_fp8.cpu.te.tex.gemm import _output_shape, generic_gemm, operand_shape

__all__ = [
    "fused_multi_row_padding",
    "fused_multi_row_unpadding",
    "split_quantize",
    "te_general_grouped_gemm",
]
TEX_KERNELS = tuple(__all__)
"""The ``transformer_engine_torch`` names this module provides."""


def split_quantize(
    tensor: torch.Tensor,
    split_sections: Sequence[int],
    quantizer_list: Sequence[Any],
    disable_bulk_allocation: bool = False,
) -> list[Any]:
    """``tex.split_quantize``: split the rows of ``tensor`` and quantize split ``i`` with
    ``quantizer_list[i]`` (exact: the project's quantizers)."""
    from nemo_lw_fp8.cpu.te.tex import cast

    sizes = [int(s) for s in split_sections]
    if len(sizes) != len(quantizer_list):
        raise ValueError(f"{len(sizes)} splits but {len(quantizer_list)} quantizers")
    if sum(sizes) != tensor.shape[0]:
        raise ValueError(f"split sizes {sizes} do not add up to {tensor.shape[0]} rows")
    from nemo_lw_fp8.cpu.te.tex.split_quantize_nvfp4 import is_nvfp4_list, split_quantize_nvfp4

    if is_nvfp4_list(quantizer_list):
        # TE's grouped NVFP4 kernels: one amax per split, the group's scale layout
        return split_quantize_nvfp4(tensor, sizes, quantizer_list, disable_bulk_allocation)
    parts = torch.split(tensor.detach().contiguous(), sizes)
    pairs = zip(parts, quantizer_list, strict=True)
    return [cast.kernel_quantize("split_quantize", p.contiguous(), q) for p, q in pairs]


def _check_rows(rows: Sequence[int], other: Sequence[int], what: str) -> list[tuple[int, int]]:
    if len(rows) != len(other):
        raise ValueError(f"{what}: {len(rows)} row counts but {len(other)} targets")
    return [(int(a), int(b)) for a, b in zip(rows, other, strict=True)]


def fused_multi_row_padding(
    input: torch.Tensor,  # noqa: A002 - TE's argument name
    output: torch.Tensor,
    input_row_list: Sequence[int],
    padded_input_row_list: Sequence[int],
) -> None:
    """``tex.fused_multi_row_padding``: chunk ``i`` (``input_row_list[i]`` rows) copied to the
    start of its ``padded_input_row_list[i]`` rows of ``output``, the rest zero."""
    src = dst = 0
    with torch.no_grad():
        for rows, padded in _check_rows(input_row_list, padded_input_row_list, "padding"):
            if padded < rows:
                raise ValueError(f"padded rows {padded} < rows {rows}")
            output[dst : dst + rows].copy_(input[src : src + rows])
            output[dst + rows : dst + padded].zero_()
            src, dst = src + rows, dst + padded


def fused_multi_row_unpadding(
    input: torch.Tensor,  # noqa: A002
    output: torch.Tensor,
    input_row_list: Sequence[int],
    unpadded_input_row_list: Sequence[int],
) -> None:
    """``tex.fused_multi_row_unpadding``: the first ``unpadded_input_row_list[i]`` rows of each
    padded chunk ``i`` (``input_row_list[i]`` rows), packed into ``output``."""
    src = dst = 0
    with torch.no_grad():
        for rows, kept in _check_rows(input_row_list, unpadded_input_row_list, "unpadding"):
            if kept > rows:
                raise ValueError(f"unpadded rows {kept} > rows {rows}")
            output[dst : dst + kept].copy_(input[src : src + kept])
            src, dst = src + rows, dst + kept


def te_general_grouped_gemm(
    A: Sequence[Any],  # noqa: N803 - TE's argument names
    transa: bool,
    B: Sequence[Any],  # noqa: N803
    transb: bool,
    D: Sequence[torch.Tensor] | None,  # noqa: N803
    D_type: Any,  # noqa: N803
    m_splits: Sequence[int],
    bias: Sequence[torch.Tensor],
    bias_type: Any,
    single_output: bool,
    pre_gelu_out: Sequence[torch.Tensor],
    grad: bool,
    workspace: Sequence[torch.Tensor],
    workspaceSize: int,  # noqa: N803
    accumulate: bool,
    use_split_accumulator: bool,
    math_sm_count: int = 0,
) -> list[torch.Tensor]:
    """``tex.te_general_grouped_gemm``: one :func:`generic_gemm` per expert (see module doc);
    returns ``bias`` (holding the bias gradients when ``grad``)."""
    if any(t.numel() for t in pre_gelu_out):
        raise NotImplementedError(
            f"tex.te_general_grouped_gemm with a GELU epilogue is not implemented by {BACKEND}"
        )
    if single_output and D is None:
        raise ValueError("not implemented, D should be allocated for single output case.")
    dtype = torch_dtype(D_type)
    flat = D[0].view(-1) if single_output else None
    offset = 0
    for i, (a, b) in enumerate(zip(A, B, strict=True)):
        shape = _output_shape(operand_shape(a), transa, operand_shape(b), transb)
        count = 1
        for dim in shape:
            count *= dim
        if single_output:
            out = flat[offset : offset + count].view(shape)
            offset += count
        elif D is not None:
            out = D[i]
        else:
            out = torch.empty(shape, dtype=dtype)
        empty = count == 0 or 0 in operand_shape(a) or 0 in operand_shape(b)
        if empty:
            with torch.no_grad():
                if out.numel() and not accumulate:
                    out.zero_()
                if bias[i].numel() and grad:
                    bias[i].zero_()
            continue
        use_bias = bias[i].numel() != 0
        result = generic_gemm(
            a, transa, b, transb, out, None, D_type, bias[i] if use_bias else None, bias_type,
            False, None, grad, workspace[0], workspaceSize, accumulate, use_split_accumulator,
        )  # fmt: skip
        if grad and use_bias:
            with torch.no_grad():
                bias[i].copy_(result[1])
    return list(bias)
