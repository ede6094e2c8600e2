"""Who owns single grouped expert weights under layer-wise Muon: whole vs expert runs.

For each model at its recipe's expert-parallel and pipeline sizes (``nemo_lw_fp8.planner``,
GB200 defaults), scaling the expert-data-parallel size ``d`` (more GPUs): the grouped weights of
the busiest pipeline stage (fc1 and fc2 of each MoE layer, ``E / EP`` local experts each) are
owned over the ``d`` ranks of an expert-DP group, whole (``grouped_weight_ownership="whole"``)
or in runs of experts (``"expert"``), by the same functions the compact layout patch calls
(``nemo_lw_fp8.layout.packing.choose_pieces``). Printed per case: the busiest rank's Newton-Schulz
work over the mean, ranks that own nothing, the busiest rank's fp32 master + Muon momentum bytes,
and what ``"auto"`` picks. Pure arithmetic on the shapes; no GPU, no process group.

    python benchmarks/grouped_ownership.py [--json]
"""

from __future__ import annotations

import argparse
import json
import math

from nemo_lw_fp8.layout import packing as layout
from nemo_lw_fp8.planner import get_architecture, parallelism

MODELS = ("deepseek-v3", "qwen3-235b-a22b", "qwen3-30b-a3b")
EXPERT_DP = (1, 2, 4, 8, 16, 32, 64)
#: fp32 master + Muon momentum per element.
OPTIMIZER_BYTES = 8


def grouped_shapes(name: str) -> tuple[list[tuple[int, int, int]], int, int]:
    """The busiest pipeline stage's grouped weight shapes, and the recipe's EP and PP."""
    arch = get_architecture(name)
    defaults = parallelism(arch, "gb200")
    local = arch.num_moe_experts // defaults.ep
    fc1_rows = arch.moe_ffn_hidden_size * (2 if arch.gated_linear_unit else 1)
    moe_layers = math.ceil(sum(arch.moe_layer_pattern()) / defaults.pp)
    fc1 = (local, fc1_rows, arch.hidden_size)
    fc2 = (local, arch.hidden_size, arch.moe_ffn_hidden_size)
    pair = [fc1, fc2]
    return pair * moe_layers, defaults.ep, defaults.pp


def measure(shapes: list[tuple[int, int, int]], dp: int, ownership: str) -> dict[str, float]:
    costs = [layout.newton_schulz_cost(s) for s in shapes]
    units = [s[0] for s in shapes]
    sizes = [s[0] * s[1] * s[2] for s in shapes]
    pieces = layout.choose_pieces(costs, units, dp, sizes, ownership)
    work = layout.piece_loads(costs, units, pieces, dp)
    numel = layout.piece_loads(sizes, units, pieces, dp)
    split = any(p.hi - p.lo < units[p.index] for p in pieces)
    return {
        "ns_max_over_mean": layout.imbalance(work),
        "idle_ranks": sum(1 for w in work if w == 0),
        "busiest_optimizer_gb": max(numel) * OPTIMIZER_BYTES / 1e9,
        "pieces": len(pieces),
        "split": split,
    }


def rows() -> list[dict[str, object]]:
    out = []
    for name in MODELS:
        shapes, ep, pp = grouped_shapes(name)
        for dp in EXPERT_DP:
            whole = measure(shapes, dp, "whole")
            expert = measure(shapes, dp, "expert")
            auto = measure(shapes, dp, "auto")
            out.append(
                {
                    "model": name,
                    "ep": ep,
                    "pp": pp,
                    "expert_dp": dp,
                    "grouped_weights": len(shapes),
                    "local_experts": shapes[0][0],
                    "whole": whole,
                    "expert": expert,
                    "auto_splits": auto["split"],
                }
            )
    return out


def table(results: list[dict[str, object]]) -> str:
    header = (
        "| model | EP | PP | expert-DP | grouped weights / stage | NS max/mean whole | "
        "NS max/mean expert | idle ranks whole | idle ranks expert | busiest GB whole | "
        "busiest GB expert | auto |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in results:
        w, e = r["whole"], r["expert"]
        lines.append(
            f"| {r['model']} | {r['ep']} | {r['pp']} | {r['expert_dp']} | "
            f"{r['grouped_weights']} x {r['local_experts']} experts | "
            f"{w['ns_max_over_mean']:.3f} | {e['ns_max_over_mean']:.3f} | {w['idle_ranks']} | "
            f"{e['idle_ranks']} | {w['busiest_optimizer_gb']:.1f} | "
            f"{e['busiest_optimizer_gb']:.1f} | {'expert' if r['auto_splits'] else 'whole'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    results = rows()
    print(json.dumps(results, indent=2) if args.json else table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
