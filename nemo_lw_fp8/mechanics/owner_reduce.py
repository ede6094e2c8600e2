"""megatron's bucket-group grad-sync contract for reducing each gradient to its owner only.

Why: a compact layer-wise bucket group runs with plain-DDP semantics, so megatron all-reduces its
gradients and every rank receives every Muon gradient, although only the matrix's owner reads it
(the layer-wise optimizer updates, clips and counts its own matrices only). This module replaces
that all-reduce with one reduce per owner's span of each bucket: the compact layout lays each
bucket's gradients out in owner order once ownership is known
(:func:`nemo_lw_fp8.mechanics.compact.lay_out_grads_by_owner`), so an owner's gradients in a
bucket are one contiguous span of the grad buffer, reduced there in place to the owner: no
transient buffer, no copies. On NCCL the reduces go out under one coalescing manager (one launch
per bucket group); gloo has no coalescing and runs them one after the other. Other ranks keep
local (scaled, unreduced; on gloo possibly partly summed) values in spans they do not own, which
nothing reads.

What megatron's callers rely on is kept: gradients are scaled by the buckets'
``gradient_scaling_factor`` before the collective and summed (or averaged with
``average_in_collective``), the NaN / large-gradient checks run on the local gradients first,
``grad_reduce_handle`` is the pending work (megatron's own ``finish_grad_sync`` waits on it and
copies separate fp32 ``main_grad`` back), a forced all-reduce (``force_all_reduce``) still
all-reduces, and a first overlapped batch reduces from ``finish_grad_sync`` as megatron's does.

The layout order and the wire arithmetic (a ring reduce: every rank but the destination sends
the span once) are here too, as functions of sizes and owners, so the planner's model
(:mod:`nemo_lw_fp8.models.traffic`) and the mechanism compute the same spans.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the layout and wire arithmetic is imported by the planner without torch
    import torch

# --------------------------------------------------------------------------- layout and wire


def owner_order(first_owners: Sequence[int]) -> list[int]:
    """Indices of a bucket's params in the order their gradients are laid out: by owner (of the
    param's first piece), backprop order within one owner. Each owner's gradients in the bucket
    are then one contiguous span (a grouped weight owned in runs of experts by several ranks
    adds one span per further run)."""
    return sorted(range(len(first_owners)), key=lambda i: (int(first_owners[i]), i))


def owner_spans(pieces: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(owner, elements)`` pieces in buffer order merged into maximal runs of one owner: the
    spans the owner reduce sends, one reduce each (empty pieces dropped)."""
    spans: list[tuple[int, int]] = []
    for owner, numel in pieces:
        if not numel:
            continue
        if spans and spans[-1][0] == owner:
            spans[-1] = (owner, spans[-1][1] + int(numel))
        else:
            spans.append((int(owner), int(numel)))
    return spans


@dataclass(frozen=True)
class GradSyncTraffic:
    """One bucket group's gradient sync, per rank and step."""

    #: Elements this rank sends (ring reduce: every rank but the destination sends the span).
    sent: int
    #: Reduce calls (one per span of one owner's gradients in a bucket).
    reduces: int
    #: Collective launches (one coalesced launch; 0 for an empty group).
    launches: int


def owner_reduce_traffic(
    spans: Sequence[tuple[int, int]], rank: int, world: int
) -> GradSyncTraffic:
    """What reducing each ``(owner, elements)`` span to its owner costs ``rank`` (ring model).
    The spans are reduced in place in the grad buffer: no transient buffer."""
    if world <= 1:
        return GradSyncTraffic(0, 0, 0)
    reduces = sum(1 for _, numel in spans if numel)
    sent = sum(numel for owner, numel in spans if owner != rank)
    return GradSyncTraffic(sent, reduces, 1 if reduces else 0)


def all_reduce_sent(total: int, world: int) -> float:
    """Elements one rank sends in a ring all-reduce of ``total`` elements."""
    return 2 * (world - 1) / world * total if world > 1 else 0.0


def reduce_scatter_sent(total: int, world: int) -> float:
    """Elements one rank sends in an exact (unpadded) ring reduce-scatter: the lower limit for
    delivering each owner its reduced gradients."""
    return (world - 1) / world * total if world > 1 else 0.0


# --------------------------------------------------------------------------- the collective


class ReduceWork:
    """The pending reduces of one bucket group; megatron's ``finish_grad_sync`` waits on it."""

    def __init__(self, works: list[Any]):
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []


def coalesces(process_group: Any, device: torch.device) -> bool:
    """Whether the backend runs a coalescing manager's reduces on ``device`` as one launch
    (NCCL does for CUDA tensors; gloo has no coalescing)."""
    import torch

    return device.type == "cuda" and "nccl" in str(torch.distributed.get_backend(process_group))


def reduce_spans(
    spans: Sequence[tuple[int, torch.Tensor]],
    op: Any,
    process_group: Any,
    async_op: bool,
) -> list[Any]:
    """Reduce each ``(owner, tensor)`` span in place to group rank ``owner``. Returns the works
    to wait for (empty when synchronous)."""
    import torch
    from torch.distributed import _coalescing_manager

    spans = [(owner, span) for owner, span in spans if span.numel()]
    if not spans:
        return []
    device = spans[0][1].device
    if coalesces(process_group, device):
        with _coalescing_manager(process_group, device=device, async_ops=async_op) as cm:
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
    import torch

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
    scaling and reduce op, then ``dispatch(group, op, async_op)`` issues the reduces (returning
    the pending work when asynchronous, else ``None``)."""
    import torch

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
