"""What the plugin remembers on megatron's own objects: one record per object, every field named.

Why: patched methods run on megatron's optimizers, DDP chunks and bucket groups, and need to keep
a little of their own state there (an optimizer's ownership, a chunk's optimizers to re-stage, a
bucket group's gather plan). Each such object carries ONE record under :data:`STATE_ATTR`, and
the record types below are the whole protocol: a reader finds every field the plugin keeps, what
writes it and what reads it, in one place. Records live in the object's ``__dict__`` (never a
class attribute, never megatron's own fields) and go away with the object.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

#: The one attribute name the plugin sets on megatron objects.
STATE_ATTR = "_nemo_lw_fp8"


@dataclass
class OptimizerState:
    """On a ``LayerWiseDistributedOptimizer`` (and, for ``unstaged``, a DistributedOptimizer)."""

    #: The DDP chunks handed to ``__init__`` (megatron stores them only after ``shard_params``,
    #: which the compact layout needs them for).
    model_chunks: list[Any] | None = None
    #: param -> (bucket, start, end) of its slot in the bucket's ``param_data`` (staging).
    param_slots: dict[torch.Tensor, tuple[Any, int, int]] | None = None
    #: True when the optimizer's last step left its new masters unstaged (set by the step that
    #: defers staging to the training loop, cleared by every staging).
    unstaged: bool = False
    #: Compact layout: model parameter -> what its owners update (the parameter itself, or
    #: expert slices of a single grouped weight), for every rank's params.
    pieces: dict[torch.Tensor, list[torch.Tensor]] = field(default_factory=dict)
    #: Compact layout: piece -> the data-parallel rank that owns it.
    owner_of: dict[torch.Tensor, int] = field(default_factory=dict)
    #: True once the masters of quantized weights follow model loads (the load hooks and the
    #: ``reload_model_params`` wrapper of :mod:`nemo_lw_fp8.mechanics.pretrained_load` are in
    #: place).
    follows_model_loads: bool = False
    #: id of a quantized model weight -> the high-precision value a model load just quantized
    #: into it (its nominal dtype), kept until the masters are rebuilt. Keyed by id, not on the
    #: weight: a load may ``swap_tensors`` the weight, which moves its ``__dict__`` away and
    #: refuses weights that have weak references.
    loaded_values: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class ChunkState:
    """On a megatron ``DistributedDataParallel`` chunk."""

    #: Layer-wise optimizers that stage into this chunk's buffers (re-staged after a zero).
    restagers: list[weakref.ref] = field(default_factory=list)
    #: DistributedOptimizers whose steps left staging to the training loop.
    deferred_stagers: list[weakref.ref] = field(default_factory=list)

    def optimizers(self) -> list[Any]:
        """Every live optimizer registered on the chunk, restagers first."""
        found = [ref() for ref in (*self.restagers, *self.deferred_stagers)]
        return [optimizer for optimizer in found if optimizer is not None]


@dataclass
class BucketGroupState:
    """On a megatron ``_ParamAndGradBucketGroup`` gathered by one of the plugin's collectives."""

    #: The compact layout's gather plan (:class:`nemo_lw_fp8.mechanics.compact.CompactGroup`).
    compact: Any = None
    #: The blockwise FP8 gather plan (:class:`nemo_lw_fp8.mechanics.blockwise.BlockwiseGroup`);
    #: when set it takes over from the compact plan.
    blockwise: Any = None
    #: The output buffer of a gather in flight, unpacked when it finishes.
    pending: torch.Tensor | None = None


def _record[S: (OptimizerState, ChunkState, BucketGroupState)](obj: Any, kind: type[S]) -> S:
    record = obj.__dict__.get(STATE_ATTR)
    if record is None:
        record = kind()
        obj.__dict__[STATE_ATTR] = record
    elif not isinstance(record, kind):
        raise TypeError(f"{type(obj).__name__} carries a {type(record).__name__}, not a {kind}")
    return record


def optimizer_state(optimizer: Any) -> OptimizerState:
    return _record(optimizer, OptimizerState)


def chunk_state(chunk: Any) -> ChunkState:
    return _record(chunk, ChunkState)


def group_state(group: Any) -> BucketGroupState:
    return _record(group, BucketGroupState)


def peek(obj: Any) -> Any:
    """The record ``obj`` carries, or ``None`` (never creates one)."""
    return obj.__dict__.get(STATE_ATTR)


def add_weak(refs: list[weakref.ref], obj: Any) -> None:
    """Append a weak reference to ``obj`` unless one is there already."""
    if all(ref() is not obj for ref in refs):
        refs.append(weakref.ref(obj))
