"""A checkpoint saved at tensor parallel 2 resumes at TP 1 with the same fp32 masters, Muon
momentum and Adam moments, bit for bit (issue 29), through Megatron-Bridge's own ``pretrain`` as
a user launches it (``nemo-lw-fp8 pretrain --cpu``, TE's own modules).

``tiny_qwen3_30b_a3b`` (GQA with two query groups, QK norms, MoE with single grouped MXFP8
experts, untied output layer, layer-wise Muon, MXFP8 param gather, ``muon_tp_mode`` as shipped:
``duplicated``): A (TP 2 x DP 2 with sequence parallelism, 4 ranks, as
tests/bridge/test_tp_bridge_training.py runs it) trains 2 iterations and saves (``torch_dist``); B
(TP 1 x DP 2, 2 ranks) loads it and trains iteration 3. TP 1 x DP 2 rather than DP 4: the
data-parallel size stays what A saved with, so the one thing that changes is TP (another DP size
is proven in tests/recipes/test_twin_resharding.py), and two ranks cost half of four on this
machine.

Compared: every entry of B's per-parameter state right after the load (tensors behind
:mod:`nemo_lw_fp8.mechanics.state_by_name`) with A's final state (= what it saved) merged over its
TP ranks as megatron's ``sharded_state_dict`` lays the shards out (tests/support/tp_merge.py):
the same names, kinds, shapes, dtypes and bits. B then trains iteration 3 (a finite loss, its
state moves). Not claimed: that iteration equals a TP-1 run that never stopped, or TP 2 going on
(the gradients' reductions run in another order at TP 1).

Control: B again with each rank's first layer-wise master moved by one ulp after the load
(mutation ``nudge_loaded_master``): exactly those masters differ.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.support import bridge_runs as br
from tests.support.harness import run_on_ranks
from tests.support.tp_merge import bitwise_differences, merge_over_tp, without_expert_rank

pytestmark = pytest.mark.usefixtures("bridge_installed")

RECIPE = "tiny_qwen3_30b_a3b"
SAVED_AT = 2
#: Model-space optimizer state (``fully_reshardable``): Bridge's default ``dp_reshardable`` writes
#: the sibling Adam's buckets flat, in a layout that follows the TP shards (megatron reshards it
#: across DP only).
COMMON = ("train.global_batch_size=4", "validation.eval_interval=100", "validation.eval_iters=1",
          "checkpoint.dist_ckpt_optim_fully_reshardable=true")  # fmt: skip
TP2_SP = ("model.tensor_model_parallel_size=2", "model.sequence_parallel=true")
_runs: dict[str, dict] = {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp-reshard")


def _saved_at_tp2(tmp: Path) -> dict:
    """A: TP 2 x DP 2 trains to iteration 2 and saves there; its end state is what it saved."""
    if "a" not in _runs:
        _runs["a"] = br.pretrain(
            tmp, "a-tp2", RECIPE, *TP2_SP, *COMMON, f"train.train_iters={SAVED_AT}",
            *br.saving_at(tmp, SAVED_AT), nproc=4, probe=True, state_tensors=True,
        )  # fmt: skip
    return _runs["a"]


def _loaded_at_tp1(tmp: Path, mutation: str = "") -> dict:
    """B: TP 1 x DP 2 loads A's checkpoint and trains iteration 3."""
    _saved_at_tp2(tmp)
    tag = f"b-tp1{mutation and '-' + mutation}"
    if tag not in _runs:
        _runs[tag] = br.pretrain(
            tmp, tag, RECIPE, *COMMON, f"train.train_iters={SAVED_AT + 1}",
            *br.loading_at(tmp, SAVED_AT), nproc=2, mutation=mutation, probe=True,
            state_tensors=True,
        )  # fmt: skip
    return _runs[tag]


def _merged_saved_state(a: dict) -> dict:
    """A's saved state merged over TP ranks into TP-1 entries."""
    ranks = a["tensors"]["end"]
    dims = {name: dim for rank in ranks for name, dim in rank["partition_dim"].items()}
    return without_expert_rank(merge_over_tp([rank["state"] for rank in ranks], dims, gated=True))


def _loaded_state(b: dict) -> dict:
    """B's state right after the load (TP 1: no shard to merge; ranks holding an entry
    agree)."""
    ranks = b["tensors"]["start"]
    return without_expert_rank(merge_over_tp([rank["state"] for rank in ranks], {}, gated=True))


def megatron_global_tensors(tp: int) -> tuple[dict, dict]:
    """Each of ``tp`` ranks' shard of a gated ``linear_fc1`` (``apply_swiglu_sharded_factory``
    over the rank's ``(0, r, tp)`` entry, as megatron's ``MLP.sharded_state_dict`` makes it), a
    row-parallel weight (axis 1) and a vocabulary-parallel one (axis 0), placed in their global
    tensors at the offsets megatron's entries give: ``(shards by rank, global tensors)``."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    shapes = {"fc1": ((8, 4), 0), "proj": ((4, 6), 1), "vocab": ((5, 4), 0)}
    shards: dict = {name: [] for name in shapes}
    whole: dict = {}
    generator = torch.Generator().manual_seed(0)
    for name, (shape, axis) in shapes.items():
        global_shape = list(shape)
        global_shape[axis] *= tp
        whole[name] = torch.full(global_shape, float("nan"))
        for rank in range(tp):
            local = torch.randn(shape, generator=generator)
            shards[name].append(local)
            entry = ShardedTensor.from_rank_offsets(name, local, (axis, rank, tp), replica_id=0)
            built = [entry]
            if name == "fc1":
                built = apply_swiglu_sharded_factory(entry, ()).build()
            for piece in built:
                where = tuple(
                    slice(offset, offset + size)
                    for offset, size in zip(piece.global_offset, piece.local_shape, strict=True)
                )
                whole[name][where] = piece.data
    return shards, whole


def test_tp_merge_places_shards_where_megatrons_entries_do():
    """tests/support/tp_merge.py against megatron's own entries at TP 2 (the gated ``fc1``
    rule is not exercised by the Bridge runs: Qwen3-30B-A3B has no dense MLP or shared
    expert). Control: the gated ``fc1`` merged as plain rows differs."""
    [(shards, whole)] = run_on_ranks(megatron_global_tensors, 2, world_size=1)
    names = {"fc1": "decoder.layers.0.mlp.linear_fc1.weight",
             "proj": "decoder.layers.0.self_attention.linear_proj.weight",
             "vocab": "output_layer.weight"}  # fmt: skip
    ranks = [
        {f"pp0/chunk0/tp{r}/{names[k]}": {"master": shards[k][r]} for k in names} for r in range(2)
    ]
    dims = {f"pp0/chunk0/tp{r}/{names[k]}": int(k == "proj") for k in names for r in range(2)}
    merged = merge_over_tp(ranks, dims, gated=True)
    expected = {f"pp0/chunk0/{names[k]}": {"master": whole[k]} for k in names}
    assert bitwise_differences(merged, expected) == []
    as_rows = merge_over_tp(ranks, dims, gated=False)
    assert bitwise_differences(as_rows, expected) == [f"pp0/chunk0/{names['fc1']}/master"]


def _group(expert: bool, lr: float, params: list | None = None) -> dict:
    group = {"is_expert_parallel": expert, "default_config": True, "wd_mult": 1.0,
             "lr_mult": 1.0, "is_decoupled_lr": False, "max_lr": 3e-3, "min_lr": 3e-4,
             "lr": lr, "weight_decay": 0.033}  # fmt: skip
    return group if params is None else {**group, "params": params}


def param_groups_through_a_load(
    directory: str, saved: list[bool], live: list[bool], saved_lrs: list[float], shaped: bool
) -> list[dict] | str:
    """A layer-wise optimizer's param groups through ``dist_checkpointing``'s load path:
    ``saved`` / ``live``: each group's ``is_expert_parallel``, the live groups holding params
    ``[0, 1]``, ``[2]``... and live lr 1.0 (not the saved lrs). ``shaped``: the plugin's
    :func:`shape_like_checkpoint` runs (else the loading list is the live one, as unpatched).
    Returns the groups :func:`fold_to_live` gives, or the error of the merge or fold."""
    from unittest import mock

    from megatron.core.dist_checkpointing.dict_utils import merge
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
    from megatron.core.dist_checkpointing.utils import extract_nonpersistent

    from nemo_lw_fp8.mechanics import param_groups_load

    common = {
        "optimizer": {
            "param_groups": [_group(e, lr) for e, lr in zip(saved, saved_lrs, strict=True)]
        }
    }
    params = [[0, 1], [2], [3]]
    loading = {"optimizer": {"param_groups": [
        _group(e, 1.0, LocalNonpersistentObject(params[i])) for i, e in enumerate(live)
    ]}}  # fmt: skip
    saved_lists = lambda _: [common["optimizer"]["param_groups"]]  # noqa: E731
    with mock.patch.object(param_groups_load, "_saved_group_lists", saved_lists):
        if shaped:
            param_groups_load.shape_like_checkpoint(loading, directory)
    nonpersistent, _ = extract_nonpersistent(loading)
    nonpersistent = {k: v for k, v in nonpersistent.items()}

    def unwrap(node):
        if isinstance(node, dict):
            return {k: unwrap(v) for k, v in node.items()}
        if isinstance(node, list):
            return [unwrap(v) for v in node]
        return node.unwrap() if isinstance(node, LocalNonpersistentObject) else node

    try:
        loaded = merge(common, unwrap(nonpersistent))
        param_groups_load.fold_to_live(loaded)
    except ValueError as error:
        return str(error)
    return loaded["optimizer"]["param_groups"]


def test_param_groups_split_at_another_tp_load_as_the_live_ones(tmp_path):
    """:mod:`nemo_lw_fp8.mechanics.param_groups_load` (the fix the TP 2 -> TP 1 load needed):
    a checkpoint's dense and expert groups load into one live group and the reverse, each live
    group with its own params and ``is_expert_parallel`` and the saved hyperparameters (lr
    0.5, not the live 1.0). Controls: unshaped, megatron's merge stops as the TP-1 load did;
    saved groups with different lrs merged into one are refused, naming ``lr``."""
    d = str(tmp_path)
    runs = run_on_ranks(param_groups_through_a_load, d, [False, True], [False], [0.5, 0.5], True,
                        world_size=1)  # fmt: skip
    assert runs == [[_group(False, 0.5, [0, 1])]]
    [grown] = run_on_ranks(param_groups_through_a_load, d, [False], [False, True], [0.5], True,
                           world_size=1)  # fmt: skip
    assert grown == [_group(False, 0.5, [0, 1]), _group(True, 0.5, [2])]
    [same] = run_on_ranks(param_groups_through_a_load, d, [False, True], [False, True],
                          [0.5, 0.5], True, world_size=1)  # fmt: skip
    assert same == [_group(False, 0.5, [0, 1]), _group(True, 0.5, [2])]
    [unshaped] = run_on_ranks(param_groups_through_a_load, d, [False, True], [False],
                              [0.5, 0.5], False, world_size=1)  # fmt: skip
    assert "Cannot merge two lists with different lengths (2 and 1" in unshaped
    [differ] = run_on_ranks(param_groups_through_a_load, d, [False, True], [False], [0.5, 0.7],
                            True, world_size=1)  # fmt: skip
    assert isinstance(differ, str) and "hyperparameters (lr)" in differ


def test_tp2_checkpoint_resumes_at_tp1_with_the_same_state(runs):
    a, b = _saved_at_tp2(runs), _loaded_at_tp1(runs)
    for rank in a["probe"] + b["probe"]:
        assert rank["te_modules"] > 0 and rank["project_layers"] == 0, rank
    # A really held TP shards of every kind the merge handles: rows (QKV parts, vocabulary)
    # and columns (linear_proj).
    dims = {n: d for r in a["tensors"]["end"] for n, d in r["partition_dim"].items()}
    assert {n.split("/", 2)[-1] for n in dims} >= {
        "tp0/embedding.word_embeddings.weight", "tp1/output_layer.weight",
        "tp0/decoder.layers.0.self_attention.linear_qkv.weight",
        "tp1/decoder.layers.1.self_attention.linear_proj.weight",
    }, sorted(dims)  # fmt: skip
    assert set(dims.values()) == {0, 1}
    saved = _merged_saved_state(a)
    kinds = {kind for entry in saved.values() for kind in entry}
    assert {"master", "momentum_buffer", "exp_avg", "exp_avg_sq"} <= kinds, kinds
    loaded = _loaded_state(b)
    assert bitwise_differences(saved, loaded) == []
    # The same through the runs' digests (what the record of every other resharding test
    # compares): B's record at the start has no TP-rank name left.
    assert not any("/tp" in name for name in b["state"]["start"])
    # B trains on from there.
    assert len(br.losses(b)) == 1 and all(math.isfinite(x) for x in br.losses(b))
    assert b["state"]["end"] != b["state"]["start"]


@pytest.mark.extended  # a third run; the gate keeps the resharding parity itself
def test_control_tp1_load_with_a_master_one_ulp_off_differs_there_only(runs):
    saved = _merged_saved_state(_saved_at_tp2(runs))
    nudged = _loaded_state(_loaded_at_tp1(runs, mutation="nudge_loaded_master"))
    moved = bitwise_differences(saved, nudged)
    assert len(moved) == 2, moved  # each of the 2 ranks owns Muon matrices: one master each
    assert all(name.endswith("/master") for name in moved), moved


WHERE = "/ckpt/iter_0000002"
#: The sibling Adam's one dp_reshardable bucket as the TP-2 run of this file writes it.
BUCKETS = {"chained_1.optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_x": [66_432]}


def test_dp_reshardable_checkpoint_of_another_tp_is_refused_naming_the_fix():
    """Rule ``checkpoint-tp-resplit``: Bridge's default ``dp_reshardable`` writes the sibling
    Adam's buckets flat over this TP rank's shards; loaded at TP 1, megatron stopped inside the
    load (``Global shape mismatch for loaded (torch.Size([66432])) and expected ((131968,))``,
    measured with this file's TP-2 run saved ``dp_reshardable``)."""
    from nemo_lw_fp8 import rules as guards

    message = guards.checkpoint_tp_resplit(False, 2, 1, BUCKETS, WHERE)
    assert message is not None and len(message.splitlines()) == 1 and WHERE in message
    assert "Fix: set model.tensor_model_parallel_size=2" in message
    assert "checkpoint.dist_ckpt_optim_fully_reshardable=true" in message
    assert "checkpoint-tp-resplit" in {name for name, _ in guards.CHECKPOINT_RULES}
    # Controls: the same TP, a fully_reshardable checkpoint, no sibling Adam buckets.
    assert guards.checkpoint_tp_resplit(False, 2, 2, BUCKETS, WHERE) is None
    assert guards.checkpoint_tp_resplit(True, 2, 1, BUCKETS, WHERE) is None
    assert guards.checkpoint_tp_resplit(False, 2, 1, {}, WHERE) is None


def test_bridge_load_check_refuses_a_dp_reshardable_checkpoint_of_another_tp(tmp_path):
    """The wiring: ``check_loadable`` (when Bridge reads ``run_config.yaml``) reads the saved
    TP size and buckets and this run's TP size; control: the saved TP size passes."""
    from types import SimpleNamespace

    import torch
    import torch.distributed.checkpoint as dcp

    from nemo_lw_fp8 import rules as guards
    from nemo_lw_fp8.mechanics import checkpointing

    buffer = "chained_1.optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16)"
    state = {f"{buffer}.bucket_idx_0.param": torch.zeros(100)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    saved = {"checkpoint": {"dist_ckpt_optim_fully_reshardable": False},
             "model": {"tensor_model_parallel_size": 2}}  # fmt: skip

    def cfg(tp: int) -> SimpleNamespace:
        return SimpleNamespace(
            model=SimpleNamespace(tensor_model_parallel_size=tp), optimizer=SimpleNamespace(),
            checkpoint=SimpleNamespace(ckpt_format="torch_dist"),
            ddp=SimpleNamespace(bucket_size=None),
        )  # fmt: skip

    run_config = str(tmp_path / "run_config.yaml")
    with checkpointing.loading_into(cfg(2)):
        checkpointing.check_loadable(saved, run_config)  # control: the saved TP size
    with checkpointing.loading_into(cfg(1)), pytest.raises(guards.ConfigError) as caught:
        checkpointing.check_loadable(saved, run_config)
    assert caught.value.rule == "checkpoint-tp-resplit"
    assert "Fix: set model.tensor_model_parallel_size=2" in str(caught.value)
