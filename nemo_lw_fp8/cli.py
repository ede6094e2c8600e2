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

    # `plan` has its own parser (nemo_lw_fp8.planner.main); listed here for --help.
    sub.add_parser("plan", help="per-rank memory and communication: padded vs compact vs Adam")

    demo = sub.add_parser("demo", help="train a tiny GPT on 2 CPU ranks with layer-wise Muon")
    demo.add_argument("--steps", type=int, default=30)
    demo.add_argument("--world-size", type=int, default=2)

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        from . import planner

        return planner.main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from . import doctor as doctor_mod

        return doctor_mod.main(as_json=args.json)
    if args.command == "demo":
        from . import demo as demo_mod

        return demo_mod.run(steps=args.steps, world_size=args.world_size)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
