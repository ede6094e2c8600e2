"""megatron's bucket-group grad-sync contract for reducing each gradient to its owner only.

Why: a compact layer-wise bucket group runs with plain-DDP semantics, so megatron all-reduces its
gradients and every rank receives every Muon gradient, although only the matrix's owner reads it
(the layer-wise optimizer updates, clips and counts its own matrices only). This module replaces
that all-reduce with one reduce per owner's span of each bucket: the compact layout lays each
bucket's gradients out in owner order once ownership is known
(:func:`nemo_lw_fp8.mechanics.compact_grads.lay_out_grads_by_owner`), so an owner's gradients in a
bucket are one contiguous span of the grad buffer, reduced there in place to the owner: no
transient buffer, no copies. On NCCL the reduces go out under one coalescing manager (one launch
per bucket group); gloo has no coalescing and runs them one after the other. Other ranks keep
local (scaled, unreduced; on gloo possibly partly summed) values in spans they do not own, which
nothing reads.

megatron's own ``start_grad_sync`` runs (:func:`start_grad_sync`): its NaN / large-gradient
checks, the staging of separate fp32 ``main_grad``, the ``gradient_scaling_factor`` scaling, the
reduce op (``average_in_collective``), the first-overlapped-batch and previous-group handling and
``grad_reduce_handle`` stay upstream's, so an upstream fix to that method reaches plugin runs.
Only the collective it issues on the group's bucket buffers inside its coalescing manager is
replaced, for the length of the call, by the reduces to the owners; megatron's
``finish_grad_sync`` waits on them. A forced all-reduce (``force_all_reduce``) still all-reduces.

The layout order and the wire arithmetic (a ring reduce: every rank but the destination sends
the span once) are here too, as functions of sizes and owners, so the planner's model
(:mod:`nemo_lw_fp8.planner.traffic`) and the mechanism compute the same spans.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
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

    return "nccl" in str(torch.distributed.get_backend(process_group)) and device.type == "cuda"


def reduce_spans(
    spans: Sequence[tuple[int, torch.Tensor]],
    op: Any,
    process_group: Any,
    async_op: bool,
) -> list[Any]:
    """Reduce each ``(owner, tensor)`` span in place to group rank ``owner``. Returns the works
    to wait for (empty when synchronous)."""
    import torch

    spans = [(owner, span) for owner, span in spans if span.numel()]
    if not spans:
        return []

    def issue(each_async: bool) -> list[Any]:
        works = []
        for owner, span in spans:
            work = torch.distributed.reduce(
                span, op=op, group=process_group, group_dst=owner, async_op=each_async
            )
            if work is not None:
                works.append(work)
        return works

    device = spans[0][1].device
    if coalesces(process_group, device):
        return _coalesced(process_group, device, async_op, issue)
    return issue(async_op)  # gloo: one after the other


def _coalesced(
    process_group: Any, device: torch.device, async_op: bool, issue: Callable[[bool], list[Any]]
) -> list[Any]:
    """The reduces ``issue`` sends, as one NCCL launch: the only code of the owner reduce that
    cannot run on CPU (gloo has no coalescing; ``tests/mechanics/test_owner_reduce_spans.py``
    runs it on 2 GPUs). Inside the manager each reduce is queued (``async_op=True``); the
    manager's work stands for all of them."""
    from torch.distributed import _coalescing_manager

    with _coalescing_manager(process_group, device=device, async_ops=async_op) as cm:
        issue(True)
    return [cm] if async_op else []


# --------------------------------------------------------------------------- megatron's contract
#
# megatron's own ``_ParamAndGradBucketGroup.start_grad_sync`` runs for an owner-reduced group: its
# checks, staging, scaling, reduce op, overlap and handle bookkeeping are upstream's, so an
# upstream fix to them reaches plugin runs (the fingerprint check in patches/ still refuses a
# megatron whose method changed). Only the collective it issues inside its coalescing manager
# (the all-reduce of each bucket's ``grad_data``, or the reduce-scatter with the distributed
# optimizer) is replaced, for the length of that call, by the reduces to the owners.


class _PendingReduces:
    """What megatron's coalescing manager hands back for an owner-reduced group: megatron stores
    it as ``grad_reduce_handle`` (overlapped) and ``finish_grad_sync`` waits on it."""

    def __init__(self) -> None:
        self.work: ReduceWork | None = None

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


class _OwnerCollectives:
    """One owner-reduced ``start_grad_sync`` call: stands in for megatron's coalescing manager
    and bucket collectives for this group only. Anything else issued during the call (a previous
    group's sync that megatron finishes first, another group's reduce, the NaN check) reaches the
    real collective: only calls on this group's own bucket buffers, inside the coalescing block,
    are taken over."""

    def __init__(self, group: Any, dispatch: Callable[[Any, Any, bool], ReduceWork | None]):
        self.group = group
        self.dispatch = dispatch
        self.inside = False
        self.recorded: list[tuple[Any, bool]] = []
        self.pending = _PendingReduces()

    def owns(self, tensor: Any) -> bool:
        """Whether ``tensor`` is one of this group's bucket buffers (what megatron reduces)."""
        return self.inside and any(tensor is b.grad_data for b in self.group.buckets)

    def record(self, op: Any, async_op: bool) -> _PendingReduces:
        self.recorded.append((op, bool(async_op)))
        return self.pending

    def finish(self) -> None:
        """At the end of megatron's coalescing block: one reduce per owner's span, in place."""
        if len(self.recorded) != len(self.group.buckets):
            raise RuntimeError(
                f"megatron's start_grad_sync issued {len(self.recorded)} bucket collectives for "
                f"{len(self.group.buckets)} buckets; the owner reduce replaces one per bucket"
            )
        if len(set(self.recorded)) != 1:
            raise RuntimeError("megatron's bucket collectives disagree on reduce op or async")
        op, async_op = self.recorded[0]
        self.pending.work = self.dispatch(self.group, op, async_op)


_ACTIVE: list[_OwnerCollectives | None] = []


@contextmanager
def _coalescing(process_group: Any, device: Any = None, async_ops: bool = False):
    """megatron's ``_coalescing_manager`` while an owner-reduced group syncs: the real one for
    anything else, for this group's bucket collectives a handle to the reduces it dispatches."""
    scope = _ACTIVE[-1] if _ACTIVE else None
    if scope is None or scope.inside:
        with _REAL["coalescing"](process_group, device=device, async_ops=async_ops) as cm:
            yield cm
        return
    scope.inside = True
    try:
        yield scope.pending
    finally:
        scope.inside = False
    scope.finish()


_REAL: dict[str, Any] = {}


def _all_reduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    scope = _ACTIVE[-1] if _ACTIVE else None
    if scope is None or not scope.owns(tensor):
        return _REAL["all_reduce"](tensor, *args, **kwargs)
    op = kwargs.get("op", args[0] if args else None)
    return scope.record(op, kwargs.get("async_op", False))


def _reduce_scatter(output: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:
    scope = _ACTIVE[-1] if _ACTIVE else None
    if scope is None or not scope.owns(tensor):
        return _REAL["reduce_scatter"](output, tensor, *args, **kwargs)
    return scope.record(kwargs.get("op"), kwargs.get("async_op", False))


@contextmanager
def _owner_collectives(group: Any, dispatch: Callable[[Any, Any, bool], ReduceWork | None]):
    """For the length of one ``start_grad_sync`` call, megatron's bucket collectives of
    ``group`` become the owner reduce. Nested calls (megatron finishing a previous group's sync,
    which may start it) open their own scope or, with ``None``, pass straight through."""
    if dispatch is None and not _ACTIVE:
        yield  # megatron's collectives as they are; nothing to tell apart
        return
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as buffer_module

    outermost = not _ACTIVE
    if outermost:
        _REAL.update(
            coalescing=buffer_module._coalescing_manager,
            all_reduce=dist.all_reduce,
            reduce_scatter=buffer_module.dist_reduce_scatter_func,
        )
        buffer_module._coalescing_manager = _coalescing
        dist.all_reduce = _all_reduce
        buffer_module.dist_reduce_scatter_func = _reduce_scatter
    _ACTIVE.append(_OwnerCollectives(group, dispatch) if dispatch is not None else None)
    try:
        yield
    finally:
        _ACTIVE.pop()
        if outermost:
            buffer_module._coalescing_manager = _REAL["coalescing"]
            dist.all_reduce = _REAL["all_reduce"]
            buffer_module.dist_reduce_scatter_func = _REAL["reduce_scatter"]
            _REAL.clear()


def start_grad_sync(
    group: Any,
    original: Callable[..., Any],
    dispatch: Callable[[Any, Any, bool], ReduceWork | None] | None,
    force_all_reduce: bool = False,
) -> Any:
    """Run megatron's ``start_grad_sync`` (``original``) on ``group``; with ``dispatch``, the
    bucket collectives it issues become ``dispatch(group, op, async_op)`` (the reduces to the
    owners, returning the pending work when asynchronous, else ``None``). Without, megatron's
    collectives run as they are (inside another group's owner-reduced call, too)."""
    with _owner_collectives(group, dispatch):
        return original(group, force_all_reduce)
