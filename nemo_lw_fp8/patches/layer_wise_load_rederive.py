"""A loaded layer-wise optimizer re-derives its weights from the loaded fp32 masters.

Behaviour: after ``LayerWiseDistributedOptimizer.load_state_dict`` has put the checkpoint's
masters in, every weight the optimizer manages is rebuilt from them through the same
master -> model copy and gather a step runs (:func:`nemo_lw_fp8.mechanics.checkpointing.
rederive_weights_from_masters`). A ``torch_dist`` save writes FP8 weights dequantized from
their rowwise copy, and the model's load re-quantizes both copies from those values, so
without this a resumed MXFP8 run's backward can read other columnwise bytes than the
uninterrupted run's (and a blockwise run other transposes). With it, resume is bitwise by
construction, on every load path (Bridge, megatron-training, ``dist_checkpointing`` directly),
since all of them end in the optimizer's ``load_state_dict`` after the model's.

Mirrors no upstream change (``upstream_pr=0``): megatron-core 0.19.2 trusts the model's own
checkpoint entries for the weights.

Patches: ``LayerWiseDistributedOptimizer.load_state_dict`` (which first puts back param groups
that a load shaped like the checkpoint's, :mod:`nemo_lw_fp8.mechanics.param_groups_load`).

Verdict: the record's (``patches/record.py``): applied over every recorded build, checked by the
fingerprint of each object it wraps; never decided by reading upstream's source.
"""

from __future__ import annotations

from nemo_lw_fp8.mechanics import checkpointing, param_groups_load, pretrained_load
from nemo_lw_fp8.patches.framework import Override, Patch, register

FEATURE = "layer_wise_load_rederive"


def _layer_wise_class():
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    return LayerWiseDistributedOptimizer


def _make_load_state_dict(original):
    def load_state_dict(self, state_dict):
        # Param groups a Bridge load shaped like the checkpoint's (another TP / EP split)
        # go back to this optimizer's own (:mod:`nemo_lw_fp8.mechanics.param_groups_load`).
        param_groups_load.fold_to_live(state_dict)
        original(self, state_dict)
        checkpointing.rederive_weights_from_masters(self)
        # The masters came from the optimizer's state: values the model's load kept for a
        # model-only load (mechanics.pretrained_load) are not needed.
        pretrained_load.forget_loaded_values(self)

    load_state_dict.__wrapped__ = original
    return load_state_dict


def _build_overrides() -> list[Override]:
    cls = _layer_wise_class()
    load = _make_load_state_dict(cls.__dict__["load_state_dict"])
    return [Override(cls, "load_state_dict", load)]


PATCH = register(
    Patch(
        name=FEATURE,
        upstream_pr=0,
        summary="a loaded layer-wise optimizer re-derives every weight from its fp32 masters",
        build_overrides=_build_overrides,
    )
)
