"""Tiny Hugging Face checkpoints with random weights, built from configs (nothing downloaded).

Their shapes are the tiny recipes' (``tiny_qwen3_30b_a3b``, ``tiny_deepseek_v3`` with
``model.moe_router_topk=4``: :data:`DEEPSEEK_OVERRIDES`), so ``nemo-lw-fp8 hf-import`` accepts
them; the weights are bf16 (what the recipe's model holds), so
an import can be compared bitwise. No tokenizer files are written: the weights need none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

QWEN3_MOE = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
    max_position_embeddings=64, tie_word_embeddings=False, decoder_sparse_step=1,
    mlp_only_layers=[], rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
)  # fmt: skip

DEEPSEEK_V3 = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=64, q_lora_rank=64,
    qk_rope_head_dim=32, v_head_dim=32, qk_nope_head_dim=32, n_group=4, topk_group=2,
    num_experts_per_tok=4, first_k_dense_replace=1, norm_topk_prob=True, rms_norm_eps=1e-6,
    max_position_embeddings=64, tie_word_embeddings=False,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 64, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0},
)  # fmt: skip

#: tiny_deepseek_v3 routes top-2 of 2 groups: megatron then scores a group by its top expert,
#: HF DeepSeek-V3 by its top 2 (refused by the import, nemo_lw_fp8/hf/checks.py); top-4 scores
#: by 2 on both sides. Without MTP: transformers saves no MTP weights.
DEEPSEEK_OVERRIDES = ("model.moe_router_topk=4",)

#: recipe -> (transformers config class name, config values)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny_qwen3_30b_a3b": ("Qwen3MoeConfig", QWEN3_MOE),
    "tiny_deepseek_v3": ("DeepseekV3Config", DEEPSEEK_V3),
}


def make(recipe: str, folder: Path, seed: int = 0, **changes: Any) -> Path:
    """Save a random bf16 model of ``recipe``'s shapes under ``folder`` (``changes``: config
    values that differ, e.g. a mismatched dimension)."""
    import torch
    import transformers

    name, values = MODELS[recipe]
    config = getattr(transformers, name)(**(values | changes))
    config.architectures = [name.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():  # non-trivial norms too (ones would hide swaps)
            param.normal_(0.0, 0.05 if param.dim() > 1 else 1.0)
            if param.dim() == 1:
                param.abs_().add_(0.5)
    model = model.to(torch.bfloat16)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek-V3 ships it in fp32
            module = model.get_submodule(name.rsplit(".", 1)[0])
            module.e_score_correction_bias = torch.rand(buffer.shape, dtype=torch.float32) * 0.1
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return folder
