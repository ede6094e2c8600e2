"""``nemo-lw-fp8 hf-import`` and ``nemo-lw-fp8 hf-export``: Hugging Face checkpoints in and out.

The work is :mod:`nemo_lw_fp8.hf`'s (docs/hf.md); this module reads the command line and prints
what was written. Both run in one process (no ``torchrun``) in a one-rank gloo group with the
tensors on the CPU (as Bridge converts): over real TE on a GPU machine, over TE's emulated
kernels on CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Third-party import noise held back to one line (all of it with ``--debug``)."""
    from nemo_lw_fp8.cli.quiet import held_back
    from nemo_lw_fp8.errors import DEBUG_ENV

    if os.environ.get(DEBUG_ENV) == "1":
        yield
        return
    with held_back() as held:
        yield
    if held.messages:
        sys.stderr.write(held.summary().replace("--verbose", "--debug") + "\n")


def _run(work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    with _quiet():
        return work()


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", help="HF checkpoint directory (config.json + *.safetensors)")
    parser.add_argument("out", help="new directory for the torch_dist checkpoint")
    parser.add_argument("--recipe", required=True, help="recipe the weights are for")
    parser.add_argument(
        "overrides", nargs="*", help="key=value overrides of the recipe (model.mtp_num_layers=0)"
    )


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run's checkpoint.save folder (or one iter_* folder)")
    parser.add_argument("out", help="new directory for the HF checkpoint")
    parser.add_argument(
        "--weights",
        choices=("masters", "compute"),
        default="masters",
        help="masters (default): bf16 of the fp32 masters, the trained weights; compute: the "
        "weights the run computed with (FP8 weights dequantized)",
    )


def main_import(args: argparse.Namespace) -> int:
    from nemo_lw_fp8.hf import importer

    record = _run(lambda: importer.import_hf(args.hf_dir, args.out, args.recipe, args.overrides))
    print(f"imported {record['parameters']} parameters of {record['source']} into {args.out}")
    print(f"train from it: {record['use']}")
    return 0


def main_export(args: argparse.Namespace) -> int:
    from nemo_lw_fp8.hf import exporter

    record = _run(lambda: exporter.export_hf(args.run_dir, args.out, args.weights))
    print(
        f"exported {args.weights} weights of {record['run']} to {args.out} "
        f"({len(record['from_masters'])} from fp32 masters, "
        f"{len(record['from_model_entries'])} from model entries)"
    )
    print(json.dumps({"weights": record["weights"], "what": record["what"]}))
    if "transformers_differs" in record:
        sys.stderr.write(
            f"nemo-lw-fp8 hf-export: warning: {record['transformers_differs']}\n"
        )
    return 0


def main(command: str, words: list[str]) -> int:
    """``nemo-lw-fp8 hf-import ...`` / ``hf-export ...`` (options and overrides mixed)."""
    parser = argparse.ArgumentParser(prog=f"nemo-lw-fp8 {command}")
    if command == "hf-import":
        add_import_arguments(parser)
        return main_import(parser.parse_intermixed_args(words))
    add_export_arguments(parser)
    return main_export(parser.parse_intermixed_args(words))
