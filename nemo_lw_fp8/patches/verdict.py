"""One verdict per patch: what ``apply()`` does with it on this install, and what ``doctor``
shows (the same function, :func:`decide`).

The record (:mod:`.record`, :mod:`.upstream_fingerprints`) decides first: every object the patch
would replace is fingerprinted and compared with the record of the installed version, and any
difference refuses the patch naming the object, before anything else is asked. Only a full match
gives the recorded verdict (``patched``, or ``native`` where the record says that exact upstream
code already does it). No detector reads upstream's source for a word.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

from nemo_lw_fp8.patches.record import NATIVE, PATCHED, UpstreamChanged, fingerprint, recorded
from nemo_lw_fp8.patches.registry import (
    _MISSING,
    _REGISTRY,
    ALLOW_UNTESTED_ENV,
    Override,
    Patch,
    UntestedMegatronVersion,
    UntestedUpstreamWarning,
    _pending,
    _resolve,
    _untested_allowed,
    installed_version,
    unpatched_own_attr,
    version_key,
)


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


def _recorded_builds(patch: Patch) -> list[dict]:
    """The record's entries for ``patch``, one per recorded version (none: a patch the plugin
    does not ship, e.g. a test's own)."""
    from nemo_lw_fp8.patches.upstream_fingerprints import FINGERPRINTS

    return [table[patch.name] for table in FINGERPRINTS.values() if patch.name in table]


def _refused(patch: Patch, kind: type[Exception], message: str, changed=()) -> Verdict:
    error = kind(message, tuple(changed)) if kind is UpstreamChanged else kind(message)
    return Verdict(patch.name, "refused", message, tuple(changed), error)


def decide(
    patch: Patch, allow_untested: bool = False, *, memo: dict[str, Verdict] | None = None
) -> tuple[Verdict, list[Override]]:
    """The one verdict for ``patch`` on this install, and the overrides to install for it.

    The record decides first: each object the patch would replace is fingerprinted
    (:func:`.record.fingerprint`) and compared with the record of the installed version;
    any difference refuses the patch, naming the objects, before anything else is asked.
    Only a full match gives the recorded verdict. With the override (``allow_untested`` or
    :data:`ALLOW_UNTESTED_ENV`), an untested version or changed code is patched anyway, each
    changed object named in an :class:`UntestedUpstreamWarning` by the caller; never "native".
    ``memo``: verdicts already decided in this call (a patch several others require is
    fingerprinted once).
    """
    if patch.applied:
        return Verdict(patch.name, PATCHED, "applied"), []
    if _pending(patch):
        return Verdict(patch.name, "pending", "applies when Megatron-Bridge is imported"), []
    memo = {} if memo is None else memo
    for name in patch.requires:  # apply() installs these first: a refusal there stops it
        if name not in memo:
            memo[name] = decide(_REGISTRY[name], allow_untested, memo=memo)[0]
        needed = memo[name]
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
    builds = _recorded_builds(patch)
    if entry is None and not builds:
        # Not one of the plugin's patches (tests register their own); the plugin's are all
        # recorded (tests/patches/test_upstream_fingerprints.py).
        return Verdict(patch.name, PATCHED, "not in the record"), overrides
    changed = []
    for override in overrides:
        name = override.target
        found = fingerprint(unpatched_own_attr(override.owner, override.attr), _MISSING)
        if entry is not None and entry.targets.get(name) == found:
            continue
        if entry is None and any(b.get("targets", {}).get(name) == found for b in builds):
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


def verdicts(
    features: Iterable[str] | None = None, *, allow_untested: bool = False
) -> dict[str, Verdict]:
    """:func:`decide` for the named patches (all by default), installing nothing."""
    memo: dict[str, Verdict] = {}
    for patch in _resolve(features):
        if patch.name not in memo:
            memo[patch.name] = decide(patch, allow_untested, memo=memo)[0]
    return {patch.name: memo[patch.name] for patch in _resolve(features)}


def _recorded_native(patch: Patch) -> bool:
    try:
        entry = recorded(version_key(patch), patch.name)
    except Exception:  # noqa: BLE001 - a package without a version: decide() refuses it
        return False
    return entry is not None and entry.verdict == NATIVE
