"""Stand-ins for TE 2.20.2's Triton MoE permutation kernels (``moe_permute_fusion`` on CPU).

Why: the recipes ship ``moe_permute_fusion=True``, so megatron's token dispatchers call TE's
``moe_permute_with_probs`` / ``moe_permute_and_pad_with_probs`` / ``moe_unpermute`` /
``moe_sort_chunks_by_index`` (``transformer_engine/pytorch/permutation.py``). Those run TE's
Python and reach the GPU only through the six launch wrappers of
``transformer_engine/pytorch/triton/permutation.py``, each of which allocates its outputs on
``"cuda"`` and launches Triton kernels (``transformer_engine/common/triton/permutation.py``).
:func:`install` replaces exactly those six wrappers, on CPU tensors, with the kernels' semantics
read from TE's Triton source:

* ``make_row_id_map`` (passes 1-3): destination rows are numbered expert-major (all tokens of
  expert 0 in token order, then expert 1, ...); each token's row holds its routed destination
  rows in descending order, then the matching expert indices, then the count
  (``[num_tokens, 2 * num_experts + 1]``, int32). Exact. The entries past a token's count are
  never read by TE; here they hold -1 (on the GPU: whatever the earlier passes left).
* ``permute_with_mask_map``: copies each token (FP8 data bytes as they are) to its destination
  rows, shifted by ``pad_offsets[expert]`` when given; the probs and the MXFP8 / blockwise
  scale rows travel with it; a routed slot whose prob is exactly 0 is written as zeros. Exact.
  Rows nobody writes are zeros (TE zero-fills them only with padding; without it they would be
  uninitialised memory, never read by TE's callers).
* ``unpermute_with_mask_map``: per token, an fp32 accumulator starting at 0 adds each routed
  row (times its merging prob, product rounded to fp32) in the row map's order, then rounds
  once to the input's dtype; probs scatter back (zeros where not routed). Exact where the GPU
  does not contract the multiply-add into an FMA; with merging probs the Triton compiler may
  (its ``enable_fp_fusion`` default), which is the one place this is a documented deterministic
  computation rather than the GPU's bits. Megatron's op-fuser path applies the probs inside the
  experts and unpermutes without merging probs.
* ``unpermute_with_mask_map_bwd_with_merging_probs``: the activation gradient
  (``grad * prob`` in fp32, rounded to the gradient's dtype) is exact; each merging-prob
  gradient is a dot product over the hidden dim whose order is the GPU's block reduction:
  here fp32 products summed in float64, rounded once (deterministic on every CPU).
* ``make_chunk_sort_map`` / ``sort_chunks_by_map``: the chunk permutation (tokens past the
  split sizes' total map to themselves) and the row copy, forward or inverse. Exact.

A destination row outside the output (a routing map with more routed slots than
``num_out_tokens``, which the GPU kernel would write out of bounds) is refused by name.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "install",
    "make_chunk_sort_map",
    "make_row_id_map",
    "permute_with_mask_map",
    "sort_chunks_by_map",
    "unpermute_with_mask_map",
    "unpermute_with_mask_map_bwd_with_merging_probs",
]

TE_MODULE = "transformer_engine.pytorch.triton.permutation"
"""TE's module of Triton launch wrappers whose functions :func:`install` replaces."""

WRAPPERS = (
    "make_row_id_map",
    "permute_with_mask_map",
    "unpermute_with_mask_map",
    "unpermute_with_mask_map_bwd_with_merging_probs",
    "make_chunk_sort_map",
    "sort_chunks_by_map",
)


def _refuse(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"TE's Triton permutation kernel {what} is not implemented by the nemo_lw_fp8 CPU stand-in"
    )


def make_row_id_map(routing_map: torch.Tensor, num_tokens: int, num_experts: int) -> torch.Tensor:
    """TE's ``make_row_id_map``: the ``[num_tokens, 2 * num_experts + 1]`` int32 row map."""
    routed = routing_map.reshape(num_tokens, num_experts) != 0
    per_expert = routed.to(torch.int64).sum(0)
    expert_start = torch.cumsum(per_expert, 0) - per_expert
    rank_in_expert = torch.cumsum(routed.to(torch.int64), 0) - 1
    sparse = torch.where(routed, expert_start + rank_in_expert, torch.full_like(rank_in_expert, -1))
    rows, experts = torch.sort(sparse, dim=1, descending=True, stable=True)
    count = routed.sum(1)
    valid = torch.arange(num_experts, device=routing_map.device) < count[:, None]
    experts = torch.where(valid, experts, torch.full_like(experts, -1))
    row_id_map = torch.cat([rows, experts, count[:, None]], dim=1)
    return row_id_map.to(torch.int32)


def _routed_slots(
    row_id_map: torch.Tensor, num_experts: int, pad_offsets: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, slot, expert, permuted row) of every routed slot, in row-map order."""
    count = row_id_map[:, 2 * num_experts].to(torch.int64)
    slot = torch.arange(num_experts, device=row_id_map.device)
    valid = slot[None, :] < count[:, None]
    token, k = valid.nonzero(as_tuple=True)
    row = row_id_map[token, k].to(torch.int64)
    expert = row_id_map[token, num_experts + k].to(torch.int64)
    if pad_offsets is not None:
        row = row + pad_offsets.to(torch.int64)[expert]
    return token, k, expert, row


def _check_rows(row: torch.Tensor, rows: int, what: str) -> None:
    if row.numel() and (int(row.min()) < 0 or int(row.max()) >= rows):
        raise _refuse(
            f"{what} with a destination row outside [0, {rows}) (more routed slots than "
            "num_out_tokens: the GPU kernel would write out of bounds)"
        )


def _check_tokens(row_id_map: torch.Tensor, num_tokens: int, what: str) -> None:
    if row_id_map.shape[0] != num_tokens:
        raise _refuse(
            f"{what} for {num_tokens} tokens with a row map of {row_id_map.shape[0]} (a restore "
            "shape other than the routing map's tokens: the GPU kernel would read out of bounds)"
        )


def permute_with_mask_map(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    probs: torch.Tensor | None,
    scale: torch.Tensor | None,
    pad_offsets: torch.Tensor | None,
    num_tokens: int,
    num_experts: int,
    num_out_tokens: int,
    hidden_size: int,
    scale_hidden_dim: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """TE's ``permute_with_mask_map``: (permuted rows, permuted scale rows, permuted probs)."""
    _check_tokens(row_id_map, num_tokens, "permute_with_mask_map")
    token, _, expert, row = _routed_slots(row_id_map, num_experts, pad_offsets)
    _check_rows(row, num_out_tokens, "permute_with_mask_map")
    output = torch.zeros((num_out_tokens, hidden_size), dtype=inp.dtype, device=inp.device)
    output[row] = inp[token, :hidden_size]
    permuted_probs = None
    if probs is not None:
        permuted_probs = torch.zeros((num_out_tokens,), dtype=probs.dtype, device=probs.device)
        prob = probs[token, expert]
        permuted_probs[row] = prob
        output[row[prob == 0.0]] = 0  # a padded routing slot
    permuted_scale = None
    if scale is not None:
        assert scale_hidden_dim is not None
        permuted_scale = torch.zeros(
            (num_out_tokens, scale_hidden_dim), dtype=scale.dtype, device=scale.device
        )
        permuted_scale[row] = scale[token, :scale_hidden_dim]
    return output, permuted_scale, permuted_probs


def unpermute_with_mask_map(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: torch.Tensor | None,
    permuted_probs: torch.Tensor | None,
    pad_offsets: torch.Tensor | None,
    num_tokens: int,
    num_experts: int,
    hidden_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TE's ``unpermute_with_mask_map``: (tokens restored and summed, probs scattered back)."""
    _check_tokens(row_id_map, num_tokens, "unpermute_with_mask_map")
    count = row_id_map[:, 2 * num_experts].to(torch.int64)
    _, _, _, all_rows = _routed_slots(row_id_map, num_experts, pad_offsets)
    _check_rows(all_rows, inp.shape[0], "unpermute_with_mask_map")
    accumulator = torch.zeros((num_tokens, hidden_size), dtype=torch.float32, device=inp.device)
    tokens = torch.arange(num_tokens, device=inp.device)
    for k in range(int(count.max()) if num_tokens else 0):
        taking = (k < count)[:, None]
        k_safe = torch.minimum(torch.full_like(count, k), torch.clamp(count - 1, min=0))
        row = row_id_map[tokens, k_safe].to(torch.int64).clamp(min=0)
        expert = row_id_map[tokens, num_experts + k_safe].to(torch.int64).clamp(min=0)
        if pad_offsets is not None:
            row = row + pad_offsets.to(torch.int64)[expert]
        term = inp[row, :hidden_size].to(torch.float32)
        if merging_probs is not None:
            term = term * merging_probs[tokens, expert].to(torch.float32)[:, None]
        # where(), not "+ 0": adding +0.0 would turn an accumulated -0.0 into +0.0
        accumulator = torch.where(taking, accumulator + term, accumulator)
    output = accumulator.to(inp.dtype)
    unpermuted_probs = None
    if permuted_probs is not None:
        token, _, expert, row = _routed_slots(row_id_map, num_experts, pad_offsets)
        unpermuted_probs = torch.zeros(
            (num_tokens, num_experts), dtype=permuted_probs.dtype, device=permuted_probs.device
        )
        unpermuted_probs[token, expert] = permuted_probs[row]
    return output, unpermuted_probs


def unpermute_with_mask_map_bwd_with_merging_probs(
    fwd_output_grad: torch.Tensor,
    row_id_map: torch.Tensor,
    fwd_input: torch.Tensor,
    merging_probs: torch.Tensor,
    pad_offsets: torch.Tensor | None,
    num_tokens: int,
    num_experts: int,
    num_out_tokens: int,
    hidden_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's backward of the merging-probs unpermute: (permuted-rows grad, merging-probs grad)."""
    _check_tokens(row_id_map, num_tokens, "unpermute_with_mask_map_bwd_with_merging_probs")
    token, _, expert, row = _routed_slots(row_id_map, num_experts, pad_offsets)
    _check_rows(row, num_out_tokens, "unpermute_with_mask_map_bwd_with_merging_probs")
    grad = fwd_output_grad[token, :hidden_size].to(torch.float32)
    prob = merging_probs[token, expert].to(torch.float32)
    act_grad = torch.zeros(
        (num_out_tokens, hidden_size), dtype=fwd_output_grad.dtype, device=fwd_output_grad.device
    )
    act_grad[row] = (grad * prob[:, None]).to(fwd_output_grad.dtype)
    products = fwd_input[row, :hidden_size].to(torch.float32) * grad
    dot = products.to(torch.float64).sum(1).to(torch.float32)
    probs_grad = torch.zeros(
        (num_tokens, num_experts), dtype=merging_probs.dtype, device=merging_probs.device
    )
    probs_grad[token, expert] = dot.to(merging_probs.dtype)
    return act_grad, probs_grad


def make_chunk_sort_map(
    split_sizes: torch.Tensor, sorted_indices: torch.Tensor, num_tokens: int, num_splits: int
) -> torch.Tensor:
    """TE's ``make_chunk_sort_map``: each token's row after the chunks are put in
    ``sorted_indices`` order; tokens past the chunks' total keep their row."""
    sizes = split_sizes[:num_splits].to(torch.int64)
    order = sorted_indices[:num_splits].to(torch.int64)
    if sorted(order.tolist()) != list(range(num_splits)):
        raise _refuse("make_chunk_sort_map with sorted_indices that are not a permutation")
    start_in = torch.cumsum(sizes, 0) - sizes
    sizes_out = sizes[order]
    start_out = torch.empty_like(sizes)
    start_out[order] = torch.cumsum(sizes_out, 0) - sizes_out
    pid = torch.arange(num_tokens, device=split_sizes.device)
    chunk = torch.bucketize(pid, torch.cumsum(sizes, 0), right=True)
    inside = pid < sizes.sum()
    chunk_safe = chunk.clamp(max=max(num_splits - 1, 0))
    dst = start_out[chunk_safe] + pid - start_in[chunk_safe]
    return torch.where(inside, dst, pid).to(torch.int32)


def sort_chunks_by_map(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    probs: torch.Tensor | None,
    num_tokens: int,
    hidden_size: int,
    is_forward: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TE's ``sort_chunks_by_map``: row ``t`` goes to ``map[t]`` (forward) or comes from it."""
    index = row_id_map[:num_tokens].to(torch.int64)
    output = torch.empty((num_tokens, hidden_size), dtype=inp.dtype, device=inp.device)
    permuted_probs = None
    if probs is not None:
        permuted_probs = torch.empty((num_tokens,), dtype=probs.dtype, device=probs.device)
    if is_forward:
        output[index] = inp[:num_tokens, :hidden_size]
        if probs is not None:
            permuted_probs[index] = probs[:num_tokens]
    else:
        output.copy_(inp[index, :hidden_size])
        if probs is not None:
            permuted_probs.copy_(probs[index])
    return output, permuted_probs


_originals: dict[str, Callable[..., Any]] = {}


def install() -> None:
    """Put the stand-ins in TE's wrapper module (idempotent); TE imports it as a module, so
    every call site sees them."""
    module = sys.modules.get(TE_MODULE)
    if module is None:
        import importlib

        module = importlib.import_module(TE_MODULE)
    for name in WRAPPERS:
        current = getattr(module, name)
        if current is globals()[name]:
            continue
        _originals.setdefault(name, current)
        setattr(module, name, globals()[name])


def installed() -> bool:
    module = sys.modules.get(TE_MODULE)
    return module is not None and all(getattr(module, n) is globals()[n] for n in WRAPPERS)
