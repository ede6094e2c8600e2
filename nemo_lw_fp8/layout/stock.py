"""megatron-core 0.19.2's own buffer layouts, computed by *calling* megatron's layout code on
meta-device stand-ins: the reference the planner compares the compact layout with, and where the
compact layout's buckets end by default.

Split from :mod:`nemo_lw_fp8.layout.packing` (which re-exports every name here) because it is the
one part that imports megatron; it depends only on :mod:`nemo_lw_fp8.layout.ns_cost`, never on
``layout``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from nemo_lw_fp8.layout.ns_cost import newton_schulz_cost, rank_loads


@dataclass(frozen=True)
class StockLayout:
    """megatron-core 0.19.2's layout of one buffer, as its own code computes it.

    ``owners[i]``: the shard (data-parallel rank) that updates parameter ``i`` (layer-wise
    layouts only; ``None`` for the distributed-optimizer byte-level layout). ``buckets``: per
    bucket ``(start, end, unpadded numel)``; ``padding_numel = numel - sum(param numels)``;
    ``bucket_params[b]``: indices of the parameters in bucket ``b`` (backprop order).
    ``rank_numel``: elements each rank updates (layer-wise: whole owned parameters;
    distributed optimizer: parameter elements inside the rank's byte range of every bucket).
    ``rank_cost``: Newton-Schulz cost per rank (layer-wise only).
    """

    numel: int
    padding_numel: int
    buckets: list[tuple[int, int, int]]
    bucket_params: list[list[int]]
    owners: list[int] | None = None
    rank_numel: list[int] | None = None
    rank_cost: list[int] | None = None


@contextmanager
def _quiet_megatron() -> Iterator[None]:
    """megatron warns at import and in ``log_single_rank`` about things a pure layout
    computation does not use (no TE/Apex, no CUDA, no process group to read the rank from)."""
    torch_logger = logging.getLogger("torch.utils.cpp_extension")
    level = torch_logger.level
    torch_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch_logger.setLevel(level)


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


def _bucket_params(layout, params) -> list[list[int]]:
    """Parameter indices per bucket, in backprop order (start offset order)."""
    per_bucket: list[list[tuple[int, int]]] = [[] for _ in layout.bucket_indices]
    for index, p in enumerate(params):
        start, _, bucket_id = layout.param_index_map[p]
        per_bucket[bucket_id].append((start, index))
    return [[index for _, index in sorted(entries)] for entries in per_bucket]


def _buckets(layout) -> list[tuple[int, int, int]]:
    return [
        (start, end, unpadded)
        for (start, end), unpadded in zip(
            layout.bucket_indices, layout.per_bucket_numel_unpadded, strict=True
        )
    ]


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
    with _quiet_megatron():
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
        bucket_start, bucket_end = layout.bucket_indices[bucket_id]
        shard = (bucket_end - bucket_start) // layout.num_optimizer_shards
        owner = (start - bucket_start) // shard
        assert end <= bucket_start + (owner + 1) * shard, "megatron layout crosses a shard"
        owners.append(owner)
    numel = layout.bucket_indices[-1][1] if layout.bucket_indices else 0
    return StockLayout(
        numel=numel,
        padding_numel=numel - sum(numels),
        buckets=_buckets(layout),
        bucket_params=_bucket_params(layout, params),
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
    """megatron-core 0.19.2's ``DistributedOptimizer`` (byte-level, Adam) layout of one buffer.

    Calls ``DistributedOptimizer._compute_per_buffer_param_layout`` on stand-ins: params start
    64-element aligned, bucket ends are padded to a multiple of ``lcm(dp, 128)``. Each bucket is
    cut into ``dp`` equal byte ranges; ``rank_numel[r]`` counts the parameter elements inside
    rank ``r``'s ranges (what its fp32 masters and Adam states cover).
    """
    with _quiet_megatron():
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        params = _stand_ins(shapes, shared_embedding)
        layout = DistributedOptimizer._compute_per_buffer_param_layout(
            params, bucket_size, dp, _ddp_config(pad_buckets_for_high_nccl_busbw)
        )
    rank_numel = [0] * dp
    for p in params:
        start, end, bucket_id = layout.param_index_map[p]
        bucket_start, bucket_end = layout.bucket_indices[bucket_id]
        shard = (bucket_end - bucket_start) // dp
        if end == start:
            continue
        for rank in range((start - bucket_start) // shard, (end - 1 - bucket_start) // shard + 1):
            lo = bucket_start + rank * shard
            rank_numel[rank] += min(end, lo + shard) - max(start, lo)
    numel = layout.bucket_indices[-1][1] if layout.bucket_indices else 0
    return StockLayout(
        numel=numel,
        padding_numel=numel - sum(p.numel() for p in params),
        buckets=_buckets(layout),
        bucket_params=_bucket_params(layout, params),
        rank_numel=rank_numel,
    )


def default_buckets(shapes: Sequence[Sequence[int]], bucket_size: int | None) -> StockLayout:
    """megatron's unpadded DDP layout (``_compute_default_per_buffer_param_layout``): backprop
    order, a bucket closes once it holds ``bucket_size`` elements. It is the layout of plain DDP,
    of the legacy layer-wise path, and the bucketing the compact layout starts from."""
    with _quiet_megatron():
        from megatron.core.distributed.param_and_grad_buffer import (
            _compute_default_per_buffer_param_layout,
        )

        params = _stand_ins(shapes, None)
        layout = _compute_default_per_buffer_param_layout(params, bucket_size)
    numel = layout.bucket_indices[-1][1] if layout.bucket_indices else 0
    return StockLayout(
        numel=numel,
        padding_numel=numel - sum(p.numel() for p in params),
        buckets=_buckets(layout),
        bucket_params=_bucket_params(layout, params),
    )
