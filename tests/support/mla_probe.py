"""Rank functions for tests/patches/test_mla_local_attention.py.

``local_attention_probe``: megatron-core's local ``DotProductAttention`` built as MLA builds it
(``k_channels`` != ``v_channels``), compared with a reference causal softmax attention computed
here in fp32; ``mla_gpt_probe``: a tiny MLA GPTModel on megatron's local spec, a few Adam steps.
Both report what happened instead of raising, so a test can also show the unpatched failure.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _attention_module(heads: int, k_channels: int, v_channels: int):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from tests.support.scenarios import transformer_config

    config = transformer_config(num_attention_heads=heads, hidden_size=heads * v_channels,
                                bf16=False, params_dtype=torch.float32)
    return DotProductAttention(
        config,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        k_channels=k_channels,
        v_channels=v_channels,
    )


def local_attention_probe(plugin: bool) -> dict[str, Any]:
    import nemo_lw_fp8

    if plugin:
        nemo_lw_fp8.apply(["mla_local_attention"])
    heads, dk, dv, seq, batch = 4, 48, 32, 8, 2
    try:
        module = _attention_module(heads, dk, dv)
    except TypeError as error:
        return {"built": False, "error": str(error)}
    finally:
        if plugin:
            nemo_lw_fp8.revert(["mla_local_attention"])
    from tests.support.scenarios import seed_all

    seed_all(0)  # megatron's attention dropout forks the model-parallel RNG state
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(seq, batch, heads, dk, generator=gen)
    k = torch.randn(seq, batch, heads, dk, generator=gen)
    v = torch.randn(seq, batch, heads, dv, generator=gen)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    out = module(q, k, v, attention_mask=mask)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(dk)
    scores = scores.masked_fill(mask, float("-inf"))
    reference = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(seq, batch, -1)
    return {
        "built": True,
        "shape": list(out.shape),
        "max_error": float((out.float() - reference).abs().max()),
    }


def mla_gpt_probe(steps: int = 3) -> dict[str, Any]:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    import nemo_lw_fp8
    from tests.support.scenarios import seed_all

    seed_all(0)
    nemo_lw_fp8.apply(["mla_local_attention"])
    try:
        config = MLATransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
            q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=16,
            v_head_dim=16, use_cpu_initialization=True, hidden_dropout=0.0,
            attention_dropout=0.0, gradient_accumulation_fusion=False, apply_rope_fusion=False,
            bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
            rope_type="rope", normalization="RMSNorm", qk_layernorm=True,
        )
        spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True,
                                        normalization="RMSNorm")
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64,
                         max_sequence_length=16, position_embedding_type="none")
    finally:
        nemo_lw_fp8.revert(["mla_local_attention"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    tokens = torch.arange(32).reshape(2, 16) % 64
    positions = torch.arange(16).expand(2, 16)
    mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)[None, None]
    losses = []
    for _ in range(steps):
        loss = model(tokens, positions, mask, labels=(tokens + 1) % 64).float().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return {"losses": losses}
