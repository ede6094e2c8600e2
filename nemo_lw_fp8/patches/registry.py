"""The patches' data model and registry: a :class:`Patch`, its :class:`Override` s, the versions
of what it targets, and what an owner held before any applied patch (:func:`original`).

Kept apart from :mod:`.framework` (apply, revert, the Bridge import watch) and :mod:`.verdict`
(the one decision per patch), which both build on it, so that neither imports the other's
machinery to ask "what is installed" or "what did upstream define here".
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from nemo_lw_fp8.patches.record import target_name

#: Set to 1 to apply patches on a megatron-core version they were not tested on.
ALLOW_UNTESTED_ENV = "NEMO_LW_FP8_ALLOW_UNTESTED_MEGATRON"


_MISSING = object()


class UntestedMegatronVersion(RuntimeError):
    """The installed megatron-core (or Megatron-Bridge) is not one the patch was tested on."""


class LateApplyWarning(UserWarning):
    """Patches were applied after megatron DDP wrappers or optimizers already existed."""


class UntestedUpstreamWarning(UserWarning):
    """A patch applied, under the override, over code or a version it was not tested on
    (always shown: :mod:`nemo_lw_fp8.cli.quiet` never holds the plugin's own warnings back)."""


@dataclass
class Override:
    """Replace ``owner.attr`` with ``replacement`` while the patch is applied."""

    owner: Any
    attr: str
    replacement: Any
    #: How the record names the owner when it has no module-level name of its own (an entry of
    #: a registry dict); "" for a module or class.
    owner_name: str = ""

    @property
    def target(self) -> str:
        """The record's name for what this override replaces."""
        if self.owner_name:
            return f"{self.owner_name}.{self.attr}"
        return target_name(self.owner, self.attr)


@dataclass
class Patch:
    """One behaviour the plugin brings to megatron-core, mirroring one upstream change."""

    name: str
    #: The Megatron-LM pull request this patch mirrors (0: none, the plugin's own behaviour).
    upstream_pr: int
    summary: str
    build_overrides: Callable[[], list[Override]]
    #: Versions of ``target`` (megatron-core or Megatron-Bridge) the patch was tested on; each
    #: also needs its record (patches/upstream_fingerprints.py), so the number alone admits
    #: nothing. 0.19.0: ``make test-mcore-0.19.0``; 0.20.0: the snapshot Megatron-Bridge's main
    #: pins, ``make test-next-release`` (docs/install.md, supported lines).
    tested_versions: tuple[str, ...] = ("0.19.0", "0.19.2", "0.20.0")
    requires: tuple[str, ...] = ()
    #: The upstream change's title, as ``doctor`` lists it ("" for the plugin's own patches).
    upstream_title: str = ""
    #: Where the upstream change has landed only for some optimizers (DistributedOptimizer),
    #: whether the installed megatron-core has that part (by the symbols it defines, for
    #: ``doctor``'s notes only: it never decides whether the patch applies).
    detect_upstream_part: Callable[[], tuple[bool, str]] | None = None
    #: What the patch changes: megatron-core ("megatron-core") or Megatron-Bridge call sites.
    target: str = "megatron-core"
    _saved: list[tuple[Any, str, Any]] = field(default_factory=list, repr=False)
    #: Position in the sequence of applications (revert goes newest first).
    _order: int = field(default=0, repr=False)
    applied: bool = False


_REGISTRY: dict[str, Patch] = {}


def register(patch: Patch) -> Patch:
    """Add a patch to the registry (patch modules call this at import time)."""
    if patch.name in _REGISTRY and _REGISTRY[patch.name] is not patch:
        raise ValueError(f"a patch named {patch.name!r} is already registered")
    _REGISTRY[patch.name] = patch
    return patch


def registry() -> dict[str, Patch]:
    return dict(_REGISTRY)


def megatron_core_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        from megatron.core import package_info

        return package_info.__version__


def installed_version(target: str) -> str:
    """The installed version of a patch's ``target`` package."""
    if target == "megatron-core":
        return megatron_core_version()
    from importlib.metadata import version

    return version(target)


def version_key(patch: Patch) -> str:
    """``"<target> <installed version>"``: where the fingerprint record files a patch."""
    return f"{patch.target} {installed_version(patch.target)}"


def _untested_allowed(allow_untested: bool) -> bool:
    return allow_untested or os.environ.get(ALLOW_UNTESTED_ENV) == "1"


def _own_attr(owner: Any, attr: str) -> Any:
    if isinstance(owner, type):
        return owner.__dict__.get(attr, _MISSING)
    return getattr(owner, attr, _MISSING)


def _resolve(features: Iterable[str] | None) -> list[Patch]:
    if features is None:
        return list(_REGISTRY.values())
    chosen: list[Patch] = []
    for name in features:
        if name not in _REGISTRY:
            raise KeyError(f"unknown nemo_lw_fp8 feature {name!r}; known: {sorted(_REGISTRY)}")
        for required in _REGISTRY[name].requires:
            if _REGISTRY[required] not in chosen:
                chosen.append(_REGISTRY[required])
        if _REGISTRY[name] not in chosen:
            chosen.append(_REGISTRY[name])
    return chosen


def required_by(name: str) -> list[str]:
    """Every registered patch ``name`` requires, directly or through another, nearest first
    (``apply()`` installs them before it; a refusal of any of them refuses it, and reverting
    any of them reverts it)."""
    found: list[str] = []
    queue = list(_REGISTRY[name].requires)
    while queue:
        needed = queue.pop(0)
        if needed in _REGISTRY and needed not in found:
            found.append(needed)
            queue.extend(_REGISTRY[needed].requires)
    return found


MISSING = _MISSING


def unpatched_own_attr(owner: Any, attr: str) -> Any:
    """What ``owner`` itself held under ``attr`` before any applied patch (``MISSING`` if none).

    Detectors use it so that a patch of ours is never mistaken for upstream having the change.
    """
    for patch in _REGISTRY.values():
        for saved_owner, saved_attr, value in patch._saved:
            if saved_owner is owner and saved_attr == attr:
                return value
    return _own_attr(owner, attr)


def defines(owner: Any, name: str) -> bool:
    """Whether ``owner`` itself defines ``name``, ignoring anything a plugin patch installed.

    Detectors use it so that a patch of ours is never mistaken for upstream having the change.
    """
    return unpatched_own_attr(owner, name) is not MISSING


def original(owner: Any, attr: str) -> Any:
    """The object ``owner.attr`` held before any applied patch replaced it."""
    for patch in _REGISTRY.values():
        for saved_owner, saved_attr, value in patch._saved:
            if saved_owner is owner and saved_attr == attr:
                if value is _MISSING:
                    raise AttributeError(f"{owner!r} had no attribute {attr!r} before patching")
                return value
    return getattr(owner, attr)


#: Imported by every Megatron-Bridge run; the Bridge patches wait for it.
BRIDGE_IN_USE_MODULE = "megatron.bridge.training.config"


def _pending(patch: Patch) -> bool:
    return patch.target == "megatron-bridge" and BRIDGE_IN_USE_MODULE not in sys.modules
