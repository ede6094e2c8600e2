"""A record of the optimizer state that does not depend on who owns what.

Why: :func:`nemo_lw_fp8.cli.pretrain.optimizer_state_digest` hashes a rank's state in the
optimizer's order, which changes with the data-parallel size (layer-wise ownership, Adam's
byte-range shards) and with the grouped-weight ownership (a grouped weight's master is one
``(E, out, in)`` tensor on one rank, or runs of experts on several). A resume at another size or
ownership can only be compared entry by entry, in model terms.

:func:`state_by_name` gives, for this rank, one entry per parameter it holds state for: the
SHA-256 of its fp32 master and of each optimizer state tensor (Muon momentum; Adam moments).
Keys are what stays fixed when DP size and ownership change: the pipeline stage, the virtual
chunk, the model's parameter name and, for expert parameters, the expert-parallel rank, and for
a TP-sharded parameter at tensor (or expert tensor) parallel above 1 its TP rank; a
grouped expert weight is split into one entry per expert, whether one rank holds the whole
weight or several hold runs of its experts, and a fused QKV weight into its Q, K, V parts.
The Adam state of the sibling DistributedOptimizer is put back together over its data-parallel
group (each rank holds a byte range of each parameter), so every rank of that group records
the whole parameter. The union over ranks is the run's state; where ranks hold the same entry
they must agree.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def _sha(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous()
    digest = hashlib.sha256(str((tuple(data.shape), data.dtype)).encode())
    digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class _Names:
    """Layout-independent names of this rank's model parameters."""

    def __init__(self, model_chunks: list[Any]) -> None:
        from megatron.core import parallel_state as ps

        pp = ps.get_pipeline_model_parallel_rank()
        ep = ps.get_expert_model_parallel_rank()
        shard = {
            False: (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()),
            True: (
                ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_rank(),
            ),
        }
        self.names: dict[int, str] = {}
        for index, chunk in enumerate(model_chunks):
            for name, param in chunk.named_parameters():
                while name.startswith("module."):
                    name = name[len("module.") :]
                expert = not getattr(param, "allreduce", True)
                # A TP-sharded parameter's shards share its name: the (expert) TP rank tells
                # them apart (only when that size is above 1, so TP-1 names stay as they were).
                size, rank = shard[expert]
                sharded = size > 1 and getattr(param, "tensor_model_parallel", False)
                tp = f"tp{rank}/" if sharded else ""
                self.names[id(param)] = (
                    f"pp{pp}/chunk{index}/" + (f"ep{ep}/" if expert else "") + tp + name
                )

    def entries(self, param: torch.Tensor, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """``{name: {kind: sha}}`` for ``param``'s state ``tensors`` (full shape of
        ``param``, or of an expert run, or of a QKV part): one entry per expert of a grouped
        weight, one per part (Q, K, V) of a fused QKV weight, however it is owned."""
        from nemo_lw_fp8.mechanics import qkv_parts
        from nemo_lw_fp8.mechanics.expert_slices import is_slice

        if qkv_parts.is_part(param):
            base = self.names[id(param.parent)]
            return {f"{base}/qkv_part{param.index}": {k: _sha(v) for k, v in tensors.items()}}
        shapes = qkv_parts.split_shapes(param)
        if shapes is not None:
            base = self.names[id(param)]
            split = {k: qkv_parts.parts_of(v, shapes) for k, v in tensors.items()}
            return {
                f"{base}/qkv_part{j}": {k: _sha(parts[j]) for k, parts in split.items()}
                for j in range(len(shapes))
            }
        if is_slice(param):
            base, first = self.names[id(param.parent)], param.lo
        else:
            base, first = self.names[id(param)], 0
        if tensors and next(iter(tensors.values())).dim() == 3:  # grouped (E, out, in)
            rows = next(iter(tensors.values())).shape[0]
            return {
                f"{base}/expert{first + row}": {k: _sha(v[row]) for k, v in tensors.items()}
                for row in range(rows)
            }
        return {base: {k: _sha(v) for k, v in tensors.items()}}


def _inner_state(optimizer: Any, main: torch.Tensor) -> dict[str, torch.Tensor]:
    state = optimizer.state.get(main, {}) if optimizer is not None else {}
    return {k: v for k, v in sorted(state.items()) if isinstance(v, torch.Tensor) and v.dim()}


def _mixed_precision(opt: Any, names: _Names, out: dict[str, Any]) -> None:
    """A Float16OptimizerWithFloat16Params (the layer-wise Muon): model param -> master."""
    pairs = []
    for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True):
        pairs += list(zip(models, mains, strict=True))
    for group in getattr(opt, "fp32_from_fp32_groups", None) or []:
        pairs += [(param, param) for param in group]
    for model_param, main in pairs:
        tensors = {"master": main.detach(), **_inner_state(opt.optimizer, main)}
        out.update(names.entries(model_param, tensors))


def _collective_device(group: Any) -> torch.device:
    """Where the tensors of a collective over ``group`` must live: NCCL takes only CUDA
    tensors (the current device), gloo takes CPU tensors."""
    import torch.distributed as dist

    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _distributed(opt: Any, names: _Names, out: dict[str, Any]) -> None:
    """A DistributedOptimizer (the sibling Adam): each rank's byte ranges, put back together
    over its data-parallel group as int32 sums (exact: the other ranks add zeros)."""
    import torch.distributed as dist

    mains: dict[int, torch.Tensor] = {}
    for models, shards in (
        (opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
        (opt.model_fp32_groups, opt.shard_fp32_groups),
    ):
        for model_group, shard_group in zip(models, shards, strict=True):
            for model_param, shard in zip(model_group, shard_group, strict=True):
                mains[id(model_param)] = shard
    kinds = ["master", *getattr(opt, "optimizer_state_keys", ("exp_avg", "exp_avg_sq"))]
    # Every parameter of the optimizer's buffers, in buffer order: the same on every rank of
    # the group (``model_param_gbuf_map`` holds only the parameters of this rank's range).
    every = [param for buffer in getattr(opt, "buffers", ()) for param in buffer.params]
    device = _collective_device(opt.data_parallel_group)
    for model_param in every:
        numel = model_param.numel()
        full = torch.zeros(len(kinds), numel, dtype=torch.int32, device=device)
        held = torch.zeros(len(kinds), dtype=torch.int32, device=device)
        shard = mains.get(id(model_param))
        if shard is not None:
            span = opt._get_model_param_range_map(model_param)["param"]
            state = {"master": shard.detach(), **_inner_state(opt.optimizer, shard)}
            for row, kind in enumerate(kinds):
                if kind in state:
                    values = state[kind].detach().float().reshape(-1)
                    full[row, span.start : span.end] = values.view(torch.int32).to(device)
                    held[row] = 1
        dist.all_reduce(full, group=opt.data_parallel_group)
        dist.all_reduce(held, group=opt.data_parallel_group)
        full, held = full.cpu(), held.cpu()
        tensors = {
            kind: full[row].view(torch.float32).reshape(model_param.shape)
            for row, kind in enumerate(kinds)
            if held[row] > 0
        }
        if tensors:  # no rank of the group holds state for a parameter of another optimizer
            out.update(names.entries(model_param, tensors))


def state_by_name(optimizer: Any, model_chunks: list[Any]) -> dict[str, dict[str, str]]:
    """``{parameter: {"master": sha, "momentum_buffer" | "exp_avg" | ...: sha}}`` of this
    rank (collective over each DistributedOptimizer's data-parallel group: call it on every
    rank)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    names = _Names(model_chunks)
    out: dict[str, Any] = {}

    def walk(opt: Any) -> None:
        children = getattr(opt, "chained_optimizers", None)
        if children is not None:
            for child in children:
                walk(child)
        elif isinstance(opt, DistributedOptimizer):
            _distributed(opt, names, out)
        elif hasattr(opt, "fp32_from_float16_groups"):
            _mixed_precision(opt, names, out)

    walk(optimizer)
    return out


class StateDisagreement(ValueError):
    """Two ranks hold the same state entry with different values."""


def union(records: list[dict[str, dict[str, str]]]) -> dict[str, dict[str, str]]:
    """The run's state from every rank's :func:`state_by_name`; raises
    :class:`StateDisagreement` when two ranks hold the same entry with different values."""
    merged: dict[str, dict[str, str]] = {}
    for rank, record in enumerate(records):
        for name, kinds in record.items():
            if name in merged and merged[name] != kinds:
                raise StateDisagreement(
                    f"rank {rank} disagrees on {name}: {kinds} vs {merged[name]}"
                )
            merged[name] = kinds
    return merged
