"""Buffer layouts for layer-wise (Muon) optimizers: ownership, compact packing, stock reference.

Everything here is a pure function of shapes and sizes (no process groups, no devices), so every
rank computes the same answer, before and after a resume, and the planner can run anywhere.

* :func:`newton_schulz_cost` - the work Muon does on one parameter.
* :func:`assign_owners` - which data-parallel rank updates each whole parameter, balancing that
  work (the largest per-rank cost bounds the optimizer step); :func:`assign_owners_joint` does it
  for dense and expert matrices together, balancing each rank's total.
* :func:`compact_offsets` - the compact persistent layout: each rank's parameters back to back,
  no padding at all.
* :func:`pack_for_even_all_gather` - how that compact layout is gathered with one
  ``all_gather_into_tensor``: padding lives only in a transient gather buffer;
  :func:`even_gather_fits` decides per bucket group whether that padding is small enough.
* :func:`stock_padded_layout`, :func:`stock_distopt_layout`, :func:`default_buckets` -
  megatron-core 0.19.2's own layouts, computed by *calling* megatron's layout code on
  meta-device stand-ins, for comparison and for the compact bucketing (written in
  :mod:`.stock`, the part that imports megatron; :func:`newton_schulz_cost` and
  :func:`rank_loads` in :mod:`.ns_cost`, which both use; importable from here).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

# The cost and megatron's own layouts live in modules of their own (ns_cost.py, stock.py;
# neither imports this one); their names stay importable from here.
from nemo_lw_fp8.layout.ns_cost import newton_schulz_cost as newton_schulz_cost
from nemo_lw_fp8.layout.ns_cost import rank_loads as rank_loads
from nemo_lw_fp8.layout.stock import StockLayout as StockLayout
from nemo_lw_fp8.layout.stock import default_buckets as default_buckets
from nemo_lw_fp8.layout.stock import stock_distopt_layout as stock_distopt_layout
from nemo_lw_fp8.layout.stock import stock_padded_layout as stock_padded_layout
from nemo_lw_fp8.vocabulary import AUTO_SPLIT_GAIN, GROUPED_WEIGHT_OWNERSHIP

# --------------------------------------------------------------------------- ownership


def assign_owners(
    costs: Sequence[int],
    world_size: int,
    sizes: Sequence[int] | None = None,
    initial_loads: Sequence[int] | None = None,
) -> list[int]:
    """Give every whole parameter to one rank so that the largest per-rank cost is small.

    Greedy LPT (longest processing time first): parameters in order of decreasing cost, ties by
    decreasing size (``sizes``, e.g. bytes; zero if not given), then increasing index; each goes
    to the rank with the smallest load so far, the lowest rank id on ties. ``initial_loads``
    (default zeros) is work a rank already has, e.g. the dense matrices it owns when its expert
    matrices are assigned afterwards (:func:`assign_owners_joint`).

    Deterministic: the result depends only on the arguments (no hashing, no randomness, no rank
    or process-group state), so every rank computes the same owners, and a resumed job the same
    owners as before. Permuting the inputs permutes the owners with them whenever the
    ``(cost, size)`` pairs are distinct; with repeated pairs the per-rank loads (cost and size)
    are still the same, only which of the identical parameters lands where follows the index.

    Bound (Graham 1969): with ``L = (sum(initial_loads) + sum(costs)) / world_size`` and
    ``c_max = max(costs)``, the largest final load is at most ``max(max(initial_loads),
    L + c_max * (1 - 1 / world_size))``: the rank that ends highest got its last parameter while
    it was the least loaded. Without initial loads it is also at most
    ``(4/3 - 1/(3 * world_size))`` times the best possible assignment. So the ratio max/mean is
    ``1 + O(c_max / L)``: close to 1 as soon as each rank gets several of the large matrices.

    Runs in ``O(n log n + n log world_size)``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = len(costs)
    if sizes is not None and len(sizes) != n:
        raise ValueError(f"{len(sizes)} sizes for {n} costs")
    if initial_loads is not None and len(initial_loads) != world_size:
        raise ValueError(f"{len(initial_loads)} initial loads for world size {world_size}")
    if any(c < 0 for c in costs):
        raise ValueError("costs must be non-negative")
    size_of = (lambda i: int(sizes[i])) if sizes is not None else (lambda i: 0)
    order = sorted(range(n), key=lambda i: (-int(costs[i]), -size_of(i), i))
    loads = [int(x) for x in initial_loads] if initial_loads is not None else [0] * world_size
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    owners = [0] * n
    for i in order:
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + int(costs[i]), rank))
    return owners


def refine_owners(
    costs: Sequence[int],
    owners: Sequence[int],
    world_size: int,
    max_rounds: int | None = None,
    initial_loads: Sequence[int] | None = None,
) -> list[int]:
    """Lower the busiest rank's cost after LPT by moves and swaps (deterministic local search).

    LPT alone can leave the busiest rank up to one large matrix above the mean when the
    matrices are few and large per rank (a pipeline rank's dense layers over DP 64). Each round
    takes the busiest rank (lowest id on ties) and applies the one change that lowers its load
    the most while keeping both ranks below its old load: moving one of its matrices to the
    least-loaded rank, or swapping one of its matrices for a cheaper one elsewhere. Ties go to
    the lowest indices, so the result depends only on the arguments, like :func:`assign_owners`.
    Stops when no change helps (or after ``max_rounds``, default ``4 * len(costs)``).
    ``initial_loads``: work the ranks already have (as in :func:`assign_owners`).
    """
    owners = [int(o) for o in owners]
    costs = [int(c) for c in costs]
    loads = rank_loads(costs, owners, world_size)
    if initial_loads is not None:
        loads = [a + int(b) for a, b in zip(loads, initial_loads, strict=True)]
    rounds = 4 * len(costs) if max_rounds is None else max_rounds
    for _ in range(rounds):
        hi = max(range(world_size), key=lambda r: (loads[r], -r))
        low = min(range(world_size), key=lambda r: (loads[r], r))
        mine = [i for i, o in enumerate(owners) if o == hi]
        best: tuple[int, int, int] | None = None  # (new busiest of the pair, item, other item)
        for i in mine:
            if loads[low] + costs[i] < loads[hi] and costs[i] > 0:
                peak = max(loads[hi] - costs[i], loads[low] + costs[i])
                if best is None or (peak, i, -1) < best:
                    best = (peak, i, -1)
        for i in mine:
            for j, o in enumerate(owners):
                delta = costs[i] - costs[j]
                if o == hi or delta <= 0 or loads[o] + delta >= loads[hi]:
                    continue
                peak = max(loads[hi] - delta, loads[o] + delta)
                if best is None or (peak, i, j) < best:
                    best = (peak, i, j)
        if best is None:
            break
        _, i, j = best
        if j < 0:
            owners[i] = low
            loads[hi] -= costs[i]
            loads[low] += costs[i]
        else:
            other = owners[j]
            delta = costs[i] - costs[j]
            owners[i], owners[j] = other, hi
            loads[hi] -= delta
            loads[other] += delta
    return owners


@dataclass(frozen=True)
class JointOwnership:
    """Owners of the dense and the expert Muon matrices of one model replica.

    ``dense[i]``: data-parallel rank of dense matrix ``i``. ``expert[e][j]``: rank, inside
    expert-data-parallel group ``e``, of that group's expert matrix ``j`` (every group holds
    different experts of the same shapes, so ``j`` indexes the shapes). ``rank_cost[r]``:
    Newton-Schulz total of data-parallel rank ``r`` (dense plus expert).
    """

    dense: list[int]
    expert: list[list[int]]
    rank_cost: list[int]


def default_expert_groups(dp: int, ep: int) -> list[list[int]]:
    """Expert-data-parallel groups as lists of data-parallel ranks, in group-rank order, for
    TP = CP = PP = 1 and megatron's default ``tp-cp-ep-dp-pp`` order: an expert-parallel group
    is ``ep`` consecutive ranks, so rank ``r`` is member ``r // ep`` of group ``r % ep``."""
    if dp % ep:
        raise ValueError(f"ep={ep} does not divide dp={dp}")
    return [[e + k * ep for k in range(dp // ep)] for e in range(ep)]


def assign_owners_joint(
    dense_costs: Sequence[int],
    expert_costs: Sequence[int],
    dp: int,
    expert_groups: Sequence[Sequence[int]],
    dense_sizes: Sequence[int] | None = None,
    expert_sizes: Sequence[int] | None = None,
) -> JointOwnership:
    """Cost-balanced owners for dense matrices (over the data-parallel group) and expert
    matrices (over each expert-data-parallel group), balancing each rank's *total* work.

    Dense matrices go first (attention, dense MLP and shared experts are the largest items, so
    this is close to a single LPT pass over everything), then each expert-data-parallel group
    assigns its expert matrices starting from its members' dense loads (``initial_loads``), so a
    rank that drew a large dense matrix gets fewer experts. ``expert_groups[e]`` lists the
    data-parallel ranks of group ``e`` in group-rank order (:func:`default_expert_groups`).
    Deterministic like :func:`assign_owners`; every rank computes every group's answer.
    """
    members = [r for group in expert_groups for r in group]
    if expert_costs and sorted(members) != list(range(dp)):
        raise ValueError("expert_groups must partition the data-parallel ranks")
    dense = assign_owners(dense_costs, dp, dense_sizes)
    cost = rank_loads(dense_costs, dense, dp)
    expert: list[list[int]] = []
    for group in expert_groups:
        owners = assign_owners(expert_costs, len(group), expert_sizes, [cost[r] for r in group])
        for k, load in enumerate(rank_loads(expert_costs, owners, len(group))):
            cost[group[k]] += load
        expert.append(owners)
    return JointOwnership(dense=dense, expert=expert, rank_cost=cost)


def resolve_qkv_ownership(value: str, layout: str, blockwise: bool = False) -> str:
    """``"split"`` or ``"whole"`` for a ``qkv_ownership`` setting. ``"auto"`` splits only where
    it can: the compact layout (the padded and legacy layouts own whole parameters) with weights
    that are not blockwise FP8 (their owner quantizes whole 128 x 128 tiles, which span the
    parts). An explicit value is returned as given; the guards refuse the explicit ``"split"``
    where it cannot happen rather than dropping it (``qkv-split-needs-compact``,
    ``qkv-split-blockwise``)."""
    if value != "auto":
        return value
    return "split" if layout == "compact" and not blockwise else "whole"


@dataclass(frozen=True)
class Piece:
    """Units ``[lo, hi)`` of parameter ``index`` (all of it when ``units == 1``) and its owner."""

    index: int
    lo: int
    hi: int
    owner: int


def assign_owner_pieces(
    costs: Sequence[int],
    units: Sequence[int],
    world_size: int,
    sizes: Sequence[int] | None = None,
    initial_loads: Sequence[int] | None = None,
) -> list[Piece]:
    """Owners at unit granularity: parameter ``i`` is ``units[i]`` equal, independent units
    (a grouped weight's experts; 1 for an ordinary matrix), each of cost ``costs[i] / units[i]``.

    Greedy LPT over all units (:func:`assign_owners`, deterministic the same way), then the
    consecutive units of a parameter that landed on the same rank merge into one piece. Returns
    the pieces in parameter order, units ascending. With units of equal cost this balances to
    within one unit, where whole ownership can only balance to within one whole parameter.
    """
    if len(units) != len(costs):
        raise ValueError(f"{len(units)} unit counts for {len(costs)} costs")
    unit_cost, unit_size, owner_of = [], [], []
    for i, (cost, count) in enumerate(zip(costs, units, strict=True)):
        if count < 1 or int(cost) % count:
            raise ValueError(f"parameter {i}: cost {cost} does not split into {count} units")
        size = int(sizes[i]) if sizes is not None else 0
        for _ in range(count):
            unit_cost.append(int(cost) // count)
            unit_size.append(size // count)
            owner_of.append(i)
    owners = assign_owners(unit_cost, world_size, unit_size, initial_loads)
    pieces: list[Piece] = []
    unit = 0
    for i, count in enumerate(units):
        lo = 0
        for k in range(1, count + 1):
            if k == count or owners[unit + k] != owners[unit + lo]:
                pieces.append(Piece(i, lo, k, owners[unit + lo]))
                lo = k
        unit += count
    return pieces


def choose_pieces(
    costs: Sequence[int],
    units: Sequence[int],
    world_size: int,
    sizes: Sequence[int] | None = None,
    ownership: str = "auto",
    initial_loads: Sequence[int] | None = None,
) -> list[Piece]:
    """Whole or unit-granular ownership as ``ownership`` says (:data:`GROUPED_WEIGHT_OWNERSHIP`).

    ``initial_loads``: Newton-Schulz work the ranks already have (an expert-data-parallel
    group's members' dense matrices, :func:`expert_initial_loads`), so that each rank's total is
    balanced, not each kind on its own ("whole" and "auto"; "expert" spreads every grouped
    weight over the group evenly, as asked, whatever the dense work)."""
    if ownership not in GROUPED_WEIGHT_OWNERSHIP:
        raise ValueError(f"ownership must be one of {GROUPED_WEIGHT_OWNERSHIP}, got {ownership!r}")
    base = [0] * world_size if initial_loads is None else [int(x) for x in initial_loads]
    owners = refine_owners(
        costs, assign_owners(costs, world_size, sizes, base), world_size, initial_loads=base
    )
    whole = [
        Piece(i, 0, count, owner)
        for i, (count, owner) in enumerate(zip(units, owners, strict=True))
    ]
    if ownership == "whole" or all(count == 1 for count in units):
        return whole
    if ownership == "expert":  # asked for: every grouped weight spread over the group evenly
        return assign_owner_pieces(costs, units, world_size, sizes)
    split = assign_owner_pieces(costs, units, world_size, sizes, base)

    def busiest(pieces: list[Piece]) -> int:
        loads = piece_loads(costs, units, pieces, world_size)
        return max(a + b for a, b in zip(loads, base, strict=True))

    busiest_whole, busiest_split = busiest(whole), busiest(split)
    return split if busiest_whole > (1 + AUTO_SPLIT_GAIN) * busiest_split else whole


def expert_initial_loads(
    dense_loads: Sequence[int], dense_ranks: Sequence[int], expert_ranks: Sequence[int]
) -> list[int] | None:
    """The dense work of each member of an expert-data-parallel group, in group-rank order:
    ``dense_loads`` per data-parallel rank, ``dense_ranks`` / ``expert_ranks`` the global ranks
    of the two groups in group-rank order. ``None`` when the expert group is not inside the
    data-parallel group (then each kind is balanced on its own)."""
    where = {int(g): k for k, g in enumerate(dense_ranks)}
    if any(int(g) not in where for g in expert_ranks):
        return None
    return [int(dense_loads[where[int(g)]]) for g in expert_ranks]


def piece_loads(
    values: Sequence[int], units: Sequence[int], pieces: Sequence[Piece], world_size: int
) -> list[int]:
    """Per-rank sum of ``values`` (per parameter, spread evenly over its units) under ``pieces``."""
    loads = [0] * world_size
    for piece in pieces:
        loads[piece.owner] += int(values[piece.index]) * (piece.hi - piece.lo) // units[piece.index]
    return loads


def imbalance(loads: Sequence[int]) -> float:
    """``max / mean`` of per-rank loads (1.0 is perfect balance; 1.0 for all-zero loads)."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 1.0


# --------------------------------------------------------------------------- compact layout


@dataclass(frozen=True)
class CompactLayout:
    """Each rank's parameters packed contiguously, rank-major, with no padding.

    ``rank_sizes[r]``: elements rank ``r`` owns; ``rank_starts[r]``: where its segment starts
    in the buffer; ``offsets[i] = (owner, offset inside the owner's segment)``;
    ``buffer_offsets[i]``: the parameter's start in the whole buffer. ``padding`` is 0 by
    construction (kept as a field so callers and tests can say so).
    """

    rank_sizes: list[int]
    rank_starts: list[int]
    offsets: list[tuple[int, int]]
    buffer_offsets: list[int]
    numel: int
    padding: int = 0


def compact_offsets(sizes: Sequence[int], owners: Sequence[int], world_size: int) -> CompactLayout:
    """The compact persistent layout of one buffer (or bucket).

    Parameters keep their input order inside their owner's segment (pass them in backprop order
    to keep megatron's bucket semantics), and segments follow rank order, so rank ``r``'s
    updated parameters are one contiguous slice: it can be sent as it is, without a copy.
    """
    if len(sizes) != len(owners):
        raise ValueError(f"{len(sizes)} sizes for {len(owners)} owners")
    rank_sizes = [0] * world_size
    local = []
    for size, owner in zip(sizes, owners, strict=True):
        if not 0 <= owner < world_size:
            raise ValueError(f"owner {owner} outside world size {world_size}")
        local.append((owner, rank_sizes[owner]))
        rank_sizes[owner] += int(size)
    rank_starts = [0] * world_size
    for r in range(1, world_size):
        rank_starts[r] = rank_starts[r - 1] + rank_sizes[r - 1]
    buffer_offsets = [rank_starts[owner] + off for owner, off in local]
    return CompactLayout(
        rank_sizes=rank_sizes,
        rank_starts=rank_starts,
        offsets=local,
        buffer_offsets=buffer_offsets,
        numel=sum(rank_sizes),
    )


@dataclass(frozen=True)
class EvenGatherPlan:
    """One ``all_gather_into_tensor`` for a compact bucket group.

    The persistent buffer is compact (:class:`CompactLayout`, no padding). For the gather, a
    *transient* buffer of ``world_size * segment`` elements is used, ``segment`` being the
    largest rank segment: rank ``r`` contributes its compact slice as the input chunk
    ``[0, rank_sizes[r])`` of a ``segment``-element send buffer (the tail is don't-care), one
    ``all_gather_into_tensor`` fills the transient buffer, and each rank copies chunk ``q``'s
    first ``rank_sizes[q]`` elements to ``rank_starts[q]`` of the persistent buffer (its own
    chunk can be skipped). ``gather_offsets[i]`` is parameter ``i``'s start in the transient
    buffer. ``transient_padding = world_size * segment - numel`` elements travel on the wire and
    exist only while the gather runs; they can live in the bucket's idle gradient buffer, as
    megatron's legacy layer-wise gather already does, when that is large enough
    (``fits_in(grad_buffer_bytes, element_bytes)``).
    """

    layout: CompactLayout
    segment: int
    gather_numel: int
    transient_padding: int
    gather_offsets: list[int] = field(default_factory=list)

    def fits_in(self, grad_buffer_bytes: int, element_bytes: int = 2) -> bool:
        """Whether the transient gather buffer fits into ``grad_buffer_bytes`` bytes."""
        return self.gather_numel * element_bytes <= grad_buffer_bytes


def pack_for_even_all_gather(
    sizes: Sequence[int], owners: Sequence[int], world_size: int
) -> EvenGatherPlan:
    """Plan the single even all-gather of a compact bucket group (see :class:`EvenGatherPlan`).

    A bucket group needs at most one collective per step this way, instead of megatron's uneven
    ``all_gather`` (which NCCL runs as one broadcast per rank) or a persistently padded buffer.
    """
    layout = compact_offsets(sizes, owners, world_size)
    segment = max(layout.rank_sizes, default=0)
    gather_offsets = [owner * segment + off for owner, off in layout.offsets]
    gather_numel = world_size * segment
    return EvenGatherPlan(
        layout=layout,
        segment=segment,
        gather_numel=gather_numel,
        transient_padding=gather_numel - layout.numel,
        gather_offsets=gather_offsets,
    )


#: megatron-core 0.19.2's padded layer-wise layout closes a bucket once its elements reach
#: ``max(bucket_size, PADDED_BUCKET_FLOOR * world * its largest parameter)``
#: (``LayerWiseDistributedOptimizer._compute_per_buffer_param_layout``'s ``PADDING_FLOOR``).
PADDED_BUCKET_FLOOR = 0.9


def compact_bucket_counts(
    numels: Sequence[int], bucket_size: int | None, world_size: int, cap: int | None = None
) -> list[int]:
    """How many parameters each compact layer-wise bucket holds, ``numels`` in backprop order.

    A bucket closes once its elements reach ``max(bucket_size, min(cap, floor))`` with ``floor =
    PADDED_BUCKET_FLOOR * world_size * the largest parameter in it`` (``cap=None``: no cap). So
    with no cap the buckets end where megatron's padded layout ends its buckets (same
    parameters, no padding): as many bucket groups, hence as many gather and gradient-sync
    launches, as the padded layout. ``cap=0`` is megatron's plain DDP bucketing (a bucket
    closes at ``bucket_size``), with more, smaller buckets. ``bucket_size=None``: one bucket.
    Each bucket's elements stay below its threshold plus one parameter, which bounds the
    transient buffers that live one bucket group at a time.
    """
    if cap is not None and cap < 0:
        raise ValueError(f"cap must be >= 0 or None, got {cap}")
    counts: list[int] = []
    count = total = largest = 0
    for numel in numels:
        count, total, largest = count + 1, total + int(numel), max(largest, int(numel))
        if bucket_size is None:
            continue
        floor = int(world_size * largest * PADDED_BUCKET_FLOOR)
        if total >= max(bucket_size, floor if cap is None else min(cap, floor)):
            counts.append(count)
            count = total = largest = 0
    if count:
        counts.append(count)
    return counts


def even_gather_fits(segment_numel: Sequence[int], tolerance: float) -> bool:
    """Whether one even ``all_gather_into_tensor`` (every segment padded to the longest) pads at
    most ``tolerance`` of the payload; otherwise an uneven ``all_gather`` of the same segments
    moves only real bytes (NCCL runs it as one broadcast per rank). Used by the compact layout
    patch per bucket group and by the planner, so both describe the same collectives."""
    total = sum(int(n) for n in segment_numel)
    if total == 0:
        return True
    padding = len(segment_numel) * max(int(n) for n in segment_numel) - total
    return padding <= tolerance * total
