"""Runs of ``nemo-lw-fp8 pretrain --cpu`` for the Bridge tests, in ranks launched by ``torchrun``
as a user launches them, or forked from the session's launch server, which imported the stack
once (``launcher="fork"``, tests/support/fork_run.py and tests/support/fork_server.py: the same
entry point and rank environment, without ~20 s of imports per run). tests/support/bridge_run.py
adds an optional mutation that switches one fix off.

:func:`pretrain` returns the run's record: ``train`` (per iteration: reduced ``lm loss`` and
``grad norm``), ``eval`` (per evaluation), ``ranks`` (each rank's digest of its fp32 masters
and optimizer state at the end), ``state`` (``{"start" | "end": {parameter: {kind: sha}}}``:
the per-parameter record of :mod:`nemo_lw_fp8.mechanics.state_by_name`, the union over ranks,
which must agree where several hold an entry; ``start`` is taken after a load), and the
grouped-weight ownership facts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support import fork_server

HERE = Path(__file__).parent
#: FP8 param gather off, everything else as the recipe ships (the parity reference).
GATHER_OFF = (
    "mixed_precision.fp8_param_gather=false",
    "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=false",
)


LAUNCHERS = ("torchrun", "fork")


def _launch(
    tmp: Path,
    tag: str,
    recipe: str,
    overrides: tuple[str, ...],
    nproc: int,
    mutation: str,
    timeout: int,
    launcher: str = "torchrun",
    probe: str = "",
    cpu_modules: str = "te",
    state_tensors: str = "",
) -> subprocess.CompletedProcess:
    env = dict(os.environ, NEMO_LW_FP8_TEST_MUTATION=mutation, NEMO_LW_FP8_TEST_PROBE=probe)
    env["NEMO_LW_FP8_TEST_STATE_TENSORS"] = state_tensors
    port = str(29500 + (os.getpid() * 7 + sum(map(ord, tag))) % 400)
    words = ["pretrain", "--recipe", recipe, "--cpu", "--cpu-modules", cpu_modules,
             "--losses-json", str(tmp / f"{tag}.json"), *overrides]  # fmt: skip
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                   "--master-port", port, str(HERE / "bridge_run.py"), *words]  # fmt: skip
    elif launcher == "fork":
        return fork_server.server().run(nproc, port, words, env, timeout, tmp, tag)
    else:
        raise ValueError(f"launcher {launcher!r}: one of {LAUNCHERS}")
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


def pretrain(
    tmp: Path,
    tag: str,
    recipe: str,
    *overrides: str,
    nproc: int = 2,
    mutation: str = "",
    timeout: int = 900,
    launcher: str = "fork",
    probe: bool = False,
    cpu_modules: str = "te",
    state_tensors: bool = False,
) -> dict:
    """Train ``recipe`` on ``nproc`` CPU ranks; a failing run fails the test with its log tail
    (a control that crashes is a failure, not a divergence). ``probe``: also record, per rank,
    what the layer-wise optimizer of a blockwise run was built over (``run["probe"]``, see
    tests/support/bridge_run.py). ``cpu_modules``: ``pretrain --cpu-modules``: TE's own modules as
    the GPU builds them (``te``) unless a test asks for the project's CPU layers.
    ``state_tensors``: also keep the tensors behind ``state`` (``run["tensors"]``: per moment,
    per rank, what tests/support/bridge_run.py's ``install_state_tensors`` wrote)."""
    prefix = str(tmp / f"{tag}-probe") if probe else ""
    kept = str(tmp / f"{tag}-state") if state_tensors else ""
    done = _launch(
        tmp, tag, recipe, overrides, nproc, mutation, timeout, launcher, prefix, cpu_modules, kept
    )
    assert done.returncode == 0, f"{tag} failed:\n" + (done.stdout + done.stderr)[-4000:]
    run = json.loads((tmp / f"{tag}.json").read_text())
    from nemo_lw_fp8.mechanics.state_by_name import union

    per_rank = [json.loads((tmp / f"{tag}.json.rank{rank}").read_text()) for rank in range(nproc)]
    run["ranks"] = [record["optimizer_state"] for record in per_rank]
    run["state"] = {
        when: union([record["state_by_name"][when] for record in per_rank])
        for when in ("start", "end")
    }
    if state_tensors:
        import torch

        run["tensors"] = {
            when: [torch.load(f"{kept}.{when}.rank{rank}.pt") for rank in range(nproc)]
            for when in ("start", "end")
        }
    if probe:
        run["probe"] = [
            json.loads(Path(f"{prefix}.rank{rank}.json").read_text()) for rank in range(nproc)
        ]
    return run


def pretrain_refused(tmp: Path, tag: str, recipe: str, *overrides: str, nproc: int = 2) -> str:
    """A run expected to stop with an error: its whole output (asserting that it stopped)."""
    done = _launch(tmp, tag, recipe, overrides, nproc, "", 600, launcher="fork")
    assert done.returncode != 0, f"{tag} was expected to stop but trained"
    return done.stdout + done.stderr


def losses(run: dict) -> list[float]:
    return [row["lm loss"] for row in run["train"]]


def grad_norms(run: dict) -> list[float]:
    return [row["grad norm"] for row in run["train"]]


def eval_losses(run: dict) -> list[float]:
    return [row["lm loss"] for row in run["eval"]]


def saving_at(tmp: Path, iteration: int) -> tuple[str, ...]:
    """Overrides that save a ``torch_dist`` checkpoint into ``tmp / "ckpt"`` every ``iteration``
    iterations."""
    return (f"checkpoint.save={tmp / 'ckpt'}", f"checkpoint.save_interval={iteration}")


def loading_at(tmp: Path, iteration: int) -> tuple[str, ...]:
    """Overrides that load :func:`saving_at`'s checkpoint of ``iteration``."""
    return (f"checkpoint.load={tmp / 'ckpt'}", f"checkpoint.ckpt_step={iteration}")


class SavingRuns:
    """A test module's runs of one recipe, each made once per session and kept by tag: the ON
    run also saves at ``saved_at`` (a save must not change what it trains), a resumed run loads
    that checkpoint in fresh processes. ``overrides`` and ``options`` (of :func:`pretrain`) are
    what every run of the module shares; the tags start with ``prefix``."""

    def __init__(self, prefix: str, recipe: str, *overrides: str, saved_at: int, **options: Any):
        self.prefix, self.recipe, self.overrides = prefix, recipe, overrides
        self.saved_at, self.options = saved_at, options
        self._made: dict[str, dict] = {}

    def run(self, tmp: Path, tag: str, *extra: str, mutation: str = "") -> dict:
        """The run ``tag`` with the ``extra`` overrides (and ``mutation``), made the first time."""
        if tag not in self._made:
            self._made[tag] = pretrain(
                tmp, tag, self.recipe, *self.overrides, *extra, mutation=mutation, **self.options
            )
        return self._made[tag]

    def on(self, tmp: Path) -> dict:
        """The ON run; it also saves at ``saved_at``."""
        return self.run(tmp, f"{self.prefix}-on", *saving_at(tmp, self.saved_at))

    def resumed(self, tmp: Path, mutation: str = "") -> dict:
        """Fresh processes load the ON run's checkpoint and train the iterations after it."""
        self.on(tmp)
        loading = loading_at(tmp, self.saved_at)
        tag = f"{self.prefix}-resumed{mutation and '-' + mutation}"
        return self.run(tmp, tag, *loading, mutation=mutation)


def assert_gather_on_equals_off(on: dict, off: dict, steps: int) -> None:
    """FP8 param gather ON = OFF through Bridge: both runs built TE's modules (no project layer),
    only ON held persistent FP8 weights; losses, evaluations, grad norms and every rank's masters
    and optimizer state bitwise (runs made with ``probe=True``)."""
    for run in (on, off):
        for rank in run["probe"]:
            assert rank["te_modules"] > 0 and rank["project_layers"] == 0, rank
    assert all(rank["fp8_weights"] > 0 for rank in on["probe"]), on["probe"]
    assert all(rank["fp8_weights"] == 0 for rank in off["probe"]), off["probe"]
    assert len(losses(on)) == steps and len(eval_losses(on)) >= 1
    assert losses(on) == losses(off)
    assert grad_norms(on) == grad_norms(off)
    assert eval_losses(on) == eval_losses(off)
    assert on["ranks"] == off["ranks"]


def assert_stale_columnwise_diverges(off: dict, stale: dict) -> None:
    """The control of :func:`assert_gather_on_equals_off`: steps 1 and 2 read fresh copies (the
    first gathers re-quantize both); step 3's dgrad reads stale columnwise copies, so its grad
    norm and every rank's state after it differ."""
    assert losses(stale)[0] == losses(off)[0]
    assert grad_norms(stale) != grad_norms(off)
    assert stale["ranks"] != off["ranks"]


def assert_resumed_goes_on(went_on: dict, resumed: dict, saved_at: int) -> None:
    """Fresh processes that loaded ``went_on``'s checkpoint of iteration ``saved_at`` trained the
    rest exactly as it did: losses, grad norms, evaluations, every rank's final state."""
    assert losses(resumed) == losses(went_on)[saved_at:]
    assert grad_norms(resumed) == grad_norms(went_on)[saved_at:]
    assert eval_losses(resumed) == eval_losses(went_on)[-len(eval_losses(resumed)) :]
    assert resumed["ranks"] == went_on["ranks"]
