"""The plugin's rules run whenever Megatron-Bridge validates a ``ConfigContainer``.

Behaviour: Bridge's ``pretrain`` finalises its config (mixed-precision preset copied onto the
model, DDP and optimizer configs, then ``ConfigContainer.validate()``) before anything is built.
With this patch, a config whose optimizer is the plugin's ``LayerWiseMuonConfig`` is then passed
to :func:`nemo_lw_fp8.bridge.finalize`: every rule of :mod:`nemo_lw_fp8.rules` is checked on the
whole container (an unsupported combination fails here, naming the flag and the fix, before a
model exists) and the layer-wise layout is handed to the DDP config. Other configs are untouched.

Mirrors: no upstream change (the plugin's own configuration-time checks; the MXFP8 part of them
mirrors the checks of Megatron-LM PR #4987 in megatron-training's ``validate_args``).

Patches: ``megatron.bridge.training.config.ConfigContainer.validate`` (wrapped).

Detection: only when Megatron-Bridge has been imported (this never imports it); never native.
"""

from __future__ import annotations

import sys

from nemo_lw_fp8.patches.framework import Override, Patch, register

FEATURE = "bridge_config_guards"
_CONFIG_MODULE = "megatron.bridge.training.config"


def _detect_native() -> tuple[bool, str]:
    if _CONFIG_MODULE not in sys.modules:
        return True, "Megatron-Bridge not imported: nothing to patch"
    return False, "Bridge does not know the plugin's rules"


def _make_validate(original):
    def validate(self) -> None:
        original(self)
        from nemo_lw_fp8.bridge import finalize

        finalize(self)

    validate.__wrapped__ = original  # type: ignore[attr-defined]
    return validate


def _build_overrides() -> list[Override]:
    container = sys.modules[_CONFIG_MODULE].ConfigContainer
    return [Override(container, "validate", _make_validate(container.__dict__["validate"]))]


PATCH = register(
    Patch(
        name=FEATURE,
        upstream_pr=0,
        summary="plugin rules run in Megatron-Bridge's ConfigContainer.validate",
        detect_native=_detect_native,
        build_overrides=_build_overrides,
        target="megatron-bridge",
        tested_versions=("0.6.2",),
    )
)
