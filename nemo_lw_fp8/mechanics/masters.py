"""fp32 masters of FP8 (MXFP8, blockwise) weights under the layer-wise optimizer.

Two fixes, both from Megatron-LM PR #4987 (area 1), needed for FP8 param gather to train
bitwise like FP8 param gather off:

* a master starts from the high-precision init value TE keeps for a quantized weight, not from
  the dequantized FP8 bytes (:func:`init_masters_from_high_precision`). TE 2.20's modules keep
  that attribute through the module-wide casts every run does after building (their ``_apply``
  re-attaches what ``swap_tensors`` moves off a quantized parameter; the emulated modules do the
  same), so the attribute is read where the masters are built;
* the inner step does not re-quantize FP8 weights (the gather that follows writes them from the
  staged or shipped bf16 bytes anyway): :func:`skip_requantize_on_inner_step`.

A model-only load after the optimizer is built (``checkpoint.pretrained_checkpoint``) has masters
of its own: :mod:`.pretrained_load`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from nemo_lw_fp8.mechanics import expert_slices, qkv_parts


def float16_children(optimizer: Any) -> list[Any]:
    """The chained optimizers that keep fp32 masters of bf16/FP8 params."""
    return [
        child
        for child in optimizer.chained_optimizers
        if hasattr(child, "float16_groups") and not getattr(child, "is_stub_optimizer", False)
    ]


def model_main_pairs(child: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(model param, fp32 master) of one Float16 optimizer, in its order."""
    for model_group, main_group in zip(
        child.float16_groups, child.fp32_from_float16_groups, strict=True
    ):
        yield from zip(model_group, main_group, strict=True)


# --------------------------------------------------------------------------- init values

def preserved_init_value(param: torch.Tensor) -> torch.Tensor | None:
    """TE's high-precision init value of ``param`` (``None`` when TE kept none)."""
    getter = getattr(param, "get_high_precision_init_val", None)
    return getter() if getter is not None else None


def _stored(tensor: Any) -> list[tuple[str, torch.Tensor]]:
    """The FP8 copies a quantized tensor holds: (usage, bytes)."""
    out = []
    for usage, name in (("rowwise", "_rowwise_data"), ("columnwise", "_columnwise_data")):
        data = getattr(tensor, name, None)
        if data is not None:
            out.append((usage, data))
    return out


def _member_quantizes_to(tensor: Any, value: torch.Tensor) -> bool:
    quantizer = getattr(tensor, "_quantizer", None)
    stored = _stored(tensor)
    if quantizer is None or not stored:
        return True  # nothing to compare against
    usage, data = stored[0]
    fresh_quantizer = quantizer.copy()
    fresh_quantizer.set_usage(rowwise=usage == "rowwise", columnwise=usage == "columnwise")
    fresh = fresh_quantizer(value.to(device=data.device).reshape(tensor.shape).contiguous())
    fresh_data = dict(_stored(fresh)).get(usage)
    if fresh_data is None or fresh_data.shape != data.shape:
        return True  # another storage layout: not comparable here
    return torch.equal(fresh_data.view(torch.uint8), data.view(torch.uint8))


def quantizes_to_weight(param: Any, value: torch.Tensor) -> bool:
    """Whether TE's preserved init value quantizes to the FP8 bytes ``param`` holds (what TE's
    ``quantized_model_init`` guarantees when TE initialised the weight). A weight written later
    (megatron's ``use_cpu_initialization`` hands TE a no-op ``init_method`` and copies its own
    values in afterwards, leaving the init value as uninitialised memory; a load before the
    optimizer is built) fails, and a master started from the value would train other weights."""
    members = getattr(param, "quantized_tensors", None)
    if members is None and hasattr(param, "split_into_quantized_tensors"):
        members = param.split_into_quantized_tensors()
    if members is None:
        return _member_quantizes_to(param, value)
    values = value.reshape(len(members), -1)
    return all(_member_quantizes_to(m, v) for m, v in zip(members, values, strict=True))


def init_masters_from_high_precision(optimizer: Any) -> None:
    """Masters of quantized params take TE's preserved init values (an expert slice takes its
    experts' part of its grouped weight's value). TE's copy is then released, as megatron's
    DistributedOptimizer releases it once its masters are built."""
    used: dict[int, torch.Tensor] = {}
    for child in float16_children(optimizer):
        for model_param, main_param in model_main_pairs(child):
            if not expert_slices.uses_quantized_storage(model_param):
                continue
            parent = expert_slices.parent_of(model_param)
            value = preserved_init_value(parent)
            if value is None:
                continue
            if id(parent) not in used and not quantizes_to_weight(parent, value):
                raise ValueError(
                    f"a {type(parent).__name__} weight of shape {tuple(parent.shape)}: TE's "
                    "preserved high-precision init value does not quantize to its FP8 bytes (the "
                    "weight was written after TE initialised it), so its fp32 master cannot start "
                    "from it; fix: build with model.use_cpu_initialization=False (megatron then "
                    "lets TE initialise the weight) and load checkpoints after the optimizer is "
                    "built"
                )
            used[id(parent)] = parent
            if expert_slices.is_slice(model_param):
                value = expert_slices.slice_init_value(model_param, value)
            elif qkv_parts.is_part(model_param):
                value = qkv_parts.init_value(model_param, value)
            main_param.data.copy_(value.to(main_param.device).view(main_param.shape))
    for param in used.values():
        param.clear_high_precision_init_val()


# --------------------------------------------------------------------------- the inner step


def copy_non_quantized_main_params(child: Any) -> None:
    """The inner step's master -> model copy, for params that are not quantized."""
    for model_param, main_param in model_main_pairs(child):
        if not expert_slices.uses_quantized_storage(model_param):
            model_param.data.copy_(main_param.data)


def copy_model_params_to_main_params(child: Any, state_dict: Any = None) -> None:
    """megatron's model -> master copy (``reload_model_params``), reading expert slices and QKV
    parts from the weight they are part of (their own bf16 copy is released or stale)."""
    if state_dict is not None:
        raise AssertionError("Initialize main params from state dict is not supported")
    for model_param, main_param in model_main_pairs(child):
        if expert_slices.is_slice(model_param):
            values = expert_slices.model_values(model_param)
        elif qkv_parts.is_part(model_param):
            values = qkv_parts.model_values(model_param)
        else:
            values = model_param.data
        main_param.data.copy_(values)


def read_parts_from_their_weights(optimizer: Any) -> None:
    """megatron's model -> master copy reads QKV parts from their fused weight (a part's own
    bf16 copy is not the model's value: the gather writes the fused weight)."""
    for child in float16_children(optimizer):
        if any(qkv_parts.is_part(param) for param, _ in model_main_pairs(child)):
            child._copy_model_params_to_main_params = lambda state_dict=None, child=child: (
                copy_model_params_to_main_params(child, state_dict)
            )


def skip_requantize_on_inner_step(optimizer: Any) -> None:
    """The inner step leaves quantized params alone (the post-gather quantize sets them)."""
    for child in float16_children(optimizer):
        child._copy_main_params_to_model_params = lambda child=child: (
            copy_non_quantized_main_params(child)
        )
        child._copy_model_params_to_main_params = lambda state_dict=None, child=child: (
            copy_model_params_to_main_params(child, state_dict)
        )
        for model_param, _ in model_main_pairs(child):
            if expert_slices.is_slice(model_param):
                expert_slices.release_copy(model_param)
            elif qkv_parts.is_part(model_param):
                qkv_parts.release_copy(model_param)

