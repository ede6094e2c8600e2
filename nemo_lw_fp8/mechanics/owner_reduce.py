"""megatron's bucket-group grad-sync contract for reducing each gradient to its owner only.

Why: a compact layer-wise bucket group runs with plain-DDP semantics, so megatron all-reduces its
gradients and every rank receives every Muon gradient, although only the matrix's owner reads it
(the layer-wise optimizer updates, clips and counts its own matrices only). This module replaces
that all-reduce with one reduce per owner: the group's gradients are packed, in owner order,
into a transient buffer of the group's length, and the owner of each segment is the reduce's
destination. On NCCL the reduces go out under one coalescing manager (one launch per bucket
group); gloo has no coalescing and runs them one after the other. When the reduce finishes, each
owner copies its reduced segment back into the gradients it owns; other ranks keep their local
(scaled, unreduced) values there, which nothing reads.

What megatron's callers rely on is kept: gradients are scaled by the buckets'
``gradient_scaling_factor`` before the collective and summed (or averaged with
``average_in_collective``), the NaN / large-gradient checks run on the local gradients first,
``grad_reduce_handle`` is the pending work (its ``wait()`` also copies the owner's segment back,
so megatron's own ``finish_grad_sync`` completes the sync), a forced all-reduce
(``force_all_reduce``) still all-reduces, and a first overlapped batch reduces from
``finish_grad_sync`` as megatron's does.

The wire arithmetic (a ring reduce: every rank but the destination sends the message once) is
here too, as functions of the segment sizes, so the planner's model can be checked against what
the process group is asked to do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# --------------------------------------------------------------------------- wire arithmetic


@dataclass(frozen=True)
class GradSyncTraffic:
    """One bucket group's gradient sync, per rank and step."""

    #: Elements this rank sends (ring reduce: every rank but the destination sends the segment).
    sent: int
    #: Reduce calls (one per owner with a non-empty segment).
    reduces: int
    #: Collective launches (one coalesced launch; 0 for an empty group).
    launches: int
    #: Elements of the transient buffer the group holds while its reduce is in flight.
    transient: int


def owner_reduce_traffic(segment_numel: Sequence[int], rank: int) -> GradSyncTraffic:
    """What reducing each owner's segment to its owner costs ``rank`` (ring model)."""
    total = sum(segment_numel)
    reduces = sum(1 for size in segment_numel if size)
    sent = sum(size for owner, size in enumerate(segment_numel) if owner != rank)
    if len(segment_numel) == 1:
        return GradSyncTraffic(0, 0, 0, 0)
    return GradSyncTraffic(sent, reduces, 1 if reduces else 0, total)


def all_reduce_sent(total: int, world: int) -> float:
    """Elements one rank sends in a ring all-reduce of ``total`` elements."""
    return 2 * (world - 1) / world * total if world > 1 else 0.0


def reduce_scatter_sent(total: int, world: int) -> float:
    """Elements one rank sends in an exact (unpadded) ring reduce-scatter: the lower limit for
    delivering each owner its reduced gradients."""
    return (world - 1) / world * total if world > 1 else 0.0


def transient_peak(group_numel: Sequence[int], overlap: bool) -> int:
    """Largest transient gradient buffer alive at once, in elements, over one chunk's groups.

    Without overlap each group reduces and unpacks before the next starts; with
    ``overlap_grad_reduce`` every group reduces as its gradients become ready and waits only in
    ``finish_grad_sync``, so all of them can be in flight together.
    """
    if not group_numel:
        return 0
    return sum(group_numel) if overlap else max(group_numel)


# --------------------------------------------------------------------------- the collective


class ReduceWork:
    """The pending reduces of one bucket group: ``wait()`` waits for them and then runs
    ``done`` (the owner's copy-back) once; megatron's ``finish_grad_sync`` calls it."""

    def __init__(self, works: list[Any], done: Callable[[], None]):
        self._works = works
        self._done: Callable[[], None] | None = done

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []
        done, self._done = self._done, None
        if done is not None:
            done()


def coalesces(process_group: Any, device: torch.device) -> bool:
    """Whether the backend runs a coalescing manager's reduces on ``device`` as one launch
    (NCCL does for CUDA tensors; gloo has no coalescing)."""
    return device.type == "cuda" and "nccl" in str(torch.distributed.get_backend(process_group))


def reduce_segments(
    packed: torch.Tensor,
    segment_numel: Sequence[int],
    op: Any,
    process_group: Any,
    async_op: bool,
) -> list[Any]:
    """Reduce ``packed``'s segment ``r`` to group rank ``r``, for every non-empty segment.
    Returns the works to wait for (empty when synchronous)."""
    from torch.distributed import _coalescing_manager

    spans = []
    offset = 0
    for owner, size in enumerate(segment_numel):
        if size:
            spans.append((owner, packed[offset : offset + size]))
        offset += size
    if coalesces(process_group, packed.device):
        with _coalescing_manager(process_group, device=packed.device, async_ops=async_op) as cm:
            for owner, span in spans:
                torch.distributed.reduce(
                    span, op=op, group=process_group, group_dst=owner, async_op=True
                )
        return [cm] if async_op else []
    works = []
    for owner, span in spans:
        work = torch.distributed.reduce(
            span, op=op, group=process_group, group_dst=owner, async_op=async_op
        )
        if work is not None:
            works.append(work)
    return works


# --------------------------------------------------------------------------- megatron's contract


def _wait_for_graph_replays(group: Any) -> None:
    """A local CUDA-graph replay accumulates gradients asynchronously to the autograd hooks:
    the current stream waits for each replay's event before the gradients are read."""
    stream = None
    seen: set[int] = set()
    for bucket in group.buckets:
        for param in bucket.params_list:
            event = getattr(param, "_cudagraph_wgrad_ready_event", None)
            if event is None or id(event) in seen:
                continue
            stream = stream or torch.cuda.current_stream()
            stream.wait_event(event)
            seen.add(id(event))


def _stage_separate_main_grads(group: Any) -> None:
    """Params accumulating in a separate fp32 ``main_grad`` copy it into their slot of the
    bucket's grad buffer, which is what the collective reduces (megatron copies it back in
    ``finish_grad_sync``)."""
    for bucket in group.buckets:
        for param in bucket.params_with_extra_main_grads:
            slot = getattr(param, "main_grad_copy_in_grad_buffer", None)
            if slot is not None:
                slot.copy_(param.main_grad)


def start_grad_sync(
    group: Any,
    dispatch: Callable[[Any, Any, bool], ReduceWork | None],
) -> None:
    """megatron's ``start_grad_sync`` for a group reduced to its owners: the same checks,
    scaling and reduce op, then ``dispatch(group, op, async_op)`` packs and issues the reduces
    (and, when synchronous, copies the owner's segment back before returning ``None``)."""
    config = group.ddp_config
    if group.is_first_batch and group.grad_reduce_handle is not None:
        return  # the first overlapped batch already dispatched this group
    previous = group.previous_grad_reduce_bucket_group
    if previous is not None and previous.grad_reduce_handle is not None:
        previous.finish_grad_sync()
    if group.grad_reduce_handle is not None:
        raise RuntimeError("a bucket group's gradient reduce is already in flight")
    _wait_for_graph_replays(group)
    _stage_separate_main_grads(group)
    if config.check_for_nan_in_grad or config.check_for_large_grads:
        group.check_grads(
            check_for_nan_or_inf=config.check_for_nan_in_grad,
            check_for_large=config.check_for_large_grads,
        )
    with torch.no_grad():
        for bucket in group.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data.mul_(bucket.gradient_scaling_factor)
    ops = torch.distributed.ReduceOp
    op = ops.AVG if config.average_in_collective else ops.SUM
    async_op = config.overlap_grad_reduce and config.num_distributed_optimizer_instances == 1
    group.grad_reduce_handle = dispatch(group, op, async_op)
