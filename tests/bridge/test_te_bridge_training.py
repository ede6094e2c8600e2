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
the grad norms and every rank's state; the losses only from step 4).

And resume: the ON run saves at iteration 2; fresh processes load it and train iteration 3 =
the run that went on, bitwise (losses, evaluation, grad norm, every rank's state). Control: each
rank's first loaded master one ulp up diverges."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import bridge_runs as br

pytestmark = pytest.mark.usefixtures("bridge_installed")

RECIPE = "tiny_deepseek_v3"
STEPS = 3
SAVED_AT = 2
RUNS = br.SavingRuns(
    "te", RECIPE, f"train.train_iters={STEPS}", "validation.eval_interval=2",
    "train.global_batch_size=4", saved_at=SAVED_AT, probe=True, cpu_modules="te",
)  # fmt: skip
_run, _on, _resumed = RUNS.run, RUNS.on, RUNS.resumed


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for the module's runs (the resume tests load the ON run's checkpoint)."""
    return tmp_path_factory.mktemp("te-bridge")


def _off(tmp: Path) -> dict:
    return _run(tmp, "te-off", *br.GATHER_OFF)


def test_te_modules_gather_on_equals_off_through_bridge(runs):
    on, off = _on(runs), _off(runs)
    br.assert_gather_on_equals_off(on, off, STEPS)


def test_control_stale_columnwise_diverges_through_bridge(runs):
    off = _off(runs)
    stale = _run(runs, "te-stale", mutation="te_stale_columnwise")
    br.assert_stale_columnwise_diverges(off, stale)


def test_te_modules_resume_in_fresh_processes_is_bitwise(runs):
    """Single grouped MXFP8 weights through TE's modules save in TE's per-expert layout and load
    back; the resumed iteration, its evaluation and every rank's final state equal the run that
    went on."""
    on, resumed = _on(runs), _resumed(runs)
    br.assert_resumed_goes_on(on, resumed, SAVED_AT)


def test_control_loaded_master_one_ulp_off_diverges(runs):
    on, nudged = _on(runs), _resumed(runs, mutation="nudge_loaded_master")
    assert nudged["ranks"] != on["ranks"]
