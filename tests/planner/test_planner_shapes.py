"""nemo_lw_fp8.planner.shapes: the parameter shapes of the known models (totals against the
published sizes, megatron's Muon routing) and of models given by hyper-parameters only."""

from __future__ import annotations

import pytest

from nemo_lw_fp8.planner.shapes import SPECS, ModelSpec, ParamSpec, param_shapes, total_params

# ----------------------------------------------------------------------------- model shapes


@pytest.mark.parametrize(
    ("name", "published"), [("deepseek-v3", 671e9), ("qwen3-235b-a22b", 235e9)]
)
def test_parameter_totals_match_published_sizes(name, published):
    total = total_params(param_shapes(name))
    assert abs(total - published) / published < 0.01
    assert SPECS[name].published_params == published


def test_deepseek_v3_shapes():
    specs = {s.name: s for s in param_shapes("deepseek-v3")}
    attn = "decoder.layers.5.self_attention"
    assert specs[f"{attn}.linear_q_down_proj.weight"].shape == (1536, 7168)
    assert specs[f"{attn}.linear_q_up_proj.weight"].shape == (128 * 192, 1536)
    assert specs[f"{attn}.linear_kv_down_proj.weight"].shape == (512 + 64, 7168)
    assert specs[f"{attn}.linear_kv_up_proj.weight"].shape == (128 * 256, 512)
    assert specs[f"{attn}.linear_proj.weight"].shape == (7168, 128 * 128)
    assert specs["decoder.layers.2.mlp.linear_fc1.weight"].shape == (2 * 18432, 7168)
    assert "decoder.layers.3.mlp.linear_fc1.weight" not in specs  # MoE from layer 3
    router = specs["decoder.layers.3.mlp.router.weight"]
    assert router.shape == (256, 7168) and router.muon and not router.quantized
    bias = specs["decoder.layers.3.mlp.router.expert_bias"]
    assert not bias.trainable and not bias.muon
    expert = specs["decoder.layers.60.mlp.experts.linear_fc2.weight255"]
    assert expert.shape == (7168, 2048) and expert.expert_parallel and expert.muon
    shared = specs["decoder.layers.60.mlp.shared_experts.linear_fc1.weight"]
    assert shared.shape == (4096, 7168) and not shared.expert_parallel
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert specs[name].shape == (129280, 7168) and not specs[name].muon
    assert sum(1 for s in specs.values() if s.expert_parallel) == 58 * 2 * 256


def test_qwen3_shapes_and_muon_routing():
    specs = param_shapes("qwen3-235b-a22b")
    by_name = {s.name: s for s in specs}
    attn = "decoder.layers.93.self_attention"
    assert by_name[f"{attn}.linear_qkv.weight"].shape == ((64 + 2 * 4) * 128, 4096)
    assert by_name[f"{attn}.linear_proj.weight"].shape == (4096, 64 * 128)
    assert by_name[f"{attn}.q_layernorm.weight"].shape == (128,)
    assert by_name["decoder.layers.0.mlp.experts.linear_fc1.weight127"].shape == (3072, 4096)
    # megatron's rule: Muon iff 2-D and not embedding / output
    for s in specs:
        assert s.muon == (len(s.shape) == 2 and not s.embedding_or_output), s.name


def test_more_models_need_only_hyper_parameters():
    """DeepSeek-V2-Lite (MLA without q LoRA, 2 shared experts), Qwen3-30B-A3B and
    Qwen3-Next-80B-A3B (Gated DeltaNet on 3 of 4 layers, gated attention, gated shared expert)
    are plain ModelSpec instances; their totals match the published sizes."""
    models = [
        ModelSpec(
            name="deepseek-v2-lite",
            num_layers=27,
            hidden_size=2048,
            vocab_size=102400,
            num_attention_heads=16,
            multi_latent_attention=True,
            q_lora_rank=None,
            ffn_hidden_size=10944,
            first_k_dense_replace=1,
            num_moe_experts=64,
            moe_ffn_hidden_size=1408,
            moe_shared_expert_intermediate_size=2 * 1408,
            published_params=15.7e9,
        ),
        ModelSpec(
            name="qwen3-30b-a3b",
            num_layers=48,
            hidden_size=2048,
            vocab_size=151936,
            num_attention_heads=32,
            num_query_groups=4,
            kv_channels=128,
            qk_layernorm=True,
            num_moe_experts=128,
            moe_ffn_hidden_size=768,
            published_params=30.5e9,
        ),
        ModelSpec(
            name="qwen3-next-80b-a3b",
            num_layers=48,
            hidden_size=2048,
            vocab_size=151936,
            num_attention_heads=16,
            num_query_groups=2,
            kv_channels=256,
            qk_layernorm=True,
            attention_output_gate=True,
            linear_attention_freq=4,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            num_moe_experts=512,
            moe_ffn_hidden_size=512,
            moe_shared_expert_intermediate_size=512,
            moe_shared_expert_gate=True,
            published_params=80e9,
        ),
    ]
    for model in models:
        specs = model.params()
        assert abs(total_params(specs) - model.published_params) / model.published_params < 0.01
        for s in specs:  # megatron's Muon rule holds for every builder
            assert s.muon == (len(s.shape) == 2 and not s.embedding_or_output), s.name
    nxt = {s.name: s for s in models[2].params()}
    assert nxt["decoder.layers.0.in_proj.weight"].shape == (2 * 2048 + 2 * 4096 + 64, 2048)
    assert nxt["decoder.layers.0.conv1d.weight"].shape == (2 * 2048 + 4096, 1, 4)
    assert "decoder.layers.3.self_attention.linear_qkv.weight" in nxt  # every 4th: attention
    assert nxt["decoder.layers.3.self_attention.linear_qkv.weight"].shape == (
        2 * 16 * 256 + 2 * 2 * 256,
        2048,
    )
    assert nxt["decoder.layers.0.mlp.shared_experts.gate_weight"].shape == (1, 2048)
    lite = {s.name: s for s in models[0].params()}
    assert lite["decoder.layers.0.self_attention.linear_q_proj.weight"].shape == (16 * 192, 2048)


def test_param_spec_local_expert_view():
    e = ParamSpec("w3", (8, 4), True, expert_parallel=True, expert_index=3, num_experts=8)
    assert e.local(1) is e and e.local(2) is e and e.local(4) is None
    grouped = ParamSpec("g", (8, 4, 6), False, expert_parallel=True, num_experts=8)
    assert grouped.local(4).shape == (2, 4, 6)
    with pytest.raises(ValueError):
        e.local(3)
    local = [s.local(64) for s in param_shapes("deepseek-v3")]
    assert sum(1 for s in local if s is not None and s.expert_parallel) == 58 * 2 * 4


def test_unknown_model():
    with pytest.raises(KeyError, match="known"):
        param_shapes("gpt-5")
