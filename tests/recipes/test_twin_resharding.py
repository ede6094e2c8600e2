"""The flagship MXFP8 twin (DeepSeek-V3: PP 2 x VPP 2 x EP 2, MTP, single grouped MXFP8 experts,
clipping, dropout) resumes through Megatron-Bridge at another data-parallel size and another
grouped-weight ownership, as a user launches it (``nemo-lw-fp8 pretrain --cpu``), on TE's own
modules (``--cpu-modules te``, the default of tests/support/bridge_runs.py: megatron's TE spec,
as on the GPU; the probe of tests/support/bridge_run.py counts TE modules and no project layer on
every rank of A, B and C).

Three runs: A (DP 2, 4 ranks, whole ownership) trains 2 iterations and saves; B (DP 4, 8 ranks,
expert-run ownership: each grouped weight's experts split over the 2 ranks of its
expert-data-parallel group, which DP 2 does not have) loads it, trains iteration 3 and saves;
C (DP 2, whole ownership again) loads B's checkpoint. After each load the fp32 masters, Muon
momentum and Adam moments, per parameter and expert (:mod:`nemo_lw_fp8.mechanics.state_by_name`,
which does not depend on who owns what), equal the state the saving run ended with, bit for bit.

Control: C again with each rank's first layer-wise master moved by one ulp right after the load
(mutation ``nudge_loaded_master``): exactly those masters differ.
"""

from __future__ import annotations

import math

import pytest

from tests.support import bridge_runs as br
from tests.support.harness import run_on_ranks

RECIPE = "twin_deepseek_v3_mxfp8"
#: Model-space Adam state (``fully_reshardable``; Bridge's default ``dp_reshardable`` reshards too,
#: tested on the Hopper and Qwen3-235B twins in test_recipe_twins.py).
COMMON = ("checkpoint.dist_ckpt_optim_fully_reshardable=true", "validation.eval_interval=100",
          "validation.eval_iters=1")  # fmt: skip


def _differences(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def rng_entries_at_load(directory: str, blind_to_the_saved_size: bool = False) -> list:
    """The entries :func:`rng_state_for_load` makes of Bridge's RNG entry for (PP 1, TP 0, DP 3
    of 4), and for (PP 1, TP 0, DP 1 of 2), when loading a checkpoint saved at DP 2, at DP 4,
    and outside a load: ``(global shape, offset, replica)`` of each entry read.
    ``blind_to_the_saved_size`` (the control's mutation): the checkpoint's RNG data-parallel
    size is not found, as if the checkpoint had none."""
    import contextlib
    from unittest import mock

    import torch
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    from nemo_lw_fp8.mechanics import checkpointing

    def read(entry) -> list:
        if isinstance(entry, ShardedTensorFactory):
            built = entry.build()
            assert entry.merge_fn(dict.fromkeys(built, "x") | {min(built): "own"}) == "own"
            return [(e.global_shape, e.global_offset, e.replica_id) for e in built.values()]
        return [(entry.global_shape, entry.global_offset, entry.replica_id)]

    out = []
    blind = mock.patch.object(
        checkpointing, "saved_rng_data_parallel_size", lambda *args: None
    )
    with blind if blind_to_the_saved_size else contextlib.nullcontext():
        for saved_dp in (2, 4):
            directory_dp = f"{directory}/dp{saved_dp}"
            dcp.save({f"rng_state/shard_{pp}.0.{dp}_2.1.{saved_dp}": torch.zeros(1)
                      for pp in (0, 1) for dp in range(saved_dp)},
                     checkpoint_id=directory_dp, no_dist=True)  # fmt: skip
            with checkpointing.loading_into(cfg=None):
                checkpointing._LOADING_INTO.get().iteration_dir = directory_dp
                for size, dp in ((4, 3), (2, 1)):
                    entry = ShardedObject("rng_state", [{}], (2, 1, size), (1, 0, dp), replica_id=0)
                    out.append(read(checkpointing.rng_state_for_load(entry)))
        entry = ShardedObject("rng_state", [{}], (2, 1, 4), (1, 0, 3), replica_id=0)
        out.append(read(checkpointing.rng_state_for_load(entry)))  # no load in progress
    return out


def test_rng_state_of_another_data_parallel_size_maps_to_the_same_expert_rank(tmp_path):
    """Bridge shards the RNG state by DP with EP > 1. From a DP 2 checkpoint, DP rank 3 of 4
    (EP rank 1) reads saved DP rank 1 (EP rank 1) as a replica; from a DP 4 checkpoint, DP rank
    1 of 2 reads saved DP ranks 1 (its own) and 3; same-size loads and saves keep theirs."""
    [out] = run_on_ranks(rng_entries_at_load, str(tmp_path), world_size=1)
    assert out == [
        [((2, 1, 2), (1, 0, 1), 1)],  # saved at DP 2, loaded at DP 4
        [((2, 1, 2), (1, 0, 1), 0)],  # same size
        [((2, 1, 4), (1, 0, 3), 0)],  # same size
        [((2, 1, 4), (1, 0, 1), 0), ((2, 1, 4), (1, 0, 3), 0)],  # saved at DP 4, loaded at DP 2
        [((2, 1, 4), (1, 0, 3), 0)],  # not a load
    ]


def test_control_rng_state_without_the_saved_size_is_not_mapped(tmp_path):
    """Control of ``test_rng_state_of_another_data_parallel_size_maps_to_the_same_expert_rank``:
    when the checkpoint's data-parallel size is not found, every load asks for its own entry,
    as Bridge does unpatched: the DP 4 load of a DP 2 checkpoint asks for
    ``(1, 0, 3)`` of a DP 4 grid, which that checkpoint does not have, and the DP 2 load of a
    DP 4 checkpoint reads one entry instead of two. The same expectations fail at both."""
    [out] = run_on_ranks(rng_entries_at_load, str(tmp_path), True, world_size=1)
    assert out == [
        [((2, 1, 4), (1, 0, 3), 0)],  # mapped: [((2, 1, 2), (1, 0, 1), 1)]
        [((2, 1, 2), (1, 0, 1), 0)],
        [((2, 1, 4), (1, 0, 3), 0)],
        [((2, 1, 2), (1, 0, 1), 0)],  # mapped: saved entries 1 and 3 of a DP 4 grid
        [((2, 1, 4), (1, 0, 3), 0)],
    ]


@pytest.mark.usefixtures("bridge_installed")
@pytest.mark.extended  # eight-rank runs; the gate reshards in test_checkpoint_resharding.py
def test_flagship_twin_resumes_at_another_dp_size_and_ownership(tmp_path):
    at2, at4 = tmp_path / "dp2", tmp_path / "dp4"
    a = br.pretrain(tmp_path, "a", RECIPE, *COMMON, "train.train_iters=2",
                    f"checkpoint.save={at2}", "checkpoint.save_interval=2",
                    "optimizer.grouped_weight_ownership=whole", nproc=4, probe=True)  # fmt: skip
    b = br.pretrain(tmp_path, "b", RECIPE, *COMMON, "train.train_iters=3",
                    f"checkpoint.load={at2}", "checkpoint.ckpt_step=2",
                    f"checkpoint.save={at4}", "checkpoint.save_interval=1",
                    "optimizer.grouped_weight_ownership=expert", nproc=8, timeout=1500,
                    probe=True)  # fmt: skip
    load_b = (*COMMON, "train.train_iters=3", f"checkpoint.load={at4}", "checkpoint.ckpt_step=3",
              "optimizer.grouped_weight_ownership=whole")  # fmt: skip
    c = br.pretrain(tmp_path, "c", RECIPE, *load_b, nproc=4, probe=True)

    # What the ranks ran, not what was configured: TE's modules (megatron's TE spec, as on the
    # GPU), no project CPU layer, at both sizes.
    for rank in a["probe"] + b["probe"] + c["probe"]:
        assert rank["te_modules"] > 0 and rank["project_layers"] == 0, rank
    saved = a["state"]["end"]
    kinds = {kind for entry in saved.values() for kind in entry}
    assert {"master", "momentum_buffer", "exp_avg", "exp_avg_sq"} <= kinds, kinds
    assert any("/expert" in name for name in saved)  # grouped weights, one entry per expert
    # B owns runs of experts where A owned whole grouped weights.
    assert b["grouped_weight_ownership"] == "expert" and b["expert_slices"] > 0
    assert a["expert_slices"] == 0
    assert _differences(saved, b["state"]["start"]) == []  # DP 2 whole -> DP 4 expert
    assert len(br.losses(b)) == 1 and all(math.isfinite(x) for x in br.losses(b))
    assert b["state"]["end"] != b["state"]["start"]  # it trained
    assert _differences(b["state"]["end"], c["state"]["start"]) == []  # DP 4 -> DP 2

    # Control: one ulp on the first master of each rank that owns one shows, and only there.
    nudged = br.pretrain(tmp_path, "nudged", RECIPE, *load_b, nproc=4,
                         mutation="nudge_loaded_master")  # fmt: skip
    moved = _differences(b["state"]["end"], nudged["state"]["start"])
    assert len(moved) == 4, moved  # each of the 4 ranks owns Muon matrices: one entry each
    for name in moved:
        before, after = b["state"]["end"][name], nudged["state"]["start"][name]
        assert [k for k in before if before[k] != after[k]] == ["master"], name
