"""``nemo-lw-fp8 plan MODEL --dp N --ep E``: :func:`.planner.plan` printed as a table or JSON.

Kept apart from :mod:`.planner` so the maths reads without the presentation around it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .planner import GRAD_BYTES, MEMORY_FIELDS, plan
from .shapes import SPECS


def _unit(nbytes: float) -> tuple[str, float]:
    """Decimal unit that keeps the table readable for this size."""
    for name, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return name, scale
    return "B", 1.0


def format_table(result: dict[str, Any]) -> str:
    """The plan as a fixed-width table (decimal units: GB = 1e9 bytes)."""
    names = ("stock_padded", "compact", "adam_distopt")
    lays = [result["layouts"][n] for n in names]
    unit, scale = _unit(max(x["bytes_per_rank"]["total"] for x in lays))

    def fmt(nbytes: float) -> str:
        return f"{nbytes / scale:.2f}"

    transient = lays[1]["transient_gather"]
    rows: list[tuple[str, ...]] = [("per rank", *names)]
    for field in (*MEMORY_FIELDS, "total"):
        rows.append((f"{field} {unit}", *(fmt(x["bytes_per_rank"][field]) for x in lays)))
    rows += [
        (f"mean total {unit}", *(fmt(x["bytes_per_rank_mean"]["total"]) for x in lays)),
        (f"persistent padding {unit}", *(fmt(x["padding_bytes"]) for x in lays)),
        (f"transient gather peak {unit}", "-", fmt(transient["peak_bytes"]), "-"),
        (f"  beyond idle grad buffer {unit}", "-", fmt(transient["extra_bytes"]), "-"),
        (
            "Newton-Schulz max/mean",
            *(
                f"{x['newton_schulz']['max_over_mean']:.3f}" if x["newton_schulz"] else "-"
                for x in lays
            ),
        ),
        ("param gathers / step", *(str(x["param_gather"]["collectives"]) for x in lays)),
        (f"gathered {unit} / step", *(fmt(x["param_gather"]["output_bytes"]) for x in lays)),
        ("grad sync", *(x["grad_sync"]["op"] for x in lays)),
        (
            f"grad sync wire {unit} / rank",
            *(fmt(x["grad_sync"]["wire_bytes_per_rank"]) for x in lays),
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        f"{result['model']}: dp={result['dp']} ep={result['ep']} "
        f"(expert dp {result['expert_dp']}), "
        f"bucket_size={result['bucket_size']}, fp8_param_gather={result['fp8_param_gather']}, "
        f"grads {result['grad_dtype']}; {result['params']['per_rank']:,} params per rank"
    ]
    for i, row in enumerate(rows):
        lines.append(
            "  ".join(
                c.ljust(widths[j]) if j == 0 else c.rjust(widths[j]) for j, c in enumerate(row)
            )
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    summary = result["summary"]
    wire = result.get("muon_gather_wire")
    if wire is not None:
        lines.append(
            f"Muon gather payload / rank / step: bf16 {fmt(wire['bf16_bytes'])} {unit}, "
            f"blockwise FP8 {fmt(wire['blockwise_fp8_bytes'])} {unit} "
            f"({wire['bytes_per_param']['blockwise_fp8']:.4f} B/param, "
            f"{wire['blockwise_over_bf16']:.4f} of bf16)"
        )
    lines.append(
        f"compact / stock bytes: {summary['compact_over_stock_bytes']:.3f} "
        f"({fmt(summary['bytes_saved_per_rank'])} {unit} saved per rank); legacy uneven gather: "
        f"{summary['param_gather_collectives']['stock_legacy']} collectives / step"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``nemo-lw-fp8 plan MODEL --dp N [--ep N] ...``: print the plan (table or JSON)."""
    parser = argparse.ArgumentParser(
        prog="nemo-lw-fp8 plan",
        description="Per-rank memory, Newton-Schulz balance and collectives of layer-wise Muon "
        "layouts (stock padded vs compact vs Adam), computed without a GPU.",
    )
    parser.add_argument("model", choices=sorted(SPECS))
    parser.add_argument("--dp", type=int, required=True, help="data-parallel size (= world size)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    parser.add_argument("--bucket-size", type=int, default=None, help="elements per DDP bucket")
    parser.add_argument(
        "--no-overlap-grad-reduce", action="store_true", help="one bucket per buffer"
    )
    parser.add_argument(
        "--no-fp8-param-gather", action="store_true", help="bf16 parameters, no MXFP8"
    )
    parser.add_argument("--grad-dtype", choices=sorted(GRAD_BYTES), default="fp32")
    parser.add_argument("--gather-padding-tolerance", type=float, default=0.1)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        result = plan(
            args.model,
            args.dp,
            args.ep,
            bucket_size=args.bucket_size,
            fp8_param_gather=not args.no_fp8_param_gather,
            grad_dtype=args.grad_dtype,
            overlap_grad_reduce=not args.no_overlap_grad_reduce,
            gather_padding_tolerance=args.gather_padding_tolerance,
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
