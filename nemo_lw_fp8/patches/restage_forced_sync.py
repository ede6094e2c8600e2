"""Re-stage layer-wise MXFP8 masters whenever the shared grad/param buffer is zeroed.

Behaviour: with ``reuse_grad_buf_for_mxfp8_param_ag`` and ``overlap_param_gather``, the bf16
staging buffer of the MXFP8 all-gather *is* the grad buffer, so every ``zero_grad_buffer()``
wipes what the optimizer staged; the gather that follows (the next forward's pre-hooks, an eval's
forced sync, a checkpoint save's ``force_param_sync``, the paged-stash rerun) would ship zeros
and the weights would freeze. megatron-core 0.19.2 re-stages only ``DistributedOptimizer``.
Instead of editing each call site (megatron's and Bridge's ``train_step``, ``evaluate``,
``force_param_sync``, the paged stash), the re-stage hangs on the one mechanism they share: after
a DDP chunk zeroes its buffers while its forward pre-hooks will gather, the layer-wise optimizers
registered on that chunk re-stage. ``ChainedOptimizer.prepare_model_params_for_param_sync`` zeroes
once, then stages every child (it staged DistOpt only, and zeroed after). Steps that leave staging
to the loop mark their optimizer; a DDP forward (pre-hooks on) or ``start_param_sync`` stages
marked optimizers first: megatron-training and Bridge run layer-wise evals with the pre-hooks on,
with no zero or forced sync before their gathers.
The mechanics: :mod:`nemo_lw_fp8.mechanics.staging`.

Mirrors Megatron-LM PR #4994 (native in 0.19.2 for DistributedOptimizer) and area 2b of PR
#4987, extended to ``LayerWiseDistributedOptimizer``.

Patches: ``DistributedDataParallel.zero_grad_buffer``, ``.forward``, ``.start_param_sync``,
``ChainedOptimizer.prepare_model_params_for_param_sync``,
``DistributedOptimizer.step_with_ready_grads`` and ``._copy_main_params_to_param_buffer``.

Verdict: the record's (``patches/record.py``). ``doctor`` also notes whether #4994's
DistributedOptimizer part is there (:func:`_detect_distopt_part`).
"""

from __future__ import annotations

from nemo_lw_fp8.mechanics import staging
from nemo_lw_fp8.patches import symbols
from nemo_lw_fp8.patches.framework import Override, Patch, register

FEATURE = "restage_forced_sync"


def _detect_distopt_part() -> tuple[bool, str]:
    distopt = symbols.module("megatron.core.optimizer.distrib_optimizer")
    if not distopt.has("DistributedOptimizer.prepare_model_params_for_param_sync"):
        return False, "DistributedOptimizer has no prepare_model_params_for_param_sync"
    try:
        training = symbols.module("megatron.training.training")
    except ModuleNotFoundError:
        return True, "DistributedOptimizer re-stages; megatron.training not installed to check"
    if "optimizer" not in training.parameters("force_param_sync"):
        return False, "megatron.training.force_param_sync does not take the optimizer"
    return True, "forced param syncs re-stage DistributedOptimizer masters first"


def _make_distopt_step(original):
    def step_with_ready_grads(self) -> bool:
        success = original(self)
        if staging.distopt_defers_staging(self):
            staging.mark_unstaged(self)
            for chunk in self.model_chunks:
                staging.register_deferred_stager(chunk, self)
        return success

    step_with_ready_grads.__wrapped__ = original
    return step_with_ready_grads


def _make_copy_to_param_buffer(original):
    def _copy_main_params_to_param_buffer(self) -> None:
        original(self)
        staging.clear_unstaged(self)

    _copy_main_params_to_param_buffer.__wrapped__ = original
    return _copy_main_params_to_param_buffer


def _make_forward(original):
    def forward(self, *inputs, **kwargs):
        # The pre-hooks of this forward gather; a loop that zeroed and staged left nothing here.
        if staging.pre_hooks_enabled(self):
            staging.stage_if_unstaged(self)
        return original(self, *inputs, **kwargs)

    forward.__wrapped__ = original
    return forward


def _make_start_param_sync(original):
    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False):
        staging.stage_if_unstaged(self)
        return original(self, *unused, force_sync=force_sync, force_dispatch=force_dispatch)

    start_param_sync.__wrapped__ = original
    return start_param_sync


def _make_zero_grad_buffer(original):
    def zero_grad_buffer(self):
        original(self)
        staging.restage_after_zero(self)

    zero_grad_buffer.__wrapped__ = original
    return zero_grad_buffer


def _chained_prepare(self) -> None:
    staging.prepare_chained(self)


def _build_overrides() -> list[Override]:
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    ddp, distopt = DistributedDataParallel, DistributedOptimizer
    copy_name = "_copy_main_params_to_param_buffer"
    return [
        Override(ddp, "zero_grad_buffer", _make_zero_grad_buffer(ddp.__dict__["zero_grad_buffer"])),
        # DDP inherits forward from _BaseDataParallel: wrap what instances resolve.
        Override(ddp, "forward", _make_forward(ddp.forward)),
        Override(ddp, "start_param_sync", _make_start_param_sync(ddp.__dict__["start_param_sync"])),
        Override(ChainedOptimizer, "prepare_model_params_for_param_sync", _chained_prepare),
        Override(
            distopt,
            "step_with_ready_grads",
            _make_distopt_step(distopt.__dict__["step_with_ready_grads"]),
        ),
        Override(distopt, copy_name, _make_copy_to_param_buffer(distopt.__dict__[copy_name])),
    ]


PATCH = register(
    Patch(
        name=FEATURE,
        upstream_pr=4994,
        upstream_title="re-stage masters before every forced param sync",
        summary="re-stage layer-wise MXFP8 masters after every zero_grad_buffer / forced sync",
        detect_upstream_part=_detect_distopt_part,
        build_overrides=_build_overrides,
        requires=("muon_fp8_param_gather",),
    )
)
