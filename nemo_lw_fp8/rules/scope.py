"""Rules for settings outside what the plugin was built and tested for.

A layer-wise run with one of these settings is not known to be wrong, but nothing in the suite
runs it, so the plugin refuses it at configuration time instead of letting it fail (or, worse,
train differently) later. :mod:`nemo_lw_fp8.rules` lists these rules with every other one; the
functions read a :class:`nemo_lw_fp8.rules.Settings` by attribute only, so this module imports
nothing from there.
"""

from __future__ import annotations

from typing import Any

#: The checkpoint format every layer-wise save / load path of the plugin is built and tested for.
TESTED_CKPT_FORMAT = "torch_dist"


def layer_wise_context_parallel(s: Any) -> str | None:
    """Rule ``layer-wise-context-parallel``: context parallelism > 1 with layer-wise Muon."""
    cp = s.context_parallel_size or 1
    if s.layer_wise and cp > 1:
        return (
            f"context_parallel_size={cp} with layer-wise Muon is not tested by nemo_lw_fp8 "
            "(its data-parallel ownership, owner reduce and FP8 gather run over the "
            "data-parallel group only). Fix: set model.context_parallel_size=1 "
            "(--context-parallel-size 1), or use Adam with the distributed optimizer for "
            "long-context runs."
        )
    return None


def layer_wise_ckpt_format(s: Any) -> str | None:
    """Rule ``layer-wise-checkpoint-format``: a checkpoint format other than ``torch_dist``."""
    fmt = s.ckpt_format
    if s.layer_wise and fmt is not None and fmt != TESTED_CKPT_FORMAT:
        return (
            f"checkpoint.ckpt_format={fmt!r}: nemo_lw_fp8 saves and resumes layer-wise runs "
            f"in {TESTED_CKPT_FORMAT!r} only; no other format is tested to resume to the same "
            "bits (docs/checkpointing.md). Fix: set checkpoint.ckpt_format=torch_dist "
            "(--ckpt-format torch_dist)."
        )
    return None
