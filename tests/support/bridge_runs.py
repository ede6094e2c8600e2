"""Runs of ``nemo-lw-fp8 pretrain --cpu`` under ``torchrun`` for the Bridge tests, as a user
launches them (tests/bridge_run.py adds an optional mutation that switches one fix off).

:func:`pretrain` returns the run's record: ``train`` (per iteration: reduced ``lm loss`` and
``grad norm``), ``eval`` (per evaluation), ``ranks`` (each rank's digest of its fp32 masters
and optimizer state at the end), ``state`` (``{"start" | "end": {parameter: {kind: sha}}}``:
the per-parameter record of :mod:`nemo_lw_fp8.launch.state_by_name`, the union over ranks,
which must agree where several hold an entry; ``start`` is taken after a load), and the
grouped-weight ownership facts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent.parent
#: FP8 param gather off, everything else as the recipe ships (the parity reference).
GATHER_OFF = (
    "mixed_precision.fp8_param_gather=false",
    "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=false",
)


def _launch(
    tmp: Path, tag: str, recipe: str, overrides: tuple[str, ...], nproc: int, mutation: str,
    timeout: int,
) -> subprocess.CompletedProcess:
    env = dict(os.environ, NEMO_LW_FP8_TEST_MUTATION=mutation)
    port = str(29500 + (os.getpid() * 7 + sum(map(ord, tag))) % 400)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
         "--master-port", port, str(HERE / "bridge_run.py"), "pretrain", "--recipe", recipe,
         "--cpu", "--losses-json", str(tmp / f"{tag}.json"), *overrides],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip


def pretrain(
    tmp: Path,
    tag: str,
    recipe: str,
    *overrides: str,
    nproc: int = 2,
    mutation: str = "",
    timeout: int = 900,
) -> dict:
    """Train ``recipe`` on ``nproc`` CPU ranks; a failing run fails the test with its log tail
    (a control that crashes is a failure, not a divergence)."""
    done = _launch(tmp, tag, recipe, overrides, nproc, mutation, timeout)
    assert done.returncode == 0, f"{tag} failed:\n" + (done.stdout + done.stderr)[-4000:]
    run = json.loads((tmp / f"{tag}.json").read_text())
    from nemo_lw_fp8.launch.state_by_name import union

    per_rank = [json.loads((tmp / f"{tag}.json.rank{rank}").read_text()) for rank in range(nproc)]
    run["ranks"] = [record["optimizer_state"] for record in per_rank]
    run["state"] = {
        when: union([record["state_by_name"][when] for record in per_rank])
        for when in ("start", "end")
    }
    return run


def pretrain_refused(tmp: Path, tag: str, recipe: str, *overrides: str, nproc: int = 2) -> str:
    """A run expected to stop with an error: its whole output (asserting that it stopped)."""
    done = _launch(tmp, tag, recipe, overrides, nproc, "", 600)
    assert done.returncode != 0, f"{tag} was expected to stop but trained"
    return done.stdout + done.stderr


def losses(run: dict) -> list[float]:
    return [row["lm loss"] for row in run["train"]]


def grad_norms(run: dict) -> list[float]:
    return [row["grad norm"] for row in run["train"]]


def eval_losses(run: dict) -> list[float]:
    return [row["lm loss"] for row in run["eval"]]
