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
several ranks (:mod:`nemo_lw_fp8.mechanics.expert_slices`; see ``docs/moe-grouped-weights.md``).

Mirrors the layer-wise Muon side of Megatron-LM PR #5464 (whose numerical fixes megatron-core
0.19.2 already has for Adam's DistributedOptimizer).

Patches: ``megatron.core.optimizer.emerging_optimizers.TensorParallelMuon.orthogonalize``; the
routing rule ``layer_wise_optimizer.is_managed_by_layer_wise_optimizer`` (and its import in
``megatron.core.optimizer``), ``emerging_optimizers._is_nonlinear_or_embedding`` and the
exclusion predicate of Muon's default param overrides (``nonlinear_or_embedding`` on 0.19.x,
renamed ``muon_excluded`` on 0.20, which also excludes ``use_muon=False`` params; replaced under
the name the installed line uses): TE 2.20.2's grouped weight has wrapper shape ``(E, out, in)``
(3-D), which 0.19.2 counts as "not a matrix" and hands to Adam.

Verdict: the record's (``patches/record.py``). ``doctor`` also notes whether #5464's Adam part
is there (megatron's grouped-weight FP8 helpers and dispatch reset).

The mechanics (what a grouped weight is, Muon per expert): :mod:`nemo_lw_fp8.mechanics.grouped`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from nemo_lw_fp8.mechanics import grouped
from nemo_lw_fp8.patches import symbols
from nemo_lw_fp8.patches.framework import Override, Patch, defines, original, register
from nemo_lw_fp8.patches.record import UpstreamChanged

FEATURE = "grouped_weight_layerwise"


def _detect_upstream_part() -> tuple[bool, str]:
    """#5464's numerics for Adam's DistributedOptimizer (what 0.19.2 already has)."""
    fp8_utils = symbols.module("megatron.core.fp8_utils")
    ddp = symbols.module("megatron.core.distributed.distributed_data_parallel")
    reset = "DistributedDataParallel.reset_param_sync_dispatch_state"
    found = {
        f"fp8_utils.{name}": fp8_utils.has(name)
        for name in ("is_grouped_mxfp8tensor", "copy_tensor_to_quantized_param")
    }
    found[reset] = ddp.has(reset)
    return symbols.all_defined(
        found, "grouped-weight FP8 numerics and dispatch reset present (Adam DistOpt path)"
    )


def _make_orthogonalize(original):
    def orthogonalize(self, p: torch.Tensor, grad: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return grouped.orthogonalize_per_expert(original, self, p, grad, **kwargs)

    orthogonalize.__wrapped__ = original
    return orthogonalize


def _is_managed_by_layer_wise_optimizer(param: torch.nn.Parameter) -> bool:
    """megatron's rule (2-D, not embedding/output) plus single grouped expert weights."""
    return grouped.is_muon_matrix(param)


def _is_nonlinear_or_embedding(param: torch.Tensor) -> bool:
    return grouped.is_nonlinear_or_embedding(param)


def _is_muon_excluded(param: torch.Tensor) -> bool:
    return grouped.is_muon_excluded(param)


def _exclusion_predicates(eo: Any) -> dict[str, tuple[Any, Any]]:
    """Muon's "send to the scalar optimizer" predicate under the name each megatron line gives
    it: name -> (the line's own function, ours). 0.19.x names it ``nonlinear_or_embedding``;
    0.20 names it ``muon_excluded`` (the same test, or a param tagged ``use_muon=False``)."""
    found = {
        "nonlinear_or_embedding": (
            original(eo, "_is_nonlinear_or_embedding"),
            _is_nonlinear_or_embedding,
        )
    }
    if defines(eo, "_is_muon_excluded"):
        found["muon_excluded"] = (original(eo, "_is_muon_excluded"), _is_muon_excluded)
    return found


def _routing_overrides() -> list[Override]:
    """Route grouped weights to Muon / the layer-wise optimizer, as their discrete twins are.

    megatron-core 0.19.2 tests ``len(param.shape) == 2``; TE's grouped weight is 3-D, so it went
    to Adam (and with layer-wise + DistOpt, to an assertion on expert-parallel Adam groups).
    """
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
    exclusions = _exclusion_predicates(eo)
    for name in ("muon", "adaptive_muon"):
        entry = eo._EMERGING_OPTIMIZERS.get(name)
        if entry is None:
            continue
        routed, replaced = {}, 0
        for key, value in original(entry, "default_param_overrides").items():
            predicate = getattr(key, "predicate", None)
            upstream, ours = exclusions.get(getattr(predicate, "name", None), (None, None))
            # The line's own predicate only (its name and its function), kept under its name:
            # the registry's other entries and a user's own predicates stay as they are.
            if ours is not None and getattr(predicate, "fn", None) is upstream:
                fields = {f: getattr(key, f) for f in key.__dataclass_fields__}
                fields["predicate"] = ParamPredicate(name=predicate.name, fn=ours)
                key = ParamKey(**fields)
                replaced += 1
            routed[key] = copy.deepcopy(value)
        owner = f"{eo.__name__}._EMERGING_OPTIMIZERS[{name!r}]"
        if not replaced:
            # Even under the override: applying would leave grouped weights on the scalar
            # optimizer, a feature switched off without a word.
            target = f"{owner}.default_param_overrides"
            raise UpstreamChanged(
                f"nemo_lw_fp8 patch {FEATURE!r}: {target} holds none of the exclusion "
                f"predicates it follows ({sorted(exclusions)}), so single grouped expert "
                "weights would still go to the scalar optimizer: megatron renamed or replaced "
                "the predicate; install a supported release (docs/install.md, supported lines).",
                (target,),
            )
        overrides.append(Override(entry, "default_param_overrides", routed, owner_name=owner))
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
        upstream_title="single grouped MoE expert weight numerics",
        summary=(
            "single grouped expert weights go to Muon (layer-wise), one Newton-Schulz and one "
            "scale per expert"
        ),
        detect_upstream_part=_detect_upstream_part,
        build_overrides=_build_overrides,
    )
)
