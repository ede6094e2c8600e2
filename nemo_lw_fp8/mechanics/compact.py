"""The compact layer-wise layout: no padding, balanced ownership, one gather per bucket group.

* Muon-managed (layer-wise) buffers are laid out without any padding and act as plain-DDP
  buffers: an *effective* per-buffer config with ``use_distributed_optimizer=False``
  (parameters keep their own storage). Sibling non-Muon buffers (embeddings,
  biases, norms) keep the standard DistributedOptimizer layout; bucket groups never mix the two.
* Whole-parameter ownership minimises the largest per-rank Newton-Schulz cost
  (:func:`nemo_lw_fp8.layout.packing.choose_pieces`), deterministic on every rank and after a
  resume. Single grouped expert weights can instead be owned in runs of experts by several ranks
  (:mod:`.expert_slices`); the gather then assembles an MXFP8 grouped weight whole before
  quantizing it.
* One gather collective per layer-wise bucket group and step: each owner packs the bf16 cast of
  its fp32 masters into one segment; the group uses one even ``all_gather_into_tensor``
  (segments padded to the longest, in a transient buffer only) when that padding is within the
  config's ``gather_padding_tolerance``, else one uneven ``all_gather`` of the same segments.
  Every rank copies the gathered values into its weights (quantizing into MXFP8 weights from the
  same bf16 bytes), which also serves MXFP8 param gather without staging in the grad buffer.

* Gradients: once ownership is known, each owner's gradients are reduced to it alone
  (:mod:`.compact_grads`).

Settings come from :class:`nemo_lw_fp8.config.LayerWiseConfig` on the DDP config.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from nemo_lw_fp8 import config as plugin_config
from nemo_lw_fp8.layout import packing as layout_math
from nemo_lw_fp8.mechanics import (
    compact_grads,
    expert_slices,
    grouped,
    owner_gather,
    qkv_parts,
)
from nemo_lw_fp8.state import group_state, optimizer_state, peek

# --------------------------------------------------------------------------- buffers


def effective_config(ddp_config: Any) -> Any:
    """The per-buffer config of compact layer-wise buffers: plain DDP semantics."""
    effective = copy.copy(ddp_config)
    effective.use_distributed_optimizer = False
    return effective


def all_layer_wise(params_with_names: Any) -> bool:
    """Whether a buffer's params are all managed by the layer-wise optimizer."""
    return bool(params_with_names) and all(
        getattr(param, "is_managed_by_layer_wise_optimizer", False)
        for param, _ in params_with_names
    )


def unpadded_layer_wise_layouts(
    full: Any,
    params: Any,
    bucket_size: Any,
    ddp_config: Any,
    data_parallel_world_size: int = 1,
    expert_data_parallel_world_size: int | None = None,
) -> Any:
    """Replace the layer-wise buffers' layouts in megatron's full layout by unpadded ones.

    Buckets end where :func:`nemo_lw_fp8.layout.packing.compact_bucket_counts` says: by default
    where megatron's padded layout ends them (as many bucket groups, so as many gather and gradient
    launches per step), capped by the config's ``bucket_cap_numel``.
    """
    from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers

    cap = plugin_config.bucket_cap_numel(ddp_config)
    groups = group_params_for_buffers(params, ddp_config.grad_reduce_in_fp32)
    for key, (group_params, param_indices) in groups.items():
        if not key.is_managed_by_layer_wise_optimizer:
            continue
        world = data_parallel_world_size
        if key.is_expert_parallel and expert_data_parallel_world_size is not None:
            world = expert_data_parallel_world_size
        compact = _bucketed_layout(group_params, bucket_size, world, cap)
        compact.param_indices = param_indices
        full.layouts[key] = compact
    return full


def _bucketed_layout(params: list[Any], bucket_size: Any, world: int, cap: int | None) -> Any:
    """megatron's unpadded DDP layout (params back to back in backprop order), with the bucket
    boundaries of :func:`nemo_lw_fp8.layout.packing.compact_bucket_counts`."""
    from megatron.core.optimizer.param_layout import PerBufferParamLayout

    backprop = params[::-1]
    counts = layout_math.compact_bucket_counts(
        [p.data.nelement() for p in backprop], bucket_size, world, cap
    )
    layout = PerBufferParamLayout()
    start = index = 0
    for bucket_id, count in enumerate(counts):
        bucket_start = start
        for param in backprop[index : index + count]:
            layout.param_index_map[param] = (start, start + param.data.nelement(), bucket_id)
            start += param.data.nelement()
        index += count
        layout.bucket_indices.append((bucket_start, start))
        layout.per_bucket_numel_unpadded.append(start - bucket_start)
    return layout


def split_by_effective_kind(buffers: list[Any]) -> list[list[Any]]:
    """Buffers grouped by their effective ``use_distributed_optimizer`` (compact layer-wise
    buffers never share a bucket group with DistOpt ones)."""
    kinds: dict[bool, list[Any]] = {}
    for buffer in buffers:
        kinds.setdefault(bool(buffer.ddp_config.use_distributed_optimizer), []).append(buffer)
    return list(kinds.values())


def partition(original: Any, buffers: list[Any], force_single: bool = False, **kwargs: Any):
    """megatron's ``partition_buckets`` once per effective kind (:func:`split_by_effective_kind`).

    With an FP8 buffer among ``buffers``, stock megatron puts every non-FP8 bucket into the
    last FP8 bucket group (its case 3), one group for all of them. A kind split off without
    an FP8 buffer (the sibling DistributedOptimizer buckets next to compact MXFP8 buckets) is
    kept as one group the same way, instead of one group per bucket: as many gather and
    gradient launches as the padded layout.
    """
    kinds = split_by_effective_kind(buffers) or [buffers]
    fp8 = any(b.param_dtype == torch.uint8 for b in buffers)
    groups = []
    for subset in kinds:
        single = force_single or (
            len(kinds) > 1 and fp8 and not any(b.param_dtype == torch.uint8 for b in subset)
        )
        groups += original(subset, single, **kwargs)
    return groups


# --------------------------------------------------------------------------- ownership


@dataclass
class CompactGroup:
    """What one compact bucket group gathers: per rank, the pieces it owns, in order."""

    segments: list[list[torch.nn.Parameter]]
    segment_numel: list[int]
    #: One even all_gather_into_tensor (segments padded to the longest) or one uneven all_gather.
    even: bool
    #: Per bucket of the group, the owner reduce's spans of its grad buffer as
    #: ``(owner, start, end)`` (empty unless gradients are reduced to their owners).
    grad_spans: list[list[tuple[int, int, int]]] = field(default_factory=list)
    #: The owner takes its own weights from the gathered bytes too (for MXFP8 the inner step
    #: left them alone; every rank quantizes the same bf16 bytes).
    unpack_own: ClassVar[bool] = True

    @property
    def gather_numel(self) -> int:
        """Elements of the gathered buffer."""
        return owner_gather.gathered_length(self.segment_numel, self.even)

    def segment_start(self, rank: int) -> int:
        return owner_gather.segment_start(self.segment_numel, self.even, rank)


def compact_groups(chunk: Any) -> list[Any]:
    """The bucket groups of ``chunk`` that hold compact layer-wise buckets."""
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


def newton_schulz_cost(param: torch.nn.Parameter) -> int:
    """Newton-Schulz cost; a single grouped expert weight counts as its E matrices."""
    if param.dim() < 2:
        return 0
    members = grouped.grouped_members(param)
    if members > 1 and param.dim() == 2:
        return layout_math.newton_schulz_cost((members, param.shape[0] // members, param.shape[1]))
    return layout_math.newton_schulz_cost(param.shape)


def expert_units(param: torch.nn.Parameter) -> int:
    """Experts a param can be split into for ownership: E for a 3-D grouped weight, else 1."""
    return int(param.shape[0]) if param.dim() == 3 and grouped.is_grouped_weight(param) else 1


def compact_pieces(
    params: list[torch.nn.Parameter],
    world_size: int,
    ownership: str,
    local_rank: int = 0,
    initial_loads: list[int] | None = None,
    split_qkv: frozenset[int] = frozenset(),
) -> list[tuple[torch.nn.Parameter, int]]:
    """Per param, what its owners update, as ``(piece, owner rank)``.

    A piece is the parameter itself (whole ownership), an
    :class:`~nemo_lw_fp8.mechanics.expert_slices.ExpertSlice` for a run of experts, or a
    :class:`~nemo_lw_fp8.mechanics.qkv_parts.QKVPart` for the Q, K or V rows of a fused QKV
    weight whose ``id`` is in ``split_qkv`` (each part is owned as a matrix of its own; a weight
    whose parts all land on one rank stays whole).
    Deterministic, so every rank builds the same pieces (also for others' params: the gather
    needs to know where each rank's bytes go). ``initial_loads``: Newton-Schulz work the group's
    ranks already have (their dense matrices, when these are expert matrices).
    """
    items: list[tuple[int, int | None]] = []  # (param index, QKV part index or None)
    costs, sizes, units = [], [], []
    for i, p in enumerate(params):
        shapes = qkv_parts.part_shapes(p) if id(p) in split_qkv else None
        if shapes is not None and len(shapes) > 1:
            for j, shape in enumerate(shapes):
                items.append((i, j))
                costs.append(layout_math.newton_schulz_cost(shape))
                sizes.append(shape[0] * shape[1])
                units.append(1)
            continue
        items.append((i, None))
        costs.append(newton_schulz_cost(p))
        sizes.append(p.numel())
        units.append(1 if ownership == "whole" else expert_units(p))
    chosen = layout_math.choose_pieces(costs, units, world_size, sizes, ownership, initial_loads)
    part_owners: dict[int, dict[int, int]] = {}
    for piece in chosen:
        index, part = items[piece.index]
        if part is not None:
            part_owners.setdefault(index, {})[part] = piece.owner
    pieces: list[tuple[torch.nn.Parameter, int]] = []
    for piece in chosen:
        index, part = items[piece.index]
        param = params[index]
        mine = piece.owner == local_rank
        if part is not None:
            owners = part_owners[index]
            if len(set(owners.values())) == 1:  # every part on one rank: the weight stays whole
                if part == 0:
                    pieces.append((param, piece.owner))
                continue
            pieces.append((qkv_parts.QKVPart(param, part, materialize=mine), piece.owner))
            continue
        whole = piece.lo == 0 and piece.hi == units[piece.index]
        if whole:
            entry = param
        else:
            entry = expert_slices.ExpertSlice(param, piece.lo, piece.hi, materialize=mine)
        pieces.append((entry, piece.owner))
    return pieces


def shards(ddp_config: Any) -> bool:
    """Whether the compact layout owns and gathers this run's layer-wise params: whenever it is
    chosen, at every data-parallel size.

    Data-parallel size 1 included: megatron's own ``shard_params`` returns early there and its
    layer-wise gather of a one-rank group does nothing, trusting the inner step to have written
    the weights. With MXFP8 param gather the inner step leaves MXFP8 weights alone (the gather
    quantizes them, :func:`.masters.skip_requantize_on_inner_step`), and compact buffers have no
    param buffer to stage into, so without this gather the MXFP8 weights would never change.
    """
    return plugin_config.is_compact(ddp_config)


def shard(
    optimizer: Any, optimizers: list[Any], ownership: str, qkv_ownership: str = "whole"
) -> None:
    """Ownership for compact buffers; narrows the optimizers' param groups to this rank's
    pieces (whole params, expert slices of grouped weights, QKV parts of fused QKV weights)."""
    from megatron.core.utils import get_pg_rank, get_pg_size

    dp_size, expt_size = get_pg_size(optimizer.dp_cp), get_pg_size(optimizer.expt_dp)
    dp_rank, expt_rank = get_pg_rank(optimizer.dp_cp), get_pg_rank(optimizer.expt_dp)
    param_groups = [group for opt in optimizers for group in opt.param_groups]
    dense, expert = [], []
    for group in param_groups:
        (expert if group.get("is_expert_parallel", False) else dense).extend(group["params"])
    record = optimizer_state(optimizer)
    blockwise = _blockwise_fp8(record.model_chunks or [])
    if qkv_ownership == "split" and blockwise:  # explicit: refused, never dropped
        from nemo_lw_fp8.rules import ConfigError, qkv_split_blockwise_message

        raise ConfigError("qkv-split-blockwise", qkv_split_blockwise_message())
    if qkv_ownership == "split" and _nvfp4_primary(record.model_chunks or []):
        from nemo_lw_fp8.rules import ConfigError, qkv_split_nvfp4_message

        raise ConfigError("qkv-split-nvfp4", qkv_split_nvfp4_message())
    split = layout_math.resolve_qkv_ownership(qkv_ownership, "compact", blockwise) == "split"
    split_qkv = _muon_splits_qkv(optimizers) if split else frozenset()
    per_rank: dict[int, list[list[torch.nn.Parameter]]] = {}
    dense_loads = [0] * dp_size
    for kind, (params, size, rank) in enumerate(
        ((dense, dp_size, dp_rank), (expert, expt_size, expt_rank))
    ):
        per_rank[kind] = [[] for _ in range(size)]
        # Experts are owned after the dense matrices, from each member's dense work, so that a
        # rank's whole Newton-Schulz work is balanced (over all its virtual-pipeline chunks: the
        # one layer-wise optimizer holds them all).
        initial = _expert_group_dense_loads(optimizer, dense_loads) if kind == 1 else None
        for piece, owner in compact_pieces(params, size, ownership, rank, initial, split_qkv):
            record.pieces.setdefault(expert_slices.parent_of(piece), []).append(piece)
            record.owner_of[piece] = owner
            per_rank[kind][owner].append(piece)
            if kind == 0:
                dense_loads[owner] += _piece_cost(piece, split_qkv)
    optimizer.dp_cp_params_list = per_rank[0]
    optimizer.expt_dp_params_list = per_rank[1] if expert else None
    for group in param_groups:
        local = expt_rank if group.get("is_expert_parallel", False) else dp_rank
        group["params"] = [
            piece
            for param in group["params"]
            for piece in record.pieces[param]
            if record.owner_of[piece] == local
        ]


def _blockwise_fp8(model_chunks: list[Any]) -> bool:
    """Whether the model computes in blockwise FP8 (Hopper): its fused QKV weights stay whole
    whether or not the run gathers FP8 weights, so FP8 param gather on and off own alike."""
    return any(getattr(getattr(c, "config", None), "fp8_recipe", None) == "blockwise"
               for c in model_chunks)  # fmt: skip


def _nvfp4_primary(model_chunks: list[Any]) -> bool:
    """Whether the model keeps NVFP4 primary weights (``fp4_param``): their owner quantizes the
    whole matrix (one per-tensor amax), so fused QKV weights stay whole."""
    return any(getattr(getattr(c, "config", None), "fp4_param", False) for c in model_chunks)


def _muon_splits_qkv(optimizers: list[Any]) -> frozenset[int]:
    """``id`` of every fused QKV weight a Muon among ``optimizers`` orthogonalizes as its Q, K
    and V parts (megatron's ``muon_split_qkv``, on by default, tags them ``is_qkv``). Blockwise
    FP8 weights stay whole: their owner quantizes whole 128 x 128 tiles, which span the parts;
    so do NVFP4 primary weights, whose per-tensor amax spans the whole matrix."""
    from nemo_lw_fp8.mechanics.blockwise import is_owner_quantized

    found = set()
    for opt in optimizers:
        inner = getattr(opt, "optimizer", opt)
        if not getattr(inner, "split_qkv", False):
            continue
        is_qkv = getattr(inner, "is_qkv_fn", None) or (lambda p: getattr(p, "is_qkv", False))
        for group in inner.param_groups:
            for param in group["params"]:
                if (
                    is_qkv(param)
                    and qkv_parts.split_shapes(param) is not None
                    and not is_owner_quantized(param)
                ):
                    found.add(id(param))
    return frozenset(found)


def _piece_cost(piece: Any, split_qkv: frozenset[int] = frozenset()) -> int:
    """Newton-Schulz cost of an owned piece (a run of experts costs its share; a fused QKV
    weight that Muon splits costs its parts)."""
    if qkv_parts.is_part(piece):
        return layout_math.newton_schulz_cost(tuple(piece.shape))
    if id(piece) in split_qkv:
        return sum(layout_math.newton_schulz_cost(s) for s in qkv_parts.part_shapes(piece))
    if expert_slices.is_slice(piece):
        parent = piece.parent
        return newton_schulz_cost(parent) * (piece.hi - piece.lo) // expert_units(parent)
    return newton_schulz_cost(piece)


def _expert_group_dense_loads(optimizer: Any, dense_loads: list[int]) -> list[int] | None:
    """The dense work of this rank's expert-data-parallel group members, in group-rank order
    (``None`` if that group is not inside the data-parallel group, or one of them is missing)."""
    import torch.distributed as dist

    if optimizer.dp_cp is None or optimizer.expt_dp is None or not dist.is_initialized():
        return None
    return layout_math.expert_initial_loads(
        dense_loads,
        dist.get_process_group_ranks(optimizer.dp_cp),
        dist.get_process_group_ranks(optimizer.expt_dp),
    )


def attach_groups(optimizer: Any, model_chunks: list[Any]) -> None:
    """Give each compact bucket group of ``model_chunks`` its gather plan and, when its
    gradients are reduced to their owners, lay its buckets' gradients out in owner order."""
    record = optimizer_state(optimizer)
    for chunk in model_chunks:
        tolerance = plugin_config.gather_padding_tolerance(chunk.ddp_config)
        index_maps = [b.param_index_map for b in chunk.buffers + chunk.expert_parallel_buffers]
        for group in compact_groups(chunk):
            size = group.data_parallel_group.size()
            segments: list[list[torch.nn.Parameter]] = [[] for _ in range(size)]
            for bucket in group.buckets:
                for param in bucket.params_list:
                    for piece in record.pieces[param]:
                        segments[record.owner_of[piece]].append(piece)
            numel = [sum(p.numel() for p in seg) for seg in segments]
            plan = CompactGroup(segments, numel, layout_math.even_gather_fits(numel, tolerance))
            if plugin_config.grad_sync(group.ddp_config) == "reduce_to_owner":  # grads_to_owners
                plan.grad_spans = [
                    compact_grads.lay_out_grads_by_owner(bucket, record, index_maps)
                    for bucket in group.buckets
                ]
            group_state(group).compact = plan


def owns_expert_runs(optimizer: Any) -> bool:
    """Whether this optimizer owns runs of experts (expert slices) of grouped weights."""
    record = peek(optimizer)
    pieces = record.pieces if record is not None else {}
    return any(expert_slices.is_slice(p) for group in pieces.values() for p in group)
