"""Patch modules for the installed megatron-core, one module per behaviour.

Each module opens with a docstring: the behaviour it brings, the upstream change it mirrors (by
PR number), what it patches, and that its verdict is the record's (:mod:`.record`). A patch
module is wiring: the overrides it installs call the mechanisms in
:mod:`nemo_lw_fp8.mechanics`, and no patch module imports another (a patch that needs another
names it in ``requires``). Modules register a :class:`~nemo_lw_fp8.patches.framework.Patch` when
they are imported; :data:`PATCH_MODULES` lists them so :func:`load_all` can import every one.
"""

from __future__ import annotations

import importlib

from nemo_lw_fp8.patches.framework import (
    ALLOW_UNTESTED_ENV,
    LateApplyWarning,
    Override,
    Patch,
    UntestedMegatronVersion,
    UntestedUpstreamWarning,
    UpstreamChanged,
    Verdict,
    applied,
    apply,
    original,
    register,
    registry,
    revert,
    verdicts,
)

#: Patch modules shipped with the plugin (imported lazily: they import megatron-core).
PATCH_MODULES: tuple[str, ...] = (
    "layer_wise_init",
    "muon_fp8_param_gather",
    "restage_forced_sync",
    "compact_layout",
    "grouped_weight_layerwise",
    "te_grouped_checkpoint",
    "blockwise_fp8_param_gather",
    "mla_local_attention",
    "bridge_layer_wise_wrap",
    "bridge_config_guards",
    "bridge_checkpoint_sharding",
    "bridge_save_param_sync",
    "bridge_checkpoint_compat",
    "bridge_checkpoint_rng",
    "layer_wise_load_rederive",
    "pretrained_load_masters",
)


def load_all() -> None:
    """Import every patch module so its patch is registered."""
    for module in PATCH_MODULES:
        importlib.import_module(f"{__name__}.{module}")


__all__ = [
    "ALLOW_UNTESTED_ENV",
    "LateApplyWarning",
    "Override",
    "PATCH_MODULES",
    "Patch",
    "UntestedMegatronVersion",
    "UntestedUpstreamWarning",
    "UpstreamChanged",
    "Verdict",
    "applied",
    "apply",
    "load_all",
    "original",
    "register",
    "registry",
    "revert",
    "verdicts",
]
