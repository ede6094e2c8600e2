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
from collections.abc import Callable

from nemo_lw_fp8.patches.bridge_support import bridge_detector, register_bridge_patch, wrap_own
from nemo_lw_fp8.patches.framework import Override

FEATURE = "bridge_config_guards"
_CONFIG_MODULE = "megatron.bridge.training.config"


@bridge_detector(_CONFIG_MODULE)  # the module whose import says Bridge is in use
def _detect_native(_source: Callable[[str], str]) -> tuple[bool, str]:
    return False, "Bridge does not know the plugin's rules"


def _make_validate(original):
    def validate(self) -> None:
        original(self)
        from nemo_lw_fp8.bridge import finalize

        finalize(self)

    validate.__wrapped__ = original  # type: ignore[attr-defined]
    return validate


def _build_overrides() -> list[Override]:
    return [wrap_own(sys.modules[_CONFIG_MODULE].ConfigContainer, "validate", _make_validate)]


PATCH = register_bridge_patch(
    FEATURE,
    "plugin rules run in Megatron-Bridge's ConfigContainer.validate",
    _detect_native,
    _build_overrides,
)
