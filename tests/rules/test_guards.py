"""Every configuration rule: what it rejects, the message (flag + fix), and where it runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nemo_lw_fp8 import rules as guards
from nemo_lw_fp8.rules import ConfigError, Settings
from tests.support.guard_settings import GROUPED_OK, LAYER_WISE_MUON, LAYER_WISE_MXFP8_GATHER

GOOD_MXFP8 = Settings(**LAYER_WISE_MXFP8_GATHER, overlap_param_gather=True)

BAD = {
    "fp8-gather-needs-grad-buffer-reuse": (
        dict(reuse_grad_buf_for_mxfp8_param_ag=False),
        "--reuse-grad-buf-for-mxfp8-param-ag",
    ),
    "fp8-gather-recipe": (dict(fp8_recipe="tensorwise"), "--fp8-recipe blockwise"),
    "fp8-recipe-agreement": (dict(optimizer_fp8_recipe="tensorwise"), "--fp8-recipe mxfp8"),
    "blockwise-gather-no-grad-buffer-reuse": (
        dict(fp8_recipe="blockwise"),
        "--reuse-grad-buf-for-mxfp8-param-ag",
    ),
    "fp8-gather-layout": (dict(layer_wise_layout="legacy"), "--no-use-layer-wise-param-layout"),
    "fp8-gather-bf16": (dict(bf16=False), "--bf16"),
    "compact-single-instance": (
        dict(layer_wise_layout="compact", num_distributed_optimizer_instances=2),
        "--num-distributed-optimizer-instances 1",
    ),
    "compact-needs-param-layout": (
        dict(layer_wise_layout="compact", use_layer_wise_param_layout=False),
        "--no-use-layer-wise-param-layout",
    ),
    # Single grouped expert weights (issue 6; more in tests/rules/test_grouped_guards.py).
    "grouped-weight-fsdp": (
        dict(**GROUPED_OK, use_megatron_fsdp=True),
        "--use-megatron-fsdp",
    ),
    "grouped-weight-mxfp8-primary-needs-reuse": (
        dict(
            **GROUPED_OK,
            optimizer="adam",
            use_layer_wise_distributed_optimizer=False,
            use_distributed_optimizer=True,
            reuse_grad_buf_for_mxfp8_param_ag=False,
        ),
        "--reuse-grad-buf-for-mxfp8-param-ag",
    ),
    "grouped-weight-te-version": (
        dict(GROUPED_OK, te_version="2.13.0"),
        "transformer-engine >= 2.14.0",
    ),
    "grouped-weight-te-switch": (
        dict(GROUPED_OK, grouped_linear_single_param=False),
        "NVTE_GROUPED_LINEAR_SINGLE_PARAM=1",
    ),
    "grouped-weight-nvfp4-layer-wise": (
        dict(**GROUPED_OK, fp4_recipe="nvfp4"),
        "--fp8-recipe mxfp8",
    ),
    "fp4-primary-weights-layer-wise": (
        dict(
            fp8_recipe=None,
            fp8_param_gather=False,
            fp4_recipe="nvfp4",
            fp4_param_gather=True,
            tensor_model_parallel_size=2,
        ),
        "--tensor-model-parallel-size 1",
    ),
}

#: Layer-wise NVFP4 primary weights as tests/mechanics/test_nvfp4_param_gather.py runs them.
FP4_PRIMARY_OK = LAYER_WISE_MUON | dict(fp4_recipe="nvfp4", fp4_param=True, fp4_param_gather=True)


def test_fp4_primary_weights_pass_where_verified():
    """The lifted part of ``fp4-primary-weights-layer-wise``: padded and compact layouts, with
    and without overlapped gathers, discrete experts; megatron-training's args carry the gather
    flag alone (it hands it to ``fp4_param``)."""
    for layout in ("padded", "compact"):
        for overlap in (False, True):
            guards.check(
                Settings(**FP4_PRIMARY_OK, layer_wise_layout=layout, overlap_param_gather=overlap)
            )
    guards.check(Settings(**FP4_PRIMARY_OK, num_moe_experts=4))
    guards.check(Settings(**{**FP4_PRIMARY_OK, "fp4_param": False}))


@pytest.mark.parametrize(
    "changes, flag",
    [
        (dict(fp4_param_gather=False), "--fp4-param-gather"),
        (dict(layer_wise_layout="legacy"), "--no-use-layer-wise-param-layout"),
        (dict(tensor_model_parallel_size=2), "--tensor-model-parallel-size 1"),
        (dict(num_moe_experts=4, expert_tensor_parallel_size=2), "--expert-tensor-parallel-size"),
        (dict(fp4_recipe="custom"), "--fp4-recipe nvfp4"),
        (dict(bf16=False), "--bf16"),
        (dict(num_distributed_optimizer_instances=2), "--num-distributed-optimizer-instances 1"),
    ],
)
def test_fp4_primary_weights_refused_outside_what_is_verified(changes, flag):
    with pytest.raises(ConfigError) as info:
        guards.check(Settings(**{**FP4_PRIMARY_OK, **changes}))
    assert info.value.rule == "fp4-primary-weights-layer-wise"
    assert flag in str(info.value) and "Fix:" in str(info.value)


def test_single_grouped_nvfp4_refusal_names_its_reason():
    """``grouped-weight-nvfp4-layer-wise`` says why (docs/nvfp4.md): TE 2.20.2 cannot cast bf16
    single grouped weights under NVFP4, and names the FP4 primary weights that train instead."""
    base = dict(GOOD_MXFP8.__dict__, fp8_recipe=None)
    changes = dict(GROUPED_OK, fp4_recipe="nvfp4", fp8_param_gather=False)
    with pytest.raises(ConfigError) as info:
        guards.check(Settings(**{**base, **changes}))
    assert info.value.rule == "grouped-weight-nvfp4-layer-wise"
    message = str(info.value)
    assert "group_quantize has no NVFP4 kernel" in message and "--fp4-param-gather" in message
    assert "Fix:" in message


@pytest.mark.parametrize("ownership", ["whole", "expert", "auto"])
def test_fp4_primary_single_grouped_weights_pass(ownership):
    """The lifted part of ``grouped-weight-nvfp4-layer-wise``: FP4 primary single grouped
    weights on the compact layout, owned whole or in runs of experts
    (tests/mechanics/test_fp4_grouped_param_gather.py); the padded layout owns them whole."""
    guards.check(
        Settings(
            **FP4_PRIMARY_OK, **GROUPED_OK, num_moe_experts=4, layer_wise_layout="compact",
            grouped_weight_ownership=ownership,
        )
    )  # fmt: skip
    guards.check(Settings(**FP4_PRIMARY_OK, **GROUPED_OK, num_moe_experts=4))


def test_supported_combinations_pass():
    guards.check(GOOD_MXFP8)
    guards.check(Settings(**{**GOOD_MXFP8.__dict__, "layer_wise_layout": "compact"}))
    guards.check(GOOD_MXFP8.__class__(**{**GOOD_MXFP8.__dict__, "overlap_param_gather": False}))
    # FP8 compute with bf16 parameters works with any recipe.
    guards.check(
        Settings(
            optimizer="muon", use_layer_wise_distributed_optimizer=True, fp8_recipe="blockwise"
        )
    )
    # Blockwise FP8 (Hopper) layer-wise gather ships FP8 bytes: no grad-buffer reuse.
    for layout in ("padded", "compact"):
        guards.check(
            Settings(
                **{
                    **GOOD_MXFP8.__dict__,
                    "fp8_recipe": "blockwise",
                    "reuse_grad_buf_for_mxfp8_param_ag": False,
                    "layer_wise_layout": layout,
                }
            )
        )
    # Adam with megatron's own MXFP8 param gather is upstream's business, not ours.
    guards.check(
        Settings(
            optimizer="adam",
            use_distributed_optimizer=True,
            fp8_recipe="mxfp8",
            fp8_param_gather=True,
        )
    )


@pytest.mark.parametrize("rule", sorted(BAD))
def test_each_rule_rejects_with_flag_and_fix(rule):
    changes, flag = BAD[rule]
    bad = Settings(**{**GOOD_MXFP8.__dict__, **changes})
    with pytest.raises(ConfigError) as info:
        guards.check(bad)
    assert info.value.rule == rule
    assert flag in str(info.value)
    assert "Fix:" in str(info.value)


def test_every_rule_is_tested():
    # The recipe-level rules have their cases in tests/rules/test_guard_catalogue.py.
    own = {rule.name for rule in guards.RULES if rule not in guards.INTEGRATION_RULES}
    assert own == set(BAD)


def test_dist_muon_counts_as_layer_wise():
    settings = Settings(optimizer="dist_muon", fp8_recipe="mxfp8", fp8_param_gather=True)
    assert [rule for rule, _ in guards.violations(settings)] == [
        "fp8-gather-needs-grad-buffer-reuse"
    ]


def test_megatron_args_are_read():
    args = SimpleNamespace(
        **LAYER_WISE_MXFP8_GATHER,
        use_layer_wise_param_layout=False,
        bf16=True,
        use_distributed_optimizer=True,
        overlap_param_gather=False,
    )
    assert Settings.from_args(args).layer_wise_layout == "legacy"
    with pytest.raises(ConfigError, match="fp8-gather-layout"):
        guards.check(Settings.from_args(args))


def test_validate_args_runs_the_rules_after_megatrons_own_checks():
    from nemo_lw_fp8.patches.muon_fp8_param_gather import _make_validate_args

    seen = []

    def megatron_validate_args(args, defaults):
        seen.append(args)
        return args

    validate_args = _make_validate_args(megatron_validate_args)
    args = SimpleNamespace(**{**GOOD_MXFP8.__dict__, "reuse_grad_buf_for_mxfp8_param_ag": False})
    with pytest.raises(ConfigError, match="fp8-gather-needs-grad-buffer-reuse"):
        validate_args(args)
    assert seen == [args], "megatron's own validation must run first"
    good = SimpleNamespace(**GOOD_MXFP8.__dict__)
    assert validate_args(good) is good


def test_apply_hooks_megatron_validate_args():
    from megatron.training import arguments

    import nemo_lw_fp8

    original = arguments.validate_args
    nemo_lw_fp8.apply(["muon_fp8_param_gather"])
    try:
        assert arguments.validate_args.__wrapped__ is original
    finally:
        nemo_lw_fp8.revert()
    assert arguments.validate_args is original


# --------------------------------------------------------------------------- qkv_ownership


@pytest.mark.parametrize(
    ("value", "layout", "blockwise", "owned"),
    [
        ("auto", "compact", False, "split"),
        ("auto", "padded", False, "whole"),
        ("auto", "legacy", False, "whole"),
        ("auto", "compact", True, "whole"),
        ("whole", "compact", False, "whole"),
        ("split", "compact", False, "split"),
    ],
)
def test_qkv_ownership_auto_splits_only_where_it_can(value, layout, blockwise, owned):
    from nemo_lw_fp8.layout.packing import resolve_qkv_ownership

    assert resolve_qkv_ownership(value, layout, blockwise) == owned


def test_qkv_ownership_defaults_to_auto_on_every_layout():
    """The default is accepted on every layout (it used to be an explicit 'split' the padded
    layout dropped silently)."""
    from nemo_lw_fp8 import LayerWiseConfig

    assert LayerWiseConfig().qkv_ownership == "auto"
    for layout in ("compact", "padded", "legacy"):
        assert LayerWiseConfig(layout=layout).qkv_ownership == "auto"


@pytest.mark.parametrize(
    ("settings", "rule"),
    [
        (dict(layer_wise_layout="padded"), "qkv-split-needs-compact"),
        (dict(layer_wise_layout="legacy", use_layer_wise_param_layout=False),
         "qkv-split-needs-compact"),
        (dict(layer_wise_layout="compact", fp8_recipe="blockwise", fp8="e4m3"),
         "qkv-split-blockwise"),
    ],
)  # fmt: skip
def test_explicit_qkv_split_where_it_cannot_happen_is_refused(settings, rule):
    base = dict(optimizer="muon", use_layer_wise_distributed_optimizer=True, bf16=True)
    with pytest.raises(ConfigError) as info:
        guards.check(Settings(**base, **settings, qkv_ownership="split"))
    assert info.value.rule == rule
    message = str(info.value)
    assert "qkv_ownership='split'" in message  # the flag
    assert "Fix: qkv_ownership='auto'" in message  # the fix
    assert len(message.splitlines()) == 1
    guards.check(Settings(**base, **settings, qkv_ownership="auto"))  # the default passes


def test_layer_wise_config_refuses_split_on_the_padded_layout():
    from nemo_lw_fp8 import LayerWiseConfig

    with pytest.raises(ConfigError, match=r"qkv-split-needs-compact.*Fix: qkv_ownership='auto'"):
        LayerWiseConfig(layout="padded", qkv_ownership="split")
    assert LayerWiseConfig(layout="compact", qkv_ownership="split").qkv_ownership == "split"


#: The compact layout's own settings, each at a non-default value: (rule, field, value, fix).
COMPACT_ONLY = [
    ("compact-only-grad-sync", "layer_wise_grad_sync", "all_reduce",
     "Fix: leave layer_wise_grad_sync unset, or layer_wise_layout='compact'"),
    ("compact-only-bucket-cap", "bucket_cap_numel", 500_000_000,
     "Fix: leave bucket_cap_numel unset"),
    ("compact-only-gather-padding-tolerance", "gather_padding_tolerance", 0.0,
     "Fix: leave gather_padding_tolerance unset"),
]


@pytest.mark.parametrize("layout", ["padded", "legacy"])
@pytest.mark.parametrize(("rule", "field", "value", "fix"), COMPACT_ONLY,
                         ids=[case[0] for case in COMPACT_ONLY])
def test_compact_only_setting_on_another_layout_is_refused(rule, field, value, fix, layout):
    """The padded and legacy layouts sync, bucket and gather as megatron does: a compact-only
    setting there would be ignored, so it is refused naming the flag and the fix."""
    base = dict(optimizer="muon", use_layer_wise_distributed_optimizer=True, bf16=True,
                layer_wise_layout=layout, use_layer_wise_param_layout=layout != "legacy")
    with pytest.raises(ConfigError) as info:
        guards.check(Settings(**base, **{field: value}))
    assert info.value.rule == rule
    message = str(info.value)
    assert f"{field}={value!r}" in message  # the flag
    assert fix in message  # the fix
    assert len(message.splitlines()) == 1
    guards.check(Settings(**base))  # the defaults pass
    guards.check(Settings(**dict(base, layer_wise_layout="compact",
                                 use_layer_wise_param_layout=True), **{field: value}))


def test_layer_wise_config_refuses_compact_settings_on_the_padded_layout():
    from nemo_lw_fp8 import LayerWiseConfig

    with pytest.raises(ConfigError, match=r"compact-only-grad-sync.*layer_wise_grad_sync"):
        LayerWiseConfig(layout="padded", grad_sync="all_reduce")
    with pytest.raises(ConfigError, match=r"compact-only-bucket-cap.*bucket_cap_numel=0"):
        LayerWiseConfig(layout="padded", bucket_cap_numel=0)
    with pytest.raises(ConfigError, match=r"compact-only-gather-padding-tolerance"):
        LayerWiseConfig(layout="legacy", gather_padding_tolerance=0.5)
    assert LayerWiseConfig(layout="padded").grad_sync == "reduce_to_owner"


# --------------------------------------------------------------------------- FP8 gather at TP > 1

#: The TP-2 models tests/mechanics/test_tp_fp8_param_gather.py runs (MXFP8: hidden 64, 4 heads,
#: ffn 128, experts of 64 at ETP 1; blockwise: hidden 256, ffn 512, experts of 128), on the
#: compact layout.
TP2_MXFP8 = dict(
    GOOD_MXFP8.__dict__, layer_wise_layout="compact", fp8="e4m3", tensor_model_parallel_size=2,
    hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, num_moe_experts=4,
    moe_ffn_hidden_size=64, expert_tensor_parallel_size=1,
)  # fmt: skip
#: Experts as discrete TE linears (megatron's SequentialMLP), not one grouped weight.
DISCRETE_EXPERTS = dict(moe_grouped_gemm=False, moe_single_grouped_weight=False,
                        use_transformer_engine_op_fuser=False)  # fmt: skip
#: Grouped experts as the H100 recipes build them: TE's GroupedLinear module with discrete
#: weights (no op fuser, no single grouped weight).
GROUPED_DISCRETE = dict(moe_grouped_gemm=True, moe_single_grouped_weight=False,
                        use_transformer_engine_op_fuser=False)  # fmt: skip
TP2_BLOCKWISE = dict(
    TP2_MXFP8, fp8_recipe="blockwise", reuse_grad_buf_for_mxfp8_param_ag=False,
    hidden_size=256, ffn_hidden_size=512, moe_ffn_hidden_size=128, **GROUPED_DISCRETE,
)  # fmt: skip


@pytest.mark.parametrize(
    "settings",
    [
        TP2_MXFP8,
        TP2_BLOCKWISE,
        dict(TP2_MXFP8, num_moe_experts=None, expert_tensor_parallel_size=None),  # dense
        dict(TP2_BLOCKWISE, num_query_groups=2),  # GQA: QKV 512 rows, 256 per shard
        dict(TP2_BLOCKWISE, kv_channels=128, moe_shared_expert_intermediate_size=256),
        dict(TP2_BLOCKWISE, tensor_model_parallel_size=4, ffn_hidden_size=1024,
             hidden_size=512),  # fmt: skip
        # Multi-latent attention at TP 2 (tests/bridge/test_tp_mla_training.py): tiny DeepSeek-V3's
        # widths with MXFP8 (q / kv up 256 rows, linear_proj 128 columns: shards of 128 / 64),
        # and with blockwise FP8 at the 8 heads and shared experts of 256 that test runs.
        dict(TP2_MXFP8, multi_latent_attention=True, qk_head_dim=32, qk_pos_emb_head_dim=32,
             v_head_dim=32, hidden_size=128, ffn_hidden_size=256, moe_ffn_hidden_size=128,
             moe_shared_expert_intermediate_size=128),
        dict(TP2_BLOCKWISE, multi_latent_attention=True, num_attention_heads=8, qk_head_dim=32,
             qk_pos_emb_head_dim=32, v_head_dim=32, hidden_size=128, ffn_hidden_size=256,
             moe_ffn_hidden_size=128, moe_shared_expert_intermediate_size=256),
        # MLA's head widths not known yet: judged when the optimizer is built.
        dict(TP2_BLOCKWISE, multi_latent_attention=True),
        # Dimensions not known at the call site are judged when the optimizer is built.
        dict(TP2_BLOCKWISE, ffn_hidden_size=None, hidden_size=None, moe_ffn_hidden_size=None),
        # What is refused at TP > 1 passes at TP 1.
        dict(TP2_MXFP8, tensor_model_parallel_size=1, multi_latent_attention=True,
             experimental_attention_variant="gated_delta_net", attention_output_gate=True,
             ffn_hidden_size=96),
        # Unaligned widths without FP8 param gather: bf16 weights, FP8 compute only.
        dict(TP2_BLOCKWISE, fp8_param_gather=False, ffn_hidden_size=320),
        # Discrete expert linears (SequentialMLP) split over ETP 2, whole blocks per shard.
        dict(TP2_MXFP8, expert_tensor_parallel_size=2, **DISCRETE_EXPERTS),
        dict(TP2_BLOCKWISE, expert_tensor_parallel_size=2, moe_ffn_hidden_size=256,
             **DISCRETE_EXPERTS),
        # Grouped experts (TE's GroupedLinear, discrete weights) split over ETP 2
        # (tests/mechanics/test_tp_grouped_fp8_gather.py: experts of 256, shards of 128).
        dict(TP2_MXFP8, expert_tensor_parallel_size=2, moe_ffn_hidden_size=256,
             **GROUPED_DISCRETE),
        dict(TP2_BLOCKWISE, expert_tensor_parallel_size=2, moe_ffn_hidden_size=256),
    ],
    ids=["mxfp8", "blockwise", "mxfp8-dense", "blockwise-gqa", "blockwise-shared-experts",
         "blockwise-tp4", "mxfp8-mla", "blockwise-mla", "mla-dims-unknown", "dims-unknown",
         "tp1", "no-fp8-gather", "mxfp8-etp2-discrete", "blockwise-etp2-discrete",
         "mxfp8-etp2-grouped", "blockwise-etp2-grouped"],
)  # fmt: skip
def test_fp8_gather_at_tensor_parallel_passes_with_whole_blocks_per_shard(settings):
    assert guards.violations(Settings(**settings)) == []


#: Blockwise MLA at TP 2, 4 heads: the tests below change one head width each.
MLA_TP2_BLOCKWISE = dict(TP2_BLOCKWISE, multi_latent_attention=True, qk_head_dim=32,
                         qk_pos_emb_head_dim=32, v_head_dim=32)  # fmt: skip

#: (case, settings, rule, what the message names: the dimension / size, and the fix)
TP_REFUSED = [
    ("mxfp8 ffn shard of 48", dict(TP2_MXFP8, ffn_hidden_size=96), "fp8-gather-tp-block-boundary",
     ["model.ffn_hidden_size=96", "each shard 48", "32-wide", "a multiple of 64"]),
    ("blockwise ffn shard of 320", dict(TP2_BLOCKWISE, ffn_hidden_size=640),
     "fp8-gather-tp-block-boundary",
     ["model.ffn_hidden_size=640", "each shard 320", "128-wide", "a multiple of 256",
      "model.tensor_model_parallel_size"]),
    ("blockwise linear_proj shard of 64", dict(TP2_BLOCKWISE, kv_channels=32, ffn_hidden_size=512),
     "fp8-gather-tp-block-boundary",
     ["model.num_attention_heads x model.kv_channels=128", "each shard 64 linear_proj columns"]),
    ("blockwise QKV shard of 192", dict(TP2_BLOCKWISE, hidden_size=128, num_query_groups=1,
                                         kv_channels=64),
     "fp8-gather-tp-block-boundary",
     ["(model.num_attention_heads + 2 x model.num_query_groups) x model.kv_channels=384",
      "each shard 192 linear_qkv rows"]),
    ("blockwise shared experts", dict(TP2_BLOCKWISE, moe_shared_expert_intermediate_size=128),
     "fp8-gather-tp-block-boundary",
     ["model.moe_shared_expert_intermediate_size=128", "each shard 64"]),
    ("blockwise discrete experts' ETP-2 shard of 64", dict(
        TP2_BLOCKWISE, expert_tensor_parallel_size=2, **DISCRETE_EXPERTS),
     "fp8-gather-tp-block-boundary",
     ["model.moe_ffn_hidden_size=128", "each shard 64", "model.expert_tensor_parallel_size"]),
    ("grouped experts' ETP-2 shard of 64, ETP unset (follows TP 2)", dict(
        TP2_BLOCKWISE, expert_tensor_parallel_size=None),
     "fp8-gather-tp-block-boundary",
     ["at ETP=2", "model.moe_ffn_hidden_size=128", "each shard 64"]),
    ("blockwise MLA linear_proj shard of 64", dict(MLA_TP2_BLOCKWISE, qk_head_dim=96),
     "fp8-gather-tp-block-boundary",
     ["model.num_attention_heads x model.v_head_dim=128", "each shard 64 linear_proj columns"]),
    ("blockwise MLA kv_up shard of 192", dict(MLA_TP2_BLOCKWISE, num_attention_heads=8,
                                               v_head_dim=16),
     "fp8-gather-tp-block-boundary",
     ["model.num_attention_heads x (model.qk_head_dim + model.v_head_dim)=384",
      "each shard 192 linear_kv_up_proj rows"]),
    ("blockwise MLA q_up shard of 96", dict(MLA_TP2_BLOCKWISE, qk_pos_emb_head_dim=16,
                                            v_head_dim=96),
     "fp8-gather-tp-block-boundary",
     ["model.num_attention_heads x (model.qk_head_dim + model.qk_pos_emb_head_dim)=192",
      "each shard 96 linear_q_up_proj rows"]),
    ("mxfp8 MLA linear_proj shard of 48", dict(TP2_MXFP8, multi_latent_attention=True,
                                               qk_head_dim=40, qk_pos_emb_head_dim=24,
                                               v_head_dim=24),
     "fp8-gather-tp-block-boundary",
     ["model.num_attention_heads x model.v_head_dim=96", "each shard 48", "32-wide"]),
    ("Gated DeltaNet layers at TP 2", dict(TP2_BLOCKWISE,
                                           experimental_attention_variant="gated_delta_net"),
     "fp8-gather-tensor-parallel",
     ["model.experimental_attention_variant='gated_delta_net'", "Gated DeltaNet"]),
    ("gated attention output at TP 2", dict(TP2_BLOCKWISE, attention_output_gate=True),
     "fp8-gather-tensor-parallel", ["model.attention_output_gate=True", "Q rows doubled"]),
]


@pytest.mark.parametrize(
    "settings",
    [dict(TP2_MXFP8, expert_tensor_parallel_size=2, moe_ffn_hidden_size=256),
     dict(TP2_MXFP8, expert_tensor_parallel_size=None, moe_ffn_hidden_size=256),
     dict(TP2_MXFP8, tensor_model_parallel_size=1, expert_tensor_parallel_size=2),
     dict(TP2_BLOCKWISE, expert_tensor_parallel_size=2, moe_ffn_hidden_size=256,
          use_transformer_engine_op_fuser=True),
     dict(TP2_MXFP8, expert_tensor_parallel_size=2, fp8=None, fp8_recipe=None,
          fp8_param_gather=False, moe_single_grouped_weight=False)],
    ids=["mxfp8-single-grouped", "etp-unset-follows-tp", "etp2-at-tp1", "blockwise-fused",
         "bf16-no-gather"],
)  # fmt: skip
def test_op_fuser_experts_at_expert_tensor_parallel_are_refused(settings):
    """megatron-core 0.19.2 asserts at model build for grouped experts through TE's op fuser at
    ETP > 1 (``TEGroupedMLP._is_fused_impl_supported``), with or without FP8: the rule says so
    first, naming the ETP and the two fixes. Control: the same settings at ETP 1 pass it."""
    with pytest.raises(ConfigError) as info:
        guards.check(Settings(**settings))
    assert info.value.rule == "op-fuser-experts-expert-tensor-parallel", info.value
    message = str(info.value)
    for text in ("expert tensor parallel 2", "Fused GroupedMLP is not supported",
                 "model.expert_tensor_parallel_size=1",
                 "model.use_transformer_engine_op_fuser=False"):  # fmt: skip
        assert text in message, (text, message)
    assert len(message.splitlines()) == 1
    at_etp1 = Settings(**dict(settings, expert_tensor_parallel_size=1))
    assert "op-fuser-experts-expert-tensor-parallel" not in dict(guards.violations(at_etp1))


@pytest.mark.parametrize(("case", "settings", "rule", "named"), TP_REFUSED,
                         ids=[case[0] for case in TP_REFUSED])  # fmt: skip
def test_fp8_gather_at_tensor_parallel_refuses_with_its_reason(case, settings, rule, named):
    with pytest.raises(ConfigError) as info:
        guards.check(Settings(**settings))
    assert info.value.rule == rule, info.value
    message = str(info.value)
    for text in named:
        assert text in message, (text, message)
    assert "Fix:" in message and "drop --fp8-param-gather" in message
    assert len(message.splitlines()) == 1


def test_megatron_args_without_gqa_have_one_query_group_per_head():
    """megatron-training keeps ``num_query_groups`` (default 1) when GQA is off; the model then
    has one group per head, which is what the block-boundary rule must read."""
    args = SimpleNamespace(**TP2_BLOCKWISE, group_query_attention=False)
    args.num_query_groups = 1  # megatron-training's default, unused without GQA
    assert Settings.from_args(args).num_query_groups is None
    guards.check(Settings.from_args(args))
    args.group_query_attention = True  # 1 group: QKV (4 + 2) x 64 = 384 rows, 192 per shard
    with pytest.raises(ConfigError, match="fp8-gather-tp-block-boundary"):
        guards.check(Settings.from_args(args))


def test_fp8_recipe_agreement_leaves_nvfp4_parameters_to_their_type():
    """Bridge copies its preset's FP8 recipe default ("tensorwise", FP8 off) onto
    ``OptimizerConfig.fp8_recipe``; for NVFP4 parameters megatron's optimizers branch on the
    tensor's type and never read it, so the NVFP4 recipes pass. Control: the same optimizer
    recipe against blockwise FP8 parameters is still refused."""
    nvfp4 = dict(
        optimizer="muon", use_layer_wise_distributed_optimizer=True, fp8_recipe="nvfp4",
        optimizer_fp8_recipe="tensorwise", fp4_recipe="nvfp4", fp4_param=True,
        fp4_param_gather=True,
    )  # fmt: skip
    assert "fp8-recipe-agreement" not in dict(guards.violations(Settings(**nvfp4)))
    blockwise = Settings(**(nvfp4 | dict(fp8_recipe="blockwise")))
    assert "fp8-recipe-agreement" in dict(guards.violations(blockwise))


def test_the_rules_first_address_still_answers():
    """Code written against ``nemo_lw_fp8.guards`` (the catalogue's address before the rules had
    a package of their own) gets the same objects from ``nemo_lw_fp8.rules``, and a bad
    combination is refused the same way through it."""
    import nemo_lw_fp8.guards as first_address

    for name in ("check", "violations", "RULES", "Settings", "Rule", "ConfigError"):
        assert getattr(first_address, name) is getattr(guards, name), name
    with pytest.raises(ConfigError) as caught:
        first_address.check(Settings(**{**LAYER_WISE_MXFP8_GATHER, "bf16": False}))
    assert caught.value.rule == "fp8-gather-bf16"
