"""The compact layout's default gradient sync, ``grad_sync="reduce_to_owner"``, as the planner and
the traffic model count it.

Kept apart from :mod:`.planner` and :mod:`.traffic` because both need it (traffic imports the
planner, so the planner cannot import traffic) and because it is the one place that says how an
owner-reduce bucket is laid out: its buckets end where the padded layout ends them
(:func:`nemo_lw_fp8.layout.packing.compact_bucket_counts`), and within a bucket the gradients lie in
owner order, so each owner's gradients are one span reduced to it in place
(:mod:`nemo_lw_fp8.mechanics.owner_reduce`, whose arithmetic this reuses).
"""

from __future__ import annotations

from collections.abc import Sequence

from nemo_lw_fp8.layout import packing as lo
from nemo_lw_fp8.mechanics import owner_reduce
from nemo_lw_fp8.planner.ownership import Ownership


def owner_reduce_layout(
    numels: Sequence[int], bucket_size: int | None, world: int, cap: int | None = None
) -> lo.StockLayout:
    """The compact owner-reduce buckets of one buffer whose parameters (forward order) hold
    ``numels`` elements: backprop order, no padding, in the shape of megatron's
    :class:`~nemo_lw_fp8.layout.packing.StockLayout` so the planner treats it like any layout."""
    backprop = list(range(len(numels)))[::-1]
    counts = lo.compact_bucket_counts([numels[p] for p in backprop], bucket_size, world, cap)
    buckets: list[tuple[int, int, int]] = []
    bucket_params: list[list[int]] = []
    start = k = 0
    for count in counts:
        members = backprop[k : k + count]
        size = sum(int(numels[p]) for p in members)
        buckets.append((start, start + size, size))
        bucket_params.append(members)
        start, k = start + size, k + count
    return lo.StockLayout(start, padding_numel=0, buckets=buckets, bucket_params=bucket_params)


def bucket_spans(
    bucket: Sequence[tuple[int, int]], table: dict, own: Ownership
) -> list[tuple[int, int]]:
    """The ``(owner, elements)`` spans of one compact bucket (``(spec index, elements)`` in
    backprop order), laid out as the mechanism lays it: params in owner order of the owner of
    their first element (:func:`.owner_reduce.owner_order`; a split ``linear_qkv``: its first
    part's), each param's elements in flattened order (a split ``linear_qkv``: per query group,
    each part's rows), runs of one owner merged."""
    order = owner_reduce.owner_order([table[i][0][0] for i, _ in bucket])
    pieces = [run for i, n in (bucket[k] for k in order) for run in own.runs(table, i, n)]
    return owner_reduce.owner_spans(pieces)


def sent_by_member(spans: Sequence[tuple[int, int]], world: int) -> list[int]:
    """Elements each member of a ``world``-rank group sends to reduce ``spans`` to their owners
    (ring model: every rank but the owner sends each span once)."""
    return [owner_reduce.owner_reduce_traffic(spans, m, world).sent for m in range(world)]
