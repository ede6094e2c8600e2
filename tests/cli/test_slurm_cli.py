"""SLURM launch (issue 7): ``nemo-lw-fp8 slurm`` on the command line (options mixed with
overrides, refusals with exit code 2 that name their flag, the sub-command registered) and the
nemo-run path (its executor's fields, its dry-run's torchrun job)."""

from __future__ import annotations

import io
import os
import subprocess
from pathlib import Path
from unittest import mock

import pytest

from nemo_lw_fp8.cli.slurm import command as slurm_cli
from nemo_lw_fp8.cli.slurm import nemo_run_executor as slurm_nemo_run
from nemo_lw_fp8.cli.slurm.sbatch import write_sbatch
from nemo_lw_fp8.cli.slurm.settings import SlurmConfigError
from tests.support.slurm_jobs import HOSTILE, errors_without_the_flag

# --------------------------------------------------------------------------- command line


def test_cli_writes_script_and_mixes_options_with_overrides(tmp_path: Path, capsys) -> None:
    out = tmp_path / "x.sbatch"
    rc = slurm_cli.main(
        [
            "tiny_deepseek_v3",
            "a=1",
            "--nodes",
            "2",
            "b=2",
            "--gpus-per-node",
            "4",
            "--container-mounts",
            "/a:/a,/b:/c",
            "--container-image",
            "img",
            "--env",
            "X=y z",
            "--output",
            str(out),
            "--cpu",
        ]
    )
    assert rc == 0
    text = out.read_text()
    assert os.access(out, os.X_OK)
    assert text == write_sbatch(
        "tiny_deepseek_v3",
        nodes=2,
        gpus_per_node=4,
        container_image="img",
        container_mounts=["/a:/a", "/b:/c"],
        env={"X": "y z"},
        overrides=["a=1", "b=2"],
        cpu=True,
    )
    assert slurm_cli.main(["r", "--nodes", "1"]) == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash\n")


BAD_ARGV: list[tuple[list[str], str]] = [
    (["r", "--nodes", "0"], "--nodes"),
    (["r", "--nodes", "1", "oops"], "key=value"),
    (["r", "--nodes", "1", "--dryrun"], "--dryrun"),
    (["r", "--nodes", "1", "--executor", "nemo-run", "--output", "f"], "--output"),
]


@pytest.mark.parametrize(("argv", "flag"), BAD_ARGV)
def test_cli_bad_input_exit_code(argv: list[str], flag: str, capsys) -> None:
    assert slurm_cli.main(argv) == 2
    assert f"error: {flag}" in capsys.readouterr().err


def test_control_cli_errors_without_the_flag_fail_the_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Control of ``test_cli_bad_input_exit_code``: with refusals that do not name their flag
    the CLI still exits with 2, and the same stderr check fails for every case."""
    errors_without_the_flag(monkeypatch)
    named = []
    for argv, flag in BAD_ARGV:
        assert slurm_cli.main(argv) == 2
        if f"error: {flag}" in capsys.readouterr().err:
            named.append(flag)
    assert named == []


def test_subcommand_registration_passes_everything_through(capsys) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="nemo-lw-fp8")
    sub = parser.add_subparsers(dest="command", required=True)
    slurm_cli.add_slurm_subcommand(sub)
    args = parser.parse_args(["slurm", "r", "--nodes", "1", "k=v", "--cpu"])
    assert args.handler(args) == 0
    assert "    --cpu \\\n    k=v\n" in capsys.readouterr().out


def test_registered_in_nemo_lw_fp8_cli(capsys) -> None:
    from nemo_lw_fp8 import cli

    assert cli.main(["slurm", "r", "--nodes", "1"]) == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash\n")


# --------------------------------------------------------------------------- nemo-run


def _needs_nemo_run() -> None:
    """Skip the test unless nemo-run is installed."""
    pytest.importorskip(
        "nemo_run",
        reason="needs nemo-run (pip install 'nemo-lw-fp8[bridge]')",
        exc_type=ImportError,
    )


@pytest.fixture(scope="module")
def nemo_run_dryrun() -> str:
    _needs_nemo_run()
    # nemo-run's local tunnel runs shell commands through invoke, which reads stdin; pytest's
    # captured stdin refuses reads, so give it an empty one.
    with mock.patch("sys.stdin", io.StringIO()):
        return slurm_nemo_run.submit_nemo_run(
            "tiny_deepseek_v3",
            dryrun=True,
            nodes=2,
            gpus_per_node=4,
            partition="batch",
            container_image="img:1",
            container_mounts=["/data:/data"],
            env={"FOO": HOSTILE},
            overrides=[f"a.b={HOSTILE}"],
            config_file="/cfg/c.yaml",
            gpu_arch="blackwell",
            job_name="dsv3",
        )


def test_nemo_run_executor_fields() -> None:
    _needs_nemo_run()
    ex = slurm_nemo_run.slurm_executor(
        nodes=4,
        gpus_per_node=8,
        account="acc",
        container_image="img",
        container_mounts=["/a:/a"],
        env={"FOO": "a b"},
    )
    assert (ex.nodes, ex.ntasks_per_node, ex.gpus_per_node) == (4, 8, 8)
    assert ex.container_image == "img" and ex.container_mounts == ["/a:/a"]
    assert ex.srun_args == ["--no-container-mount-home"]
    assert ex.env_vars["FOO"] == "'a b'"  # nemo-run writes `export NAME=VALUE` verbatim
    assert ex.env_vars["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    script = slurm_nemo_run.pretrain_script("r", overrides=["k=v"], cpu=True)
    assert script.to_command(with_entrypoint=True) == [
        "python",
        "-m",
        "nemo_lw_fp8.cli",
        "pretrain",
        "--recipe",
        "r",
        "--cpu",
        "k=v",
    ]
    with pytest.raises(SlurmConfigError, match="^--nodes"):
        slurm_nemo_run.slurm_executor(nodes=0)


def test_nemo_run_dryrun_renders_a_valid_torchrun_job(nemo_run_dryrun: str, tmp_path) -> None:
    text = nemo_run_dryrun
    start = text.index("#!/bin/bash")
    script = text[start:]
    path = tmp_path / "nemo_run.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    for piece in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=batch",
        "#SBATCH --job-name=dsv3",
        "#SBATCH --exclusive",
        "--container-image img:1",
        "--no-container-mount-home",
        "--nproc-per-node 4",
        "--nnodes 2",
        "-m nemo_lw_fp8.cli pretrain --recipe tiny_deepseek_v3 --config-file",
        "export CUDA_DEVICE_MAX_CONNECTIONS=32",
        "export NCCL_NVLS_ENABLE=0",
    ):
        assert piece in script, piece
    # the hostile values survive nemo-run's own rendering as single shell words
    export_line = next(ln for ln in script.splitlines() if ln.startswith("export FOO="))
    value = subprocess.run(
        ["bash", "-c", f'{export_line}; printf %s "$FOO"'], capture_output=True, text=True
    ).stdout
    assert value == HOSTILE
