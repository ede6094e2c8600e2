"""Model-only loads into FP8 / FP4 weights: the fp32 masters start from the loaded values.

Why: continued pretraining loads a checkpoint's weights into a model whose optimizer is already
built (Bridge's ``checkpoint.pretrained_checkpoint``: a fine-tune load, model only, then
``optimizer.reload_model_params()``; the same for any load without optimizer state). A weight
kept in FP8 / FP4 (FP8 param gather) holds the loaded value quantized, and megatron's model ->
master copy reads the weight: its fp32 master would start from the quantized value (measured on
MXFP8: 93.8% of the elements off, median 2.3%), while with FP8 param gather off the bf16 weight's
master starts from the loaded value itself. ON and OFF would train different models from the
first step. Three pieces make the masters the loaded values:

* :func:`keep_precision` (called by ``patches/pretrained_load_masters.py`` around
  ``dist_checkpointing.load``): a load whose sharded state dict brings no optimizer state reads
  quantized weights into plain tensors of their nominal dtype, as megatron-core's own load does
  when ``stream_ckpt_dequant`` is off (``force_all_tensors_to_non_fp8``), and the plugin's
  single grouped expert weights likewise (:func:`~.grouped_checkpoint.plain_for_loading`);
  otherwise the checkpoint's values are quantized inside the load and lost;
* :func:`follow_model_loads` (when the layer-wise optimizer is built,
  :mod:`.lifecycle`): each module holding a quantized weight keeps, while a model state dict is
  loaded into it, the value it is given (:func:`_remember_loaded`);
* the optimizer's ``reload_model_params`` then builds those masters from the kept values (each
  piece its part: an expert run its experts, a Q/K/V part its rows) and re-derives the FP8 / FP4
  weights from the new masters through the gather a step runs
  (:func:`.checkpointing.rederive_weights_from_masters`).

A load with optimizer state (a resume) is left alone: its masters come from that state, and the
optimizer's load drops any kept value (:func:`forget_loaded_values`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from nemo_lw_fp8.mechanics import checkpointing, expert_slices, grouped_checkpoint, qkv_parts
from nemo_lw_fp8.mechanics.masters import float16_children, model_main_pairs
from nemo_lw_fp8.state import optimizer_state

# --------------------------------------------------------------------------- the read


def is_model_only(sharded_state_dict: Any) -> bool:
    """Whether a load brings model weights and no optimizer state (``model`` / ``model<i>``
    entries, no ``optimizer``)."""
    if not isinstance(sharded_state_dict, dict) or "optimizer" in sharded_state_dict:
        return False
    return any(str(key).startswith("model") for key in sharded_state_dict)


def keep_precision(sharded_state_dict: Any) -> None:
    """Before a model-only load: every quantized weight's entry reads into a plain tensor of the
    weight's nominal dtype (its current value dequantized, overwritten by the load), so the
    loaded state dict holds the checkpoint's values, not their FP8 / FP4 casts. The model's
    ``load_state_dict`` then quantizes them into the weights as the load itself would have."""
    if not is_model_only(sharded_state_dict):
        return
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.fp8_utils import is_float8tensor

    for key, section in sharded_state_dict.items():
        if not str(key).startswith("model"):
            continue
        for entry in nested_values(section):
            if isinstance(entry, ShardedTensor) and is_float8tensor(entry.data):
                entry.data = entry.data.dequantize()
            elif grouped_checkpoint.is_grouped_factory(entry):
                grouped_checkpoint.plain_for_loading(entry)


# --------------------------------------------------------------------------- the kept values


def _remember_loaded(
    kept: dict[int, torch.Tensor],
    module: torch.nn.Module,
    state_dict: dict,
    prefix: str,
    *_: Any,
) -> None:
    """Load pre-hook of a module holding quantized weights: keep in ``kept``, per such weight,
    the value the load is about to quantize into it, cast to the weight's nominal dtype (what a
    bf16 weight holds after the same load)."""
    for name, param in module._parameters.items():
        value = state_dict.get(prefix + name)
        if param is None or value is None or not expert_slices.uses_quantized_storage(param):
            continue
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            continue  # a quantized tensor (read into the weight itself): nothing finer to keep
        kept[id(param)] = value.detach().to(param.dtype).reshape(param.shape)


def loaded_value(kept: dict[int, torch.Tensor], param: torch.Tensor) -> torch.Tensor | None:
    """The value the last model load brought for ``param``'s weight, for this piece (an expert
    run's experts, a Q/K/V part's rows); ``None`` when no load has brought one since the masters
    were last rebuilt."""
    value = kept.get(id(expert_slices.parent_of(param)))
    if value is None:
        return None
    if expert_slices.is_slice(param):
        return expert_slices.slice_init_value(param, value)
    if qkv_parts.is_part(param):
        return qkv_parts.init_value(param, value)
    return value


def forget_loaded_values(optimizer: Any) -> None:
    """Drop the values kept for ``optimizer``'s weights (its masters were rebuilt, from them or
    from the optimizer's own checkpoint state)."""
    optimizer_state(optimizer).loaded_values.clear()


def masters_from_loaded_values(optimizer: Any) -> int:
    """Each master of a quantized weight a model load brought a value for takes that value;
    how many did."""
    kept = optimizer_state(optimizer).loaded_values
    taken = 0
    for child in float16_children(optimizer):
        for model_param, main_param in model_main_pairs(child):
            value = loaded_value(kept, model_param)
            if value is not None:
                main_param.data.copy_(value.to(main_param.device).view(main_param.shape))
                taken += 1
    return taken


def follow_model_loads(optimizer: Any) -> None:
    """Make the masters of ``optimizer``'s quantized weights follow model-only loads (the module
    docstring): the load hooks, and ``reload_model_params`` building masters from what they
    kept. ``reload_model_params(state_dict=...)`` (Bridge's
    ``checkpoint.load_main_params_from_ckpt``) ends the same way: the kept values are that state
    dict's model entries, loaded a moment before (megatron's own children cannot read a state
    dict: their copy asserts it is ``None``)."""
    record = optimizer_state(optimizer)
    if record.follows_model_loads or not float16_children(optimizer):
        return
    record.follows_model_loads = True
    holders = {
        id(module): module
        for chunk in optimizer.model_chunks
        for module in chunk.modules()
        if any(
            param is not None and expert_slices.uses_quantized_storage(param)
            for param in module._parameters.values()
        )
    }
    for module in holders.values():
        module.register_load_state_dict_pre_hook(
            functools.partial(_remember_loaded, record.loaded_values)
        )
    original_reload = optimizer.reload_model_params

    def reload_model_params(state_dict: Any = None) -> None:
        if not record.loaded_values:
            original_reload(state_dict)
            return
        original_reload(None)
        with torch.no_grad():
            masters_from_loaded_values(optimizer)
            checkpointing.rederive_weights_from_masters(optimizer)
        forget_loaded_values(optimizer)

    optimizer.reload_model_params = reload_model_params
