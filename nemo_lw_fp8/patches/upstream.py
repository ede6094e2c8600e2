"""Upstream Megatron-LM changes the plugin tracks that need no patch of its own.

Each patch module records the upstream change it mirrors (``Patch.upstream_pr``,
``upstream_title``); ``nemo-lw-fp8 doctor`` reads them from the patch registry. This module adds
the changes that the installed megatron-core must simply have, so ``doctor`` reports them too:
a detector looks at which symbols megatron defines (never its version string, never a word in
its source) and returns ``(native, reason)``, through :mod:`nemo_lw_fp8.patches.symbols`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nemo_lw_fp8.patches import symbols


@dataclass(frozen=True)
class TrackedChange:
    pr: int
    title: str
    detect: Callable[[], tuple[bool, str]]


def _detect_overlap_layerwise_gather() -> tuple[bool, str]:
    buffers = symbols.module("megatron.core.distributed.param_and_grad_buffer")
    ddp = symbols.module("megatron.core.distributed.distributed_data_parallel")
    found = {
        name: module.has(name)
        for module, name in (
            (buffers, "_LayerwiseAllGatherHandle"),
            (buffers, "_ParamAndGradBucket.set_layerwise_params_list"),
            (ddp, "DistributedDataParallel.free_overlap_buffers"),
        )
    }
    return symbols.all_defined(
        found, "layer-wise buckets gather asynchronously through DDP's forward pre-hooks"
    )


#: Changes megatron-core must have natively (the plugin builds on them; a Bridge-side patch may
#: wire them where Bridge does not, e.g. ``bridge_layer_wise_wrap`` for #3524).
TRACKED_WITHOUT_PATCH: tuple[TrackedChange, ...] = (
    TrackedChange(
        3524,
        "overlapped param gather for the layer-wise optimizer",
        _detect_overlap_layerwise_gather,
    ),
)


def megatron_core_changes() -> dict[
    int, tuple[str, Callable[[], tuple[bool, str]] | None, object]
]:
    """Every tracked megatron-core change: ``pr -> (title, upstream detector or None, patch)``.

    A change without a patch has its detector (does megatron-core have it?); a patch's change
    has its ``detect_upstream_part`` where upstream landed part of it (for ``doctor``'s note),
    else None: whether the patch applies is its verdict (:func:`.verdict.decide`).
    """
    from nemo_lw_fp8 import patches

    patches.load_all()
    changes: dict[int, tuple[str, Callable[[], tuple[bool, str]] | None, object]] = {
        item.pr: (item.title, item.detect, None) for item in TRACKED_WITHOUT_PATCH
    }
    for patch in patches.registry().values():
        if patch.upstream_pr and patch.target == "megatron-core":
            changes[patch.upstream_pr] = (patch.upstream_title, patch.detect_upstream_part, patch)
    return dict(sorted(changes.items()))
