"""Checkpoints of the tests' training runs, saved and loaded inside the ranks.

:func:`save_checkpoint` / :func:`load_checkpoint`: per rank, fixed data-parallel size, exactly
what the model and each chained optimizer hold. :func:`save_named_checkpoint` /
:func:`load_named_checkpoint`: keyed by parameter name in the discrete expert layout, so a run
with single grouped expert weights resumes one with discrete weights and the reverse.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch


def _optimizer_state(child) -> dict[str, Any]:
    """What one chained optimizer holds on this rank, exactly."""
    if hasattr(child, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
        return {
            "inner": child.optimizer.state_dict(),
            "masters": [
                [p.detach().clone() for p in g] for g in child.shard_fp32_from_float16_groups
            ],
        }
    return {"state_dict": child.state_dict()}


def _load_optimizer_state(child, state: dict[str, Any]) -> None:
    if "inner" in state:
        child.optimizer.load_state_dict(state["inner"])
        for group, saved in zip(
            child.shard_fp32_from_float16_groups, state["masters"], strict=True
        ):
            for param, value in zip(group, saved, strict=True):
                param.data.copy_(value)
    else:
        child.load_state_dict(state["state_dict"])


def save_checkpoint(model: list, optimizer, directory: str) -> None:
    """A fixed-DP, per-rank checkpoint: model state dict and every chained optimizer's state.

    megatron-core 0.19.2's own "torch" format cannot serve here: beside a layer-wise optimizer
    the DistributedOptimizer has no gloo group (``get_parameter_state_dp_zero`` asserts),
    ``ChainedOptimizer.save_parameter_state`` drops the layer-wise child while
    ``load_parameter_state`` indexes by child position, and the dp-zero loader expects TE's
    FusedAdam state layout, not torch's. (torch_dist, megatron's default format, takes none
    of these paths.) What matters to the plugin is that weights, masters and optimizer state
    come back to the bit.
    """
    import torch.distributed as dist

    os.makedirs(directory, exist_ok=True)
    children = getattr(optimizer, "chained_optimizers", [optimizer])
    torch.save(
        {
            "model": model[0].module.state_dict(),
            "optimizers": [_optimizer_state(child) for child in children],
        },
        os.path.join(directory, f"rank{dist.get_rank()}.pt"),
    )


def load_checkpoint(model: list, optimizer, directory: str) -> None:
    """Load what :func:`save_checkpoint` wrote into a freshly built model and optimizer."""
    import torch.distributed as dist

    state = torch.load(os.path.join(directory, f"rank{dist.get_rank()}.pt"), weights_only=False)
    model[0].module.load_state_dict(state["model"])
    children = getattr(optimizer, "chained_optimizers", [optimizer])
    for child, child_state in zip(children, state["optimizers"], strict=True):
        _load_optimizer_state(child, child_state)


# ------------------------------------------------------------------ cross-layout checkpoint


def _layer_wise_children(optimizer) -> tuple[list, list]:
    """(the layer-wise optimizers' Float16 inner optimizers, every other chained child)."""
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    inner, others = [], []
    for child in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(child, LayerWiseDistributedOptimizer):
            inner.extend(child.chained_optimizers)
        else:
            others.append(child)
    return inner, others


def _named_masters(inner: list, module: torch.nn.Module) -> Iterator[tuple[Any, str, Any]]:
    """(Float16 optimizer, parameter name, fp32 master) for every master ``inner`` holds: the
    walk both the named save and the named load make, so that they pair names the same way."""
    names = {id(p): n for n, p in module.named_parameters()}
    for child in inner:
        for model_group, main_group in zip(
            child.float16_groups, child.fp32_from_float16_groups, strict=True
        ):
            for param, master in zip(model_group, main_group, strict=True):
                yield child, names[id(param)], master


def _grouped_names(module: torch.nn.Module) -> list[str]:
    return [
        name for name, p in module.named_parameters() if name.endswith(".weight") and p.dim() == 3
    ]


def save_named_checkpoint(model: list, optimizer, directory: str) -> None:
    """A per-rank checkpoint keyed by parameter NAME in the discrete layout, so it loads into
    either presentation: model values, and for every layer-wise parameter this rank owns its
    fp32 master and Muon state; other chained optimizers (DistOpt Adam: no expert weights
    here, identical in both layouts) as :func:`save_checkpoint`."""
    import torch.distributed as dist

    from nemo_lw_fp8.mechanics.grouped_weights import grouped_to_discrete

    module = model[0].module
    grouped = _grouped_names(module)
    per_quantity: dict[str, dict[str, torch.Tensor]] = {"master": {}}
    inner, others = _layer_wise_children(optimizer)
    for child, name, master in _named_masters(inner, module):
        per_quantity["master"][name] = master.detach().clone()
        for key, value in child.optimizer.state.get(master, {}).items():
            if not torch.is_tensor(value):
                raise TypeError(f"{name}: non-tensor optimizer state {key!r}")
            per_quantity.setdefault(key, {})[name] = value.detach().clone()
    values = {n: p.detach().clone() for n, p in module.named_parameters()}
    state = {
        "model": grouped_to_discrete(values, grouped),
        "layer_wise": {
            key: grouped_to_discrete(tensors, [n for n in grouped if n in tensors])
            for key, tensors in per_quantity.items()
        },
        "others": [_optimizer_state(child) for child in others],
    }
    os.makedirs(directory, exist_ok=True)
    torch.save(state, os.path.join(directory, f"rank{dist.get_rank()}.pt"))


def load_named_checkpoint(model: list, optimizer, directory: str) -> None:
    """Load :func:`save_named_checkpoint` into a model of either presentation: every rank reads
    every rank's layer-wise state (ownership differs between layouts) and takes what it owns."""
    import glob

    import torch.distributed as dist

    from nemo_lw_fp8.mechanics.grouped_weights import discrete_to_grouped

    module = model[0].module
    grouped = _grouped_names(module)
    mine = torch.load(os.path.join(directory, f"rank{dist.get_rank()}.pt"), weights_only=False)
    merged: dict[str, dict[str, torch.Tensor]] = {}
    for path in sorted(glob.glob(os.path.join(directory, "rank*.pt"))):
        for key, tensors in torch.load(path, weights_only=False)["layer_wise"].items():
            merged.setdefault(key, {}).update(tensors)

    def to_model_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        present = [n for n in grouped if any(k.startswith(n) for k in tensors)]
        return discrete_to_grouped(tensors, present)

    values = to_model_layout(mine["model"])
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(values[name])
    layer_wise = {key: to_model_layout(tensors) for key, tensors in merged.items()}
    inner, others = _layer_wise_children(optimizer)
    for child, name, master in _named_masters(inner, module):
        master.data.copy_(layer_wise["master"][name])
        child.optimizer.state[master] = {
            key: tensors[name].clone()
            for key, tensors in layer_wise.items()
            if key != "master" and name in tensors
        }
    for child, child_state in zip(others, mine["others"], strict=True):
        _load_optimizer_state(child, child_state)
