"""Per-step gradient and gather traffic of one pipeline rank, chunk by chunk as megatron builds it.

megatron wraps each virtual-pipeline chunk in its own DDP: its own buffers, buckets and bucket
groups (``wrap_model_chunks_with_ddp``). Bucketing is on only for chunk 0 of pipeline rank 0;
every other chunk has one bucket per buffer, and chunks after the first force one bucket group
per process group (``disable_bucketing``). :func:`rank_traffic` lays out every chunk that way and
compares four layouts of the same parameters:

* ``stock_padded``: megatron-core 0.19.2's padded layer-wise layout (Muon) + DistributedOptimizer
  (Adam on the rest); gradients reduce-scattered over the padded buffers.
* ``compact_all_reduce``: zero-padding Muon buffers bucketed like plain DDP, gradients
  all-reduced (upstream #5388 / #5479's traffic, and the plugin's path before issue 19).
* ``compact_owner_reduce``: the plugin's path. Compact buckets end where the padded layout
  ends them (:func:`nemo_lw_fp8.layout.packing.compact_bucket_counts`); each bucket's gradients lie
  in owner order in the persistent grad buffer, and per bucket group each owner's span of each
  bucket is reduced in place to that owner in one coalesced launch
  (:mod:`nemo_lw_fp8.mechanics.owner_reduce`, whose span arithmetic this uses): a rank sends
  ``N - s_r`` of the group's ``N`` elements (ring reduce: every non-root sends each span once),
  ``s_r`` being what it owns in the group. No transient gradient buffer.

The transient peak is the largest transient buffer one bucket group needs: for the compact
layouts the bf16 buffer its param gather receives into (``N`` elements), for the owner reduce
nothing more.
* ``adam``: Adam on everything through megatron's DistributedOptimizer.

Ownership of the compact layouts is the rank's one layer-wise optimizer's: over all its chunks
together (:func:`.ownership.our_owners`), a ``linear_qkv`` weight Muon splits owned as its
Q / K / V parts with ``qkv_ownership="split"`` (:mod:`.qkv_split`; the gradient of such a weight
then interleaves its owners, part by part in every query group). Wire bytes are per rank, the
worst rank; "exact" is a reduce-scatter of the same real gradients with no padding,
``(P - 1) / P`` of them per group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nemo_lw_fp8.layout import packing as lo
from nemo_lw_fp8.mechanics import owner_reduce
from nemo_lw_fp8.planner.owner_sync import bucket_spans
from nemo_lw_fp8.planner.ownership import Ownership, our_owners, stock_costs
from nemo_lw_fp8.planner.plan_parts import bucket_groups, buffers_of, local_specs
from nemo_lw_fp8.planner.qkv_split import check_qkv_ownership, unit_costs
from nemo_lw_fp8.planner.shapes import ParamSpec
from nemo_lw_fp8.planner.tensor_parallel import StageRanks
from nemo_lw_fp8.planner.weight_bytes import PARAM_BYTES

LAYOUTS = ("stock_padded", "compact_all_reduce", "compact_owner_reduce", "adam")
LABEL = {
    "stock_padded": "0.19.2 padded",
    "compact_all_reduce": "compact all-reduce (upstream)",
    "compact_owner_reduce": "plugin compact owner-reduce",
    "adam": "Adam DistOpt",
}


def _chunk_bucket_sizes(chunks: int, pp_rank: int, bucket_size: int | None) -> list[int | None]:
    """megatron's per-chunk bucket size: only chunk 0 of pipeline rank 0 is bucketed."""
    return [bucket_size if (c == 0 and pp_rank == 0) else None for c in range(chunks)]


def _groups(members: list[tuple[bool, int]], force_single: bool) -> list[list[tuple[int, int]]]:
    """Bucket groups of one chunk's buffers of one process group (``(is_fp8, buckets)`` each)."""
    if not members:
        return []
    if force_single:
        return [[(i, b) for i, (_, n) in enumerate(members) for b in range(n)]]
    return bucket_groups(members)


def lower_bound(costs: Sequence[int], loads: Sequence[int]) -> float:
    """Largest single matrix cost over the mean cost per rank: no whole-matrix ownership can
    have a smaller max/mean."""
    total = sum(loads)
    return max(costs, default=0) * len(loads) / total if total else 1.0


def rank_traffic(
    chunk_specs: Sequence[Sequence[ParamSpec]],
    dp: int,
    ep: int = 1,
    *,
    pp_rank: int = 0,
    bucket_size: int | None = None,
    fp8_param_gather: bool = True,
    grad_bytes: int = 4,
    bucket_cap_numel: int | None = None,
    ownership: str = "whole",
    qkv_ownership: str = "split",
    tp: int = 1,
    etp: int | None = None,
) -> dict[str, Any]:
    """Traffic, padding and Newton-Schulz balance of one pipeline rank holding ``chunk_specs``
    (one list of whole-model :class:`ParamSpec` per virtual-pipeline chunk, all experts; the
    rank's TP shards and EP share are cut here), over ``dp`` data-parallel and ``tp * dp /
    (ep * etp)`` expert-data-parallel ranks (megatron's sizes; ``etp`` defaults to ``tp``): the
    bytes are per TP shard, the worst of the stage's ``tp * dp`` ranks. ``bucket_size``
    ``None``: megatron's default ``max(40M, 1M * dp)``. ``qkv_ownership``: as in
    :func:`.planner.plan` (``"whole"``: the model before Q/K/V split ownership)."""
    etp = tp if etp is None else etp
    if (dp * tp) % (ep * etp):
        raise ValueError(f"ep={ep} x etp={etp} must divide tp={tp} x dp={dp}")
    check_qkv_ownership(qkv_ownership)
    stage = StageRanks(dp, ep, tp, etp)
    edp, nranks = stage.edp, stage.n
    bucket_size = max(40_000_000, 1_000_000 * dp) if bucket_size is None else bucket_size
    local = [local_specs(list(specs), ep, tp, etp) for specs in chunk_specs]
    merged = [s for specs in local for s in specs]
    own = our_owners(merged, dp, ep, ownership, qkv_ownership, ranks=stage)
    starts = [sum(len(c) for c in local[:k]) for k in range(len(local))]
    sizes = _chunk_bucket_sizes(len(local), pp_rank, bucket_size)

    def world(expert: bool) -> int:
        return edp if expert else dp

    def per_global(values: list[int], expert: bool) -> list[int]:
        return stage.view(values, expert)

    acc = {
        name: {
            "wire": [0] * nranks,
            "exact": [0] * nranks,
            "grad_collectives": 0,
            "gather_collectives": 0,
            "transient_peak_bytes": 0,
            "padding_numel": 0,
            "grad_reduces": [0] * nranks,
        }
        for name in LAYOUTS
    }
    stock_ns = [0] * nranks

    def ring(a: dict, w: int, numel: int, real: int, all_reduce: bool) -> None:
        """A reduce-scatter (all-reduce: twice) of ``numel`` elements holding ``real`` ones."""
        if w <= 1:
            return
        sent = (2 if all_reduce else 1) * numel * (w - 1) * grad_bytes // w
        exact = real * (w - 1) * grad_bytes // w
        for r in range(nranks):
            a["wire"][r] += sent
            a["exact"][r] += exact

    for c, specs in enumerate(local):
        force_single = c > 0
        for layer_wise, names in ((True, LAYOUTS[:3]), (False, ("adam",))):
            buffers = buffers_of(specs, fp8_param_gather, layer_wise=layer_wise)
            per_kind: dict[str, dict[bool, list]] = {n: {False: [], True: []} for n in names}
            for buf in buffers:
                w = world(buf.expert)
                shapes = buf.shapes
                if not buf.muon:
                    distopt = lo.stock_distopt_layout(shapes, w, sizes[c])
                    for name in names:
                        a = acc[name]
                        a["padding_numel"] += distopt.numel - buf.numel
                        for start, end, unpadded in distopt.buckets:
                            ring(a, w, end - start, unpadded, False)
                        per_kind[name][buf.expert].append((buf, len(distopt.buckets), None))
                    continue
                padded = lo.stock_padded_layout(shapes, w, sizes[c])
                acc["stock_padded"]["padding_numel"] += padded.numel - buf.numel
                costs = stock_costs(buf.specs, padded, w, qkv_ownership)
                for r, cost in enumerate(per_global(costs, buf.expert)):
                    stock_ns[r] += cost
                for start, end, unpadded in padded.buckets:
                    ring(acc["stock_padded"], w, end - start, unpadded, False)
                per_kind["stock_padded"][buf.expert].append((buf, len(padded.buckets), None))
                # compact: per bucket, its pieces as (elements, owner)
                backprop = list(range(len(buf.specs)))[::-1]
                numels = [buf.specs[p].numel for p in backprop]
                for name, cap in (("compact_all_reduce", 0), ("compact_owner_reduce", None)):
                    if name == "compact_owner_reduce":
                        cap = bucket_cap_numel
                    counts = lo.compact_bucket_counts(numels, sizes[c], w, cap)
                    buckets, k = [], 0
                    for n in counts:  # per bucket: (spec index in the rank's list, elements)
                        buckets.append(
                            [(starts[c] + buf.indices[p], buf.specs[p].numel)
                             for p in backprop[k : k + n]]
                        )  # fmt: skip
                        k += n
                    per_kind[name][buf.expert].append((buf, len(buckets), buckets))
            for name in names:
                a = acc[name]
                for expert, members in per_kind[name].items():
                    w = world(expert)
                    if w <= 1 or not members:
                        continue
                    # compact layouts never group Muon with Adam buckets (split_by_effective_kind)
                    kinds = (
                        [[m for m in members if m[0].muon], [m for m in members if not m[0].muon]]
                        if name.startswith("compact")
                        else [members]
                    )
                    fp8 = any(m[0].fp8 for m in members)
                    for kind in filter(None, kinds):
                        # an Adam kind split off from an FP8 buffer stays one group
                        # (mechanics.compact.partition), as in megatron's case 3
                        single = force_single or (
                            name.startswith("compact") and fp8 and not any(m[0].fp8 for m in kind)
                        )
                        groups = _groups([(m[0].fp8, m[1]) for m in kind], single)
                        a["grad_collectives"] += len(groups)
                        if name == "stock_padded":  # layer-wise and DistOpt gather separately
                            a["gather_collectives"] += sum(
                                len({kind[i][0].muon for i, _ in g}) for g in groups
                            )
                        else:
                            a["gather_collectives"] += len(groups)
                        if not name.startswith("compact") or not kind[0][0].muon:
                            continue
                        # every expert-data-parallel group owns its experts its own way
                        if expert:
                            tables = list(zip(own.expert_groups, own.expert_ranks, strict=True))
                        else:
                            tables = [(own.dense, group) for group in stage.dense_groups()]
                        for g in groups:
                            items = [item for i, b in g for item in kind[i][2][b]]
                            n_group = sum(n for _, n in items)
                            exact = n_group * (w - 1) // w
                            # the gather's bf16 receive buffer; the owner reduce adds none
                            peak = n_group * PARAM_BYTES
                            a["transient_peak_bytes"] = max(a["transient_peak_bytes"], peak)
                            for table, ranks in tables:
                                spans = [
                                    span
                                    for i, b in g
                                    for span in bucket_spans(kind[i][2][b], table, own)
                                ]
                                for member, r in enumerate(ranks):
                                    if name == "compact_all_reduce":
                                        sent = 2 * n_group * (w - 1) // w
                                    else:
                                        t = owner_reduce.owner_reduce_traffic(spans, member, w)
                                        sent = t.sent
                                        a["grad_reduces"][r] += t.reduces
                                    a["wire"][r] += sent * grad_bytes
                                    a["exact"][r] += exact * grad_bytes

    dense = [
        c for s in merged if s.muon and not s.expert_parallel for c in unit_costs(s, qkv_ownership)
    ]
    expert_fixed = sum(
        lo.newton_schulz_cost(s.shape) for s in merged if s.muon and s.expert_parallel
    )
    out: dict[str, Any] = {
        "dp": dp, "ep": ep, "pp_rank": pp_rank, "chunks": len(local),
        **({"tp": tp, "etp": etp, "expert_dp": edp} if (tp, etp) != (1, 1) else {}),
        "qkv_ownership": qkv_ownership,
    }  # fmt: skip
    for name in LAYOUTS:
        a = acc[name]
        worst = max(range(nranks), key=lambda r: (a["wire"][r], -r))
        exact = a["exact"][worst]
        entry = {
            "grad_wire_bytes": a["wire"][worst],
            "exact_reduce_scatter_bytes": exact,
            "grad_wire_over_exact": a["wire"][worst] / exact if exact else 1.0,
            "grad_collectives": a["grad_collectives"],
            "gather_collectives": a["gather_collectives"],
            "transient_peak_bytes": a["transient_peak_bytes"],
            "padding_numel": a["padding_numel"],
            "grad_reduces": max(a["grad_reduces"]),
            "newton_schulz": None,
        }
        if name != "adam":
            loads = stock_ns if name == "stock_padded" else own.cost
            bound = lower_bound(_expert_aware_costs(merged, own, qkv_ownership), loads)
            if edp == 1 and sum(loads):
                # a rank's own experts cannot move: it carries them plus its largest matrix
                bound = max(bound, (expert_fixed + max(dense, default=0)) * nranks / sum(loads))
            entry["newton_schulz"] = {"max_over_mean": lo.imbalance(loads), "lower_bound": bound}
        out[name] = entry
    return out


def _expert_aware_costs(specs: list[ParamSpec], own: Ownership, qkv_ownership: str) -> list[int]:
    """Costs of the smallest units ownership can hand out: whole matrices, single experts of a
    grouped weight owned in runs, or the parts of a split ``linear_qkv``."""
    costs = []
    for i, s in enumerate(specs):
        if s.muon:
            costs += [c // own.units.get(i, 1) for c in unit_costs(s, qkv_ownership)]
    return costs


# --------------------------------------------------------------------------- rows and table


def pipeline_rows(
    label: str,
    arch: Any,
    par: Any,
    *,
    single_grouped_weight: bool,
    ownership: str = "whole",
    qkv_ownership: str = "split",
    **settings: Any,
) -> list[dict[str, Any]]:
    """One row per pipeline rank of ``arch`` under ``par`` (each rank's virtual-pipeline chunks,
    :func:`.pipeline.chunk_param_specs`): :func:`rank_traffic` of its chunks. ``settings``:
    :func:`rank_traffic`'s ``bucket_size``, ``fp8_param_gather``, ``grad_bytes``, ..."""
    from nemo_lw_fp8.planner.pipeline import chunk_param_specs
    from nemo_lw_fp8.planner.recipe_plan import group_experts

    dp = par.data_parallel_size
    rows = []
    for rank in range(par.pp):
        chunks = chunk_param_specs(arch, par, rank)
        if single_grouped_weight:
            chunks = [group_experts(c) for c in chunks]
        result = rank_traffic(
            chunks, dp, par.ep, pp_rank=rank, ownership=ownership, qkv_ownership=qkv_ownership,
            **({"tp": par.tp, "etp": par.etp} if (par.tp, par.etp) != (1, 1) else {}), **settings,
        )  # fmt: skip
        tp = f"TP{par.tp} ETP{par.etp} " if (par.tp, par.etp) != (1, 1) else ""
        config = f"{label} {tp}PP{par.pp} VP{par.vpp or 1} EP{par.ep} DP{dp} rank {rank}"
        rows.append({"config": config, "key": None, **result})
    return rows


def whole_model_rows(
    model: str, dp: int, ep: int, *, qkv_ownership: str = "split", **settings: Any
) -> list[dict[str, Any]]:
    """The whole model (TP = PP = 1) on ``dp`` ranks, discrete experts owned whole."""
    from nemo_lw_fp8.planner.pipeline import chunk_param_specs
    from nemo_lw_fp8.recipes.architectures import get_architecture
    from nemo_lw_fp8.recipes.parallel import ParallelismDefaults

    arch = get_architecture(model)
    par = ParallelismDefaults(
        recipe="whole", nodes=1, gpus_per_node=dp, ep=ep, global_batch_size=dp
    )
    result = rank_traffic(
        chunk_param_specs(arch, par, 0), dp, ep, pp_rank=0, qkv_ownership=qkv_ownership,
        **settings,
    )  # fmt: skip
    return [{"config": f"{model} whole model EP{ep} DP{dp}", "key": (model, dp, ep), **result}]


def format_rows(rows: list[dict[str, Any]], notes: dict | None = None) -> list[str]:
    """The rows as a markdown table, one line per layout; ``notes[row key]`` = upstream main's
    padded figures ``(padding G elements, NS max/mean, wire over exact, gathers)`` beside them."""
    lines = [
        "| config | layout | grad wire / exact RS | grad launches | gather launches "
        "| transient peak GB | padding G elems | NS max/mean (bound) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for name in LAYOUTS:
            e = r[name]
            ns = e["newton_schulz"]
            ns_text = "-" if ns is None else f"{ns['max_over_mean']:.3f} ({ns['lower_bound']:.3f})"
            lines.append(
                f"| {r['config']} | {LABEL[name]} | {e['grad_wire_over_exact']:.3f} "
                f"| {e['grad_collectives']} | {e['gather_collectives']} "
                f"| {e['transient_peak_bytes'] / 1e9:.2f} | {e['padding_numel'] / 1e9:.2f} "
                f"| {ns_text} |"
            )
        note = (notes or {}).get(r["key"]) if r["key"] else None
        if note:
            lines.append(
                f"| {r['config']} | upstream main padded (note) | {note[2]:.2f} | - | {note[3]} "
                f"| - | {note[0]:.2f} | {note[1]:.3f} |"
            )
    return lines
