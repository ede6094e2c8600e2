"""QKV parts: the query, key or value rows of one fused ``linear_qkv`` weight, owned apart.

Why: megatron-core 0.19.2's Muon (``muon_split_qkv=True``, its default) already orthogonalizes a
``linear_qkv`` weight as separate matrices: it views the weight as ``(query groups, rows per
group, hidden)``, takes part ``j`` as rows ``[offset_j, offset_j + rows_j)`` of every group
(``param.qkv_split_shapes``: Q, K, V, or Q, gate, K, V), runs Newton-Schulz on each part
reshaped to ``(groups x rows_j, hidden)`` and writes the results back. Every other step of the
update is elementwise. So the parts can be owned by different ranks with the same bits, which
matters for the owner reduce: at whole-matrix ownership a rank that owns no large matrix sends
all of every gradient (``P / (P - 1)`` of an exact reduce-scatter); the small K and V parts give
such ranks something to own.

A :class:`QKVPart` stands in for one part inside the optimizer: a plain 2-D parameter of shape
``(groups x rows_j, hidden)``. Its rows are not contiguous in the fused weight, so its ``data``
is a copy, read once when the optimizer builds the fp32 master and then released; later reads of
the model's values go through :func:`model_values`, and ``main_grad`` is gathered from the fused
weight's current gradient each time it is read. The compact gather ships each part's bf16 cast
from its owner and writes it back into the fused weight's rows (an MXFP8 weight is assembled
whole first and quantized once), so every rank ends with the bytes whole ownership gives.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch

from nemo_lw_fp8.mechanics.expert_slices import PartOfWeight, _quantized, _shape_only


def split_shapes(param: torch.Tensor) -> list[int] | None:
    """The rows per query group of each part of a weight megatron tagged as fused QKV."""
    if not getattr(param, "is_qkv", False) or param.dim() != 2:
        return None
    shapes = getattr(param, "qkv_split_shapes", None)
    if not shapes or int(param.shape[0]) % sum(shapes):
        return None
    return [int(s) for s in shapes]


def part_shapes(param: torch.Tensor) -> list[tuple[int, int]]:
    """Shapes of the matrices Muon orthogonalizes for ``param`` when it splits QKV."""
    shapes = split_shapes(param)
    if shapes is None:
        return [tuple(param.shape)]  # type: ignore[list-item]
    groups = int(param.shape[0]) // sum(shapes)
    return [(groups * rows, int(param.shape[1])) for rows in shapes]


def parts_of(tensor: torch.Tensor, shapes: list[int]) -> list[torch.Tensor]:
    """A tensor shaped like a fused QKV weight (rows per group ``shapes``), cut into its parts as
    Muon orthogonalizes them: each ``(groups x rows, hidden)``, in split order."""
    hidden = tensor.shape[-1]
    grouped = tensor.reshape(-1, sum(shapes), hidden)
    starts = [sum(shapes[:j]) for j in range(len(shapes))]
    return [
        grouped[:, lo : lo + rows].reshape(-1, hidden)
        for lo, rows in zip(starts, shapes, strict=True)
    ]


def _current_values(parent: torch.Tensor) -> torch.Tensor:
    """The fused weight's values as bf16 rows (dequantized for MXFP8 storage)."""
    if _quantized(parent):
        return parent.detach().dequantize().to(torch.bfloat16)
    return parent.detach()


class QKVPart(PartOfWeight):
    """Part ``index`` (Q, K, V, ...) of the fused QKV weight ``parent`` (module docstring).

    ``materialize=False``: a part another rank owns (every rank knows every part, to place the
    gathered bytes); it holds only its shape.
    """

    parent: torch.nn.Parameter
    index: int
    groups: int
    group_rows: int
    row_offset: int
    rows: int

    def __new__(
        cls, parent: torch.nn.Parameter, index: int, materialize: bool = True
    ) -> QKVPart:
        shapes = split_shapes(parent)
        if shapes is None or not 0 <= index < len(shapes):
            raise ValueError(
                f"a QKV part needs a weight megatron tagged is_qkv with qkv_split_shapes and a "
                f"part index inside them; got shape {tuple(parent.shape)}, part {index}"
            )
        group_rows = sum(shapes)
        groups = int(parent.shape[0]) // group_rows
        hidden = int(parent.shape[1])
        row_offset, rows = sum(shapes[:index]), shapes[index]
        shape = (groups * rows, hidden)
        if materialize:
            with torch.no_grad():
                values = _current_values(parent).view(groups, group_rows, hidden)
                data = values[:, row_offset : row_offset + rows].reshape(shape).clone()
        else:
            data = _shape_only(shape, torch.bfloat16, parent.device)
        self = cls._adopt(parent, data)
        self.index = index
        self.groups, self.group_rows, self.row_offset, self.rows = (
            groups, group_rows, row_offset, rows
        )  # fmt: skip
        return self

    @property
    def hidden(self) -> int:
        return int(self.parent.shape[1])

    @property
    def flat_ranges(self) -> list[tuple[int, int]]:
        """Where this part's elements lie in the fused weight, flattened: one run per group."""
        per_group = self.group_rows * self.hidden
        first = self.row_offset * self.hidden
        length = self.rows * self.hidden
        return [(g * per_group + first, g * per_group + first + length)
                for g in range(self.groups)]  # fmt: skip

    def rows_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part's rows of a tensor shaped like the fused weight, as ``(groups, rows,
        hidden)`` (a strided view)."""
        grouped = tensor.reshape(self.groups, self.group_rows, self.hidden)
        return grouped[:, self.row_offset : self.row_offset + self.rows]

    @property
    def main_grad(self) -> torch.Tensor:
        """This part's rows of the fused weight's current ``main_grad``, as a contiguous copy
        (read-only: megatron copies it into the master's ``.grad``)."""
        return self.rows_of(self.parent.main_grad).reshape(tuple(self.shape))

    @property
    def quantized_parent(self) -> bool:
        return _quantized(self.parent)

    def __repr__(self) -> str:
        return (
            f"QKVPart({self.index} of {tuple(self.parent.shape)}: rows "
            f"[{self.row_offset}, {self.row_offset + self.rows}) of {self.groups} groups)"
        )

    def __reduce_ex__(self, protocol):  # an optimizer-side stand-in is never pickled
        raise TypeError("QKVPart is an optimizer-side view and is not serialisable")


def is_part(param: torch.Tensor) -> bool:
    return isinstance(param, QKVPart)


def init_value(part: QKVPart, value: torch.Tensor) -> torch.Tensor:
    """This part's rows of the fused weight's preserved high-precision init value."""
    return part.rows_of(value.reshape(tuple(part.parent.shape))).reshape(tuple(part.shape))


def release_copy(part: QKVPart) -> None:
    """Drop the owner's bf16 copy of an MXFP8 weight's rows once its master exists
    (:func:`model_values` serves every later read). A bf16 weight's part keeps its copy: the
    inner step writes the master's cast there (the gather then writes the fused weight)."""
    if part.quantized_parent:
        part.data = _shape_only(tuple(part.shape), part.dtype, part.device)


def model_values(part: QKVPart) -> torch.Tensor:
    """The part's current values as the model holds them: what ``reload_model_params`` copies
    into its master."""
    return part.rows_of(_current_values(part.parent)).reshape(tuple(part.shape))


def write_back(part: QKVPart, target: torch.Tensor, values: torch.Tensor) -> None:
    """Write the part's ``values`` (flat) into its rows of ``target`` (shaped like, or a flat
    copy of, the fused weight)."""
    part.rows_of(target).copy_(values.view(part.groups, part.rows, part.hidden))


# --------------------------------------------------------------------------- checkpoint entries
#
# megatron's optimizers find a parameter's checkpoint entry by identity (``id(entry.data) ==
# id(param)``), so a part has none of its own. Each part gets a ``ShardedTensorFactory`` whose
# ``data`` is the part (megatron re-keys it and swaps in the fp32 master or Muon momentum):
# building it gives one piece of the fused weight's own tensor per query group (the part's rows
# of that group, a row range of the weight's local chunk), at the weight's key, on an irregular
# grid (``axis_fragmentations=None``: megatron-core 0.19.2 hands such entries to PyTorch's
# distributed checkpoint, which matches pieces by offset, so state saved under one ownership
# loads under the other).


@dataclass(frozen=True)
class PartGeometry:
    """Where one part's rows lie in the fused weight's local chunk."""

    groups: int
    group_rows: int
    row_offset: int
    rows: int
    hidden: int

    @classmethod
    def of(cls, part: QKVPart) -> PartGeometry:
        return cls(part.groups, part.group_rows, part.row_offset, part.rows, part.hidden)


def _build(template: Any, geometry: PartGeometry, key, data, replica_id, flattened_range):
    if flattened_range is not None:
        raise ValueError("a QKV part's entry is not written flattened")
    g = geometry
    values = data.reshape(g.groups, g.rows, g.hidden)
    # Prepended axes (e.g. the layer of a stacked key) become singleton local axes: megatron
    # hands irregular pieces to PyTorch's checkpoint only without prepended axes.
    prepend = template.prepend_axis_num
    row_axis = prepend  # the local chunk's rows in the global tensor
    lead = (1,) * prepend
    out = {}
    for group in range(g.groups):
        offset = list(template.global_offset)
        offset[row_axis] += group * g.group_rows + g.row_offset
        out[group] = replace(
            template,
            key=key,
            data=values[group].view(*lead, g.rows, g.hidden),
            dtype=data.dtype,
            local_shape=(*lead, g.rows, g.hidden),
            global_offset=tuple(offset),
            axis_fragmentations=None,
            prepend_axis_num=0,
            replica_id=replica_id,
        )
    return out


def _merge(geometry: PartGeometry, loaded: dict) -> torch.Tensor:
    g = geometry
    return torch.stack(
        [loaded[group].reshape(g.rows, g.hidden) for group in sorted(loaded)]
    ).reshape(g.groups * g.rows, g.hidden)


def part_entry(whole: Any, part: QKVPart) -> Any:
    """The checkpoint entry of ``part``, built from its fused weight's entry ``whole``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    geometry = PartGeometry.of(part)
    return ShardedTensorFactory(
        key=whole.key,
        data=part,
        build_fn=functools.partial(_build, whole.without_data(), geometry),
        merge_fn=functools.partial(_merge, geometry),
        replica_id=whole.replica_id,
    )


def part_entries(model_sharded_state_dict: Any, params: list[torch.Tensor]) -> dict[str, Any]:
    """Entries for the QKV parts among ``params`` (an optimizer's parameters)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    parts = [p for p in params if is_part(p)]
    if not parts:
        return {}
    by_weight = {
        id(entry.data): entry
        for entry in nested_values(model_sharded_state_dict)
        if isinstance(entry, ShardedTensor) and entry.data is not None
    }
    out = {}
    for index, part in enumerate(parts):
        whole = by_weight.get(id(part.parent))
        if whole is None or whole.flattened_range is not None:
            raise RuntimeError(
                f"{part!r}: the model's sharded state dict has no plain entry for its fused QKV "
                "weight, so its optimizer state has nowhere to go. Fix: "
                "optimizer.qkv_ownership='whole'."
            )
        if tuple(whole.local_shape) != tuple(part.parent.shape):
            raise RuntimeError(
                f"{part!r}: the fused weight's entry has local shape {whole.local_shape}, not "
                f"the weight's {tuple(part.parent.shape)}. Fix: optimizer.qkv_ownership='whole'."
            )
        out[f"qkv_part_{index}"] = part_entry(whole, part)
    return out
