"""One wrapper of ``LayerWiseDistributedOptimizer.__init__`` that runs the features' steps.

Behaviour: megatron's ``__init__`` runs under ``torch.no_grad()`` with the model chunks recorded
first (the compact layout shards before megatron stores them), then the steps that applied
features put into :data:`nemo_lw_fp8.mechanics.lifecycle.AFTER_INIT` (the rules and MXFP8
gather's masters, the blockwise gather's plans). Features add and remove their steps with their
own patches; this one only hosts them, so ``__init__`` is wrapped once however many features are
on.

Mirrors: no upstream change (megatron-core has no extension point at that place).

Patches: ``LayerWiseDistributedOptimizer.__init__``.

Verdict: the record's (``patches/record.py``): applied over every recorded build, checked by the
fingerprint of each object it wraps; never decided by reading upstream's source.
"""

from __future__ import annotations

from nemo_lw_fp8.mechanics import lifecycle
from nemo_lw_fp8.patches.framework import Override, Patch, register

FEATURE = "layer_wise_init"


def _make_init(original_init):
    def __init__(
        self, optimizers, config, pg_collection=None, init_state_fn_list=None, model_chunks=None
    ):
        lifecycle.build(
            original_init,
            self,
            optimizers,
            config,
            pg_collection,
            init_state_fn_list,
            model_chunks=model_chunks,
        )

    __init__.__wrapped__ = original_init
    return __init__


def _build_overrides() -> list[Override]:
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    lw = LayerWiseDistributedOptimizer
    return [Override(lw, "__init__", _make_init(lw.__dict__["__init__"]))]


PATCH = register(
    Patch(
        name=FEATURE,
        upstream_pr=0,
        summary="one wrapper of the layer-wise optimizer's __init__ for the features' steps",
        build_overrides=_build_overrides,
    )
)
