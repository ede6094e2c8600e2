"""The guard catalogue: every rule has a bad combination here, each message names a fix, and
docs/guards.md lists every rule. (Bridge-level cases, through ``ConfigContainer`` overrides, are
in tests/recipes/test_recipes.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_lw_fp8 import rules as guards
from nemo_lw_fp8.rules import ConfigError, Settings
from tests.support.guard_settings import GROUPED_OK, LAYER_WISE_MXFP8_GATHER

#: Layer-wise Muon with MXFP8 param gather on the compact layout, single grouped experts: a
#: combination every rule accepts. Each case below breaks it in one way.
GOOD = LAYER_WISE_MXFP8_GATHER | GROUPED_OK | dict(
    optimizer="dist_muon",
    layer_wise_layout="compact",
    fp8="e4m3",
    overlap_param_gather=True,
    ddp_overlap_param_gather=True,
)
#: Expert-run ownership of grouped weights (checkpoints save each run's optimizer state).
EXPERT_RUNS = GOOD | dict(grouped_weight_ownership="expert")
#: Layer-wise NVFP4 primary weights with FP4 bytes on the wire (discrete experts, compact).
NVFP4_PRIMARY = GOOD | dict(fp8=None, fp8_recipe=None, fp8_param_gather=False,
                            reuse_grad_buf_for_mxfp8_param_ag=False,
                            moe_single_grouped_weight=False, num_moe_experts=4,
                            fp4_recipe="nvfp4", fp4_param=True, fp4_param_gather=True)
HOPPER = GOOD | dict(fp8_recipe="blockwise", reuse_grad_buf_for_mxfp8_param_ag=False,
                     moe_single_grouped_weight=False)
#: Bridge's H100 shape (issue 29): blockwise gather at TP 2 with sequence parallelism, experts
#: whole per rank (ETP 1), every TP shard whole 128x128 tiles (DeepSeek-V3-like widths without
#: MLA: hidden 7168, 128 heads of 128, ffn 18432, experts of 2048).
HOPPER_TP2 = HOPPER | dict(
    tensor_model_parallel_size=2, expert_tensor_parallel_size=1, hidden_size=7168,
    num_attention_heads=128, kv_channels=128, ffn_hidden_size=18432, num_moe_experts=256,
    moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
)  # fmt: skip
#: Bridge's DeepSeek-V3 H100 shape: the same with multi-latent attention (heads of 128 + 64
#: rope, values of 128): q / kv up projections 24576 / 32768 rows and linear_proj 16384
#: columns, each half a whole number of 128x128 tiles per TP rank.
HOPPER_TP2_MLA = HOPPER_TP2 | dict(
    multi_latent_attention=True, kv_channels=None, qk_head_dim=128, qk_pos_emb_head_dim=64,
    v_head_dim=128,
)  # fmt: skip

CASES: list[tuple[str, dict, str]] = [
    ("mxfp8 gather without grad-buffer reuse", GOOD | dict(
        reuse_grad_buf_for_mxfp8_param_ag=False, moe_single_grouped_weight=False),
     "fp8-gather-needs-grad-buffer-reuse"),
    ("tensorwise gather", GOOD | dict(fp8_recipe="tensorwise",
                                      reuse_grad_buf_for_mxfp8_param_ag=False),
     "fp8-gather-recipe"),
    ("delayed-scaling gather", GOOD | dict(fp8_recipe="delayed",
                                           reuse_grad_buf_for_mxfp8_param_ag=False),
     "fp8-gather-recipe"),
    ("optimizer recipe disagrees with the parameters", GOOD | dict(
        optimizer_fp8_recipe="tensorwise"), "fp8-recipe-agreement"),
    ("blockwise gather with reuse", HOPPER | dict(reuse_grad_buf_for_mxfp8_param_ag=True),
     "blockwise-gather-no-grad-buffer-reuse"),
    ("fp8 gather on the legacy path", GOOD | dict(layer_wise_layout="legacy",
                                                  use_layer_wise_param_layout=False),
     "fp8-gather-layout"),
    ("blockwise gather on the legacy path", HOPPER | dict(layer_wise_layout="legacy"),
     "fp8-gather-layout"),
    ("fp8 gather in fp16", GOOD | dict(bf16=False), "fp8-gather-bf16"),
    ("compact with two optimizer instances", GOOD | dict(num_distributed_optimizer_instances=2),
     "compact-single-instance"),
    ("compact without the param layout", dict(GOOD, fp8_param_gather=False,
                                              use_layer_wise_param_layout=False),
     "compact-needs-param-layout"),
    ("grouped weights with megatron FSDP", GOOD | dict(use_megatron_fsdp=True),
     "grouped-weight-fsdp"),
    ("grouped weights with torch FSDP2", GOOD | dict(use_torch_fsdp2=True), "grouped-weight-fsdp"),
    ("grouped MXFP8 primary without reuse, plain Muon", dict(
        GOOD, optimizer="muon", use_layer_wise_distributed_optimizer=False,
        reuse_grad_buf_for_mxfp8_param_ag=False),
     "grouped-weight-mxfp8-primary-needs-reuse"),
    ("grouped weights on TE 2.8", GOOD | dict(te_version="2.8.0"), "grouped-weight-te-version"),
    ("grouped weights, TE switch unset", GOOD | dict(grouped_linear_single_param=False),
     "grouped-weight-te-switch"),
    ("grouped NVFP4 under layer-wise Muon", dict(
        GOOD, fp8=None, fp8_recipe=None, fp8_param_gather=False, fp4_recipe="nvfp4"),
     "grouped-weight-nvfp4-layer-wise"),
    ("NVFP4 primary weights under layer-wise Muon at TP 2", dict(
        GOOD, fp8=None, fp8_recipe=None, fp8_param_gather=False, moe_single_grouped_weight=False,
        fp4_recipe="nvfp4", fp4_param_gather=True, tensor_model_parallel_size=2),
     "fp4-primary-weights-layer-wise"),
    ("NVFP4 primary weights in the model config only", dict(
        GOOD, fp8=None, fp8_recipe=None, fp8_param_gather=False, moe_single_grouped_weight=False,
        fp4_recipe="nvfp4", fp4_param=True), "fp4-primary-weights-layer-wise"),
    ("grouped weights without grouped GEMM", GOOD | dict(moe_grouped_gemm=False),
     "grouped-weight-needs-grouped-gemm"),
    ("grouped weights without TE's op fuser", GOOD | dict(use_transformer_engine_op_fuser=False),
     "grouped-weight-needs-op-fuser"),
    ("fp8 gather with FP8 off", GOOD | dict(fp8=None, fp8_recipe=None,
                                            moe_single_grouped_weight=False),
     "fp8-gather-without-fp8"),
    ("op-fuser experts at ETP 2", GOOD | dict(num_moe_experts=8, expert_tensor_parallel_size=2),
     "op-fuser-experts-expert-tensor-parallel"),
    ("op-fuser experts at TP 2, ETP unset (follows TP)", GOOD | dict(
        num_moe_experts=8, tensor_model_parallel_size=2),
     "op-fuser-experts-expert-tensor-parallel"),
    ("blockwise gather at TP 2, MLA linear_proj shard of 64", HOPPER_TP2_MLA | dict(
        num_attention_heads=4, qk_head_dim=32, qk_pos_emb_head_dim=32, v_head_dim=32),
     "fp8-gather-tp-block-boundary"),
    ("blockwise gather at TP 2 with Gated DeltaNet layers", HOPPER | dict(
        tensor_model_parallel_size=2, experimental_attention_variant="gated_delta_net"),
     "fp8-gather-tensor-parallel"),
    ("mxfp8 gather at TP 2, ffn shard of 48", GOOD | dict(
        tensor_model_parallel_size=2, ffn_hidden_size=96), "fp8-gather-tp-block-boundary"),
    ("blockwise gather at TP 4, ffn shard of 192", HOPPER | dict(
        tensor_model_parallel_size=4, ffn_hidden_size=768), "fp8-gather-tp-block-boundary"),
    ("blockwise gather at TP 2, QKV shard of 192", HOPPER | dict(
        tensor_model_parallel_size=2, hidden_size=256, num_attention_heads=4,
        num_query_groups=1), "fp8-gather-tp-block-boundary"),
    ("DDP overlap off, optimizer overlap on", GOOD | dict(ddp_overlap_param_gather=False),
     "overlap-param-gather-agreement"),
    ("DDP overlap on, optimizer overlap off", GOOD | dict(overlap_param_gather=False),
     "overlap-param-gather-agreement"),
    ("layer-wise Muon with FSDP, discrete experts", dict(
        GOOD, moe_single_grouped_weight=False, use_megatron_fsdp=True),
     "layer-wise-fsdp"),
    ("overlap with the optimizer step", GOOD | dict(overlap_param_gather_with_optimizer_step=True),
     "layer-wise-overlap-with-optimizer-step"),
    ("optimizer CPU offload", GOOD | dict(optimizer_cpu_offload=True), "layer-wise-cpu-offload"),
    ("single grouped weights with blockwise gather", HOPPER | dict(moe_single_grouped_weight=True),
     "grouped-weight-blockwise-gather"),
    ("unknown layout", GOOD | dict(layer_wise_layout="diagonal"), "layer-wise-layout-name"),
    ("negative gather padding tolerance", GOOD | dict(gather_padding_tolerance=-0.5),
     "compact-gather-padding-tolerance"),
    ("unknown grad sync", GOOD | dict(layer_wise_grad_sync="reduce_scatter"),
     "compact-grad-sync-name"),
    ("per-parameter grad norms logged from owner-reduced grads",
     GOOD | dict(log_l2_norm_grad_to_tensorboard=True), "compact-owner-grads-not-logged"),
    ("negative compact bucket cap", GOOD | dict(bucket_cap_numel=-1), "compact-bucket-cap"),
    ("unknown grouped weight ownership", GOOD | dict(grouped_weight_ownership="per-expert"),
     "grouped-weight-ownership-name"),
    ("expert runs on the padded layout", GOOD | dict(layer_wise_layout="padded",
                                                    grouped_weight_ownership="expert"),
     "grouped-weight-split-ownership-needs-compact"),
    ("unknown QKV ownership", GOOD | dict(qkv_ownership="per-head"), "qkv-ownership-name"),
    ("explicit QKV split on the padded layout", GOOD | dict(layer_wise_layout="padded",
                                                           qkv_ownership="split"),
     "qkv-split-needs-compact"),
    ("explicit QKV split with blockwise FP8", HOPPER | dict(qkv_ownership="split"),
     "qkv-split-blockwise"),
    ("owner-reduce setting on the padded layout", GOOD | dict(
        layer_wise_layout="padded", layer_wise_grad_sync="all_reduce"), "compact-only-grad-sync"),
    ("bucket cap on the padded layout", GOOD | dict(layer_wise_layout="padded",
                                                   bucket_cap_numel=0),
     "compact-only-bucket-cap"),
    ("gather padding tolerance on the padded layout", GOOD | dict(
        layer_wise_layout="padded", gather_padding_tolerance=0.0),
     "compact-only-gather-padding-tolerance"),
    ("op-fuser SwiGLU experts without the CuTe-DSL switch", GOOD | dict(
        num_moe_experts=8, gated_linear_unit=True, activation_func="silu",
        cutedsl_fused_grouped_mlp=False), "op-fuser-glu-experts-env"),
    ("context parallel 2", GOOD | dict(context_parallel_size=2), "layer-wise-context-parallel"),
    ("per-rank torch checkpoints", GOOD | dict(ckpt_format="torch"),
     "layer-wise-checkpoint-format"),
    ("fsdp_dtensor checkpoints", EXPERT_RUNS | dict(ckpt_format="fsdp_dtensor"),
     "layer-wise-checkpoint-format"),
    ("explicit split QKV with NVFP4 primary weights", NVFP4_PRIMARY | dict(
        qkv_ownership="split"), "qkv-split-nvfp4"),
    ("Hugging Face directory as the pretrained checkpoint, single grouped weights", GOOD | dict(
        pretrained_checkpoint_is_hf=True), "hf-pretrained-directory"),
    ("Hugging Face directory as the pretrained checkpoint, NVFP4 primary weights",
     NVFP4_PRIMARY | dict(pretrained_checkpoint_is_hf=True), "hf-pretrained-directory"),
    ("Hugging Face copy at every save, single grouped weights", GOOD | dict(
        also_save_hf_checkpoint=True), "hf-save-single-grouped"),
]


@pytest.mark.parametrize(
    "good", [GOOD, HOPPER, EXPERT_RUNS, HOPPER_TP2, HOPPER_TP2_MLA, NVFP4_PRIMARY],
    ids=["blackwell", "hopper", "expert-runs", "hopper-tp2", "hopper-tp2-mla", "nvfp4-primary"],
)  # fmt: skip
def test_the_supported_combinations_pass(good):
    assert guards.violations(Settings(**good)) == []
    # The settings the scope rules read, at the values every test runs.
    tested = good | dict(context_parallel_size=1, ckpt_format="torch_dist")
    assert guards.violations(Settings(**tested)) == []


def test_a_hugging_face_directory_loads_where_bridge_can_convert_it():
    """Control of ``hf-pretrained-directory``: bf16 weights with discrete experts (no quantized
    weight, no single grouped one) take Bridge's own Hugging Face route."""
    bf16 = GOOD | dict(fp8=None, fp8_recipe=None, fp8_param_gather=False,
                       reuse_grad_buf_for_mxfp8_param_ag=False, moe_single_grouped_weight=False)
    assert guards.violations(Settings(**bf16 | dict(pretrained_checkpoint_is_hf=True))) == []


@pytest.mark.parametrize(("case", "settings", "rule"), CASES, ids=[c[0] for c in CASES])
def test_bad_combination_is_rejected_with_a_fix(case, settings, rule):
    with pytest.raises(ConfigError) as caught:
        guards.check(Settings(**settings))
    assert caught.value.rule == rule, caught.value
    assert "Fix:" in str(caught.value)


def test_catalogue_covers_every_rule_and_has_25_combinations():
    assert len(CASES) >= 25
    assert len({tuple(sorted(c[1].items())) for c in CASES}) == len(CASES)  # all distinct
    assert {rule for _, _, rule in CASES} == {rule.name for rule in guards.RULES}


def test_docs_list_every_rule():
    text = (Path(__file__).resolve().parents[2] / "docs" / "guards.md").read_text()
    missing = [rule.name for rule in guards.RULES if f"`{rule.name}`" not in text]
    assert missing == []


def test_rule_modules_import_neither_each_other_nor_the_list():
    """rules.RULES lists every rule; the modules that write them import rules.settings and the
    vocabulary, never the catalogue (nemo_lw_fp8.rules itself), so there is no import circle, not
    even inside a function, and every rule they define is in the list."""
    import ast

    import nemo_lw_fp8.rules as catalogue

    folder = Path(catalogue.__file__).parent
    for name in ("fp8", "grouped", "tensor_parallel", "integration", "scope", "checkpoint"):
        tree = ast.parse((folder / f"{name}.py").read_text())
        imported = {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
        } | {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        }
        assert "nemo_lw_fp8.rules" not in imported, name
        assert not any(
            module.startswith("nemo_lw_fp8.rules.")
            and module not in ("nemo_lw_fp8.rules.settings", "nemo_lw_fp8.rules.tensor_parallel")
            for module in imported
        ), (name, imported)
    from nemo_lw_fp8.rules import fp8 as rules_fp8
    from nemo_lw_fp8.rules import grouped as rules_grouped
    from nemo_lw_fp8.rules import integration as rules_integration

    defined = {
        rule.name
        for module in (rules_fp8, rules_grouped, rules_integration)
        for value in vars(module).values()
        if isinstance(value, tuple)
        for rule in value
        if isinstance(rule, guards.Rule)
    }
    assert defined <= {rule.name for rule in guards.RULES}
    assert len(guards.RULES) == len({rule.name for rule in guards.RULES})
