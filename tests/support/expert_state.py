"""The layer-wise optimizer's state of expert weights, per expert, and its comparison over ranks.

Checkpoint tests of single grouped expert weights save under one ownership (a rank holds a
grouped weight whole, or a run of its experts) and load under another, so they compare state
per expert: ``<kind>:<parameter name>:<global expert>``. Both the project-layer tests and the TE
module tests read it the same way, from here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def layer_wise_float16_optimizers(optimizer: Any) -> list:
    """The Float16 optimizers of the layer-wise Muon (chained, at any depth)."""
    children = getattr(optimizer, "chained_optimizers", None)
    if children is not None:
        return [leaf for child in children for leaf in layer_wise_float16_optimizers(child)]
    return [optimizer] if hasattr(optimizer, "fp32_from_float16_groups") else []


def per_expert_state(
    optimizer: Any,
    module: torch.nn.Module,
    keep: Callable[[str], bool] = lambda name: True,
    whole_tensors: bool = True,
) -> dict[str, torch.Tensor]:
    """This rank's layer-wise fp32 masters and Muon state of the parameters whose name ``keep``
    accepts: a grouped weight's (3-D) per global expert, ``<kind>:<name>:<expert>``, whether
    this rank holds it whole or a run of it; with ``whole_tensors`` every other non-scalar
    tensor too, as ``<kind>:<name>``."""
    from nemo_lw_fp8.mechanics.expert_slices import is_slice, parent_of

    names = {id(p): n for n, p in module.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for opt in layer_wise_float16_optimizers(optimizer):
        for group, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True):
            for param, main in zip(group, mains, strict=True):
                name = names[id(parent_of(param))]
                if not keep(name):
                    continue
                values = {"master": main, **opt.optimizer.state.get(main, {})}
                for kind, value in values.items():
                    if not torch.is_tensor(value) or value.dim() == 0:
                        continue
                    if value.dim() == 3:  # a grouped weight, or a run of its experts
                        lo = param.lo if is_slice(param) else 0
                        for k, row in enumerate(value.unbind(0)):
                            out[f"{kind}:{name}:{lo + k}"] = row.detach().clone()
                    elif whole_tensors:
                        out[f"{kind}:{name}"] = value.detach().clone()
    return out


def merged_over_ranks(
    states: list[dict[str, torch.Tensor]], keep: Callable[[str], bool] = lambda name: True
) -> dict[str, torch.Tensor]:
    """The ranks' per-expert states (those ``keep`` accepts) in one dict; each entry must come
    from exactly one rank, which is what expert ownership promises."""
    merged: dict[str, torch.Tensor] = {}
    for state in states:
        for name, value in state.items():
            if keep(name):
                assert name not in merged, f"{name} held by two ranks"
                merged[name] = value
    return merged


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The entries of two states with the same keys that are not bitwise equal, sorted."""
    assert sorted(a) == sorted(b)
    return sorted(name for name in a if not torch.equal(a[name], b[name]))
