"""Tiny recipes trained by Megatron-Bridge's own ``pretrain`` loop on 2 CPU ranks (torchrun),
every plugin feature on; FP8 param gather ON = OFF bitwise; the launchers' entry points."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import bridge_runs as br
from tests.support.side_by_side import run_side_by_side

HERE = Path(__file__).parent
OFF = br.GATHER_OFF


pytestmark = pytest.mark.usefixtures("bridge_installed")


def _train(
    tmp: Path,
    tag: str,
    recipe: str,
    steps: int,
    *extra: str,
    mutation: str = "",
    eval_interval: int | None = None,
) -> dict:
    return br.pretrain(
        tmp, tag, recipe, f"train.train_iters={steps}",
        f"validation.eval_interval={eval_interval or steps}", "train.global_batch_size=4", *extra,
        mutation=mutation,
    )  # fmt: skip


_losses, _eval_losses = br.losses, br.eval_losses


PADDED = "optimizer.layer_wise_layout=padded"
EXPERT = "optimizer.grouped_weight_ownership=expert"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """``tiny_run(tag, *extra, mutation="")``: tiny DeepSeek-V3, 4 iterations, evaluations at 2,
    4 and the final one; kept for the module (a control reuses its parity test's reference)."""
    done: dict[tuple, dict] = {}

    def run(tag: str, *extra: str, mutation: str = "") -> dict:
        key = (tag, extra, mutation)
        if key not in done:
            tmp = tmp_path_factory.mktemp(tag)
            done[key] = _train(tmp, tag, "tiny_deepseek_v3", 4, *extra, mutation=mutation,
                               eval_interval=2)  # fmt: skip
        return done[key]

    return run


def test_tiny_deepseek_v3_padded_layout_evals_through_bridge(tiny_run):
    """Padded layer-wise buckets share the grad buffer: an unstaged eval gather ships gradients
    into the MXFP8 weights (NaN); staged, the evals equal FP8 param gather off."""
    on = tiny_run("padded-on", PADDED)
    off = tiny_run("padded-off", PADDED, *OFF)
    assert _losses(on) == _losses(off)
    assert len(_eval_losses(on)) == 3
    assert _eval_losses(on) == _eval_losses(off)


def test_control_padded_layout_evals_with_stale_staging_differ(tiny_run):
    """Control of the padded-layout test: the staging before an eval's gathers writes the values
    this rank staged last, the masters before the step (mutation ``stale_eval_staging``,
    tests/support/bridge_run.py), in place of the current ones. The run completes and trains as FP8
    param gather off (every training forward's gather is staged after a zero, as usual), and its
    evals differ: the evals' equality says an eval's gathers ship the masters of the step just
    taken. (Without any staging the eval gathers the fp32 gradients' bytes as bf16, which are
    not finite, so the run stops on a NaN loss rather than diverging.)"""
    off = tiny_run("padded-off", PADDED, *OFF)
    stale = tiny_run("padded-stale-staging", PADDED, mutation="stale_eval_staging")
    assert _losses(stale) == _losses(off)
    assert len(_eval_losses(stale)) == 3
    assert _eval_losses(stale) != _eval_losses(off)


def test_expert_run_ownership_equals_whole_through_bridge(tiny_run):
    """tiny DeepSeek-V3 (8 experts as single grouped weights, MXFP8 primary, compact, overlap):
    the grouped weights' experts owned by both ranks train exactly as whole ownership."""
    whole = tiny_run("whole")
    expert = tiny_run("expert", EXPERT)
    assert expert["grouped_weight_ownership"] == "expert"
    assert expert["expert_slices"] > 0 and whole["expert_slices"] == 0
    assert _losses(expert) == _losses(whole)
    assert len(_eval_losses(expert)) == 3 and _eval_losses(expert) == _eval_losses(whole)


def test_control_expert_runs_owner_keeping_its_old_runs_differ(tiny_run):
    """Control of the expert-run test: each owner assembles its grouped MXFP8 expert weights
    from the other ranks' gathered runs but its own runs' pre-step values, not the bytes it
    stepped and sent (mutation ``stale_own_expert_runs``, tests/support/bridge_run.py). The run
    completes and its losses after the first step differ from whole ownership's: the equality
    says every rank, owners included, quantizes each grouped weight from every run's stepped
    bytes. (Skipping the owner's own segment outright leaves that run uninitialized memory in
    the assembled weight, so the run stops on a NaN loss rather than diverging.)"""
    whole = tiny_run("whole")
    stale = tiny_run("expert-own-stale", EXPERT, mutation="stale_own_expert_runs")
    assert stale["expert_slices"] > 0
    assert _losses(stale)[0] == _losses(whole)[0]  # the first forward precedes any gather
    assert _losses(stale) != _losses(whole)


def _nemo() -> str:
    exe = shutil.which("nemo", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("the `nemo` executable (nemo-run) is not installed next to this Python")
    return exe


#: The launchers' commands the tests below check: each only resolves (no training), and each
#: spends its time importing NeMo / Bridge on one core, so they run side by side.
_LAUNCHES = {
    "pretrain dry run": [sys.executable, "-m", "nemo_lw_fp8.cli", "pretrain", "--recipe",
                         "tiny_deepseek_v3", "--dry-run", "optimizer.layer_wise_layout=padded"],
    "nemo help": ["{nemo}", "llm", "pretrain", "--help"],
    "nemo dry run": ["{nemo}", "llm", "pretrain", "--factory", "tiny_qwen3_30b_a3b", "cpu=True",
                     "--dryrun"],
}  # fmt: skip


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Each command of ``_LAUNCHES`` run to completion, side by side: name -> its result."""
    nemo = _nemo()
    commands = {name: [nemo if part == "{nemo}" else part for part in command]
                for name, command in _LAUNCHES.items()}  # fmt: skip
    return run_side_by_side(commands, tmp_path_factory.mktemp("launches"),
                            env=dict(os.environ, COLUMNS="200"))  # fmt: skip


def test_pretrain_dry_run_resolves_and_checks(launches):
    done = launches["pretrain dry run"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "layer_wise_layout: padded" in done.stdout
    assert "fp8_recipe: mxfp8" in done.stdout


def test_nemo_llm_pretrain_help_lists_the_recipes(launches):
    from nemo_lw_fp8 import recipes

    done = launches["nemo help"]
    assert done.returncode == 0, done.stderr[-3000:]
    for name in recipes.RECIPES:
        assert name in done.stdout, name


def test_nemo_llm_pretrain_dry_run_resolves_a_recipe(launches):
    done = launches["nemo dry run"]
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    assert "tiny_qwen3_30b_a3b" in text
