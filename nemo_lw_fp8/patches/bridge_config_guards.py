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

Verdict: the record's (``patches/record.py``): applied over every recorded build, checked by the
fingerprint of each object it wraps; never decided by reading upstream's source.
"""

from __future__ import annotations

from nemo_lw_fp8.patches.bridge_support import bridge_module, register_bridge_patch, wrap_own
from nemo_lw_fp8.patches.framework import Override

FEATURE = "bridge_config_guards"
_CONFIG_MODULE = "megatron.bridge.training.config"


def _make_validate(original):
    def validate(self) -> None:
        original(self)
        from nemo_lw_fp8.bridge import finalize

        finalize(self)

    validate.__wrapped__ = original  # type: ignore[attr-defined]
    return validate


def _build_overrides() -> list[Override]:
    return [wrap_own(bridge_module(_CONFIG_MODULE).ConfigContainer, "validate", _make_validate)]


PATCH = register_bridge_patch(
    FEATURE,
    "plugin rules run in Megatron-Bridge's ConfigContainer.validate",
    _build_overrides,
)
