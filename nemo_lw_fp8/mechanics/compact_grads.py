"""The compact layout's gradients: each bucket's gradients laid out in owner order inside the
persistent grad buffer (bucket membership and bounds unchanged), and each owner's span reduced
there in place to that owner only, one coalesced launch per bucket group (:mod:`.owner_reduce`;
``grad_sync="all_reduce"``: megatron's all-reduce instead). The layout and ownership it reads are
:mod:`.compact`'s.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_lw_fp8 import config as plugin_config
from nemo_lw_fp8.mechanics import expert_slices, owner_reduce, qkv_parts
from nemo_lw_fp8.state import group_state, peek


def _owner_runs(param: torch.nn.Parameter, record: Any, numel: int) -> list[tuple[int, int]]:
    """``(owner, elements)`` of ``param``'s gradient in flattened order: one run for a whole
    param, one per run of experts, one per query group and part of a split QKV weight."""
    runs = []
    for piece in record.pieces[param]:
        if qkv_parts.is_part(piece):
            ranges = piece.flat_ranges
        elif expert_slices.is_slice(piece):
            ranges = [piece.flat_range]
        else:
            ranges = [(0, numel)]
        runs += [(lo, hi, record.owner_of[piece]) for lo, hi in ranges]
    runs.sort()
    return [(owner, hi - lo) for lo, hi, owner in runs]


def lay_out_grads_by_owner(
    bucket: Any, record: Any, index_maps: list[dict]
) -> list[tuple[int, int, int]]:
    """Re-lay ``bucket``'s gradients in owner order inside its own grad buffer and return the
    owner reduce's spans ``(owner, start, end)`` (bucket-relative).

    The bucket keeps its params and bounds (so its launches, readiness and the gather are as
    before; compact buffers have no param buffer, params keep their own storage); only where
    each param's gradient sits inside the bucket changes: ``main_grad`` (or, for a param with a
    separate fp32 ``main_grad``, ``main_grad_copy_in_grad_buffer``), the bucket's
    ``param_to_index`` and the buffer's ``param_index_map`` are re-pointed. Runs before the first
    backward, when ownership is set; gradients already accumulated move with their params.
    Deterministic (owners are), so every rank lays a bucket out the same way.
    """
    params = list(bucket.params_list)
    order = owner_reduce.owner_order([_owner_runs(p, record, p.numel())[0][0] for p in params])
    grad = bucket.grad_data
    old = grad.clone() if bool(torch.count_nonzero(grad)) else None
    pieces: list[tuple[int, int]] = []
    start = 0
    with torch.no_grad():
        for i in order:
            param = params[i]
            extra = hasattr(param, "main_grad_copy_in_grad_buffer")
            current = param.main_grad_copy_in_grad_buffer if extra else param.main_grad
            numel = current.numel()
            slot = grad[start : start + numel]
            if old is not None:
                was, _ = bucket.param_to_index[param]
                slot.copy_(old[was : was + numel])
            view = slot.view(current.shape)
            if extra:
                param.main_grad_copy_in_grad_buffer = view
            else:
                param.main_grad = view
            bucket.param_to_index[param] = (start, start + numel)
            for index_map in index_maps:
                if param in index_map:
                    bucket_id = index_map[param][2]
                    index_map[param] = (bucket.offset + start, bucket.offset + start + numel,
                                        bucket_id)  # fmt: skip
            pieces += _owner_runs(param, record, numel)
            start += numel
    if start != grad.numel():
        raise RuntimeError(f"a compact bucket holds {grad.numel()} elements, its params {start}")
    spans, offset = [], 0
    for owner, numel in owner_reduce.owner_spans(pieces):
        spans.append((owner, offset, offset + numel))
        offset += numel
    return spans


def grads_to_owners(group: Any) -> bool:
    """Whether ``group``'s gradients are reduced to their owners (else megatron all-reduces)."""
    record = peek(group)
    if record is None or record.compact is None:
        return False
    return plugin_config.grad_sync(group.ddp_config) == "reduce_to_owner"


def dispatch_grads(group: Any, op: Any, async_op: bool) -> owner_reduce.ReduceWork | None:
    """Reduce each owner's span of the group's buckets, in place, to that owner."""
    plan = group_state(group).compact  # a compact.CompactGroup
    process_group = group.data_parallel_group
    if process_group.size() == 1:
        # The local gradients are the reduced ones; an overlapped sync still hands megatron a
        # handle to wait on, as its own one-rank all-reduce does.
        return owner_reduce.ReduceWork([]) if async_op else None
    if len(plan.grad_spans) != len(group.buckets):
        raise RuntimeError("a compact bucket group reduced to its owners has no owner layout")
    spans = [
        (owner, bucket.grad_data[start:end])
        for bucket, bucket_spans in zip(group.buckets, plan.grad_spans, strict=True)
        for owner, start, end in bucket_spans
    ]
    works = owner_reduce.reduce_spans(spans, op, process_group, async_op)
    return owner_reduce.ReduceWork(works) if async_op else None
