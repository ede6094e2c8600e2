"""Muon + MXFP8 parameter all-gather in ``LayerWiseDistributedOptimizer``.

Behaviour: with ``fp8_param_gather`` and ``reuse_grad_buf_for_mxfp8_param_ag``, the Muon-managed
weights stay persistent MXFP8 tensors; each rank updates the fp32 masters of the matrices it owns,
writes their bf16 cast into the DDP param buffer (aliased on the idle grad buffer), the buffer is
all-gathered, and every rank quantizes the gathered bf16 values into its MXFP8 weights. Training
is bitwise identical to FP8 param gather off (with the same FP8 compute).

Mirrors Megatron-LM PR #4987 (areas 1-4), adapted to megatron-core 0.19.2: master numerics
(:mod:`nemo_lw_fp8.mechanics.masters`), staging under DistributedOptimizer's method names
(:mod:`nemo_lw_fp8.mechanics.staging`), per-bucket ownership of mixed bucket groups
(:mod:`nemo_lw_fp8.mechanics.bucket_owners`), and the rules of :mod:`nemo_lw_fp8.rules` when the
optimizer is built and in megatron-training's ``validate_args``.

Patches: TE's ``_attach_high_precision_init_val`` (``module.base`` / ``module.grouped_linear``,
only when TE is already imported), the layer-wise optimizer's build step (a step of
``patches/layer_wise_init.py``), ``LayerWiseDistributedOptimizer.step_with_ready_grads`` and
``.start_param_sync_for_bucket_group_subset``, adds ``._copy_main_params_to_param_buffer`` and
``.prepare_model_params_for_param_sync``; ``DistributedOptimizer.
start_param_sync_for_bucket_group_subset``; ``ChainedOptimizer._enable_deferred_mxfp8_param_sync``;
``megatron.training.arguments.validate_args``.

Verdict: the record's (``patches/record.py``): applied over every recorded build, checked by the
fingerprint of each object it wraps; never decided by reading upstream's source.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_lw_fp8 import rules as guards
from nemo_lw_fp8.mechanics import bucket_owners, lifecycle, masters, run_settings, staging
from nemo_lw_fp8.patches.framework import Override, Patch, register

FEATURE = "muon_fp8_param_gather"


# --------------------------------------------------------------------------- wiring


def check_rules(optimizer: Any) -> None:
    """The plugin's rules on the optimizer as built, each setting read where megatron reads it
    (:func:`nemo_lw_fp8.mechanics.run_settings.read`)."""
    guards.check(run_settings.read(optimizer))


def set_up(optimizer: Any) -> None:
    """After the layer-wise optimizer is built: the rules, then MXFP8 gather's masters, inner
    step and re-staging registration."""
    check_rules(optimizer)
    if staging.fp8_gather_active(optimizer):
        masters.init_masters_from_high_precision(optimizer)
        masters.skip_requantize_on_inner_step(optimizer)
        for chunk in optimizer.model_chunks:
            staging.register_restager(chunk, optimizer)


def _make_step(original_step):
    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        if not staging.fp8_gather_active(self):
            return original_step(self)
        from megatron.core.optimizer.optimizer import ChainedOptimizer

        success = ChainedOptimizer.step_with_ready_grads(self)
        if not self.overlap_param_gather:
            # Stage, then gather now; with overlap the gather waits for the next forward and the
            # training loop re-stages after zero_grad_buffer() (mechanics.staging).
            self._copy_main_params_to_param_buffer()
            self.start_param_sync_for_bucket_group_subset()
        else:
            staging.mark_unstaged(self)
        return success

    step_with_ready_grads.__wrapped__ = original_step
    return step_with_ready_grads


def _lw_copy_main_params_to_param_buffer(self) -> None:
    staging.copy_main_params_to_param_buffer(self)


def _lw_prepare_model_params_for_param_sync(self) -> None:
    staging.prepare_for_forced_sync(self)


def _lw_start_param_sync_for_bucket_group_subset(self) -> None:
    bucket_owners.sync_owned(self.model_chunks, layer_wise=True)


def _distopt_start_param_sync_for_bucket_group_subset(self) -> None:
    bucket_owners.sync_owned(self.model_chunks, layer_wise=False)


def _chained_enable_deferred_mxfp8_param_sync(self) -> list[tuple[Any, Any]]:
    return bucket_owners.deferred_distopt_syncs(self)


def _make_validate_args(original_validate_args):
    """megatron-training's ``validate_args``, then the plugin's rules on the final args."""

    def validate_args(args, defaults=None):
        result = original_validate_args(args, {} if defaults is None else defaults)
        guards.check(guards.Settings.from_args(args))
        return result

    validate_args.__wrapped__ = original_validate_args
    return validate_args


def _training_overrides() -> list[Override]:
    """Hook megatron-training's argument validation when megatron.training is importable."""
    try:
        from megatron.training import arguments
    except ImportError:
        return []
    return [Override(arguments, "validate_args", _make_validate_args(arguments.validate_args))]


def _build_overrides() -> list[Override]:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    lw = LayerWiseDistributedOptimizer
    return [
        Override(lifecycle.AFTER_INIT, FEATURE, set_up),
        Override(lw, "step_with_ready_grads", _make_step(lw.__dict__["step_with_ready_grads"])),
        Override(
            lw,
            "start_param_sync_for_bucket_group_subset",
            _lw_start_param_sync_for_bucket_group_subset,
        ),
        Override(lw, "_copy_main_params_to_param_buffer", _lw_copy_main_params_to_param_buffer),
        Override(
            lw, "prepare_model_params_for_param_sync", _lw_prepare_model_params_for_param_sync
        ),
        Override(
            DistributedOptimizer,
            "start_param_sync_for_bucket_group_subset",
            _distopt_start_param_sync_for_bucket_group_subset,
        ),
        Override(
            ChainedOptimizer,
            "_enable_deferred_mxfp8_param_sync",
            _chained_enable_deferred_mxfp8_param_sync,
        ),
        *_training_overrides(),
    ]


PATCH = register(
    Patch(
        name=FEATURE,
        upstream_pr=4987,
        upstream_title="Muon + MXFP8 FP8 param gather in LayerWise",
        summary="Muon + MXFP8 param gather in LayerWiseDistributedOptimizer",
        build_overrides=_build_overrides,
        requires=("layer_wise_init",),
    )
)
