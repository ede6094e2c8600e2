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

Patches: ``DistributedDataParallel.zero_grad_buffer``,
``ChainedOptimizer.prepare_model_params_for_param_sync``; adds
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
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    ddp = DistributedDataParallel
    return [
        Override(ddp, "zero_grad_buffer", _make_zero_grad_buffer(ddp.__dict__["zero_grad_buffer"])),
        Override(ddp, "_nemo_lw_fp8_register_restager", _register_restager),
        Override(ChainedOptimizer, "prepare_model_params_for_param_sync", _chained_prepare),
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
