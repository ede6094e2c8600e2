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
