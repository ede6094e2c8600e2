"""SLURM launch (issue 7): the sbatch scripts the generator writes (``bash -n`` and shellcheck on
several settings, the header and environment), refusals that name their flag, and the example
scripts in ``recipes/slurm`` (up to date, known recipes, shellcheck)."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

from nemo_lw_fp8.cli.slurm.sbatch import write_sbatch
from nemo_lw_fp8.cli.slurm.settings import SlurmConfigError
from tests.support.slurm_jobs import (
    CONFIGS,
    EXAMPLES_DIR,
    errors_without_the_flag,
    recipe_names,
    shellcheck_or_skip,
)

# --------------------------------------------------------------------------- static checks


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_script_parses_with_bash(name: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(write_sbatch("tiny_deepseek_v3", **CONFIGS[name]))
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_script_passes_shellcheck(name: str, tmp_path: Path) -> None:
    shellcheck = shellcheck_or_skip()
    path = tmp_path / "job.sbatch"
    path.write_text(write_sbatch("tiny_deepseek_v3", **CONFIGS[name]))
    result = subprocess.run([shellcheck, str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_sbatch_header_and_environment() -> None:
    text = write_sbatch("tiny_deepseek_v3", **CONFIGS["gpu-full"])
    for line in (
        "#SBATCH --job-name=dsv3",
        "#SBATCH --nodes=16",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --exclusive",
        "#SBATCH --time=1-02:00:00",
        "#SBATCH --partition=batch",
        "#SBATCH --account=proj_a",
        "#SBATCH --output=/lustre/logs/%x-%j.out",
        "#SBATCH --error=/lustre/logs/%x-%j.err",
        "set -euo pipefail",
        "export CUDA_DEVICE_MAX_CONNECTIONS=32",
        "export NCCL_NVLS_ENABLE=0",
        "export TORCH_NCCL_AVOID_RECORD_STREAMS=1",
        "export PYTHONUNBUFFERED=1",
        "export NVTE_DEBUG=1",
        "    --no-container-mount-home \\",
        "srun --mpi=pmix \\",
        "    --nproc-per-node=4 \\",
    ):
        assert line in text.splitlines(), line
    # every #SBATCH line comes before the first command (sbatch stops reading at it)
    lines = text.splitlines()
    first_cmd = next(i for i, ln in enumerate(lines) if ln and not ln.startswith("#"))
    assert all(i < first_cmd for i, ln in enumerate(lines) if ln.startswith("#SBATCH"))
    # every exported variable has a reason right above it
    for i, ln in enumerate(lines):
        if ln.startswith("export ") and "MASTER" not in ln:
            assert lines[i - 1].startswith("# "), ln
    cpu = write_sbatch("tiny_deepseek_v3", **CONFIGS["cpu"])
    assert "--gpus-per-node" not in cpu and "    --cpu \\" in cpu
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in cpu  # hopper is the default


def test_user_env_overrides_default_once() -> None:
    text = write_sbatch("r", nodes=1, env={"NCCL_NVLS_ENABLE": "1"})
    assert text.count("export NCCL_NVLS_ENABLE=") == 1
    assert "export NCCL_NVLS_ENABLE=1" in text


# --------------------------------------------------------------------------- bad inputs


BAD_INPUTS: list[tuple[dict, str]] = [
    (dict(nodes=0), "--nodes"),
    (dict(nodes=-3), "--nodes"),
    (dict(nodes=True), "--nodes"),
    (dict(nodes=1, gpus_per_node=0), "--gpus-per-node"),
    (dict(nodes=1, recipe=""), "RECIPE"),
    (dict(nodes=1, recipe="   "), "RECIPE"),
    (dict(nodes=1, recipe="a\nb"), "RECIPE"),
    (dict(nodes=1, overrides=["novalue"]), "key=value"),
    (dict(nodes=1, overrides=["=1"]), "key=value"),
    (dict(nodes=1, overrides=["a b=1"]), "key=value"),
    (dict(nodes=1, overrides=["a=1\nrm -rf /"]), "key=value"),
    (dict(nodes=1, time="4 hours"), "--time"),
    (dict(nodes=1, partition="a b"), "--partition"),
    (dict(nodes=1, account="x;y"), "--account"),
    (dict(nodes=1, job_name="my job"), "--job-name"),
    (dict(nodes=1, output_dir="logs dir"), "--output-dir"),
    (dict(nodes=1, env={"1BAD": "x"}), "--env"),
    (dict(nodes=1, env={"A-B": "x"}), "--env"),
    (dict(nodes=1, container_mounts=["/a:/b"]), "--container-mounts"),
    (dict(nodes=1, container_image="i", container_mounts=["/a,/b"]), "--container-mounts"),
    (dict(nodes=1, container_image=""), "--container-image"),
    (dict(nodes=1, gpu_arch="ampere"), "--gpu-arch"),
    (dict(nodes=1, srun_cmd=""), "--srun-cmd"),
]


def _refusal_message(kwargs: dict) -> str:
    """The message of the ``SlurmConfigError`` that ``write_sbatch`` raises for ``kwargs``."""
    kwargs = dict(kwargs)
    recipe = kwargs.pop("recipe", "tiny_deepseek_v3")
    with pytest.raises(SlurmConfigError) as info:
        write_sbatch(recipe, **kwargs)
    return str(info.value)


@pytest.mark.parametrize(("kwargs", "flag"), BAD_INPUTS)
def test_bad_inputs_name_the_flag(kwargs: dict, flag: str) -> None:
    message = _refusal_message(kwargs)
    assert message.startswith(flag), message


def test_control_refusals_without_the_flag_fail_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Control of ``test_bad_inputs_name_the_flag``: with refusals that do not name their flag,
    every one of its cases fails the same ``startswith`` check (still refused: the error is
    the same class, only the message changed)."""
    errors_without_the_flag(monkeypatch)
    named = [flag for kwargs, flag in BAD_INPUTS if _refusal_message(kwargs).startswith(flag)]
    assert named == []


# --------------------------------------------------------------------------- examples


def _load_generator():
    spec = importlib.util.spec_from_file_location("slurm_examples", EXAMPLES_DIR / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_examples_are_up_to_date() -> None:
    gen = _load_generator()
    on_disk = {p.name for p in EXAMPLES_DIR.glob("*.sbatch")}
    assert on_disk == set(gen.EXAMPLES), "examples on disk differ from generate.py's table"
    for name in gen.EXAMPLES:
        assert (EXAMPLES_DIR / name).read_text() == gen.render(name), (
            f"{name} is stale: run python recipes/slurm/generate.py"
        )
    assert gen.main(["--check"]) == 0


def test_example_recipes_exist() -> None:
    names = recipe_names()
    for name, kwargs in _load_generator().EXAMPLES.items():
        assert kwargs["recipe"] in names, f"{name}: unknown recipe {kwargs['recipe']}"


def test_examples_pass_shellcheck() -> None:
    shellcheck = shellcheck_or_skip()
    paths = sorted(str(p) for p in EXAMPLES_DIR.glob("*.sbatch"))
    assert paths
    result = subprocess.run([shellcheck, *paths], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
