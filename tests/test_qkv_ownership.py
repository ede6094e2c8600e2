"""Q, K and V parts of a fused ``linear_qkv`` weight owned by different ranks (compact layout,
``qkv_ownership="split"``, the default; ``nemo_lw_fp8/mechanics/qkv_parts.py``).

megatron's Muon (``muon_split_qkv=True``) orthogonalizes the parts apart, so owning them apart
must train bitwise like plain Muon; where Muon does not split, the weight must stay whole (the
control). The parts' fp32 masters and Muon momentum checkpoint into the fused weight's tensor and
load back under the other ownership. Tiny GPT (4 heads, 4 query groups) on megatron's local spec.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import run_on_ranks
from tests.support.parity import assert_diverges
from tests.support.scenarios import Scenario
from tests.support.training import train

GPT = Scenario(optimizer="muon", model="gpt", steps=3, snapshots=True)
SPLIT = GPT.with_(distribution="layerwise_compact", plugin=True, overlap=True,
                  qkv_ownership="split")


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
    from tests.test_compact_grad_sync import train_recorded

    def run(scenario):
        return run_on_ranks(train_recorded, scenario, world_size > 2, world_size=world_size)

    reference = run(GPT)
    split = run(SPLIT)
    # Parts really were owned apart, on more than one rank.
    assert sum(1 for r in split if r["qkv_parts"]) >= 2, [r["qkv_parts"] for r in split]
    _same(reference, split, f"split DP {world_size}")
    whole = run(SPLIT.with_(qkv_ownership="whole"))
    assert not any(r["qkv_parts"] for r in whole)
    _same(reference, whole, f"whole DP {world_size}")


def test_grad_norm_counts_every_part_once():
    """Clipping on: the global grad norm of split ownership is whole ownership's, up to the
    order its squares are summed in (parts are separate tensors in megatron's l2 sum), and
    clipping acts on every step."""
    from tests.test_compact_grad_sync import train_recorded

    clipped = SPLIT.with_(clip_grad=0.05)
    split = run_on_ranks(train_recorded, clipped)
    whole = run_on_ranks(train_recorded, clipped.with_(qkv_ownership="whole"))
    assert any(r["qkv_parts"] for r in split)
    for a, b in zip(split, whole, strict=True):
        assert min(a["grad_norms"]) > clipped.clip_grad
        assert a["grad_norms"] == pytest.approx(b["grad_norms"], rel=1e-6, abs=0)


def test_planner_counts_the_parts_reduces():
    """The planner (``models.traffic``) lays a split QKV weight's gradient out as the mechanism
    does: the reduces per step it plans for the worst rank are the ones the ranks issue
    (counted through ``torch.distributed``, DP 4), with parts and without."""
    from nemo_lw_fp8.models import ParamSpec
    from nemo_lw_fp8.models.traffic import rank_traffic
    from tests.test_compact_grad_sync import count_grad_sync
    from tests.test_planner_megatron import model_params

    specs = [ParamSpec(**row) for row in run_on_ranks(model_params, SPLIT, world_size=4)[0]]
    issued = {}
    for ownership in ("split", "whole"):
        scenario = SPLIT.with_(qkv_ownership=ownership, snapshots=False)
        counts = run_on_ranks(count_grad_sync, scenario, world_size=4)
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
    reference = run_on_ranks(train, GPT.with_(muon_split_qkv=False))
    kept = run_on_ranks(train, SPLIT.with_(muon_split_qkv=False))
    assert not any(r["qkv_parts"] for r in kept)
    _same(reference, kept, "muon_split_qkv=False")
    # Control: owning the parts apart there changes the update.
    forced = run_on_ranks(train_splitting_regardless, SPLIT.with_(muon_split_qkv=False))
    assert any(r["qkv_parts"] for r in forced)
    assert_diverges(reference, forced)


# --------------------------------------------------------------------------- checkpoints


def _layer_wise_state(optimizer, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Layer-wise fp32 masters and Muon momentum by name, a fused QKV weight's per part
    (``tests.support.training.master_snapshot``'s naming), however it is owned."""
    from tests.support.training import _named_master

    names = {id(p): n for n, p in module.named_parameters()}
    out: dict[str, torch.Tensor] = {}

    def walk(opt) -> None:
        for child in getattr(opt, "chained_optimizers", None) or []:
            walk(child)
        if not hasattr(opt, "fp32_from_float16_groups"):
            return
        for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True):
            for param, main in zip(models, mains, strict=True):
                state = opt.optimizer.state.get(main, {})
                kinds = {"master": main, "momentum": state.get("momentum_buffer")}
                for kind, value in kinds.items():
                    if value is not None:
                        for name, part in _named_master(names, param, value).items():
                            out[f"{kind}:{name}"] = part

    walk(optimizer)
    return out


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
        saved = _layer_wise_state(optimizer, model[0].module)
        parts = qkv_parts_owned(optimizer)
        ckpt.save_torch_dist(model, optimizer, where, sharding)
        scenario, model, optimizer = build(ownership)
        fresh = _layer_wise_state(optimizer, model[0].module)
        ckpt.load_torch_dist(model, optimizer, where)
        loaded = _layer_wise_state(optimizer, model[0].module)
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
    results = run_on_ranks(round_trips, str(tmp_path), sharding, timeout=600)
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
    results = run_on_ranks(reload_after_weights_change, SPLIT.with_(overlap=False))
    assert sum(r["checked"] for r in results) > 0
    assert all(r["stale"] == 0 for r in results), results
    # Control: megatron's own reload copies the part's own (now stale) bf16 copy.
    stale = run_on_ranks(reload_without_the_step, SPLIT.with_(overlap=False))
    assert any(r["stale"] for r in stale), stale


def reload_without_the_step(scenario: Scenario) -> dict:
    from nemo_lw_fp8.mechanics import masters

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(masters, "read_parts_from_their_weights", lambda optimizer: None)
        return reload_after_weights_change(scenario)
