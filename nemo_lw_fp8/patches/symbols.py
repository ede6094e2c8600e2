"""What an installed module defines, read from the live module or from its source text.

The detectors of what upstream landed (``doctor``'s notes) ask megatron-core questions such as
"does ``LayerWiseDistributedOptimizer`` itself define ``prepare_model_params_for_param_sync``" or
"which fields does ``DistributedDataParallelConfig`` have" (never "what does the source say": no
verdict rests on a word in upstream's text). Importing a module only to answer them costs seconds
(``megatron.training`` pulls in most of megatron), so each question goes through :func:`module`:

* when the module is already imported, the live objects answer, ignoring what a plugin patch
  installed (:func:`nemo_lw_fp8.patches.framework.unpatched_own_attr`), so a test that changes a
  symbol changes the answer;
* otherwise its source file is located without importing anything (``find_spec`` of the top-level
  package only, then the path) and parsed: module-level definitions (through ``if`` / ``try`` /
  ``with`` blocks), class bodies, function parameters, dataclass fields.

Both read the same definitions; ``tests/patches/test_upstream_detection.py`` checks that every
detector gives the same answer either way. :func:`from_source` forces the source reading (for that
test).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

_FORCE_SOURCE = False


@contextlib.contextmanager
def from_source() -> Iterator[None]:
    """Answer from source text even for modules already imported."""
    global _FORCE_SOURCE
    before, _FORCE_SOURCE = _FORCE_SOURCE, True
    try:
        yield
    finally:
        _FORCE_SOURCE = before


def source_path(name: str) -> Path | None:
    """The file of module ``name``, found without importing it or its parent packages."""
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported
    if spec is None:
        return None
    for root in spec.submodule_search_locations or []:
        base = Path(root, *rest)
        for candidate in (base.parent / f"{base.name}.py", base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _definitions(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a block defines (later definitions win, as at run time), looking through ``if``,
    ``try`` and ``with`` blocks but not into functions or classes."""
    found: dict[str, ast.AST] = {}
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[stmt.name] = stmt
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = stmt
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            found[stmt.target.id] = stmt
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for alias in stmt.names:
                found[(alias.asname or alias.name).split(".")[0]] = stmt
        elif isinstance(stmt, (ast.If, ast.Try, ast.With)):
            blocks = [stmt.body, getattr(stmt, "orelse", []), getattr(stmt, "finalbody", [])]
            blocks += [handler.body for handler in getattr(stmt, "handlers", [])]
            for block in blocks:
                found.update(_definitions(block))
    return found


@cache
def _parsed(path: Path) -> tuple[str, ast.Module]:
    text = path.read_text(encoding="utf-8")
    return text, ast.parse(text, filename=str(path))


#: What :meth:`_Definitions._find` returns for a name the module does not define.
_ABSENT = object()


class _Definitions:
    """What both readings answer alike, once each can find a definition by its dotted name."""

    #: The module's name, for messages.
    name: str

    def _find(self, qualname: str) -> Any:
        """The definition of ``qualname`` (``Class.method`` or a module-level name), or
        :data:`_ABSENT`."""
        raise NotImplementedError

    def has(self, qualname: str) -> bool:
        return self._find(qualname) is not _ABSENT

    def _definition(self, qualname: str) -> Any:
        found = self._find(qualname)
        if found is _ABSENT:
            raise AttributeError(f"{self.name} defines no {qualname}")
        return found


class _SourceModule(_Definitions):
    """Answers from a module's source file."""

    def __init__(self, name: str) -> None:
        path = source_path(name)
        if path is None:
            raise ModuleNotFoundError(f"no source file for {name}")
        self.name = name
        self.text, self.tree = _parsed(path)

    def _find(self, qualname: str) -> Any:
        body: list[ast.stmt] = self.tree.body
        node: Any = _ABSENT
        for part in qualname.split("."):
            node = _definitions(body).get(part, _ABSENT)
            if node is _ABSENT:
                return _ABSENT
            body = node.body if isinstance(node, ast.ClassDef) else []
        return node

    def parameters(self, qualname: str) -> list[str]:
        node = self._find(qualname)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise AttributeError(f"{self.name}.{qualname} is not a function defined there")
        args = node.args
        names = [a.arg for a in (*args.posonlyargs, *args.args)]
        names += [a.arg for a in (args.vararg,) if a is not None]
        names += [a.arg for a in args.kwonlyargs]
        names += [a.arg for a in (args.kwarg,) if a is not None]
        return names

    def fields(self, qualname: str) -> set[str]:
        node = self._find(qualname)
        if not isinstance(node, ast.ClassDef):
            return set()
        return {
            stmt.target.id
            for stmt in node.body
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
        }


class _LiveModule(_Definitions):
    """Answers from an imported module, ignoring the plugin's own patches."""

    def __init__(self, module: Any) -> None:
        self.module = module

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.module.__name__

    def _find(self, qualname: str) -> Any:
        from nemo_lw_fp8.patches.framework import MISSING, unpatched_own_attr

        owner = self.module
        for part in qualname.split("."):
            owner = unpatched_own_attr(owner, part)
            if owner is MISSING:
                return _ABSENT
        return owner

    def parameters(self, qualname: str) -> list[str]:
        return list(inspect.signature(self._definition(qualname)).parameters)

    def fields(self, qualname: str) -> set[str]:
        return set(getattr(self._definition(qualname), "__dataclass_fields__", {}))


def all_defined(found: dict[str, bool], reason: str) -> tuple[bool, str]:
    """A detector's answer for an upstream change that is a set of definitions: ``found`` maps
    each one's label to whether the installed module defines it. Native (with ``reason``) when
    all are there, else not, naming the missing ones (``doctor`` shows what an upgrade lacks)."""
    missing = [label for label, defined in found.items() if not defined]
    if missing:
        return False, "missing " + ", ".join(missing)
    return True, reason


def module(name: str) -> _LiveModule | _SourceModule:
    """The definitions of module ``name``: live when it is imported, else from its source."""
    loaded = sys.modules.get(name)
    if loaded is not None and not _FORCE_SOURCE:
        return _LiveModule(loaded)
    return _SourceModule(name)
