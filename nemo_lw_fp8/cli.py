"""The ``nemo-lw-fp8`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="nemo-lw-fp8", description="Layer-wise Muon with FP8 param gather for megatron-core."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser("doctor", help="versions, accelerator, FP8 backend, upstream status")
    doctor.add_argument("--json", action="store_true", help="print JSON instead of a table")

    # `plan` has its own parser (nemo_lw_fp8.models.plan_cli.main); listed here for --help.
    sub.add_parser("plan", help="per-rank memory and communication: padded vs compact vs Adam")

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
    from .launch.slurm_cli import add_slurm_subcommand

    add_slurm_subcommand(sub)
    sub.add_parser("recipes", help="list the recipes")

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        from .models import plan_cli

        return plan_cli.main(argv[1:])
    if argv[:1] == ["pretrain"]:
        from .launch import pretrain as pretrain_mod

        own = argparse.ArgumentParser(prog="nemo-lw-fp8 pretrain")
        pretrain_mod.add_arguments(own)
        return pretrain_mod.main(own.parse_intermixed_args(argv[1:]))
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from . import doctor as doctor_mod

        return doctor_mod.main(as_json=args.json)
    if args.command == "demo":
        from . import demo as demo_mod

        return demo_mod.run(steps=args.steps, world_size=args.world_size, out=args.out)
    if args.command == "slurm":
        return args.handler(args)
    if args.command == "recipes":
        from . import recipes

        for name, recipe in sorted(recipes.RECIPES.items()):
            print(f"{name:32s} {recipe.__doc__}")
        return 0
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
