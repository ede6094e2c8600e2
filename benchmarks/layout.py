"""Gradient-sync and gather traffic, padding and Newton-Schulz balance of the layer-wise layouts.

For DeepSeek-V3 and Qwen3-235B-A22B, on every pipeline rank of the plugin's full recipes
(``nemo_lw_fp8.recipes``: each virtual-pipeline chunk its own DDP, as megatron builds it) and
whole-model (TP = PP = 1) at DP 64 and 256: per rank and step, gradient-sync wire bytes over an
exact reduce-scatter of the same gradients, gradient-sync and param-gather collectives, the
transient peak, persistent padding, and Newton-Schulz max/mean next to its lower bound, for
stock 0.19.2 padded, compact with all-reduce (upstream #5388 / #5479), the plugin's compact
owner-reduce path, and Adam (DistributedOptimizer); upstream main's padded figures from
``../shared/notes/upstream-main-2026-08.md`` beside them. Computed by
:func:`nemo_lw_fp8.planner.traffic.rank_traffic` (megatron's own layout code on meta tensors).
``--qkv-ownership whole`` plans ``linear_qkv`` weights owned whole (the default, ``split``, owns
the Q / K / V parts Muon orthogonalizes separately on their own).

    python benchmarks/layout.py [--json] [--only NAME] [--qkv-ownership {split,whole}]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


RECIPES = ("deepseek_v3_mxfp8", "qwen3_235b_a22b_mxfp8")
WHOLE = (("deepseek-v3", 64, 64), ("deepseek-v3", 256, 64),
         ("qwen3-235b-a22b", 64, 32), ("qwen3-235b-a22b", 256, 32))  # fmt: skip
#: Upstream Megatron-LM main's padded layout (#5415, #6379), measured in the note:
#: (padding G elements, NS max/mean, grad wire over exact, param gathers per step).
UPSTREAM_MAIN = {
    ("deepseek-v3", 64, 64): (10.51, 1.044, 1.61, 3),
    ("qwen3-235b-a22b", 64, 32): (0.56, 1.002, 1.05, 98),
}


def main() -> None:
    from nemo_lw_fp8.planner.recipe_plan import recipe_setup
    from nemo_lw_fp8.planner.traffic import format_rows, pipeline_rows, whole_model_rows

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--only", help="rows whose config contains this text")
    parser.add_argument(
        "--qkv-ownership", choices=("split", "whole"), default="split",
        help="linear_qkv weights owned as their Q / K / V parts (split) or whole",
    )  # fmt: skip
    args = parser.parse_args()
    start = time.perf_counter()
    rows = []
    for name in RECIPES:
        setup = recipe_setup(name)
        rows += pipeline_rows(
            name, setup.arch, setup.par, single_grouped_weight=setup.single_grouped_weight,
            ownership=setup.ownership, qkv_ownership=args.qkv_ownership,
        )  # fmt: skip
    for model, dp, ep in WHOLE:
        rows += whole_model_rows(model, dp, ep, qkv_ownership=args.qkv_ownership)
    rows = [r for r in rows if not args.only or args.only in r["config"]]
    elapsed = time.perf_counter() - start
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return
    print("\n".join(format_rows(rows, UPSTREAM_MAIN)))
    print(
        "\nPer rank and step, worst rank; wire: bytes sent, fp32 gradients, Muon + Adam buffers; "
        f"MXFP8 param gather; megatron's default buckets; linear_qkv owned "
        f"{args.qkv_ownership}. Planned in {elapsed:.1f} s."
    )


if __name__ == "__main__":
    main()
