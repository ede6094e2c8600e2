"""The planner's per-rank numbers against what megatron really allocates, on 4 CPU gloo ranks.

For tiny MoE GPTs (megatron's Transformer Engine spec, TE's own modules over the emulated
extension) at PP 2 x DP 2 and EP 2 x DP 2 (and single grouped expert weights owned in
runs of experts), each rank builds its part of the model, wraps it in megatron DDP and builds
the layer-wise optimizer (padded and compact layouts); the planner, given the whole model's
parameter list (read from the same model built at PP = EP = 1), cuts the rank's share
(:func:`nemo_lw_fp8.planner.pipeline.specs_on_rank`, :meth:`ParamSpec.local`) and must predict,
rank by rank: every DDP buffer (elements including padding, buckets, parameters), the fp32
master and optimizer-state bytes, and the Newton-Schulz work.
"""

from __future__ import annotations

import re

import pytest

from nemo_lw_fp8.cpu.te import backend as te_backend
from tests.support.harness import BootOptions, ParallelSpec, run_on_ranks
from tests.support.scenarios import TE_BOOT, Scenario

LAYOUTS = {"layerwise_padded": "stock_padded", "layerwise_compact": "compact"}
MOE = Scenario(optimizer="muon", model="moe_gpt", plugin=True)
needs_te = pytest.mark.skipif(
    te_backend.te_package_dirs() is None, reason="grouped experts need TE's Python package"
)


# --------------------------------------------------------------------------- on the ranks


def model_params(scenario: Scenario) -> list[dict]:
    """The whole model's parameters in registration order, as the planner describes them."""
    from tests.support.scenarios import build_model

    module, config = build_model(scenario)  # applies the plugin's routing of grouped weights
    from megatron.core.optimizer.emerging_optimizers import _get_qkv_split_shapes
    from megatron.core.optimizer.layer_wise_optimizer import is_managed_by_layer_wise_optimizer

    # What megatron's Muon tags a fused QKV weight with (``is_qkv``, ``qkv_split_shapes``).
    split = tuple(_get_qkv_split_shapes(config))
    rows = []
    for name, param in module.named_parameters():
        # Routed experts by name: megatron marks them (allreduce=False) only at EP > 1.
        expert = ".mlp.experts." in name
        index = re.search(r"local_experts\.(\d+)\.", name)
        rows.append(
            {
                "name": name,
                "shape": tuple(param.shape),
                "muon": bool(is_managed_by_layer_wise_optimizer(param)),
                "expert_parallel": expert,
                "embedding_or_output": bool(
                    getattr(param, "is_embedding_or_output_parameter", False)
                ),
                "expert_index": int(index.group(1)) if index else None,
                "num_experts": config.num_moe_experts if expert else 0,
                "qkv_split": split
                if name.endswith("linear_qkv.weight") and param.shape[0] % sum(split) == 0
                else None,
            }
        )
    return rows


def allocation(scenario: Scenario) -> dict:
    """What megatron allocated on this rank: DDP buffers, fp32 masters, Newton-Schulz work."""
    from megatron.core import parallel_state

    from nemo_lw_fp8.layout import packing as layout
    from nemo_lw_fp8.mechanics import qkv_parts
    from nemo_lw_fp8.mechanics.compact import newton_schulz_cost
    from nemo_lw_fp8.mechanics.expert_slices import is_slice
    from tests.support.scenarios import build_model
    from tests.support.training import wrap_and_build_optimizer

    module, config = build_model(scenario)
    model, optimizer = wrap_and_build_optimizer(module, config, scenario)
    chunk = model[0]
    buffers = {}
    for expert, group in ((False, chunk.buffers), (True, chunk.expert_parallel_buffers)):
        for buffer in group:
            muon = bool(getattr(buffer.params[0], "is_managed_by_layer_wise_optimizer", False))
            key = f"{'muon' if muon else 'adam'}/{'expert' if expert else 'dense'}/bf16"
            assert key not in buffers, key
            buffers[key] = (buffer.grad_data.numel(), len(buffer.buckets), len(buffer.params))
    counts = {"muon": 0, "adam": 0, "newton_schulz": 0, "expert_runs": 0}

    def walk(opt) -> None:
        for child in getattr(opt, "chained_optimizers", []):
            walk(child)
        if hasattr(opt, "shard_fp32_from_float16_groups"):  # the Adam DistributedOptimizer
            counts["adam"] += sum(m.numel() for g in opt.shard_fp32_from_float16_groups for m in g)
        elif hasattr(opt, "fp32_from_float16_groups"):  # layer-wise Muon: owned matrices
            pairs = zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True)
            for model_group, main_group in pairs:
                for param, main in zip(model_group, main_group, strict=True):
                    counts["muon"] += main.numel()
                    # Muon orthogonalizes a fused QKV weight as its parts (muon_split_qkv).
                    if qkv_parts.split_shapes(param) is None:
                        counts["newton_schulz"] += newton_schulz_cost(param)
                    else:
                        shapes = qkv_parts.part_shapes(param)
                        counts["newton_schulz"] += sum(layout.newton_schulz_cost(s) for s in shapes)
                    counts["expert_runs"] += is_slice(param)

    walk(optimizer)
    return {
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "expert_dp": parallel_state.get_expert_data_parallel_world_size(),
        "buffers": buffers,
        **counts,
    }


# --------------------------------------------------------------------------- in the test


def _specs(rows: list[dict]):
    from nemo_lw_fp8.planner import ParamSpec

    return [ParamSpec(**row) for row in rows]


def _assert_planned(rank: int, real: dict, planned: dict, ranks_per_stage: int) -> None:
    """One rank's allocation against the planner's layout (``planned``) for its stage, whose
    rank vectors run over the stage's ranks (the data-parallel ranks at TP 1)."""
    dp_rank = rank % ranks_per_stage  # megatron's order tp-cp-ep-dp-pp: the stage's rank
    ours = {b["name"]: (b["numel"], b["buckets"], b["params"]) for b in planned["buffers"]}
    assert real["buffers"] == ours, (rank, real["buffers"], ours)
    by_rank = planned["bytes_by_rank"]
    masters = 4 * (real["muon"] + real["adam"])
    states = 4 * real["muon"] + 8 * real["adam"]
    assert by_rank["masters"][dp_rank] == masters, (rank, by_rank["masters"], real)
    assert by_rank["optimizer_states"][dp_rank] == states, (rank, by_rank, real)
    ns = planned["newton_schulz"]["by_rank"][dp_rank]
    assert ns == real["newton_schulz"], (rank, planned["newton_schulz"], real)


#: (scenario, whole, parallel, boot) -> (the whole model's specs, {distribution: allocations}):
#: the rank runs of a test, kept for its control (same session, same pools).
_RUNS: dict[str, tuple[list, dict[str, list[dict]]]] = {}


def _runs(
    scenario: Scenario, whole: Scenario, parallel: ParallelSpec, boot: BootOptions
) -> tuple[list, dict[str, list[dict]]]:
    """The whole model's parameter list and every rank's allocation in both layouts."""
    key = repr((scenario, whole, parallel, boot))
    if key not in _RUNS:
        specs = _specs(run_on_ranks(model_params, whole, world_size=4, boot=boot)[0])
        reals = {
            distribution: run_on_ranks(
                allocation,
                scenario.with_(distribution=distribution),
                world_size=4,
                parallel=parallel,
                boot=boot,
            )
            for distribution in LAYOUTS
        }
        _RUNS[key] = (specs, reals)
    return _RUNS[key]


def _plans(
    specs: list, scenario: Scenario, parallel: ParallelSpec, layout: str, **settings: object
) -> list[dict]:
    """The planner's ``layout`` for every pipeline stage, from the whole model."""
    from nemo_lw_fp8.planner import plan
    from nemo_lw_fp8.planner.pipeline import specs_on_rank

    pp, ep, tp = parallel.pp, parallel.ep, parallel.tp
    etp = tp if parallel.etp is None else parallel.etp
    dp = 4 // (pp * tp)
    # Megatron's default split: layers evenly over the stages, embedding first, loss last.
    layers = max(int(s.name.split(".")[2]) for s in specs if s.name.startswith("decoder.l")) + 1
    per = layers // pp
    stages = [(["E"] if s == 0 else []) + ["t"] * per for s in range(pp)]
    stages[-1].append("L")
    options: dict = dict(
        fp8_param_gather=False,
        overlap_grad_reduce=False,
        grouped_weight_ownership=scenario.grouped_weight_ownership,
    )
    options.update(settings)
    return [
        plan(specs_on_rank(specs, stages, pp, stage), dp, ep, tp=tp, etp=etp, **options)[
            "layouts"
        ][layout]
        for stage in range(pp)
    ]


def _compare(
    scenario: Scenario, whole: Scenario, parallel: ParallelSpec, boot: BootOptions = TE_BOOT
) -> list[dict]:
    """Plan every stage from the whole model and compare it with every rank, both layouts;
    returns the compact layout's allocations."""
    specs, runs = _runs(scenario, whole, parallel, boot)
    for distribution, key in LAYOUTS.items():
        plans = _plans(specs, scenario, parallel, key)
        for rank, real in enumerate(runs[distribution]):
            assert real["stage"] == rank // (4 // parallel.pp)
            _assert_planned(rank, real, plans[real["stage"]], 4 // parallel.pp)
    return runs["layerwise_compact"]


def _failing_ranks(reals: list[dict], plans: list[dict], ranks_per_stage: int) -> list[int]:
    """The ranks whose allocation the comparison of the test rejects against ``plans``."""
    failing = []
    for rank, real in enumerate(reals):
        try:
            _assert_planned(rank, real, plans[real["stage"]], ranks_per_stage)
        except AssertionError:
            failing.append(rank)
    return failing


def test_planner_equals_megatron_at_pp2():
    """PP 2 x DP 2: stage 0 holds the embedding and layer 0, stage 1 layer 1, the final norm
    and the output layer; each stage's two data-parallel ranks split its Muon matrices."""
    _compare(MOE, MOE, ParallelSpec(pp=2))


def test_planner_equals_megatron_at_ep2():
    """EP 2 x DP 2: each rank holds 2 of the 4 experts of each MoE layer, owned over an
    expert-data-parallel group of 2 while dense matrices are owned over all 4 ranks."""
    _compare(MOE.with_(ep=2), MOE, ParallelSpec(ep=2))


def test_planner_equals_megatron_at_tp2():
    """TP 2 x DP 2 (ETP = TP, megatron's default, EP 1: the experts in the dense buffers): each
    rank holds its TP shard of every matrix (the router and norms whole) and its DP group of 2
    owns the shards of its TP rank; the Newton-Schulz work compared is the local shards', what
    ownership balances (the work under muon_tp_mode: test_planner_tp.py)."""
    _compare(MOE, MOE, ParallelSpec(tp=2))


def test_planner_equals_megatron_at_tp2_etp1():
    """TP 2, ETP 1, EP 1 on 4 ranks: megatron's expert data-parallel group is world / (EP x
    ETP) = 4 ranks, twice the dense DP group (dp / ep said 2): experts are whole on every rank,
    in expert buffers owned over all 4 ranks, dense matrices as TP shards over DP 2."""
    parallel = ParallelSpec(tp=2, etp=1)
    reals = _compare(MOE, MOE, parallel)
    assert all(real["expert_dp"] == 4 for real in reals)
    # control: the same ranks against a planner told ETP = TP (experts TP-sharded in the dense
    # buffers, as at ETP 2) fail on every rank
    specs, runs = _runs(MOE, MOE, parallel, TE_BOOT)
    for distribution, key in LAYOUTS.items():
        wrong = _plans(specs, MOE, ParallelSpec(tp=2, etp=2), key)
        assert _failing_ranks(runs[distribution], wrong, 4) == [0, 1, 2, 3], distribution


@pytest.mark.parametrize("wrong", ["padding", "bucket_size"])
def test_control_planner_told_a_wrong_setting_differs(wrong: str) -> None:
    """Control of ``test_planner_equals_megatron_at_pp2`` (the comparison the EP 2 and
    grouped-expert tests share): the same rank allocations (the test's own runs when it ran
    first in this session) against a planner told a wrong setting fail that comparison on
    every rank: ``padding``, the padded layout's plan where megatron laid out compact buffers
    and the other way round; ``bucket_size``, buckets of 1000 elements where megatron made one
    bucket per buffer (no overlapped grad reduce)."""
    parallel = ParallelSpec(pp=2)
    specs, runs = _runs(MOE, MOE, parallel, TE_BOOT)
    other = {"stock_padded": "compact", "compact": "stock_padded"}
    for distribution, key in LAYOUTS.items():
        if wrong == "padding":
            plans = _plans(specs, MOE, parallel, other[key])
        else:
            plans = _plans(specs, MOE, parallel, key, overlap_grad_reduce=True, bucket_size=1000)
        assert _failing_ranks(runs[distribution], plans, 2) == [0, 1, 2, 3], distribution


@needs_te
def test_planner_equals_megatron_for_grouped_expert_runs():
    """Single grouped expert weights ``(E, m, n)`` at EP 2 x DP 2, owned in runs of experts
    (``grouped_weight_ownership="expert"``: each grouped weight split over both ranks of its
    expert-data-parallel group) on the compact layout; the padded layout owns them whole."""
    grouped = MOE.with_(model="moe_grouped", single_grouped_weight=True)
    split = grouped.with_(ep=2, grouped_weight_ownership="expert")
    reals = _compare(split, grouped, ParallelSpec(ep=2), BootOptions(fp8_emulation=True))
    # Every rank owns runs of experts (each grouped weight is split over its group's 2 ranks).
    assert all(real["expert_runs"] > 0 for real in reals), reals
