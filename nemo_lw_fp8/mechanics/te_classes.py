"""Which TE tensor class a parameter is, asked without importing Transformer Engine where it is
absent (the plugin runs on stacks without TE; a missing class means "not that kind")."""

from __future__ import annotations

import functools
import importlib

import torch


@functools.cache
def te_class(module: str, name: str) -> type | None:
    """TE's class ``name`` from ``module`` (``transformer_engine.pytorch.tensor.<...>``), or
    ``None`` when TE or the class is not installed."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def holds(param: torch.Tensor, cls: type | None) -> bool:
    """Whether ``param`` (a ``Parameter`` or its ``.data``) is an instance of ``cls``."""
    if cls is None:
        return False
    data = param.data if isinstance(param, torch.nn.Parameter) else param
    return isinstance(param, cls) or isinstance(data, cls)
