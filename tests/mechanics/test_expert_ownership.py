"""Expert-granular ownership of single grouped expert weights (issue 6, compact layout).

The layout arithmetic (pure functions) and, on CPU gloo ranks, the training parity it must keep:
with ``grouped_weight_ownership="expert"`` the experts of one grouped weight are owned by
different ranks, and training is bitwise what discrete expert weights (and whole ownership) give.
Every run of a parity syncs its Muon gradients by the compact layout's owner reduce, probed for
what its ranks issued (``tests/support/owner_reduce_probe.py``; an expert run's gradient is
reduced to its owner's rank in the expert-data-parallel group).
"""

from __future__ import annotations

import functools

import pytest
import torch

from nemo_lw_fp8.cpu.te import backend as te_backend
from nemo_lw_fp8.layout import packing as layout
from tests.support import owner_reduce_probe as probe

# --------------------------------------------------------------------------- layout arithmetic

#: DeepSeek-V3's routed experts at EP 8: 58 MoE layers x (fc1, fc2), 32 local experts each.
DSV3_GROUPED = [(32, 4096, 7168), (32, 7168, 2048)] * 58


def _costs(shapes):
    return [layout.newton_schulz_cost(s) for s in shapes]


def _busiest(shapes, dp, ownership):
    costs, units = _costs(shapes), [s[0] for s in shapes]
    sizes = [s[0] * s[1] * s[2] for s in shapes]
    pieces = layout.choose_pieces(costs, units, dp, sizes, ownership)
    loads = layout.piece_loads(costs, units, pieces, dp)
    return pieces, loads


def test_pieces_cover_every_unit_once_and_merge_runs():
    shapes = [(4, 8, 8), (4, 8, 8), (1, 16, 8)]
    pieces = layout.assign_owner_pieces(_costs(shapes), [4, 4, 1], world_size=3)
    for index, units in enumerate([4, 4, 1]):
        mine = [p for p in pieces if p.index == index]
        covered = [u for p in mine for u in range(p.lo, p.hi)]
        assert covered == list(range(units))
        # Adjacent pieces of one parameter have different owners (runs are merged).
        assert all(a.owner != b.owner for a, b in zip(mine, mine[1:], strict=False))
    assert pieces == layout.assign_owner_pieces(_costs(shapes), [4, 4, 1], world_size=3)


@pytest.mark.parametrize("dp", [32, 128])
def test_expert_ownership_balances_deepseek_v3(dp):
    """Whole ownership: +10 % at expert-DP 32, ranks with nothing at 128 (116 weights). Expert
    runs: within one expert of perfect."""
    _, whole = _busiest(DSV3_GROUPED, dp, "whole")
    _, split = _busiest(DSV3_GROUPED, dp, "expert")
    assert sum(whole) == sum(split)
    assert layout.imbalance(whole) > 1.09
    if dp > len(DSV3_GROUPED):
        assert min(whole) == 0
    unit = max(_costs(DSV3_GROUPED)) // 32
    # Graham's bound with unit-sized items: the busiest rank is within one expert of the mean.
    assert max(split) - sum(split) / dp <= unit
    assert layout.imbalance(split) < 1.01 < layout.imbalance(whole)
    assert min(split) > 0


def test_auto_splits_only_when_it_pays():
    balanced = [(4, 64, 64)] * 4  # 4 equal weights on 2 ranks: whole is already perfect
    pieces, _ = _busiest(balanced, 2, "auto")
    assert all(p.lo == 0 and p.hi == 4 for p in pieces)
    odd = [(4, 64, 64)] * 3  # 3 on 2 ranks: whole gives 2:1
    pieces, loads = _busiest(odd, 2, "auto")
    assert any(p.hi - p.lo < 4 for p in pieces) and loads[0] == loads[1]


def test_unknown_ownership_is_refused():
    with pytest.raises(ValueError, match="ownership must be one of"):
        layout.choose_pieces([8], [2], 2, ownership="experts")


def test_split_ownership_needs_the_compact_layout():
    from nemo_lw_fp8 import LayerWiseConfig
    from nemo_lw_fp8.errors import ConfigError

    with pytest.raises(ConfigError, match="grouped-weight-split-ownership-needs-compact"):
        LayerWiseConfig(layout="padded", grouped_weight_ownership="expert")


# --------------------------------------------------------------------------- training parity

needs_te = pytest.mark.skipif(
    te_backend.te_package_dirs() is None, reason="TE's GroupedTensor needs TE's Python package"
)

PRECISIONS = {
    "bf16": {},
    "mxfp8-compute": {"fp8": True},
    "mxfp8-primary": {"fp8": True, "fp8_param_gather": True},
}
GROUPED = "decoder.layers.0.mlp.experts.linear_fc1.weight"


def _base():
    from tests.support.scenarios import Scenario

    return Scenario(
        model="moe_grouped",
        steps=3,
        plugin=True,
        snapshots=True,
        optimizer="muon",
        distribution="layerwise_compact",
    )


def _run(scenario, world_size=2, parallel=None, fn=None):
    """``fn(scenario)`` on the ranks; by default ``train``, probed for what its grad syncs issued
    (:func:`_owner_reduced` reads it)."""
    from tests.support.harness import BootOptions, ParallelSpec, run_on_ranks

    return run_on_ranks(
        fn or probe.train_probed,
        scenario,
        world_size=world_size,
        boot=BootOptions(fp8_emulation=True),
        parallel=parallel or ParallelSpec(),
    )


def _owner_reduced(**runs) -> None:
    """Each of ``runs`` (label -> results of a probed :func:`_run`) synced its Muon gradients,
    the experts' included, by the owner reduce: reduces to the planned owners, no all-reduce of
    a Muon gradient, every element once per step."""
    for label, results in runs.items():
        probe.assert_reduced_to_owners(results, label)


def _expert_owners(results, name=GROUPED):
    """Which rank holds the fp32 master of each expert of ``name``."""
    owners = {}
    for rank, result in enumerate(results):
        for key in result["masters"]:
            if key.startswith(name) and key[len(name) :].isdigit():
                owners[int(key[len(name) :])] = rank
    return owners


@needs_te
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_expert_ownership_equals_discrete(precision):
    from tests.support.parity import assert_same_training

    scenario = _base().with_(**PRECISIONS[precision])
    discrete = _run(scenario)
    split = _run(scenario.with_(single_grouped_weight=True, grouped_weight_ownership="expert"))
    # The experts of one grouped weight really are owned by both ranks.
    assert sorted(set(_expert_owners(split).values())) == [0, 1]
    assert sorted(_expert_owners(split)) == [0, 1, 2, 3]
    _owner_reduced(discrete=discrete, split=split)
    assert_same_training(discrete, split)


def _overlap_eval_scenario():
    return _base().with_(**PRECISIONS["mxfp8-primary"], overlap=True, steps=4, eval_after=(1,))


@needs_te
def test_expert_ownership_overlap_eval_equals_discrete():
    """MXFP8 primary weights, overlapped gather, grad-buffer reuse, an eval after step 1."""
    from tests.support.parity import assert_same_training

    discrete = _overlap_eval_discrete()
    runs = _overlap_eval_scenario().with_(
        single_grouped_weight=True, grouped_weight_ownership="expert"
    )
    split = _run(runs)
    assert len(split[0]["eval_losses"]) == 1
    _owner_reduced(discrete=discrete, split=split)
    assert_same_training(discrete, split)


_OVERLAP_EVAL_RUNS: list[list[dict]] = []


def _overlap_eval_discrete() -> list[dict]:
    """The discrete-expert run of the overlap / eval test, made once per session (the test
    and its control compare against it)."""
    if not _OVERLAP_EVAL_RUNS:
        _OVERLAP_EVAL_RUNS.append(_run(_overlap_eval_scenario()))
    return _OVERLAP_EVAL_RUNS[0]


@needs_te
def test_control_overlap_eval_without_the_owners_own_bytes_differs():
    """Control of ``test_expert_ownership_overlap_eval_equals_discrete``: the expert-run build
    whose owners skip their own gathered segment (the mutation of
    ``test_control_mxfp8_slices_need_the_owners_own_bytes``) completes with its eval and fails
    the same comparison with the same discrete run."""
    from tests.support.parity import assert_diverges, assert_same_training

    runs = _overlap_eval_scenario().with_(
        single_grouped_weight=True, grouped_weight_ownership="expert"
    )
    broken = _run(runs, fn=_train_skipping_own_segment)
    assert len(broken[0]["eval_losses"]) == 1
    assert_diverges(_overlap_eval_discrete(), broken, assert_same_training)


def _train_skipping_own_segment(scenario):
    """Mutation: unpack only the other ranks' segments, as a gather that trusts the owner's
    weights to be current would."""
    from nemo_lw_fp8.mechanics.compact import CompactGroup
    from tests.support.training import train

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CompactGroup, "unpack_own", False)
        return train(scenario)


@needs_te
def test_control_mxfp8_slices_need_the_owners_own_bytes():
    """With MXFP8 primary weights a grouped weight is re-quantized whole from every expert run,
    the owner's own included; leaving it out breaks parity (the parity test can fail)."""
    from tests.support.parity import assert_diverges, assert_same_training

    scenario = _base().with_(**PRECISIONS["mxfp8-primary"])
    discrete = _run(scenario)
    broken = _run(
        scenario.with_(single_grouped_weight=True, grouped_weight_ownership="expert"),
        fn=_train_skipping_own_segment,
    )
    assert_diverges(discrete, broken, assert_same_training)


@needs_te
def test_expert_parallel_grouped_weights_equal_discrete():
    """EP 2 on 4 ranks (expert-DP 2): single grouped weights, whole and expert-run ownership,
    against discrete experts; the two EP ranks hold different experts."""
    from tests.support.harness import ParallelSpec
    from tests.support.parity import assert_same_training

    scenario = _base().with_(ep=2)
    ep2 = ParallelSpec(ep=2)
    discrete = _run(scenario, world_size=4, parallel=ep2)
    assert discrete[0]["digest"] != discrete[1]["digest"]
    _owner_reduced(discrete=discrete)
    for ownership in ("whole", "expert"):
        single = _run(
            scenario.with_(single_grouped_weight=True, grouped_weight_ownership=ownership),
            world_size=4,
            parallel=ep2,
        )
        if ownership == "expert":
            assert _expert_owners(single), "expert runs were not used"
        _owner_reduced(**{ownership: single})
        # Ranks 0, 2 hold EP rank 0's experts, ranks 1, 3 EP rank 1's.
        assert_same_training(discrete, single, replicas=[[0, 2], [1, 3]])


@needs_te
def test_control_expert_parallel_experts_paired_with_the_wrong_weights_differ():
    """Control of ``test_expert_parallel_grouped_weights_equal_discrete``: the discrete EP 2 run
    whose first two local experts start with each other's fc1 weights
    (tests/support/expert_controls.py) completes and fails the same comparison with the
    expert-run single grouped run."""
    from tests.support.expert_controls import train_with_two_experts_swapped
    from tests.support.harness import ParallelSpec
    from tests.support.parity import assert_diverges, assert_same_training

    scenario = _base().with_(ep=2)
    ep2 = ParallelSpec(ep=2)
    single = _run(
        scenario.with_(single_grouped_weight=True, grouped_weight_ownership="expert"),
        world_size=4,
        parallel=ep2,
    )
    swapped = _run(scenario, world_size=4, parallel=ep2, fn=train_with_two_experts_swapped)
    compare = functools.partial(assert_same_training, replicas=[[0, 2], [1, 3]])
    assert_diverges(swapped, single, compare)


@needs_te
def test_auto_keeps_balanced_grouped_weights_whole():
    """The test model's 4 grouped weights balance on 2 ranks: auto owns them whole."""
    from tests.support.parity import assert_same_training

    scenario = _base().with_(single_grouped_weight=True)
    whole = _run(scenario)
    auto = _run(scenario.with_(grouped_weight_ownership="auto"))
    assert _expert_owners(auto) == {} and any(GROUPED in r["masters"] for r in auto)
    _owner_reduced(whole=whole, auto=auto)
    assert_same_training(whole, auto)


def train_with_auto_always_splitting(scenario) -> dict:
    """Mutation: ``auto`` splits whenever splitting is not worse by more than 100 % (the gain
    it asks for set to -1), so balanced grouped weights are owned in runs of experts."""
    from tests.support.training import train

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layout, "AUTO_SPLIT_GAIN", -1.0)
        return train(scenario)


def test_control_auto_that_always_splits_owns_expert_runs():
    """Control of ``test_auto_keeps_balanced_grouped_weights_whole``: with ``auto`` mutated to
    split whatever the balance, the same build owns the grouped weight in runs of experts,
    which the test's first check rejects."""
    scenario = _base().with_(single_grouped_weight=True, grouped_weight_ownership="auto")
    split = _run(scenario, fn=train_with_auto_always_splitting)
    owners = _expert_owners(split)
    assert owners != {} and set(owners.values()) == {0, 1}, owners


def _slice_storage(scenario) -> list[tuple[int, int, int]]:
    """(owner, this rank, bytes of storage) for every expert slice this rank knows."""
    import torch.distributed as dist

    from nemo_lw_fp8.mechanics.expert_slices import is_slice
    from tests.support.scenarios import build_model
    from tests.support.training import wrap_and_build_optimizer

    module, config = build_model(scenario)
    _, optimizer = wrap_and_build_optimizer(module, config, scenario)
    from nemo_lw_fp8.state import OptimizerState, peek

    found = []
    for child in optimizer.chained_optimizers:
        record = peek(child)
        if not isinstance(record, OptimizerState):
            continue
        for pieces in record.pieces.values():
            for piece in pieces:
                if is_slice(piece):
                    nbytes = piece.untyped_storage().nbytes()
                    found.append((record.owner_of[piece], dist.get_rank(), nbytes))
    return found


@needs_te
def test_mxfp8_slices_hold_no_copy():
    """For MXFP8 storage an owned run's bf16 copy is read once, to build its master, and then
    released; the runs other ranks own (every rank knows them, to place gathered bytes) never
    hold one."""
    scenario = _base().with_(
        **PRECISIONS["mxfp8-primary"], single_grouped_weight=True, grouped_weight_ownership="expert"
    )
    for found in _run(scenario, fn=_slice_storage):
        assert found and {owner for owner, _, _ in found} == {0, 1}
        assert all(nbytes <= 2 for _, _, nbytes in found), found


def _slice_storage_keeping_copies(scenario) -> list[tuple[int, int, int]]:
    """Mutation: :func:`_slice_storage` with the owner's bf16 copy never released."""
    from nemo_lw_fp8.mechanics import expert_slices

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(expert_slices, "release_copy", lambda piece: None)
        return _slice_storage(scenario)


@needs_te
def test_control_mxfp8_slices_that_keep_their_copy_are_caught():
    """Control of ``test_mxfp8_slices_hold_no_copy``: when the owner's bf16 copy is not
    released, each rank's own runs hold their full bf16 bytes, which the same size check
    rejects; the runs other ranks own still hold none."""
    scenario = _base().with_(
        **PRECISIONS["mxfp8-primary"], single_grouped_weight=True, grouped_weight_ownership="expert"
    )
    for found in _run(scenario, fn=_slice_storage_keeping_copies):
        own = [nbytes for owner, rank, nbytes in found if owner == rank]
        others = [nbytes for owner, rank, nbytes in found if owner != rank]
        assert own and all(nbytes > 2 for nbytes in own), found
        assert all(nbytes <= 2 for nbytes in others), found


def _reloaded_masters(scenario) -> dict:
    """megatron's ``reload_model_params`` (a checkpoint load without optimizer state), then the
    fp32 masters this rank holds, by name."""
    from tests.support.scenarios import build_model
    from tests.support.training import master_snapshot, wrap_and_build_optimizer

    module, config = build_model(scenario)
    _, optimizer = wrap_and_build_optimizer(module, config, scenario)
    for child in optimizer.chained_optimizers:
        for param_group in getattr(child, "param_groups", []):
            for master in param_group["params"]:
                master.data.fill_(1.0)  # anything but the model's values
    optimizer.reload_model_params()
    return {"masters": master_snapshot(optimizer, module), "layer_wise": True}


@needs_te
def test_reload_model_params_reads_mxfp8_slices_from_the_model():
    """After ``reload_model_params`` every master under expert runs equals the one under whole
    ownership (the dequantized MXFP8 weights), although the runs hold no copy."""
    from tests.support.parity import _merged_masters

    scenario = _base().with_(**PRECISIONS["mxfp8-primary"], single_grouped_weight=True)
    whole = _merged_masters(_run(scenario, fn=_reloaded_masters))
    split = _merged_masters(
        _run(scenario.with_(grouped_weight_ownership="expert"), fn=_reloaded_masters)
    )
    assert whole.keys() == split.keys()
    for name, master in whole.items():
        assert torch.equal(master, split[name]), name
        if ".experts." in name:  # (norm weights start at 1.0 anyway)
            assert not torch.all(master == 1.0), name


def _reloaded_masters_from_the_wrong_experts(scenario) -> dict:
    """Mutation: the model -> master copy of an expert run reads the experts one place before
    its own (the grouped weight's experts rolled by one), i.e. each master is paired with
    another expert's weights."""
    from nemo_lw_fp8.mechanics import expert_slices

    def shifted(piece):
        if piece.quantized_parent:
            experts = torch.roll(piece.parent.detach().dequantize(), shifts=1, dims=0)
            return experts[piece.lo : piece.hi]
        return piece.data

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(expert_slices, "model_values", shifted)
        return _reloaded_masters(scenario)


@needs_te
def test_control_reload_reading_the_wrong_experts_differs():
    """Control of ``test_reload_model_params_reads_mxfp8_slices_from_the_model``: a reload whose
    expert runs read their neighbours' experts completes and its masters differ from whole
    ownership's."""
    from tests.support.parity import _merged_masters

    scenario = _base().with_(**PRECISIONS["mxfp8-primary"], single_grouped_weight=True)
    whole = _merged_masters(_run(scenario, fn=_reloaded_masters))
    split = _merged_masters(
        _run(
            scenario.with_(grouped_weight_ownership="expert"),
            fn=_reloaded_masters_from_the_wrong_experts,
        )
    )
    assert whole.keys() == split.keys()
    differ = [name for name, master in whole.items() if not torch.equal(master, split[name])]
    assert differ and all(".experts." in name for name in differ), differ
