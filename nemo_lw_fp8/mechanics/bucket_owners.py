"""Which optimizer gathers which bucket of a bucket group (#4987 area 3).

megatron's ``partition_buckets`` may put layer-wise (Muon, FP8) buckets and DistributedOptimizer
(Adam, bf16) buckets into one bucket group (its FP8 "case 3"). megatron-core 0.19.2 decides a
whole group's owner from its first bucket, so one side's buckets were never gathered. Here
ownership is decided per bucket, in the layer-wise, the DistOpt and the ChainedOptimizer's
deferred-sync paths: each optimizer gathers exactly its own buckets, one synchronous gather of
a sub-group over them.
"""

from __future__ import annotations

from typing import Any


def owned_by_layer_wise(bucket: Any) -> bool:
    """megatron's own tag: whether the layer-wise optimizer manages ``bucket``."""
    from megatron.core.optimizer.layer_wise_optimizer import (
        _bucket_is_managed_by_layer_wise_optimizer,
    )

    return _bucket_is_managed_by_layer_wise_optimizer(bucket, default_for_untagged=False)


def owned_buckets(bucket_group: Any, layer_wise: bool) -> list[Any]:
    """The buckets of a group that the layer-wise (or the DistOpt) side owns."""
    return [b for b in bucket_group.buckets if owned_by_layer_wise(b) == layer_wise]


def sub_group(bucket_group: Any, buckets: list[Any]) -> Any:
    """A bucket group over a subset of ``bucket_group``'s buckets, for one synchronous gather."""
    if len(buckets) == len(bucket_group.buckets):
        return bucket_group
    return type(bucket_group)(
        buckets,
        bucket_group.ddp_config,
        bucket_group.intra_distributed_optimizer_instance_group,
        bucket_group.intra_distributed_optimizer_instance_size,
    )


def _all_groups(chunk: Any) -> list[Any]:
    return chunk.bucket_groups + chunk.expert_parallel_bucket_groups


def sync_owned(model_chunks: list[Any], layer_wise: bool) -> None:
    """Gather, group by group, the buckets one side owns."""
    for chunk in model_chunks:
        for bucket_group in _all_groups(chunk):
            mine = owned_buckets(bucket_group, layer_wise)
            if mine:
                chunk._start_bucket_group_param_sync(
                    sub_group(bucket_group, mine), force_sync=False
                )


def deferred_distopt_syncs(chained: Any) -> list[tuple[Any, Any]]:
    """The ChainedOptimizer's deferred DistOpt sync, restricted per bucket to DistOpt buckets:
    ``(chunk, bucket group)`` pairs, each group once."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    deferred: list[tuple[Any, Any]] = []
    seen: set[int] = set()
    for optimizer in chained.chained_optimizers:
        if not isinstance(optimizer, DistributedOptimizer):
            continue
        optimizer._defer_param_sync = True
        for chunk in optimizer.model_chunks:
            for bucket_group in _all_groups(chunk):
                if id(bucket_group) in seen:
                    continue
                seen.add(id(bucket_group))
                mine = owned_buckets(bucket_group, layer_wise=False)
                if mine:
                    deferred.append((chunk, sub_group(bucket_group, mine)))
    return deferred
