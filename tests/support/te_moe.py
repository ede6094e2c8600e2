"""The tiny MoE GPT from megatron's TE spec that the TE module tests train and checkpoint.

Two layers of 4 experts (top 2, SwiGLU, RMSNorm) with megatron's ``TEGroupedMLP`` through TE's
op fuser and single grouped expert weights; with MXFP8 parameters, TE's ``quantized_model_init``
keeps the high-precision init values the fp32 masters start from. The checkpoint tests and the
training tests build the same model, so it is built here.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

EXPERTS = 4
#: What the MXFP8 recipes' TE modules need in the environment (docs/recipes.md).
TE_ENV = {"NVTE_GROUPED_LINEAR_SINGLE_PARAM": "1", "NVTE_CUTEDSL_FUSED_GROUPED_MLP": "1"}


def build_te_moe_gpt(
    seed: int,
    mxfp8_params: bool,
    scopes: tuple[contextlib.AbstractContextManager, ...] = (),
    **config: Any,
) -> tuple[torch.nn.Module, Any]:
    """The MoE GPT seeded with ``seed``, its transformer config extended by ``config``, built
    inside ``scopes`` (entered in order); persistent MXFP8 weights with ``mxfp8_params``. Plain
    tensors are cast to bf16 (grouped and MXFP8 weights are final). Returns (module, config)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.support.scenarios import GPT_SEQ, GPT_VOCAB, seed_all, transformer_config

    seed_all(seed)
    model_parallel_cuda_manual_seed(seed)
    transformer = transformer_config(
        num_moe_experts=EXPERTS, moe_router_topk=2, add_bias_linear=False,
        moe_token_dispatcher_type="allgather", moe_router_dtype="fp64", moe_grouped_gemm=True,
        use_transformer_engine_op_fuser=True, moe_single_grouped_weight=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", **config,
    )  # fmt: skip
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=EXPERTS, moe_grouped_gemm=True)
    with contextlib.ExitStack() as stack:
        for scope in scopes:
            stack.enter_context(scope)
        if mxfp8_params:
            from transformer_engine.common.recipe import MXFP8BlockScaling
            from transformer_engine.pytorch import quantized_model_init

            stack.enter_context(
                quantized_model_init(
                    enabled=True, recipe=MXFP8BlockScaling(), preserve_high_precision_init_val=True
                )
            )
        module = GPTModel(
            config=transformer, transformer_layer_spec=spec, vocab_size=GPT_VOCAB,
            max_sequence_length=GPT_SEQ, share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
        )  # fmt: skip
    for param in module.parameters():
        if type(param.data) is torch.Tensor:
            param.data = param.data.to(torch.bfloat16)
    return module, transformer
