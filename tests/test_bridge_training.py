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


def test_tiny_deepseek_v3_fp8_gather_on_equals_off_through_bridge(tmp_path):
    on = _train(tmp_path, "on", "tiny_deepseek_v3", 4, eval_interval=2)
    off = _train(tmp_path, "off", "tiny_deepseek_v3", 4, *OFF, eval_interval=2)
    assert len(_losses(on)) == 4
    assert _losses(on) == _losses(off)  # exact float equality at every iteration
    assert _losses(on)[-1] < _losses(on)[0]
    # Evals at iterations 2 and 4 and the final one: Bridge keeps the pre-hooks on for a
    # layer-wise run, and they gather the last step's params (Adam's included), exactly.
    assert len(_eval_losses(on)) == 3
    assert _eval_losses(on) == _eval_losses(off)
    # Control: without the init-value table (TE's attribute dropped by Module._apply) the
    # masters start from dequantized FP8 and the runs part after two steps.
    broken = _train(tmp_path, "broken", "tiny_deepseek_v3", 4, mutation="init_value_table")
    assert _losses(broken) != _losses(off)
    # Control: without staging before those gathers, evals see stale Adam params; training
    # (its loop zeroes and stages before every forward) stays bitwise.
    stale = _train(
        tmp_path,
        "stale",
        "tiny_deepseek_v3",
        4,
        eval_interval=2,
        mutation="stage_before_hook_gather",
    )
    assert _losses(stale) == _losses(off)
    assert _eval_losses(stale) != _eval_losses(off)


def test_tiny_deepseek_v3_padded_layout_evals_through_bridge(tmp_path):
    """Padded layer-wise buckets share the grad buffer: an unstaged eval gather ships gradients
    into the MXFP8 weights (NaN); staged, the evals equal FP8 param gather off."""
    padded = "optimizer.layer_wise_layout=padded"
    on = _train(tmp_path, "padded-on", "tiny_deepseek_v3", 4, padded, eval_interval=2)
    off = _train(tmp_path, "padded-off", "tiny_deepseek_v3", 4, padded, *OFF, eval_interval=2)
    assert _losses(on) == _losses(off)
    assert len(_eval_losses(on)) == 3
    assert _eval_losses(on) == _eval_losses(off)


def test_expert_run_ownership_equals_whole_through_bridge(tmp_path):
    """tiny DeepSeek-V3 (8 experts as single grouped weights, MXFP8 primary, compact, overlap):
    the grouped weights' experts owned by both ranks train exactly as whole ownership."""
    whole = _train(tmp_path, "whole", "tiny_deepseek_v3", 4, eval_interval=2)
    expert = _train(
        tmp_path,
        "expert",
        "tiny_deepseek_v3",
        4,
        "optimizer.grouped_weight_ownership=expert",
        eval_interval=2,
    )
    assert expert["grouped_weight_ownership"] == "expert"
    assert expert["expert_slices"] > 0 and whole["expert_slices"] == 0
    assert _losses(expert) == _losses(whole)
    assert len(_eval_losses(expert)) == 3 and _eval_losses(expert) == _eval_losses(whole)


def test_tiny_qwen3_moe_trains_through_bridge(tmp_path):
    run = _train(tmp_path, "qwen", "tiny_qwen3_30b_a3b", 4)
    losses = _losses(run)
    assert len(losses) == 4 and losses[-1] < losses[0], losses


def test_pretrain_dry_run_resolves_and_checks():
    done = subprocess.run(
        [sys.executable, "-m", "nemo_lw_fp8.cli", "pretrain", "--recipe", "tiny_deepseek_v3",
         "--dry-run", "optimizer.layer_wise_layout=padded"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "layer_wise_layout: padded" in done.stdout
    assert "fp8_recipe: mxfp8" in done.stdout


def _nemo() -> str:
    exe = shutil.which("nemo", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("the `nemo` executable (nemo-run) is not installed next to this Python")
    return exe


def test_nemo_llm_pretrain_help_lists_the_recipes():
    from nemo_lw_fp8 import recipes

    done = subprocess.run([_nemo(), "llm", "pretrain", "--help"], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, COLUMNS="200"))
    assert done.returncode == 0, done.stderr[-3000:]
    for name in recipes.RECIPES:
        assert name in done.stdout, name


def test_nemo_llm_pretrain_dry_run_resolves_a_recipe():
    done = subprocess.run(
        [_nemo(), "llm", "pretrain", "--factory", "tiny_qwen3_30b_a3b", "cpu=True", "--dryrun"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, COLUMNS="200"),
    )
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    assert "tiny_qwen3_30b_a3b" in text
