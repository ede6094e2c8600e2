"""The steps features add around ``LayerWiseDistributedOptimizer.__init__``.

Several features need to act when the layer-wise optimizer is built: the guards check the final
configuration, MXFP8 gather builds masters from TE's init values and registers re-staging, the
blockwise gather plans its collectives. Rather than each wrapping ``__init__`` in turn, one
wrapper (``patches/layer_wise_init.py``) runs the steps that the applied features put into
:data:`AFTER_INIT` (each feature's patch adds its step as an ``Override`` on that table, so
reverting the feature takes its step away). Steps run in the order of :data:`ORDER`, after the
masters of TP-duplicated weights lose the partition dimension TE tagged them with
(:mod:`.tp_duplicated`: Muon orthogonalizes them whole, as at TP 1). Last, whatever the features,
the masters of quantized weights are made to follow model-only loads
(:func:`.pretrained_load.follow_model_loads`: a pretrained checkpoint loaded into FP8 / FP4
weights).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nemo_lw_fp8.mechanics import pretrained_load, tp_duplicated
from nemo_lw_fp8.state import optimizer_state


class StepTable:
    """Named steps ``fn(optimizer)``; a feature's step is an attribute set while it is applied."""

    def steps(self, order: tuple[str, ...]) -> list[Callable[[Any], None]]:
        return [getattr(self, name) for name in order if name in self.__dict__]


#: Steps run after megatron's ``__init__`` returns, by feature.
AFTER_INIT = StepTable()

#: Their order: the rules first, then each gather's set-up.
ORDER: tuple[str, ...] = ("muon_fp8_param_gather", "blockwise_fp8_param_gather", "compact_layout")


def build(original_init: Callable, optimizer: Any, *args: Any, model_chunks: Any = None) -> None:
    """megatron's ``__init__``, then every feature's step.

    The chunks are recorded first: megatron stores them only after ``shard_params``, which the
    compact layout needs them for. Masters are built without autograd: ``.float()`` of an MXFP8
    param under grad mode yields a view made inside a custom Function, which breaks in-place
    optimizer steps.
    """
    optimizer_state(optimizer).model_chunks = model_chunks
    with torch.no_grad():
        original_init(optimizer, *args, model_chunks)
    # Before any step derives stand-ins from the masters: a TP-duplicated weight's master must
    # not carry the partition dimension TE tagged it with (mechanics/tp_duplicated.py).
    tp_duplicated.unpartition_duplicated_masters(optimizer)
    for step in AFTER_INIT.steps(ORDER):
        step(optimizer)
    pretrained_load.follow_model_loads(optimizer)
