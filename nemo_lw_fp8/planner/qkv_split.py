"""Q/K/V split ownership as the planner models it: a fused ``linear_qkv`` weight as its parts.

megatron-core 0.19.2's Muon with ``muon_split_qkv`` (on by default) views a ``linear_qkv`` weight
``(groups * sum(split), hidden)`` as ``(groups, sum(split), hidden)`` and orthogonalizes each part
``j`` (rows ``[off_j, off_j + split_j)`` of every query group) as its own ``(groups * split_j,
hidden)`` matrix. So the parts can have different owners and the update stays the same: with
``qkv_ownership="split"`` the compact layout owns them as independent matrices. Here is what the
planner needs of that: which specs split, the parts' shapes, sizes and Newton-Schulz costs, and
where each part's elements lie in the flattened weight (the gradient layout of the owner reduce).
MLA attention (DeepSeek-V3) has no ``linear_qkv`` and never splits; neither does an
expert-parallel weight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from nemo_lw_fp8.layout import packing as lo
from nemo_lw_fp8.planner.shapes import ParamSpec
from nemo_lw_fp8.vocabulary import QKV_RESOLVED


def check_qkv_ownership(value: str) -> str:
    """``value`` if it is one of :data:`nemo_lw_fp8.layout.packing.QKV_RESOLVED`, else a ValueError
    (the planner models what a run does: resolve ``"auto"`` first with
    :func:`nemo_lw_fp8.layout.packing.resolve_qkv_ownership`)."""
    if value not in QKV_RESOLVED:
        raise ValueError(f"qkv_ownership must be one of {QKV_RESOLVED}, got {value!r}")
    return value


@dataclass(frozen=True)
class QkvParts:
    """The parts of one split ``linear_qkv`` weight: ``split[j]`` rows of every one of
    ``groups`` query groups, ``hidden`` columns."""

    groups: int
    split: tuple[int, ...]
    hidden: int

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Each part as the matrix Muon orthogonalizes, in split order."""
        return [(self.groups * rows, self.hidden) for rows in self.split]

    @property
    def numels(self) -> list[int]:
        return [math.prod(shape) for shape in self.shapes]

    @property
    def costs(self) -> list[int]:
        return [lo.newton_schulz_cost(shape) for shape in self.shapes]

    def runs(self, owners: Sequence[int]) -> list[tuple[int, int]]:
        """``(owner, elements)`` of the weight's elements in flattened order, ``owners[j]``
        owning part ``j``: per query group, each part's rows in split order."""
        return [
            (int(owner), rows * self.hidden)
            for _ in range(self.groups)
            for owner, rows in zip(owners, self.split, strict=True)
        ]


def qkv_parts(spec: ParamSpec, qkv_ownership: str) -> QkvParts | None:
    """The parts ``spec`` is owned as under ``qkv_ownership``, or ``None`` when it is owned whole:
    ownership ``"whole"``, not a Muon ``linear_qkv`` megatron tags for the split (2-D, rows a
    multiple of ``sum(qkv_split)``), or expert-parallel."""
    split = spec.qkv_split
    if qkv_ownership == "whole" or split is None or not spec.muon or spec.expert_parallel:
        return None
    if len(spec.shape) != 2 or spec.shape[0] % sum(split):
        return None
    return QkvParts(spec.shape[0] // sum(split), tuple(split), spec.shape[1])


def unit_costs(spec: ParamSpec, qkv_ownership: str) -> list[int]:
    """Newton-Schulz cost of the matrices Muon runs on for ``spec``: its parts when split, else
    the whole weight."""
    parts = qkv_parts(spec, qkv_ownership)
    return parts.costs if parts is not None else [lo.newton_schulz_cost(spec.shape)]
