"""Layer specs that let megatron-core's real GPT / MLA / MoE layers train with FP8 on CPU.

Part of the CPU backend (:mod:`nemo_lw_fp8.cpu`): used under ``--cpu`` and by the tests only.

Why
    With FP8 on, megatron builds Transformer Engine layers, whose GEMMs are CUDA kernels. On CPU
    we keep megatron's local (non-TE) decoder spec - its MLA attention, router, token dispatcher,
    shared experts, norms - and swap only the linear layers for
    :class:`~nemo_lw_fp8.emulation.fp8_linear.MXFP8Linear` (TE ``Linear``'s MXFP8 arithmetic,
    exactly emulated). Under megatron's ``get_fp8_context(is_init=True)`` (TE's
    ``quantized_model_init``) their weights become TE ``MXFP8Tensor`` parameters, so megatron's
    MXFP8 param-gather paths see what they see on a GPU. Routed experts can be the single
    grouped weight of :mod:`nemo_lw_fp8.cpu.grouped_experts`.

Limits (checked, not silently ignored): tensor parallelism 1 (the adapters do no TP
communication), linear widths multiples of 32 (MXFP8 blocks). MLA's two down projections stay
bf16 linears: megatron accepts only its own classes in those slots. MLA without a q LoRA gets
TE's fused Q / KV norms (:mod:`nemo_lw_fp8.cpu.norm_linear`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import torch

from nemo_lw_fp8.emulation.fp8_linear import MXFP8Linear


def _tp_size(config: Any) -> int:
    return int(getattr(config, "tensor_model_parallel_size", 1) or 1)


class _MXFP8ParallelLinear(torch.nn.Module):
    """Megatron ``Column/RowParallelLinear`` interface over :class:`MXFP8Linear` (TP = 1)."""

    partition_dim = 0

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Any = None,
        bias: bool = True,
        skip_bias_add: bool = False,
        is_expert: bool = False,
        **_: Any,
    ) -> None:
        super().__init__()
        if _tp_size(config) != 1:
            raise ValueError("CPU MXFP8 linears support tensor_model_parallel_size=1 only")
        self.skip_bias_add = skip_bias_add
        self.linear = MXFP8Linear(
            input_size,
            output_size,
            bias=bias,
            params_dtype=config.params_dtype,
            init_method=init_method,
        )
        expert_parallel = is_expert and config.expert_model_parallel_size > 1
        for param in self.linear.parameters():
            param.tensor_model_parallel = param.dim() == 2
            param.partition_dim = self.partition_dim if param.dim() == 2 else -1
            param.partition_stride = 1
            param.allreduce = not expert_parallel

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.linear.bias

    def forward(self, x: torch.Tensor, *_: Any, **__: Any) -> tuple[torch.Tensor, Any]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.skip_bias_add and self.linear.bias is not None:
            bias = self.linear.bias
            self.linear.bias = None
            try:
                out = self.linear(flat)
            finally:
                self.linear.bias = bias
            return out.reshape(*shape[:-1], self.linear.out_features), bias
        return self.linear(flat).reshape(*shape[:-1], self.linear.out_features), None


class MXFP8ColumnParallelLinear(_MXFP8ParallelLinear):
    partition_dim = 0


class MXFP8RowParallelLinear(_MXFP8ParallelLinear):
    partition_dim = 1


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


def cpu_decoder_block_spec(
    config: Any,
    *,
    fp8: bool,
    fp8_recipe: str = "mxfp8",
    single_grouped_experts: bool = False,
    vp_stage: int | None = None,
) -> Any:
    """megatron's local decoder block spec for ``config`` (dense / MoE layers per
    ``moe_layer_freq``, MLA or standard attention, torch norms), with MXFP8 linears when ``fp8``
    and :class:`~nemo_lw_fp8.cpu.grouped_experts.GroupedExperts` routed experts when
    ``single_grouped_experts``; ``vp_stage``: the virtual pipeline stage being built."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.experts import SequentialMLP

    if fp8 and fp8_recipe != "mxfp8":
        raise ValueError(
            f"the CPU layers emulate MXFP8 compute only, not fp8_recipe={fp8_recipe!r} (the "
            "blockwise CPU linear needs 128-wide tiles, wider than the tiny models). Fix: use an "
            "MXFP8 recipe on CPU (mixed_precision=bf16_with_mxfp8_mixed), or a GPU."
        )
    # The local spec's grouped-GEMM experts need the grouped_gemm CUDA package: build the spec as
    # for discrete experts (SequentialMLP), swapped below; the model keeps its own config.
    spec_config = copy.copy(config)
    spec_config.moe_grouped_gemm = False
    if getattr(config, "multi_latent_attention", False) and config.q_lora_rank is None:
        # TE's MLA spec: IdentityOp Q / KV norms, which the QK-norm resolver fuses into
        # linear_q_proj / linear_kv_up_proj (the local spec's explicit Q norm has no place without
        # a q LoRA). The fused class: nemo_lw_fp8.cpu.norm_linear, via the local_norm_linear
        # stand-in. The model's own config keeps qk_layernorm.
        spec_config.qk_layernorm = False
    spec = get_gpt_decoder_block_spec(
        spec_config, use_transformer_engine=False, vp_stage=vp_stage
    )
    table: dict[type, Any] = {}
    whole: dict[type, Any] = {}
    if fp8:
        table[ColumnParallelLinear] = MXFP8ColumnParallelLinear
        table[RowParallelLinear] = MXFP8RowParallelLinear
    if single_grouped_experts:
        from nemo_lw_fp8.cpu.grouped_experts import GroupedExperts

        whole[SequentialMLP] = functools.partial(GroupedExperts, fp8=fp8)
    return _swap_tree(spec, table, whole)
