"""Muon on a single grouped expert weight orthogonalises each expert's matrix, not the stack.

Behaviour: Transformer Engine 2.20.2's single grouped expert weight (``GroupedLinear`` with
``single_grouped_weight=True``) is ONE parameter, a ``GroupedTensor`` whose wrapper shape is
``(E, out, in)`` (its storage's ``logical_shape`` is the 2-D ``(E*out, in)``). megatron-core 0.19.2
sends only ``len(shape) == 2`` parameters to Muon, so the grouped weight went to Adam -- while the
same experts as discrete ``(out, in)`` weights get Muon -- and with layer-wise Muon + DistOpt the
optimizer build asserts on the expert-parallel Adam group. This patch routes grouped weights (not
TE's grouped *biases*, ``(E, out)``) to Muon / the layer-wise optimizer and makes Muon treat them
as E independent matrices: each expert's slice of the momentum is orthogonalised and scaled on its
own, bitwise what E separate weights get. A grouped weight is owned whole by one rank, or, on
the compact layout with ``grouped_weight_ownership="expert"``/``"auto"``, in runs of experts by
several ranks (:mod:`nemo_lw_fp8.expert_slices`; see ``docs/moe-grouped-weights.md``).

Mirrors the layer-wise Muon side of Megatron-LM PR #5464 (whose numerical fixes megatron-core
0.19.2 already has for Adam's DistributedOptimizer).

Patches: ``megatron.core.optimizer.emerging_optimizers.TensorParallelMuon.orthogonalize``; the
routing rule ``layer_wise_optimizer.is_managed_by_layer_wise_optimizer`` (and its import in
``megatron.core.optimizer``), ``emerging_optimizers._is_nonlinear_or_embedding`` and the
``nonlinear_or_embedding`` predicate of Muon's default param overrides: TE 2.20.2's grouped weight
has wrapper shape ``(E, out, in)`` (3-D), which 0.19.2 counts as "not a matrix" and hands to Adam.

Detection: native when megatron's ``TensorParallelMuon.orthogonalize`` itself splits grouped
tensors (its source mentions grouped members); 0.19.2 splits only fused QKV weights.

A parameter is a grouped weight with E members when it is TE's ``GroupedTensor`` (E =
``num_tensors``) or carries ``nemo_lw_fp8_grouped_members = E`` (CPU expert layers of our own).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .framework import Override, Patch, register

FEATURE = "grouped_weight_layerwise"
MEMBERS_ATTR = "nemo_lw_fp8_grouped_members"


def grouped_members(param: torch.Tensor) -> int:
    """How many expert matrices ``param`` stacks (1 for an ordinary matrix)."""
    members = getattr(param, MEMBERS_ATTR, None)
    if members:
        return int(members)
    try:
        from megatron.core.fp8_utils import _unwrap_parameter_data, is_grouped_tensor
    except ImportError:
        return 1
    if is_grouped_tensor(param):
        return int(getattr(_unwrap_parameter_data(param), "num_tensors", 1) or 1)
    return 1


def is_grouped_weight(param: torch.Tensor) -> bool:
    """A single grouped expert weight: TE ``GroupedTensor`` of 2-D members (wrapper shape
    ``(E, out, in)``), or a 2-D matrix tagged with :data:`MEMBERS_ATTR`."""
    if getattr(param, MEMBERS_ATTR, None):
        return True
    try:
        from megatron.core.fp8_utils import is_grouped_tensor
    except ImportError:
        return False
    return bool(is_grouped_tensor(param)) and param.dim() == 3


def _muon_matrix(param: torch.Tensor) -> bool:
    """Muon's routing rule with grouped weights counted as (stacks of) matrices."""
    if getattr(param, "is_embedding_or_output_parameter", False):
        return False
    if is_grouped_weight(param):
        return True
    return param.dim() == 2 and not _is_grouped_vector(param)


def _is_grouped_vector(param: torch.Tensor) -> bool:
    """TE's single grouped bias: wrapper shape ``(E, out)``, E vectors, not a matrix."""
    try:
        from megatron.core.fp8_utils import is_grouped_tensor
    except ImportError:
        return False
    return bool(is_grouped_tensor(param)) and param.dim() == 2


def _is_nonlinear_or_embedding(param: torch.Tensor) -> bool:
    return not _muon_matrix(param)


def _detect_native() -> tuple[bool, str]:
    from megatron.core.optimizer import layer_wise_optimizer as lw
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from .framework import unpatched_own_attr

    orth = inspect.getsource(unpatched_own_attr(TensorParallelMuon, "orthogonalize"))
    routing = inspect.getsource(unpatched_own_attr(lw, "is_managed_by_layer_wise_optimizer"))
    if "grouped" in orth and "grouped" in routing:
        return True, "megatron routes single grouped weights to Muon and splits them per expert"
    return False, (
        "Muon skips a single grouped expert weight (3-D GroupedTensor -> Adam, which the "
        "layer-wise + DistOpt path refuses for experts) and would orthogonalise it as one stack"
    )


def _make_orthogonalize(original):
    def orthogonalize(self, p: torch.Tensor, grad: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if grad.dim() == 3:
            # Only grouped weights reach Muon as 3-D tensors (see the routing overrides); the
            # optimizer sees their fp32 master, a plain (E, out, in) tensor.
            updates = [original(self, p, member, **kwargs) for member in grad.unbind(0)]
            return torch.stack(updates)
        members = grouped_members(p)
        if members <= 1:
            return original(self, p, grad, **kwargs)
        rows, cols = grad.shape[0], grad.shape[-1]
        if grad.dim() != 2 or rows % members:
            raise RuntimeError(
                f"grouped weight with {members} members has momentum of shape "
                f"{tuple(grad.shape)}: its first dimension must split evenly into members"
            )
        per_expert = grad.view(members, rows // members, cols)
        # One Newton-Schulz per expert, exactly as for separate weights (a batched 3-D run
        # would reorder the arithmetic).
        updates = [original(self, p, member, **kwargs) for member in per_expert]
        return torch.stack(updates).view(grad.shape)

    orthogonalize.__wrapped__ = original
    return orthogonalize


def _is_managed_by_layer_wise_optimizer(param: torch.nn.Parameter) -> bool:
    """megatron's rule (2-D, not embedding/output) plus single grouped expert weights."""
    return _muon_matrix(param)


def _routing_overrides() -> list[Override]:
    """Route grouped weights to Muon / the layer-wise optimizer, as their discrete twins are.

    megatron-core 0.19.2 tests ``len(param.shape) == 2``; TE's grouped weight is 3-D, so it went
    to Adam (and with layer-wise + DistOpt, to an assertion on expert-parallel Adam groups).
    """
    import copy

    import megatron.core.optimizer as optimizer_pkg
    from megatron.core.optimizer import emerging_optimizers as eo
    from megatron.core.optimizer import layer_wise_optimizer as lw
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate

    overrides = [
        Override(lw, "is_managed_by_layer_wise_optimizer", _is_managed_by_layer_wise_optimizer),
        Override(
            optimizer_pkg, "is_managed_by_layer_wise_optimizer", _is_managed_by_layer_wise_optimizer
        ),
        Override(eo, "_is_nonlinear_or_embedding", _is_nonlinear_or_embedding),
    ]
    for name in ("muon", "adaptive_muon"):
        entry = eo._EMERGING_OPTIMIZERS.get(name)
        if entry is None:
            continue
        routed = {}
        for key, value in entry.default_param_overrides.items():
            predicate = getattr(key, "predicate", None)
            if getattr(predicate, "name", None) == "nonlinear_or_embedding":
                fields = {f: getattr(key, f) for f in key.__dataclass_fields__}
                fields["predicate"] = ParamPredicate(
                    name="nonlinear_or_embedding", fn=_is_nonlinear_or_embedding
                )
                key = ParamKey(**fields)
            routed[key] = copy.deepcopy(value)
        overrides.append(Override(entry, "default_param_overrides", routed))
    return overrides


def _build_overrides() -> list[Override]:
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    original = TensorParallelMuon.__dict__["orthogonalize"]
    return [
        Override(TensorParallelMuon, "orthogonalize", _make_orthogonalize(original)),
        *_routing_overrides(),
    ]


PATCH = register(
    Patch(
        name=FEATURE,
        upstream_pr=5464,
        summary=(
            "single grouped expert weights go to Muon (layer-wise), one Newton-Schulz and one "
            "scale per expert"
        ),
        detect_native=_detect_native,
        build_overrides=_build_overrides,
    )
)
