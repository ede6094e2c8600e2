"""The machinery every patch module uses: declare targets, detect upstream, apply, revert.

A :class:`Patch` names the upstream change it mirrors, the versions it was tested on and a
builder that returns its :class:`Override` s (owner object, attribute, replacement). Whether it
applies is :func:`decide`'s one verdict, which ``apply()`` acts on and ``doctor`` shows: the
record (:mod:`.record`) decides first. Every object the patch would replace must have a recorded
fingerprint of the installed version; then the recorded verdict holds (``patched``, or
``native`` where the record says that exact upstream code already does it). Nothing is decided
by reading upstream's source for a word. Applying records the exact original objects (read from
the owner's ``__dict__`` for classes, so inherited, static and class methods come back
unchanged) and applying twice is a no-op. :func:`revert` puts back the very same objects.
:func:`original` keeps every original reachable while patched.
"""

from __future__ import annotations

import gc
import importlib
import importlib.abc
import os
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from nemo_lw_fp8.patches.record import (
    NATIVE,
    PATCHED,
    UpstreamChanged,
    fingerprint,
    recorded,
    target_name,
)

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
_APPLY_COUNTER = 0


def register(patch: Patch) -> Patch:
    """Add a patch to the registry (patch modules call this at import time)."""
    if patch.name in _REGISTRY and _REGISTRY[patch.name] is not patch:
        raise ValueError(f"a patch named {patch.name!r} is already registered")
    _REGISTRY[patch.name] = patch
    return patch


def unregister(name: str) -> None:
    """Remove a patch from the registry, reverting it first (used by tests)."""
    patch = _REGISTRY.get(name)
    if patch is not None:
        _revert_one(patch)
        del _REGISTRY[name]


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


def _origin(patch: Patch) -> str:
    """How a message names what a patch mirrors."""
    if patch.upstream_pr:
        return f"mirrors Megatron-LM PR #{patch.upstream_pr}"
    return "the plugin's own behaviour"


@dataclass(frozen=True)
class Verdict:
    """What :func:`apply` does with one patch here, and why (``doctor`` shows the same)."""

    patch: str
    #: ``patched`` (applied or to apply), ``native`` (the record says upstream does it),
    #: ``pending`` (a Bridge patch before Bridge's import) or ``refused``.
    status: str
    reason: str
    #: Objects whose fingerprint no recorded build of this patch has (named in the refusal,
    #: or in the warnings when the override lets the patch apply anyway).
    changed: tuple[str, ...] = ()
    error: Exception | None = field(default=None, compare=False, repr=False)


def _targets(patch: Patch) -> tuple[list[Override] | None, Exception | None]:
    """The patch's overrides, or None and the error that says why they cannot be built here
    (a builder that finds upstream changed raises :class:`UpstreamChanged` itself)."""
    try:
        return patch.build_overrides(), None
    except (UpstreamChanged, AttributeError, KeyError, ImportError, TypeError) as error:
        return None, error


def _known_anywhere(patch: Patch, name: str, found: str) -> bool:
    """Whether any recorded build of ``patch`` (any version) had ``found`` under ``name``."""
    from nemo_lw_fp8.patches.upstream_fingerprints import FINGERPRINTS

    return any(
        entry.get(patch.name, {}).get("targets", {}).get(name) == found
        for entry in FINGERPRINTS.values()
    )


def _refused(patch: Patch, kind: type[Exception], message: str, changed=()) -> Verdict:
    error = kind(message, tuple(changed)) if kind is UpstreamChanged else kind(message)
    return Verdict(patch.name, "refused", message, tuple(changed), error)


def decide(patch: Patch, allow_untested: bool = False) -> tuple[Verdict, list[Override]]:
    """The one verdict for ``patch`` on this install, and the overrides to install for it.

    The record decides first: each object the patch would replace is fingerprinted
    (:func:`.record.fingerprint`) and compared with the record of the installed version;
    any difference refuses the patch, naming the objects, before anything else is asked.
    Only a full match gives the recorded verdict. With the override (``allow_untested`` or
    :data:`ALLOW_UNTESTED_ENV`), an untested version or changed code is patched anyway, each
    changed object named in an :class:`UntestedUpstreamWarning` by the caller; never "native".
    """
    if patch.applied:
        return Verdict(patch.name, PATCHED, "applied"), []
    if _pending(patch):
        return Verdict(patch.name, "pending", "applies when Megatron-Bridge is imported"), []
    for name in patch.requires:  # apply() installs these first: a refusal there stops it
        needed = decide(_REGISTRY[name], allow_untested)[0]
        if needed.status == "refused":
            return Verdict(patch.name, "refused", f"needs {name}: {needed.reason}",
                           needed.changed, needed.error), []  # fmt: skip
    allowed = _untested_allowed(allow_untested)
    installed = installed_version(patch.target)
    key = version_key(patch)
    tested = installed in patch.tested_versions
    if not tested and not allowed:
        return _refused(
            patch,
            UntestedMegatronVersion,
            f"nemo_lw_fp8 patch {patch.name!r} ({_origin(patch)}) was tested on {patch.target} "
            f"{', '.join(patch.tested_versions)}, not the installed {installed}: install "
            f"{patch.target}=={patch.tested_versions[-1]} (docs/install.md, supported lines), or "
            f"set {ALLOW_UNTESTED_ENV}=1 to apply it at your own risk.",
        ), []
    overrides, failure = _targets(patch)
    if overrides is None:
        if isinstance(failure, UpstreamChanged):  # its message names the object and the fix
            return Verdict(patch.name, "refused", str(failure), failure.objects, failure), []
        return _refused(
            patch,
            UpstreamChanged,
            f"nemo_lw_fp8 patch {patch.name!r} cannot find what it wraps in {key} "
            f"({type(failure).__name__}: {failure}): upstream changed; install a supported "
            "release (docs/install.md, supported lines).",
        ), []
    entry = recorded(key, patch.name)
    if entry is None and not _recorded_anywhere(patch):
        # Not one of the plugin's patches (tests register their own); the plugin's are all
        # recorded (tests/patches/test_upstream_fingerprints.py).
        return Verdict(patch.name, PATCHED, "not in the record"), overrides
    changed = []
    for override in overrides:
        name = override.target
        found = fingerprint(unpatched_own_attr(override.owner, override.attr), _MISSING)
        if entry is not None and entry.targets.get(name) == found:
            continue
        if entry is None and _known_anywhere(patch, name, found):
            continue  # an untested version whose object some tested build had
        changed.append(f"{name} (fingerprint {found})")
    if entry is None and tested:
        return _refused(
            patch,
            UpstreamChanged,
            f"nemo_lw_fp8 patch {patch.name!r} has no record for {key}: run "
            f"`python -m nemo_lw_fp8.patches.fingerprints --write` after testing it there.",
        ), []
    if changed and not allowed:
        return _refused(
            patch,
            UpstreamChanged,
            f"nemo_lw_fp8 patch {patch.name!r} wraps {', '.join(changed)}, which is not the code "
            f"it was tested over in {key}: reinstall the released {key.replace(' ', '==')} "
            f"(docs/install.md), or set {ALLOW_UNTESTED_ENV}=1 to apply it at your own risk.",
            changed,
        ), []
    if changed or entry is None:
        reason = f"applied over untested {key} ({ALLOW_UNTESTED_ENV}=1)"
        return Verdict(patch.name, PATCHED, reason, tuple(changed)), overrides
    if entry.verdict == NATIVE:
        return Verdict(patch.name, NATIVE, entry.reason), []
    return Verdict(patch.name, PATCHED, f"recorded over {key}"), overrides


def _recorded_anywhere(patch: Patch) -> bool:
    from nemo_lw_fp8.patches.upstream_fingerprints import FINGERPRINTS

    return any(patch.name in entry for entry in FINGERPRINTS.values())


def _warn_untested(patch: Patch, verdict: Verdict) -> None:
    """Name, in a shown warning, what the override let ``patch`` apply over."""
    key = version_key(patch)
    if installed_version(patch.target) not in patch.tested_versions:
        warnings.warn(
            f"nemo_lw_fp8 patch {patch.name!r} was tested on {patch.target} "
            f"{', '.join(patch.tested_versions)}, not {key}; applying anyway "
            f"({ALLOW_UNTESTED_ENV}=1 / allow_untested=True).",
            UntestedUpstreamWarning,
            stacklevel=4,
        )
    for name in verdict.changed:
        warnings.warn(
            f"nemo_lw_fp8 patch {patch.name!r} applies over {name}, which no tested build has "
            f"({ALLOW_UNTESTED_ENV}=1).",
            UntestedUpstreamWarning,
            stacklevel=4,
        )


def verdicts(features: Iterable[str] | None = None, *, allow_untested: bool = False) -> dict[
    str, Verdict
]:
    """:func:`decide` for the named patches (all by default), installing nothing."""
    return {patch.name: decide(patch, allow_untested)[0] for patch in _resolve(features)}


def _own_attr(owner: Any, attr: str) -> Any:
    if isinstance(owner, type):
        return owner.__dict__.get(attr, _MISSING)
    return getattr(owner, attr, _MISSING)


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


def _recorded_native(patch: Patch) -> bool:
    try:
        entry = recorded(version_key(patch), patch.name)
    except Exception:  # noqa: BLE001 - a package without a version: decide() refuses it
        return False
    return entry is not None and entry.verdict == NATIVE


def _with_dependents(chosen: list[Patch]) -> list[Patch]:
    """``chosen`` plus every applied patch that requires one of them (it wraps their objects)."""
    result = list(chosen)
    changed = True
    while changed:
        changed = False
        for patch in _REGISTRY.values():
            if patch in result or not patch.applied:
                continue
            if any(_REGISTRY[name] in result for name in patch.requires if name in _REGISTRY):
                result.append(patch)
                changed = True
    return result


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


#: Bridge patches asked for before Bridge was imported: name -> allow_untested.
_PENDING: dict[str, bool] = {}
_APPLYING_PENDING = False


def _pending(patch: Patch) -> bool:
    return patch.target == "megatron-bridge" and BRIDGE_IN_USE_MODULE not in sys.modules


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
