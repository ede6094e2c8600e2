"""Megatron-Bridge refuses, before loading anything, a checkpoint the run cannot resume from.

Behaviour: Bridge 0.6.2 compares only TP / PP between a checkpoint's ``run_config.yaml`` and the
run. A checkpoint of another model fails later inside the sharded load with a key or shape
error naming tensors, one of FP8 recipe MXFP8 loaded into a blockwise run (or the reverse) loads
without complaint, and a checkpoint missing one of its ``.distcp`` files fails on the ranks that
read it while the others wait in a collective. With this patch the load stops first, on every
rank, with a message naming each differing field (model shapes, FP8 recipe, optimizer) or the
missing or truncated files, and the fix:
:func:`nemo_lw_fp8.mechanics.checkpointing.check_loadable`, rules ``checkpoint-mismatch``,
``checkpoint-missing-shard`` and ``checkpoint-truncated-shard`` in :mod:`nemo_lw_fp8.rules`.

Mirrors: no upstream change.

Patches: ``megatron.bridge.training.checkpointing._load_checkpoint_from_path`` (remembers the
run being loaded into) and that module's ``read_run_config`` (Bridge reads the checkpoint's
config through it, rank 0 reading and broadcasting, before any tensor is loaded).

Verdict: the record's (``patches/record.py``): applied over every recorded build, checked by the
fingerprint of each object it wraps; never decided by reading upstream's source.
"""

from __future__ import annotations

from typing import Any

from nemo_lw_fp8.mechanics import checkpointing
from nemo_lw_fp8.patches.bridge_support import bridge_module, register_bridge_patch, wrap_own
from nemo_lw_fp8.patches.framework import Override

FEATURE = "bridge_checkpoint_compat"
_CHECKPOINTING = "megatron.bridge.training.checkpointing"


def _make_load(original):
    def _load_checkpoint_from_path(load_dir: str, state: Any, *args: Any, **kwargs: Any) -> Any:
        with checkpointing.loading_into(state.cfg, load_dir):
            return original(load_dir, state, *args, **kwargs)

    _load_checkpoint_from_path.__wrapped__ = original  # type: ignore[attr-defined]
    return _load_checkpoint_from_path


def _make_read(original):
    def read_run_config(run_config_filename: str) -> dict[str, Any]:
        run_config = original(run_config_filename)
        checkpointing.check_loadable(run_config, run_config_filename)
        return run_config

    read_run_config.__wrapped__ = original  # type: ignore[attr-defined]
    return read_run_config


def _build_overrides() -> list[Override]:
    module = bridge_module(_CHECKPOINTING)
    # _make_load is looked up here, at build time: tests/support/bridge_run.py replaces it.
    return [
        wrap_own(module, "_load_checkpoint_from_path", _make_load),
        wrap_own(module, "read_run_config", _make_read),
    ]


PATCH = register_bridge_patch(
    FEATURE,
    "Megatron-Bridge refuses a checkpoint of another model, FP8 / FP4 recipe or optimizer",
    _build_overrides,
)
