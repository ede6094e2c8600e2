"""Switch one step of a plugin mechanism off inside a rank: what the mutation tests share.

A mutation test proves that a step is needed by training with it undone and showing that a
parity test's comparison then fails. The tests describe each step as (module under
``nemo_lw_fp8.mechanics``, attribute, replacement); the replacement is the stock behaviour,
or ``None`` for a step that simply does not happen.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

#: step name -> (module under ``nemo_lw_fp8.mechanics``, attribute, replacement or None)
Mutations = dict[str, tuple[str, str, Callable[..., Any] | None]]


def _skipped(*args: Any, **kwargs: Any) -> None:
    """The replacement of a step that is switched off without a stock behaviour to restore."""


@contextlib.contextmanager
def switched_off(mutations: Mutations, step: str) -> Iterator[None]:
    """Inside a rank: ``mutations[step]`` replaced (a no-op, or the stock behaviour) until the
    block ends, so the next task on the same rank sees the plugin intact."""
    module_name, attr, replacement = mutations[step]
    module = importlib.import_module(f"nemo_lw_fp8.mechanics.{module_name}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, attr, replacement if replacement is not None else _skipped)
        yield


def train_with_step_off(scenario: Any, mutations: Mutations, step: str) -> dict:
    """Inside a rank: :func:`tests.support.training.train` with ``mutations[step]`` switched
    off, the ON run of a mutation test."""
    from tests.support.training import train

    with switched_off(mutations, step):
        return train(scenario)
