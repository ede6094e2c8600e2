"""Expert slices: a run of experts of one single grouped weight, owned by one rank.

Why: the layer-wise optimizer owns whole parameters, and a single grouped expert weight (TE's
``GroupedTensor``, wrapper shape ``(E, out, in)``) is ONE parameter holding E matrices, so whole
ownership puts E experts' Newton-Schulz work, fp32 masters and momentum on one rank. Muon treats
the E matrices independently (:mod:`nemo_lw_fp8.mechanics.grouped`), so nothing in the
arithmetic ties them to one owner. An :class:`ExpertSlice` stands in for experts ``[lo, hi)`` of
such a weight inside the optimizer: it is a plain parameter of shape ``(hi - lo, out, in)``
whose data is a view of the experts' bf16 storage (a copy for MXFP8 storage, which cannot be
viewed as bf16) and whose ``main_grad`` is always the matching slice of the grouped weight's
current ``main_grad``. The optimizer builds one fp32 master and one momentum per slice; the
compact layout's gather (:mod:`nemo_lw_fp8.mechanics.compact`) ships each slice's bf16 cast from its
owner and writes it back into the grouped weight, assembling MXFP8 weights whole before
quantizing them, so every rank ends with the same bytes as under whole ownership.

Only 3-D grouped weights are sliced (2-D matrices tagged with a member count stay whole).
"""

from __future__ import annotations

import torch

#: Attributes an expert slice takes from its grouped weight (what megatron's optimizers read:
#: tensor-parallel layout, expert all-reduce flag, sharing, grad-norm group, routing tag).
_COPIED_ATTRS = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "allreduce",
    "shared",
    "sequence_parallel",
    "is_embedding_or_output_parameter",
    "is_managed_by_layer_wise_optimizer",
    "grad_norm_group",
)


def _quantized(param: torch.Tensor) -> bool:
    from megatron.core.distributed.param_and_grad_buffer import _param_uses_quantized_storage

    return bool(_param_uses_quantized_storage(param))


def uses_quantized_storage(param: torch.Tensor) -> bool:
    """Whether ``param`` (for a part of a weight: that weight) has MXFP8 storage."""
    return _quantized(parent_of(param))


def _shape_only(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` that allocates one element: for runs whose values live elsewhere."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def expert_view(grouped: torch.Tensor) -> torch.Tensor | None:
    """The live bf16 storage of a grouped weight as ``(E, out, in)``, or ``None`` when it is
    quantized (MXFP8 storage has no bf16 bytes to view)."""
    if _quantized(grouped):
        return None
    from megatron.core.fp8_utils import _unwrap_parameter_data, is_grouped_tensor

    if is_grouped_tensor(grouped):
        storage = _unwrap_parameter_data(grouped).rowwise_data
        return storage.view(tuple(grouped.shape))
    return grouped.data


class PartOfWeight(torch.nn.Parameter):
    """An optimizer-side stand-in for part of one model weight ``parent``: an
    :class:`ExpertSlice`, or a :class:`~.qkv_parts.QKVPart`."""

    parent: torch.nn.Parameter

    @classmethod
    def _adopt(cls, parent: torch.nn.Parameter, data: torch.Tensor):
        """A new stand-in over ``data`` that takes from ``parent`` what megatron's optimizers
        read (:data:`_COPIED_ATTRS`)."""
        self = torch.Tensor._make_subclass(cls, data, parent.requires_grad)
        self.parent = parent
        for name in _COPIED_ATTRS:
            if hasattr(parent, name):
                setattr(self, name, getattr(parent, name))
        return self


class ExpertSlice(PartOfWeight):
    """Experts ``[lo, hi)`` of the grouped weight ``parent`` (see the module docstring).

    ``materialize=False``: a run another rank owns (every rank knows every run, to place the
    gathered bytes); for MXFP8 storage it then holds no copy, only its shape.
    """

    parent: torch.nn.Parameter
    lo: int
    hi: int

    def __new__(
        cls, parent: torch.nn.Parameter, lo: int, hi: int, materialize: bool = True
    ) -> ExpertSlice:
        if parent.dim() != 3 or not 0 <= lo < hi <= parent.shape[0]:
            raise ValueError(
                f"an expert slice needs a 3-D grouped weight and 0 <= lo < hi <= E; got shape "
                f"{tuple(parent.shape)}, experts [{lo}, {hi})"
            )
        view = expert_view(parent)
        shape = (hi - lo, int(parent.shape[1]), int(parent.shape[2]))
        if view is not None:
            data = view[lo:hi]
        elif not materialize:
            # Another rank's run of MXFP8 experts: only its shape and place are ever read here.
            data = _shape_only(shape, torch.bfloat16, parent.device)
        else:
            # MXFP8 storage: a bf16 copy of the dequantized experts, read once when the optimizer
            # builds the fp32 master (which TE's preserved init value then overwrites).
            with torch.no_grad():
                data = parent.detach().dequantize()[lo:hi].to(torch.bfloat16).contiguous()
        self = cls._adopt(parent, data)
        self.lo, self.hi = lo, hi
        return self

    @property
    def expert_numel(self) -> int:
        return int(self.parent.shape[1]) * int(self.parent.shape[2])

    @property
    def flat_range(self) -> tuple[int, int]:
        """Where this slice's elements lie in the grouped weight, flattened."""
        return self.lo * self.expert_numel, self.hi * self.expert_numel

    @property
    def main_grad(self) -> torch.Tensor:
        """The matching slice of the grouped weight's ``main_grad`` (looked up every time, so a
        buffer the DDP wrapper re-points is followed)."""
        start, end = self.flat_range
        return self.parent.main_grad.reshape(-1)[start:end].view(tuple(self.shape))

    @property
    def quantized_parent(self) -> bool:
        return _quantized(self.parent)

    def __repr__(self) -> str:
        return f"ExpertSlice(experts [{self.lo}, {self.hi}) of {tuple(self.parent.shape)})"

    def __reduce_ex__(self, protocol):  # an optimizer-side stand-in is never pickled
        raise TypeError("ExpertSlice is an optimizer-side view and is not serialisable")


def parent_of(param: torch.Tensor) -> torch.Tensor:
    """The model parameter ``param`` stands for: the weight an expert slice or QKV part is
    part of, else ``param`` itself."""
    return param.parent if isinstance(param, PartOfWeight) else param


def is_part_of_weight(param: torch.Tensor) -> bool:
    """Whether ``param`` stands for part of a model weight (an expert slice or a QKV part)."""
    return isinstance(param, PartOfWeight)


def is_slice(param: torch.Tensor) -> bool:
    return isinstance(param, ExpertSlice)


def slice_init_value(piece: ExpertSlice, value: torch.Tensor) -> torch.Tensor:
    """The slice of a grouped weight's preserved high-precision init value."""
    return value.reshape(tuple(piece.parent.shape))[piece.lo : piece.hi]


def release_copy(piece: ExpertSlice) -> None:
    """Drop the owner's bf16 copy of MXFP8 experts once their master exists (the copy is read
    only to build it; :func:`model_values` serves every later read)."""
    if piece.quantized_parent:
        piece.data = _shape_only(tuple(piece.shape), piece.dtype, piece.device)


def model_values(piece: ExpertSlice) -> torch.Tensor:
    """The experts' current values as the model holds them (dequantized for MXFP8 storage):
    what megatron's ``reload_model_params`` copies into a master."""
    if piece.quantized_parent:
        return piece.parent.detach().dequantize()[piece.lo : piece.hi]
    return piece.data

