"""``nemo-lw-fp8 plan --recipe``: a recipe's pipeline ranks and grouped expert weights planned,
bad overrides refused with one line, the Hopper variants' discrete experts."""

from __future__ import annotations

import dataclasses

import pytest

# ----------------------------------------------------------------------------- plan --recipe


def test_recipe_plan_pipeline_and_grouped_weights():
    """A tiny recipe at PP 2 plans both pipeline ranks, reports the busiest, groups the experts
    into single (E, m, n) weights and gives a verdict against the GPU."""
    from nemo_lw_fp8.planner import recipe_plan

    setup = recipe_plan.recipe_setup(
        "tiny_qwen3_30b_a3b",
        ["model.pipeline_model_parallel_size=2", "model.expert_model_parallel_size=1"],
    )
    setup.par = dataclasses.replace(setup.par, gpus_per_node=4)
    result = recipe_plan.plan_recipe(setup)
    assert result["parallelism"]["pp"] == 2 and result["parallelism"]["dp"] == 2
    peaks = result["pp_rank_peaks"]
    assert len(peaks) == 2 and result["pp_rank"] == peaks.index(max(peaks))
    assert result["verdict"]["fits"] and result["verdict"]["gpu_bytes"] == 80e9
    # At EP 1 megatron builds the experts with the dense process groups: no expert buffers.
    names = [b["name"] for b in result["layouts"]["compact"]["buffers"]]
    assert names and not any("/expert/" in name for name in names)
    # grouped weights keep their element count
    specs = recipe_plan.stage_param_specs(setup.arch, setup.par, 0) + (
        recipe_plan.stage_param_specs(setup.arch, setup.par, 1)
    )
    single = recipe_plan.group_experts(specs)
    assert sum(s.numel for s in single) == sum(s.numel for s in specs)
    assert any(len(s.shape) == 3 and s.num_experts == 8 for s in single)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # TP 3 does not divide the tiny recipe's 2 ranks (TP 2 plans: test_planner_tp.py)
        (["model.tensor_model_parallel_size=3"], "does not split into TP 3"),
        (["optimizer.muon_tp_mode=rowwise"], "muon_tp_mode='rowwise'"),
        (["optimizer.lr=1"], "plan does not read 'optimizer.lr'"),
        (["model.expert_model_parallel_size=3"], "does not split"),
        (["optimizer.grouped_weight_ownership=experts"], "grouped_weight_ownership='experts'"),
    ],
)
def test_recipe_plan_bad_input(capsys, overrides, message):
    from nemo_lw_fp8 import cli

    assert cli.main(["plan", "--recipe", "tiny_deepseek_v3", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.splitlines()) <= 2


def test_recipe_plan_tiny_hopper_has_discrete_experts():
    """``tiny_<model>_hopper`` plans the tiny architecture with the Hopper variant's discrete
    expert weights (the blockwise gather handles no grouped tensors)."""
    from nemo_lw_fp8.planner import recipe_plan

    hopper = recipe_plan.recipe_setup("tiny_deepseek_v3_hopper")
    mxfp8 = recipe_plan.recipe_setup("tiny_deepseek_v3")
    assert hopper.arch == mxfp8.arch and hopper.par == mxfp8.par
    assert (hopper.single_grouped_weight, mxfp8.single_grouped_weight) == (False, True)


@pytest.mark.parametrize(
    ("recipe", "overrides", "gather"),
    [
        ("tiny_deepseek_v3", [], "mxfp8"),
        ("tiny_deepseek_v3_hopper", [], "blockwise"),
        ("tiny_deepseek_v3_nvfp4", [], "nvfp4"),
        ("tiny_deepseek_v3_nvfp4", ["mixed_precision.fp4_param_gather=false"], "bf16"),
    ],
)
def test_recipe_plan_names_the_gather_the_recipe_runs(capsys, recipe, overrides, gather):
    """The plan's header names what the recipe's param gather moves (NVFP4 recipes gather FP4
    bytes, Hopper ones blockwise FP8), not just whether an FP8 gather is on."""
    from nemo_lw_fp8 import cli

    assert cli.main(["plan", "--recipe", recipe, *overrides]) == 0
    out = capsys.readouterr().out
    assert f"param gather {gather}," in out
