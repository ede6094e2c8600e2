"""Muon + MXFP8 parameter all-gather in ``LayerWiseDistributedOptimizer``.

Behaviour: with ``fp8_param_gather`` and ``reuse_grad_buf_for_mxfp8_param_ag``, the Muon-managed
weights stay persistent MXFP8 tensors; each rank updates the fp32 masters of the matrices it owns,
writes their bf16 cast into the DDP param buffer (aliased on the idle grad buffer), the buffer is
all-gathered, and every rank quantizes the gathered bf16 values into its MXFP8 weights. Training
is bitwise identical to FP8 param gather off (with the same FP8 compute).

Mirrors Megatron-LM PR #4987 (areas 1-4), adapted to megatron-core 0.19.2:

1. master numerics: the fp32 masters of MXFP8 params start from the high-precision init values
   TE keeps (not from dequantized FP8), and the inner step does not re-quantize MXFP8 params
   (the post-gather quantize overwrites them anyway);
2. staging: ``LayerWiseDistributedOptimizer._copy_main_params_to_param_buffer`` and
   ``prepare_model_params_for_param_sync`` under the names DistributedOptimizer uses;
   the step stages before its (non-overlapped) gather;
3. ownership: each optimizer gathers exactly the buckets it owns, decided per bucket, also in
   mixed bucket groups (LayerWise FP8 buckets + DistOpt bf16 buckets, from ``partition_buckets``
   case 3), in the LayerWise, DistOpt and ChainedOptimizer deferred-sync paths;
4. guards: :mod:`nemo_lw_fp8.guards` rules run when the optimizer is built.

Re-staging after ``zero_grad_buffer()`` and the chained ordering fix live in
:mod:`.restage_forced_sync` (#4994's extension).

Patches: TE's ``_attach_high_precision_init_val`` (``module.base`` and ``module.grouped_linear``;
only when TE is imported: init values also go into a table keyed by parameter, because the
module-wide ``bfloat16()`` / ``cuda()`` casts after building drop TE's attribute),
``LayerWiseDistributedOptimizer.__init__``,
``.step_with_ready_grads``,
``.start_param_sync_for_bucket_group_subset``, adds ``._copy_main_params_to_param_buffer`` and
``.prepare_model_params_for_param_sync``; ``DistributedOptimizer.
start_param_sync_for_bucket_group_subset``; ``ChainedOptimizer._enable_deferred_mxfp8_param_sync``;
``megatron.training.arguments.validate_args`` (runs the guards on the final args).

Detection: upstream has it when ``LayerWiseDistributedOptimizer`` defines both staging methods
itself and its bucket-group sync no longer decides ownership from ``buckets[0]``
(:func:`nemo_lw_fp8.upstream._detect_muon_fp8_param_gather`).

The fixes are module-level functions called by name at run time, so the mutation tests can switch
each one off on its own.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import guards
from ..upstream import change
from .framework import Override, Patch, register

FEATURE = "muon_fp8_param_gather"


# --------------------------------------------------------------------------- helpers


def _quantized(param: torch.Tensor) -> bool:
    """Whether ``param`` (an expert slice: its grouped weight) has MXFP8 storage."""
    from ..expert_slices import uses_quantized_storage

    return uses_quantized_storage(param)


def _owned_by_layer_wise(bucket: Any) -> bool:
    from megatron.core.optimizer.layer_wise_optimizer import (
        _bucket_is_managed_by_layer_wise_optimizer,
    )

    return _bucket_is_managed_by_layer_wise_optimizer(bucket, default_for_untagged=False)


def fp8_gather_active(optimizer: Any) -> bool:
    """Whether this layer-wise optimizer gathers MXFP8 params through the staging buffer."""
    config = optimizer.config
    if not getattr(config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        return False
    if not getattr(optimizer, "use_buffer_param_sync", False):
        return False
    return any(getattr(c.ddp_config, "fp8_param_gather", False) for c in optimizer.model_chunks)


def _float16_children(optimizer: Any) -> list[Any]:
    return [
        child
        for child in optimizer.chained_optimizers
        if hasattr(child, "float16_groups") and not getattr(child, "is_stub_optimizer", False)
    ]


def _model_main_pairs(child: Any):
    for model_group, main_group in zip(
        child.float16_groups, child.fp32_from_float16_groups, strict=True
    ):
        yield from zip(model_group, main_group, strict=True)


# --------------------------------------------------------------------------- 1. master numerics


def init_masters_from_high_precision(optimizer: Any) -> None:
    """Area 1a: masters of MXFP8 params take TE's preserved high-precision init values (an
    expert slice takes its experts' part of its grouped weight's value)."""
    from ..expert_slices import is_slice, parent_of, slice_init_value

    used = []
    for child in _float16_children(optimizer):
        for model_param, main_param in _model_main_pairs(child):
            if not _quantized(model_param):
                continue
            value = preserved_init_value(parent_of(model_param))
            if value is None:
                continue
            if is_slice(model_param):
                value = slice_init_value(model_param, value)
            main_param.data.copy_(value.to(main_param.device).view(main_param.shape))
            used.append(parent_of(model_param))
    for param in used:
        forget_init_value(param)


#: TE's preserved init values kept outside the tensor (see :func:`_make_attach_init_value`):
#: ``id(param) -> value``. No reference to the parameter is held (torch's ``swap_tensors``, which
#: ``Module._apply`` uses for tensor subclasses, refuses tensors with weak references), so a
#: lookup also checks the shape; entries are dropped once the masters are built.
_INIT_VALUES: dict[int, torch.Tensor] = {}


def _make_attach_init_value(original):
    """Area 1a, build side: remember each init value TE attaches, keyed by the parameter.

    TE keeps the value as a Python attribute of the parameter; the module-wide casts every run
    does after building (megatron's ``Float16Module`` ``module.bfloat16()``, Bridge's
    ``.cuda()``) go through ``Module._apply``, which swaps a quantized parameter's contents with
    the cast result (``torch.utils.swap_tensors``, ``__dict__`` included), and the attribute is
    gone: masters would silently start from the dequantized FP8 weights and diverge from FP8
    param gather off. The parameter object (its ``id``) survives, so a table keyed by it does.
    """

    def attach(parameter: torch.Tensor, value: torch.Tensor) -> None:
        original(parameter, value)
        _INIT_VALUES[id(parameter)] = value

    attach.__wrapped__ = original  # type: ignore[attr-defined]
    return attach


def preserved_init_value(param: torch.Tensor) -> torch.Tensor | None:
    """TE's high-precision init value of ``param``, from the tensor or the plugin's table."""
    getter = getattr(param, "get_high_precision_init_val", None)
    value = getter() if getter is not None else None
    if value is None:
        stored = _INIT_VALUES.get(id(param))
        if stored is not None and stored.shape == param.shape:
            value = stored
    return value


def forget_init_value(param: torch.Tensor) -> None:
    _INIT_VALUES.pop(id(param), None)


def _te_attach_overrides() -> list[Override]:
    """Wrap TE's attach helper where TE is already imported (never imports TE itself)."""
    import sys

    if "transformer_engine.pytorch" not in sys.modules:
        return []
    from transformer_engine.pytorch.module import base, grouped_linear

    attach = _make_attach_init_value(base.__dict__["_attach_high_precision_init_val"])
    overrides = [Override(base, "_attach_high_precision_init_val", attach)]
    if "_attach_high_precision_init_val" in grouped_linear.__dict__:
        overrides.append(Override(grouped_linear, "_attach_high_precision_init_val", attach))
    return overrides


def _copy_non_quantized_main_params(child: Any) -> None:
    """The inner step's master -> model copy, for params that are not MXFP8."""
    for model_param, main_param in _model_main_pairs(child):
        if not _quantized(model_param):
            model_param.data.copy_(main_param.data)


def _copy_model_params_to_main_params(child: Any, state_dict: Any = None) -> None:
    """megatron's model -> master copy (``reload_model_params``), reading expert slices of
    MXFP8 grouped weights from their grouped weight (their own bf16 copy is released)."""
    from ..expert_slices import is_slice, model_values

    if state_dict is not None:
        raise AssertionError("Initialize main params from state dict is not supported")
    for model_param, main_param in _model_main_pairs(child):
        values = model_values(model_param) if is_slice(model_param) else model_param.data
        main_param.data.copy_(values)


def skip_requantize_on_inner_step(optimizer: Any) -> None:
    """Area 1b: the inner step leaves MXFP8 params alone (the post-gather quantize sets them)."""
    from ..expert_slices import is_slice, release_copy

    for child in _float16_children(optimizer):
        child._copy_main_params_to_model_params = lambda child=child: (
            _copy_non_quantized_main_params(child)
        )
        child._copy_model_params_to_main_params = lambda state_dict=None, child=child: (
            _copy_model_params_to_main_params(child, state_dict)
        )
        for model_param, _ in _model_main_pairs(child):
            if is_slice(model_param):
                release_copy(model_param)


# --------------------------------------------------------------------------- 2. staging


def _param_slots(optimizer: Any) -> dict[torch.Tensor, tuple[Any, int, int]]:
    """Map each param of the optimizer's model chunks to (bucket, start, end) in param_data."""
    slots = getattr(optimizer, "_nemo_lw_fp8_param_slots", None)
    if slots is None:
        slots = {}
        for chunk in optimizer.model_chunks:
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                for bucket in buffer.buckets:
                    for param in bucket.params_list:
                        start, end = bucket.param_to_index[param]
                        slots[param] = (bucket, start, end)
        optimizer._nemo_lw_fp8_param_slots = slots
    return slots


#: True on an optimizer whose overlapped step left its new masters unstaged (the loop stages them
#: after its zero_grad_buffer(); see restage_forced_sync.stage_if_unstaged); staging clears it.
UNSTAGED_ATTR = "_nemo_lw_fp8_unstaged"


def stage_owned_masters(optimizer: Any) -> None:
    """Area 2a: write the bf16 cast of owned MXFP8 masters into the DDP param buffer."""
    from ..expert_slices import is_slice

    slots = _param_slots(optimizer)
    for child in _float16_children(optimizer):
        for model_param, main_param in _model_main_pairs(child):
            if not _quantized(model_param) or is_slice(model_param):
                continue  # expert slices exist on compact buckets only, which pack themselves
            bucket, start, end = slots[model_param]
            if bucket.param_data is None:
                continue  # a compact-layout bucket: its gather packs masters itself
            bucket.param_data.view(-1)[start:end].copy_(main_param.detach().view(-1))
    # The buffer now holds new values: the next forward pre-hook must gather them again.
    for chunk in optimizer.model_chunks:
        chunk.reset_param_sync_dispatch_state()
    optimizer.__dict__[UNSTAGED_ATTR] = False


def _lw_copy_main_params_to_param_buffer(self) -> None:
    if fp8_gather_active(self):
        stage_owned_masters(self)


@torch.no_grad()
def _lw_prepare_model_params_for_param_sync(self) -> None:
    """Before a forced param sync: zero the shared buffers, then stage the owned masters."""
    if not (fp8_gather_active(self) and self.config.overlap_param_gather):
        return
    for chunk in self.model_chunks:
        chunk.zero_grad_buffer()
    self._copy_main_params_to_param_buffer()


# --------------------------------------------------------------------------- 3. ownership


def owned_buckets(bucket_group: Any, layer_wise: bool) -> list[Any]:
    """Area 3a: the buckets of a group that the layer-wise (or the DistOpt) side owns."""
    return [b for b in bucket_group.buckets if _owned_by_layer_wise(b) == layer_wise]


def _sub_group(bucket_group: Any, buckets: list[Any]) -> Any:
    """A bucket group over a subset of ``bucket_group``'s buckets, for one synchronous gather."""
    if len(buckets) == len(bucket_group.buckets):
        return bucket_group
    return type(bucket_group)(
        buckets,
        bucket_group.ddp_config,
        bucket_group.intra_distributed_optimizer_instance_group,
        bucket_group.intra_distributed_optimizer_instance_size,
    )


def _sync_owned(model_chunks: list[Any], layer_wise: bool) -> None:
    for chunk in model_chunks:
        for bucket_group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            mine = owned_buckets(bucket_group, layer_wise)
            if mine:
                chunk._start_bucket_group_param_sync(
                    _sub_group(bucket_group, mine), force_sync=False
                )


def _lw_start_param_sync_for_bucket_group_subset(self) -> None:
    _sync_owned(self.model_chunks, layer_wise=True)


def _distopt_start_param_sync_for_bucket_group_subset(self) -> None:
    _sync_owned(self.model_chunks, layer_wise=False)


def _chained_enable_deferred_mxfp8_param_sync(self) -> list[tuple[Any, Any]]:
    """The deferred DistOpt sync, restricted per bucket to DistOpt-owned buckets."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    deferred: list[tuple[Any, Any]] = []
    seen: set[int] = set()
    for optimizer in self.chained_optimizers:
        if not isinstance(optimizer, DistributedOptimizer):
            continue
        optimizer._defer_param_sync = True
        for chunk in optimizer.model_chunks:
            for bucket_group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
                if id(bucket_group) in seen:
                    continue
                seen.add(id(bucket_group))
                mine = owned_buckets(bucket_group, layer_wise=False)
                if mine:
                    deferred.append((chunk, _sub_group(bucket_group, mine)))
    return deferred


# --------------------------------------------------------------------------- the optimizer


def _check_guards(optimizer: Any) -> None:
    ddp_config = optimizer.model_chunks[0].ddp_config if optimizer.model_chunks else None
    has_layout = bool(optimizer.use_buffer_param_sync)
    chosen = getattr(ddp_config, "nemo_lw_fp8_layer_wise_layout", None)
    settings = guards.Settings.from_megatron(
        optimizer.config,
        ddp_config,
        use_layer_wise_distributed_optimizer=True,
        use_layer_wise_param_layout=has_layout,
        layer_wise_layout=chosen or ("padded" if has_layout else "legacy"),
    )
    guards.check(settings)


def _make_init(original_init):
    def __init__(
        self, optimizers, config, pg_collection=None, init_state_fn_list=None, model_chunks=None
    ):
        # Build masters without autograd: ``.float()`` of an MXFP8 param under grad mode
        # yields a view made inside a custom Function, which breaks in-place optimizer steps.
        with torch.no_grad():
            original_init(self, optimizers, config, pg_collection, init_state_fn_list, model_chunks)
        _check_guards(self)
        if fp8_gather_active(self):
            init_masters_from_high_precision(self)
            skip_requantize_on_inner_step(self)
            for chunk in self.model_chunks:
                register = getattr(chunk, "_nemo_lw_fp8_register_restager", None)
                if register is not None:
                    register(self)

    __init__.__wrapped__ = original_init
    return __init__


def _make_step(original_step):
    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        if not fp8_gather_active(self):
            return original_step(self)
        from megatron.core.optimizer.optimizer import ChainedOptimizer

        success = ChainedOptimizer.step_with_ready_grads(self)
        if not self.overlap_param_gather:
            # Stage, then gather now; with overlap the gather waits for the next forward and
            # the training loop re-stages after zero_grad_buffer() (restage_forced_sync).
            self._copy_main_params_to_param_buffer()
            self.start_param_sync_for_bucket_group_subset()
        else:
            self.__dict__[UNSTAGED_ATTR] = True
        return success

    step_with_ready_grads.__wrapped__ = original_step
    return step_with_ready_grads


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
        *_te_attach_overrides(),
        Override(lw, "__init__", _make_init(lw.__dict__["__init__"])),
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
        summary="Muon + MXFP8 param gather in LayerWiseDistributedOptimizer",
        detect_native=change(4987).detect,
        build_overrides=_build_overrides,
    )
)
