"""``torch_dist`` checkpoints of single grouped expert weights owned in runs of experts.

With ``grouped_weight_ownership="expert"`` each rank's layer-wise optimizer holds fp32 masters
and Muon momentum for a run of experts ``[lo, hi)`` of a grouped weight. A checkpoint writes
each run as its experts' slice of the grouped weight's entry (megatron's per-expert layout, see
``nemo_lw_fp8/mechanics/grouped_checkpoint.py``), so the state saved under one ownership loads
under another. 2 CPU ranks, the tiny MoE GPT from megatron's TE spec (model ``moe_grouped``:
``TEGroupedMLP`` through TE's op fuser) with MXFP8 primary weights in one TE ``GroupedTensor``
per expert linear, compact layout, megatron's own ``dist_checkpointing``.
"""

from __future__ import annotations

import pytest
import torch

from nemo_lw_fp8.cpu.te import backend as te_backend
from tests.support import expert_state
from tests.support.expert_state import differing as _differ
from tests.support.harness import BootOptions, run_on_ranks
from tests.support.scenarios import Scenario

if te_backend.te_package_dirs() is None:  # find, never import, TE in this process
    pytest.skip("TE's GroupedTensor needs TE's Python package", allow_module_level=True)

BASE = Scenario(
    model="moe_grouped",
    single_grouped_weight=True,
    fp8=True,
    fp8_param_gather=True,
    plugin=True,
    optimizer="muon",
    distribution="layerwise_compact",
)
STEPS = 1
GROUPED = ".mlp.experts.linear_fc"


def _optimizer_state(optimizer, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's layer-wise fp32 masters and Muon state, per parameter; a grouped weight's
    per expert (``<name>:<expert>``), whether this rank holds it whole or a run of it."""
    return expert_state.per_expert_state(optimizer, module)


def _grouped_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the expert GEMMs read: each expert's rowwise and columnwise MXFP8 values (the
    members of TE's ``GroupedLinear`` weights)."""
    from transformer_engine.pytorch import GroupedLinear

    from nemo_lw_fp8.cpu.layers.mxfp8_linear import weight_columnwise
    from nemo_lw_fp8.mechanics.grouped_checkpoint import _expert_tensors

    out = {}
    for name, sub in module.named_modules():
        if isinstance(sub, GroupedLinear):
            for expert, member in enumerate(_expert_tensors(sub.weight, sub.num_gemms)):
                out[f"{name}:{expert}"] = member.dequantize(dtype=torch.float32)
                out[f"{name}:{expert}:columnwise"] = weight_columnwise(member).float()
    assert out, "no TE GroupedLinear in the model"
    return out


def _runs(optimizer) -> int:
    """How many runs of experts this rank's layer-wise optimizer holds."""
    from nemo_lw_fp8.mechanics.expert_slices import is_slice

    optimizers = expert_state.layer_wise_float16_optimizers(optimizer)
    groups = [group for opt in optimizers for group in opt.float16_groups]
    return sum(is_slice(p) for group in groups for p in group)


class _Chain:
    """Builds, trains, saves and loads in a chain: each loaded run trains one step on and is
    the next save (four model builds for three round trips)."""

    def __init__(self, directory: str) -> None:
        from megatron.core import parallel_state

        self.directory = directory
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.seed = BASE.seed
        self.model, self.optimizer = self.build("expert")

    def build(self, ownership: str):
        from tests.support.scenarios import build_model
        from tests.support.training import wrap_and_build_optimizer

        scenario = BASE.with_(grouped_weight_ownership=ownership, seed=self.seed)
        self.seed += 1  # every build starts from other values: a no-op load cannot pass
        self.scenario = scenario
        return wrap_and_build_optimizer(*build_model(scenario), scenario)

    def round_trip(self, tag: str, ownership: str) -> dict:
        """Train one step, save, build with ``ownership``, load."""
        import os

        from tests.support import dist_checkpoints as ckpt
        from tests.support.training import train_step

        directory = os.path.join(self.directory, tag)
        os.makedirs(directory, exist_ok=True)
        for step in range(STEPS):
            train_step(self.scenario, self.model, self.optimizer, step, self.dp_rank)
        saved = _optimizer_state(self.optimizer, self.model[0].module)
        saved_weights = _grouped_weights(self.model[0].module)
        runs = _runs(self.optimizer)
        ckpt.save_torch_dist(self.model, self.optimizer, directory, "dp_reshardable")

        self.model, self.optimizer = self.build(ownership)
        fresh = _optimizer_state(self.optimizer, self.model[0].module)
        ckpt.load_torch_dist(self.model, self.optimizer, directory)
        loaded = _optimizer_state(self.optimizer, self.model[0].module)
        weights_differ = [
            name
            for name, value in _grouped_weights(self.model[0].module).items()
            if not torch.equal(value, saved_weights[name])
        ]
        return {"saved": saved, "fresh": fresh, "loaded": loaded,
                "runs": runs + _runs(self.optimizer), "weights_differ": weights_differ}  # fmt: skip


def round_trips(directory: str) -> dict:
    """Expert runs -> whole ownership, whole -> expert runs; then the control: expert runs
    whose loads drop what they read (each run keeps the fresh build's state)."""
    import dataclasses

    from nemo_lw_fp8.mechanics import grouped_checkpoint

    chain = _Chain(directory)
    out = {
        "expert->whole": chain.round_trip("a", "whole"),
        "whole->expert": chain.round_trip("b", "expert"),
    }
    narrow = grouped_checkpoint.narrow

    def not_read_back(whole_entry, data, lo, hi):
        """A run's entry, written as usual, whose load returns what the optimizer holds."""
        return dataclasses.replace(narrow(whole_entry, data, lo, hi), merge_fn=lambda _: data)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grouped_checkpoint, "narrow", not_read_back)
        out["control"] = chain.round_trip("c", "expert")
    return out


def _merged(results: list[dict], case: str, what: str) -> dict[str, torch.Tensor]:
    """One case's grouped-weight state over both ranks (each expert on exactly one rank)."""
    states = [result[case][what] for result in results]
    return expert_state.merged_over_ranks(states, keep=lambda name: GROUPED in name)



def test_expert_run_state_round_trips_across_ownerships(tmp_path):
    results = run_on_ranks(round_trips, str(tmp_path), boot=BootOptions(fp8_emulation=True),
                           timeout=600)  # fmt: skip
    for case in ("expert->whole", "whole->expert"):
        # Runs of experts really were in play: both ranks held some under expert ownership.
        assert all(r[case]["runs"] > 0 for r in results), case
        saved, loaded = _merged(results, case, "saved"), _merged(results, case, "loaded")
        assert {name.split(":")[0] for name in saved} == {"master", "momentum_buffer"}
        assert len(saved) == 2 * 2 * 2 * 4  # (master, momentum) x 2 layers x (fc1, fc2) x E
        # The new build's masters differ from the checkpoint's (its momentum is not made yet):
        # a load that did nothing cannot pass.
        fresh = _merged(results, case, "fresh")
        masters = [name for name in saved if name.startswith("master:")]
        assert all(not torch.equal(saved[name], fresh[name]) for name in masters), case
        assert _differ(saved, loaded) == [], case  # fp32 masters and momentum, bitwise
        for result in results:
            assert result[case]["weights_differ"] == [], (case, result[case]["weights_differ"])

    # Control: with the runs' state not read back, the resumed masters and momentum of every
    # expert are the fresh build's; the rest of the state still comes back.
    saved, loaded = _merged(results, "control", "saved"), _merged(results, "control", "loaded")
    assert _differ(saved, loaded) == sorted(saved)
    for result in results:
        control = result["control"]
        rest = [n for n in control["saved"] if GROUPED not in n]
        assert rest and all(torch.equal(control["saved"][n], control["loaded"][n]) for n in rest)
