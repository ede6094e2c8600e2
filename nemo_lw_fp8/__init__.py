"""nemo_lw_fp8: layer-wise Muon with FP8 parameter all-gather for megatron-core.

Public entry points::

    import nemo_lw_fp8
    nemo_lw_fp8.apply()            # patch the installed megatron-core (before building models)
    nemo_lw_fp8.apply(compact_layout=False)     # every feature but one
    nemo_lw_fp8.applied()          # which patches are active
    nemo_lw_fp8.revert()           # put every original object back
    nemo_lw_fp8.LayerWiseConfig(layout="compact").attach(ddp_config)   # the plugin's settings

Importing this package does not import megatron-core; :func:`apply` does. It does hide an
incompatible NVRx's async checkpointing from megatron (:mod:`nemo_lw_fp8.compat`).
"""

from __future__ import annotations

from collections.abc import Iterable

__version__ = "0.1.0"

from nemo_lw_fp8.compat import hide_old_nvrx_async_checkpointing as _hide_old_nvrx

# Must run before megatron.core is imported (see nemo_lw_fp8/compat.py); a no-op unless an
# NVRx older than 0.6 is installed.
_hide_old_nvrx()


def apply(
    features: Iterable[str] | None = None, *, allow_untested: bool = False, **switches: bool
) -> dict[str, str]:
    """Apply the plugin's patches to megatron-core (all by default).

    ``features`` names the patches to apply; keyword switches turn single features on or off
    from that set (``apply(compact_layout=False)``: every feature but the compact layout;
    ``apply([], mla_local_attention=True)``: only that one). A patch's ``requires`` come along.
    Returns ``{feature: "patched" | "native"}``. Call it before models and optimizers are built.
    """
    from nemo_lw_fp8 import patches

    patches.load_all()
    known = patches.registry()
    unknown = sorted(set(switches) - set(known))
    if unknown:
        raise TypeError(f"apply() got unknown feature switches {unknown}; known: {sorted(known)}")
    chosen = list(known) if features is None else list(features)
    chosen = [name for name in chosen if switches.get(name, True)]
    chosen += [name for name, on in switches.items() if on and name not in chosen]
    return patches.apply(chosen, allow_untested=allow_untested)


def revert(features: Iterable[str] | None = None) -> None:
    """Undo :func:`apply` (all features by default), restoring the original objects exactly."""
    from nemo_lw_fp8 import patches

    patches.revert(features)


def applied() -> list[str]:
    """Names of the features currently patched into megatron-core."""
    from nemo_lw_fp8 import patches

    return patches.applied()


from nemo_lw_fp8.config import LayerWiseConfig  # noqa: E402 (after the NVRx shim; imports no megatron)

__all__ = ["LayerWiseConfig", "__version__", "applied", "apply", "revert"]
