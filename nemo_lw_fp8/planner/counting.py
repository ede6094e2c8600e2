"""Analytic parameter counts of a :class:`~.architectures.MoEArchitecture`.

Independent of the per-parameter shapes in :mod:`.shapes` on purpose: two derivations of the
same number, which the tests check agree.

Counting convention (:func:`count_parameters`): every parameter of the language model as
megatron-core builds it with ``share_embeddings_and_output_weights=False``, plus the DeepSeek-V3
router's ``expert_bias`` buffer (256 per MoE layer: in the published checkpoint, not trained).
Multi-token-prediction (MTP) layers are **excluded** by default (``include_mtp=True`` adds them):
DeepSeek-V3's 671B excludes its 14B MTP module, Qwen3-Next's 80B also fits only without its MTP
layer. An MTP layer here is megatron's (it shares the embedding and output layer of the main
model), so it is smaller than the checkpoint's MTP module, which stores its own copies.
Qwen3.5-35B-A3B is published as a vision-language checkpoint: its 35B includes a ~0.45B vision
encoder that a text-only pretraining run does not build (``vision_params_in_published``).
"""

from __future__ import annotations

from nemo_lw_fp8.recipes.architectures import MoEArchitecture


def _attention_params(a: MoEArchitecture, linear: bool) -> dict[str, int]:
    """One layer's token mixer with its input norm: (matrices, norms)."""
    h = a.hidden_size
    if linear:
        assert a.linear_key_head_dim and a.linear_num_key_heads and a.linear_num_value_heads
        assert a.linear_value_head_dim and a.linear_conv_kernel_dim
        qk = a.linear_num_key_heads * a.linear_key_head_dim
        v = a.linear_num_value_heads * a.linear_value_head_dim
        # in_proj: q, k, v, output gate z, and per-value-head beta and alpha
        in_proj = (2 * qk + 2 * v + 2 * a.linear_num_value_heads) * h
        conv = (2 * qk + v) * a.linear_conv_kernel_dim  # depthwise, no bias
        heads = 2 * a.linear_num_value_heads  # dt_bias, A_log
        return {
            "linear_attention": in_proj + conv + heads + v * h,
            "norms": h + a.linear_value_head_dim,  # input norm, gated output norm
        }
    n = a.num_attention_heads
    if a.multi_latent_attention:
        assert a.qk_head_dim and a.qk_pos_emb_head_dim and a.v_head_dim and a.kv_lora_rank
        q_out = n * (a.qk_head_dim + a.qk_pos_emb_head_dim)
        if a.q_lora_rank is None:
            q, q_norm = h * q_out, 0
        else:
            q, q_norm = h * a.q_lora_rank + a.q_lora_rank * q_out, a.q_lora_rank
        kv = h * (a.kv_lora_rank + a.qk_pos_emb_head_dim)
        kv += a.kv_lora_rank * n * (a.qk_head_dim + a.v_head_dim)
        out = n * a.v_head_dim * h
        return {"attention": q + kv + out, "norms": h + q_norm + a.kv_lora_rank}
    assert a.kv_channels and a.num_query_groups
    d = a.kv_channels
    q = n * d * (2 if a.attention_output_gate else 1)
    kv = 2 * a.num_query_groups * d
    norms = h + (2 * d if a.qk_layernorm else 0)
    return {"attention": (q + kv) * h + n * d * h, "norms": norms}


def _mlp_params(a: MoEArchitecture, moe: bool) -> dict[str, int]:
    """One layer's MLP with its pre-MLP norm."""
    h = a.hidden_size
    rows = 2 if a.gated_linear_unit else 1
    if not moe:
        assert a.ffn_hidden_size
        return {"dense_mlp": (rows + 1) * a.ffn_hidden_size * h, "norms": h}
    e = a.num_moe_experts
    out = {
        "router": e * h + (e if a.moe_router_enable_expert_bias else 0),
        "routed_experts": e * (rows + 1) * a.moe_ffn_hidden_size * h,
        "norms": h,
    }
    shared = a.moe_shared_expert_intermediate_size or 0
    out["shared_experts"] = (rows + 1) * shared * h + (h if a.moe_shared_expert_gate else 0)
    return out


def parameter_breakdown(arch: MoEArchitecture, *, include_mtp: bool = False) -> dict[str, int]:
    """Parameter counts by kind (see the module docstring for the convention).

    Keys: embedding, output_layer, attention, linear_attention, dense_mlp, router (incl. the
    expert-bias buffer), routed_experts, shared_experts (incl. their gate), norms, mtp.
    """
    h = arch.hidden_size
    total = dict.fromkeys(
        (
            "embedding",
            "output_layer",
            "attention",
            "linear_attention",
            "dense_mlp",
            "router",
            "routed_experts",
            "shared_experts",
            "norms",
            "mtp",
        ),
        0,
    )
    total["embedding"] = arch.vocab_size * h
    if arch.untie_embeddings_and_output_weights:
        total["output_layer"] = arch.vocab_size * h
    for linear, moe in zip(arch.linear_attention_pattern(), arch.moe_layer_pattern(), strict=True):
        for part in (_attention_params(arch, bool(linear)), _mlp_params(arch, bool(moe))):
            for key, value in part.items():
                total[key] += value
    total["norms"] += h  # final norm
    if include_mtp and arch.mtp_num_layers:
        per_layer = 2 * h + 2 * h * h + h  # enorm, hnorm, eh_proj, final norm
        per_layer += sum(_attention_params(arch, False).values())
        per_layer += sum(_mlp_params(arch, True).values())
        total["mtp"] = arch.mtp_num_layers * per_layer
    return total


def count_parameters(arch: MoEArchitecture, *, include_mtp: bool = False) -> int:
    """Total parameters of the language model (MTP layers only with ``include_mtp``)."""
    return sum(parameter_breakdown(arch, include_mtp=include_mtp).values())


def published_comparison(arch: MoEArchitecture) -> tuple[int, float]:
    """(our count made comparable to the published total, relative delta). Adds the vision
    encoder a text-only model lacks where the published number includes one."""
    ours = count_parameters(arch) + arch.vision_params_in_published
    return ours, (ours - arch.published_total_params) / arch.published_total_params
