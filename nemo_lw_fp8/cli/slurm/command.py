"""The ``nemo-lw-fp8 slurm`` command line: its parser and what it does with the arguments.

Why a module of its own: parsing and dispatch are separate from the two launchers it drives
(:func:`.slurm.write_sbatch`, :func:`.slurm_nemo_run.submit_nemo_run`).
:func:`add_slurm_subcommand` registers ``slurm`` on the ``nemo-lw-fp8`` CLI; :func:`main` is the
command itself (also ``python -m nemo_lw_fp8.cli.slurm.command``). Bad input exits with code 2
and a message naming the flag. See docs/slurm.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_lw_fp8.cli.slurm.nemo_run_executor import submit_nemo_run
from nemo_lw_fp8.cli.slurm.sbatch import write_sbatch
from nemo_lw_fp8.cli.slurm.settings import EXECUTORS, GPU_ARCHS, SlurmConfigError, config_error

__all__ = ["add_slurm_subcommand", "build_parser", "main", "run_slurm"]


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
                raise config_error(
                    "--output", "only with --executor sbatch (nemo-run writes its own)"
                )
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
            raise config_error(
                "--dryrun", "only with --executor nemo-run (sbatch mode never submits)"
            )
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
