"""What every Megatron-Bridge patch shares: Bridge's modules looked up only once Bridge is in use,
and the registration that targets Megatron-Bridge's tested releases. The framework itself
(:mod:`.framework`) knows Bridge only as a target whose import it waits for; whether a Bridge
patch applies is the record's verdict, as for megatron-core's.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from nemo_lw_fp8.patches.framework import (
    BRIDGE_IN_USE_MODULE,
    Override,
    Patch,
    register,
)


def bridge_module(name: str) -> Any:
    """Megatron-Bridge's module ``name``, imported if need be: a Bridge patch builds its
    overrides only once Bridge is in use (:data:`BRIDGE_IN_USE_MODULE` imported), so this never
    brings Bridge into a process that did not ask for it."""
    if BRIDGE_IN_USE_MODULE not in sys.modules:
        raise ImportError(f"{name}: Megatron-Bridge is not in use in this process")
    return importlib.import_module(name)


#: The Megatron-Bridge releases the Bridge patches were tested on (one place for all of them).
BRIDGE_TESTED_VERSIONS: tuple[str, ...] = ("0.6.2", "0.7.0")


def register_bridge_patch(
    name: str,
    summary: str,
    build_overrides: Callable[[], list[Override]],
    *,
    upstream_pr: int = 0,
    upstream_title: str = "",
    requires: tuple[str, ...] = (),
) -> Patch:
    """Register a patch of Megatron-Bridge's call sites (the Bridge patches' :func:`register`).

    It targets ``megatron-bridge`` at :data:`BRIDGE_TESTED_VERSIONS`, so it waits for Bridge's
    import before it applies (:func:`apply`) and is checked against Bridge's version, not
    megatron-core's.
    """
    return register(
        Patch(
            name=name,
            upstream_pr=upstream_pr,
            summary=summary,
            build_overrides=build_overrides,
            requires=requires,
            upstream_title=upstream_title,
            target="megatron-bridge",
            tested_versions=BRIDGE_TESTED_VERSIONS,
        )
    )


def wrap_own(owner: Any, attr: str, make: Callable[[Any], Any]) -> Override:
    """The override that replaces ``owner``'s own ``attr`` with ``make(original)``.

    Most overrides wrap what the owner itself defines, read from its ``__dict__`` (so a class's
    static and class methods come as stored and an inherited method is never taken for its own).
    """
    return Override(owner, attr, make(owner.__dict__[attr]))
