"""What every Megatron-Bridge patch shares: Bridge's modules looked up only once Bridge is in use,
the detector's first question (is there anything of Bridge's to patch?), and the registration
that targets Megatron-Bridge's tested releases. The framework itself (:mod:`.framework`) knows
Bridge only as a target whose import it waits for.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

from nemo_lw_fp8.patches.framework import (
    BRIDGE_IN_USE_MODULE,
    Override,
    Patch,
    register,
    unpatched_own_attr,
)


def bridge_module(name: str) -> Any | None:
    """Megatron-Bridge's module ``name`` once Bridge is in use (importing it is then cheap),
    else ``None``: the Bridge patches never import Bridge themselves."""
    if BRIDGE_IN_USE_MODULE not in sys.modules:
        return None
    return importlib.import_module(name)


#: The Megatron-Bridge releases the Bridge patches were tested on (one place for all of them).
BRIDGE_TESTED_VERSIONS: tuple[str, ...] = ("0.6.2",)

#: Why a Bridge patch is "native" while Bridge is not imported: there is nothing to patch yet.
BRIDGE_NOT_IMPORTED = "Megatron-Bridge not imported: nothing to patch"


#: A Bridge detector's reader: the source of what Bridge's module itself defines under a name,
#: as upstream wrote it (a plugin patch installed there is never read as Bridge's code).
BridgeSource = Callable[[str], str]


def bridge_detector(
    module_name: str, *, imported_only: bool = False
) -> Callable[[Callable[[BridgeSource], tuple[bool, str]]], Callable[[], tuple[bool, str]]]:
    """Decorator turning ``detect(source)`` into a Bridge patch's ``detect_native``.

    Every Bridge patch asks the same first question (is there a Bridge module to patch?) before
    reading the sources of what it patches; the decorator asks it once and hands the detector a
    :data:`BridgeSource` of Bridge's module ``module_name``. That module is looked up through
    :func:`bridge_module` (the detector never imports Bridge), or with ``imported_only`` only
    when it is itself imported already (importing it would bring more than Bridge's config
    module does, e.g. Transformer Engine).
    """

    def decorate(
        detect: Callable[[BridgeSource], tuple[bool, str]],
    ) -> Callable[[], tuple[bool, str]]:
        @functools.wraps(detect)
        def detect_native() -> tuple[bool, str]:
            lookup = sys.modules.get if imported_only else bridge_module
            module = lookup(module_name)
            if module is None:
                return True, BRIDGE_NOT_IMPORTED
            return detect(lambda name: inspect.getsource(unpatched_own_attr(module, name)))

        return detect_native

    return decorate


def register_bridge_patch(
    name: str,
    summary: str,
    detect_native: Callable[[], tuple[bool, str]],
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
            detect_native=detect_native,
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
