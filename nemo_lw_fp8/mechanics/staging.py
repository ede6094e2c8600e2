"""Staging: the bf16 cast of each rank's owned masters in DDP's param buffer, before a gather.

With ``reuse_grad_buf_for_mxfp8_param_ag`` the bf16 staging buffer of the MXFP8 all-gather *is*
the idle grad buffer. The layer-wise optimizer stages the masters it owns there
(:func:`stage_owned_masters`, #4987 area 2), the buffer is all-gathered, and every rank quantizes
the gathered values into its MXFP8 weights. Three hazards follow, each handled here:

* every ``zero_grad_buffer()`` wipes what was staged; when a gather follows (the next forward's
  pre-hooks, an eval's or a save's forced sync), the optimizers registered on that chunk stage
  again (:func:`restage_after_zero`; #4994, extended to the layer-wise optimizer);
* ``ChainedOptimizer.prepare_model_params_for_param_sync`` staged only DistOpt children and
  zeroed after them; :func:`prepare_chained` zeroes once, then stages every child;
* a step that leaves staging to the training loop (overlapped gathers) marks its optimizer
  unstaged (:func:`mark_unstaged`); a gather that no zero precedes (an eval with the pre-hooks
  on, as megatron-training and Bridge run layer-wise evals) stages it first
  (:func:`stage_if_unstaged`). Every staging clears the mark.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_lw_fp8.mechanics import expert_slices, masters, run_settings
from nemo_lw_fp8.state import add_weak, chunk_state, optimizer_state, peek


def fp8_gather_active(optimizer: Any) -> bool:
    """Whether this layer-wise optimizer gathers MXFP8 params through the staging buffer
    (decided where DDP's buffers decide it: :func:`.run_settings.stages_in_grad_buffer`)."""
    return run_settings.stages_in_grad_buffer(optimizer)


# --------------------------------------------------------------------------- the unstaged mark


def mark_unstaged(optimizer: Any) -> None:
    optimizer_state(optimizer).unstaged = True


def clear_unstaged(optimizer: Any) -> None:
    optimizer_state(optimizer).unstaged = False


def is_unstaged(optimizer: Any) -> bool:
    record = peek(optimizer)
    return bool(record is not None and record.unstaged)


# --------------------------------------------------------------------------- staging


def _param_slots(optimizer: Any) -> dict[torch.Tensor, tuple[Any, int, int]]:
    """Each param of the optimizer's model chunks -> (bucket, start, end) in its param_data."""
    record = optimizer_state(optimizer)
    if record.param_slots is None:
        slots = {}
        for chunk in optimizer.model_chunks:
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                for bucket in buffer.buckets:
                    for param in bucket.params_list:
                        start, end = bucket.param_to_index[param]
                        slots[param] = (bucket, start, end)
        record.param_slots = slots
    return record.param_slots


def stage_owned_masters(optimizer: Any) -> None:
    """Write the bf16 cast of this rank's owned MXFP8 masters into the DDP param buffer."""
    slots = _param_slots(optimizer)
    for child in masters.float16_children(optimizer):
        for model_param, main_param in masters.model_main_pairs(child):
            quantized = expert_slices.uses_quantized_storage(model_param)
            if not quantized or expert_slices.is_part_of_weight(model_param):
                continue  # parts of weights exist on compact buckets only, which pack themselves
            bucket, start, end = slots[model_param]
            if bucket.param_data is None:
                continue  # a compact-layout bucket: its gather packs masters itself
            bucket.param_data.view(-1)[start:end].copy_(main_param.detach().view(-1))
    # The buffer now holds new values: the next forward pre-hook must gather them again.
    for chunk in optimizer.model_chunks:
        chunk.reset_param_sync_dispatch_state()
    clear_unstaged(optimizer)


def copy_main_params_to_param_buffer(optimizer: Any) -> None:
    """The layer-wise optimizer's staging entry point, under DistributedOptimizer's name."""
    if fp8_gather_active(optimizer):
        stage_owned_masters(optimizer)


@torch.no_grad()
def prepare_for_forced_sync(optimizer: Any) -> None:
    """Before a forced param sync: zero the shared buffers, then stage the owned masters."""
    if not (fp8_gather_active(optimizer) and optimizer.config.overlap_param_gather):
        return
    for chunk in optimizer.model_chunks:
        chunk.zero_grad_buffer()
    optimizer._copy_main_params_to_param_buffer()


# --------------------------------------------------------------------------- re-staging


def register_restager(chunk: Any, optimizer: Any) -> None:
    """``optimizer`` stages into ``chunk``'s buffers: re-stage it after the chunk zeroes them."""
    add_weak(chunk_state(chunk).restagers, optimizer)


def register_deferred_stager(chunk: Any, optimizer: Any) -> None:
    """A DistributedOptimizer on ``chunk`` whose steps leave staging to the training loop."""
    add_weak(chunk_state(chunk).deferred_stagers, optimizer)


def pre_hooks_enabled(chunk: Any) -> bool:
    return len(getattr(chunk, "remove_forward_pre_hook_handles", {})) > 0


def restage_after_zero(chunk: Any) -> None:
    """Re-stage the masters of layer-wise optimizers on ``chunk`` after its buffers were zeroed."""
    config = chunk.ddp_config
    if not (config.reuse_grad_buf_for_mxfp8_param_ag and config.overlap_param_gather):
        return
    # With the pre-hooks off (e.g. megatron's first iteration) no gather follows, and staged
    # bytes would pollute the gradients accumulated into the same buffer.
    if not pre_hooks_enabled(chunk):
        return
    record = peek(chunk)
    for ref in record.restagers if record is not None else ():
        optimizer = ref()
        if optimizer is not None and fp8_gather_active(optimizer):
            stage_owned_masters(optimizer)


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
    record = peek(chunk)
    for optimizer in record.optimizers() if record is not None else ():
        if is_unstaged(optimizer):
            optimizer._copy_main_params_to_param_buffer()


def _stages(optimizer: Any) -> bool:
    return hasattr(optimizer, "_copy_main_params_to_param_buffer") and not getattr(
        optimizer, "is_stub_optimizer", False
    )


@torch.no_grad()
def prepare_chained(chained: Any) -> None:
    """Zero each model chunk once, then stage every child that stages (DistOpt and LayerWise)."""
    config = chained.config
    if not (config.reuse_grad_buf_for_mxfp8_param_ag and config.overlap_param_gather):
        for optimizer in chained.chained_optimizers:
            optimizer.prepare_model_params_for_param_sync()
        return
    stagers = [opt for opt in chained.chained_optimizers if _stages(opt)]
    for optimizer in chained.chained_optimizers:
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
