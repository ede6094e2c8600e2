"""The recipe against a Hugging Face config, before any weight is converted.

Why: a recipe fixes every shape of its model; Megatron-Bridge builds its model from the HF
config instead. Importing HF weights into a recipe whose shapes, router, rotary or norms differ
would either fail deep inside a weight copy or, worse, succeed and train a different model than
the checkpoint's. Each difference is one line naming the recipe's field, both values and the
fix; all of them together are one :class:`~nemo_lw_fp8.errors.ConfigError`.

What the HF side says is what Bridge's own provider for that config says
(``AutoBridge.from_hf_config(...).to_megatron_provider``), so the comparison speaks megatron's
field names on both sides.
"""

from __future__ import annotations

from typing import Any

from nemo_lw_fp8.errors import ConfigError

#: megatron fields a recipe fixes and an HF config states, compared when the recipe sets them.
SHAPES = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
    "vocab_size", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
    "v_head_dim",
)  # fmt: skip
BEHAVIOUR = (
    "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_topk_scaling_factor", "rotary_base", "rotary_percent", "rotary_scaling_factor",
    "rope_type", "mscale", "mscale_all_dim", "original_max_position_embeddings", "beta_fast",
    "beta_slow",
    "layernorm_epsilon", "normalization", "qk_layernorm", "gated_linear_unit",
    "share_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias",
)  # fmt: skip
RULE = "hf-recipe-mismatch"


def _normal(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 9)
    if isinstance(value, tuple):
        return list(value)
    return value


def moe_pattern(provider: Any) -> list[int]:
    """Per layer: 1 MoE, 0 dense (megatron's reading of ``moe_layer_freq``)."""
    freq = getattr(provider, "moe_layer_freq", 1)
    layers = int(provider.num_layers)
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(layers)]
    return [int(v) for v in freq]


def _dense_width_used(provider: Any) -> bool:
    return not getattr(provider, "num_moe_experts", None) or 0 in moe_pattern(provider)


def differences(recipe_model: Any, hf_model: Any, hf_declares_mtp: bool) -> list[str]:
    """One line per field where the recipe's provider and Bridge's HF provider disagree."""
    lines: list[str] = []
    for field in SHAPES + BEHAVIOUR:
        if not hasattr(recipe_model, field):
            continue
        ours, theirs = getattr(recipe_model, field), getattr(hf_model, field, None)
        if ours is None and field in ("num_query_groups", "kv_channels"):
            continue  # megatron derives them (MLA has neither)
        if field == "qk_layernorm" and getattr(recipe_model, "multi_latent_attention", False):
            continue  # MLA's q / kv LoRA norms: Bridge states no flag for them
        if field == "moe_router_topk_scaling_factor" and {ours, theirs} <= {None, 1.0}:
            continue
        if _normal(ours) != _normal(theirs):
            lines.append(f"model.{field}: recipe {ours!r}, HF config {theirs!r}")
    if _dense_width_used(recipe_model) and recipe_model.ffn_hidden_size != hf_model.ffn_hidden_size:
        lines.append(
            f"model.ffn_hidden_size: recipe {recipe_model.ffn_hidden_size!r}, "
            f"HF config {hf_model.ffn_hidden_size!r}"
        )
    if getattr(recipe_model, "num_moe_experts", None) and moe_pattern(recipe_model) != moe_pattern(
        hf_model
    ):
        lines.append(
            f"model.moe_layer_freq (dense / MoE per layer): recipe {moe_pattern(recipe_model)}, "
            f"HF config {moe_pattern(hf_model)}"
        )
    ours_mla = bool(getattr(recipe_model, "multi_latent_attention", False))
    theirs_mla = bool(getattr(hf_model, "multi_latent_attention", False))
    if ours_mla != theirs_mla:
        lines.append(f"model.multi_latent_attention: recipe {ours_mla}, HF config {theirs_mla}")
    if hf_declares_mtp:
        ours_mtp = int(getattr(recipe_model, "mtp_num_layers", None) or 0)
        theirs_mtp = int(getattr(hf_model, "mtp_num_layers", None) or 0)
        if ours_mtp != theirs_mtp:
            lines.append(f"model.mtp_num_layers: recipe {ours_mtp}, HF config {theirs_mtp}")
    return lines


#: HF DeepSeek-V3 scores an expert group by the sum of its top 2 experts, always
#: (``DeepseekV3TopkRouter``); megatron's ``group_limited_topk`` by its top
#: ``moe_router_topk // moe_router_group_topk``.
HF_GROUP_SCORE_EXPERTS = 2


def group_routing_difference(model: Any) -> str | None:
    """Why a DeepSeek-V3 model with ``model``'s group-limited routing routes differently in
    megatron and in transformers (``None`` when it does not).

    Why: the two agree on the real model (top-8 of 4 groups: 2 experts per group) but not on
    other ratios. tiny_deepseek_v3 (top-2, 2 of 4 groups: 1 expert per group) was measured on
    the same weights: fp32 logits off by up to 2.2, 60% of the argmax changed; routed top-4
    (2 per group) they agree to 2e-6."""
    groups = getattr(model, "moe_router_num_groups", None) or 1
    group_topk = getattr(model, "moe_router_group_topk", None)
    if groups <= 1 or not group_topk:
        return None
    per_group = int(model.moe_router_topk) // int(group_topk)
    if per_group == HF_GROUP_SCORE_EXPERTS:
        return None
    return (
        f"model.moe_router_topk // model.moe_router_group_topk = {model.moe_router_topk} // "
        f"{group_topk} = {per_group}: megatron scores an expert group by its top {per_group} "
        f"experts, HF DeepSeek-V3 by its top {HF_GROUP_SCORE_EXPERTS}, so the model would "
        f"route differently (fix: moe_router_topk = {HF_GROUP_SCORE_EXPERTS} x "
        "moe_router_group_topk)"
    )


def declares_mtp(hf_config: Any) -> bool:
    """Whether the HF config states a number of MTP layers (transformers drops the field when
    it re-saves DeepSeek-V3; then the weights decide, :func:`..importer.missing_weights`)."""
    for field in ("num_nextn_predict_layers", "mtp_num_hidden_layers", "mtp_num_layers"):
        if field in getattr(hf_config, "__dict__", {}):
            return True
    return False


def check(recipe: str, recipe_model: Any, hf_model: Any, hf_config: Any, hf_dir: str) -> None:
    """Refuse the import when the recipe and the HF config disagree (all differences, one
    line each)."""
    lines = differences(recipe_model, hf_model, declares_mtp(hf_config))
    if getattr(hf_config, "model_type", None) == "deepseek_v3":
        routing = group_routing_difference(recipe_model)
        lines += [routing] if routing else []
    if lines:
        head = (
            f"recipe {recipe} does not match the HF checkpoint {hf_dir} (fix: the recipe of "
            "this model, or key=value overrides setting the recipe's field to the HF value)"
        )
        raise ConfigError(RULE, head + ": " + "\n  ".join(lines))
