"""A layer-wise optimizer loads a checkpoint whose param groups were split another way.

Why: megatron-core 0.19.2 puts a parameter in an expert-parallel param group when its
``allreduce`` attribute is False, and TE's linears set that only when the experts use their own
process groups: ``EP > 1`` or ``expert_tensor_parallel_size != tensor_model_parallel_size``
(``megatron/core/extensions/transformer_engine.py``, ``use_expert_pgs``). So a MoE run at TP 2
with expert TP 1 has two Muon param groups (dense, expert), the same model at TP 1 (EP 1) one.
The layer-wise optimizer writes its param groups' hyperparameters once, in the checkpoint's
common state, and ``dist_checkpointing.load`` merges that list with the loading run's list
element by element: a TP-2 checkpoint loaded at TP 1 stopped there (``Cannot merge two lists with
different lengths (2 and 1, encountered at level ('optimizer', 0, 'optimizer',
'param_groups'))``), before any tensor was read; megatron's
``_filter_and_reorder_param_groups`` after it would also miss a group the checkpoint lacks.

The groups hold no tensor (the masters and Muon momentum are per-parameter entries, whatever
the group), only hyperparameters, so the fix is bookkeeping, done while a Bridge load is in
progress (the checkpoint's directory is known):

* :func:`shape_like_checkpoint` (the loading ``sharded_state_dict``): the list of param groups
  takes the checkpoint's length; each saved group carries the live groups it feeds (same
  identifier but ``is_expert_parallel``: the saved group with the same flag if there is one,
  else the first) in a non-persistent marker, so ``dist_checkpointing`` merges one-to-one;
* :func:`fold_to_live` (before the optimizer's ``load_state_dict``): the live groups are rebuilt
  in their own order from the saved hyperparameters, each with its own parameters and
  ``is_expert_parallel``. A saved group that feeds none must hold the same hyperparameters as
  the one that was used for its parameters (else the load stops, naming the keys).
"""

from __future__ import annotations

import os
from typing import Any

#: Non-persistent key of a reshaped group: ``[(live index, is_expert_parallel, params), ...]``.
MARKER = "nemo_lw_fp8_live_groups"
_NOT_HYPERPARAMETERS = ("params", "is_expert_parallel", MARKER)


def _identifier(group: dict) -> tuple:
    """megatron's param-group identifier (``param_group_identifier_keys``) without
    ``is_expert_parallel``: what must agree for two groups to share hyperparameters."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    out = []
    for key in param_group_identifier_keys:
        if key == "is_expert_parallel":
            continue
        out.append(group.get(key, group.get(f"pre_{key}")))
    return tuple(out)


def _group_lists(sd: Any) -> list[list[dict]]:
    """The ``param_groups`` lists of a layer-wise optimizer's state dict (one per chained
    optimizer: a single one is not wrapped)."""
    wrapped = sd.values() if isinstance(sd, dict) and "optimizer" not in sd else [sd]
    return [
        entry["optimizer"]["param_groups"]
        for entry in wrapped
        if isinstance(entry, dict) and isinstance(entry.get("optimizer"), dict)
        and isinstance(entry["optimizer"].get("param_groups"), list)
    ]  # fmt: skip


def _saved_group_lists(iteration_dir: str) -> list[list[dict]]:
    """Every ``param_groups`` list of the checkpoint's common optimizer state."""
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    found: list[list[dict]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            groups = node.get("param_groups")
            if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
                found.append(groups)
            for key, value in node.items():
                if key != "param_groups":
                    walk(value)

    walk(load_common_state_dict(iteration_dir).get("optimizer"))
    return found


def _matching_saved(live: list[dict], saved_lists: list[list[dict]]) -> list[dict] | None:
    """The saved list of the same optimizer: its groups have the live groups' keys, and the
    identifiers (``is_expert_parallel`` aside) of both lists are the same set."""
    keys = {frozenset(k for k in g if k not in _NOT_HYPERPARAMETERS) for g in live}
    ids = {_identifier(g) for g in live}
    candidates = [
        groups
        for groups in saved_lists
        if {frozenset(k for k in g if k not in _NOT_HYPERPARAMETERS) for g in groups} == keys
        and {_identifier(g) for g in groups} == ids
    ]
    return candidates[0] if len(candidates) == 1 else None


def _split_the_same(live: list[dict], saved: list[dict]) -> bool:
    def split(groups: list[dict]) -> list[tuple]:
        return [(_identifier(g), bool(g.get("is_expert_parallel", False))) for g in groups]

    return sorted(split(live)) == sorted(split(saved))


def shape_like_checkpoint(sharded_state_dict: Any, iteration_dir: str | None) -> None:
    """Give each of this layer-wise optimizer's loading ``param_groups`` lists the saved
    list's length and order (module docstring); nothing when the split is the same or the
    checkpoint is not known."""
    if iteration_dir is None or not os.path.isdir(iteration_dir):
        return
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    lists = _group_lists(sharded_state_dict)
    if not lists:
        return
    saved_lists = _saved_group_lists(iteration_dir)
    for live in lists:
        saved = _matching_saved(live, saved_lists)
        if saved is None or _split_the_same(live, saved):
            continue
        feeds: list[list[tuple]] = [[] for _ in saved]
        for index, group in enumerate(live):
            flag = bool(group.get("is_expert_parallel", False))
            same = [j for j, s in enumerate(saved) if _identifier(s) == _identifier(group)]
            exact = [j for j in same if bool(saved[j].get("is_expert_parallel", False)) == flag]
            params = group["params"]
            params = params.unwrap() if isinstance(params, LocalNonpersistentObject) else params
            feeds[(exact or same)[0]].append((index, flag, params))
        live[:] = [
            {
                "params": LocalNonpersistentObject(fed[0][2] if fed else []),
                MARKER: LocalNonpersistentObject(fed),
            }
            for fed in feeds
        ]


def fold_to_live(state_dict: Any) -> None:
    """Undo :func:`shape_like_checkpoint` on the loaded state dict: the live groups, in their
    order, from the saved hyperparameters (module docstring)."""
    for groups in _group_lists(state_dict):
        if not groups or MARKER not in groups[0]:
            continue
        rebuilt: dict[int, dict] = {}
        used: dict[tuple, dict] = {}
        for group in groups:
            fed = group.pop(MARKER)
            hyper = {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS}
            for index, flag, params in fed:
                rebuilt[index] = {**hyper, "is_expert_parallel": flag, "params": params}
                used[_identifier(group)] = hyper
        for group in groups:
            hyper = {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS}
            kept = used.get(_identifier(group))
            if kept is not None and kept != hyper:
                differ = sorted(k for k in set(kept) | set(hyper) if kept.get(k) != hyper.get(k))
                raise ValueError(
                    "checkpoint: its dense and expert param groups hold different "
                    f"hyperparameters ({', '.join(differ)}); this run has them in one group "
                    "(expert TP = TP and EP 1). Load it with the saved tensor-, expert- "
                    "and expert-tensor-parallel sizes."
                )
        groups[:] = [rebuilt[index] for index in sorted(rebuilt)]
