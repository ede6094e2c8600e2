"""megatron's bucket-group sync contract for owner-packed gathers (not a patch of its own).

The compact layout (bf16 values) and the blockwise FP8 gather (FP8 codes + tile scales) both
replace a layer-wise bucket group's ``start_param_sync`` / ``finish_param_sync`` with one
collective of owner-packed segments. What megatron's callers rely on is the same for both, so it
lives here once: a forced sync completes an in-flight gather instead of issuing another, an
overlapped gather is asynchronous and its ``finish`` dispatches the next group before unpacking,
and ``param_gather_dispatched`` / ``param_gather_handle`` keep megatron's meaning. Each kind
supplies its own steps: ``dispatch(group, async_op)`` packs and issues the collective (and
unpacks at once when synchronous), ``unpack(group)`` writes a finished gather into the weights,
``post(group)`` runs after the weights are current (blockwise: derive the columnwise copies), and
``empty(group)`` says a group has nothing to gather.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


def _nothing(group: Any) -> None:
    return None


def _never(group: Any) -> bool:
    return False


@dataclass(frozen=True)
class OwnerPackedSync:
    """The steps of one kind of owner-packed gather (see the module docstring)."""

    dispatch: Callable[[Any, bool], None]
    unpack: Callable[[Any], None]
    post: Callable[[Any], None] = _nothing
    empty: Callable[[Any], bool] = _never

    def start(self, group: Any, force_sync: bool = False) -> None:
        overlap = group.ddp_config.overlap_param_gather
        if force_sync and group.param_gather_handle is not None:
            group.param_gather_handle.wait()
            group.param_gather_handle = None
            self.unpack(group)
            self.post(group)
            return
        if self.empty(group):
            group.param_gather_dispatched = True
            return
        self.dispatch(group, overlap and not force_sync)
        if force_sync and overlap:
            self.post(group)
        group.param_gather_dispatched = True

    def finish(self, group: Any, skip_next_bucket_dispatch: bool = False) -> None:
        if not group.param_gather_dispatched:
            self.start(group)
        if group.param_gather_handle is not None:
            group.param_gather_handle.wait()
            group.param_gather_handle = None
            following = group.next_param_gather_bucket_group
            dispatch_next = following is not None and not skip_next_bucket_dispatch
            if dispatch_next and not following.param_gather_dispatched:
                following.start_param_sync()
            self.unpack(group)
            self.post(group)


def ranks_to_unpack(plan: Any, my_rank: int) -> list[int]:
    """The ranks whose gathered segments this rank writes into its weights.

    ``plan.unpack_own`` says whether the owner also takes its own weights from the gathered
    bytes: the compact gather does (the inner step left MXFP8 weights alone, and every rank must
    quantize the same bf16 bytes), the blockwise gather does not (the owner quantized in place).
    """
    return [rank for rank in range(len(plan.segments)) if plan.unpack_own or rank != my_rank]


# --------------------------------------------------------------------------- segments on the wire


def gathered_length(sizes: Sequence[int], even: bool) -> int:
    """Length of the gathered buffer: every segment padded to the longest (even), or their sum."""
    if even:
        return max(sizes) * len(sizes) if sizes else 0
    return sum(sizes)


def segment_start(sizes: Sequence[int], even: bool, rank: int) -> int:
    """Where ``rank``'s segment starts in the gathered buffer."""
    return rank * max(sizes) if even else sum(sizes[:rank])


def all_gather_segments(
    gathered: torch.Tensor,
    send: torch.Tensor,
    sizes: Sequence[int],
    even: bool,
    process_group: Any,
    async_op: bool,
) -> Any:
    """The group's one collective: an even ``all_gather_into_tensor`` (``send`` padded to the
    longest segment) or an uneven ``all_gather`` of the real segments. Returns the work handle."""
    if even:
        return torch.distributed.all_gather_into_tensor(
            gathered, send, group=process_group, async_op=async_op
        )
    outputs = [
        gathered[segment_start(sizes, even, rank) :][: sizes[rank]]
        for rank in range(process_group.size())
    ]
    return torch.distributed.all_gather(outputs, send, group=process_group, async_op=async_op)


def gather_owned(
    group: Any,
    record: Any,
    sizes: Sequence[int],
    even: bool,
    process_group: Any,
    dtype: torch.dtype,
    pack: Callable[[int, torch.Tensor], None],
    async_op: bool,
    finish: Callable[[Any], None],
) -> None:
    """A kind's ``dispatch``: this rank packs its segment (``pack(rank, send)``), then the bucket
    group's one collective of every owner's segment is issued. The gathered buffer waits in
    ``record.pending`` until ``finish(group)`` unpacks it: at once when not ``async_op``."""
    rank = process_group.rank()
    device = group.buckets[0].grad_data.device
    gathered = torch.empty(gathered_length(sizes, even), dtype=dtype, device=device)
    send = torch.zeros(max(sizes) if even else sizes[rank], dtype=dtype, device=device)
    with torch.no_grad():
        pack(rank, send)
    work = all_gather_segments(gathered, send, sizes, even, process_group, async_op)
    record.pending = gathered
    group.param_gather_handle = work if async_op else None
    if not async_op:
        finish(group)


def take_pending(record: Any) -> torch.Tensor | None:
    """The finished gather waiting in ``record.pending`` (None: nothing to unpack), taken once."""
    gathered, record.pending = record.pending, None
    return gathered
