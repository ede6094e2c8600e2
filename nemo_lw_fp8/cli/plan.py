"""``nemo-lw-fp8 plan``: :func:`.planner.plan` printed as a table or JSON.

Three forms: ``plan --recipe NAME [key=value ...]`` (the recipe's own parallelism, every
pipeline rank, the busiest reported, against its GPU: :mod:`.recipe_plan`); ``plan MODEL --dp N
[--tp --pp --vpp --ep --etp --cp --gpu]`` (the same at explicit sizes); ``plan MODEL --dp N --ep
E`` alone keeps the layout comparison of the whole model on one pipeline stage. Kept apart from
:mod:`.planner` so the maths reads without the presentation around it.

Every form then prints the per-chunk traffic model of the same configuration
(:mod:`.traffic`: each virtual-pipeline chunk as megatron builds it, gradient-sync wire bytes
over an exact reduce-scatter, launches, transient peak, padding, Newton-Schulz balance, for the
padded, compact all-reduce, compact owner-reduce and Adam layouts), the rows
``benchmarks/layout.py`` prints, from the same functions; ``--json`` puts them under
``"traffic"``. ``--qkv-ownership whole`` plans ``linear_qkv`` weights owned whole instead of as
the Q / K / V parts Muon orthogonalizes separately (the default ``auto`` resolves as a run
does: split on the compact layout, whole for a blockwise FP8 recipe).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from nemo_lw_fp8.layout.packing import resolve_qkv_ownership
from nemo_lw_fp8.planner import traffic
from nemo_lw_fp8.planner.rank_plan import GRAD_BYTES, MEMORY_FIELDS, plan
from nemo_lw_fp8.planner.shapes import SPECS
from nemo_lw_fp8.planner.tensor_parallel import MUON_TP_MODES
from nemo_lw_fp8.vocabulary import QKV_OWNERSHIP


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
        f"bucket_size={result['bucket_size']}, param gather {result['param_gather']}, "
        f"grads {result['grad_dtype']}, linear_qkv owned {result['qkv_ownership']}, "
        f"compact grad_sync={result['grad_sync']}; "
        f"{result['params']['per_rank']:,} params per rank"
    ]
    for i, row in enumerate(rows):
        lines.append(
            "  ".join(
                c.ljust(widths[j]) if j == 0 else c.rjust(widths[j]) for j, c in enumerate(row)
            )
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    if result.get("tp", 1) > 1 or result.get("etp", 1) > 1:
        ns = [x["newton_schulz"] for x in lays[:2]]
        gathers = [x["muon_tp_comm"]["bytes_per_rank"] for x in lays[:2]]
        lines.append(
            f"TP {result['tp']} ETP {result['etp']}, muon_tp_mode={result['muon_tp_mode']}: "
            f"Newton-Schulz max work / rank {ns[0]['tp_mode_max']:.3g} (stock_padded), "
            f"{ns[1]['tp_mode_max']:.3g} (compact); Newton-Schulz TP traffic {unit} / rank / step "
            f"{fmt(gathers[0])} (stock_padded), {fmt(gathers[1])} (compact)"
        )
    summary = result["summary"]
    wire = result.get("muon_gather_wire")
    if wire is not None:
        lines.append(
            f"Muon gather payload / rank / step: bf16 {fmt(wire['bf16_bytes'])} {unit}, "
            f"blockwise FP8 {fmt(wire['blockwise_fp8_bytes'])} {unit} "
            f"({wire['bytes_per_param']['blockwise_fp8']:.4f} B/param, "
            f"{wire['blockwise_over_bf16']:.4f} of bf16), NVFP4 {fmt(wire['nvfp4_bytes'])} "
            f"{unit} ({wire['bytes_per_param']['nvfp4']:.4f} B/param, "
            f"{wire['nvfp4_over_bf16']:.4f} of bf16)"
        )
    lines.append(
        f"compact / stock bytes: {summary['compact_over_stock_bytes']:.3f} "
        f"({fmt(summary['bytes_saved_per_rank'])} {unit} saved per rank); legacy uneven gather: "
        f"{summary['param_gather_collectives']['stock_legacy']} collectives / step"
    )
    return "\n".join(lines)


def format_verdict(result: dict[str, Any]) -> str:
    """The header and verdict lines of a recipe / model-form plan."""
    par = result["parallelism"]
    gb = 1e9
    verdict = result["verdict"]
    peaks = result["pp_rank_peaks"]
    ownership = result["grouped_weight_ownership"]
    grouped = (
        f"single grouped expert weights, ownership {ownership}"
        if result["single_grouped_weight"]
        else "discrete expert weights"
    )
    lines = [
        f"{result['recipe'] or result['model']} on {result['gpu'].upper()}: world {par['world']} "
        f"= TP {par['tp']} x PP {par['pp']} (VPP {par['vpp'] or 1}) x CP {par['cp']} x "
        f"DP {par['dp']}; EP {par['ep']} ETP {par['etp']}, expert DP {par['expert_dp']}; "
        f"{grouped}",
        f"busiest pipeline rank {result['pp_rank']} of {par['pp']} (peak GB per PP rank: "
        + " ".join(f"{p / gb:.1f}" for p in peaks)
        + ")",
    ]
    state = verdict["peak_bytes"] / gb
    memory = verdict["gpu_bytes"] / gb
    if verdict["fits"]:
        lines.append(
            f"verdict: FITS - compact peak {state:.1f} GB of {memory:.0f} GB; "
            f"{verdict['headroom_bytes'] / gb:.1f} GB left for activations, workspaces, NCCL"
        )
    else:
        lines.append(
            f"verdict: DOES NOT FIT - compact peak {state:.1f} GB > {memory:.0f} GB before "
            "activations; more PP or EP, or a larger GPU"
        )
    for row in result.get("expert_path") or ():
        lines.append(f"experts on {row['gpu']}: {row['path']}")
    return "\n".join(lines)


def expert_path_rows(recipe: str, gpu: str) -> list[dict[str, str]]:
    """Which expert implementation recipe ``recipe`` takes on ``gpu`` (and on the GPU family
    its variant is for), with and without nvidia-cudnn-frontend where that decides it
    (:func:`nemo_lw_fp8.recipes.te_env.recipe_paths`)."""
    from nemo_lw_fp8.recipes import te_env

    model = te_env.recipe_model(recipe)
    family = "h100" if model["fp8_recipe"] == "blockwise" else "gb200"
    gpus = tuple(dict.fromkeys((gpu, family)))
    return [{"gpu": name, "path": path} for name, path in te_env.recipe_paths(recipe, gpus)]


def main(argv: list[str] | None = None) -> int:
    """``nemo-lw-fp8 plan``: print the plan (table or JSON); bad input is a UsageError."""
    from nemo_lw_fp8.errors import UsageError
    from nemo_lw_fp8.planner import recipe_plan

    parser = argparse.ArgumentParser(
        prog="nemo-lw-fp8 plan",
        description="Per-rank memory, Newton-Schulz balance and collectives of layer-wise Muon "
        "layouts (stock padded vs compact vs Adam), computed without a GPU.",
    )
    parser.add_argument("model", nargs="?", help=f"one of {', '.join(sorted(SPECS))}")
    parser.add_argument("overrides", nargs="*", help="with --recipe: key=value (pretrain names)")
    parser.add_argument("--recipe", help="plan a recipe as shipped (nemo-lw-fp8 recipes)")
    parser.add_argument("--dp", type=int, help="data-parallel size")
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel size")
    for flag in ("tp", "pp", "vpp", "etp", "cp"):
        parser.add_argument(f"--{flag}", type=int, default=None, help=f"{flag.upper()} size")
    parser.add_argument("--gpu", choices=sorted(recipe_plan.GPU_MEMORY), default=None)
    parser.add_argument(
        "--muon-tp-mode", choices=MUON_TP_MODES, default=None,
        help="Newton-Schulz of TP-sharded matrices (megatron's muon_tp_mode; default "
        "duplicated): the work and TP traffic per owner at TP or ETP > 1",
    )  # fmt: skip
    parser.add_argument("--bucket-size", type=int, default=None, help="elements per DDP bucket")
    parser.add_argument(
        "--no-overlap-grad-reduce", action="store_true", help="one bucket per buffer"
    )
    parser.add_argument(
        "--no-fp8-param-gather", action="store_true", help="bf16 parameters, no MXFP8"
    )
    parser.add_argument("--grad-dtype", choices=sorted(GRAD_BYTES), default="fp32")
    parser.add_argument("--gather-padding-tolerance", type=float, default=0.1)
    parser.add_argument(
        "--qkv-ownership", choices=QKV_OWNERSHIP, default="auto",
        help="linear_qkv weights Muon splits (muon_split_qkv) owned as their Q / K / V parts "
        "(split) or whole; auto (the default): split unless the recipe is blockwise FP8",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_intermixed_args(argv)
    for name in ("dp", "ep", "tp", "pp", "vpp", "etp", "cp", "bucket_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} {value}: must be >= 1", "give a count")
    grad_bytes = GRAD_BYTES[args.grad_dtype]
    # The model forms plan the compact layout of bf16 / MXFP8 weights: auto owns QKV parts apart.
    qkv_ownership = resolve_qkv_ownership(args.qkv_ownership, "compact")
    traffic_of = None  # () -> the traffic rows of the same configuration
    if args.recipe:
        words = ([args.model] if args.model else []) + args.overrides
        setup = recipe_plan.recipe_setup(args.recipe, words)
        if args.qkv_ownership != "auto":  # else the recipe's own (override or default)
            setup.qkv_ownership = args.qkv_ownership
        if args.muon_tp_mode is not None:
            setup.muon_tp_mode = args.muon_tp_mode
        result = recipe_plan.plan_recipe(setup)
        result["expert_path"] = expert_path_rows(args.recipe, setup.gpu)
        traffic_of = _pipeline_traffic(setup)
    else:
        if args.model is None or args.overrides:
            raise UsageError(
                "plan needs --recipe NAME, or a MODEL and --dp",
                "e.g. plan --recipe deepseek_v3_mxfp8",
            )
        if args.dp is None:
            raise UsageError("the model form needs --dp", f"e.g. plan {args.model} --dp 64")
        model_form = any(
            getattr(args, f) is not None for f in ("tp", "pp", "vpp", "etp", "cp", "gpu")
        )
        if model_form:
            names = recipe_plan.spec_names()
            if args.model.removeprefix("tiny-") not in names:
                raise UsageError(f"unknown model {args.model!r}", f"one of {', '.join(names)}")
            setup = recipe_plan.model_setup(
                args.model, tp=args.tp or 1, pp=args.pp or 1, vpp=args.vpp, ep=args.ep or 1,
                etp=args.etp or 1, cp=args.cp or 1, dp=args.dp, gpu=args.gpu or "h100",
                single_grouped_weight=False, bucket_size=args.bucket_size,
                fp8_param_gather=not args.no_fp8_param_gather,
                gather_padding_tolerance=args.gather_padding_tolerance,
                grad_reduce_in_fp32=args.grad_dtype == "fp32", qkv_ownership=qkv_ownership,
                muon_tp_mode=args.muon_tp_mode or "duplicated",
            )  # fmt: skip
            result = recipe_plan.plan_recipe(setup)
            result["recipe"] = None
            traffic_of = _pipeline_traffic(setup)
        else:
            if args.model not in SPECS:
                raise UsageError(
                    f"unknown model {args.model!r}", f"one of {', '.join(sorted(SPECS))}"
                )
            try:
                result = plan(
                    args.model,
                    args.dp,
                    args.ep or 1,
                    bucket_size=args.bucket_size,
                    fp8_param_gather=not args.no_fp8_param_gather,
                    grad_dtype=args.grad_dtype,
                    overlap_grad_reduce=not args.no_overlap_grad_reduce,
                    gather_padding_tolerance=args.gather_padding_tolerance,
                    qkv_ownership=qkv_ownership,
                )
            except ValueError as exc:
                raise UsageError(str(exc), "see nemo-lw-fp8 plan --help") from None
            if args.model in recipe_plan.spec_names():

                def traffic_of() -> list[dict[str, Any]]:
                    return traffic.whole_model_rows(
                        args.model, args.dp, args.ep or 1, bucket_size=args.bucket_size,
                        fp8_param_gather=not args.no_fp8_param_gather, grad_bytes=grad_bytes,
                        qkv_ownership=qkv_ownership,
                    )  # fmt: skip

    rows, why_not = None, "not modelled for this model (no architecture)"
    if traffic_of is not None:
        try:
            rows = traffic_of()
        except ValueError as error:  # e.g. TP or CP above 1
            why_not = str(error)
    if args.json:
        print(json.dumps({**result, "traffic": rows}, indent=2, default=list))
        return 0
    print(format_verdict(result) + "\n" + format_table(result) if "verdict" in result
          else format_table(result))  # fmt: skip
    print(f"\n{TRAFFIC_TITLE}")
    print("\n".join(traffic.format_rows(rows)) if rows is not None else f"  {why_not}")
    return 0


#: The heading of the traffic rows in the text output.
TRAFFIC_TITLE = (
    "The table above plans the compact layout as it runs by default (grad_sync=reduce_to_owner: "
    "the owner-reduce layout below; all_reduce is the upstream compact path).\n"
    "Per step, worst rank, each virtual-pipeline chunk as megatron builds it "
    "(nemo_lw_fp8.planner.traffic, as benchmarks/layout.py):"
)


def _pipeline_traffic(setup: Any):
    """The traffic rows of a recipe or model-form setup, every pipeline rank."""

    from nemo_lw_fp8.planner.recipe_plan import planned_qkv_ownership

    def rows() -> list[dict[str, Any]]:
        return traffic.pipeline_rows(
            setup.recipe, setup.arch, setup.par,
            single_grouped_weight=setup.single_grouped_weight, ownership=setup.ownership,
            qkv_ownership=planned_qkv_ownership(setup),
            bucket_size=setup.bucket_size,
            fp8_param_gather=setup.fp8_param_gather,
            grad_bytes=GRAD_BYTES["fp32" if setup.grad_reduce_in_fp32 else "bf16"],
        )  # fmt: skip

    return rows


if __name__ == "__main__":
    raise SystemExit(main())
