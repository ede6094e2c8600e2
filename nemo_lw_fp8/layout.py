"""Buffer layouts for layer-wise (Muon) optimizers: ownership, compact packing, stock reference.

Everything here is a pure function of shapes and sizes (no process groups, no devices), so every
rank computes the same answer, before and after a resume, and the planner can run anywhere.

* :func:`newton_schulz_cost` - the work Muon does on one parameter.
* :func:`assign_owners` - which data-parallel rank updates each whole parameter, balancing that
  work (the largest per-rank cost bounds the optimizer step).
* :func:`compact_offsets` - the compact persistent layout: each rank's parameters back to back,
  no padding at all.
* :func:`pack_for_even_all_gather` - how that compact layout is gathered with one
  ``all_gather_into_tensor``: padding lives only in a transient gather buffer.
* :func:`stock_padded_layout` / :func:`stock_distopt_layout` - megatron-core 0.19.2's own
  layouts, computed by *calling* megatron's layout code on meta-device stand-ins, for comparison.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

# --------------------------------------------------------------------------- cost


def newton_schulz_cost(shape: Sequence[int]) -> int:
    """Relative Newton-Schulz work for one parameter: ``m * n * min(m, n)``.

    One Newton-Schulz iteration on an ``m x n`` matrix is a few GEMMs of ``min(m, n)``-sided
    Gram matrices, i.e. ``O(m * n * min(m, n))`` flops; the constant (iterations, GEMMs per
    iteration) is the same for every matrix, so it is left out. A 3-D grouped expert weight
    ``(E, m, n)`` is orthogonalised per expert: ``E * m * n * min(m, n)``.

    Raises ``ValueError`` for anything that is not a matrix or a stack of matrices (Muon does not
    touch vectors; they have no Newton-Schulz cost to balance).
    """
    dims = tuple(int(d) for d in shape)
    if len(dims) == 2:
        m, n = dims
        return m * n * min(m, n)
    if len(dims) == 3:
        e, m, n = dims
        return e * m * n * min(m, n)
    raise ValueError(f"Newton-Schulz cost is defined for 2-D and 3-D shapes, got {dims}")


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
    (default zeros) is work a rank already has, e.g. its expert matrices when the dense matrices
    are assigned over the full data-parallel group afterwards (a joint assignment).

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


def rank_loads(values: Sequence[int], owners: Sequence[int], world_size: int) -> list[int]:
    """Sum of ``values`` per owner rank."""
    loads = [0] * world_size
    for value, owner in zip(values, owners, strict=True):
        loads[owner] += int(value)
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


# --------------------------------------------------------------------------- stock megatron


@dataclass(frozen=True)
class StockLayout:
    """megatron-core 0.19.2's layout of one buffer, as its own code computes it.

    ``owners[i]``: the shard (data-parallel rank) that updates parameter ``i`` (layer-wise
    layouts only; ``None`` for the distributed-optimizer byte-level layout). ``buckets``: per
    bucket ``(start, end, unpadded numel)``; ``padding_numel = numel - sum(param numels)``;
    ``rank_numel`` / ``rank_cost``: owned elements and Newton-Schulz cost per rank (layer-wise).
    """

    numel: int
    padding_numel: int
    buckets: list[tuple[int, int, int]]
    owners: list[int] | None = None
    rank_numel: list[int] | None = None
    rank_cost: list[int] | None = None


def _stand_ins(shapes: Sequence[Sequence[int]], shared_embedding: Sequence[bool] | None):
    """Meta-device parameters: megatron's layout code reads only ``.data.nelement()`` and
    attributes such as ``shared_embedding``, and meta tensors allocate nothing."""
    import torch

    params = []
    for i, shape in enumerate(shapes):
        p = torch.nn.Parameter(torch.empty(tuple(shape), device="meta"))
        if shared_embedding is not None and shared_embedding[i]:
            p.shared_embedding = True
        params.append(p)
    return params


def _ddp_config(pad_buckets_for_high_nccl_busbw: bool):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        pad_buckets_for_high_nccl_busbw=pad_buckets_for_high_nccl_busbw,
    )


def stock_padded_layout(
    shapes: Sequence[Sequence[int]],
    dp: int,
    bucket_size: int | None,
    *,
    shared_embedding: Sequence[bool] | None = None,
    pad_buckets_for_high_nccl_busbw: bool = False,
) -> StockLayout:
    """megatron-core 0.19.2's padded layer-wise layout of one Muon buffer over ``dp`` ranks.

    Calls ``LayerWiseDistributedOptimizer._compute_per_buffer_param_layout`` itself on
    meta-device stand-ins (``shapes`` in model-definition order, as megatron passes a buffer's
    params), then reads ownership the way ``_shard_params_from_layout`` does: a parameter
    belongs to the shard its start falls in. Every rank allocates the whole padded buffer.
    """
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    params = _stand_ins(shapes, shared_embedding)
    layout = LayerWiseDistributedOptimizer._compute_per_buffer_param_layout(
        params, bucket_size, dp, _ddp_config(pad_buckets_for_high_nccl_busbw)
    )
    numels = [p.numel() for p in params]
    costs = [newton_schulz_cost(tuple(p.shape)) for p in params]
    owners = []
    for p in params:
        start, end, bucket_id = layout.param_index_map[p]
        b_start, b_end = layout.bucket_indices[bucket_id]
        shard = (b_end - b_start) // layout.num_optimizer_shards
        owner = (start - b_start) // shard
        assert end <= b_start + (owner + 1) * shard, "megatron layout crosses a shard"
        owners.append(owner)
    numel = layout.bucket_indices[-1][1] if layout.bucket_indices else 0
    return StockLayout(
        numel=numel,
        padding_numel=numel - sum(numels),
        buckets=[
            (s, e, u)
            for (s, e), u in zip(
                layout.bucket_indices, layout.per_bucket_numel_unpadded, strict=True
            )
        ],
        owners=owners,
        rank_numel=rank_loads(numels, owners, dp),
        rank_cost=rank_loads(costs, owners, dp),
    )


def stock_distopt_layout(
    shapes: Sequence[Sequence[int]],
    dp: int,
    bucket_size: int | None,
    *,
    shared_embedding: Sequence[bool] | None = None,
    pad_buckets_for_high_nccl_busbw: bool = False,
) -> StockLayout:
    """megatron-core 0.19.2's ``DistributedOptimizer`` (byte-level, Adam) layout of one buffer,
    by calling ``DistributedOptimizer._compute_per_buffer_param_layout`` on stand-ins: params
    start 64-element aligned, bucket ends are padded to a multiple of ``lcm(dp, 128)``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    params = _stand_ins(shapes, shared_embedding)
    layout = DistributedOptimizer._compute_per_buffer_param_layout(
        params, bucket_size, dp, _ddp_config(pad_buckets_for_high_nccl_busbw)
    )
    numel = layout.bucket_indices[-1][1] if layout.bucket_indices else 0
    return StockLayout(
        numel=numel,
        padding_numel=numel - sum(p.numel() for p in params),
        buckets=[
            (s, e, u)
            for (s, e), u in zip(
                layout.bucket_indices, layout.per_bucket_numel_unpadded, strict=True
            )
        ],
    )
