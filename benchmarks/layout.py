"""Gradient-sync and gather traffic, padding and Newton-Schulz balance of the layer-wise layouts.

For DeepSeek-V3 and Qwen3-235B-A22B, on every pipeline rank of the plugin's full recipes
(``nemo_lw_fp8.recipes``: each virtual-pipeline chunk its own DDP, as megatron builds it) and
whole-model (TP = PP = 1) at DP 64 and 256: per rank and step, gradient-sync wire bytes over an
exact reduce-scatter of the same gradients, gradient-sync and param-gather collectives, the
transient peak, persistent padding, and Newton-Schulz max/mean next to its lower bound, for
stock 0.19.2 padded, compact with all-reduce (upstream #5388 / #5479), the plugin's compact
owner-reduce path, and Adam (DistributedOptimizer); upstream main's padded figures from
``../shared/notes/upstream-main-2026-08.md`` beside them. Computed by
:func:`nemo_lw_fp8.models.traffic.rank_traffic` (megatron's own layout code on meta tensors).

    python benchmarks/layout.py [--json] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nemo_lw_fp8.models.traffic import LAYOUTS  # noqa: E402

RECIPES = ("deepseek_v3_mxfp8", "qwen3_235b_a22b_mxfp8")
WHOLE = (("deepseek-v3", 64, 64), ("deepseek-v3", 256, 64),
         ("qwen3-235b-a22b", 64, 32), ("qwen3-235b-a22b", 256, 32))  # fmt: skip
#: Upstream Megatron-LM main's padded layout (#5415, #6379), measured in the note:
#: (padding G elements, NS max/mean, grad wire over exact, param gathers per step).
UPSTREAM_MAIN = {
    ("deepseek-v3", 64, 64): (10.51, 1.044, 1.61, 3),
    ("qwen3-235b-a22b", 64, 32): (0.56, 1.002, 1.05, 98),
}
LABEL = {
    "stock_padded": "0.19.2 padded",
    "compact_all_reduce": "compact all-reduce (upstream)",
    "compact_owner_reduce": "plugin compact owner-reduce",
    "adam": "Adam DistOpt",
}


def settings() -> list[dict]:
    """Every row's model, parallelism, pipeline rank and chunks."""
    from nemo_lw_fp8.models.architectures import get_architecture
    from nemo_lw_fp8.models.parallel import ParallelismDefaults
    from nemo_lw_fp8.models.pipeline import chunk_param_specs
    from nemo_lw_fp8.models.recipe_plan import group_experts, recipe_setup

    rows = []
    for name in RECIPES:
        setup = recipe_setup(name)
        par = setup.par
        for rank in range(par.pp):
            chunks = chunk_param_specs(setup.arch, par, rank)
            if setup.single_grouped_weight:
                chunks = [group_experts(c) for c in chunks]
            rows.append({
                "config": f"{name} PP{par.pp} VP{par.vpp or 1} EP{par.ep} "
                          f"DP{par.data_parallel_size} rank {rank}",
                "key": None, "chunks": chunks, "dp": par.data_parallel_size, "ep": par.ep,
                "pp_rank": rank, "ownership": setup.ownership,
            })  # fmt: skip
    for model, dp, ep in WHOLE:
        arch = get_architecture(model)
        par = ParallelismDefaults(recipe="whole", nodes=1, gpus_per_node=dp, ep=ep,
                                  global_batch_size=dp)  # fmt: skip
        rows.append({
            "config": f"{model} whole model EP{ep} DP{dp}", "key": (model, dp, ep),
            "chunks": chunk_param_specs(arch, par, 0), "dp": dp, "ep": ep, "pp_rank": 0,
            "ownership": "whole",
        })  # fmt: skip
    return rows


def main() -> None:
    from nemo_lw_fp8.models.traffic import rank_traffic

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--only", help="rows whose config contains this text")
    args = parser.parse_args()
    start = time.perf_counter()
    out = []
    for row in settings():
        if args.only and args.only not in row["config"]:
            continue
        result = rank_traffic(
            row["chunks"], row["dp"], row["ep"], pp_rank=row["pp_rank"],
            ownership=row["ownership"],
        )  # fmt: skip
        out.append({"config": row["config"], "key": row["key"], **result})
    elapsed = time.perf_counter() - start
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return
    print(
        "| config | layout | grad wire / exact RS | grad launches | gather launches "
        "| transient peak GB | padding G elems | NS max/mean (bound) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in out:
        for name in LAYOUTS:
            e = r[name]
            ns = e["newton_schulz"]
            ns_text = "-" if ns is None else f"{ns['max_over_mean']:.3f} ({ns['lower_bound']:.3f})"
            print(
                f"| {r['config']} | {LABEL[name]} | {e['grad_wire_over_exact']:.3f} "
                f"| {e['grad_collectives']} | {e['gather_collectives']} "
                f"| {e['transient_peak_bytes'] / 1e9:.2f} | {e['padding_numel'] / 1e9:.2f} "
                f"| {ns_text} |"
            )
        note = UPSTREAM_MAIN.get(r["key"]) if r["key"] else None
        if note:
            print(
                f"| {r['config']} | upstream main padded (note) | {note[2]:.2f} | - | {note[3]} "
                f"| - | {note[0]:.2f} | {note[1]:.3f} |"
            )
    print(
        "\nPer rank and step, worst rank; wire: bytes sent, fp32 gradients, Muon + Adam buffers; "
        f"MXFP8 param gather; megatron's default buckets. Planned in {elapsed:.1f} s."
    )


if __name__ == "__main__":
    main()
