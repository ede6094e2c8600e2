"""The recipes' launch environment (``nemo_lw_fp8/recipes/te_env.py``): what their TE layers need,
carried by every launcher, checked by a guard, and enough to build each MXFP8 recipe's model from
megatron's Transformer Engine spec.

Model builds run TE 2.20.2's own modules over the project's emulation (one CPU rank), with
``torch.cuda.is_available`` answered True during construction only (TE's module base asks), as
``tests/cpu/test_cpu_norm_linear.py`` does.
"""

from __future__ import annotations

import contextlib
import os
import unittest.mock
from pathlib import Path

import pytest

from nemo_lw_fp8 import recipes
from nemo_lw_fp8 import rules as guards
from nemo_lw_fp8.cli.slurm.sbatch import write_sbatch
from nemo_lw_fp8.cli.slurm.settings import SlurmConfigError
from nemo_lw_fp8.recipes import te_env
from tests.support.harness import BootOptions, run_on_ranks

MXFP8_TINY = [recipes.tiny_name(model) for model in recipes.MODELS]
FULL = [name for name in recipes.RECIPES if not name.startswith(("tiny_", "twin_"))]
ASSERTION = "Fused GroupedMLP is not supported for this configuration."
REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- what is needed


@pytest.mark.parametrize("name", sorted(recipes.RECIPES))
def test_every_recipe_needs_what_its_experts_take(name):
    """MXFP8 recipes (single grouped weights through TE's op fuser, SwiGLU experts) need both
    variables; Hopper recipes (discrete experts, no op fuser) need none."""
    needed = te_env.as_dict(te_env.for_recipe(name))
    if name.endswith(("_nvfp4", "_hopper")):  # discrete experts; NVFP4 rounds as TE ships it
        assert needed == {}
    else:
        assert needed == {te_env.SINGLE_GROUPED_WEIGHT_ENV: "1", te_env.CUTEDSL_ENV: "1"}
        assert [v.name for v in te_env.for_recipe(name) if v.before_import] == [te_env.CUTEDSL_ENV]


def test_expert_path_per_gpu():
    """On SM 10.x with cudnn-frontend >= 1.23 an MXFP8 (E4M3) recipe takes TE's CuTe-DSL fused
    grouped MLP; without cudnn-frontend, or under a HYBRID format, the op fuser's unfused ops;
    MXFP8 on Hopper is refused; Hopper recipes take TE's GroupedLinear modules."""
    model = te_env.recipe_model("deepseek_v3_mxfp8")
    assert te_env.expert_path(model, (10, 0), "1.23.0").startswith("TE CuTe-DSL fused")
    assert te_env.expert_path(model, (10, 0), "1.22.9").startswith("TE op fuser, unfused")
    assert te_env.expert_path(model, (10, 0), None).startswith("TE op fuser, unfused")
    hybrid = model | {"fp8": "hybrid"}
    assert te_env.expert_path(hybrid, (10, 0), "1.24.0").startswith("TE op fuser, unfused")
    assert te_env.expert_path(model, (9, 0), "1.24.0").startswith("unsupported")
    assert te_env.expert_path(model, (10, 0), "1.24.0", env_set=False).startswith("none")
    hopper = te_env.recipe_model("deepseek_v3_hopper")
    assert te_env.expert_path(hopper, (9, 0), None).startswith("TEGroupedMLP unfused")


def test_export_for_launch_fills_only_unset_and_import_time_variables():
    environ: dict[str, str] = {}
    assert te_env.export_for_launch("tiny_deepseek_v3", environ=environ) == {
        te_env.CUTEDSL_ENV: "1"
    }
    # the environment and an env_vars override win
    environ = {te_env.CUTEDSL_ENV: "1"}
    assert te_env.export_for_launch("tiny_deepseek_v3", environ=environ) == {}
    environ = {}
    overrides = [f"env_vars.{te_env.CUTEDSL_ENV}='0'"]
    assert te_env.export_for_launch("tiny_deepseek_v3", overrides, environ=environ) == {
        te_env.CUTEDSL_ENV: "0"
    }
    assert te_env.export_for_launch("deepseek_v3_hopper", environ={}) == {}


def test_doctor_and_plan_say_which_expert_path(capsys):
    from nemo_lw_fp8.cli import doctor
    from nemo_lw_fp8.cli import plan as plan_cli

    rows = doctor.collect()["expert_path"]["rows"]
    cute = [r for r in rows if r["recipes"] == "*_mxfp8" and r["path"].startswith("TE CuTe-DSL")]
    assert [r["gpu"] for r in cute] == ["gb200 + cudnn-frontend >= 1.23.0"]
    assert any(r["gpu"] == "this machine (launched)" for r in rows)
    assert "expert path" in doctor.render(doctor.collect())
    assert plan_cli.main(["--recipe", "deepseek_v2_lite_mxfp8"]) == 0
    out = capsys.readouterr().out
    assert "experts on gb200 + cudnn-frontend >= 1.23.0: TE CuTe-DSL fused grouped MLP" in out
    assert "experts on gb200 without cudnn-frontend: TE op fuser, unfused" in out
    assert plan_cli.main(["--recipe", "deepseek_v2_lite_hopper", "--json"]) == 0
    import json

    result = json.loads(capsys.readouterr().out)
    assert result["expert_path"] == [
        {"gpu": "h100", "path": "TEGroupedMLP unfused: TE GroupedLinear modules, discrete weights"}
    ]


# --------------------------------------------------------------------------- the guard


def _silu():
    """Stands for ``torch.nn.functional.silu`` (the rule reads the activation's name)."""


_silu.__name__ = "silu"
OP_FUSER_GLU = dict(num_moe_experts=8, gated_linear_unit=True, activation_func=_silu,
                    moe_grouped_gemm=True, use_transformer_engine_op_fuser=True)  # fmt: skip


def test_guard_refuses_op_fuser_glu_experts_without_the_variable(monkeypatch):
    # what a launcher will export, given: missing is refused
    with pytest.raises(guards.ConfigError) as caught:
        guards.check(guards.Settings(**OP_FUSER_GLU, cutedsl_fused_grouped_mlp=False))
    assert caught.value.rule == "op-fuser-glu-experts-env"
    assert f"export {te_env.CUTEDSL_ENV}=1" in str(caught.value) and "Fix:" in str(caught.value)
    monkeypatch.setenv(te_env.CUTEDSL_ENV, "0")  # a contradicting process environment
    assert [r for r, _ in guards.violations(guards.Settings(**OP_FUSER_GLU))] == [
        "op-fuser-glu-experts-env"
    ]
    monkeypatch.setenv(te_env.CUTEDSL_ENV, "1")
    assert guards.violations(guards.Settings(**OP_FUSER_GLU)) == []
    # unset and not given: the recipe's env_vars may still give it (Bridge exports them)
    monkeypatch.delenv(te_env.CUTEDSL_ENV)
    assert guards.violations(guards.Settings(**OP_FUSER_GLU)) == []
    # not a GLU the op fuser fuses, or no op fuser: nothing needed
    off = dict(cutedsl_fused_grouped_mlp=False)
    settings = guards.Settings(**OP_FUSER_GLU | off | dict(gated_linear_unit=False))
    assert guards.violations(settings) == []
    settings = guards.Settings(**OP_FUSER_GLU | off | dict(use_transformer_engine_op_fuser=False))
    assert guards.violations(settings) == []


def test_check_environment_names_the_variable():
    with pytest.raises(guards.ConfigError, match=te_env.CUTEDSL_ENV):
        te_env.check_environment("deepseek_v3_mxfp8", {te_env.SINGLE_GROUPED_WEIGHT_ENV: "1"})
    with pytest.raises(guards.ConfigError, match=te_env.SINGLE_GROUPED_WEIGHT_ENV):
        te_env.check_environment("deepseek_v3_mxfp8", {te_env.CUTEDSL_ENV: "1"})
    te_env.check_environment("deepseek_v3_hopper", {})


# --------------------------------------------------------------------------- launchers


@pytest.mark.parametrize("name", FULL)
def test_sbatch_exports_the_recipe_environment(name):
    text = write_sbatch(name, nodes=2, gpu_arch="blackwell")
    lines = text.splitlines()
    exported = {line.split("=")[0][len("export "):] for line in lines if line.startswith("export")}
    needed = te_env.as_dict(te_env.for_recipe(name))
    for var, value in needed.items():
        assert f"export {var}={value}" in lines, var
        assert lines[lines.index(f"export {var}={value}") - 1].startswith("# ")  # a reason
    assert te_env.CUTEDSL_ENV in exported or te_env.CUTEDSL_ENV not in needed
    # before torchrun (and so before Python imports TE)
    for var in te_env.for_recipe(name):
        if var.before_import:
            assert lines.index(f"export {var.name}={var.value}") < next(
                i for i, line in enumerate(lines) if "torchrun" in line and "exec" in line
            )


def test_sbatch_on_cpu_leaves_the_import_time_variable_to_pretrain():
    text = write_sbatch("tiny_deepseek_v3", nodes=1, cpu=True)
    assert f"export {te_env.SINGLE_GROUPED_WEIGHT_ENV}=1" in text
    assert te_env.CUTEDSL_ENV not in text


def test_sbatch_refuses_a_contradicting_env():
    with pytest.raises(SlurmConfigError, match=f"^--env: .*{te_env.CUTEDSL_ENV}"):
        write_sbatch("deepseek_v3_mxfp8", nodes=2, env={te_env.CUTEDSL_ENV: "0"})
    with pytest.raises(SlurmConfigError, match=f"^--env: .*{te_env.SINGLE_GROUPED_WEIGHT_ENV}"):
        write_sbatch("tiny_qwen3_30b_a3b", nodes=1, env={te_env.SINGLE_GROUPED_WEIGHT_ENV: "0"})
    # a user value that agrees is exported once
    text = write_sbatch("deepseek_v3_mxfp8", nodes=2, env={te_env.CUTEDSL_ENV: "1"})
    assert text.count(f"export {te_env.CUTEDSL_ENV}=") == 1


def test_nemo_run_executor_carries_the_recipe_environment():
    pytest.importorskip("nemo_run", exc_type=ImportError)
    from nemo_lw_fp8.cli.slurm import nemo_run_executor as slurm_nemo_run

    ex = slurm_nemo_run.slurm_executor(nodes=2, gpus_per_node=4, gpu_arch="blackwell",
                                       recipe="qwen3_235b_a22b_mxfp8")  # fmt: skip
    assert ex.env_vars[te_env.CUTEDSL_ENV] == "1"
    assert ex.env_vars[te_env.SINGLE_GROUPED_WEIGHT_ENV] == "1"
    ex = slurm_nemo_run.slurm_executor(nodes=2, recipe="qwen3_235b_a22b_hopper")
    assert te_env.CUTEDSL_ENV not in ex.env_vars


# --------------------------------------------------------------------------- model builds


def build_recipe_model(name: str, with_env: bool) -> str:
    """Build recipe ``name``'s model from megatron's TE spec (its Bridge provider, its MXFP8
    settings) with the computed launch environment, or without it; "built" or the error."""
    from megatron.bridge.training.mixed_precision import get_mixed_precision_config
    from megatron.core.fp8_utils import get_fp8_context
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cfg = recipes.get_recipe(name)()
    provider = cfg.model
    get_mixed_precision_config(cfg.mixed_precision).setup(provider, cfg.optimizer, cfg.ddp)
    provider.use_cpu_initialization = True
    provider.gradient_accumulation_fusion = False  # apex's CUDA extension otherwise
    provider.finalize()
    assert provider.transformer_impl == "transformer_engine" and provider.fp8_recipe == "mxfp8"
    wanted = te_env.as_dict(te_env.for_config(cfg)) if with_env else {}
    names = (te_env.CUTEDSL_ENV, te_env.SINGLE_GROUPED_WEIGHT_ENV)
    before = {key: os.environ.pop(key, None) for key in names}
    os.environ.update(wanted)
    model_parallel_cuda_manual_seed(1234)
    try:
        with (
            unittest.mock.patch("torch.cuda.is_available", lambda: True),
            get_fp8_context(provider, is_init=True),
            contextlib.redirect_stdout(None),
        ):
            model = provider.provide(pre_process=True, post_process=True)
    except AssertionError as error:
        return f"AssertionError: {error}"
    finally:
        for key, value in before.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
    grouped = [n for n, p in model.named_parameters() if type(p).__name__ == "GroupedTensor"]
    fused = [m for m in model.modules() if type(m).__name__ == "TEGroupedMLP"]
    assert fused and all(m._with_fused_impl for m in fused)
    return f"built: {len(grouped)} grouped weights"


BOOT = BootOptions(fp8_emulation=True)


@pytest.mark.parametrize("name", MXFP8_TINY)
def test_mxfp8_recipe_builds_from_the_te_spec_with_its_environment(name, bridge_installed):
    """With the computed environment TE builds single grouped weights (one ``GroupedTensor``
    per expert linear) behind megatron's op-fuser ``TEGroupedMLP``; without it (the control)
    megatron's own assertion stops the build."""
    built, control = (
        run_on_ranks(build_recipe_model, name, with_env, world_size=1, boot=BOOT, timeout=600)[0]
        for with_env in (True, False)
    )
    assert built.startswith("built: ") and int(built.split()[1]) > 0, built
    assert control.startswith(f"AssertionError: {ASSERTION}"), control


def test_pretrain_exports_before_transformer_engine_is_imported():
    """What ``resolve_config`` runs before it imports Bridge (the GPU path) imports neither TE
    nor megatron, so TE's op fuser sees the variable when it registers its fusions."""
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "os.environ.pop('NVTE_CUTEDSL_FUSED_GROUPED_MLP', None)\n"
        "from nemo_lw_fp8.cli import pretrain\n"
        "from nemo_lw_fp8.recipes import te_env\n"
        "pretrain.check_command_line('deepseek_v3_mxfp8', None, [])\n"
        "print(te_env.export_for_launch('deepseek_v3_mxfp8', []),\n"
        "      os.environ['NVTE_CUTEDSL_FUSED_GROUPED_MLP'],\n"
        "      'transformer_engine' in sys.modules, 'megatron.core' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "{'NVTE_CUTEDSL_FUSED_GROUPED_MLP': '1'} 1 False False"


NVFP4 = [name for name in sorted(recipes.RECIPES) if name.endswith("_nvfp4")]


@pytest.mark.parametrize("name", NVFP4)
def test_nvfp4_recipes_round_as_te_ships_them_on_gpus(name):
    """Stochastic rounding of NVFP4 gradients is TE's default (and Bridge's): no launcher of an
    NVFP4 recipe turns it off (the recipe's ``env_vars``, its YAML, the sbatch script, the
    nemo-run executor's environment); only the CPU backend does, for itself
    (``tests/cpu/test_nvfp4_rounding_on_cpu.py``). A user's own setting is carried as given."""
    from nemo_lw_fp8.cli.slurm.environment import resolve_env
    from nemo_lw_fp8.vocabulary import NVFP4_NO_SR_ENV

    assert NVFP4_NO_SR_ENV not in te_env.as_dict(te_env.for_recipe(name))
    assert NVFP4_NO_SR_ENV not in (REPO / "recipes" / f"{name}.yaml").read_text()
    assert NVFP4_NO_SR_ENV not in write_sbatch(name, nodes=2, gpu_arch="blackwell")
    assert NVFP4_NO_SR_ENV not in {var.name for var in resolve_env("blackwell", recipe=name)}
    mine = {var.name: var.value for var in resolve_env("blackwell", {NVFP4_NO_SR_ENV: "1"}, name)}
    assert mine[NVFP4_NO_SR_ENV] == "1"
