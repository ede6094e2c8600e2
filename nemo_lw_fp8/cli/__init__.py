"""The ``nemo-lw-fp8`` command.

A mistake on the command line (unknown recipe, bad key, value of the wrong type or out of range,
a broken rule, Megatron-Bridge missing) ends with one or two lines on stderr naming the problem
and the fix, and exit status 2; ``--debug`` (anywhere on the line, or ``NEMO_LW_FP8_DEBUG=1``)
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys

from nemo_lw_fp8.errors import BRIDGE_INSTALL_HINT, DEBUG_ENV, UsageError


def _report(command: str, problem: str, fix: str) -> int:
    sys.stderr.write(f"nemo-lw-fp8 {command}: error: {problem}\n")
    if fix:
        sys.stderr.write(f"  fix: {fix} (--debug shows the traceback)\n")
    return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nemo-lw-fp8",
        description="Layer-wise Muon with FP8 param gather for megatron-core.",
        epilog="--debug (anywhere) shows tracebacks instead of one-line errors.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser("doctor", help="versions, accelerator, FP8 backend, upstream status")
    doctor.add_argument("--json", action="store_true", help="print JSON instead of a table")
    doctor.add_argument(
        "--verbose", action="store_true", help="also print the third-party warnings it hides"
    )

    # `plan` has its own parser (nemo_lw_fp8.cli.plan.main); listed here for --help.
    sub.add_parser(
        "plan", help="per-rank memory and communication of a recipe or model, against the GPU"
    )

    demo = sub.add_parser(
        "demo",
        help="tiny DeepSeek-V3 architecture through Megatron-Bridge on 2 CPU ranks, "
        "every feature on, FP8 param gather ON vs OFF",
    )
    demo.add_argument("--steps", type=int, default=12)
    demo.add_argument("--world-size", type=int, default=2)
    demo.add_argument("--out", default="demo-output", help="folder for the losses and the plot")

    # `pretrain` and `slurm` parse their own words (options and key=value overrides mixed).
    sub.add_parser("pretrain", help="train a recipe with Megatron-Bridge (run under torchrun)")
    from nemo_lw_fp8.cli.slurm.command import add_slurm_subcommand

    add_slurm_subcommand(sub)
    sub.add_parser("recipes", help="list the recipes")
    # `hf-import` / `hf-export` parse their own words (nemo_lw_fp8.cli.hf); listed for --help.
    sub.add_parser("hf-import", help="a Hugging Face checkpoint into a recipe's torch_dist")
    sub.add_parser("hf-export", help="a run's checkpoint to Hugging Face safetensors")
    return parser


def _dispatch(argv: list[str]) -> int:
    if argv[:1] == ["plan"]:
        from nemo_lw_fp8.cli import plan as plan_cli

        return plan_cli.main(argv[1:])
    if argv[:1] == ["pretrain"]:
        from nemo_lw_fp8.cli import pretrain as pretrain_mod

        own = argparse.ArgumentParser(prog="nemo-lw-fp8 pretrain")
        pretrain_mod.add_arguments(own)
        return pretrain_mod.main(own.parse_intermixed_args(argv[1:]))
    if argv[:1] in (["hf-import"], ["hf-export"]):
        from nemo_lw_fp8.cli import hf as hf_cli

        return hf_cli.main(argv[0], argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from nemo_lw_fp8.cli import doctor as doctor_mod

        return doctor_mod.main(as_json=args.json, verbose=args.verbose)
    if args.command == "demo":
        from nemo_lw_fp8.cli import demo as demo_mod

        return demo_mod.run(steps=args.steps, world_size=args.world_size, out=args.out)
    if args.command == "slurm":
        return args.handler(args)
    if args.command == "recipes":
        from nemo_lw_fp8 import recipes

        for name, recipe in sorted(recipes.RECIPES.items()):
            print(f"{name:32s} {recipe.__doc__}")
        return 0
    parser.error(f"unknown command {args.command}")
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV) == "1"
    argv = [word for word in argv if word != "--debug"]
    if debug:
        os.environ[DEBUG_ENV] = "1"  # subcommands and torchrun's ranks read it
    command = argv[0] if argv else ""
    from nemo_lw_fp8.errors import ConfigError
    from nemo_lw_fp8.patches.framework import UntestedMegatronVersion
    from nemo_lw_fp8.patches.record import UpstreamChanged

    try:
        return _dispatch(argv)
    except UsageError as error:
        if debug:
            raise
        return _report(command, error.problem, error.fix)
    except ConfigError as error:
        if debug:
            raise
        # A rule's message names the flag and its fix already.
        return _report(command, str(error), "")
    except (UpstreamChanged, UntestedMegatronVersion) as error:
        if debug:
            raise
        # A patch refused the installed stack: its one line names the object and the fix.
        return _report(command, str(error), "")
    except ImportError as error:
        if debug or "megatron.bridge" not in str(error) and "Megatron-Bridge" not in str(error):
            raise
        return _report(command, f"Megatron-Bridge is not importable ({error})", BRIDGE_INSTALL_HINT)
