"""Upstream Megatron-LM changes the plugin tracks that need no patch of its own.

Each patch module records the upstream change it mirrors (``Patch.upstream_pr``,
``upstream_title``) and owns its detector; ``nemo-lw-fp8 doctor`` reads them from the patch
registry. This module adds the changes that the installed megatron-core must simply have, so
``doctor`` reports them too: a detector looks at megatron's symbols, never its version string,
and returns ``(native, reason)``; it reads them through :mod:`nemo_lw_fp8.patches.symbols`, so
``doctor`` answers without importing megatron-core.
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


def megatron_core_changes() -> dict[int, tuple[str, Callable[[], tuple[bool, str]], object]]:
    """Every tracked megatron-core change: ``pr -> (title, detector, patch or None)``.

    The detector answers whether upstream has the change as far as it lands upstream (for a
    patch that extends an upstream change to the layer-wise optimizer: the upstream part).
    """
    from nemo_lw_fp8 import patches

    patches.load_all()
    changes: dict[int, tuple[str, Callable[[], tuple[bool, str]], object]] = {
        item.pr: (item.title, item.detect, None) for item in TRACKED_WITHOUT_PATCH
    }
    for patch in patches.registry().values():
        if patch.upstream_pr and patch.target == "megatron-core":
            detect = patch.detect_upstream_part or patch.detect_native
            changes[patch.upstream_pr] = (patch.upstream_title, detect, patch)
    return dict(sorted(changes.items()))


def detect(pr: int) -> tuple[bool, str]:
    """Whether the installed megatron-core has upstream change ``pr`` (its upstream part)."""
    changes = megatron_core_changes()
    if pr not in changes:
        raise KeyError(f"not a tracked upstream change: #{pr}")
    return changes[pr][1]()
