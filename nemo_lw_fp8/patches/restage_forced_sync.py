"""Re-stage layer-wise MXFP8 masters whenever the shared grad/param buffer is zeroed.

Behaviour: with ``reuse_grad_buf_for_mxfp8_param_ag`` and ``overlap_param_gather``, the bf16
staging buffer of the MXFP8 all-gather *is* the grad buffer, so every ``zero_grad_buffer()``
wipes what the optimizer staged; the gather that follows (the next forward's pre-hooks, an eval's
forced sync, a checkpoint save's ``force_param_sync``, the paged-stash rerun) would ship zeros
and the weights would freeze. megatron-core 0.19.2 re-stages only ``DistributedOptimizer``.

Mirrors Megatron-LM PR #4994 (merged on dev, native in 0.19.2 for DistributedOptimizer) and area
2b of PR #4987, extended to ``LayerWiseDistributedOptimizer``. Instead of editing each call site
(megatron's and Megatron-Bridge's ``train_step``, ``evaluate``, ``force_param_sync``, the paged
stash), the re-stage hangs on the one mechanism they share: after a DDP chunk zeroes its buffers
while its forward pre-hooks will gather, the layer-wise optimizers registered on that chunk
re-stage their masters. It also fixes the ordering hazard of
``ChainedOptimizer.prepare_model_params_for_param_sync`` (it staged only DistOpt children and its
``zero_grad_buffer()`` ran after, wiping LayerWise staging): it now zeroes once, then stages every
child that stages.

Gathers that no zero precedes: megatron-training's and Megatron-Bridge's loops disable the
pre-hooks (forced sync, re-stage first) around an eval or a save only when
``use_distributed_optimizer`` is on; a layer-wise run has it off, so its evals run with the
pre-hooks on, right after a step, without a zero or a forced sync. Under grad-buffer reuse with
overlapped gathers the step stages nothing itself (DistOpt's step skips its master -> param
buffer copy, "called in the training loop"; the layer-wise step defers too), so those pre-hooks
gathered what the buffers held: DistOpt params one step stale (whole bf16 param buffer) or the
gradients (buffers shared with the grad buffer, e.g. padded layer-wise buckets: NaN). Each such
step now marks its optimizer unstaged (the layer-wise step in :mod:`.muon_fp8_param_gather`);
a DDP chunk's forward (pre-hooks on) or ``start_param_sync`` stages the marked optimizers before
any gather; every staging clears the mark, so the training loop's own staging leaves nothing to
do.

Patches: ``DistributedDataParallel.zero_grad_buffer``, ``.forward``, ``.start_param_sync``,
``ChainedOptimizer.prepare_model_params_for_param_sync``,
``DistributedOptimizer.step_with_ready_grads`` and ``._copy_main_params_to_param_buffer``; adds
``DistributedDataParallel._nemo_lw_fp8_register_restager``.

Detection: native when ``LayerWiseDistributedOptimizer`` defines
``prepare_model_params_for_param_sync`` itself and megatron's ``force_param_sync`` takes the
optimizer (upstream then re-stages the layer-wise optimizer at its call sites).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .framework import Override, Patch, register
from .muon_fp8_param_gather import UNSTAGED_ATTR

FEATURE = "restage_forced_sync"


def _detect_native() -> tuple[bool, str]:
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    from ..upstream import _defines, change

    native_distopt, reason = change(4994).detect()
    if not native_distopt:
        return False, reason
    if not _defines(LayerWiseDistributedOptimizer, "prepare_model_params_for_param_sync"):
        return False, "forced syncs re-stage DistributedOptimizer only, not the layer-wise one"
    return True, "forced syncs re-stage every optimizer"


def _pre_hooks_enabled(chunk: Any) -> bool:
    return len(getattr(chunk, "remove_forward_pre_hook_handles", {})) > 0


def restage_after_zero(chunk: Any) -> None:
    """Re-stage the masters of layer-wise optimizers on ``chunk`` after its buffers were zeroed."""
    from .muon_fp8_param_gather import fp8_gather_active, stage_owned_masters

    config = chunk.ddp_config
    if not (config.reuse_grad_buf_for_mxfp8_param_ag and config.overlap_param_gather):
        return
    # With the pre-hooks off (e.g. megatron's first iteration) no gather follows, and staged
    # bytes would pollute the gradients accumulated into the same buffer.
    if not _pre_hooks_enabled(chunk):
        return
    for ref in getattr(chunk, "_nemo_lw_fp8_restagers", ()):
        optimizer = ref()
        if optimizer is not None and fp8_gather_active(optimizer):
            stage_owned_masters(optimizer)


#: On a DDP chunk: weak references to the DistributedOptimizers whose steps left staging to the
#: loop (the layer-wise ones are its restagers).
_DEFERRED_ATTR = "_nemo_lw_fp8_deferred_stagers"


def distopt_defers_staging(optimizer: Any) -> bool:
    """Whether a DistributedOptimizer's step skipped its master -> param buffer copy (megatron
    leaves it to the training loop under grad-buffer reuse with overlapped gathers)."""
    if getattr(optimizer, "is_stub_optimizer", False):
        return False
    config = optimizer.config
    return bool(config.reuse_grad_buf_for_mxfp8_param_ag and config.overlap_param_gather)


def stage_if_unstaged(chunk: Any) -> None:
    """Before a gather on ``chunk``: stage the optimizers whose last step is not staged yet.

    Staging writes only each rank's own slots, so nothing else in the buffers (another
    optimizer's staging, the other slots) is touched; no gather is in flight after a step.
    """
    refs = [*getattr(chunk, "_nemo_lw_fp8_restagers", ()), *chunk.__dict__.get(_DEFERRED_ATTR, ())]
    for ref in refs:
        optimizer = ref()
        if optimizer is not None and optimizer.__dict__.get(UNSTAGED_ATTR, False):
            optimizer._copy_main_params_to_param_buffer()


def _make_distopt_step(original):
    def step_with_ready_grads(self) -> bool:
        success = original(self)
        if distopt_defers_staging(self):
            self.__dict__[UNSTAGED_ATTR] = True
            for chunk in self.model_chunks:
                refs = chunk.__dict__.setdefault(_DEFERRED_ATTR, [])
                if all(ref() is not self for ref in refs):
                    refs.append(weakref.ref(self))
        return success

    step_with_ready_grads.__wrapped__ = original
    return step_with_ready_grads


def _make_copy_to_param_buffer(original):
    def _copy_main_params_to_param_buffer(self) -> None:
        original(self)
        self.__dict__[UNSTAGED_ATTR] = False

    _copy_main_params_to_param_buffer.__wrapped__ = original
    return _copy_main_params_to_param_buffer


def _make_forward(original):
    def forward(self, *inputs, **kwargs):
        # The pre-hooks of this forward gather; a loop that zeroed and staged left nothing here.
        if _pre_hooks_enabled(self):
            stage_if_unstaged(self)
        return original(self, *inputs, **kwargs)

    forward.__wrapped__ = original
    return forward


def _make_start_param_sync(original):
    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False):
        stage_if_unstaged(self)
        return original(self, *unused, force_sync=force_sync, force_dispatch=force_dispatch)

    start_param_sync.__wrapped__ = original
    return start_param_sync


def _register_restager(self, optimizer: Any) -> None:
    restagers = self.__dict__.setdefault("_nemo_lw_fp8_restagers", [])
    if all(ref() is not optimizer for ref in restagers):
        restagers.append(weakref.ref(optimizer))


def _make_zero_grad_buffer(original):
    def zero_grad_buffer(self):
        original(self)
        restage_after_zero(self)

    zero_grad_buffer.__wrapped__ = original
    return zero_grad_buffer


def _stages(optimizer: Any) -> bool:
    return hasattr(optimizer, "_copy_main_params_to_param_buffer") and not getattr(
        optimizer, "is_stub_optimizer", False
    )


@torch.no_grad()
def prepare_chained(self) -> None:
    """Zero each model chunk once, then stage every child that stages (DistOpt and LayerWise)."""
    if not (self.config.reuse_grad_buf_for_mxfp8_param_ag and self.config.overlap_param_gather):
        for optimizer in self.chained_optimizers:
            optimizer.prepare_model_params_for_param_sync()
        return
    stagers = [opt for opt in self.chained_optimizers if _stages(opt)]
    for optimizer in self.chained_optimizers:
        if not _stages(optimizer) and not getattr(optimizer, "is_stub_optimizer", False):
            optimizer.prepare_model_params_for_param_sync()
    chunks: dict[int, Any] = {}
    for optimizer in stagers:
        for chunk in optimizer.model_chunks:
            chunks.setdefault(id(chunk), chunk)
    for chunk in chunks.values():
        chunk.zero_grad_buffer()
    for optimizer in stagers:
        optimizer._copy_main_params_to_param_buffer()


def _chained_prepare(self) -> None:
    # Called by name so the mutation tests can put the stock ordering back.
    prepare_chained(self)


def _build_overrides() -> list[Override]:
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    ddp, distopt = DistributedDataParallel, DistributedOptimizer
    copy_name = "_copy_main_params_to_param_buffer"
    return [
        Override(ddp, "zero_grad_buffer", _make_zero_grad_buffer(ddp.__dict__["zero_grad_buffer"])),
        Override(ddp, "_nemo_lw_fp8_register_restager", _register_restager),
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


def original_chained_prepare():
    """megatron-core's own ``ChainedOptimizer.prepare_model_params_for_param_sync``."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    from .framework import original

    return original(ChainedOptimizer, "prepare_model_params_for_param_sync")


PATCH = register(
    Patch(
        name=FEATURE,
        upstream_pr=4994,
        summary="re-stage layer-wise MXFP8 masters after every zero_grad_buffer / forced sync",
        detect_native=_detect_native,
        build_overrides=_build_overrides,
        requires=("muon_fp8_param_gather",),
    )
)
