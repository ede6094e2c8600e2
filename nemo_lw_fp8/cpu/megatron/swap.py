"""Swap attributes on a module or class and get back a function that undoes it exactly: how every
CPU stand-in installs itself without editing megatron's, Bridge's or fla's sources."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def swap_attrs(owner: Any, replacements: dict[str, Any]) -> Callable[[], None]:
    """Set attributes on ``owner`` and return a function that restores the originals exactly."""
    missing = object()
    # For a class, read its own __dict__ so an inherited attribute is restored by deletion.
    lookup = owner.__dict__.get if isinstance(owner, type) else lambda n, d: getattr(owner, n, d)
    originals = {name: lookup(name, missing) for name in replacements}
    for name, value in replacements.items():
        setattr(owner, name, value)

    def undo() -> None:
        for name, value in originals.items():
            if value is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, value)

    return undo
