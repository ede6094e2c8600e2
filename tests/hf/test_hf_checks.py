"""The recipe-vs-HF-config comparison itself (no Bridge, no model): each differing field is one
line naming the recipe field and both values; equal configs give none; MTP is compared only
when the HF config states it (transformers' re-saved DeepSeek-V3 does not; the missing weights
then decide, tests/hf/test_hf_import.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nemo_lw_fp8.errors import ConfigError
from nemo_lw_fp8.hf import checks

QWEN = dict(
    num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2, kv_channels=32,
    num_moe_experts=8, moe_ffn_hidden_size=128, moe_shared_expert_intermediate_size=None,
    vocab_size=512, moe_router_topk=2, moe_router_score_function="softmax",
    moe_router_pre_softmax=False, rotary_base=1_000_000.0, layernorm_epsilon=1e-6,
    normalization="RMSNorm", qk_layernorm=True, moe_layer_freq=1, ffn_hidden_size=None,
    mtp_num_layers=None,
)  # fmt: skip


def _model(**changes: object) -> SimpleNamespace:
    return SimpleNamespace(**(QWEN | changes))


def test_equal_configs_have_no_differences() -> None:
    # The HF side states a dense width the all-MoE recipe never builds: not a difference.
    assert checks.differences(_model(), _model(ffn_hidden_size=256), hf_declares_mtp=True) == []


def test_each_difference_is_one_line() -> None:
    hf = _model(moe_router_topk=8, rotary_base=10_000.0, layernorm_epsilon=1e-5, num_layers=3)
    lines = checks.differences(_model(), hf, hf_declares_mtp=False)
    assert lines == [
        "model.num_layers: recipe 2, HF config 3",
        "model.moe_router_topk: recipe 2, HF config 8",
        "model.rotary_base: recipe 1000000.0, HF config 10000.0",
        "model.layernorm_epsilon: recipe 1e-06, HF config 1e-05",
        "model.moe_layer_freq (dense / MoE per layer): recipe [1, 1], HF config [1, 1, 1]",
    ]


def test_mtp_compared_only_when_the_hf_config_states_it() -> None:
    ours, theirs = _model(mtp_num_layers=1), _model(mtp_num_layers=None)
    assert checks.differences(ours, theirs, hf_declares_mtp=False) == []
    assert checks.differences(ours, theirs, hf_declares_mtp=True) == [
        "model.mtp_num_layers: recipe 1, HF config 0"
    ]
    assert checks.declares_mtp(SimpleNamespace(num_nextn_predict_layers=1))
    assert not checks.declares_mtp(SimpleNamespace(num_hidden_layers=3))


def test_refusal_names_the_rule_and_every_line() -> None:
    with pytest.raises(ConfigError) as raised:
        checks.check("tiny_qwen3_30b_a3b", _model(), _model(hidden_size=256), None, "/hf")
    text = str(raised.value)
    assert text.startswith("[nemo_lw_fp8:hf-recipe-mismatch] recipe tiny_qwen3_30b_a3b")
    assert text.count("\n") == 0 and "model.hidden_size: recipe 128, HF config 256" in text


def test_deepseek_group_routing_that_transformers_computes_otherwise() -> None:
    """megatron scores an expert group by its top topk // group_topk experts, HF DeepSeek-V3 by
    its top 2: the real model (8 // 4) agrees, the tiny recipe (2 // 2) does not."""
    real = SimpleNamespace(moe_router_num_groups=8, moe_router_group_topk=4, moe_router_topk=8)
    assert checks.group_routing_difference(real) is None
    tiny = SimpleNamespace(moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk=2)
    line = checks.group_routing_difference(tiny)
    assert line is not None and "top 1 experts, HF DeepSeek-V3 by its top 2" in line
    assert "moe_router_topk = 2 x moe_router_group_topk" in line
    assert checks.group_routing_difference(SimpleNamespace(moe_router_num_groups=None)) is None
