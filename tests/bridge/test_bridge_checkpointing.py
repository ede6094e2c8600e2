"""Save and resume through Megatron-Bridge's own ``pretrain`` loop (2 CPU ranks, torchrun),
launched as ``nemo llm pretrain`` (nemo-run's CLI; the control runs ``nemo-lw-fp8 pretrain``
through tests/support/bridge_run.py, which can switch a fix off, forked from the tests' launch
server).

tiny DeepSeek-V3 with every plugin feature on (layer-wise Muon, compact layout, overlapped
gathers, MXFP8 param gather): a run saves a ``torch_dist`` checkpoint at iteration 2 and goes
on to 4 (evaluating at 3 and at the end); fresh processes load it and train iterations 3-4.
Training and evaluation losses after the save equal the run that went on, bitwise, and the
weights the save wrote are the masters of that step. The model is the recipe's: single grouped
expert weights (one TE ``GroupedTensor`` per expert linear, written per expert as megatron does)
and dropout 0.1 (the CPU backend keeps the CUDA generator's stream apart from the host's, so the
resumed dropout masks are the uninterrupted run's).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import bridge_runs as br

HERE = Path(__file__).parent

pytestmark = pytest.mark.usefixtures("bridge_installed")


COMMON = ("validation.eval_interval=3", "train.global_batch_size=4")


def _nemo_llm_pretrain(tmp: Path, tag: str, *extra: str) -> dict:
    """``torchrun ... nemo llm pretrain --factory tiny_deepseek_v3 --yes cpu=True ...``."""
    out = tmp / f"{tag}.json"
    nemo = shutil.which("nemo", path=str(Path(sys.executable).parent))
    assert nemo is not None, "the `nemo` executable (nemo-run) is not installed next to Python"
    overrides = "overrides=[" + ",".join(f'"{item}"' for item in (*COMMON, *extra)) + "]"
    port = str(29700 + (os.getpid() + sum(map(ord, tag))) % 200)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port",
         port, nemo, "llm", "pretrain", "--factory", "tiny_deepseek_v3", "--yes", "cpu=True",
         f"losses_json={out}", overrides],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads(out.read_text())


def _saved_weights_vs_masters(iteration_dir: Path) -> dict[str, list[str]]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.bridge_checkpoint_check", str(iteration_dir)],
        capture_output=True, text=True, timeout=600, cwd=HERE.parent.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _train(run: dict) -> list[float]:
    return [row["lm loss"] for row in run["train"]]


def _eval(run: dict) -> list[float]:
    return [row["lm loss"] for row in run["eval"]]


@pytest.mark.extended  # ~5 min of torchrun imports; the gate resumes the Qwen3.5 twin
def test_save_and_resume_in_fresh_processes_is_bitwise(tmp_path):
    ckpt = tmp_path / "ckpt"
    save = ("train.train_iters=4", f"checkpoint.save={ckpt}", "checkpoint.save_interval=2")
    full = _nemo_llm_pretrain(tmp_path, "full", *save)
    checked = _saved_weights_vs_masters(ckpt / "iter_0000002")
    assert checked["stale"] == [] and len(checked["matched"]) > 10, checked

    # The full run also saved at its end (iteration 4): load the iteration-2 checkpoint.
    resumed = _nemo_llm_pretrain(
        tmp_path, "resumed", "train.train_iters=4", f"checkpoint.load={ckpt}",
        "checkpoint.ckpt_step=2",
    )  # fmt: skip
    assert len(_train(full)) == 4 and len(_train(resumed)) == 2
    assert _train(resumed) == _train(full)[2:]  # exact float equality
    # Evals at iteration 3 and the final one; none at 2, so nothing but the save-time sync
    # gathers the weights of step 2 before they are written.
    assert len(_eval(full)) == 2 and _eval(resumed) == _eval(full)

    # Control: without the forced gather before the save, Bridge writes the weights of the
    # step before (the overlapped gather waits for the next forward).
    stale_dir = tmp_path / "stale"
    br.pretrain(tmp_path, "stale", "tiny_deepseek_v3", *COMMON, "train.train_iters=2",
                f"checkpoint.save={stale_dir}", "checkpoint.save_interval=2",
                mutation="save_param_sync")  # fmt: skip
    stale = _saved_weights_vs_masters(stale_dir / "iter_0000002")
    assert len(stale["stale"]) > 10, stale
