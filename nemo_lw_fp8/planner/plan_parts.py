"""The planner's building blocks: one rank's DDP buffers, megatron's bucket groups, ring bytes
and the per-rank accumulator of one layout (:func:`.planner.plan`, :mod:`.traffic`).

Split out of :mod:`.planner` so that module stays the plan itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from nemo_lw_fp8.layout import packing as lo
from nemo_lw_fp8.planner.shapes import ParamSpec
from nemo_lw_fp8.planner.tensor_parallel import StageRanks, tp_shard
from nemo_lw_fp8.planner.weight_bytes import PARAM_BYTES, mxfp8_weight_bytes, nvfp4_weight_bytes

MASTER_BYTES = 4  # fp32 master weights
MUON_STATE_BYTES = 4  # Muon momentum, fp32
ADAM_STATE_BYTES = 8  # Adam exp_avg + exp_avg_sq, fp32
GRAD_BYTES = {"fp32": 4, "bf16": 2}
MEMORY_FIELDS = ("params", "grads", "masters", "optimizer_states")


@dataclass
class Buffer:
    """One DDP buffer of one rank: megatron's BufferKey without the (common) grad dtype."""

    name: str
    muon: bool
    expert: bool
    fp8: bool
    specs: list[ParamSpec]  # model-definition (forward) order
    indices: list[int]  # position of each spec in the rank's parameter list
    #: The persistent format of the quantized weights of an ``fp8`` buffer: "mxfp8" or "nvfp4"
    #: (NVFP4 primary weights, ``fp4_param``).
    weight_format: str = "mxfp8"

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.specs)

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [s.shape for s in self.specs]


def buffers_of(
    specs: list[ParamSpec], fp8: bool, layer_wise: bool, weight_format: str = "mxfp8"
) -> list[Buffer]:
    """Split a rank's trainable parameters by buffer key, as ``group_params_for_buffers`` does
    (quantized storage, expert-parallel, layer-wise tag), keeping first-seen key order;
    ``weight_format``: how the quantized weights are held ("mxfp8" or "nvfp4")."""
    groups: dict[tuple[bool, bool, bool], list[int]] = {}
    for i, s in enumerate(specs):
        key = (layer_wise and s.muon, s.expert_parallel, fp8 and s.quantized)
        groups.setdefault(key, []).append(i)
    buffers = []
    for (muon, expert, is_fp8), members in groups.items():
        name = "/".join(
            (
                "muon" if muon else "adam",
                "expert" if expert else "dense",
                "mxfp8" if is_fp8 else "bf16",
            )
        )
        buffers.append(
            Buffer(
                name, muon, expert, is_fp8, [specs[i] for i in members], members, weight_format
            )
        )
    return buffers


def bucket_groups(bucket_counts: list[tuple[bool, int]]) -> list[list[tuple[int, int]]]:
    """megatron's ``partition_buckets`` for the buffers of one process group.

    ``bucket_counts``: ``(is_fp8_buffer, number of buckets)`` per buffer, in buffer order.
    Returns the bucket groups as lists of ``(buffer index, bucket index)``, in megatron's order
    (backprop order: the last group holds the first layers). Without an FP8 buffer each bucket is
    its own group; with one, each FP8 bucket is a group and every other bucket joins the last
    FP8 group (``reduce_scatter_with_fp32_accumulation`` off).
    """
    fp8 = [i for i, (is_fp8, _) in enumerate(bucket_counts) if is_fp8]
    if not fp8:
        return [[(i, b)] for i, (_, n) in enumerate(bucket_counts) for b in range(n)]
    assert len(fp8) == 1, "megatron allows one FP8 buffer per process group"
    groups = [[(fp8[0], b)] for b in range(bucket_counts[fp8[0]][1])]
    others = [(i, b) for i, (is_fp8, n) in enumerate(bucket_counts) if not is_fp8 for b in range(n)]
    if groups:
        groups[-1].extend(others)
    elif others:
        groups.append(others)
    return groups


def ring(world: int, nbytes: int, all_reduce: bool = False) -> int:
    """Bytes one rank receives in a ring collective over ``nbytes`` of buffer."""
    if world <= 1:
        return 0
    return (2 if all_reduce else 1) * nbytes * (world - 1) // world


class Acc:
    """Per-rank memory and per-step communication of one layout."""

    def __init__(self, dp: int) -> None:
        self.mem = {f: [0] * dp for f in MEMORY_FIELDS}
        self.padding_numel = 0
        self.muon_padding_numel = 0
        self.padding_bytes = 0
        self.buffers: list[dict[str, Any]] = []
        self.gather = {
            "collectives": 0,
            "muon_collectives": 0,
            "adam_collectives": 0,
            "output_bytes": 0,
            "wire_bytes_per_rank": 0,
            "padding_bytes": 0,
        }
        self.grad = {"collectives": 0, "buffer_bytes": 0, "wire_bytes_per_rank": 0, "ops": set()}

    def add_buffer(self, buf: Buffer, layout: Any, world: int, grad_bytes: int) -> int:
        """Count one buffer laid out as ``layout`` over ``world`` ranks: its padding, its row in
        the buffer table, its params and grads on every rank. Returns the padding (elements)."""
        padding = layout.numel - buf.numel
        self.padding_numel += padding
        self.padding_bytes += padding * (grad_bytes + (0 if buf.fp8 else PARAM_BYTES))
        self.buffers.append(
            {
                "name": buf.name,
                "world": world,
                "params": len(buf.specs),
                "numel": layout.numel,
                "padding_numel": padding,
                "buckets": len(layout.buckets),
            }
        )
        self.add_all("params", param_bytes(buf, layout.numel))
        self.add_all("grads", layout.numel * grad_bytes)
        return padding

    def add_all(self, field: str, nbytes: int) -> None:
        for r in range(len(self.mem[field])):
            self.mem[field][r] += nbytes

    def add_gather(self, world: int, nbytes: int, padding: int = 0) -> None:
        if world > 1:
            self.gather["output_bytes"] += nbytes
            self.gather["wire_bytes_per_rank"] += ring(world, nbytes)
            self.gather["padding_bytes"] += padding

    def add_grad(self, world: int, nbytes: int, all_reduce: bool) -> None:
        if world > 1:
            self.grad["buffer_bytes"] += nbytes
            self.grad["wire_bytes_per_rank"] += ring(world, nbytes, all_reduce)
            self.grad["ops"].add("all_reduce" if all_reduce else "reduce_scatter")

    def report(
        self,
        description: str,
        ns: list[int] | None,
        extra: dict | None = None,
        work: tuple[list[int], list[int]] | None = None,
    ) -> dict:
        """The layout's JSON entry; ``work``: per rank the Newton-Schulz work under
        ``muon_tp_mode`` and the bytes its Newton-Schulz receives over TP."""
        dp = len(self.mem["params"])
        totals = [sum(self.mem[f][r] for f in MEMORY_FIELDS) for r in range(dp)]
        worst = max(range(dp), key=lambda r: (totals[r], -r))
        per_rank = {f: self.mem[f][worst] for f in MEMORY_FIELDS}
        per_rank["total"] = totals[worst]
        mean = {f: sum(self.mem[f]) / dp for f in MEMORY_FIELDS}
        mean["total"] = sum(totals) / dp
        grad = dict(self.grad)
        grad["op"] = "+".join(sorted(grad.pop("ops"))) or "none"
        out = {
            "description": description,
            "bytes_per_rank": per_rank,
            "worst_rank": worst,
            "bytes_by_rank": {f: list(self.mem[f]) for f in MEMORY_FIELDS},
            "bytes_per_rank_mean": mean,
            "padding_numel": self.padding_numel,
            "muon_padding_numel": self.muon_padding_numel,
            "padding_bytes": self.padding_bytes,
            "buffers": self.buffers,
            "newton_schulz": None,
            "param_gather": dict(self.gather),
            "grad_sync": grad,
        }
        if ns is not None:
            mean_ns = sum(ns) / dp
            out["newton_schulz"] = {
                "by_rank": list(ns),
                "max": max(ns),
                "mean": mean_ns,
                "max_over_mean": lo.imbalance(ns),
            }
        if ns is not None and work is not None:
            flops, gathers = work
            out["newton_schulz"] |= {
                "tp_mode_by_rank": list(flops),
                "tp_mode_max": max(flops),
                "tp_mode_max_over_mean": lo.imbalance(flops),
            }
            out["muon_tp_comm"] = {
                "bytes_by_rank": list(gathers),
                "bytes_per_rank": max(gathers),
            }
        if extra:
            out.update(extra)
        return out


def local_specs(
    specs: Sequence[ParamSpec], ep: int, tp: int = 1, etp: int | None = None
) -> list[ParamSpec]:
    """One rank's trainable parameters: its TP shard (ETP for routed experts,
    :func:`.tensor_parallel.tp_shard`) of its expert-parallel rank's share. At EP 1 with ETP =
    TP megatron builds experts with the dense process groups (``allreduce`` stays True, the
    linears' ``use_expert_pgs`` is off), so they share the dense buffers and ownership group;
    ETP != TP switches the expert groups on even at EP 1."""
    etp = tp if etp is None else etp
    expert_pgs = ep > 1 or etp != tp
    local = []
    for s in specs:
        if not s.trainable:
            continue
        view = tp_shard(s, tp, etp).local(ep)
        if view is not None:
            local.append(view if expert_pgs else replace(view, expert_parallel=False))
    return local


def rank_view(values: list[int], expert: bool, ranks: StageRanks) -> list[int]:
    """A group-local per-member vector as a vector over the stage's ranks."""
    return ranks.view(values, expert)


def param_bytes(buf: Buffer, numel: int) -> int:
    """Persistent parameter bytes of a buffer on every rank: MXFP8 weights (their bf16 param
    buffer aliases the gradient buffer) or NVFP4 weights (TE's ``NVFP4Tensor``, both usages),
    or a bf16 buffer of ``numel`` elements."""
    if buf.fp8:
        weight_bytes = nvfp4_weight_bytes if buf.weight_format == "nvfp4" else mxfp8_weight_bytes
        return sum(weight_bytes(s.shape) for s in buf.specs)
    return numel * PARAM_BYTES
