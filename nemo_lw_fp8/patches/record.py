"""How the patches know the upstream code they wrap: an object's fingerprint, the name the record
gives it, and the record itself (:mod:`.upstream_fingerprints`, per tested version and patch).

A version number says which release is installed, not what its code does: a source install, a
container's cherry-picked fix or an upgrade that keeps the number can change a method a patch
wraps. Each patch therefore checks, before it installs anything, that every object it replaces
is the one it was tested over; a different fingerprint refuses the patch with one line naming the
object, the version and the override (:class:`UpstreamChanged`). The framework
(:mod:`.framework`) asks here; :mod:`.fingerprints` writes the record.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

#: What an override's target held when the attribute did not exist.
ABSENT = "absent"


class UpstreamChanged(RuntimeError):
    """An object a patch wraps differs from the one it was tested over."""


def fingerprint(obj: Any, missing: Any) -> str:
    """A short hash of ``obj``'s source text (``missing``: the attribute did not exist).

    Methods stored as ``staticmethod`` / ``classmethod`` / ``property`` objects are hashed by
    the function inside; an object without source (a builtin, a constant) by its type's name.
    """
    if obj is missing:
        return ABSENT
    target = obj
    if isinstance(obj, (staticmethod, classmethod)):
        target = obj.__func__
    elif isinstance(obj, property):
        target = obj.fget
    try:
        text = inspect.getsource(target)
    except (TypeError, OSError):
        text = f"<{type(obj).__module__}.{type(obj).__qualname__}>"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def target_name(owner: Any, attr: str) -> str:
    """``module.Class.attr`` or ``module.attr``: how the record names an override's target."""
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{attr}"
    return f"{getattr(owner, '__name__', type(owner).__qualname__)}.{attr}"


def recorded(version_key: str, patch_name: str) -> dict[str, str] | None:
    """The fingerprints recorded for ``patch_name`` at ``version_key`` (None: not recorded)."""
    from nemo_lw_fp8.patches.upstream_fingerprints import FINGERPRINTS

    return FINGERPRINTS.get(version_key, {}).get(patch_name)
