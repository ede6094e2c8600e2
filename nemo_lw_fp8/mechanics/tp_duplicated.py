"""Muon on weights duplicated over tensor parallel: orthogonalized whole, as at TP 1.

Why: multi-latent attention's q / kv down projections are TE linears in ``duplicated`` parallel
mode (megatron's ``TELinear``): every TP rank holds the whole matrix and megatron all-reduces
its gradient over TP under sequence parallelism. TE's ``Linear.reset_parameters`` tags every
weight as TP-partitioned along dim 0 whatever its mode; megatron then sets
``tensor_model_parallel=False`` on a duplicated weight but leaves ``partition_dim=0``, and the
fp32 master copies both attributes. megatron-core 0.19.2's ``TensorParallelMuon`` reads only
``partition_dim``: it all-gathers the two identical copies over TP, orthogonalizes the stacked
``(2 x rows, cols)`` matrix and keeps its half (and scales for the doubled rows), so a down
projection's update at TP 2 is not the one TP 1 computes, on every rank alike (FP8 param gather
ON and OFF agree, so ON = OFF cannot see it).

:func:`unpartition_duplicated_masters` clears the partition dimension of every layer-wise master
whose parameter is not TP-sharded, before the features' steps derive their stand-ins (QKV parts,
expert slices) from the masters: Muon then takes its non-TP path for them, the whole matrix, as
at TP 1. Model parameters keep their attributes (checkpointing reads them).
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_lw_fp8.mechanics import masters

#: megatron's "not partitioned" value of ``partition_dim``.
UNPARTITIONED = -1


def is_mislabelled(param: torch.Tensor) -> bool:
    """Not TP-sharded, yet carrying a partition dimension Muon would gather over."""
    dim = getattr(param, "partition_dim", UNPARTITIONED)
    return not getattr(param, "tensor_model_parallel", False) and dim not in (None, UNPARTITIONED)


def unpartition_duplicated_masters(optimizer: Any) -> list[torch.Tensor]:
    """Clear ``partition_dim`` on the fp32 masters of TP-duplicated weights of a layer-wise
    optimizer; returns the masters changed."""
    changed = []
    for child in masters.float16_children(optimizer):
        for _, main in masters.model_main_pairs(child):
            if is_mislabelled(main):
                main.partition_dim = UNPARTITIONED
                changed.append(main)
    return changed
