"""Recipes, the optimizer factory, YAML / key=value overrides and the Bridge-level guards.

Everything Megatron-Bridge runs in one fresh process (``tests/support/bridge_report.py``): Bridge
imports Transformer Engine, booted here through the CPU emulation before megatron-core loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_lw_fp8 import planner as models
from nemo_lw_fp8 import recipes
from tests.support import fork_server

HERE = Path(__file__).parent
SUPPORT = HERE.parent / "support"
REPO = HERE.parent.parent


@pytest.fixture(scope="module")
def report(tmp_path_factory, bridge_installed) -> dict:
    out = tmp_path_factory.mktemp("bridge") / "report.json"
    done = fork_server.run_script(SUPPORT / "bridge_report.py", str(out), timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def test_every_recipe_builds_offline_and_passes_the_guards(report):
    assert report["errors"] == {}
    assert sorted(report["recipes"]) == sorted(recipes.RECIPES)
    full = [name for name in recipes.RECIPES if not name.startswith(("tiny_", "twin_"))]
    assert len(full) == sum(len(recipes.variants_of(model)) for model in recipes.MODELS)
    assert sorted(n for n in recipes.RECIPES if n.startswith("twin_")) == sorted(
        f"twin_{name}" for name in full
    )
    # tiny_<model> (MXFP8), tiny_<model>_hopper and tiny_<model>_nvfp4
    assert len([name for name in recipes.RECIPES if name.startswith("tiny_")]) == len(full)


@pytest.mark.parametrize("name", sorted(recipes.RECIPES))
def test_recipe_key_settings(report, name):
    row = report["recipes"][name]
    assert row["optimizer"] == "dist_muon" and row["optimizer_class"] == "LayerWiseMuonConfig"
    assert row["layout"] == row["ddp_layout"] == "compact"
    assert row["overlap_ddp"] and row["overlap_optimizer"]
    assert row["grouped_gemm"]
    if name.endswith(("_hopper", "_nvfp4")):  # discrete experts (docs/recipes.md)
        assert not row["single_grouped_weight"] and row["switch_env"] is None
        assert not row["op_fuser"]
    else:
        assert row["single_grouped_weight"] and row["op_fuser"] and row["switch_env"] == "1"
    if name.endswith("_nvfp4"):  # Bridge's bf16_with_nvfp4_mixed, TE's rounding as shipped
        assert (row["fp8"], row["fp8_param_gather"], row["reuse_grad_buf"]) == (None, False, False)
        assert (row["fp4"], row["fp4_recipe"], row["fp4_param_gather"]) == ("e2m1", "nvfp4", True)
        assert row["no_sr_env"] is None  # stochastic rounding stays TE's default on GPUs
        # the last 15% of the layers in bf16, as Bridge's NVFP4 presets (at least one)
        kept = recipes.nvfp4_bf16_layers_at_end(row["num_layers"])
        assert (row["first_last_layers_bf16"], row["bf16_layers_at_start"]) == (True, 0)
        assert row["bf16_layers_at_end"] == kept
    else:
        assert row["fp8"] == "e4m3" and row["fp8_param_gather"]
        assert row["fp4"] is None and row["no_sr_env"] is None
    if name.endswith("_hopper"):
        assert (row["fp8_recipe"], row["reuse_grad_buf"]) == ("blockwise", False)
    elif not name.endswith("_nvfp4"):
        assert (row["fp8_recipe"], row["reuse_grad_buf"]) == ("mxfp8", True)
    assert row["etp"] == 1  # whole experts: FP8 gather at ETP > 1 is not verified
    assert row["muon_tp_mode"] == "duplicated"  # the factory's TP-invariant default
    assert row["provider"] == ("MLAModelProvider" if row["multi_latent_attention"] else
                               "GPTModelProvider")
    arch = row["arch"]
    if name.startswith("tiny_"):
        assert row["hidden_size"] < arch["hidden_size"] and row["num_moe_experts"] <= 8
        assert row["multi_latent_attention"] == arch["multi_latent_attention"]
        assert (row["tp"], row["pp"]) == (1, 1)
    elif name.startswith("twin_"):
        _check_twin(row, report["recipes"][name[len("twin_"):]])
    else:
        for key in ("num_layers", "hidden_size", "num_moe_experts", "moe_ffn_hidden_size",
                    "vocab_size", "multi_latent_attention"):
            assert row[key] == arch[key], key
        gpu = recipes.VARIANT_GPU[name.rsplit("_", 1)[1]]
        parallel = models.parallelism(name.rsplit("_", 1)[0], gpu)
        assert (row["pp"], row["ep"]) == (parallel.pp, parallel.ep)
        assert (row["tp"], row["sequence_parallel"]) == (parallel.tp, parallel.sequence_parallel)
        # TP 1 (whole matrices for layer-wise Muon) except where Bridge's TP is kept: Qwen3-235B
        # and DeepSeek-V3 on H100 at Bridge's TP 2 with sequence parallelism (their TP-2 twins
        # run it on CPU).
        tp2 = name in ("qwen3_235b_a22b_hopper", "deepseek_v3_hopper")
        assert (row["tp"], row["sequence_parallel"]) == ((2, True) if tp2 else (1, False))
        assert row["global_batch_size"] == parallel.global_batch_size


def _check_twin(twin: dict, full: dict) -> None:
    """A twin keeps its recipe's structure (sizes 1 or 2) and training settings."""
    assert twin["hidden_size"] < full["hidden_size"]
    assert twin["pp"] == (2 if full["pp"] > 1 else 1)
    assert twin["vpp"] == (2 if full["vpp"] else None)
    # Expert-data-parallel size 1 as shipped: EP covers the TP x DP 2 ranks of a stage.
    assert twin["ep"] == (2 * full["tp"] if full["ep"] > 1 else 1)
    assert bool(twin["pipeline_layout"]) == bool(full["pipeline_layout"])
    if full["pipeline_layout"]:  # embedding first, MTP and loss last, as the recipe's
        first, *_, last = twin["pipeline_layout"].split("|")
        assert first.startswith("E") and last.endswith("mL" if full["mtp_num_layers"] else "tL")
    for key in ("fp8_recipe", "single_grouped_weight", "clip_grad", "mtp_num_layers", "tp",
                "sequence_parallel", "etp", "layout", "multi_latent_attention", "reuse_grad_buf",
                "fp4", "fp4_param_gather", "no_sr_env", "first_last_layers_bf16"):
        assert twin[key] == full[key], key


@pytest.mark.parametrize("model", recipes.MODELS)
def test_recipe_models_match_published_sizes(model):
    arch = models.get_architecture(model)
    _, delta = models.published_comparison(arch)
    assert abs(delta) <= 0.01


def test_factory_refuses_an_unknown_muon_tp_mode(report):
    """The factory's ``muon_tp_mode`` (default "duplicated", checked on every recipe above)
    takes megatron's three names only."""
    assert "muon_tp_mode='sharded'" in report["bad_muon_tp_mode"]
    assert "distributed" in report["bad_muon_tp_mode"]


def test_yaml_and_cli_precedence(report):
    yaml = report["yaml"]
    assert yaml["train_iters"] == 7  # YAML over recipe
    assert yaml["lr"] == 0.002  # CLI over YAML (YAML said 0.001)
    assert yaml["global_batch_size"] == 8  # CLI over recipe
    assert yaml["layout"] == yaml["ddp_layout"] == "padded"  # YAML reaches the DDP config
    assert yaml["num_layers"] == 4 and yaml["hidden_size"] == 128  # untouched keys keep recipe's
    assert yaml["optimizer_class"] == "LayerWiseMuonConfig"
    assert "is not key=value" in yaml["bad_override"]


def test_yaml_target_reaches_the_factory_config(report):
    target = report["yaml"]["target"]
    assert target == {"class": "LayerWiseMuonConfig", "lr": 0.003, "layout": "compact"}, target


def test_yaml_recipe_files_are_current(report):
    """recipes/*.yaml are generated from the recipes; each parses and names its recipe."""
    from nemo_lw_fp8.recipes.yaml_files import render

    for name in sorted(recipes.RECIPES):
        path = REPO / "recipes" / f"{name}.yaml"
        assert path.exists(), f"missing {path}; run: python -m nemo_lw_fp8.recipes.yaml_files"
        assert path.read_text() == render(name, report["recipes"][name]), f"{path} is stale"


def test_yaml_recipe_file_applied_to_its_recipe_changes_nothing(report):
    assert report["yaml_identity"] == {
        "tiny_deepseek_v3": True, "deepseek_v3_hopper": True, "qwen3_235b_a22b_mxfp8": True,
        "deepseek_v3_nvfp4": True,
    }


#: The rule each Bridge override case in ``bridge_report.GUARD_CASES`` must trip.
EXPECTED_RULES = {
    "mxfp8-without-reuse": "fp8-gather-needs-grad-buffer-reuse",
    "legacy-layout-fp8": "fp8-gather-layout",
    "overlap-disagree": "overlap-param-gather-agreement",
    "tensor-parallel": "",  # passes: MLA at TP 2 with whole blocks per shard, ETP 1
    "expert-tensor-parallel": "op-fuser-experts-expert-tensor-parallel",
    "tensor-parallel-hopper": "",  # passes: TP 2 with whole 128-blocks per shard, ETP 1
    "tensor-parallel-hybrid": "fp8-gather-tensor-parallel",
    "tp-block-boundary": "fp8-gather-tp-block-boundary",
    "twin-tp2-tp1-widths": "fp8-gather-tp-block-boundary",
    "twin-mla-tp2-tp1-widths": "fp8-gather-tp-block-boundary",
    "fsdp": "grouped-weight-fsdp",
    "no-grouped-gemm": "grouped-weight-needs-grouped-gemm",
    "no-op-fuser": "grouped-weight-needs-op-fuser",
    "cpu-offload": "layer-wise-cpu-offload",
    "bad-layout": "layer-wise-layout-name",
    "blockwise-with-reuse": "blockwise-gather-no-grad-buffer-reuse",
    "tensorwise-gather": "fp8-gather-recipe",
    "overlap-with-step": "layer-wise-overlap-with-optimizer-step",
    "two-instances": "compact-single-instance",
    "negative-tolerance": "compact-gather-padding-tolerance",
    "switch-off": "grouped-weight-te-switch",
    "gather-without-fp8": "fp8-gather-without-fp8",
    "fp16": "fp8-gather-bf16",
    "bad-ownership": "grouped-weight-ownership-name",
    "bad-grad-sync": "compact-grad-sync-name",
    "grad-norms-logged": "compact-owner-grads-not-logged",
    "expert-runs-padded": "grouped-weight-split-ownership-needs-compact",
    "context-parallel": "layer-wise-context-parallel",
    "torch-checkpoints": "layer-wise-checkpoint-format",
    "hf-pretrained-directory": "hf-pretrained-directory",
    "hf-copy-single-grouped": "hf-save-single-grouped",
    "nvfp4-tensor-parallel": "fp4-primary-weights-layer-wise",
    "nvfp4-expert-tensor-parallel": "fp4-primary-weights-layer-wise",
}


def test_bridge_overrides_trip_their_rule(report):
    """Each bad key=value combination on a real recipe fails in Bridge's config validation with
    its rule, and the message names a fix; the supported ones (rule "") pass."""
    assert sorted(report["guards"]) == sorted(EXPECTED_RULES)
    for case, rule in EXPECTED_RULES.items():
        found = report["guards"][case]
        assert found.split("|", 1)[0] == rule, (case, found)
        assert "Fix" in found or not rule, (case, found)

