"""nemo_lw_fp8: layer-wise Muon with FP8 parameter all-gather for megatron-core.

Public entry points::

    import nemo_lw_fp8
    nemo_lw_fp8.apply()            # patch the installed megatron-core (before building models)
    nemo_lw_fp8.applied()          # which patches are active
    nemo_lw_fp8.revert()           # put every original object back

Importing this package does not import megatron-core; :func:`apply` does. It does hide an
incompatible NVRx's async checkpointing from megatron (:mod:`nemo_lw_fp8.compat`).
"""

from __future__ import annotations

from collections.abc import Iterable

__version__ = "0.1.0"

from .compat import hide_old_nvrx_async_checkpointing as _hide_old_nvrx

# Must run before megatron.core is imported (see nemo_lw_fp8/compat.py); a no-op unless an
# NVRx older than 0.6 is installed.
_hide_old_nvrx()


def apply(features: Iterable[str] | None = None, *, allow_untested: bool = False) -> dict[str, str]:
    """Apply the plugin's patches to megatron-core (all by default).

    Returns ``{feature: "patched" | "native"}``. Call it before models and optimizers are built.
    """
    from . import patches

    patches.load_all()
    return patches.apply(features, allow_untested=allow_untested)


def revert(features: Iterable[str] | None = None) -> None:
    """Undo :func:`apply` (all features by default), restoring the original objects exactly."""
    from . import patches

    patches.revert(features)


def applied() -> list[str]:
    """Names of the features currently patched into megatron-core."""
    from . import patches

    return patches.applied()


__all__ = ["__version__", "applied", "apply", "revert"]
