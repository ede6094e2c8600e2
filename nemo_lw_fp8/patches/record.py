"""How the patches know the upstream code they wrap: an object's fingerprint, the name the record
gives it, and the record itself (:mod:`.upstream_fingerprints`: per tested version, per patch, a
verdict and the fingerprint of every object the patch wraps).

A version number says which release is installed, not what its code does: a source install, a
container's cherry-picked fix or an upgrade that keeps the number can change a method a patch
wraps. So the fingerprint is taken of what the interpreter will run, never of what the object
says it wraps:

* a function: the source lines of its own code object (read from the file that code names, so a
  ``functools.wraps`` wrapper is hashed as the wrapper, never through ``__wrapped__``), its
  defaults, and every closure cell (a wrapper's wrapped function is hashed in full);
* ``staticmethod`` / ``classmethod`` / ``property`` / ``functools.partial``: their kind and
  what they hold;
* a class: its bases and its own attributes, each by this same rule;
* data: a canonical form (dicts sorted, dataclass instances field by field, predicates as
  functions), never just a type's name; an object with no such form is hashed by a text that
  matches no record, so it counts as changed.

Source lines, not bytecode, so the record holds on every Python that megatron-core supports.
Classes met inside a function (``super()``'s ``__class__`` cell, a default) count by their name:
a method's fingerprint then does not move when another method of its class is patched.

Tests that install a stand-in over an upstream method (to count calls) declare it through
:func:`counted_as`, a door only tests open: the product never calls it, so any other wrapper
is changed code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import inspect
import re
import types
from collections.abc import Iterator
from typing import Any

#: What an override's target held when the attribute did not exist.
ABSENT = "absent"

#: A patch's recorded verdicts: applied over the recorded code, or upstream already does it.
PATCHED = "patched"
NATIVE = "native"

#: Class attributes that say nothing about behaviour (or that Python fills in for every class).
_CLASS_NOISE = frozenset(
    {"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__", "__annotations__",
     "__static_attributes__", "__firstlineno__", "__parameters__", "__orig_bases__"}
)  # fmt: skip

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")

#: Stand-ins tests declared (id -> (stand-in, the upstream object it counts as)).
_COUNTED_AS: dict[int, tuple[Any, Any]] = {}


class UpstreamChanged(RuntimeError):
    """An object a patch wraps differs from the one it was tested over (``objects``: the
    record's names of the changed objects)."""

    def __init__(self, message: str, objects: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.objects = tuple(objects)


@contextlib.contextmanager
def counted_as(stand_in: Any, upstream: Any) -> Iterator[None]:
    """While open, ``stand_in`` is fingerprinted as ``upstream`` (tests only: a call counter
    installed over megatron's method must not be refused as a hotfix)."""
    _COUNTED_AS[id(stand_in)] = (stand_in, upstream)
    try:
        yield
    finally:
        _COUNTED_AS.pop(id(stand_in), None)


def fingerprint(obj: Any, missing: Any) -> str:
    """A short hash of what ``obj`` runs (``missing``: the attribute did not exist)."""
    if obj is missing:
        return ABSENT
    return hashlib.sha256(canonical(obj).encode()).hexdigest()[:16]


def canonical(obj: Any) -> str:
    """The text :func:`fingerprint` hashes (module docstring: what goes in)."""
    return _canonical(obj, top=True, seen=set())


def _name_of(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def _code_text(code: types.CodeType) -> str:
    try:
        return inspect.getsource(code)
    except (OSError, TypeError):
        # No source (built at run time, or a .pyc alone): a text no recorded build has.
        return f"<no source: {code.co_filename}:{code.co_firstlineno} {code.co_code.hex()}>"


def _function_text(function: types.FunctionType, seen: set[int]) -> str:
    parts = [f"function {function.__qualname__}", _code_text(function.__code__)]
    parts.append("defaults " + _canonical(function.__defaults__, top=False, seen=seen))
    parts.append("kwdefaults " + _canonical(function.__kwdefaults__, top=False, seen=seen))
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or (), strict=True):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            value = "<empty cell>"
        parts.append(f"cell {name} " + _canonical(value, top=False, seen=seen))
    return "\n".join(parts)


def _class_text(cls: type, seen: set[int]) -> str:
    parts = [f"class {_name_of(cls)}({', '.join(_name_of(base) for base in cls.__bases__)})"]
    for name in sorted(cls.__dict__):
        if name not in _CLASS_NOISE:
            parts.append(f"{name} = " + _canonical(cls.__dict__[name], top=False, seen=seen))
    return "\n".join(parts)


def _canonical(obj: Any, *, top: bool, seen: set[int]) -> str:  # noqa: PLR0911 - one kind each
    stand_in = _COUNTED_AS.get(id(obj))
    if stand_in is not None and stand_in[0] is obj:
        obj = stand_in[1]
    if isinstance(obj, enum.Enum):
        return f"enum {_name_of(type(obj))}.{obj.name}"
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        return repr(obj)
    if isinstance(obj, type):
        # A class a patch replaces is hashed whole; one met inside other code, by its name.
        return _class_text(obj, seen) if top else f"class {_name_of(obj)}"
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}"
    if id(obj) in seen:  # a cycle (a closure holding itself, a dict holding itself)
        return f"<again {type(obj).__qualname__}>"
    seen = seen | {id(obj)}
    if isinstance(obj, types.FunctionType):
        return _function_text(obj, seen)
    if isinstance(obj, (staticmethod, classmethod)):
        return f"{type(obj).__name__}(" + _canonical(obj.__func__, top=False, seen=seen) + ")"
    if isinstance(obj, property):
        accessors = (obj.fget, obj.fset, obj.fdel)
        return "property(" + ", ".join(_canonical(a, top=False, seen=seen) for a in accessors) + ")"
    if isinstance(obj, types.MethodType):
        return "method(" + _canonical(obj.__func__, top=False, seen=seen) + ")"
    if isinstance(obj, functools.partial):
        inner = [obj.func, obj.args, obj.keywords]
        return "partial(" + ", ".join(_canonical(x, top=False, seen=seen) for x in inner) + ")"
    if isinstance(obj, (types.BuiltinFunctionType, types.WrapperDescriptorType,
                        types.MethodDescriptorType)):  # fmt: skip
        return f"builtin {_name_of(obj)}"
    if isinstance(obj, dict):
        items = sorted(
            _canonical(key, top=False, seen=seen) + ": " + _canonical(value, top=False, seen=seen)
            for key, value in obj.items()
        )
        return "{" + ", ".join(items) + "}"
    if isinstance(obj, (list, tuple)):
        items = [_canonical(item, top=False, seen=seen) for item in obj]
        return f"{type(obj).__name__}[" + ", ".join(items) + "]"
    if isinstance(obj, (set, frozenset)):
        items = sorted(_canonical(item, top=False, seen=seen) for item in obj)
        return f"{type(obj).__name__}{{" + ", ".join(items) + "}"
    if dataclasses.is_dataclass(obj):
        fields = [
            f"{field.name}=" + _canonical(getattr(obj, field.name), top=False, seen=seen)
            for field in dataclasses.fields(obj)
        ]
        return f"{_name_of(type(obj))}(" + ", ".join(fields) + ")"
    if hasattr(obj, "__dict__") and not callable(obj):
        return f"{_name_of(type(obj))}" + _canonical(dict(vars(obj)), top=False, seen=seen)
    # Anything else (a C-level callable object, an opaque value): its type and its repr, less
    # memory addresses; a different object of the same type differs unless it prints the same.
    return f"<{_name_of(type(obj))}: {_ADDRESS.sub('', repr(obj))}>"


def target_name(owner: Any, attr: str) -> str:
    """``module.Class.attr`` or ``module.attr``: how the record names an override's target."""
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{attr}"
    return f"{getattr(owner, '__name__', type(owner).__qualname__)}.{attr}"


@dataclasses.dataclass(frozen=True)
class Recorded:
    """What the record holds for one patch at one version."""

    verdict: str
    targets: dict[str, str]
    #: Why upstream needs no patch (a native verdict only).
    reason: str = ""


def recorded(version_key: str, patch_name: str) -> Recorded | None:
    """The record's entry for ``patch_name`` at ``version_key`` (None: not recorded)."""
    from nemo_lw_fp8.patches.upstream_fingerprints import FINGERPRINTS

    entry = FINGERPRINTS.get(version_key, {}).get(patch_name)
    if entry is None:
        return None
    return Recorded(entry["verdict"], dict(entry["targets"]), entry.get("reason", ""))
