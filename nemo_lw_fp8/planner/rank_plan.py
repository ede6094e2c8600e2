"""Memory, Newton-Schulz balance and communication of layer-wise Muon layouts, per rank.

``plan()`` compares, for one model at given data-, expert- and tensor-parallel sizes (PP = CP = 1;
TP and ETP shards as in :mod:`.tensor_parallel`):

* ``stock_padded``: megatron-core 0.19.2's padded layer-wise layout (Muon on the matrices, a
  sibling ``DistributedOptimizer`` running Adam on embeddings, output layer and vectors),
  computed by megatron's own layout code (:func:`nemo_lw_fp8.layout.packing.stock_padded_layout`);
* ``compact``: the same optimizers with compact (zero-padding) Muon buffers, ownership as the
  compact patch computes it (:func:`nemo_lw_fp8.layout.packing.choose_pieces` by Newton-Schulz cost,
  the dense and the expert group each on its own; grouped expert weights whole or in runs of
  experts; a ``linear_qkv`` weight Muon splits owned as its Q / K / V parts with
  ``qkv_ownership="split"``, :mod:`.qkv_split`) and one gather per
  Muon bucket group, even or uneven (:func:`nemo_lw_fp8.layout.packing.even_gather_fits`), as the
  compact patch does it;
* ``adam_distopt``: Adam on everything through megatron's ``DistributedOptimizer``.

It needs no GPU and no process group: megatron's layout functions run on meta-device stand-ins.
The reference for every number is docs/planner.md. The table and the ``nemo-lw-fp8 plan`` command
are in :mod:`nemo_lw_fp8.cli.plan`; the plan for one pipeline rank of a recipe in :mod:`.pipeline`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nemo_lw_fp8.layout import packing as lo
from nemo_lw_fp8.planner.owner_sync import bucket_spans, owner_reduce_layout, sent_by_member
from nemo_lw_fp8.planner.ownership import our_owners, stock_costs, stock_tp_work
from nemo_lw_fp8.planner.plan_parts import (
    ADAM_STATE_BYTES,
    GRAD_BYTES,
    MASTER_BYTES,
    MUON_STATE_BYTES,
    Acc,
    Buffer,
    bucket_groups,
    buffers_of,
    local_specs,
    rank_view,
    ring,
)
from nemo_lw_fp8.planner.plan_parts import MEMORY_FIELDS as MEMORY_FIELDS
from nemo_lw_fp8.planner.qkv_split import check_qkv_ownership
from nemo_lw_fp8.planner.shapes import ParamSpec, param_shapes
from nemo_lw_fp8.planner.tensor_parallel import MUON_TP_MODES, StageRanks
from nemo_lw_fp8.planner.weight_bytes import PARAM_BYTES as PARAM_BYTES
from nemo_lw_fp8.planner.weight_bytes import blockwise_wire_bytes as blockwise_wire_bytes
from nemo_lw_fp8.planner.weight_bytes import muon_gather_wire
from nemo_lw_fp8.planner.weight_bytes import mxfp8_weight_bytes as mxfp8_weight_bytes
from nemo_lw_fp8.planner.weight_bytes import nvfp4_weight_bytes as nvfp4_weight_bytes
from nemo_lw_fp8.planner.weight_bytes import nvfp4_wire_bytes as nvfp4_wire_bytes
from nemo_lw_fp8.vocabulary import GRAD_SYNC_MODES

ASSUMPTIONS = (
    "One pipeline stage (PP and CP outside; CP folded into dp). At TP = 1 the data-parallel "
    "group is every rank; an expert-parallel group is ep consecutive ranks, so global rank r is "
    "member r // ep of expert-data-parallel group r % ep (megatron's default tp-cp-ep-dp-pp "
    "order), a group of dp / ep ranks. At TP > 1 each rank holds TP shards (ETP for experts) "
    "and the expert-data-parallel group has tp * dp / (ep * etp) ranks (docs/planner.md).",
    "Each rank holds num_experts / ep experts of every MoE layer; expert matrices are sharded "
    "over the expert-data-parallel group, everything else over the data-parallel group.",
    "bucket_size defaults to megatron DDP's max(40M, 1M * dp) elements (overlap_grad_reduce on); "
    "without overlap_grad_reduce each buffer is one bucket.",
    "Muon-managed: 2-D and not embedding/output (megatron's is_managed_by_layer_wise_optimizer); "
    "the router weight is Muon-managed. Adam (sibling DistributedOptimizer) takes the rest.",
    "fp8_param_gather = MXFP8 with reuse_grad_buf_for_mxfp8_param_ag: TE linear weights are "
    "persistent MXFP8 tensors (rowwise + columnwise codes and E8M0 scales) and the bf16 param "
    "buffer aliases the gradient buffer; router, embeddings, output layer and norms stay bf16 in "
    "their own buffers. Off: every parameter is bf16 in a persistent param buffer.",
    "fp32 masters for every parameter a rank updates; Muon keeps one fp32 momentum, Adam two fp32 "
    "moments. TE's high-precision init copies and activations are not counted.",
    "Gather bytes are bf16 (2 per element, padding included) for every layout; wire bytes per "
    "rank use ring formulas: (w - 1) / w of the gathered or reduce-scattered buffer, twice that "
    "for an all-reduce.",
    "Collectives are counted per step for groups of more than one rank. stock_padded: one "
    "coalesced all_gather_into_tensor per bucket group (megatron's _coalescing_manager in "
    "start_param_sync), separately for the layer-wise and the Adam optimizer when a bucket group "
    "mixes both (partition_buckets case 3 puts non-FP8 buckets into the last FP8 group). "
    "stock_legacy: the uneven all_gather of the legacy path, which NCCL runs as one broadcast per "
    "rank, over megatron's unpadded, untagged buckets. compact: one all_gather_into_tensor per "
    "gather group (consecutive bucket groups merged until the transient padding is within "
    "gather_padding_tolerance) plus Adam's; every expert-data-parallel group owns its "
    "(identically shaped) experts the same way.",
    "compact Muon gradients are synced as grad_sync says: reduce_to_owner (the default) reduces "
    "each owner's span of each bucket to that owner in place, buckets ending where the padded "
    "layout ends them (bucket_cap_numel None); all_reduce all-reduces plain DDP buckets "
    "(upstream PR #5388's compact path). The padded and Adam layouts reduce-scatter.",
    "muon_split_qkv on (megatron's default): Muon orthogonalizes a linear_qkv weight as its "
    "Q / K / V parts (with attention_output_gate Q, gate, K, V). qkv_ownership='split' counts its "
    "Newton-Schulz work as the parts' in every layout and owns the parts separately in the "
    "compact one (one gather segment member each); 'whole' owns and counts it as one matrix.",
)


def plan(
    model: str | Sequence[ParamSpec],
    dp: int,
    ep: int = 1,
    bucket_size: int | None = None,
    fp8_param_gather: bool = True,
    grad_dtype: str = "fp32",
    *,
    overlap_grad_reduce: bool = True,
    gather_padding_tolerance: float = 0.1,
    grouped_weight_ownership: str = "whole",
    qkv_ownership: str = "split",
    grad_sync: str = "reduce_to_owner",
    bucket_cap_numel: int | None = None,
    tp: int = 1,
    etp: int | None = None,
    muon_tp_mode: str = "duplicated",
    weight_format: str = "mxfp8",
) -> dict[str, Any]:
    """Per-rank bytes, Newton-Schulz balance and per-step communication of the three layouts.

    ``model``: a name from :data:`nemo_lw_fp8.planner.shapes.SPECS` or an explicit list of
    :class:`ParamSpec` (full model, all experts). ``dp``: dense data-parallel size (x CP);
    ``ep``: expert-parallel size (divides the expert count; EP x ETP divides TP x DP).
    ``bucket_size``: elements per DDP bucket, ``None`` for megatron's default.
    ``grouped_weight_ownership``: how the compact layout owns single grouped expert weights
    ``(E, m, n)`` (``"whole"``, ``"expert"``: runs of experts, ``"auto"``;
    :data:`nemo_lw_fp8.layout.packing.GROUPED_WEIGHT_OWNERSHIP`).
    ``qkv_ownership``: ``"split"`` owns each ``linear_qkv`` weight Muon splits
    (``muon_split_qkv``, assumed on) as its Q / K / V parts and counts their Newton-Schulz work
    as the parts' (in every layout); ``"whole"`` owns and counts it as one matrix
    (:mod:`.qkv_split`). ``grad_sync`` and ``bucket_cap_numel``: the compact layout's
    (:class:`nemo_lw_fp8.LayerWiseConfig`; the defaults are its defaults, so the compact column
    is the layout a run gets unless it says otherwise). ``tp`` / ``etp`` (default ``tp``):
    tensor and expert tensor parallel sizes; every rank then holds TP shards
    (:mod:`.tensor_parallel`), rank vectors run over the ``tp * dp`` ranks of the stage and the
    expert data-parallel group is megatron's ``tp * dp / (ep * etp)`` ranks. ``muon_tp_mode``:
    megatron's Newton-Schulz mode for TP-sharded matrices (the factory's default
    ``duplicated``), for the work and TP gather bytes per owner. ``weight_format``: how the
    quantized weights are held with ``fp8_param_gather`` ("mxfp8"; "nvfp4": NVFP4 primary
    weights, counted by :func:`nvfp4_weight_bytes`). Returns a JSON-ready dict
    (docs/planner.md describes every field).
    """
    etp = tp if etp is None else etp
    if min(dp, ep, tp, etp) < 1 or (dp * tp) % (ep * etp):
        raise ValueError(
            f"need dp, ep, tp, etp >= 1 and ep dividing dp (ep * etp dividing tp * dp); "
            f"got dp={dp}, ep={ep}, tp={tp}, etp={etp}"
        )
    if muon_tp_mode not in MUON_TP_MODES:
        raise ValueError(f"muon_tp_mode must be one of {MUON_TP_MODES}, got {muon_tp_mode!r}")
    stage = StageRanks(dp, ep, tp, etp)
    nranks = stage.n
    if grad_dtype not in GRAD_BYTES:
        raise ValueError(f"grad_dtype must be one of {sorted(GRAD_BYTES)}, got {grad_dtype!r}")
    check_qkv_ownership(qkv_ownership)
    if grad_sync not in GRAD_SYNC_MODES:
        raise ValueError(f"grad_sync must be one of {GRAD_SYNC_MODES}, got {grad_sync!r}")
    owner_reduce = grad_sync == "reduce_to_owner"
    name = model if isinstance(model, str) else "custom"
    all_specs = param_shapes(model) if isinstance(model, str) else list(model)
    edp = stage.edp
    if bucket_size is None and overlap_grad_reduce:
        bucket_size = max(40_000_000, 1_000_000 * dp)
    if not overlap_grad_reduce:
        bucket_size = None
    g = GRAD_BYTES[grad_dtype]
    specs = local_specs(all_specs, ep, tp, etp)

    def world(buf: Buffer) -> int:
        return edp if buf.expert else dp

    # -------------------------------------------------------------- layer-wise (a) and (b)
    buffers = buffers_of(specs, fp8_param_gather, layer_wise=True, weight_format=weight_format)
    own = our_owners(
        specs, dp, ep, grouped_weight_ownership, qkv_ownership,
        ranks=stage, muon_tp_mode=muon_tp_mode,
    )  # fmt: skip

    def our_pieces(buf: Buffer, p: int) -> list[tuple[int, int]]:
        """``(elements, owner)`` of each piece of parameter ``p`` of a Muon buffer (owners in
        the buffer's group: data-parallel or expert-data-parallel ranks)."""
        table = own.expert if buf.expert else own.dense
        return [
            (numel, owner) for owner, numel in own.pieces(table, buf.indices[p], buf.specs[p].numel)
        ]

    def our_rank_numel(buf: Buffer) -> list[int]:
        """Elements each global rank updates in a Muon buffer under our ownership."""
        loads = [0] * world(buf)
        for p in range(len(buf.specs)):
            for numel, owner in our_pieces(buf, p):
                loads[owner] += numel
        return rank_view(loads, buf.expert, stage)

    stock, compact = Acc(nranks), Acc(nranks)
    stock_ns, stock_flops, stock_tp_comm = [0] * nranks, [0] * nranks, [0] * nranks
    # per process group (expert or not): (buffer, stock layout, compact layout)
    per_group: dict[bool, list[tuple[Buffer, lo.StockLayout, lo.StockLayout]]] = {
        False: [],
        True: [],
    }

    for buf in buffers:
        w = world(buf)
        if buf.muon:
            padded = lo.stock_padded_layout(buf.shapes, w, bucket_size)
            flat = (
                owner_reduce_layout([s.numel for s in buf.specs], bucket_size, w, bucket_cap_numel)
                if owner_reduce
                else lo.default_buckets(buf.shapes, bucket_size)
            )
            stock_rank = rank_view(padded.rank_numel or [], buf.expert, stage)
            compact_rank = our_rank_numel(buf)
            state_bytes = MUON_STATE_BYTES
            costs = stock_costs(buf.specs, padded, w, qkv_ownership)
            work = stock_tp_work(buf.specs, padded, w, qkv_ownership, muon_tp_mode)
            for totals, values in zip(
                (stock_ns, stock_flops, stock_tp_comm), (costs, *work), strict=True
            ):
                for r, value in enumerate(rank_view(values, buf.expert, stage)):
                    totals[r] += value
        else:
            padded = flat = lo.stock_distopt_layout(buf.shapes, w, bucket_size)
            stock_rank = compact_rank = rank_view(padded.rank_numel or [], buf.expert, stage)
            state_bytes = ADAM_STATE_BYTES
        per_group[buf.expert].append((buf, padded, flat))
        for acc, layout, rank_numel in ((stock, padded, stock_rank), (compact, flat, compact_rank)):
            padding = acc.add_buffer(buf, layout, w, g)
            if buf.muon:
                acc.muon_padding_numel += padding
            for r, n in enumerate(rank_numel):
                acc.mem["masters"][r] += n * MASTER_BYTES
                acc.mem["optimizer_states"][r] += n * state_bytes
            # compact Muon buckets all-reduce (no shards) or reduce to their owners (counted
            # per bucket group below); the other layouts reduce-scatter
            all_reduce = acc is compact and buf.muon
            for start, end, _ in layout.buckets:
                if all_reduce and owner_reduce:
                    acc.grad["buffer_bytes"] += (end - start) * g if w > 1 else 0
                else:
                    acc.add_grad(w, (end - start) * g, all_reduce)
            if acc is stock or not buf.muon:  # compact Muon gathers are planned below
                for start, end, unpadded in layout.buckets:
                    acc.add_gather(
                        w, (end - start) * PARAM_BYTES, (end - start - unpadded) * PARAM_BYTES
                    )

    # collectives per bucket group (megatron's partition_buckets), per process group
    transient_peak = transient_extra = transient_padding = 0
    owner_sent = [0] * nranks  # elements each rank of the stage sends in the owner reduce
    for expert, members in per_group.items():
        w = edp if expert else dp
        if w <= 1 or not members:
            continue
        for acc, which in ((stock, 1), (compact, 2)):
            groups = bucket_groups([(m[0].fp8, len(m[which].buckets)) for m in members])
            acc.grad["collectives"] += len(groups)
            acc.gather["adam_collectives"] += sum(
                any(not members[i][0].muon for i, _ in grp) for grp in groups
            )
            if acc is stock:
                acc.gather["muon_collectives"] += sum(
                    any(members[i][0].muon for i, _ in grp) for grp in groups
                )
                continue
            # compact: the Muon buckets of each bucket group form one gather unit (every
            # expert-data-parallel group owns the same shapes the same way).
            units: list[tuple[list[int], list[int]]] = []
            unit_grad_bytes: list[int] = []
            # the owner reduce exactly per group: expert-data-parallel groups own differently
            tables = (
                list(zip(own.expert_groups, own.expert_ranks, strict=True))
                if expert
                else [(own.dense, group) for group in stage.dense_groups()]
            )
            for grp in reversed(groups):  # forward order, as the gathers are issued
                sizes: list[int] = []
                unit_owners: list[int] = []
                buckets: list[list[tuple[int, int]]] = []
                for i, b in grp:
                    buf, _, flat = members[i]
                    if not buf.muon:
                        continue
                    buckets.append(
                        [(buf.indices[p], buf.specs[p].numel) for p in flat.bucket_params[b]]
                    )
                    for p in flat.bucket_params[b]:
                        for numel, owner in our_pieces(buf, p):
                            sizes.append(numel)
                            unit_owners.append(owner)
                if sizes:
                    units.append((sizes, unit_owners))
                    unit_grad_bytes.append(sum(sizes) * g)
                for table, ranks in tables if owner_reduce and buckets else ():
                    spans = [sp for bucket in buckets for sp in bucket_spans(bucket, table, own)]
                    for member, sent in enumerate(sent_by_member(spans, w)):
                        owner_sent[ranks[member]] += sent
            # As the compact patch does it: one gather per bucket group, even when its
            # transient padding is within the tolerance, else uneven (real bytes only).
            stats = {"collectives": len(units), "output": 0, "wire": 0, "padding": 0}
            for (sizes, unit_owners), grad_region in zip(units, unit_grad_bytes, strict=True):
                segments = lo.rank_loads(sizes, unit_owners, w)
                if lo.even_gather_fits(segments, gather_padding_tolerance):
                    gplan = lo.pack_for_even_all_gather(sizes, unit_owners, w)
                    nbytes = gplan.gather_numel * PARAM_BYTES
                    stats["padding"] += gplan.transient_padding
                else:
                    nbytes = sum(sizes) * PARAM_BYTES
                stats["output"] += nbytes
                stats["wire"] += ring(w, nbytes)
                transient_peak = max(transient_peak, nbytes)
                transient_extra = max(transient_extra, nbytes - grad_region)
            acc.gather["muon_collectives"] += stats["collectives"]
            acc.gather["output_bytes"] += stats["output"]
            acc.gather["wire_bytes_per_rank"] += stats["wire"]
            acc.gather["padding_bytes"] += stats["padding"] * PARAM_BYTES
            transient_padding += stats["padding"]
    for acc in (stock, compact):
        acc.gather["collectives"] = acc.gather["muon_collectives"] + acc.gather["adam_collectives"]
    if any(owner_sent):  # the worst rank's owner-reduce bytes on top of everyone's others
        compact.grad["wire_bytes_per_rank"] += max(owner_sent) * g
        compact.grad["ops"].add("reduce_to_owner")

    # legacy uneven gather: untagged unpadded buffers, one broadcast per rank per bucket
    legacy = {"collectives": 0, "output_bytes": 0}
    for buf in buffers_of(specs, fp8_param_gather, layer_wise=False, weight_format=weight_format):
        w = world(buf)
        if w <= 1:
            continue
        flat_legacy = lo.default_buckets(buf.shapes, bucket_size)
        legacy["collectives"] += w * len(flat_legacy.buckets)
        legacy["output_bytes"] += flat_legacy.numel * PARAM_BYTES

    # -------------------------------------------------------------- (c) Adam everywhere
    adam_acc = Acc(nranks)
    adam_entries: dict[bool, list[tuple[bool, int]]] = {False: [], True: []}
    for buf in buffers_of(specs, fp8_param_gather, layer_wise=False, weight_format=weight_format):
        w = world(buf)
        layout = lo.stock_distopt_layout(buf.shapes, w, bucket_size)
        adam_acc.add_buffer(buf, layout, w, g)
        per_rank = rank_view(layout.rank_numel, buf.expert, stage)
        for r in range(nranks):
            adam_acc.mem["masters"][r] += per_rank[r] * MASTER_BYTES
            adam_acc.mem["optimizer_states"][r] += per_rank[r] * ADAM_STATE_BYTES
        for start, end, _ in layout.buckets:
            adam_acc.add_gather(w, (end - start) * PARAM_BYTES)
            adam_acc.add_grad(w, (end - start) * g, all_reduce=False)
        adam_entries[buf.expert].append((buf.fp8, len(layout.buckets)))
    for expert, entries in adam_entries.items():
        w = edp if expert else dp
        if w > 1 and entries:
            n = len(bucket_groups(entries))
            adam_acc.grad["collectives"] += n
            adam_acc.gather["adam_collectives"] += n
            adam_acc.gather["collectives"] += n

    layouts = {
        "stock_padded": stock.report(
            "megatron-core 0.19.2 padded layer-wise layout (Muon) + DistributedOptimizer (Adam)",
            stock_ns,
            work=(stock_flops, stock_tp_comm),
        ),
        "compact": compact.report(
            "compact Muon buffers, cost-balanced ownership, one even gather per gather group",
            own.cost,
            {
                "transient_gather": {
                    "padding_numel": transient_padding,
                    "peak_bytes": transient_peak,
                    "extra_bytes": max(0, transient_extra),
                    "gather_padding_tolerance": gather_padding_tolerance,
                }
            },
            work=(own.flops, own.tp_comm),
        ),
        "adam_distopt": adam_acc.report("Adam on every parameter via DistributedOptimizer", None),
    }
    stock_total = layouts["stock_padded"]["bytes_per_rank"]["total"]
    compact_total = layouts["compact"]["bytes_per_rank"]["total"]
    muon_local = sum(s.numel for s in specs if s.muon)
    return {
        "model": name,
        "dp": dp,
        "ep": ep,
        "expert_dp": edp,
        "tp": tp,
        "etp": etp,
        "stage_ranks": nranks,
        "muon_tp_mode": muon_tp_mode,
        "bucket_size": bucket_size,
        "fp8_param_gather": fp8_param_gather,
        "weight_format": weight_format,
        # what the quantized weights' param gather moves: their own format, or bf16
        "param_gather": weight_format if fp8_param_gather else "bf16",
        "grad_dtype": grad_dtype,
        "grouped_weight_ownership": grouped_weight_ownership,
        "qkv_ownership": qkv_ownership,
        "grad_sync": grad_sync,
        "bucket_cap_numel": bucket_cap_numel,
        "params": {
            "total": sum(s.numel for s in all_specs),
            "trainable": sum(s.numel for s in all_specs if s.trainable),
            "per_rank": sum(s.numel for s in specs),
            "muon_per_rank": muon_local,
            "adam_per_rank": sum(s.numel for s in specs) - muon_local,
        },
        "layouts": layouts,
        "stock_legacy_param_gather": legacy,
        # Per rank (its dense matrices and its EP rank's experts), one gather of each per step.
        "muon_gather_wire": muon_gather_wire(specs),
        "summary": {
            "compact_over_stock_bytes": compact_total / stock_total if stock_total else 1.0,
            "bytes_saved_per_rank": stock_total - compact_total,
            "stock_padding_bytes": layouts["stock_padded"]["padding_bytes"],
            "newton_schulz_max_over_mean": {
                "stock_padded": layouts["stock_padded"]["newton_schulz"]["max_over_mean"],
                "compact": layouts["compact"]["newton_schulz"]["max_over_mean"],
            },
            "param_gather_collectives": {
                "stock_legacy": legacy["collectives"],
                "stock_padded": layouts["stock_padded"]["param_gather"]["collectives"],
                "compact": layouts["compact"]["param_gather"]["collectives"],
                "adam_distopt": layouts["adam_distopt"]["param_gather"]["collectives"],
            },
        },
        "assumptions": list(ASSUMPTIONS),
    }
