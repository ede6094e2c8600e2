"""Layer-wise Muon with MXFP8 param gather at tensor parallel 2 through Megatron-Bridge's own
``pretrain`` (issue 29): ``nemo-lw-fp8 pretrain --cpu`` on 4 CPU ranks (TP 2 x DP 2, sequence
parallel) builds ``tiny_qwen3_30b_a3b`` as a GB200 would -- Bridge's provider, megatron's TE spec,
TE's own TP-sharded linears, and the MoE experts as ``TEGroupedMLP`` through TE's op fuser with
single grouped MXFP8 weights, whole on every rank (expert TP 1).

The claim: FP8 param gather ON = OFF bitwise, for the training and evaluation losses, the grad
norms and every rank's fp32 masters and optimizer state; the ON ranks held persistent MXFP8
weights, the OFF ranks none. Control: ON with each gathered weight's columnwise copy left stale
diverges (from step 3's gradients on). The one TP-2 run of TE's grouped experts: the harness's
TP-2 MoE (``test_tp_fp8_param_gather.py``) runs megatron's ``SequentialMLP``.

And resume at TP 2: the ON run saves at iteration 2 (``torch_dist``, each TP rank its shards);
fresh processes at TP 2 load it and train iteration 3 = the run that went on, bitwise (loss,
evaluation, grad norm, every rank's state). Control: each rank's first loaded master one ulp up
diverges.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import bridge_runs as br

pytestmark = pytest.mark.usefixtures("bridge_installed")

RECIPE = "tiny_qwen3_30b_a3b"
TP2_SP = ("model.tensor_model_parallel_size=2", "model.sequence_parallel=true")
SAVED_AT = 2
#: Fresh TP-2 processes resume from the ON run's iteration-2 checkpoint and train iteration 3.
RUNS = br.SavingRuns(
    "tp2", RECIPE, *TP2_SP, "train.train_iters=3", "validation.eval_interval=2",
    "train.global_batch_size=4", saved_at=SAVED_AT, nproc=4, probe=True,
)  # fmt: skip
_run, _on, _resumed = RUNS.run, RUNS.on, RUNS.resumed


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp-bridge")


def test_tp2_gather_on_equals_off_through_bridge(runs):
    on, off = _on(runs), _run(runs, "tp2-off", *br.GATHER_OFF)
    br.assert_gather_on_equals_off(on, off, 3)


def test_control_tp2_stale_columnwise_diverges_through_bridge(runs):
    off = _run(runs, "tp2-off", *br.GATHER_OFF)
    stale = _run(runs, "tp2-stale", mutation="te_stale_columnwise")
    br.assert_stale_columnwise_diverges(off, stale)


def test_tp2_resume_in_fresh_processes_is_bitwise(runs):
    on, resumed = _on(runs), _resumed(runs)
    br.assert_resumed_goes_on(on, resumed, SAVED_AT)


def test_control_tp2_loaded_master_one_ulp_off_diverges(runs):
    on, nudged = _on(runs), _resumed(runs, mutation="nudge_loaded_master")
    assert nudged["ranks"] != on["ranks"]


@pytest.mark.extended
def test_tp2_expert_runs_gather_on_equals_off_through_bridge(runs):
    """Single grouped weights owned as runs of experts (``grouped_weight_ownership=expert``: the
    4-rank expert data-parallel group of TP 2 x DP 2 at ETP 1 splits each grouped weight's 8
    experts over its owners) next to TP-2 attention: ON = OFF bitwise, both runs with expert
    slices."""
    expert_runs = "optimizer.grouped_weight_ownership=expert"
    on = _run(runs, "tp2-expert-runs-on", expert_runs)
    off = _run(runs, "tp2-expert-runs-off", expert_runs, *br.GATHER_OFF)
    for run in (on, off):
        assert run["grouped_weight_ownership"] == "expert"
        assert run["expert_slices"] > 0, run["expert_slices"]
    br.assert_gather_on_equals_off(on, off, 3)
