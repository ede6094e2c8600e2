"""``torch_dist`` entries of single grouped expert weights, whole or in runs of experts.

Why: a single grouped expert weight (TE's ``GroupedTensor``, wrapper shape ``(E, out, in)``) is
ONE parameter, but megatron-core 0.19.2 / TE 2.20.2 checkpoint it as E expert tensors:
``TEGroupedLinear._sharded_state_dict_grouped`` writes each expert under the layer's ``weight``
key at its *global* expert index (axis ``len(sharded_offsets)``, ``E_global = EP x E_local``),
tensor-parallel along ``out`` (column) or ``in`` (row), fc1 of a gated MLP split into its two
halves (``apply_swiglu_sharded_factory``). megatron's optimizers find a parameter's entry by
identity (``id(entry.data) == id(param)``), so per-expert entries leave the grouped parameter,
and an optimizer-side run of its experts (:class:`~.expert_slices.ExpertSlice`), without one.

:func:`factory` makes one ``ShardedTensorFactory`` per grouped weight (or per run of
experts ``[lo, hi)`` of it) whose ``data`` IS the parameter (or the run): building it gives the
per-expert entries of megatron's layout (the model's live expert tensors, or the matching rows of
an fp32 master / momentum of shape ``(hi - lo, out, in)``); merging stacks what was loaded back
into ``(hi - lo, out, in)``. The checkpoint therefore holds the same tensors, keys and expert
chunks whatever the ownership, and a run saved under one ownership loads under another.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True)
class GroupedLayout:
    """Where the E local experts of one grouped weight go in megatron's checkpoint layout."""

    sharded_offsets: tuple
    first_global_expert: int  # EP rank x local experts
    num_global_experts: int
    tp_axis: int  # 0: column parallel (fc1), 1: row parallel (fc2)
    tp_rank: int
    tp_size: int
    gated: bool  # fc1 of a gated MLP: [W; V] halves written apart, as megatron does
    singleton_local_shards: bool
    tail: str  # the key's last part ("linear_fc1.weight"), after which nothing is prefixed
    tp_group: Any = None
    dp_group: Any = None


def _dequantized(tensor: Any) -> torch.Tensor:
    return tensor.dequantize() if hasattr(tensor, "dequantize") else tensor


def _expert_tensors(data: Any, count: int) -> list[torch.Tensor]:
    """The ``count`` expert tensors of ``data``: a grouped weight's live members (views of its
    storage; MXFP8 members stay quantized, megatron's writer dequantizes them), else rows."""
    from megatron.core.fp8_utils import get_grouped_quantized_members, is_grouped_tensor

    from nemo_lw_fp8.mechanics import expert_slices

    if is_grouped_tensor(data):
        view = expert_slices.expert_view(data)
        members = (
            list(view.unbind(0))
            if view is not None
            else list(get_grouped_quantized_members(data, create_if_missing=True))
        )
    else:
        members = list(data.unbind(0))
    if len(members) != count:
        raise RuntimeError(f"expected {count} experts, found {len(members)} in {type(data)}")
    return members


def _expert_key(layout: GroupedLayout, key: str, global_expert: int) -> str:
    if not layout.singleton_local_shards:
        return key
    # megatron's singleton layout names each expert: "<prefix>experts.<g>.linear_fc1.weight"
    head = key[: len(key) - len(layout.tail)]
    return f"{head}{global_expert}.{layout.tail}"


def expert_entry(
    layout: GroupedLayout, key: str, tensor: torch.Tensor, expert: int, replica_id: Any
) -> Any:
    """megatron's entry for local expert ``expert``: a ShardedTensor, or the swiglu factory."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    global_expert = layout.first_global_expert + expert
    offsets = tuple(layout.sharded_offsets)
    if not layout.singleton_local_shards:
        offsets = (*offsets, (len(offsets), global_expert, layout.num_global_experts))
    prepend = len(offsets)
    sh_ten = ShardedTensor.from_rank_offsets(
        _expert_key(layout, key, global_expert),
        tensor,
        *offsets,
        (prepend + layout.tp_axis, layout.tp_rank, layout.tp_size),
        replica_id=replica_id,
        prepend_axis_num=prepend,
    )
    if not layout.gated:
        return sh_ten
    return apply_swiglu_sharded_factory(
        sh_ten,
        offsets,
        layout.singleton_local_shards,
        tp_group=layout.tp_group,
        dp_group=layout.dp_group,
    )


def _build(layout: GroupedLayout, lo: int, hi: int, key, data, replica_id, flattened_range):
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if flattened_range is not None:
        raise ValueError("grouped expert weights are not written flattened")
    out = {}
    for offset, tensor in enumerate(_expert_tensors(data, hi - lo)):
        entry = expert_entry(layout, key, tensor, lo + offset, replica_id)
        out[lo + offset] = entry.build() if isinstance(entry, ShardedTensorFactory) else entry
    return out


def _build_plain(layout: GroupedLayout, lo: int, hi: int, key, data, replica_id, flattened_range):
    """:func:`_build` over a plain copy of the experts (their values dequantized): a load then
    reads the checkpoint's values into plain tensors instead of quantizing them into the weight
    (:func:`plain_for_loading`)."""
    plain = torch.stack([_dequantized(expert) for expert in _expert_tensors(data, hi - lo)])
    return _build(layout, lo, hi, key, plain, replica_id, flattened_range)


def _merge(layout: GroupedLayout, loaded: dict) -> torch.Tensor:
    from megatron.core.transformer.mlp import cat_with_oom_fallback

    experts = []
    for expert in sorted(loaded):
        value = loaded[expert]
        if layout.gated:
            value = cat_with_oom_fallback([_dequantized(half) for half in value])
        experts.append(_dequantized(value))
    return torch.stack(experts, dim=0)


def factory(key: str, data: Any, layout: GroupedLayout, lo: int, hi: int, replica_id: Any) -> Any:
    """The ``ShardedTensorFactory`` of experts ``[lo, hi)`` of one grouped weight, held by
    ``data`` (the grouped parameter itself, or a run of its experts)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    return ShardedTensorFactory(
        key=key,
        data=data,
        build_fn=functools.partial(_build, layout, lo, hi),
        merge_fn=functools.partial(_merge, layout),
        replica_id=replica_id,
    )


def _experts_of(entry: Any) -> tuple[GroupedLayout, int, int] | None:
    """``(layout, lo, hi)`` of an entry :func:`factory` made (kept by ``dataclasses.replace``,
    which megatron's optimizers use to re-key it), else ``None``."""
    build = getattr(entry, "build_fn", None)
    if isinstance(build, functools.partial) and build.func is _build:
        return build.args  # type: ignore[return-value]
    return None


def is_grouped_factory(entry: Any) -> bool:
    """Whether ``entry`` is a grouped weight's entry made by :func:`factory`."""
    return _experts_of(entry) is not None


def plain_for_loading(entry: Any) -> None:
    """Make a grouped weight's entry (of :func:`factory`) load into plain tensors, so the merged
    value the model's load receives holds the checkpoint's values whatever the weight's storage
    (a model-only load, :func:`nemo_lw_fp8.mechanics.pretrained_load.keep_precision`)."""
    layout, lo, hi = _experts_of(entry)  # type: ignore[misc]
    entry.build_fn = functools.partial(_build_plain, layout, lo, hi)


def narrow(whole: Any, data: Any, lo: int, hi: int) -> Any:
    """The entry of experts ``[lo, hi)`` of ``whole``'s grouped weight, held by ``data``."""
    layout, _, _ = _experts_of(whole)  # type: ignore[misc]
    return replace(whole, data=data, build_fn=functools.partial(_build, layout, lo, hi))


def run_entries(model_sharded_state_dict: Any, params: list[torch.Tensor]) -> dict[str, Any]:
    """Entries for the expert runs among ``params`` (an optimizer's parameters), each narrowed
    from its grouped weight's entry in the model's sharded state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from nemo_lw_fp8.mechanics import expert_slices

    runs = [p for p in params if expert_slices.is_slice(p)]
    if not runs:
        return {}
    by_weight = {
        id(entry.data): entry
        for entry in nested_values(model_sharded_state_dict)
        if _experts_of(entry) is not None
    }
    out = {}
    for index, piece in enumerate(runs):
        whole = by_weight.get(id(piece.parent))
        if whole is None:
            raise RuntimeError(
                f"{piece!r}: the model's sharded state dict has no grouped-weight entry for its "
                "grouped weight (runs of experts are checkpointed as slices of the entry "
                "mechanics.grouped_checkpoint.factory makes for it). Fix: "
                "optimizer.grouped_weight_ownership='whole'."
            )
        _, lo, _ = _experts_of(whole)  # type: ignore[misc]
        out[f"expert_run_{index}"] = narrow(whole, piece, lo + piece.lo, lo + piece.hi)
    return out


# --------------------------------------------------------------------------- TE's own modules
#
# megatron-core 0.19.2's ``TEGroupedLinear._sharded_state_dict_grouped`` (TE 2.20.2's
# ``GroupedLinear`` with ``single_grouped_weight=True``) writes a single grouped weight as E
# per-expert entries ``<prefix>weight0 .. weight{E-1}`` whose data are the ``GroupedTensor``'s
# members, and ``TEGroupedMLP.sharded_state_dict`` wraps fc1's in the SwiGLU factory. The two
# functions below put one :func:`factory` in their place, whose ``data`` is the parameter: built,
# it gives the very entries TE wrote (same keys, offsets, shapes, replica ids), so the files are
# TE's, and megatron's optimizers (identity lookup) and expert runs find the grouped weight.


def te_layout(linear: Any, prefix: str, sharded_offsets: tuple, metadata: dict | None,
              tp_axis: int) -> GroupedLayout:  # fmt: skip
    """Where TE's ``TEGroupedLinear`` (``linear``, E local experts) writes its experts: global
    index ``ep_rank * E + e`` of ``EP * E``, tensor-parallel along ``tp_axis`` of its TP group,
    ``<prefix>weight`` (``<g>.<prefix>weight`` with singleton local shards). Not gated: fc1's
    halves are the enclosing ``TEGroupedMLP``'s business (:func:`te_gated`)."""
    from megatron.core.utils import get_pg_rank, get_pg_size

    experts = linear.num_gemms
    ep = linear._pg_collection.ep
    tp = linear._tp_group
    metadata = metadata or {}
    return GroupedLayout(
        sharded_offsets=tuple(sharded_offsets),
        first_global_expert=get_pg_rank(ep) * experts,
        num_global_experts=get_pg_size(ep) * experts,
        tp_axis=tp_axis,
        tp_rank=get_pg_rank(tp),
        tp_size=get_pg_size(tp),
        gated=False,
        singleton_local_shards=bool(metadata.get("singleton_local_shards", False)),
        tail=f"{prefix}weight",
        tp_group=tp,
        dp_group=metadata.get("dp_cp_group"),
    )


def te_grouped_weight_entries(linear: Any, entries: dict, prefix: str, sharded_offsets: tuple,
                              metadata: dict | None, tp_axis: int) -> dict:  # fmt: skip
    """``entries`` (what ``TEGroupedLinear._sharded_state_dict_grouped`` returned) with a single
    grouped weight's E per-expert entries replaced by one :func:`factory` over the parameter,
    at the place of the first; the replica id is the one TE gave its experts. Discrete weights
    (``weight0..N`` parameters), ``_extra_state`` and biases are left as TE wrote them."""
    weight = linear._parameters.get("weight")
    if not getattr(linear, "single_grouped_weight", False) or weight is None:
        return entries
    experts = linear.num_gemms
    keys = [f"{prefix}weight{index}" for index in range(experts)]
    if not all(key in entries for key in keys):
        return entries
    layout = te_layout(linear, prefix, sharded_offsets, metadata, tp_axis)
    whole = factory(f"{prefix}weight", weight, layout, 0, experts, entries[keys[0]].replica_id)
    out = {}
    for key, value in entries.items():
        if key == keys[0]:
            out[f"{prefix}weight"] = whole
        elif key not in keys:
            out[key] = value
    return out


def te_gated(mlp: Any, entries: dict, prefix: str, metadata: dict | None) -> dict:
    """``entries`` (what ``TEGroupedMLP.sharded_state_dict`` returned) with fc1's grouped-weight
    factory writing each expert in its ``[W; V]`` halves, as megatron's SwiGLU factory does for
    TE's per-expert entries (the MLP's TP group, the metadata's ``dp_cp_group``)."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    if not mlp.config.gated_linear_unit:
        return entries
    key = f"{prefix}linear_fc1.weight"
    entry = entries.get(key)
    found = _experts_of(entry)
    if found is None:
        return entries
    layout, lo, hi = found
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    gated = replace(layout, gated=True, tp_group=mlp.tp_group, dp_group=metadata["dp_cp_group"])
    return {
        **entries,
        key: replace(
            entry,
            build_fn=functools.partial(_build, gated, lo, hi),
            merge_fn=functools.partial(_merge, gated),
        ),
    }
