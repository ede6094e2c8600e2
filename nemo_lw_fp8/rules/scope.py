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


def _quantized_weights(s: Any) -> bool:
    """Whether the run keeps FP8 / FP4 weights (FP8 or FP4 param gather)."""
    return bool(s.fp8_param_gather or s.fp4_param_gather or s.fp4_param)


def hf_pretrained_route(s: Any) -> str | None:
    """Rule ``hf-pretrained-directory``: a Hugging Face directory as the pretrained checkpoint of
    a run with single grouped expert weights or FP8 / FP4 weights. Bridge converts it through
    its name mapping, which has no entry for single grouped weights (measured on Bridge 0.6.2:
    ``'NoneType' object has no attribute 'megatron_module'``) and copies values into quantized
    weights outside a model load, so the fp32 masters would start from the quantized values
    (``docs/checkpointing.md``)."""
    if not s.pretrained_checkpoint_is_hf:
        return None
    why = []
    if s.moe_single_grouped_weight:
        why.append("has no mapping for single grouped expert weights")
    if _quantized_weights(s):
        why.append("writes FP8 / FP4 weights whose fp32 masters would start from the quantized "
                   "values")
    if not why:
        return None
    return (
        "checkpoint.pretrained_checkpoint is a Hugging Face directory, and Bridge's conversion "
        f"of it {' and '.join(why)}. Fix: convert it first, nemo-lw-fp8 hf-import HF_DIR OUT "
        "--recipe <this recipe>, and set checkpoint.pretrained_checkpoint=OUT (docs/hf.md)."
    )


def hf_save_single_grouped(s: Any) -> str | None:
    """Rule ``hf-save-single-grouped``: Bridge's Hugging Face copy at every save, with single
    grouped expert weights (its name mapping has none for them: the save would stop)."""
    if s.also_save_hf_checkpoint and s.moe_single_grouped_weight:
        return (
            "checkpoint.also_save_hf_checkpoint=true with single grouped expert weights "
            "(model.moe_single_grouped_weight): Bridge's Hugging Face conversion has no mapping "
            "for them, so the save would stop. Fix: set checkpoint.also_save_hf_checkpoint=false "
            "and export a saved run with nemo-lw-fp8 hf-export RUN_DIR OUT (docs/hf.md)."
        )
    return None
