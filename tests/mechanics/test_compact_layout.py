"""The compact layer-wise layout: bitwise parity, zero padding, homogeneous bucket groups,
deterministic cost-balanced ownership, and one param-gather collective per bucket group.

The parities' compact runs sync their Muon gradients by the layout's default, the owner reduce;
each of them is probed for what its ranks issued (``tests/support/owner_reduce_probe.py``:
reduces to the owners of the ownership table, no all-reduce of a Muon gradient, every element
reduced once per step), and the plain Muon and padded references for no reduce at all. At
data-parallel size 1 there is nothing to reduce (the ranks issue no reduce): that parity is not.
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_lw_fp8.cpu.te import backend as te_backend
from tests.support import owner_reduce_probe as probe
from tests.support.harness import BootOptions, run_on_ranks
from tests.support.parity import assert_diverges, assert_fp8_gather_parity
from tests.support.scenarios import Scenario, boot_for
from tests.support.training import train

FP8 = BootOptions(fp8_emulation=True)
COMPACT = Scenario(optimizer="muon", distribution="layerwise_compact", plugin=True)
needs_te = pytest.mark.skipif(
    te_backend.te_package_dirs() is None, reason="the MXFP8 emulation needs TE's Python package"
)


def _same(reference: list[dict], candidate: list[dict], label: str) -> None:
    for rank, (a, b) in enumerate(zip(reference, candidate, strict=True)):
        assert a["losses"] == b["losses"], f"{label}: rank {rank} losses"
        for name, value in a["params"].items():
            assert torch.equal(value, b["params"][name]), f"{label}: rank {rank} {name}"
    assert len({r["digest"] for r in candidate}) == 1


#: Plain Muon runs a parity test compared against, kept for the controls below (same session).
_REFERENCES: dict[str, list[dict]] = {}


def _reference(scenario: Scenario, world_size: int = 2) -> list[dict]:
    """``train(scenario)`` on ``world_size`` ranks, run once per session; probed, it issued no
    reduce (plain Muon: no compact bucket)."""
    key = repr((scenario, world_size))
    if key not in _REFERENCES:
        runs = run_on_ranks(
            probe.train_probed, scenario, world_size=world_size, boot=boot_for(scenario)
        )
        probe.assert_no_reduce(runs, f"reference {scenario}")
        _REFERENCES[key] = runs
    return _REFERENCES[key]


def _owner_reduced(scenario: Scenario, world_size: int = 2, boot: BootOptions | None = None):
    """``train(scenario)`` on ``world_size`` ranks, probed: its grad syncs were owner reduces."""
    boot = boot_for(scenario) if boot is None else boot
    runs = run_on_ranks(probe.train_probed, scenario, world_size=world_size, boot=boot)
    probe.assert_reduced_to_owners(runs, f"{scenario}")
    return runs


def train_with_receivers_skipping_the_last_owner(scenario: Scenario) -> dict:
    """Mutation: no rank writes the last data-parallel rank's gathered segment into its
    weights, so the matrices that rank owns stay at their old values everywhere else (the rank
    of the dense data-parallel group; with TP > 1 that group is smaller than the world)."""
    from megatron.core import parallel_state

    from nemo_lw_fp8.mechanics import owner_gather

    last = parallel_state.get_data_parallel_world_size() - 1
    original = owner_gather.ranks_to_unpack

    def skipping(plan: object, my_rank: int) -> list[int]:
        return [rank for rank in original(plan, my_rank) if rank != last]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(owner_gather, "ranks_to_unpack", skipping)
        return train(scenario)


@pytest.mark.parametrize("world_size", [2, 4])
def test_compact_equals_plain_muon(world_size):
    reference = _reference(Scenario(optimizer="muon"), world_size)
    for overlap in (False, True):
        # The default tolerance, and an always-even gather (segments padded to the longest).
        for tolerance in (None, math.inf):
            scenario = COMPACT.with_(overlap=overlap, gather_padding_tolerance=tolerance)
            compact = _owner_reduced(scenario, world_size)
            assert compact[0]["layer_wise"]
            _same(reference, compact, f"compact overlap={overlap} tolerance={tolerance}")


def test_compact_tiny_gpt_equals_plain_muon():
    gpt = Scenario(optimizer="muon", model="gpt", steps=3)
    reference = _reference(gpt)
    compact_gpt = COMPACT.with_(model="gpt", steps=3, overlap=True)
    compact = _owner_reduced(compact_gpt)
    _same(reference, compact, "compact gpt")


#: The controls' cases: the plain Muon reference a parity test used, and the compact run.
_CONTROLLED = {
    "mlp": (Scenario(optimizer="muon"), COMPACT),
    "gpt": (Scenario(optimizer="muon", model="gpt", steps=3),
            COMPACT.with_(model="gpt", steps=3, overlap=True)),
    "padded_buckets": (Scenario(optimizer="muon", bucket_size=2000),
                       COMPACT.with_(bucket_size=2000, overlap=True)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_CONTROLLED))
def test_control_compact_with_a_skipped_segment_differs_from_plain_muon(case: str) -> None:
    """Control of ``test_compact_equals_plain_muon`` (``mlp``, 2 ranks),
    ``test_compact_tiny_gpt_equals_plain_muon`` (``gpt``) and the training comparison of
    ``test_compact_gathers_no_more_often_than_padded_and_trains_the_same``
    (``padded_buckets``): the compact run whose receivers skip the last rank's gathered
    segment completes and fails the same comparison against the same plain Muon run (reused
    when its test ran first in this session)."""
    plain, compact = _CONTROLLED[case]
    reference = _reference(plain)
    mutated = run_on_ranks(
        train_with_receivers_skipping_the_last_owner, compact, world_size=2, boot=boot_for(compact)
    )
    assert_diverges(reference, mutated, compare=lambda a, b: _same(a, b, case))


@needs_te
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_compact_with_mxfp8_param_gather_on_equals_off(world_size, overlap):
    base = COMPACT.with_(model="fp8mlp", fp8=True, micro_batch=32, snapshots=True, overlap=overlap)
    off = _owner_reduced(base, world_size, boot=FP8)
    on = _owner_reduced(base.with_(fp8_param_gather=True), world_size, boot=FP8)
    assert_fp8_gather_parity(off, on)


def train_with_owner_skipping_itself(scenario: Scenario) -> dict:
    """Mutation: the owner does not take its own weights from the gathered bf16 bytes."""
    from nemo_lw_fp8.mechanics.compact import CompactGroup

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CompactGroup, "unpack_own", False)
        return train(scenario)


@needs_te
def test_owner_must_unpack_its_own_segment_for_mxfp8():
    base = COMPACT.with_(model="fp8mlp", fp8=True, micro_batch=32, snapshots=True)
    off = run_on_ranks(train, base, boot=FP8)
    on = run_on_ranks(train_with_owner_skipping_itself, base.with_(fp8_param_gather=True), boot=FP8)
    assert_diverges(off, on)


def train_with_stock_sharding(scenario: Scenario) -> dict:
    """Mutation: megatron's own ``shard_params`` at data-parallel size 1 (the compact layout
    used to hand it over there): no compact ownership, so no compact gather."""
    from nemo_lw_fp8.mechanics import compact

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compact, "shards", lambda ddp_config: False)
        return train(scenario)


@needs_te
def test_compact_mxfp8_param_gather_at_data_parallel_size_1():
    """One data-parallel rank (what PP 2 x VPP 2 on 2 ranks leaves): the compact gather still
    quantizes the masters into the MXFP8 weights; megatron's one-rank gather would not, and the
    weights would stay at their initial values (the control)."""
    base = COMPACT.with_(
        model="fp8mlp", fp8=True, micro_batch=32, snapshots=True, overlap=True, steps=3
    )
    off = run_on_ranks(train, base, world_size=1, boot=FP8)
    on = run_on_ranks(train, base.with_(fp8_param_gather=True), world_size=1, boot=FP8)
    assert_fp8_gather_parity(off, on)
    stock = run_on_ranks(
        train_with_stock_sharding, base.with_(fp8_param_gather=True), world_size=1, boot=FP8
    )
    assert_diverges(off, stock, match="losses")


# --------------------------------------------------------------------------- layout facts


def layout_facts(scenario: Scenario) -> dict:
    """Buffers, bucket groups and ownership as this rank built them."""
    from tests.support.scenarios import build_model
    from tests.support.training import wrap_and_build_optimizer

    module, config = build_model(scenario)
    model, optimizer = wrap_and_build_optimizer(module, config, scenario)
    chunk = model[0]
    names = {id(p): n for n, p in module.named_parameters()}
    buffers = [
        {
            "layer_wise": bool(getattr(b.params[0], "is_managed_by_layer_wise_optimizer", False)),
            "numel": b.numel,
            "numel_unpadded": b.numel_unpadded,
            "distopt": bool(b.ddp_config.use_distributed_optimizer),
        }
        for b in chunk.buffers + chunk.expert_parallel_buffers
    ]
    groups = [
        sorted(
            {
                bool(getattr(b.params_list[0], "is_managed_by_layer_wise_optimizer", False))
                for b in g.buckets
            }
        )
        for g in chunk.bucket_groups + chunk.expert_parallel_bucket_groups
    ]
    layer_wise = next(
        opt
        for opt in [optimizer, *getattr(optimizer, "chained_optimizers", [])]
        if hasattr(opt, "dp_cp_params_list")
    )
    owners = {
        names[id(p)]: rank for rank, ps in enumerate(layer_wise.dp_cp_params_list) for p in ps
    }
    return {"buffers": buffers, "groups": groups, "owners": owners}


@pytest.mark.parametrize("single_bucket_group", [False, True])
def test_zero_padding_and_homogeneous_groups(single_bucket_group):
    scenario = COMPACT.with_(single_bucket_group=single_bucket_group, bucket_size=2000)
    facts = run_on_ranks(layout_facts, scenario, world_size=4)
    buffers = facts[0]["buffers"]
    muon = [b for b in buffers if b["layer_wise"]]
    assert muon and all(b["numel"] == b["numel_unpadded"] for b in muon), muon
    assert all(not b["distopt"] for b in muon) and all(
        b["distopt"] for b in buffers if not b["layer_wise"]
    )
    assert all(len(kinds) == 1 for kinds in facts[0]["groups"]), facts[0]["groups"]
    # Ownership is the same on every rank and covers every Muon matrix once.
    assert all(f["owners"] == facts[0]["owners"] for f in facts)


def test_stock_padded_layout_pads():
    """Control: megatron's own padded layout does pad these buffers (the test above can fail)."""
    scenario = Scenario(optimizer="muon", distribution="layerwise_padded")
    buffers = run_on_ranks(layout_facts, scenario, world_size=4)[0]["buffers"]
    assert any(b["layer_wise"] and b["numel"] > b["numel_unpadded"] for b in buffers)


_OWNERS: list[dict[str, int]] = []


def _first_owners() -> dict[str, int]:
    """The owners of the test's first build (4 ranks), kept for the control."""
    if not _OWNERS:
        _OWNERS.append(run_on_ranks(layout_facts, COMPACT, world_size=4)[0]["owners"])
    return _OWNERS[0]


def _max_load_and_largest_cost(owners: dict[str, int]) -> tuple[int, int]:
    """The busiest rank's Newton-Schulz work under ``owners``, and the largest matrix's."""
    from nemo_lw_fp8.layout import packing as layout

    module_shapes = {
        "net.0.weight": (64, 32),
        "net.3.weight": (64, 64),
        "net.6.weight": (48, 64),
        "net.9.weight": (64, 48),
        "net.12.weight": (16, 64),
    }
    costs = [layout.newton_schulz_cost(module_shapes[n]) for n in sorted(owners)]
    loads = layout.rank_loads(costs, [owners[n] for n in sorted(owners)], 4)
    return max(loads), max(costs)


def test_ownership_is_cost_balanced_and_repeatable():
    first = _first_owners()
    again = run_on_ranks(layout_facts, COMPACT, world_size=4)[0]["owners"]
    assert first == again
    # With 5 matrices on 4 ranks the best possible max load is the largest matrix.
    busiest, largest = _max_load_and_largest_cost(first)
    assert busiest == largest


def layout_facts_with_unit_costs(scenario: Scenario) -> dict:
    """Mutation: ownership balanced by matrix count (every Newton-Schulz cost 1), not by cost."""
    from nemo_lw_fp8.mechanics import compact

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compact, "newton_schulz_cost", lambda param: 1)
        return layout_facts(scenario)


def test_control_ownership_by_count_is_not_cost_balanced() -> None:
    """Control of ``test_ownership_is_cost_balanced_and_repeatable``: owners chosen with every
    matrix costing the same (by count: the fifth matrix joins rank 0, which holds the largest)
    fail both of its checks: they are not the first build's owners, and the busiest rank does
    more than the largest matrix's work."""
    first = _first_owners()
    by_count = run_on_ranks(layout_facts_with_unit_costs, COMPACT, world_size=4)
    assert all(f["owners"] == by_count[0]["owners"] for f in by_count)  # still one answer
    assert by_count[0]["owners"] != first
    busiest, largest = _max_load_and_largest_cost(by_count[0]["owners"])
    assert busiest > largest


# --------------------------------------------------------------------------- collectives


def count_layer_wise_gathers(scenario: Scenario) -> dict:
    """Param-gather collectives of the layer-wise bucket groups during steps 1 and 2."""
    from tests.support.param_gathers import layer_wise_bucket_groups, train_recording_gathers

    # "launches": what NCCL runs; an all_gather of unequal sizes is one broadcast per rank.
    counts = {"calls": 0, "launches": 0, "uneven_all_gather_as_broadcasts": 0}

    def record(name: str, tensors: list) -> None:
        counts["calls"] += 1
        if name == "all_gather" and len({t.numel() for t in tensors}) > 1:
            counts["uneven_all_gather_as_broadcasts"] += len(tensors)
            counts["launches"] += len(tensors)
        else:
            counts["launches"] += 1

    def choose_groups(chunk) -> list:
        # On the legacy path the layer-wise optimizer owns every bucket.
        legacy = scenario.distribution == "layerwise_legacy"
        return list(chunk.bucket_groups) if legacy else layer_wise_bucket_groups(chunk)

    groups = train_recording_gathers(scenario, record, choose_groups)
    return {**counts, "groups": len(groups), "steps": 2}


@pytest.mark.parametrize("tolerance", [math.inf, 0.1], ids=["always-even", "default"])
def test_compact_issues_one_collective_per_bucket_group_per_step(tolerance):
    scenario = COMPACT.with_(
        bucket_size=2000, gather_padding_tolerance=tolerance, bucket_cap_numel=0
    )
    counts = run_on_ranks(count_layer_wise_gathers, scenario, world_size=4)[0]
    assert counts["groups"] >= 2
    assert counts["calls"] == counts["groups"] * counts["steps"], counts
    if math.isinf(tolerance):
        assert counts["launches"] == counts["calls"]
    # Stock 0.19.2's legacy layer-wise path: an uneven all_gather per bucket (NCCL runs it as
    # one broadcast per rank).
    legacy = run_on_ranks(
        count_layer_wise_gathers,
        Scenario(optimizer="muon", distribution="layerwise_legacy", overlap=True, bucket_size=2000),
        world_size=4,
    )[0]
    assert legacy["uneven_all_gather_as_broadcasts"] > 0, legacy
    assert legacy["launches"] >= counts["launches"], (legacy, counts)
    if math.isinf(tolerance):
        assert legacy["launches"] > counts["launches"], (legacy, counts)


def test_compact_gathers_no_more_often_than_padded_and_trains_the_same():
    """Issue 19: compact buckets end where the padded layout's do (no padding), so the compact
    layout has as many layer-wise bucket groups as megatron's padded layout and issues one
    collective for each per step, not one per plain ``bucket_size`` bucket; training is
    bitwise what plain Muon does."""
    # (megatron's padded gather calls a torch function it bound at import: count its groups.)
    padded = run_on_ranks(
        layout_facts,
        Scenario(optimizer="muon", distribution="layerwise_padded", bucket_size=2000),
        world_size=2,
    )[0]
    padded_groups = sum(kinds == [True] for kinds in padded["groups"])
    scenario = COMPACT.with_(bucket_size=2000, gather_padding_tolerance=math.inf)
    compact = run_on_ranks(count_layer_wise_gathers, scenario, world_size=2)[0]
    assert padded_groups >= 2, padded["groups"]
    assert compact["groups"] == padded_groups, (compact, padded["groups"])
    assert compact["launches"] == compact["groups"] * compact["steps"], compact
    # Control: megatron's plain bucketing (the layout before issue 19) gathers more often.
    plain = run_on_ranks(
        count_layer_wise_gathers, scenario.with_(bucket_cap_numel=0), world_size=2
    )[0]
    assert plain["launches"] > compact["launches"], (plain, compact)
    reference = _reference(Scenario(optimizer="muon", bucket_size=2000))
    candidate = _owner_reduced(COMPACT.with_(bucket_size=2000, overlap=True))
    _same(reference, candidate, "compact, padded-layout buckets")


# --------------------------------------------------------------------------- planner vs reality


def allocated_buffers(scenario: Scenario) -> list[dict]:
    """The grad (and param) storage megatron really allocated, per buffer."""
    from tests.support.scenarios import build_model
    from tests.support.training import wrap_and_build_optimizer

    module, config = build_model(scenario)
    model, _ = wrap_and_build_optimizer(module, config, scenario)
    return [
        {
            "muon": bool(getattr(b.params[0], "is_managed_by_layer_wise_optimizer", False)),
            "grad_bytes": b.grad_data.numel() * b.grad_data.element_size(),
            "param_bytes": 0 if b.param_data is None else b.param_data.numel() * 2,
        }
        for b in model[0].buffers
    ]


def _mlp_specs():
    from nemo_lw_fp8.planner import ParamSpec
    from tests.support.scenarios import TinyMLP

    return [
        ParamSpec(name, tuple(p.shape), muon=p.dim() == 2)
        for name, p in TinyMLP().named_parameters()
    ]


_ALLOCATED: dict[tuple[str, int], list[dict]] = {}
_PLANNER_KEY = {"layerwise_padded": "stock_padded", "layerwise_compact": "compact"}


def _allocated(distribution: str, world_size: int) -> list[dict]:
    """Rank 0's buffers as megatron allocated them, built once per session (test and control)."""
    if (distribution, world_size) not in _ALLOCATED:
        scenario = Scenario(optimizer="muon", distribution=distribution, plugin=True)
        real = run_on_ranks(allocated_buffers, scenario, world_size=world_size)[0]
        _ALLOCATED[distribution, world_size] = real
    return _ALLOCATED[distribution, world_size]


def _byte_mismatches(real: list[dict], world_size: int, key: str) -> list[str]:
    """Where the planner's ``key`` layout at ``world_size`` disagrees with ``real`` (grad and
    param bytes of the Muon and the Adam buffers); empty when it agrees everywhere."""
    from nemo_lw_fp8.planner import plan

    planned = plan(_mlp_specs(), dp=world_size, fp8_param_gather=False)["layouts"][key]
    bad = []
    for muon in (True, False):
        prefix = "muon/" if muon else "adam/"
        planned_numel = sum(b["numel"] for b in planned["buffers"] if b["name"].startswith(prefix))
        real_grad = sum(b["grad_bytes"] for b in real if b["muon"] == muon)
        if real_grad != planned_numel * 4:
            bad.append(f"{prefix} grad bytes")
        real_param = sum(b["param_bytes"] for b in real if b["muon"] == muon)
        # Compact Muon buffers keep params in their own storage: no param buffer at all.
        expected_param = 0 if (muon and key == "compact") else planned_numel * 2
        if real_param != expected_param:
            bad.append(f"{prefix} param bytes")
    return bad


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("distribution", ["layerwise_padded", "layerwise_compact"])
def test_planner_bytes_equal_allocated_buffers(world_size, distribution):
    real = _allocated(distribution, world_size)
    assert _byte_mismatches(real, world_size, _PLANNER_KEY[distribution]) == [], real


@pytest.mark.parametrize("world_size", [2, 4])
def test_control_planner_bytes_of_the_other_layout_differ(world_size: int) -> None:
    """Control of ``test_planner_bytes_equal_allocated_buffers``: the same allocations (the
    test's own builds when it ran first in this session) against the planner's other layout
    fail the same comparison on the Muon buffers (padding and a param buffer, or neither),
    and only there: the Adam buffers are laid out alike."""
    other = {"layerwise_padded": "compact", "layerwise_compact": "stock_padded"}
    for distribution, key in other.items():
        bad = _byte_mismatches(_allocated(distribution, world_size), world_size, key)
        assert bad and all(b.startswith("muon/") for b in bad), (distribution, bad)


def test_expert_parallel_moe_layouts_equal_plain_muon():
    """A tiny MoE GPT with EP 2 on 4 ranks: expert matrices are owned over the expert-DP group.
    Layer-wise padded and compact (overlap on and off) train to plain Muon's bits. Control:
    receivers skipping DP rank 3's gathered segment (the dense data-parallel group is all 4
    ranks) diverge. The dense gradients are summed over 4 ranks, so every run sums its grad
    syncs in rank order (``ordered_grad_sync``, test_compact_grad_sync.py): gloo's ring sums an
    element in an order set by its place in the buffer, which the layouts move (the verdict
    then depended on the CPU's kernels: equal with native ones, 1 fp32 ulp apart in the second
    loss with ``ATEN_CPU_CAPABILITY=default``)."""
    from tests.support.harness import ParallelSpec

    moe = Scenario(optimizer="muon", model="moe_gpt", ep=2, steps=3)
    _four_rank_layouts_equal_plain_muon(moe, ParallelSpec(ep=2), overlaps=(False, True),
                                        rank_order=True)  # fmt: skip


def test_tensor_parallel_gpt_layouts_equal_plain_muon():
    """A tiny GPT at TP 2 x DP 2 on 4 ranks (TE's linears, each rank a TP shard of every matrix;
    bf16, FP8 param gather stays refused at TP > 1): layer-wise padded and the plugin's compact
    layout with the owner reduce and overlap train to plain Muon's bits (megatron's default
    ``muon_tp_mode``). Control: receivers skipping DP rank 1's gathered segment diverge."""
    from tests.support.harness import ParallelSpec

    gpt = Scenario(optimizer="muon", model="gpt", steps=3)
    _four_rank_layouts_equal_plain_muon(gpt, ParallelSpec(tp=2), overlaps=(True,))


def train_summing_grad_syncs_in_rank_order(scenario: Scenario, skip_last_owner: bool) -> dict:
    """:func:`train` (or, with ``skip_last_owner``, the skipped-segment mutation) with every
    grad sync summed in rank order, probed (inside the ordering: the probe sees what it is
    asked)."""
    from tests.mechanics.test_compact_grad_sync import ordered_grad_sync

    with ordered_grad_sync() as counts:
        result = probe.train_probed(
            scenario, train_with_receivers_skipping_the_last_owner if skip_last_owner else train)
    assert counts["ordered"] > 0, "no grad sync was summed in rank order"
    return result


def _four_rank_layouts_equal_plain_muon(
    base: Scenario, parallel, overlaps, rank_order: bool = False
) -> None:
    """``base`` (plain Muon) on 4 ranks split by ``parallel`` into two shards (TP or EP): the
    ranks of one shard agree and the shards differ; layer-wise padded and compact (each
    ``overlaps`` setting) train to the same bits; the skipped-segment control diverges. With
    ``rank_order`` every run sums its grad syncs in rank order. Every run is probed: the
    compact ones' grad syncs were owner reduces, plain Muon's and the padded layout's issued no
    reduce."""

    def run(scenario: Scenario, skip_last_owner: bool = False) -> list[dict]:
        if rank_order:
            fn, args = train_summing_grad_syncs_in_rank_order, (scenario, skip_last_owner)
        else:
            mutation = train_with_receivers_skipping_the_last_owner if skip_last_owner else train
            fn, args = probe.train_probed, (scenario, mutation)
        return run_on_ranks(fn, *args, world_size=4, parallel=parallel, boot=boot_for(scenario))

    reference = run(base)
    probe.assert_no_reduce(reference, "plain Muon")
    digests = [r["digest"] for r in reference]
    assert digests[0] == digests[2] and digests[1] == digests[3] and digests[0] != digests[1]
    compact = base.with_(distribution="layerwise_compact", plugin=True)
    layouts = [base.with_(distribution="layerwise_padded")]
    layouts += [compact.with_(overlap=overlap) for overlap in overlaps]
    for scenario in layouts:
        result = run(scenario)
        assert result[0]["layer_wise"], scenario
        if probe.owner_reduced(scenario):
            probe.assert_reduced_to_owners(result, f"{scenario}")
        else:
            probe.assert_no_reduce(result, f"{scenario}")
        _same_losses_and_weights(reference, result)
    mutated = run(compact, skip_last_owner=True)
    assert_diverges(reference, mutated, compare=_same_losses_and_weights)


def _same_losses_and_weights(reference: list[dict], result: list[dict]) -> None:
    for rank, (a, b) in enumerate(zip(reference, result, strict=True)):
        assert a["losses"] == b["losses"], f"rank {rank}: losses"
        assert a["digest"] == b["digest"], f"rank {rank}: weights"
