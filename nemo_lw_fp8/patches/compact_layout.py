"""Compact, decoupled layer-wise DDP buffers: no padding, balanced ownership, one gather per group.

Behaviour (selected with :func:`set_layer_wise_layout` (ddp_config, ``"compact"``)):

* Muon-managed (layer-wise) buffers are laid out without any padding and act as plain-DDP buffers:
  an *effective* per-buffer config with ``use_distributed_optimizer=False`` (gradients are
  all-reduced, parameters keep their own storage). Sibling non-Muon buffers (embeddings, biases,
  norms) keep the standard DistributedOptimizer layout. Bucket groups never mix the two kinds:
  ``partition_buckets`` runs separately per effective setting (also for force-single groups and
  its FP8 "case 3").
* Whole-parameter ownership minimises the largest per-rank Newton-Schulz cost
  (:func:`nemo_lw_fp8.layout.assign_owners`), deterministic on every rank and after a resume.
  Single grouped expert weights can instead be owned in runs of experts by several ranks
  (``grouped_weight_ownership``, :mod:`nemo_lw_fp8.expert_slices`); the gather then assembles an
  MXFP8 grouped weight whole before quantizing it.
* Parameter sync issues exactly one gather collective per layer-wise bucket group and step: each
  owner packs the bf16 cast of its fp32 masters into one segment; the group uses one even
  ``all_gather_into_tensor`` (segments padded to the longest, in a transient buffer only) when that
  padding is within ``gather_padding_tolerance`` of the payload, else one uneven ``all_gather`` of
  the same segments (real bytes only). Every rank copies the gathered values into its weights
  (quantizing into MXFP8 weights from the same bf16 bytes). This also serves MXFP8 FP8 param
  gather, bitwise equal to FP8 gather off, without staging anything in the grad buffer.

Mirrors Megatron-LM PR #5388 (compact decoupled layer-wise layout), with our own explicit setting
(``"padded" | "compact" | "legacy"``; 0.19.2's ``use_layer_wise_param_layout`` keeps its meaning:
True = padded, False = legacy), cost-balanced ownership instead of ping-pong, one even
collective per group instead of #3524's uneven all_gather per bucket, and MXFP8 param gather
supported (upstream rejected that combination).

Patches: ``LayerWiseDistributedOptimizer.compute_full_param_layout`` and ``.shard_params``,
``_ParamAndGradBuffer.__init__`` (effective config), ``partition_buckets`` as DDP calls it,
``_ParamAndGradBucketGroup.start_param_sync`` / ``.finish_param_sync`` (compact groups only),
``LayerWiseDistributedOptimizer.sharded_state_dict`` (refuses expert runs, which torch_dist cannot
describe).

Detection: upstream has it when ``DistributedDataParallelConfig`` carries a per-buffer layer-wise
layout field (``use_layer_wise_param_layout``) - #5388's design.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from .. import layout as layout_math
from ..upstream import change
from .framework import Override, Patch, register
from .owner_gather import OwnerPackedSync

FEATURE = "compact_layout"

#: Attributes on ``DistributedDataParallelConfig`` that hold our settings.
LAYOUT_ATTR = "nemo_lw_fp8_layer_wise_layout"
TOLERANCE_ATTR = "nemo_lw_fp8_gather_padding_tolerance"
OWNERSHIP_ATTR = "nemo_lw_fp8_grouped_weight_ownership"
LAYOUTS = layout_math.LAYER_WISE_LAYOUTS


def set_layer_wise_layout(
    ddp_config: Any,
    layout: str,
    gather_padding_tolerance: float = layout_math.DEFAULT_GATHER_PADDING_TOLERANCE,
    grouped_weight_ownership: str = "whole",
) -> Any:
    """Choose the layer-wise buffer layout on a megatron ``DistributedDataParallelConfig``.

    ``"padded"``: megatron-core 0.19.2's shard-aligned layout (its default);
    ``"compact"``: this module; ``"legacy"``: no layout (flatten + all_gather of whole params).
    For ``"padded"`` and ``"compact"`` wrap with ``use_layer_wise_param_layout=True``; for
    ``"legacy"`` with ``use_layer_wise_param_layout=False`` (megatron's own flag, unchanged).

    ``gather_padding_tolerance`` (compact): a bucket group gathers with one even
    ``all_gather_into_tensor`` when padding every owner's segment to the longest costs at most
    this fraction of the payload, else with one uneven ``all_gather`` (real bytes only).
    ``math.inf`` always takes the even gather.

    ``grouped_weight_ownership`` (compact): how a single grouped expert weight is owned,
    ``"whole"`` (one rank), ``"expert"`` (runs of experts on different ranks, see
    :mod:`nemo_lw_fp8.expert_slices`) or ``"auto"`` (expert runs where they lower the busiest
    rank's Newton-Schulz work by more than 2 %); the arithmetic is the same in all three.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layer_wise_layout must be one of {LAYOUTS}, got {layout!r}")
    if gather_padding_tolerance < 0:
        raise ValueError(f"gather_padding_tolerance must be >= 0, got {gather_padding_tolerance}")
    if grouped_weight_ownership not in layout_math.GROUPED_WEIGHT_OWNERSHIP:
        raise ValueError(
            f"grouped_weight_ownership must be one of {layout_math.GROUPED_WEIGHT_OWNERSHIP}, "
            f"got {grouped_weight_ownership!r}"
        )
    if grouped_weight_ownership != "whole" and layout != "compact":
        raise ValueError(
            f"grouped_weight_ownership={grouped_weight_ownership!r} needs the compact layout "
            f"(layer_wise_layout='compact'); the {layout!r} layout owns whole parameters"
        )
    setattr(ddp_config, LAYOUT_ATTR, layout)
    setattr(ddp_config, TOLERANCE_ATTR, gather_padding_tolerance)
    setattr(ddp_config, OWNERSHIP_ATTR, grouped_weight_ownership)
    return ddp_config


def is_compact(ddp_config: Any) -> bool:
    return getattr(ddp_config, LAYOUT_ATTR, "padded") == "compact"


def _effective_config(ddp_config: Any) -> Any:
    """The per-buffer config of compact layer-wise buffers: plain DDP semantics."""
    effective = copy.copy(ddp_config)
    effective.use_distributed_optimizer = False
    return effective


# --------------------------------------------------------------------------- layout


def _make_compute_full_param_layout(original):
    def compute_full_param_layout(
        params,
        bucket_size,
        data_parallel_world_size,
        ddp_config,
        expert_data_parallel_world_size=None,
    ):
        full = original(
            params,
            bucket_size,
            data_parallel_world_size,
            ddp_config,
            expert_data_parallel_world_size,
        )
        if not is_compact(ddp_config):
            return full
        from megatron.core.distributed.param_and_grad_buffer import (
            _compute_default_per_buffer_param_layout,
            group_params_for_buffers,
        )

        groups = group_params_for_buffers(params, ddp_config.grad_reduce_in_fp32)
        for key, (group_params, param_indices) in groups.items():
            if not key.is_managed_by_layer_wise_optimizer:
                continue
            compact = _compute_default_per_buffer_param_layout(group_params, bucket_size)
            compact.param_indices = param_indices
            full.layouts[key] = compact
        return full

    return compute_full_param_layout


def _layer_wise_params(params_with_names) -> bool:
    return bool(params_with_names) and all(
        getattr(param, "is_managed_by_layer_wise_optimizer", False)
        for param, _ in params_with_names
    )


def _make_buffer_init(original):
    def __init__(self, ddp_config, param_dtype, grad_dtype, params_with_names, *args, **kwargs):
        if is_compact(ddp_config) and _layer_wise_params(params_with_names):
            ddp_config = _effective_config(ddp_config)
        original(self, ddp_config, param_dtype, grad_dtype, params_with_names, *args, **kwargs)

    __init__.__wrapped__ = original
    return __init__


def _make_partition_buckets(original):
    def partition_buckets(buffers, force_single_bucket_group=False, **kwargs):
        """Never group buckets whose effective ``use_distributed_optimizer`` differs."""
        kinds: dict[bool, list[Any]] = {}
        for buffer in buffers:
            kinds.setdefault(bool(buffer.ddp_config.use_distributed_optimizer), []).append(buffer)
        if len(kinds) <= 1:
            return original(buffers, force_single_bucket_group, **kwargs)
        groups = []
        for subset in kinds.values():
            groups += original(subset, force_single_bucket_group, **kwargs)
        return groups

    partition_buckets.__wrapped__ = original
    return partition_buckets


# --------------------------------------------------------------------------- ownership


@dataclass
class CompactGroup:
    """What one compact bucket group gathers: per rank, the params it owns, in order."""

    segments: list[list[torch.nn.Parameter]]
    segment_numel: list[int]
    #: One even all_gather_into_tensor (segments padded to the longest) or one uneven all_gather.
    even: bool

    @property
    def gather_numel(self) -> int:
        """Elements of the gathered buffer."""
        if self.even:
            return max(self.segment_numel) * len(self.segment_numel) if self.segment_numel else 0
        return sum(self.segment_numel)

    def segment_start(self, rank: int) -> int:
        if self.even:
            return rank * max(self.segment_numel)
        return sum(self.segment_numel[:rank])


def _compact_groups(chunk: Any) -> list[Any]:
    return [
        group
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups
        if group.buckets
        and not group.ddp_config.use_distributed_optimizer
        and all(
            getattr(b.params_list[0], "is_managed_by_layer_wise_optimizer", False)
            for b in group.buckets
        )
    ]


def _cost(param: torch.nn.Parameter) -> int:
    """Newton-Schulz cost; a single grouped expert weight counts as its E matrices."""
    from .grouped_weight_layerwise import grouped_members

    if param.dim() < 2:
        return 0
    members = grouped_members(param)
    if members > 1 and param.dim() == 2:
        return layout_math.newton_schulz_cost((members, param.shape[0] // members, param.shape[1]))
    return layout_math.newton_schulz_cost(param.shape)


def _expert_units(param: torch.nn.Parameter) -> int:
    """Experts a param can be split into for ownership: E for a 3-D grouped weight, else 1."""
    from .grouped_weight_layerwise import is_grouped_weight

    return int(param.shape[0]) if param.dim() == 3 and is_grouped_weight(param) else 1


def compact_pieces(
    params: list[torch.nn.Parameter], world_size: int, ownership: str, local_rank: int = 0
) -> list[torch.nn.Parameter]:
    """Per param, what its owner updates: the param itself, or expert slices of a grouped weight.

    Returns one entry per piece, each tagged with ``_nemo_lw_fp8_owner_rank``; the entry is the
    parameter for a whole piece and an :class:`~nemo_lw_fp8.expert_slices.ExpertSlice` for a run
    of experts. Deterministic, so every rank builds the same pieces (also for others' params:
    the gather needs to know where each rank's bytes go).
    """
    from ..expert_slices import ExpertSlice

    costs = [_cost(p) for p in params]
    sizes = [p.numel() for p in params]
    units = [1 if ownership == "whole" else _expert_units(p) for p in params]
    pieces = []
    for piece in layout_math.choose_pieces(costs, units, world_size, sizes, ownership):
        param = params[piece.index]
        whole = piece.lo == 0 and piece.hi == units[piece.index]
        mine = piece.owner == local_rank
        entry = param if whole else ExpertSlice(param, piece.lo, piece.hi, materialize=mine)
        entry._nemo_lw_fp8_owner_rank = piece.owner
        pieces.append(entry)
    return pieces


def _shard_compact(optimizer: Any, optimizers: list[Any], ownership: str) -> None:
    """Ownership for compact buffers; narrows the optimizers' param groups to this rank's
    pieces (whole params, or expert slices of grouped weights)."""
    from megatron.core.utils import get_pg_rank, get_pg_size

    from ..expert_slices import parent_of

    dp_size, expt_size = get_pg_size(optimizer.dp_cp), get_pg_size(optimizer.expt_dp)
    dp_rank, expt_rank = get_pg_rank(optimizer.dp_cp), get_pg_rank(optimizer.expt_dp)
    param_groups = [group for opt in optimizers for group in opt.param_groups]
    dense, expert = [], []
    for group in param_groups:
        (expert if group.get("is_expert_parallel", False) else dense).extend(group["params"])
    pieces_of: dict[torch.nn.Parameter, list[torch.nn.Parameter]] = {}
    per_rank: dict[int, list[list[torch.nn.Parameter]]] = {}
    for kind, (params, size, rank) in enumerate(
        ((dense, dp_size, dp_rank), (expert, expt_size, expt_rank))
    ):
        per_rank[kind] = [[] for _ in range(size)]
        for piece in compact_pieces(params, size, ownership, rank):
            pieces_of.setdefault(parent_of(piece), []).append(piece)
            per_rank[kind][piece._nemo_lw_fp8_owner_rank].append(piece)
    optimizer.dp_cp_params_list = per_rank[0]
    optimizer.expt_dp_params_list = per_rank[1] if expert else None
    optimizer._nemo_lw_fp8_pieces = pieces_of
    for group in param_groups:
        local = expt_rank if group.get("is_expert_parallel", False) else dp_rank
        group["params"] = [
            piece
            for param in group["params"]
            for piece in pieces_of[param]
            if piece._nemo_lw_fp8_owner_rank == local
        ]


def _attach_compact_groups(optimizer: Any, model_chunks: list[Any]) -> None:
    pieces_of = optimizer._nemo_lw_fp8_pieces
    for chunk in model_chunks:
        for group in _compact_groups(chunk):
            size = group.data_parallel_group.size()
            segments: list[list[torch.nn.Parameter]] = [[] for _ in range(size)]
            for bucket in group.buckets:
                for param in bucket.params_list:
                    for piece in pieces_of[param]:
                        segments[piece._nemo_lw_fp8_owner_rank].append(piece)
            numel = [sum(p.numel() for p in seg) for seg in segments]
            tolerance = getattr(
                chunk.ddp_config, TOLERANCE_ATTR, layout_math.DEFAULT_GATHER_PADDING_TOLERANCE
            )
            group._nemo_lw_fp8_compact = CompactGroup(
                segments, numel, layout_math.even_gather_fits(numel, tolerance)
            )


def _make_shard_params(original):
    def shard_params(self, optimizers, full_param_layouts=None):
        chunks = getattr(self, "_nemo_lw_fp8_chunks", None) or []
        if full_param_layouts is None or not chunks or not is_compact(chunks[0].ddp_config):
            return original(self, optimizers, full_param_layouts)
        from megatron.core.utils import get_pg_size

        if get_pg_size(self.dp_cp) == 1:
            return original(self, optimizers, full_param_layouts)
        _shard_compact(self, optimizers, getattr(chunks[0].ddp_config, OWNERSHIP_ATTR, "whole"))
        _attach_compact_groups(self, chunks)
        return None

    shard_params.__wrapped__ = original
    return shard_params


def _make_sharded_state_dict(original):
    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        """Refuse, with the fix, a torch_dist checkpoint of expert-run ownership (guarded at
        configuration time too: rule ``grouped-weight-split-ownership-checkpoint``)."""
        from ..expert_slices import is_slice

        pieces = getattr(self, "_nemo_lw_fp8_pieces", {})
        if any(is_slice(p) for group in pieces.values() for p in group):
            from ..guards import ConfigError

            raise ConfigError(
                "grouped-weight-split-ownership-checkpoint",
                "this layer-wise optimizer owns runs of experts of single grouped weights "
                "(grouped_weight_ownership='expert'/'auto'), which megatron's torch_dist "
                "optimizer state cannot describe. Fix: grouped_weight_ownership='whole'.",
            )
        return original(self, model_sharded_state_dict, is_loading, **kwargs)

    sharded_state_dict.__wrapped__ = original
    return sharded_state_dict


def _make_lw_init(original):
    def __init__(
        self, optimizers, config, pg_collection=None, init_state_fn_list=None, model_chunks=None
    ):
        # shard_params runs inside __init__ before model_chunks is stored; hand them over.
        self._nemo_lw_fp8_chunks = model_chunks
        original(self, optimizers, config, pg_collection, init_state_fn_list, model_chunks)

    __init__.__wrapped__ = original
    return __init__


# --------------------------------------------------------------------------- the gather


def _source(param: torch.nn.Parameter) -> torch.Tensor:
    """What the owner ships: its fp32 master if it has one, else the param itself."""
    master = getattr(param, "main_param", None)
    return master if master is not None else param


def ranks_to_unpack(state: CompactGroup, my_rank: int) -> range:
    """Every rank's segment, this rank's own included: the owner takes its weights from the
    same bf16 bytes as everyone else (for MXFP8, the inner step does not touch them)."""
    return range(len(state.segments))


def _unpack(group: Any, state: CompactGroup, gathered: torch.Tensor) -> None:
    """Write every gathered segment into the weights. Expert slices of a quantized (MXFP8)
    grouped weight are assembled into one bf16 tensor first and quantized once, from the same
    bytes a whole owner would have sent."""
    from megatron.core.distributed.param_and_grad_buffer import (
        _param_uses_quantized_storage,
        copy_tensor_to_quantized_param,
    )

    from ..expert_slices import is_slice

    assembled: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
    for rank in ranks_to_unpack(state, group.data_parallel_group.rank()):
        offset = state.segment_start(rank)
        for piece in state.segments[rank]:
            values = gathered[offset : offset + piece.numel()]
            offset += piece.numel()
            if is_slice(piece) and piece.quantized_parent:
                parent = piece.parent
                _, whole = assembled.setdefault(
                    id(parent), (parent, values.new_empty(parent.numel()))
                )
                start, end = piece.flat_range
                whole[start:end].copy_(values)
            elif _param_uses_quantized_storage(piece):
                copy_tensor_to_quantized_param(piece, values.view(piece.shape))
            else:
                piece.data.copy_(values.view(piece.shape))
    for parent, whole in assembled.values():
        copy_tensor_to_quantized_param(parent, whole.view(parent.shape))


def _compact_dispatch(group: Any, async_op: bool) -> None:
    """Pack this rank's owned masters (bf16) and issue the group's single gather collective."""
    state: CompactGroup = group._nemo_lw_fp8_compact
    process_group = group.data_parallel_group
    rank = process_group.rank()
    dtype = group.buckets[0].params_list[0].dtype
    device = group.buckets[0].grad_data.device
    gathered = torch.empty(state.gather_numel, dtype=dtype, device=device)
    send = torch.zeros(
        max(state.segment_numel) if state.even else state.segment_numel[rank],
        dtype=dtype,
        device=device,
    )
    offset = 0
    with torch.no_grad():
        for param in state.segments[rank]:
            send[offset : offset + param.numel()].copy_(_source(param).detach().reshape(-1))
            offset += param.numel()
    if state.even:
        work = torch.distributed.all_gather_into_tensor(
            gathered, send, group=process_group, async_op=async_op
        )
    else:
        outputs = [
            gathered[state.segment_start(r) :][: state.segment_numel[r]]
            for r in range(process_group.size())
        ]
        work = torch.distributed.all_gather(outputs, send, group=process_group, async_op=async_op)
    group._nemo_lw_fp8_pending = gathered
    group.param_gather_handle = work if async_op else None
    if not async_op:
        _unpack_pending(group)


def _unpack_pending(group: Any) -> None:
    gathered = getattr(group, "_nemo_lw_fp8_pending", None)
    if gathered is not None:
        group._nemo_lw_fp8_pending = None
        with torch.no_grad():
            _unpack(group, group._nemo_lw_fp8_compact, gathered)


#: One all_gather(_into_tensor) of owner-packed bf16 values per bucket group, under megatron's
#: start/finish contract (:mod:`.owner_gather`).
COMPACT_SYNC = OwnerPackedSync(
    dispatch=lambda group, async_op: _compact_dispatch(group, async_op),
    unpack=lambda group: _unpack_pending(group),
    empty=lambda group: group._nemo_lw_fp8_compact.gather_numel == 0,
)


def compact_start_param_sync(group: Any, force_sync: bool = False) -> None:
    COMPACT_SYNC.start(group, force_sync)


def compact_finish_param_sync(group: Any, skip_next_bucket_dispatch: bool = False) -> None:
    COMPACT_SYNC.finish(group, skip_next_bucket_dispatch)


def _make_start(original):
    def start_param_sync(self, force_sync: bool = False):
        if getattr(self, "_nemo_lw_fp8_compact", None) is not None:
            return compact_start_param_sync(self, force_sync)
        return original(self, force_sync)

    start_param_sync.__wrapped__ = original
    return start_param_sync


def _make_finish(original):
    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False):
        if getattr(self, "_nemo_lw_fp8_compact", None) is not None:
            return compact_finish_param_sync(self, skip_next_bucket_dispatch)
        return original(self, skip_next_bucket_dispatch)

    finish_param_sync.__wrapped__ = original
    return finish_param_sync


# --------------------------------------------------------------------------- wiring


def _build_overrides() -> list[Override]:
    from megatron.core.distributed import distributed_data_parallel as ddp_module
    from megatron.core.distributed import param_and_grad_buffer as buffer_module
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    lw = LayerWiseDistributedOptimizer
    buffer_cls = buffer_module._ParamAndGradBuffer
    group_cls = buffer_module._ParamAndGradBucketGroup
    layout_fn = lw.__dict__["compute_full_param_layout"].__func__
    return [
        Override(
            lw,
            "compute_full_param_layout",
            staticmethod(_make_compute_full_param_layout(layout_fn)),
        ),
        Override(lw, "shard_params", _make_shard_params(lw.__dict__["shard_params"])),
        Override(lw, "__init__", _make_lw_init(lw.__init__)),
        Override(
            lw,
            "sharded_state_dict",
            _make_sharded_state_dict(lw.__dict__["sharded_state_dict"]),
        ),
        Override(buffer_cls, "__init__", _make_buffer_init(buffer_cls.__dict__["__init__"])),
        Override(
            ddp_module, "partition_buckets", _make_partition_buckets(ddp_module.partition_buckets)
        ),
        Override(
            group_cls, "start_param_sync", _make_start(group_cls.__dict__["start_param_sync"])
        ),
        Override(
            group_cls, "finish_param_sync", _make_finish(group_cls.__dict__["finish_param_sync"])
        ),
    ]


PATCH = register(
    Patch(
        name=FEATURE,
        upstream_pr=5388,
        summary="compact layer-wise buffers, cost-balanced ownership, one gather per group",
        detect_native=change(5388).detect,
        build_overrides=_build_overrides,
        requires=("muon_fp8_param_gather",),
    )
)
