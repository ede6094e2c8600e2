"""Map name-keyed tensors between single grouped expert weights and discrete expert weights.

Why: TE 2.20.2's ``GroupedLinear`` names its expert matrices ``<prefix>.weight0 ..
<prefix>.weight{E-1}`` (each ``(out, in)``), or, with a single grouped weight, ONE
``<prefix>.weight`` of shape ``(E, out, in)``. A checkpoint written under one presentation must
load under the other -- model weights and everything the optimizer keeps per parameter (fp32
masters, Muon momentum, Adam moments) -- and training must continue bit for bit. Per expert the
values are the same bytes, so the conversion is exact: split along dim 0, or stack.

These functions work on plain ``{name: tensor}`` dicts (any per-parameter quantity), so callers
can convert model state, masters and optimizer state alike. megatron-core 0.19.2's own
``torch_dist`` path does the same for model weights through TE's state-dict hooks
(``DistributedOptimizer._normalize_state_dict_for_grouped_params``); these helpers cover the
per-parameter optimizer state under layer-wise Muon, which that path does not.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

__all__ = ["grouped_to_discrete", "discrete_to_grouped", "grouped_prefixes"]

_MEMBER = re.compile(r"^(?P<prefix>.*\.weight)(?P<index>\d+)$")


def grouped_prefixes(names: Iterable[str], shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """The ``<prefix>.weight`` names that are single grouped weights (3-D ``weight`` tensors)."""
    return [n for n in names if n.endswith(".weight") and len(shapes[n]) == 3]


def grouped_to_discrete(
    tensors: Mapping[str, torch.Tensor], grouped: Iterable[str]
) -> dict[str, torch.Tensor]:
    """Split each name in ``grouped`` (``(E, out, in)``) into ``name0 .. name{E-1}``."""
    grouped = set(grouped)
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if name not in grouped:
            out[name] = value
            continue
        if value.dim() != 3:
            raise ValueError(f"{name}: a grouped weight is (E, out, in), got {tuple(value.shape)}")
        for index, member in enumerate(value.unbind(0)):
            out[f"{name}{index}"] = member.clone()
    missing = grouped - set(tensors)
    if missing:
        raise KeyError(f"grouped weights not found: {sorted(missing)}")
    return out


def discrete_to_grouped(
    tensors: Mapping[str, torch.Tensor], grouped: Iterable[str]
) -> dict[str, torch.Tensor]:
    """Stack ``name0 .. name{E-1}`` into ``name`` for each name in ``grouped``.

    Every index from 0 to E-1 must be present and no other: a missing expert is an error, never
    a silently shorter stack.
    """
    grouped = set(grouped)
    members: dict[str, dict[int, torch.Tensor]] = {name: {} for name in grouped}
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        match = _MEMBER.match(name)
        if match and match["prefix"] in grouped:
            members[match["prefix"]][int(match["index"])] = value
        else:
            out[name] = value
    for name, parts in members.items():
        if not parts or sorted(parts) != list(range(len(parts))):
            raise KeyError(f"{name}: expert members {sorted(parts)} are not 0..E-1")
        out[name] = torch.stack([parts[i] for i in range(len(parts))], dim=0)
    return out
