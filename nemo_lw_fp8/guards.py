"""The rule catalogue's first address, kept for code written against it
(``nemo_lw_fp8.guards.check(settings)``): every name resolves in :mod:`nemo_lw_fp8.rules`."""

from __future__ import annotations

from typing import Any

from nemo_lw_fp8 import rules


def __getattr__(name: str) -> Any:
    return getattr(rules, name)
