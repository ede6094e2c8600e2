"""The data-movement kernel TE 2.20.2's quantized all-gathers call, for the
``transformer_engine_torch`` stand-in: ``swap_first_dims``.

Why: with sequence parallelism (tensor-parallel size above 1), TE gathers a blockwise FP8
activation's columnwise data and rowwise scales over the tensor-parallel group
(``pytorch/distributed.py``, ``_start_all_gather_fp8_blockwise`` /
``_finish_all_gather_fp8_blockwise``, and ``_swap_first_dims`` for NVFP4). Each rank's block
arrives stacked along the first dimension, ``(world, rows, ...)``; TE then reorders it to
``(rows, world, ...)`` with ``tex.swap_first_dims`` (``pytorch/csrc/extensions/transpose.cpp``
-> ``nvte_swap_first_dims``).

Exact: it only moves bytes. The input is read as contiguous, dimensions 0 and 1 are exchanged,
every trailing dimension keeps its order; written into ``out`` when given (TE's call sites pass
a view of the gathered tensor's own buffer), else into a new contiguous tensor.
"""

from __future__ import annotations

import torch

__all__ = ["swap_first_dims"]
TEX_KERNELS = tuple(__all__)
"""The ``transformer_engine_torch`` names this module provides."""


def swap_first_dims(tensor: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``tex.swap_first_dims``: ``out[j, i, ...] = tensor[i, j, ...]``."""
    if tensor.dim() < 2:
        raise RuntimeError(f"Invalid input tensor dimensions (shape={list(tensor.shape)})")
    swapped = tensor.contiguous().transpose(0, 1)
    if out is None:
        return swapped.contiguous()
    if tuple(out.shape) != tuple(swapped.shape) or out.dtype != tensor.dtype:
        raise RuntimeError(
            f"swap_first_dims: output {tuple(out.shape)} {out.dtype} does not hold input "
            f"{tuple(tensor.shape)} {tensor.dtype} with its first two dimensions swapped"
        )
    out.copy_(swapped)
    return out
