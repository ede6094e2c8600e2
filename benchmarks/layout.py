"""Stock padded layer-wise layout vs compact layout, per rank, for DeepSeek-V3 and Qwen3-235B.

For DeepSeek-V3 at DP 64 / EP 64 and Qwen3-235B-A22B at DP 64 / EP 32 (TP = PP = 1, MXFP8
param gather, fp32 grads, megatron's default buckets): bytes per rank (worst rank) of megatron-core
0.19.2's padded layer-wise layout and of the compact layout, their ratio, the Newton-Schulz
max/mean cost per rank, and the parameter-gather collectives per step. Everything is computed by
:func:`nemo_lw_fp8.models.planner.plan` (megatron's own layout code on meta-device stand-ins;
no GPU).

    python benchmarks/layout.py [--json] [--no-fp8-param-gather] [--grad-dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nemo_lw_fp8.models import plan  # noqa: E402

CONFIGS = (("deepseek-v3", 64, 64), ("qwen3-235b-a22b", 64, 32))


def _row(result: dict) -> dict:
    stock = result["layouts"]["stock_padded"]
    compact = result["layouts"]["compact"]
    adam = result["layouts"]["adam_distopt"]
    gathers = result["summary"]["param_gather_collectives"]
    return {
        "model": result["model"],
        "dp": result["dp"],
        "ep": result["ep"],
        "stock_gb": stock["bytes_per_rank"]["total"] / 1e9,
        "compact_gb": compact["bytes_per_rank"]["total"] / 1e9,
        "adam_gb": adam["bytes_per_rank"]["total"] / 1e9,
        "ratio": result["summary"]["compact_over_stock_bytes"],
        "stock_padding_gb": stock["padding_bytes"] / 1e9,
        "ns_stock": stock["newton_schulz"]["max_over_mean"],
        "ns_ours": compact["newton_schulz"]["max_over_mean"],
        "gathers_legacy": gathers["stock_legacy"],
        "gathers_stock": gathers["stock_padded"],
        "gathers_compact": gathers["compact"],
        "gathers_adam": gathers["adam_distopt"],
        "gathered_stock_gb": stock["param_gather"]["output_bytes"] / 1e9,
        "gathered_compact_gb": compact["param_gather"]["output_bytes"] / 1e9,
        "transient_peak_gb": compact["transient_gather"]["peak_bytes"] / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--no-fp8-param-gather", action="store_true")
    parser.add_argument("--grad-dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    rows = []
    start = time.perf_counter()
    for model, dp, ep in CONFIGS:
        result = plan(
            model,
            dp,
            ep,
            fp8_param_gather=not args.no_fp8_param_gather,
            grad_dtype=args.grad_dtype,
        )
        rows.append(_row(result))
    elapsed = time.perf_counter() - start
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    header = (
        "| model | DP | EP | stock padded GB/rank | compact GB/rank | compact/stock "
        "| stock padding GB | NS max/mean stock | NS max/mean ours "
        "| gathers/step legacy | stock padded | compact | Adam |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in rows:
        print(
            f"| {r['model']} | {r['dp']} | {r['ep']} | {r['stock_gb']:.1f} | {r['compact_gb']:.1f} "
            f"| {r['ratio']:.3f} | {r['stock_padding_gb']:.1f} | {r['ns_stock']:.3f} "
            f"| {r['ns_ours']:.3f} | {r['gathers_legacy']} | {r['gathers_stock']} "
            f"| {r['gathers_compact']} | {r['gathers_adam']} |"
        )
    print(
        f"\nfp8_param_gather={not args.no_fp8_param_gather}, grads {args.grad_dtype}; "
        f"GB = 1e9 bytes, worst rank; planned in {elapsed:.1f} s"
    )


if __name__ == "__main__":
    main()
