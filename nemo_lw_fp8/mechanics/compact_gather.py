"""The compact layout's gather: one collective per bucket group, each owner packing the bf16 cast
of its fp32 masters into its segment; one even ``all_gather_into_tensor`` when the padding is
within ``gather_padding_tolerance``, else one uneven ``all_gather`` (:mod:`.owner_gather`). Every
rank copies the gathered values into its weights, quantizing into MXFP8 weights from the same
bf16 bytes. The plan it follows (:class:`~.compact.CompactGroup`) is :mod:`.compact`'s; blockwise
and NVFP4 weights travel in their own bytes instead (:mod:`.blockwise`).
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_lw_fp8.mechanics import expert_slices, owner_gather, qkv_parts
from nemo_lw_fp8.mechanics.compact import CompactGroup
from nemo_lw_fp8.state import group_state, peek


def _source(param: torch.nn.Parameter) -> torch.Tensor:
    """What the owner ships: its fp32 master if it has one, else the param itself."""
    master = getattr(param, "main_param", None)
    return master if master is not None else param


def unpack(group: Any, plan: CompactGroup, gathered: torch.Tensor) -> None:
    """Write the gathered segments into the weights. Expert slices and QKV parts of a quantized
    (MXFP8) weight are assembled into one bf16 tensor first and quantized once, from the same
    bytes a whole owner would have sent."""
    # Each from the module that defines it: 0.20 no longer re-exports the copy from
    # param_and_grad_buffer, while fp8_utils defines it on 0.19.0, 0.19.2 and 0.20 alike.
    from megatron.core.distributed.param_and_grad_buffer import _param_uses_quantized_storage
    from megatron.core.fp8_utils import copy_tensor_to_quantized_param

    assembled: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
    for rank in owner_gather.ranks_to_unpack(plan, group.data_parallel_group.rank()):
        offset = plan.segment_start(rank)
        for piece in plan.segments[rank]:
            values = gathered[offset : offset + piece.numel()]
            offset += piece.numel()
            if expert_slices.is_part_of_weight(piece) and piece.quantized_parent:
                parent = piece.parent
                _, whole = assembled.setdefault(
                    id(parent), (parent, values.new_empty(parent.numel()))
                )
                if qkv_parts.is_part(piece):
                    qkv_parts.write_back(piece, whole, values)
                else:
                    start, end = piece.flat_range
                    whole[start:end].copy_(values)
            elif qkv_parts.is_part(piece):
                qkv_parts.write_back(piece, piece.parent.data, values)
            elif _param_uses_quantized_storage(piece):
                copy_tensor_to_quantized_param(piece, values.view(piece.shape))
            else:
                piece.data.copy_(values.view(piece.shape))
    for parent, whole in assembled.values():
        copy_tensor_to_quantized_param(parent, whole.view(parent.shape))


def dispatch(group: Any, async_op: bool) -> None:
    """Pack this rank's owned masters (bf16) and issue the group's single gather collective."""
    record = group_state(group)
    plan: CompactGroup = record.compact
    owner_gather.gather_owned(
        group,
        record,
        plan.segment_numel,
        plan.even,
        group.data_parallel_group,
        group.buckets[0].params_list[0].dtype,
        lambda rank, send: _pack_owned(plan, rank, send),
        async_op,
        unpack_pending,
    )


def _pack_owned(plan: CompactGroup, rank: int, send: torch.Tensor) -> None:
    offset = 0
    for param in plan.segments[rank]:
        send[offset : offset + param.numel()].copy_(_source(param).detach().reshape(-1))
        offset += param.numel()


def unpack_pending(group: Any) -> None:
    record = group_state(group)
    gathered = owner_gather.take_pending(record)
    if gathered is not None:
        with torch.no_grad():
            unpack(group, record.compact, gathered)


def plan_of(group: Any) -> CompactGroup | None:
    """The compact gather plan of ``group`` (``None``: megatron gathers it)."""
    record = peek(group)
    return None if record is None or record.blockwise is not None else record.compact


#: One all_gather(_into_tensor) of owner-packed bf16 values per bucket group, under megatron's
#: start/finish contract (:mod:`.owner_gather`).
SYNC = owner_gather.OwnerPackedSync(
    dispatch=lambda group, async_op: dispatch(group, async_op),
    unpack=lambda group: unpack_pending(group),
    empty=lambda group: group_state(group).compact.gather_numel == 0,
)


# --------------------------------------------------------------------------- the gradient sync
