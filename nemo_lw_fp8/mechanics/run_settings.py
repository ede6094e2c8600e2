"""What the plugin does for one layer-wise optimizer, read where megatron itself reads it.

A run can be configured through megatron-training's args, Megatron-Bridge's ``ConfigContainer``
or megatron-core's configs directly, and megatron-core accepts FP8 settings in several places:
DDP's buffers read the DDP config (``fp8_param_gather``, ``reuse_grad_buf_for_mxfp8_param_ag``,
``overlap_param_gather``); TE and megatron's FP8 helpers read the parameters' own quantized
types and the model's ``TransformerConfig`` (``fp8``, ``fp8_recipe``); the optimizers read
``OptimizerConfig``. A megatron-core user may leave ``OptimizerConfig.fp8_recipe`` unset (0.19.2
accepts that), so the optimizer config alone is not the truth. :func:`read` builds the guards'
view of one built optimizer from all of them, each value from where megatron reads it and with
its source recorded (a guard's message names the field it read), and :func:`stages_in_grad_buffer`
decides the MXFP8 staging path from the same sources, so every caller (Bridge,
megatron-training, megatron-core direct) gets the same decision.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from nemo_lw_fp8 import config as plugin_config
from nemo_lw_fp8 import rules as guards

#: TE's quantized parameter classes -> the FP8 recipe that builds them.
_RECIPE_OF_CLASS = {
    "MXFP8Tensor": "mxfp8",
    "Float8BlockwiseQTensor": "blockwise",
    "Float8Tensor": "tensorwise",
    "NVFP4Tensor": "nvfp4",
}


def _quantized_class(param: torch.Tensor) -> str | None:
    """The TE quantized-tensor class behind ``param`` (None for a plain tensor)."""
    data = param.data if isinstance(param, torch.nn.Parameter) else param
    for candidate in (param, data):
        for cls in type(candidate).__mro__:
            if cls.__name__ in _RECIPE_OF_CLASS:
                return cls.__name__
    for member in getattr(data, "quantized_tensors", None) or ():  # a GroupedTensor's members
        found = _quantized_class(member)
        if found is not None:
            return found
    return None


def params_recipe(params: Iterable[torch.Tensor]) -> tuple[str | None, str | None]:
    """The FP8 recipe the parameters themselves were built with, and the class that says so."""
    for param in params:
        name = _quantized_class(param)
        if name is not None:
            return _RECIPE_OF_CLASS[name], name
    return None, None


def _layer_wise_params(optimizer: Any) -> list[torch.Tensor]:
    return [
        param
        for chunk in optimizer.model_chunks
        for param in chunk.module.parameters()
        if getattr(param, "is_managed_by_layer_wise_optimizer", False)
    ]


def _model_config(optimizer: Any) -> Any:
    if not optimizer.model_chunks:
        return None
    from megatron.core.utils import get_model_config

    try:
        return get_model_config(optimizer.model_chunks[0])
    except (AttributeError, RuntimeError):
        return None


def read(optimizer: Any) -> guards.Settings:
    """The guards' view of a built layer-wise optimizer, each value from where megatron reads it.

    Order of the FP8 recipe: the parameters' quantized type, then ``TransformerConfig.fp8_recipe``
    (when ``TransformerConfig.fp8`` is on), then ``OptimizerConfig.fp8_recipe``.
    """
    ddp_config = optimizer.model_chunks[0].ddp_config if optimizer.model_chunks else None
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def take(name: str, owner: Any, field: str, label: str) -> None:
        if owner is not None and hasattr(owner, field):
            values[name] = getattr(owner, field)
            sources[name] = f"{label}.{field}"

    opt_config = optimizer.config
    for name in ("optimizer", "bf16", "overlap_param_gather_with_optimizer_step",
                 "optimizer_cpu_offload", "num_distributed_optimizer_instances",
                 "use_distributed_optimizer"):
        take(name, opt_config, name, "OptimizerConfig")
    take("fp8_recipe", opt_config, "fp8_recipe", "OptimizerConfig")
    take("optimizer_fp8_recipe", opt_config, "fp8_recipe", "OptimizerConfig")
    for name in ("fp8_param_gather", "reuse_grad_buf_for_mxfp8_param_ag", "overlap_param_gather",
                 "use_megatron_fsdp", "num_distributed_optimizer_instances", "fp4_param_gather"):
        take(name, ddp_config, name, "DistributedDataParallelConfig")
    # DDP and the optimizer each read their own overlap and grad-buffer-reuse flags.
    values["ddp_overlap_param_gather"] = values.get("overlap_param_gather")
    take("overlap_param_gather", opt_config, "overlap_param_gather", "OptimizerConfig")

    model_config = _model_config(optimizer)
    for name in ("moe_single_grouped_weight", "moe_grouped_gemm",
                 "use_transformer_engine_op_fuser", "tensor_model_parallel_size",
                 "expert_tensor_parallel_size", "num_moe_experts", "hidden_size",
                 "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                 "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                 "multi_latent_attention", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                 "experimental_attention_variant", "attention_output_gate",
                 "context_parallel_size"):
        take(name, model_config, name, "TransformerConfig")
    if getattr(model_config, "fp4", None):
        # NVFP4 primary weights (TE builds them under megatron's fp4_param) and their recipe
        take("fp4_param", model_config, "fp4_param", "TransformerConfig")
        take("fp4_recipe", model_config, "fp4_recipe", "TransformerConfig")
    if getattr(model_config, "fp8", None):
        take("fp8", model_config, "fp8", "TransformerConfig")
        take("fp8_recipe", model_config, "fp8_recipe", "TransformerConfig")
    if values.get("moe_single_grouped_weight"):
        # The model is built: whether TE's switch took effect is read from the parameters (the
        # environment may have held it only while the model was built).
        from nemo_lw_fp8.mechanics import grouped

        # A pipeline stage without MoE layers (dense first layers, embedding) holds no routed
        # experts (megatron's MoELayer.experts): the stages that hold them judge.
        experts = [
            p
            for chunk in optimizer.model_chunks
            for name, p in chunk.module.named_parameters()
            if ".experts." in f".{name}"
        ]
        if experts:
            values["grouped_linear_single_param"] = any(map(grouped.is_grouped_weight, experts))
            sources["grouped_linear_single_param"] = "the built expert parameters"
        else:
            values["grouped_linear_single_param"] = True
            sources["grouped_linear_single_param"] = "no expert parameters on this rank"
    recipe, cls = params_recipe(_layer_wise_params(optimizer))
    if recipe is not None:
        values["fp8_recipe"] = recipe
        sources["fp8_recipe"] = f"the parameters' type ({cls})"

    has_layout = bool(getattr(optimizer, "use_buffer_param_sync", False))
    chosen = plugin_config.read(ddp_config)
    values["use_layer_wise_distributed_optimizer"] = True
    values["use_layer_wise_param_layout"] = has_layout
    stock_layout = "padded" if has_layout else "legacy"
    values["layer_wise_layout"] = chosen.layout if chosen is not None else stock_layout
    if chosen is not None:
        values.update(chosen.settings())
        for name in chosen.settings():
            sources[name] = "LayerWiseConfig"
    known = {field for field in guards.Settings.__dataclass_fields__}
    values = {name: value for name, value in values.items() if name in known}
    return guards.Settings(**values, sources=tuple(sorted(sources.items())))


def stages_in_grad_buffer(optimizer: Any) -> bool:
    """Whether this layer-wise optimizer gathers MXFP8 params through DDP's staging buffer.

    Read from the DDP config, where megatron's buffers decide to alias the param buffer on the
    grad buffer (``fp8_param_gather`` + ``reuse_grad_buf_for_mxfp8_param_ag``), and from the
    optimizer having a layer-wise param layout to stage into.
    """
    if not getattr(optimizer, "use_buffer_param_sync", False):
        return False
    return any(
        getattr(chunk.ddp_config, "fp8_param_gather", False)
        and getattr(chunk.ddp_config, "reuse_grad_buf_for_mxfp8_param_ag", False)
        for chunk in optimizer.model_chunks
    )
