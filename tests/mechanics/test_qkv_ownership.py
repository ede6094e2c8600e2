"""Q, K and V parts of a fused ``linear_qkv`` weight owned by different ranks (compact layout,
``qkv_ownership="split"``, the default; ``nemo_lw_fp8/mechanics/qkv_parts.py``).

megatron's Muon (``muon_split_qkv=True``) orthogonalizes the parts apart, so owning them apart
must train bitwise like plain Muon; where Muon does not split, the weight must stay whole (the
control). The parts' fp32 masters and Muon momentum checkpoint into the fused weight's tensor and
load back under the other ownership. Tiny GPT (4 heads, 4 query groups) on megatron's Transformer
Engine spec (TE's own modules over the emulated extension; ``linear_qkv`` is TE's
``TELayerNormColumnParallelLinear``).
"""

from __future__ import annotations

import pytest
import torch

from tests.support import owner_reduce_probe as probe
from tests.support.harness import run_on_ranks
from tests.support.parity import assert_diverges
from tests.support.scenarios import TE_BOOT, Scenario
from tests.support.training import state_by_part, train

GPT = Scenario(optimizer="muon", model="gpt", steps=3, snapshots=True)
SPLIT = GPT.with_(distribution="layerwise_compact", plugin=True, overlap=True,
                  qkv_ownership="split")


def _same_params(reference: list[dict], candidate: list[dict]) -> None:
    _same(reference, candidate, "muon_split_qkv=False")


def _owned_apart(results: list[dict]) -> list[str]:
    """The fused QKV weights whose parts sit on more than one rank."""
    ranks_of: dict[str, set[int]] = {}
    for rank, result in enumerate(results):
        for part in result["qkv_part_names"]:
            ranks_of.setdefault(part.rsplit(".qkv_part", 1)[0], set()).add(rank)
    return sorted(weight for weight, ranks in ranks_of.items() if len(ranks) > 1)


def _same(reference: list[dict], candidate: list[dict], label: str) -> None:
    for rank, (a, b) in enumerate(zip(reference, candidate, strict=True)):
        assert a["losses"] == b["losses"], f"{label}: rank {rank} losses"
        for name, value in a["params"].items():
            assert torch.equal(value, b["params"][name]), f"{label}: rank {rank} {name}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_split_qkv_ownership_equals_plain_muon(world_size):
    """Clipping off: the layer-wise grad norm sums each rank's owned gradients, so any change
    of owners (DP size, ownership) moves its last bits (``test_compact_grad_sync``). DP 4: every
    run's grad syncs sum in rank order (gloo's own order depends on where an element sits in
    the buffer, which the owner layout changes)."""
    from tests.mechanics.test_compact_grad_sync import train_recorded

    def run(scenario):
        return run_on_ranks(
            train_recorded, scenario, world_size > 2, world_size=world_size, boot=TE_BOOT
        )

    reference = run(GPT)
    split = run(SPLIT)
    probe.assert_reduced_to_owners(split, f"split DP {world_size}")
    # Parts really were owned apart: some fused weight has its parts on different ranks.
    assert _owned_apart(split), [r["qkv_part_names"] for r in split]
    _same(reference, split, f"split DP {world_size}")
    _same_state_as_plain(reference, split, f"split DP {world_size}")
    whole = run(SPLIT.with_(qkv_ownership="whole"))
    probe.assert_reduced_to_owners(whole, f"whole DP {world_size}")
    assert not any(r["qkv_parts"] for r in whole)
    _same(reference, whole, f"whole DP {world_size}")
    _same_state_as_plain(reference, whole, f"whole DP {world_size}")


def _same_state_as_plain(plain: list[dict], layer_wise: list[dict], label: str) -> None:
    """Every layer-wise fp32 master and Muon momentum (over all ranks, by part name) equals
    plain Muon's (every rank holds all of them there), and every QKV part is among them."""
    owned: dict[str, torch.Tensor] = {}
    for result in layer_wise:
        for name, value in result["state_by_part"].items():
            assert name not in owned, f"{label}: {name} held by two ranks"
            owned[name] = value
    reference = plain[0]["state_by_part"]
    parts = {name for name in reference if ".qkv_part" in name}
    assert parts and parts <= owned.keys(), label
    differ = [name for name in owned if not torch.equal(owned[name], reference[name])]
    assert not differ, f"{label}: layer-wise state differs from plain Muon's: {differ}"


def train_exact_norm(scenario: Scenario, count_a_part_twice: bool = False) -> dict:
    """:func:`tests.mechanics.test_compact_grad_sync.train_recorded` (each step's grad norm, the
    layer-wise state by part name) with the grad norm computed order-free
    (:func:`tests.support.parity.exact_grad_norm`). ``count_a_part_twice``: the control's
    mutation, each rank's first owned QKV part enters the norm twice."""
    import contextlib

    from megatron.core.optimizer.optimizer import MegatronOptimizer

    from nemo_lw_fp8.mechanics import masters, qkv_parts
    from tests.mechanics.test_compact_grad_sync import train_recorded
    from tests.support.parity import exact_grad_norm

    grads_for_norm = MegatronOptimizer.get_grads_for_grad_norm

    def with_a_part_twice(self, grad_norm_group=None):
        grads = grads_for_norm(self, grad_norm_group)
        if hasattr(self, "float16_groups"):
            for model_param, main_param in masters.model_main_pairs(self):
                if qkv_parts.is_part(model_param):
                    return [*grads, main_param.grad]
        return grads

    with contextlib.ExitStack() as stack:
        if count_a_part_twice:
            mp = stack.enter_context(pytest.MonkeyPatch.context())
            mp.setattr(MegatronOptimizer, "get_grads_for_grad_norm", with_a_part_twice)
        stack.enter_context(exact_grad_norm())
        return train_recorded(scenario)


def _union(results: list[dict]) -> dict[str, torch.Tensor]:
    """The layer-wise state of all ranks (each master on exactly one rank)."""
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        for name, value in result["state_by_part"].items():
            assert name not in merged, f"{name} held by two ranks"
            merged[name] = value
    return merged


def _same_clipped_training(whole: list[dict], split: list[dict]) -> None:
    """Grad norms (exact: order-free), losses, parameters, and every layer-wise fp32 master and
    Muon momentum (by part name, over all ranks): equal to the bit."""
    for rank, (a, b) in enumerate(zip(whole, split, strict=True)):
        assert a["grad_norms"] == b["grad_norms"], f"rank {rank}: grad norms differ"
    _same(whole, split, "split vs whole, clipped")
    a, b = _union(whole), _union(split)
    assert sorted(a) == sorted(b)
    differ = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differ, f"layer-wise state differs: {differ}"


def test_grad_norm_counts_every_part_once():
    """Clipping on (every step clips): split ownership's global grad norm is whole ownership's.
    megatron sums the squares per tensor and per rank, so ownership changes the summation order
    and the last bits of the norm, and a clip coefficient one ulp apart grows in bf16 training;
    the comparison therefore computes the norm order-free (exact squares, one correctly rounded
    sum) in both runs: each part counted once gives the same norm, the same clip coefficient by
    construction, and bitwise training. Control: a part counted twice diverges."""
    clipped = SPLIT.with_(clip_grad=0.05)
    split = run_on_ranks(train_exact_norm, clipped, boot=TE_BOOT)
    whole = run_on_ranks(train_exact_norm, clipped.with_(qkv_ownership="whole"), boot=TE_BOOT)
    assert any(r["qkv_parts"] for r in split) and not any(r["qkv_parts"] for r in whole)
    probe.assert_reduced_to_owners(split, "split")
    probe.assert_reduced_to_owners(whole, "whole")
    assert all(min(r["grad_norms"]) > clipped.clip_grad for r in split)
    _same_clipped_training(whole, split)

    twice = run_on_ranks(train_exact_norm, clipped, True, boot=TE_BOOT)
    assert_diverges(whole, twice, _same_clipped_training, match="grad norms differ")


def test_planner_counts_the_parts_reduces():
    """The planner (``models.traffic``) lays a split QKV weight's gradient out as the mechanism
    does: the reduces per step it plans for the worst rank are the ones the ranks issue
    (counted through ``torch.distributed``, DP 4), with parts and without."""
    from nemo_lw_fp8.planner import ParamSpec
    from nemo_lw_fp8.planner.traffic import rank_traffic
    from tests.mechanics.test_compact_grad_sync import count_grad_sync
    from tests.planner.test_planner_megatron import model_params

    rows = run_on_ranks(model_params, SPLIT, world_size=4, boot=TE_BOOT)[0]
    specs = [ParamSpec(**row) for row in rows]
    issued = {}
    for ownership in ("split", "whole"):
        scenario = SPLIT.with_(qkv_ownership=ownership, snapshots=False)
        counts = run_on_ranks(count_grad_sync, scenario, world_size=4, boot=TE_BOOT)
        for c in counts:
            assert c["reduces"] == c["planned_reduces"] * c["steps"], c
        planned = rank_traffic([specs], 4, fp8_param_gather=False, qkv_ownership=ownership)
        issued[ownership] = max(c["planned_reduces"] for c in counts)
        assert planned["compact_owner_reduce"]["grad_reduces"] == issued[ownership], ownership
    # Parts owned apart add the runs of their query groups.
    assert issued["split"] > issued["whole"]


def train_splitting_regardless(scenario: Scenario) -> dict:
    """Mutation: parts owned apart even though Muon orthogonalizes the fused weight whole."""
    from nemo_lw_fp8.mechanics import compact, qkv_parts

    def every_fused_weight(optimizers):
        return frozenset(
            id(p)
            for opt in optimizers
            for group in getattr(opt, "optimizer", opt).param_groups
            for p in group["params"]
            if qkv_parts.split_shapes(p) is not None
        )

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compact, "_muon_splits_qkv", every_fused_weight)
        return train(scenario)


def test_weight_stays_whole_where_muon_does_not_split():
    reference = run_on_ranks(train, GPT.with_(muon_split_qkv=False), boot=TE_BOOT)
    kept = run_on_ranks(train, SPLIT.with_(muon_split_qkv=False), boot=TE_BOOT)
    assert not any(r["qkv_parts"] for r in kept)
    _same(reference, kept, "muon_split_qkv=False")
    # Control: owning the parts apart there changes the update.
    forced = run_on_ranks(
        train_splitting_regardless, SPLIT.with_(muon_split_qkv=False), boot=TE_BOOT
    )
    assert any(r["qkv_parts"] for r in forced)
    assert_diverges(reference, forced, _same_params, match="muon_split_qkv=False")


# --------------------------------------------------------------------------- checkpoints


def round_trips(directory: str, sharding: str) -> dict:
    """Train, save, build under the other QKV ownership (other initial values), load; twice
    (split -> whole -> split), then the control: parts whose query groups are put back in the
    wrong order."""
    import os

    from megatron.core import parallel_state

    from nemo_lw_fp8.mechanics import qkv_parts
    from tests.support import dist_checkpoints as ckpt
    from tests.support.scenarios import build_model
    from tests.support.training import qkv_parts_owned, train_step, wrap_and_build_optimizer

    dp_rank = parallel_state.get_data_parallel_rank()
    seeds = iter(range(100, 200))

    def build(ownership: str):
        scenario = SPLIT.with_(qkv_ownership=ownership, seed=next(seeds), overlap=False)
        return scenario, *wrap_and_build_optimizer(*build_model(scenario), scenario)

    scenario, model, optimizer = build("split")

    def round_trip(tag: str, ownership: str) -> dict:
        nonlocal scenario, model, optimizer
        where = os.path.join(directory, tag)
        os.makedirs(where, exist_ok=True)
        train_step(scenario, model, optimizer, 0, dp_rank)
        saved = state_by_part(optimizer, model[0].module)
        parts = qkv_parts_owned(optimizer)
        ckpt.save_torch_dist(model, optimizer, where, sharding)
        scenario, model, optimizer = build(ownership)
        fresh = state_by_part(optimizer, model[0].module)
        ckpt.load_torch_dist(model, optimizer, where)
        loaded = state_by_part(optimizer, model[0].module)
        return {"saved": saved, "fresh": fresh, "loaded": loaded,
                "parts": parts + qkv_parts_owned(optimizer)}  # fmt: skip

    out = {"split->whole": round_trip("a", "whole"), "whole->split": round_trip("b", "split")}

    original_merge = qkv_parts._merge

    def groups_reversed(geometry, loaded: dict) -> torch.Tensor:
        keys = sorted(loaded)
        swapped = [loaded[k] for k in reversed(keys)]
        return original_merge(geometry, dict(zip(keys, swapped, strict=True)))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qkv_parts, "_merge", groups_reversed)
        out["control"] = round_trip("c", "split")
    return out


def _merged(results: list[dict], case: str, what: str) -> dict[str, torch.Tensor]:
    """One case's QKV state over both ranks (each part on exactly one rank)."""
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        for name, value in result[case][what].items():
            if ".qkv_part" in name:
                assert name not in merged, f"{name} held by two ranks"
                merged[name] = value
    return merged


@pytest.mark.parametrize("sharding", ["dp_reshardable", "fully_reshardable"])
def test_qkv_part_state_round_trips_across_ownerships(tmp_path, sharding):
    results = run_on_ranks(round_trips, str(tmp_path), sharding, timeout=600, boot=TE_BOOT)
    for case in ("split->whole", "whole->split"):
        assert any(r[case]["parts"] for r in results), case
        saved, loaded = _merged(results, case, "saved"), _merged(results, case, "loaded")
        fresh = _merged(results, case, "fresh")
        # (master, momentum) x 2 layers x (Q, K, V)
        assert len(saved) == 2 * 2 * 3 and sorted(saved) == sorted(loaded), case
        masters = [name for name in saved if name.startswith("master:")]
        assert all(not torch.equal(saved[n], fresh[n]) for n in masters), case
        differ = [n for n in saved if not torch.equal(saved[n], loaded[n])]
        assert not differ, f"{case}: {differ}"
    # Control: pieces put back in the wrong query groups are noticed.
    assert any(r["control"]["parts"] for r in results)
    saved = _merged(results, "control", "saved")
    loaded = _merged(results, "control", "loaded")
    assert any(not torch.equal(saved[n], loaded[n]) for n in saved)


# --------------------------------------------------------------------------- reloads


def reload_after_weights_change(scenario: Scenario) -> dict:
    """Train a step, write new values into every fused QKV weight (as a checkpoint load without
    optimizer state does), ``reload_model_params``; each owned part's master against its rows
    of the new weight."""
    from megatron.core import parallel_state

    from nemo_lw_fp8.mechanics import masters, qkv_parts
    from tests.support.scenarios import build_model
    from tests.support.training import train_step, wrap_and_build_optimizer

    model, optimizer = wrap_and_build_optimizer(*build_model(scenario), scenario)
    train_step(scenario, model, optimizer, 0, parallel_state.get_data_parallel_rank())
    with torch.no_grad():
        for name, param in model[0].module.named_parameters():
            if name.endswith("linear_qkv.weight"):
                param.copy_(torch.randn_like(param.float()).to(param.dtype))
    optimizer.reload_model_params()
    def leaves(opt) -> list:
        children = getattr(opt, "chained_optimizers", None)
        if children is None:
            return [opt] if hasattr(opt, "float16_groups") else []
        return [leaf for child in children for leaf in leaves(child)]

    checked, stale = 0, 0
    for child in leaves(optimizer):
        for param, main in masters.model_main_pairs(child):
            if qkv_parts.is_part(param):
                checked += 1
                stale += int(not torch.equal(main, qkv_parts.model_values(param).float()))
    return {"checked": checked, "stale": stale}


def test_reload_reads_parts_from_their_fused_weight():
    results = run_on_ranks(reload_after_weights_change, SPLIT.with_(overlap=False), boot=TE_BOOT)
    assert sum(r["checked"] for r in results) > 0
    assert all(r["stale"] == 0 for r in results), results
    # Control: megatron's own reload copies the part's own (now stale) bf16 copy.
    stale = run_on_ranks(reload_without_the_step, SPLIT.with_(overlap=False), boot=TE_BOOT)
    assert any(r["stale"] for r in stale), stale


def reload_without_the_step(scenario: Scenario) -> dict:
    from nemo_lw_fp8.mechanics import masters

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(masters, "read_parts_from_their_weights", lambda optimizer: None)
        return reload_after_weights_change(scenario)
