"""The machinery every patch module uses: apply, revert, and Bridge patches that wait for Bridge.

The data model and registry live in :mod:`.registry`, the one decision per patch in
:mod:`.verdict`; this module acts on them and hands their names on. A :class:`Patch` names the
upstream change it mirrors, the versions it was tested on and a builder that returns its
:class:`Override` s (owner object, attribute, replacement). Whether it applies is :func:`decide`'s
one verdict, which ``apply()`` acts on and ``doctor`` shows: the record (:mod:`.record`) decides
first. Every object the patch would replace must have a recorded fingerprint of the installed
version; then the recorded verdict holds (``patched``, or ``native`` where the record says that
exact upstream code already does it). Nothing is decided by reading upstream's source for a
word. Applying records the exact original objects (read from
the owner's ``__dict__`` for classes, so inherited, static and class methods come back
unchanged) and applying twice is a no-op. :func:`revert` puts back the very same objects.
:func:`original` keeps every original reachable while patched.
"""

from __future__ import annotations

import gc
import importlib
import importlib.abc
import sys
import warnings
from collections.abc import Iterable
from typing import Any

from nemo_lw_fp8.patches.record import NATIVE, PATCHED, UpstreamChanged
from nemo_lw_fp8.patches.registry import (
    _MISSING,
    _REGISTRY,
    ALLOW_UNTESTED_ENV,
    BRIDGE_IN_USE_MODULE,
    MISSING,
    LateApplyWarning,
    Override,
    Patch,
    UntestedMegatronVersion,
    UntestedUpstreamWarning,
    _own_attr,
    _pending,
    _resolve,
    defines,
    installed_version,
    megatron_core_version,
    original,
    register,
    registry,
    required_by,
    unpatched_own_attr,
    version_key,
)
from nemo_lw_fp8.patches.verdict import Verdict, _recorded_native, _warn_untested, decide, verdicts

#: What :mod:`nemo_lw_fp8.patches` and the patch modules import from here: the registry's and
#: the verdict's names with the machinery that acts on them.
__all__ = [
    "ALLOW_UNTESTED_ENV",
    "BRIDGE_IN_USE_MODULE",
    "MISSING",
    "LateApplyWarning",
    "Override",
    "Patch",
    "UntestedMegatronVersion",
    "UntestedUpstreamWarning",
    "UpstreamChanged",
    "Verdict",
    "applied",
    "apply",
    "decide",
    "defines",
    "installed_version",
    "megatron_core_version",
    "original",
    "register",
    "registry",
    "revert",
    "unpatched_own_attr",
    "unregister",
    "verdicts",
    "version_key",
]

_APPLY_COUNTER = 0


def unregister(name: str) -> None:
    """Remove a patch from the registry, reverting it first (used by tests)."""
    patch = _REGISTRY.get(name)
    if patch is not None:
        _revert_one(patch)
        del _REGISTRY[name]


def _subclasses(cls: type) -> set[type]:
    """``cls`` and every class that derives from it (defined so far)."""
    found, todo = {cls}, [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def _warn_if_late(names: list[str]) -> None:
    """Say so when megatron DDP wrappers or optimizers were built before the patches."""
    try:
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.optimizer import MegatronOptimizer
    except ImportError:
        return
    # An exact-type set lookup per object: ``issubclass`` against the ABC ``MegatronOptimizer``
    # costs ~2 s per call over the ~900k objects an imported stack holds (every rank, every apply).
    kinds = _subclasses(DistributedDataParallel) | _subclasses(MegatronOptimizer)
    late = sum(1 for obj in gc.get_objects() if type(obj) in kinds)
    if late:
        warnings.warn(
            f"nemo_lw_fp8.apply({names}) ran after {late} megatron DDP wrapper(s) / optimizer(s) "
            "were built; objects built before the patches may keep the unpatched behaviour. "
            "Call nemo_lw_fp8.apply() before building models and optimizers.",
            LateApplyWarning,
            stacklevel=3,
        )


def _apply_one(patch: Patch, allow_untested: bool) -> str:
    if patch.applied:
        return PATCHED
    if _pending(patch):
        _apply_when_bridge_is_imported(patch, allow_untested)
        return "pending"
    verdict, overrides = decide(patch, allow_untested)
    if verdict.error is not None:
        raise verdict.error
    if verdict.status == NATIVE:
        return NATIVE
    _warn_untested(patch, verdict)
    saved: list[tuple[Any, str, Any]] = []
    try:
        for override in overrides:
            previous = _own_attr(override.owner, override.attr)
            setattr(override.owner, override.attr, override.replacement)
            saved.append((override.owner, override.attr, previous))
    except BaseException:
        _restore(saved)
        raise
    global _APPLY_COUNTER
    _APPLY_COUNTER += 1
    patch._saved = saved
    patch._order = _APPLY_COUNTER
    patch.applied = True
    return PATCHED


def _restore(saved: list[tuple[Any, str, Any]]) -> None:
    for owner, attr, value in reversed(saved):
        if value is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, value)


def _revert_one(patch: Patch) -> None:
    _PENDING.pop(patch.name, None)
    if patch.applied:
        _restore(patch._saved)
        patch._saved = []
        patch.applied = False


def apply(features: Iterable[str] | None = None, *, allow_untested: bool = False) -> dict[str, str]:
    """Apply the named patches (all registered ones by default).

    Returns ``{name: "patched" | "native" | "pending"}`` (each patch's :func:`decide` verdict;
    a refused one raises :class:`UpstreamChanged` or :class:`UntestedMegatronVersion`);
    ``pending``: a Megatron-Bridge patch while Bridge is not imported yet, applied (or refused)
    the moment Bridge's config module is. Idempotent: a patch already applied stays as it is.
    """
    chosen = _resolve(features)
    names = [patch.name for patch in chosen]
    # Only a patch this call will install can come too late (a native one installs nothing).
    if any(not patch.applied and not _pending(patch) and not _recorded_native(patch)
           for patch in chosen):  # fmt: skip
        _warn_if_late(names)
    return {patch.name: _apply_one(patch, allow_untested) for patch in chosen}


def _with_dependents(chosen: list[Patch]) -> list[Patch]:
    """``chosen`` plus every applied patch that requires one of them (it wraps their objects)."""
    names = {patch.name for patch in chosen}
    return list(chosen) + [
        patch
        for patch in _REGISTRY.values()
        if patch not in chosen and patch.applied and names.intersection(required_by(patch.name))
    ]


def revert(features: Iterable[str] | None = None) -> None:
    """Restore the original objects of the named patches (all by default), newest first.

    Patches that require a reverted one are reverted too: they wrap its objects.
    """
    chosen = _with_dependents(_resolve(features))
    for patch in sorted(chosen, key=_apply_order, reverse=True):
        _revert_one(patch)


def _apply_order(patch: Patch) -> int:
    return patch._order


def applied() -> list[str]:
    """Names of the patches currently applied."""
    return [name for name, patch in _REGISTRY.items() if patch.applied]


#: Bridge patches asked for before Bridge was imported: name -> allow_untested.
_PENDING: dict[str, bool] = {}
_APPLYING_PENDING = False


class _BridgeImportWatch(importlib.abc.MetaPathFinder):
    """Watches ``megatron.bridge.*`` imports while Bridge patches are pending: when the
    outermost one has finished executing and Bridge's config module is imported, the pending
    patches apply (so ``apply()`` before ``import megatron.bridge...`` patches Bridge all the
    same, and no patch reads a module that is still half imported)."""

    depth = 0

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not fullname.startswith("megatron.bridge"):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _WatchedLoader(spec.loader)
            return spec
        return None


class _WatchedLoader(importlib.abc.Loader):
    """A Bridge module's own loader, counted while it executes."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        _WATCH.depth += 1
        try:
            self._loader.exec_module(module)
        finally:
            _WATCH.depth -= 1
        module.__loader__ = module.__spec__.loader = self._loader
        if _WATCH.depth == 0:
            _apply_pending()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


_WATCH = _BridgeImportWatch()


def _apply_pending() -> None:
    global _APPLYING_PENDING
    if BRIDGE_IN_USE_MODULE not in sys.modules or _APPLYING_PENDING:
        return
    _APPLYING_PENDING = True
    if _WATCH in sys.meta_path:
        sys.meta_path.remove(_WATCH)
    waiting = list(_PENDING.items())  # in the order they were asked for, as apply() goes
    _PENDING.clear()
    try:
        for name, allow_untested in waiting:
            if name in _REGISTRY:
                _apply_one(_REGISTRY[name], allow_untested)
    finally:
        _APPLYING_PENDING = False


def _apply_when_bridge_is_imported(patch: Patch, allow_untested: bool) -> None:
    _PENDING[patch.name] = allow_untested
    if _WATCH not in sys.meta_path:
        sys.meta_path.insert(0, _WATCH)
