"""Environment fixes needed before megatron-core is imported next to Megatron-Bridge.

``nvidia-resiliency-ext``: Megatron-Bridge 0.6.2 imports it unconditionally, and the newest
release on PyPI (0.4.1) has no ``__version__``. megatron-core 0.19.2's checkpointing reads that
attribute while it probes for NVRx async checkpointing (``dist_checkpointing/strategies/nvrx.py``),
so a bare ``import megatron.core`` fails with ``AttributeError`` as soon as NVRx 0.4.1 is
installed, GPU or not. megatron-core needs NVRx >= 0.6 for that feature anyway, so when an older
NVRx is installed we make its async-checkpoint module unimportable: megatron then reports "no
NVRx async support" and uses its own checkpointing, as it would without NVRx. Nothing happens
when NVRx is absent or new enough.
"""

from __future__ import annotations

import sys
from importlib import metadata

NVRX_ASYNC_MODULE = "nvidia_resiliency_ext.checkpointing.async_ckpt.core"
NVRX_MIN_FOR_MEGATRON_ASYNC = (0, 6)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def hide_old_nvrx_async_checkpointing() -> bool:
    """Hide NVRx's async checkpointing from megatron when NVRx is older than 0.6.

    Returns True when it hid it. Call before ``megatron.core`` is imported (idempotent).
    """
    try:
        installed = metadata.version("nvidia-resiliency-ext")
    except metadata.PackageNotFoundError:
        return False
    if _version_tuple(installed) >= NVRX_MIN_FOR_MEGATRON_ASYNC:
        return False
    if sys.modules.get(NVRX_ASYNC_MODULE, False) is None:
        return True
    sys.modules[NVRX_ASYNC_MODULE] = None  # type: ignore[assignment]
    return True
