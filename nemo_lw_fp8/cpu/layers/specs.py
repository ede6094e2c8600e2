"""Layer specs that let megatron-core's real GPT / MLA / MoE layers train with FP8 on CPU.

Part of the CPU backend (:mod:`nemo_lw_fp8.cpu`): used under ``--cpu`` and by the tests only.

Why
    With FP8 on, megatron builds Transformer Engine layers, whose GEMMs are CUDA kernels. On CPU
    we keep megatron's local (non-TE) decoder spec - its MLA attention, router, token dispatcher,
    shared experts, norms - and swap only the linear layers for the emulated linear of the
    ``fp8_recipe`` (:data:`FP8_LINEARS`): :class:`~nemo_lw_fp8.cpu.layers.mxfp8_linear.MXFP8Linear`
    (TE ``Linear``'s MXFP8 arithmetic, Blackwell recipes) or
    :class:`~nemo_lw_fp8.cpu.layers.blockwise_linear.BlockwiseFP8Linear` (``Float8BlockScaling``,
    Hopper recipes), both exactly emulated. Under megatron's ``get_fp8_context(is_init=True)``
    (TE's ``quantized_model_init``) their weights become TE ``MXFP8Tensor`` /
    ``Float8BlockwiseQTensor`` parameters, so megatron's and the plugin's FP8 param-gather paths
    see what they see on a GPU. Routed experts can be the single grouped weight of
    :mod:`nemo_lw_fp8.cpu.layers.grouped_experts` (MXFP8 only), else megatron's discrete experts.

Hybrid models (``experimental_attention_variant='gated_delta_net'``: Qwen3-Next, Qwen3.5) are
built layer by layer as megatron's own ``experimental_attention_variant_module_specs`` builds them
(TE-only upstream): megatron's local layers, with its ``GatedDeltaNet`` spec on the linear-attention
layers, whose fused input norm + ``in_proj`` (TE's ``LayerNormColumnParallelLinear``) is
:class:`~nemo_lw_fp8.cpu.layers.norm_linear.CPULayerNormColumnParallelLinear` here (as MLA's fused
Q / KV norms); fla's kernels are the references of
:mod:`nemo_lw_fp8.cpu.megatron.gated_delta_rule`. Zero-centred RMSNorm
(``layernorm_zero_centered_gamma``, which megatron's torch norm refuses) is
:class:`ZeroCenteredRMSNorm`.

Limits (checked, not silently ignored): tensor parallelism 1 (the adapters do no TP
communication), MXFP8 linear widths multiples of 32 (MXFP8 blocks; blockwise tiles at the edges
may be partial, any width works). MLA's two down projections stay bf16 linears: megatron accepts
only its own classes in those slots. MLA without a q LoRA gets
TE's fused Q / KV norms (:mod:`nemo_lw_fp8.cpu.layers.norm_linear`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import torch

from nemo_lw_fp8.cpu.layers.parallel_linears import FP8_LINEARS


class ZeroCenteredRMSNorm(torch.nn.Module):
    """TE's RMSNorm with ``zero_centered_gamma``: ``x / rms(x) * (1 + weight)``, weight starting
    at zero, computed in fp32 and cast back (megatron's torch norm refuses zero-centred gamma)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(
                "the CPU layers have zero-centred gamma for RMSNorm only, got normalization="
                f"{config.normalization!r} with layernorm_zero_centered_gamma=True"
            )
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (xf * rstd * (1 + self.weight.float())).to(x.dtype)


#: Submodule slots megatron accepts only its own classes for (``MLASelfAttention`` checks
#: ``in [Linear, TEColumnParallelLinear, ColumnParallelLinear]``): they stay bf16 on CPU.
_KEEP_FIELDS = frozenset({"linear_q_down_proj", "linear_kv_down_proj"})


def _swap_tree(node: Any, table: dict[type, Any], whole: dict[type, Any]) -> Any:
    """A copy of a spec tree with the classes in ``table`` replaced, and the module specs whose
    module is in ``whole`` replaced entirely (megatron's spec objects are shared: never edit)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    def _swap(node: Any) -> Any:
        return _swap_tree(node, table, whole)

    if isinstance(node, type):
        return table.get(node, node)
    if isinstance(node, ModuleSpec):
        if node.module in whole:
            return whole[node.module]
        return dataclasses.replace(
            node,
            module=_swap(node.module),
            submodules=_swap(node.submodules),
            params={key: _swap(value) for key, value in node.params.items()},
        )
    if isinstance(node, functools.partial):
        # megatron 0.19.2's MoE spec builds its experts as partial(SequentialMLP, submodules=..)
        if node.func in whole:
            return whole[node.func]
        keywords = {key: _swap(value) for key, value in node.keywords.items()}
        return functools.partial(_swap(node.func), *node.args, **keywords)
    if isinstance(node, list):
        return [_swap(item) for item in node]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {
            f.name: _swap(getattr(node, f.name))
            for f in dataclasses.fields(node)
            if f.name not in _KEEP_FIELDS
        }
        return dataclasses.replace(node, **changes)
    return node


def _hybrid_block_spec(config: Any, spec_config: Any, vp_stage: int | None) -> Any:
    """The decoder block of a Gated DeltaNet hybrid, as megatron's
    ``get_transformer_block_with_experimental_attention_variant_spec`` lays it out (TE-only
    upstream) but from megatron's local layers: per layer, linear attention (its
    ``get_gated_delta_net_module_spec``, input norm fused into ``in_proj``) or megatron's
    standard attention, by ``linear_attention_freq``; dense / MoE MLP by ``moe_layer_freq``;
    then the layers of this pipeline stage."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_gated_delta_net_module_spec,
        get_linear_attention_pattern,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from nemo_lw_fp8.cpu.layers.norm_linear import CPULayerNormColumnParallelLinear
    from nemo_lw_fp8.cpu.megatron import standins

    if config.experimental_attention_variant != "gated_delta_net":
        raise ValueError(
            "the CPU layers build experimental_attention_variant='gated_delta_net' only, got "
            f"{config.experimental_attention_variant!r}. Fix: run it on a GPU."
        )
    standins.install(("gated_delta_rule",))  # fla's Triton kernels cannot take CPU tensors

    class _Backend(LocalSpecProvider):
        def column_parallel_layer_norm_linear(self) -> type:
            return CPULayerNormColumnParallelLinear  # follows config.fp8 / fp8_recipe

    standard_config = copy.copy(spec_config)
    standard_config.experimental_attention_variant = None
    standard = get_gpt_decoder_layer_specs(standard_config, use_transformer_engine=False)
    linear_attention = get_gated_delta_net_module_spec(config, backend=_Backend())
    layers = [
        dataclasses.replace(
            layer,
            submodules=dataclasses.replace(
                layer.submodules, input_layernorm=IdentityOp, self_attention=linear_attention
            ),
        )
        if linear
        else layer
        for layer, linear in zip(standard, get_linear_attention_pattern(config), strict=True)
    ]
    if config.pipeline_model_parallel_layout is not None:
        ids = config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage
        )
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        ids = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))
    rms = config.normalization == "RMSNorm"
    return TransformerBlockSubmodules(
        layer_specs=[layers[i] for i in ids],
        layer_norm=LocalSpecProvider().layer_norm(rms_norm=rms, for_qk=False),
    )


def swap_norms(spec: Any, config: Any) -> Any:
    """``spec`` with megatron's torch norm replaced by :class:`ZeroCenteredRMSNorm` when the
    config asks for zero-centred gamma (also for the MTP block Bridge builds separately)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if not getattr(config, "layernorm_zero_centered_gamma", False):
        return spec
    return _swap_tree(spec, {WrappedTorchNorm: ZeroCenteredRMSNorm}, {})


def cpu_decoder_block_spec(
    config: Any,
    *,
    fp8: bool,
    fp8_recipe: str = "mxfp8",
    single_grouped_experts: bool = False,
    vp_stage: int | None = None,
) -> Any:
    """megatron's local decoder block spec for ``config`` (dense / MoE layers per
    ``moe_layer_freq``, MLA, standard or Gated DeltaNet hybrid attention, torch norms), with the
    ``fp8_recipe``'s emulated linears (:data:`FP8_LINEARS`: ``mxfp8`` or ``blockwise``) when
    ``fp8`` and :class:`~nemo_lw_fp8.cpu.layers.grouped_experts.GroupedExperts` routed experts when
    ``single_grouped_experts``; ``vp_stage``: the virtual pipeline stage being built."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    recipe = str(getattr(fp8_recipe, "value", fp8_recipe))
    if fp8 and recipe not in FP8_LINEARS:
        raise ValueError(
            f"the CPU layers emulate {' and '.join(FP8_LINEARS)} FP8 compute only, not "
            f"fp8_recipe={recipe!r}. Fix: mixed_precision.fp8_recipe=mxfp8 (Blackwell recipes) "
            "or blockwise (Hopper recipes) on CPU, or run on a GPU."
        )
    if fp8 and single_grouped_experts and recipe != "mxfp8":
        raise ValueError(
            f"the CPU single grouped expert weights are MXFP8 only, not fp8_recipe={recipe!r}. "
            "Fix: model.moe_single_grouped_weight=false (discrete experts, as the Hopper "
            "recipes have)."
        )
    # The local spec's grouped-GEMM experts need the grouped_gemm CUDA package: build the spec as
    # for discrete experts (SequentialMLP), swapped below; the model keeps its own config.
    spec_config = copy.copy(config)
    spec_config.moe_grouped_gemm = False
    if getattr(config, "multi_latent_attention", False) and config.q_lora_rank is None:
        # TE's MLA spec: IdentityOp Q / KV norms, which the QK-norm resolver fuses into
        # linear_q_proj / linear_kv_up_proj (the local spec's explicit Q norm has no place without
        # a q LoRA). The fused class: nemo_lw_fp8.cpu.layers.norm_linear, via the local_norm_linear
        # stand-in. The model's own config keeps qk_layernorm.
        spec_config.qk_layernorm = False
    if getattr(config, "experimental_attention_variant", None) is not None:
        spec = _hybrid_block_spec(config, spec_config, vp_stage)
    else:
        spec = get_gpt_decoder_block_spec(
            spec_config, use_transformer_engine=False, vp_stage=vp_stage
        )
    table: dict[type, Any] = {}
    whole: dict[type, Any] = {}
    if fp8:
        table[ColumnParallelLinear], table[RowParallelLinear] = FP8_LINEARS[recipe]
    if getattr(config, "layernorm_zero_centered_gamma", False):
        table[WrappedTorchNorm] = ZeroCenteredRMSNorm
    if single_grouped_experts:
        from nemo_lw_fp8.cpu.layers.grouped_experts import GroupedExperts

        whole[SequentialMLP] = functools.partial(GroupedExperts, fp8=fp8)
    return _swap_tree(spec, table, whole)
