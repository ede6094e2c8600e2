"""The five upstream Megatron-LM changes this plugin tracks, and how to tell if megatron has them.

Each detector looks at the installed megatron-core's *symbols and behaviour-bearing methods*, not
its version string, so a megatron-core that gains a change natively is recognised as such.
A detector returns ``(native, reason)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class UpstreamChange:
    pr: int
    title: str
    #: Name of the plugin patch that brings it when megatron lacks it (None: no patch yet).
    feature: str | None
    detect: Callable[[], tuple[bool, str]]
    #: Issue that delivers the patch, named in reports while it is missing.
    planned_in: str = ""


def _detect_overlap_layerwise_gather() -> tuple[bool, str]:
    from megatron.core.distributed import distributed_data_parallel as ddp_mod
    from megatron.core.distributed import param_and_grad_buffer as buf_mod

    missing = [
        name
        for name, ok in (
            ("_LayerwiseAllGatherHandle", hasattr(buf_mod, "_LayerwiseAllGatherHandle")),
            (
                "_ParamAndGradBucket.set_layerwise_params_list",
                hasattr(buf_mod._ParamAndGradBucket, "set_layerwise_params_list"),
            ),
            (
                "DistributedDataParallel.free_overlap_buffers",
                hasattr(ddp_mod.DistributedDataParallel, "free_overlap_buffers"),
            ),
        )
        if not ok
    ]
    if missing:
        return False, "missing " + ", ".join(missing)
    return True, "layer-wise buckets gather asynchronously through DDP's forward pre-hooks"


def _layerwise_class():
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    return LayerWiseDistributedOptimizer


def _defines(owner: object, name: str) -> bool:
    """Whether ``owner`` itself defines ``name``, ignoring anything a plugin patch installed."""
    from .patches.framework import MISSING, unpatched_own_attr

    return unpatched_own_attr(owner, name) is not MISSING


def _detect_muon_fp8_param_gather() -> tuple[bool, str]:
    from .patches.framework import unpatched_own_attr

    cls = _layerwise_class()
    if not _defines(cls, "_copy_main_params_to_param_buffer"):
        return False, "LayerWiseDistributedOptimizer does not stage masters into the param buffer"
    if not _defines(cls, "prepare_model_params_for_param_sync"):
        return False, "LayerWiseDistributedOptimizer has no prepare_model_params_for_param_sync"
    source = inspect.getsource(unpatched_own_attr(cls, "start_param_sync_for_bucket_group_subset"))
    if "buckets[0]" in source:
        return False, "layer-wise param sync decides ownership from a group's first bucket only"
    return True, "LayerWiseDistributedOptimizer stages and gathers MXFP8 params per bucket"


def _detect_restage_before_forced_sync() -> tuple[bool, str]:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not _defines(DistributedOptimizer, "prepare_model_params_for_param_sync"):
        return False, "DistributedOptimizer has no prepare_model_params_for_param_sync"
    try:
        from megatron.training import training
    except ImportError:
        return True, "DistributedOptimizer re-stages; megatron.training not importable to check"
    params = inspect.signature(training.force_param_sync).parameters
    if "optimizer" not in params:
        return False, "megatron.training.force_param_sync does not take the optimizer"
    return True, "forced param syncs re-stage DistributedOptimizer masters first"


def _detect_single_grouped_weight() -> tuple[bool, str]:
    from megatron.core import fp8_utils
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

    missing = [
        name
        for name, ok in (
            ("fp8_utils.is_grouped_mxfp8tensor", hasattr(fp8_utils, "is_grouped_mxfp8tensor")),
            (
                "fp8_utils.copy_tensor_to_quantized_param",
                hasattr(fp8_utils, "copy_tensor_to_quantized_param"),
            ),
            (
                "DistributedDataParallel.reset_param_sync_dispatch_state",
                hasattr(DistributedDataParallel, "reset_param_sync_dispatch_state"),
            ),
        )
        if not ok
    ]
    if missing:
        return False, "missing " + ", ".join(missing)
    return True, "grouped-weight FP8 numerics and dispatch reset present (Adam DistOpt path)"


def _detect_compact_layout() -> tuple[bool, str]:
    from megatron.core.distributed.distributed_data_parallel_config import (
        DistributedDataParallelConfig,
    )

    fields = getattr(DistributedDataParallelConfig, "__dataclass_fields__", {})
    if "use_layer_wise_param_layout" not in fields:
        return False, "DistributedDataParallelConfig has no per-buffer layer-wise layout setting"
    return True, "DistributedDataParallelConfig carries the decoupled layer-wise layout"


CHANGES: tuple[UpstreamChange, ...] = (
    UpstreamChange(
        3524,
        "overlapped param gather for the layer-wise optimizer",
        None,
        _detect_overlap_layerwise_gather,
        "issue #5 (fewer collectives)",
    ),
    UpstreamChange(
        4987,
        "Muon + MXFP8 FP8 param gather in LayerWise",
        "muon_fp8_param_gather",
        _detect_muon_fp8_param_gather,
        "issue #4",
    ),
    UpstreamChange(
        4994,
        "re-stage masters before every forced param sync",
        "restage_forced_sync",
        _detect_restage_before_forced_sync,
        "issue #4 (extend to the layer-wise optimizer)",
    ),
    UpstreamChange(
        5464,
        "single grouped MoE expert weight numerics",
        "grouped_weight_layerwise",
        _detect_single_grouped_weight,
        "issue #6 (layer-wise Muon side)",
    ),
    UpstreamChange(
        5388,
        "compact, decoupled layer-wise DDP layout",
        "compact_layout",
        _detect_compact_layout,
        "issue #5",
    ),
)


def change(pr: int) -> UpstreamChange:
    for item in CHANGES:
        if item.pr == pr:
            return item
    raise KeyError(f"not a tracked upstream change: #{pr}")
