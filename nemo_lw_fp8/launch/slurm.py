"""SLURM launch for ``nemo-lw-fp8 pretrain``: a self-contained sbatch script, or nemo-run.

Two ways to reach a cluster, both running ``python -m nemo_lw_fp8.cli pretrain --recipe NAME ...``
under torchrun, one torchrun agent per node that starts one rank per GPU:

* :func:`write_sbatch` renders a plain sbatch script (no Python needed on the login node beyond
  generating it; pyxis container options when an image is given). ``nemo-lw-fp8 slurm RECIPE``.
* :func:`slurm_executor` + :func:`pretrain_script` build a nemo-run ``SlurmExecutor`` (torchrun
  launcher) and ``run.Script``; :func:`submit_nemo_run` submits them or, with ``dryrun``, returns
  the sbatch text nemo-run would submit. ``nemo-lw-fp8 slurm RECIPE --executor nemo-run``.

Every user value that reaches the shell goes through :func:`shlex.quote`; values that land in
``#SBATCH`` lines (parsed by sbatch, not by bash) are restricted to a safe character set instead.
See docs/slurm.md.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shlex
import sys
import tempfile
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The module every launcher runs (the ``nemo-lw-fp8`` console script's module).
CLI_MODULE = "nemo_lw_fp8.cli"
BRIDGE_INSTALL_HINT = "pip install 'nemo-lw-fp8[bridge]'"
GPU_ARCHS = ("hopper", "blackwell")
EXECUTORS = ("sbatch", "nemo-run")


class SlurmConfigError(ValueError):
    """A launch setting that cannot work; the message names the command-line flag."""


@dataclass(frozen=True)
class EnvVar:
    """One exported variable and the reason it is set (rendered as a comment above it)."""

    name: str
    value: str
    why: str


_MARGIN_WHY = (
    "TE leaves 20 SMs free in LayerNorm kernels for the overlapped NCCL kernels "
    "(Bridge's DeepSeek-V3 recipe)"
)

#: Set for every run. Values follow Megatron-Bridge 0.6.2's recipe environments
#: (``recipes/utils/environment_utils.py`` and the DeepSeek-V3 / Qwen3-MoE recipes).
COMMON_ENV: tuple[EnvVar, ...] = (
    EnvVar("PYTHONUNBUFFERED", "1", "rank output reaches the Slurm log as it is printed"),
    EnvVar(
        "TORCH_NCCL_AVOID_RECORD_STREAMS",
        "1",
        "collective buffers are freed when their work completes, not at a later stream sync: "
        "lower peak memory with overlapped param gather and grad reduce",
    ),
    EnvVar(
        "TORCH_NCCL_HIGH_PRIORITY",
        "1",
        "NCCL streams at high priority, so overlapped param gathers are not starved by GEMMs",
    ),
    EnvVar(
        "NCCL_NVLS_ENABLE",
        "0",
        "NVLink SHARP buffers cost GPU memory per communicator and MoE + layer-wise Muon "
        "create many (DP, EP, expert-DP groups); Bridge's recipes keep it off",
    ),
    EnvVar(
        "NCCL_GRAPH_REGISTER",
        "0",
        "no NCCL graph buffer registration with the expandable allocator (Bridge's default)",
    ),
    EnvVar(
        "PYTORCH_CUDA_ALLOC_CONF",
        "expandable_segments:True",
        "MoE token buffers change size every step; expandable segments fragment less",
    ),
    EnvVar("NVTE_FWD_LAYERNORM_SM_MARGIN", "20", _MARGIN_WHY),
    EnvVar("NVTE_BWD_LAYERNORM_SM_MARGIN", "20", _MARGIN_WHY),
)

#: Differs by GPU generation.
ARCH_ENV: dict[str, tuple[EnvVar, ...]] = {
    "hopper": (
        EnvVar(
            "CUDA_DEVICE_MAX_CONNECTIONS",
            "1",
            "Hopper: megatron's TP/SP/CP communication overlap needs kernels launched in "
            "program order on one hardware queue",
        ),
    ),
    "blackwell": (
        EnvVar(
            "CUDA_DEVICE_MAX_CONNECTIONS",
            "32",
            "Blackwell no longer needs the single queue (megatron-core's argument checks); "
            "Bridge's GB200 recipes use 32 so EP overlap streams run concurrently",
        ),
    ),
}

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Values written into ``#SBATCH`` lines: sbatch parses these itself (not bash), so instead of
# quoting we accept only characters that mean the same to sbatch and to a reader.
_SBATCH_SAFE = re.compile(r"[A-Za-z0-9_.,:+@/%=-]+")
# Slurm time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}")
# Hydra-style override key: optional + / ++ / ~ prefix, then a dotted name (list indices allowed).
_OVERRIDE_KEY = re.compile(r"(\+{1,2}|~)?[A-Za-z_][A-Za-z0-9_.\[\]-]*")


# --------------------------------------------------------------------------- validation


def _fail(flag: str, message: str) -> SlurmConfigError:
    return SlurmConfigError(f"{flag}: {message}")


def _check_text(flag: str, value: str) -> str:
    """Reject line breaks and NULs: they would end a comment line or an argv word."""
    if not isinstance(value, str):
        raise _fail(flag, f"expected a string, got {type(value).__name__}")
    if any(ch in value for ch in "\n\r\x00"):
        raise _fail(flag, f"must not contain line breaks or NUL characters, got {value!r}")
    return value


def _check_count(flag: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(flag, f"expected an integer, got {value!r}")
    if value < 1:
        raise _fail(flag, f"must be >= 1, got {value}")
    return value


def _check_sbatch_value(flag: str, value: str) -> str:
    _check_text(flag, value)
    if not _SBATCH_SAFE.fullmatch(value):
        raise _fail(
            flag,
            f"{value!r} is written into an #SBATCH line; use only letters, digits and "
            "_ . , : + @ / % = -",
        )
    return value


def _check_recipe(recipe: str) -> str:
    _check_text("RECIPE", recipe)
    if not recipe.strip():
        raise _fail("RECIPE", "the recipe name must not be empty")
    return recipe


def _check_overrides(overrides: Sequence[str]) -> list[str]:
    checked = []
    for item in overrides:
        _check_text("key=value override", item)
        key, sep, _ = item.partition("=")
        if not sep or not _OVERRIDE_KEY.fullmatch(key):
            raise _fail(
                "key=value override",
                f"expected key=value with a dotted key (e.g. train.train_iters=2), got {item!r}",
            )
        checked.append(item)
    return checked


def _check_env(env: Mapping[str, str]) -> dict[str, str]:
    checked = {}
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise _fail("--env", f"{name!r} is not a valid environment variable name")
        checked[name] = _check_text(f"--env {name}", str(value))
    return checked


def _check_mounts(mounts: Sequence[str]) -> list[str]:
    checked = []
    for mount in mounts:
        _check_text("--container-mounts", mount)
        if not mount or "," in mount:
            raise _fail(
                "--container-mounts",
                f"each mount is SRC[:DST[:FLAGS]] without commas (pyxis splits on them), "
                f"got {mount!r}",
            )
        checked.append(mount)
    return checked


def _check_gpu_arch(gpu_arch: str) -> str:
    if gpu_arch not in GPU_ARCHS:
        raise _fail("--gpu-arch", f"expected one of {', '.join(GPU_ARCHS)}, got {gpu_arch!r}")
    return gpu_arch


def default_job_name(recipe: str) -> str:
    """``nemo-lw-fp8-<recipe>`` with anything sbatch-unsafe replaced by ``_``."""
    return "nemo-lw-fp8-" + re.sub(r"[^A-Za-z0-9_.-]", "_", recipe.strip())


def resolve_env(gpu_arch: str, env: Mapping[str, str] | None = None) -> list[EnvVar]:
    """The defaults for ``gpu_arch`` with ``env`` layered on top (user values win)."""
    _check_gpu_arch(gpu_arch)
    user = _check_env(env or {})
    resolved: list[EnvVar] = []
    for var in (*COMMON_ENV, *ARCH_ENV[gpu_arch]):
        if var.name in user:
            resolved.append(
                EnvVar(
                    var.name,
                    user.pop(var.name),
                    f"given with --env (default {var.value}: {var.why})",
                )
            )
        else:
            resolved.append(var)
    resolved.extend(EnvVar(name, value, "given with --env") for name, value in user.items())
    return resolved


def pretrain_args(
    recipe: str,
    *,
    config_file: str | None = None,
    overrides: Sequence[str] = (),
    cpu: bool = False,
) -> list[str]:
    """Arguments after ``python -m nemo_lw_fp8.cli``: the ``pretrain`` command both paths run."""
    args = ["pretrain", "--recipe", _check_recipe(recipe)]
    if config_file is not None:
        args += ["--config-file", _check_text("--config-file", config_file)]
    if cpu:
        args.append("--cpu")
    return args + _check_overrides(overrides)


# --------------------------------------------------------------------------- sbatch


def _continued(words: Sequence[str], indent: str = "    ") -> str:
    """One shell command, one (already quoted) word group per line, joined with backslashes."""
    return (" \\\n" + indent).join(words)


def write_sbatch(
    recipe: str,
    *,
    nodes: int,
    gpus_per_node: int = 8,
    partition: str | None = None,
    account: str | None = None,
    time: str = "04:00:00",
    container_image: str | None = None,
    container_mounts: Sequence[str] = (),
    job_name: str | None = None,
    output_dir: str = "slurm-logs",
    config_file: str | None = None,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    srun_cmd: str = "srun",
    torchrun_extra: Sequence[str] = (),
    cpu: bool = False,
    gpu_arch: str = "hopper",
    module: str = CLI_MODULE,
) -> str:
    """Render an sbatch script that runs ``nemo-lw-fp8 pretrain`` under torchrun on every node.

    One Slurm task per node (``--ntasks-per-node=1``) runs torchrun, which starts
    ``gpus_per_node`` ranks (under ``cpu``: that many gloo ranks, and no GPU request). Ranks are
    static (``--node-rank`` from each node's ``SLURM_NODEID``, rendezvous at the first node of
    the allocation), so global rank 0 is always on the first node.

    ``output_dir`` holds the Slurm logs (``%x-%j.out`` / ``.err``); sbatch does not create it.
    ``srun_cmd`` is split like a shell word list (e.g. ``"srun --mpi=pmix"``). ``module`` is the
    Python module torchrun runs (tests substitute a stand-in for the training CLI).
    """
    _check_recipe(recipe)
    _check_count("--nodes", nodes)
    _check_count("--gpus-per-node", gpus_per_node)
    if not _SLURM_TIME.fullmatch(_check_text("--time", time)):
        raise _fail("--time", f"expected MM, MM:SS, HH:MM:SS or D-HH[:MM[:SS]], got {time!r}")
    job = _check_sbatch_value("--job-name", job_name or default_job_name(recipe))
    _check_sbatch_value("--output-dir", output_dir)
    if partition is not None:
        _check_sbatch_value("--partition", partition)
    if account is not None:
        _check_sbatch_value("--account", account)
    mounts = _check_mounts(container_mounts)
    if container_image is not None:
        _check_text("--container-image", container_image)
        if not container_image:
            raise _fail("--container-image", "must not be empty")
    elif mounts:
        raise _fail("--container-mounts", "needs --container-image (pyxis mounts into a container)")
    srun_words = shlex.split(_check_text("--srun-cmd", srun_cmd))
    if not srun_words:
        raise _fail("--srun-cmd", "must not be empty")
    extra = [_check_text("--torchrun-arg", a) for a in torchrun_extra]
    env_vars = resolve_env(gpu_arch, env)
    cli_args = pretrain_args(recipe, config_file=config_file, overrides=overrides, cpu=cpu)
    log_dir = output_dir.rstrip("/") or "/"

    q = shlex.quote
    lines = [
        "#!/bin/bash",
        "# Generated by `nemo-lw-fp8 slurm` (nemo_lw_fp8.launch.slurm.write_sbatch); regenerate",
        "# rather than edit. One Slurm task per node runs torchrun, which starts the node's ranks",
        "# (one per GPU" + ("; here CPU gloo ranks, --cpu)." if cpu else ")."),
        f"#SBATCH --job-name={job}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if not cpu:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    lines += ["#SBATCH --exclusive", f"#SBATCH --time={time}"]
    if partition is not None:
        lines.append(f"#SBATCH --partition={partition}")
    if account is not None:
        lines.append(f"#SBATCH --account={account}")
    lines += [
        f"#SBATCH --output={log_dir}/%x-%j.out",
        f"#SBATCH --error={log_dir}/%x-%j.err",
        "",
        "set -euo pipefail",
        "",
        "# Rendezvous host: the first node of the allocation; outside Slurm a preset MASTER_ADDR,",
        "# else this host. awk, not head, reads the whole list, so a long one cannot die of",
        "# SIGPIPE under pipefail.",
        'if command -v scontrol >/dev/null 2>&1 && [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then',
        '    MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk \'NR == 1\')"',
        "else",
        '    MASTER_ADDR="${MASTER_ADDR:-$(hostname)}"',
        "fi",
        "export MASTER_ADDR",
        "# Port from the job id, so jobs sharing a node do not collide; a preset MASTER_PORT wins.",
        'export MASTER_PORT="${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}"',
        "",
        "# Environment for NCCL, Transformer Engine and PyTorch; srun (and pyxis) pass it on.",
    ]
    for var in env_vars:
        lines += textwrap.wrap(var.why, width=98, initial_indent="# ", subsequent_indent="# ")
        if any(ch in var.value for ch in "$`"):  # a literal on purpose, not a missed expansion
            lines.append("# shellcheck disable=SC2016")
        lines.append(f"export {var.name}={q(var.value)}")

    srun = [" ".join(q(w) for w in srun_words)]
    srun += [f"--nodes={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if container_image is not None:
        srun.append("--container-image=" + q(container_image))
        if mounts:
            srun.append("--container-mounts=" + q(",".join(mounts)))
        srun.append("--no-container-mount-home")
    # The single-quoted program runs on each node, so SLURM_NODEID is that node's (the batch
    # shell would expand node 0's); user values travel as its positional arguments.
    per_node = (
        f'exec torchrun --nnodes="${{SLURM_NNODES:-{nodes}}}" --node-rank="${{SLURM_NODEID:-0}}" '
        '--master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" "$@"'
    )
    srun += ["bash -c " + q(per_node) + " torchrun", f"--nproc-per-node={gpus_per_node}"]
    srun += [q(a) for a in extra]
    srun.append(f"-m {q(_check_text('module', module))} pretrain")
    rest = cli_args[1:]
    i = 0
    while i < len(rest):  # keep "--flag value" pairs on one line for readability
        if rest[i] in ("--recipe", "--config-file"):
            srun.append(f"{rest[i]} {q(rest[i + 1])}")
            i += 2
        else:
            srun.append(q(rest[i]))
            i += 1
    lines += [
        "",
        "# One task per node; torchrun in it starts the node's ranks with a static node rank.",
        "# shellcheck disable=SC2016",
        _continued(srun),
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- nemo-run


def _import_nemo_run() -> Any:
    try:
        import nemo_run
    except ImportError as err:  # pragma: no cover - exercised only without the bridge extra
        raise ImportError(
            f"the nemo-run executor needs nemo-run; install it with {BRIDGE_INSTALL_HINT}"
        ) from err
    return nemo_run


def slurm_executor(
    *,
    nodes: int,
    gpus_per_node: int = 8,
    partition: str | None = None,
    account: str | None = None,
    time: str = "04:00:00",
    container_image: str | None = None,
    container_mounts: Sequence[str] = (),
    job_name: str | None = None,
    env: Mapping[str, str] | None = None,
    gpu_arch: str = "hopper",
    cpu: bool = False,
    tunnel: Any = None,
    packager: Any = None,
) -> Any:
    """A nemo-run ``SlurmExecutor`` with the torchrun launcher and the same environment.

    ``ntasks_per_node=gpus_per_node`` states one rank per GPU; nemo-run's torchrun launcher then
    submits one task per node whose torchrun starts that many ranks (it rewrites
    ``ntasks_per_node`` to 1 and ``torchrun_nproc_per_node`` to the GPU count). ``tunnel``: a
    ``run.SSHTunnel`` from a workstation; default a ``LocalTunnel`` (run on a login node).
    ``packager``: default ``run.Packager()``, i.e. ship no code: the container image must have
    nemo-lw-fp8 installed. Environment values are shell-quoted here because nemo-run writes them
    into its sbatch script as ``export NAME=VALUE`` verbatim.
    """
    run = _import_nemo_run()
    _check_count("--nodes", nodes)
    _check_count("--gpus-per-node", gpus_per_node)
    _check_text("--time", time)
    if not _SLURM_TIME.fullmatch(time):
        raise _fail("--time", f"expected MM, MM:SS, HH:MM:SS or D-HH[:MM[:SS]], got {time!r}")
    for flag, value in (
        ("--partition", partition),
        ("--account", account),
        ("--job-name", job_name),
    ):
        if value is not None:
            _check_sbatch_value(flag, value)
    mounts = _check_mounts(container_mounts)
    env_vars = {var.name: shlex.quote(var.value) for var in resolve_env(gpu_arch, env)}
    kwargs: dict[str, Any] = dict(
        account=account,
        partition=partition,
        nodes=nodes,
        ntasks_per_node=gpus_per_node,
        time=time,
        exclusive=True,
        container_image=container_image,
        container_mounts=mounts,
        srun_args=["--no-container-mount-home"] if container_image else None,
        env_vars=env_vars,
        launcher="torchrun",
        packager=packager if packager is not None else run.Packager(),
        # nemo-run derives a prefix from the account unless one is set (and fails without one).
        job_name_prefix="nemo-lw-fp8-",
    )
    if not cpu:
        kwargs["gpus_per_node"] = gpus_per_node
    if tunnel is not None:
        kwargs["tunnel"] = tunnel
    executor = run.SlurmExecutor(**kwargs)
    if job_name is not None:
        executor.job_details.job_name = job_name
    return executor


def pretrain_script(
    recipe: str,
    *,
    config_file: str | None = None,
    overrides: Sequence[str] = (),
    cpu: bool = False,
) -> Any:
    """The ``run.Script`` both nemo-run paths execute: ``python -m nemo_lw_fp8.cli pretrain``."""
    run = _import_nemo_run()
    args = pretrain_args(recipe, config_file=config_file, overrides=overrides, cpu=cpu)
    return run.Script(path=CLI_MODULE, m=True, entrypoint="python", args=args)


def submit_nemo_run(
    recipe: str,
    *,
    dryrun: bool,
    config_file: str | None = None,
    overrides: Sequence[str] = (),
    cpu: bool = False,
    name: str | None = None,
    **executor_kwargs: Any,
) -> str | None:
    """Submit through nemo-run (detached), or with ``dryrun`` return the sbatch text it would.

    The dry run needs no cluster: nemo-run renders its files into a temporary experiment folder
    (deleted afterwards); the log paths in the text are where a real submission from this machine
    would put them (under ``NEMORUN_HOME``, default ``~/.nemo_run``).
    """
    run = _import_nemo_run()
    script = pretrain_script(recipe, config_file=config_file, overrides=overrides, cpu=cpu)
    executor = slurm_executor(cpu=cpu, **executor_kwargs)
    title = name or re.sub(r"[^A-Za-z0-9_-]", "_", recipe)
    if not dryrun:
        with run.Experiment(title, executor=executor) as exp:
            exp.add(script, name=title, tail_logs=False)
            exp.run(detach=True)
        return None
    # nemo-run's console writes progress to stdout; keep stdout for the script alone.
    with (
        contextlib.redirect_stdout(sys.stderr),
        tempfile.TemporaryDirectory(prefix="nemo-lw-fp8-dryrun-") as base,
        run.Experiment(title, executor=executor, base_dir=base, log_level="WARN") as exp,
    ):
        exp.add(script, name=title, tail_logs=False)
        exp.dryrun(log=False)
        infos = [getattr(job, "_dryrun_info", None) for job in exp.jobs]
        if any(info is None for info in infos):  # nemo-run changed: let it print instead
            exp.dryrun(log=True)
            return ""
    return "\n".join(str(info) for info in infos) + "\n"


# --------------------------------------------------------------------------- command line


def _env_item(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def build_parser(prog: str = "nemo-lw-fp8 slurm") -> argparse.ArgumentParser:
    """The ``slurm`` command's own parser (options and key=value overrides may be intermixed)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Write an sbatch script (or submit through nemo-run) that runs "
        "`nemo-lw-fp8 pretrain --recipe RECIPE` under torchrun on every node.",
    )
    p.add_argument("recipe", metavar="RECIPE", help="recipe name, as for `nemo-lw-fp8 pretrain`")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    p.add_argument("--nodes", type=int, required=True, help="number of nodes")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="GPUs (= ranks) per node; under --cpu: gloo ranks per node (default 8)",
    )
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--time", default="04:00:00", help="wall-clock limit (default 04:00:00)")
    p.add_argument("--job-name", help="default nemo-lw-fp8-RECIPE")
    p.add_argument("--container-image", help="pyxis/enroot image; without it srun runs on the host")
    p.add_argument(
        "--container-mounts",
        default="",
        metavar="SRC:DST[,SRC:DST...]",
        help="pyxis mounts, comma-separated",
    )
    p.add_argument(
        "--output-dir",
        default="slurm-logs",
        help="folder for the Slurm logs (must exist at submission; default slurm-logs)",
    )
    p.add_argument(
        "--gpu-arch",
        choices=GPU_ARCHS,
        default="hopper",
        help="selects CUDA_DEVICE_MAX_CONNECTIONS (default hopper)",
    )
    p.add_argument(
        "--env",
        action="append",
        type=_env_item,
        default=[],
        metavar="NAME=VALUE",
        help="extra or overriding environment variable (repeatable)",
    )
    p.add_argument(
        "--srun-cmd", default="srun", help='srun and its options, e.g. "srun --mpi=pmix"'
    )
    p.add_argument(
        "--torchrun-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra torchrun argument (repeatable): --torchrun-arg=--max-restarts=0",
    )
    p.add_argument("--config-file", help="YAML overrides file (a path inside the container)")
    p.add_argument("--cpu", action="store_true", help="CPU gloo ranks and the CPU stand-ins")
    p.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="sbatch",
        help="sbatch: write a script (default); nemo-run: a SlurmExecutor submission",
    )
    p.add_argument(
        "--dryrun",
        action="store_true",
        help="nemo-run: print what would be submitted instead of submitting",
    )
    p.add_argument(
        "--output",
        "-o",
        metavar="FILE.sbatch",
        help="sbatch: write the script here (executable) instead of to stdout",
    )
    return p


def run_slurm(ns: argparse.Namespace) -> int:
    """Act on parsed ``slurm`` arguments; returns the exit code (2 with a message on bad input)."""
    mounts = [m for m in ns.container_mounts.split(",") if m] if ns.container_mounts else []
    env = dict(ns.env)
    common = dict(
        nodes=ns.nodes,
        gpus_per_node=ns.gpus_per_node,
        partition=ns.partition,
        account=ns.account,
        time=ns.time,
        container_image=ns.container_image,
        container_mounts=mounts,
        job_name=ns.job_name,
        env=env,
        gpu_arch=ns.gpu_arch,
    )
    try:
        if ns.executor == "nemo-run":
            if ns.output:
                raise _fail("--output", "only with --executor sbatch (nemo-run writes its own)")
            text = submit_nemo_run(
                ns.recipe,
                dryrun=ns.dryrun,
                config_file=ns.config_file,
                overrides=ns.overrides,
                cpu=ns.cpu,
                **common,
            )
            if text:
                sys.stdout.write(text)
            return 0
        if ns.dryrun:
            raise _fail("--dryrun", "only with --executor nemo-run (sbatch mode never submits)")
        text = write_sbatch(
            ns.recipe,
            output_dir=ns.output_dir,
            config_file=ns.config_file,
            overrides=ns.overrides,
            srun_cmd=ns.srun_cmd,
            torchrun_extra=ns.torchrun_arg,
            cpu=ns.cpu,
            **common,
        )
    except SlurmConfigError as err:
        print(f"nemo-lw-fp8 slurm: error: {err}", file=sys.stderr)
        return 2
    if ns.output:
        path = Path(ns.output)
        path.write_text(text)
        path.chmod(0o755)
        print(
            f"wrote {path}; submit with: sbatch {shlex.quote(str(path))} "
            f"(create {ns.output_dir}/ first)",
            file=sys.stderr,
        )
    else:
        sys.stdout.write(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``nemo-lw-fp8 slurm ...`` (argv without the ``slurm`` word)."""
    parser = build_parser()
    ns = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    return run_slurm(ns)


def _handle(ns: argparse.Namespace) -> int:
    return main(ns.slurm_argv)


def add_slurm_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``slurm`` on the ``nemo-lw-fp8`` sub-parsers; dispatch with ``args.handler(args)``.

    The registered parser only collects the words after ``slurm`` (it recognises no options), so
    that options and ``key=value`` overrides can be intermixed; :func:`main` parses them with
    :func:`build_parser` (``nemo-lw-fp8 slurm --help`` shows the full usage).
    """
    sub = subparsers.add_parser(
        "slurm",
        help="sbatch script or nemo-run SlurmExecutor for `pretrain` (see `slurm --help`)",
        add_help=False,
        prefix_chars="\x01",  # no option prefix: every word is passed through to main()
    )
    sub.add_argument("slurm_argv", nargs="*", help=argparse.SUPPRESS)
    sub.set_defaults(handler=_handle)
    return sub


if __name__ == "__main__":
    raise SystemExit(main())
