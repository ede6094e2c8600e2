"""The compact layout's owners as the planner models them, and Newton-Schulz work per rank.

:func:`our_owners` computes them as :func:`nemo_lw_fp8.mechanics.compact.shard` does
(:func:`nemo_lw_fp8.layout.packing.choose_pieces` by Newton-Schulz cost; grouped expert weights
whole or in runs of experts; a split ``linear_qkv`` as its parts, :mod:`.qkv_split`), for
:func:`.planner.plan` and :func:`.traffic.rank_traffic` alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from nemo_lw_fp8.layout import packing as lo
from nemo_lw_fp8.planner.qkv_split import QkvParts, qkv_parts, unit_costs
from nemo_lw_fp8.planner.shapes import ParamSpec
from nemo_lw_fp8.planner.tensor_parallel import StageRanks, ns_cost, tp_comm_bytes


@dataclass
class Ownership:
    """Our owners, as the compact patch computes them (:func:`nemo_lw_fp8.mechanics.compact.
    shard`): ``dense[i]`` the pieces of dense Muon spec ``i`` as ``(owner, units)`` (data-parallel
    ranks); ``expert[i]`` the same for expert spec ``i`` inside every expert-data-parallel group
    (every group holds the same shapes, so one answer serves all); ``units[i]``: how many pieces
    spec ``i`` can split into; ``cost[r]``: Newton-Schulz total of global rank ``r``;
    ``qkv[i]``: the parts of a split ``linear_qkv`` spec, whose ``dense[i]`` holds one
    ``(owner, 1)`` per part, in split order. Rank vectors run over the pipeline stage's ranks
    (:class:`.tensor_parallel.StageRanks`; the data-parallel ranks at TP = 1): ``cost`` is
    what ownership balances (the local shards' work, as the compact patch measures it),
    ``flops`` the work each rank really does under ``muon_tp_mode`` and ``tp_comm`` the
    bytes its Newton-Schulz receives over TP (``duplicated``'s all-gathers, ``distributed``'s
    Gram all-reduces); ``expert_ranks[g]`` the stage ranks of
    expert group ``g`` in group-rank order."""

    dense: dict[int, list[tuple[int, int]]]
    expert: dict[int, list[tuple[int, int]]]
    units: dict[int, int]
    cost: list[int]
    expert_groups: list[dict[int, list[tuple[int, int]]]] = field(default_factory=list)
    qkv: dict[int, QkvParts] = field(default_factory=dict)
    flops: list[int] = field(default_factory=list)
    tp_comm: list[int] = field(default_factory=list)
    expert_ranks: list[list[int]] = field(default_factory=list)

    def pieces(self, table: dict, i: int, numel: int) -> list[tuple[int, int]]:
        """``(owner, elements)`` of each owned piece of spec ``i`` (``numel`` elements) under
        ``table``: one gather segment member each (a split ``linear_qkv``: one per part)."""
        parts = self.qkv.get(i)
        if parts is not None:
            return [(owner, n) for (owner, _), n in zip(table[i], parts.numels, strict=True)]
        return [(owner, numel * count // self.units[i]) for owner, count in table[i]]

    def runs(self, table: dict, i: int, numel: int) -> list[tuple[int, int]]:
        """``(owner, elements)`` runs of spec ``i``'s elements in flattened order: its
        gradient's layout (a split ``linear_qkv`` interleaves its parts per query group)."""
        parts = self.qkv.get(i)
        if parts is not None:
            return parts.runs([owner for owner, _ in table[i]])
        return self.pieces(table, i, numel)


def expert_units(spec: ParamSpec, ownership: str) -> int:
    """Experts a Muon spec splits into: E for a single grouped weight ``(E, m, n)`` unless
    ownership is whole (``mechanics.compact.expert_units``), else 1."""
    return spec.shape[0] if ownership != "whole" and len(spec.shape) == 3 else 1


def our_owners(
    specs: list[ParamSpec],
    dp: int,
    ep: int,
    ownership: str,
    qkv_ownership: str = "split",
    *,
    ranks: StageRanks | None = None,
    muon_tp_mode: str = "duplicated",
) -> Ownership:
    """Our owners keyed by spec index, as :func:`nemo_lw_fp8.mechanics.compact.shard` computes
    them: dense matrices over the data-parallel group first, then each expert-data-parallel
    group's expert matrices starting from its members' dense work
    (:func:`nemo_lw_fp8.layout.packing.choose_pieces` with ``initial_loads``, whole or in runs of
    experts), so each rank's total is balanced. ``expert`` is group 0's table (every group
    holds the same shapes; their owners differ only through the members' dense work). With
    ``qkv_ownership="split"`` each split ``linear_qkv`` spec enters ``choose_pieces`` as its
    parts, in its place among the members, each an independent matrix (one unit). ``specs``
    are the TP shards a rank holds; ``ranks`` the stage's ranks (default: TP = ETP = 1)."""
    ranks = ranks or StageRanks(dp, ep)
    edp = ranks.edp
    units = {i: expert_units(s, ownership) for i, s in enumerate(specs) if s.muon}
    qkv = {
        i: parts
        for i, s in enumerate(specs)
        if s.muon and (parts := qkv_parts(s, qkv_ownership)) is not None
    }

    def owned(members: list[int], world: int, initial: list[int] | None):
        slots: list[int] = []  # spec index of each matrix choose_pieces sees
        costs: list[int] = []
        counts: list[int] = []
        sizes: list[int] = []
        shapes: list[tuple[int, ...]] = []
        for i in members:
            parts = qkv.get(i)
            if parts is None:
                slots.append(i)
                costs.append(lo.newton_schulz_cost(specs[i].shape))
                counts.append(units[i])
                sizes.append(specs[i].numel)
                shapes.append(specs[i].shape)
                continue
            slots += [i] * len(parts.split)
            costs += parts.costs
            counts += [1] * len(parts.split)
            sizes += parts.numels
            shapes += parts.shapes
        pieces = lo.choose_pieces(costs, counts, world, sizes, ownership, initial)
        table: dict[int, list[tuple[int, int]]] = {i: [] for i in members}
        for piece in pieces:  # parameter order, units ascending: parts in split order
            table[slots[piece.index]].append((piece.owner, piece.hi - piece.lo))
        flops = [ns_cost(shape, specs[slots[k]], muon_tp_mode) for k, shape in enumerate(shapes)]
        gathers = [
            tp_comm_bytes(shape, specs[slots[k]], muon_tp_mode) for k, shape in enumerate(shapes)
        ]
        return table, [
            lo.piece_loads(values, counts, pieces, world) for values in (costs, flops, gathers)
        ]

    dense_members = [i for i, s in enumerate(specs) if s.muon and not s.expert_parallel]
    expert_members = [i for i, s in enumerate(specs) if s.muon and s.expert_parallel]
    dense, (dense_loads, dense_flops, dense_gather) = owned(dense_members, dp, None)
    cost = ranks.view(dense_loads, expert=False)
    flops = ranks.view(dense_flops, expert=False)
    tp_comm = ranks.view(dense_gather, expert=False)
    groups = []
    expert_ranks = ranks.expert_groups()
    for group in expert_ranks:
        initial = ranks.initial_loads(dense_loads, group)
        table, loads = owned(expert_members, edp, initial)
        for k, r in enumerate(group):
            cost[r] += loads[0][k]
            flops[r] += loads[1][k]
            tp_comm[r] += loads[2][k]
        groups.append(table)
    return Ownership(dense, groups[0], units, cost, groups, qkv, flops, tp_comm, expert_ranks)


def stock_costs(
    specs: Sequence[ParamSpec], padded: lo.StockLayout, world: int, qkv_ownership: str
) -> list[int]:
    """Newton-Schulz work per rank of a Muon buffer (``specs``) in megatron's padded layout (whole
    parameters on the ranks it picks), a split ``linear_qkv`` counted as its parts (megatron's
    Muon orthogonalizes them separately)."""
    costs = [sum(unit_costs(s, qkv_ownership)) for s in specs]
    return lo.rank_loads(costs, padded.owners or [], world)


def stock_tp_work(
    specs: Sequence[ParamSpec], padded: lo.StockLayout, world: int, qkv_ownership: str, mode: str
) -> tuple[list[int], list[int]]:
    """Per member of a Muon buffer's group in megatron's padded layout: the Newton-Schulz work
    under ``muon_tp_mode`` ``mode`` and the bytes its Newton-Schulz receives over TP
    (:func:`.tensor_parallel.ns_cost`, :func:`.tensor_parallel.tp_comm_bytes`)."""
    flops, gathers = [], []
    for s in specs:
        parts = qkv_parts(s, qkv_ownership)
        shapes = parts.shapes if parts is not None else [s.shape]
        flops.append(sum(ns_cost(shape, s, mode) for shape in shapes))
        gathers.append(sum(tp_comm_bytes(shape, s, mode) for shape in shapes))
    owners = padded.owners or []
    return lo.rank_loads(flops, owners, world), lo.rank_loads(gathers, owners, world)
