"""The demo's recipe on TE's own modules through Megatron-Bridge's ``pretrain`` (issue 28, "one
model path"): ``nemo-lw-fp8 pretrain --cpu`` (``--cpu-modules te``, the default) builds
``tiny_deepseek_v3`` as on a GB200 -- Bridge's provider, megatron's TE spec (MLA, MoE with a
shared expert, MTP), ``TEGroupedMLP`` through TE's op fuser with single grouped MXFP8 weights,
TE's fused MoE permutation -- with only TE's kernels emulated and TE's device questions answered
as SM 10.0.

The claim: FP8 param gather ON = OFF bitwise, for the training and evaluation losses, the grad
norms and every rank's fp32 masters and optimizer state, and the run really was what it says (a
probe counts TE's modules, no project layer, and persistent MXFP8 weights only ON). Control:
ON with each gathered weight's columnwise copy left stale diverges (from step 3's gradients on:
the grad norms and every rank's state; the losses only from step 4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import bridge_runs as br

pytestmark = pytest.mark.usefixtures("bridge_installed")

RECIPE = "tiny_deepseek_v3"
STEPS = 3
_runs: dict[str, dict] = {}


def _run(tmp: Path, tag: str, *extra: str, mutation: str = "") -> dict:
    if tag not in _runs:
        _runs[tag] = br.pretrain(
            tmp, tag, RECIPE, f"train.train_iters={STEPS}", "validation.eval_interval=2",
            "train.global_batch_size=4", *extra, mutation=mutation, probe=True,
            cpu_modules="te",
        )  # fmt: skip
    return _runs[tag]


def _on(tmp: Path) -> dict:
    return _run(tmp, "te-on")


def _off(tmp: Path) -> dict:
    return _run(tmp, "te-off", *br.GATHER_OFF)


def test_te_modules_gather_on_equals_off_through_bridge(tmp_path):
    on, off = _on(tmp_path), _off(tmp_path)
    for run in (on, off):
        for rank in run["probe"]:
            assert rank["te_modules"] > 0 and rank["project_layers"] == 0, rank
    assert all(rank["fp8_weights"] > 0 for rank in on["probe"]), on["probe"]
    assert all(rank["fp8_weights"] == 0 for rank in off["probe"]), off["probe"]
    assert len(br.losses(on)) == STEPS and len(br.eval_losses(on)) >= 1
    assert br.losses(on) == br.losses(off)
    assert br.grad_norms(on) == br.grad_norms(off)
    assert br.eval_losses(on) == br.eval_losses(off)
    assert on["ranks"] == off["ranks"]  # every rank's masters and optimizer state


def test_control_stale_columnwise_diverges_through_bridge(tmp_path):
    off = _off(tmp_path)
    stale = _run(tmp_path, "te-stale", mutation="te_stale_columnwise")
    # Steps 1 and 2 read fresh copies (the first gathers re-quantize both); step 3's dgrad reads
    # stale columnwise copies: its gradients, so its grad norm and the masters after it, differ.
    assert br.losses(stale)[0] == br.losses(off)[0]
    assert br.grad_norms(stale) != br.grad_norms(off)
    assert stale["ranks"] != off["ranks"]
