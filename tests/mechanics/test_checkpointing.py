"""``torch_dist`` checkpoints of layer-wise Muon runs with MXFP8 parameters, on CPU, bitwise.

megatron-core level: a small MXFP8 model on the compact layout (Muon matrices, Adam vectors
under the sibling DistributedOptimizer) trains, is saved through ``megatron.core.
dist_checkpointing`` with the metadata megatron's loops build, and is loaded into a model built
from another seed; weights, fp32 masters, Muon momentum, Adam moments and steps come back to the
bit and training goes on exactly as the run that never stopped. The same through
megatron-training's own ``save_checkpoint`` / ``load_checkpoint``, with the ``args`` its parser
and ``validate_args`` build (``--optimizer muon --use-distributed-optimizer``), and a control
whose changed state must come back as a mismatch. The Bridge round trip (save, end the
processes, resume in fresh ones) is in ``tests/bridge/test_bridge_checkpointing.py``. Every
build of a round trip (the run that never stopped, the saved run, the one loaded into) synced
its Muon gradients by the owner reduce, as the ranks issued them
(``tests/support/owner_reduce_probe.py``, one verdict per build).
"""

from __future__ import annotations

import pytest
import torch

from tests.support import owner_reduce_probe as probe
from tests.support.fp8_mlp import FP8_BOOT, FP8_MLP, skip_module_without_te
from tests.support.harness import run_on_ranks
from tests.support.parity import assert_diverges
from tests.support.scenarios import Scenario

skip_module_without_te("the MXFP8 emulation needs TE's Python package")

FP8 = FP8_BOOT
BASE = FP8_MLP.with_(
    optimizer="muon", distribution="layerwise_compact", fp8_param_gather=True, plugin=True, steps=5
)
SAVE_AFTER = 3


def _build(scenario: Scenario, seed: int):
    from tests.support.scenarios import build_model
    from tests.support.training import wrap_and_build_optimizer

    module, config = build_model(scenario.with_(seed=seed))
    return wrap_and_build_optimizer(module, config, scenario)


def _mismatches(before: dict, after: dict) -> list[str]:
    out = []
    for name, value in before.items():
        other = after.get(name)
        same = (
            other is not None and torch.equal(value, other)
            if torch.is_tensor(value)
            else value == other
        )
        if not same:
            out.append(name)
    return out


def save_load_resume(
    scenario: Scenario,
    directory: str,
    sharding: str,
    fully_parallel: bool,
    with_control: bool = False,
):
    """On each rank: the uninterrupted run; the run saved after ``SAVE_AFTER`` steps, loaded
    into a model and optimizer built from another seed, and trained on. ``with_control``: the
    same load once more, into another build, with its first layer-wise master moved by one ulp
    right after (:mod:`tests.support.resume_controls`), compared and trained on the same way
    (``result["control"]``)."""
    from megatron.core import parallel_state

    from tests.support import dist_checkpoints as ckpt
    from tests.support.training import train_step

    dp_rank = parallel_state.get_data_parallel_rank()
    model, optimizer = _build(scenario, scenario.seed)
    reference = [train_step(scenario, model, optimizer, s, dp_rank) for s in range(scenario.steps)]
    final_weights = ckpt.weight_snapshot(model[0].module)
    final_state = ckpt.optimizer_snapshot(optimizer, model[0].module)

    model, optimizer = _build(scenario, scenario.seed)
    losses = [train_step(scenario, model, optimizer, s, dp_rank) for s in range(SAVE_AFTER)]
    saved_weights = ckpt.weight_values(model[0].module)
    saved_state = ckpt.optimizer_snapshot(optimizer, model[0].module)
    ckpt.save_torch_dist(model, optimizer, directory, sharding, fully_parallel=fully_parallel)

    model, optimizer = _build(scenario, scenario.seed + 1)
    fresh_state = ckpt.optimizer_snapshot(optimizer, model[0].module)
    ckpt.load_torch_dist(model, optimizer, directory, fully_parallel=fully_parallel)
    loaded_weights = ckpt.weight_values(model[0].module)
    loaded_state = ckpt.optimizer_snapshot(optimizer, model[0].module)
    losses += [train_step(scenario, model, optimizer, s, dp_rank) for s in range(SAVE_AFTER, 5)]
    final_weights_differ = _mismatches(final_weights, ckpt.weight_snapshot(model[0].module))
    final_state_differ = _mismatches(
        final_state, ckpt.optimizer_snapshot(optimizer, model[0].module)
    )
    control = None
    if with_control:
        from tests.support.resume_controls import nudge_first_layer_wise_master

        model, optimizer = _build(scenario, scenario.seed + 1)
        ckpt.load_torch_dist(model, optimizer, directory, fully_parallel=fully_parallel)
        nudge_first_layer_wise_master(optimizer)
        nudged_state = ckpt.optimizer_snapshot(optimizer, model[0].module)
        for s in range(SAVE_AFTER, 5):
            train_step(scenario, model, optimizer, s, dp_rank)
        control = {
            "state_differ": _mismatches(saved_state, nudged_state),
            "final_state_differ": _mismatches(
                final_state, ckpt.optimizer_snapshot(optimizer, model[0].module)
            ),
        }
    return {
        "control": control,
        "reference": reference,
        "losses": losses,
        "weights_differ": _mismatches(saved_weights, loaded_weights),
        "state_differ": _mismatches(saved_state, loaded_state),
        # The fresh build differs from the checkpoint: a load that did nothing cannot pass.
        "fresh_differs": bool(_mismatches(saved_state, fresh_state)),
        "state_names": sorted(saved_state),
        "final_weights_differ": final_weights_differ,
        "final_state_differ": final_state_differ,
    }


#: (sharding, fully_parallel) -> per-rank results of :func:`save_load_resume`, kept for the
#: control (the ``dp_reshardable`` run carries it).
_ROUND_TRIPS: dict[tuple[str, bool], list[dict]] = {}


def _round_trip(sharding: str, fully_parallel: bool, directory: str) -> list[dict]:
    """:func:`save_load_resume` on the ranks, once per session per setting, probed per build."""
    key = (sharding, fully_parallel)
    if key not in _ROUND_TRIPS:
        _ROUND_TRIPS[key] = run_on_ranks(
            probe.run_probed_per_build, save_load_resume, BASE, directory, sharding,
            fully_parallel, sharding == "dp_reshardable", boot=FP8, timeout=400,
        )  # fmt: skip
    return _ROUND_TRIPS[key]


@pytest.mark.parametrize(
    ("sharding", "fully_parallel"),
    [("dp_reshardable", True), ("fully_reshardable", False)],
    ids=["dp_reshardable-fully-parallel", "fully_reshardable"],
)
def test_torch_dist_round_trip_is_bitwise(sharding, fully_parallel, tmp_path):
    results = _round_trip(sharding, fully_parallel, str(tmp_path))
    probe.assert_each_build_reduced_to_owners(results, sharding)
    for rank, result in enumerate(results):
        names = result["state_names"]
        # What must be in the checkpoint: fp32 masters of both optimizers, Muon's momentum,
        # Adam's moments, the Adam step.
        for kind in ("layerwise:master:", "layerwise:momentum_buffer:", "distopt:master:",
                     "distopt:exp_avg:", "distopt:exp_avg_sq:", "distopt:steps"):  # fmt: skip
            assert any(name.startswith(kind) for name in names), (rank, kind, names)
        assert result["fresh_differs"], rank
        assert result["weights_differ"] == [], (rank, result["weights_differ"])
        assert result["state_differ"] == [], (rank, result["state_differ"])
        assert result["losses"] == result["reference"], rank  # exact float equality
        assert result["final_weights_differ"] == [], (rank, result["final_weights_differ"])
        assert result["final_state_differ"] == [], (rank, result["final_state_differ"])


def test_control_round_trip_with_a_master_one_ulp_off_differs(tmp_path):
    """Control of ``test_torch_dist_round_trip_is_bitwise`` (``dp_reshardable``, fully
    parallel): the same checkpoint loaded once more in the same rank task, with each rank's
    first layer-wise master moved up by one ulp after the load: the same state comparison
    names exactly that master, and after training on the final state differs too (masters at
    least; the run is the test's own when it ran first in this session)."""
    results = _round_trip("dp_reshardable", True, str(tmp_path))
    for rank, result in enumerate(results):
        control = result["control"]
        nudged = [n for n in control["state_differ"] if n.startswith("layerwise:master:")]
        assert len(nudged) == 1 and control["state_differ"] == nudged, (rank, control)
        assert any(n.startswith("layerwise:master:") for n in control["final_state_differ"])


# --------------------------------------------------------------------------- exact resume

#: A master value far below its row block's largest (1.0) but the largest of its column block:
#: MXFP8's rowwise copy rounds it to zero, the columnwise copy keeps it.
TINY = 2.0**-20


def _plant_row_column_split(main_param: torch.Tensor) -> None:
    """Make the first 32 x 32 tile of a master one whose weight's columnwise copy cannot be
    re-made from its rowwise copy: every row's block has amax 1.0 (column 0), column 1's block
    holds ``TINY`` in every row (rowwise: a zero code; columnwise: exact)."""
    tile = main_param.data[:32, :32]
    tile.zero_()
    tile[:, 0] = 1.0
    tile[:, 1] = TINY


def planted_round_trip(scenario: Scenario, directory: str, rederive: bool) -> dict:
    """Train, plant :func:`_plant_row_column_split` into each owned MXFP8 master, gather, save;
    load into a build from another seed (with the load's re-derivation reverted when
    ``rederive`` is False) and report which weights' rowwise / columnwise values differ."""
    from megatron.core import parallel_state
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    from nemo_lw_fp8.mechanics import checkpointing, masters
    from nemo_lw_fp8.patches import framework
    from tests.support import dist_checkpoints as ckpt
    from tests.support.training import train_step

    def layer_wise(optimizer):
        if isinstance(optimizer, LayerWiseDistributedOptimizer):
            return optimizer
        return next(c for c in optimizer.chained_optimizers if layer_wise(c) is not None)

    dp_rank = parallel_state.get_data_parallel_rank()
    model, optimizer = _build(scenario, scenario.seed)
    for step in range(SAVE_AFTER):
        train_step(scenario, model, optimizer, step, dp_rank)
    names = {id(p): n for n, p in model[0].module.named_parameters()}
    planted = []
    lw = layer_wise(optimizer)
    for child in masters.float16_children(lw):
        for model_param, main_param in masters.model_main_pairs(child):
            if getattr(model_param, "_rowwise_data", None) is not None:
                _plant_row_column_split(main_param)
                planted.append(names[id(model_param)])
    checkpointing.rederive_weights_from_masters(lw)  # the planted masters reach the weights
    saved = ckpt.weight_values(model[0].module)
    ckpt.save_torch_dist(model, optimizer, directory, "dp_reshardable", fully_parallel=True)

    model, optimizer = _build(scenario, scenario.seed + 1)
    if not rederive:
        framework.revert(["layer_wise_load_rederive"])
    ckpt.load_torch_dist(model, optimizer, directory, fully_parallel=True)
    loaded = ckpt.weight_values(model[0].module)
    losses = [train_step(scenario, model, optimizer, s, dp_rank) for s in range(SAVE_AFTER, 5)]
    return {
        "losses": losses,
        "planted": planted,
        # The premise: the saved rowwise copy lost the planted value, the columnwise one kept it.
        "premise": [
            bool(saved[f"{n}:rowwise"][0, 1] == 0 and saved[f"{n}:columnwise"][0, 1] == TINY)
            for n in planted
        ],
        "weights_differ": _mismatches(saved, loaded),
    }


def _same_weights(reference: list[dict], results: list[dict]) -> None:
    for rank, result in enumerate(results):
        assert result["weights_differ"] == [], (rank, result["weights_differ"])


def test_load_rederives_fp8_weights_from_masters(tmp_path):
    """Exact resume by construction: a load rebuilds every MXFP8 weight from the loaded fp32
    masters (patch ``layer_wise_load_rederive``), so a weight whose columnwise copy cannot be
    re-made from the rowwise values the checkpoint holds comes back with both copies intact.
    Control: with the re-derivation reverted, the planted weights' columnwise copies come back
    as ``Q_col(D_row(W))`` and differ (others may too, where training left such an element)."""
    (tmp_path / "on").mkdir(), (tmp_path / "off").mkdir()
    results = run_on_ranks(planted_round_trip, BASE, str(tmp_path / "on"), True, boot=FP8,
                           timeout=400)  # fmt: skip
    assert sum(len(r["planted"]) for r in results) > 0
    assert all(all(r["premise"]) for r in results)
    _same_weights(results, results)

    control = run_on_ranks(planted_round_trip, BASE, str(tmp_path / "off"), False, boot=FP8,
                           timeout=400)  # fmt: skip
    assert_diverges(results, control, _same_weights)
    for result in control:
        differ = set(result["weights_differ"])
        assert {f"{n}:columnwise" for n in result["planted"]} <= differ
        assert not any(name.endswith(":rowwise") for name in differ)


# --------------------------------------------------------------------------- megatron.training


def _mutate_one_of_each(optimizer, module) -> list[str]:
    """Control: after the snapshot, before the save, change element 0 of this rank's first
    layer-wise fp32 master, first Muon momentum and first Adam ``exp_avg`` shard."""
    from tests.support import dist_checkpoints as ckpt

    live = ckpt.optimizer_tensors(optimizer, module)
    mutated = []
    for kind in ("layerwise:master:", "layerwise:momentum_buffer:", "distopt:exp_avg:"):
        name = next(k for k in sorted(live) if k.startswith(kind) and live[k].numel())
        with torch.no_grad():
            live[name].view(-1)[0] += 1.0
        mutated.append(name)
    return sorted(mutated)


def training_round_trip(
    scenario: Scenario, directory: str, fully_reshardable: bool, mutate: bool = False
) -> dict:
    """On each rank, with megatron-training's args and globals: train ``SAVE_AFTER`` steps, save
    through ``megatron.training.checkpointing.save_checkpoint``, train one more step (the run
    that never stopped); build the model and optimizer from another seed, load through
    ``load_checkpoint``, train that step again. ``mutate``: the control."""
    import os

    from megatron.core import dist_checkpointing, parallel_state
    from megatron.training import arguments

    import nemo_lw_fp8
    from tests.support import dist_checkpoints as ckpt
    from tests.support.training import train_step

    def state(model, optimizer, losses: list[float], iteration: int) -> dict:
        module = model[0].module
        return {
            "losses": list(losses),
            "iteration": iteration,
            "weights": ckpt.weight_values(module),
            "state": ckpt.optimizer_snapshot(optimizer, module),
        }

    nemo_lw_fp8.apply()  # first, as a training script does: validate_args runs the plugin's rules
    guarded = hasattr(arguments.validate_args, "__wrapped__")
    dp_rank = parallel_state.get_data_parallel_rank()
    steps = range(SAVE_AFTER)
    with ckpt.training_globals(ckpt.training_args(directory, fully_reshardable)):
        model, optimizer = _build(scenario, scenario.seed)
        ckpt.give_sharded_state_dict(model[0].module)
        losses = [train_step(scenario, model, optimizer, s, dp_rank) for s in steps]
        saved = state(model, optimizer, losses, SAVE_AFTER)
        mutated = _mutate_one_of_each(optimizer, model[0].module) if mutate else []
        ckpt.training_save(model, optimizer, SAVE_AFTER)
        went_on = state(
            model, optimizer, [train_step(scenario, model, optimizer, SAVE_AFTER, dp_rank)], 0
        )

        model, optimizer = _build(scenario, scenario.seed + 1)
        ckpt.give_sharded_state_dict(model[0].module)
        fresh = state(model, optimizer, losses, SAVE_AFTER)
        loaded = state(model, optimizer, losses, ckpt.training_load(model, optimizer))
        resumed = state(
            model, optimizer, [train_step(scenario, model, optimizer, SAVE_AFTER, dp_rank)], 0
        )
    written = os.path.join(directory, f"iter_{SAVE_AFTER:07d}")
    return {
        "guarded": guarded,
        "content_metadata": dist_checkpointing.load_content_metadata(written),
        "saved": saved,
        "loaded": loaded,
        "went_on": went_on,
        "resumed": resumed,
        "mutated": mutated,
        # The fresh build differs from the checkpoint: a load that did nothing cannot pass.
        "fresh_differs": bool(_mismatches(saved["state"], fresh["state"]))
        and bool(_mismatches(saved["weights"], fresh["weights"])),
    }


def assert_same_state(before: list[dict], after: list[dict]) -> None:
    """Per rank: iteration, losses, the weights the GEMMs read, every fp32 master, Muon
    momentum, Adam moment and step, equal to the bit."""
    for rank, (a, b) in enumerate(zip(before, after, strict=True)):
        assert a["iteration"] == b["iteration"], (rank, a["iteration"], b["iteration"])
        assert a["losses"] == b["losses"], (rank, a["losses"], b["losses"])
        differ = _mismatches(a["state"], b["state"])
        assert differ == [], f"rank {rank}: optimizer state differs: {differ}"
        assert _mismatches(a["weights"], b["weights"]) == [], (rank, "weights")


@pytest.mark.parametrize(
    "fully_reshardable", [False, True], ids=["dp_reshardable", "fully_reshardable"]
)
def test_megatron_training_checkpoint_round_trip_is_bitwise(fully_reshardable, tmp_path):
    results = run_on_ranks(
        probe.run_probed_per_build, training_round_trip, BASE, str(tmp_path), fully_reshardable,
        boot=FP8, timeout=400,
    )  # fmt: skip
    probe.assert_each_build_reduced_to_owners(results, "megatron-training round trip")
    for rank, result in enumerate(results):
        names = sorted(result["saved"]["state"])
        for kind in ("layerwise:master:", "layerwise:momentum_buffer:", "distopt:master:",
                     "distopt:exp_avg:", "distopt:exp_avg_sq:", "distopt:steps"):  # fmt: skip
            assert any(name.startswith(kind) for name in names), (rank, kind, names)
        assert result["fresh_differs"], rank
        assert result["guarded"], "the plugin's rules did not run in validate_args"
        # megatron-training names the sibling DistributedOptimizer's sharding type.
        sharding = "fully_reshardable" if fully_reshardable else "dp_reshardable"
        assert result["content_metadata"]["distrib_optim_sharding_type"] == sharding, rank
    assert_same_state([r["saved"] for r in results], [r["loaded"] for r in results])
    # Training goes on as the run that never stopped.
    assert_same_state([r["went_on"] for r in results], [r["resumed"] for r in results])


def test_megatron_training_checkpoint_control_detects_a_changed_state(tmp_path):
    """Control: state changed between the snapshot and the save must come back as a mismatch
    of exactly the changed entries (a completed run, not a crash), and the load derives the
    weights from the loaded masters: only the changed master's weight can differ."""
    results = run_on_ranks(
        training_round_trip, BASE, str(tmp_path), False, mutate=True, boot=FP8, timeout=400
    )
    saved, loaded = [r["saved"] for r in results], [r["loaded"] for r in results]
    assert_diverges(saved, loaded, compare=assert_same_state, match="optimizer state differs")
    # Every rank holds every weight: the ones whose masters some rank changed may differ.
    changed = {
        name.removeprefix("layerwise:master:")
        for result in results
        for name in result["mutated"]
        if name.startswith("layerwise:master:")
    }
    for rank, result in enumerate(results):
        assert len(result["mutated"]) == 3, rank
        differ = sorted(_mismatches(result["saved"]["state"], result["loaded"]["state"]))
        assert differ == result["mutated"], (rank, differ)
        weights = _mismatches(result["saved"]["weights"], result["loaded"]["weights"])
        assert weights and {w.split(":")[0] for w in weights} <= changed, (rank, weights)


# --------------------------------------------------------------------------- the CPU backend


def empty_tensors_match_te(cases: list[tuple[str, bool, bool, bool]]) -> list[str]:
    """``Quantizer.make_empty`` through the CPU ``transformer_engine_torch``: the class and inner
    buffers TE's Python declares for each quantizer (``inner_tensor_specs``, which mirrors the
    C++ ``create_tensor``)."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

    problems = []
    shape = (256, 384)
    for kind, rowwise, columnwise, internal in cases:
        if kind == "mxfp8":
            quantizer = MXFP8Quantizer(
                tex.DType.kFloat8E4M3, rowwise=rowwise, columnwise=columnwise
            )
        else:
            quantizer = Float8BlockQuantizer(
                tex.DType.kFloat8E4M3, rowwise=rowwise, columnwise=columnwise,
                block_scaling_dim=2 if kind == "blockwise2d" else 1,
            )  # fmt: skip
        quantizer.internal = internal
        empty = quantizer.make_empty(shape, dtype=torch.bfloat16, device="cpu")
        meta = quantizer.storage_metadata(torch.bfloat16)
        if type(empty) is not meta["cls"]:
            problems.append(f"{kind}: {type(empty).__name__} is not {meta['cls'].__name__}")
        specs = quantizer.inner_tensor_specs(shape)
        for attr, _ in type(empty)._INNER_TENSORS:
            buffer = getattr(empty, attr)
            if attr not in specs:
                if buffer is not None:
                    problems.append(f"{kind}: {attr} allocated for an unused usage")
                continue
            want_shape, want_dtype = specs[attr]
            if buffer is None or tuple(buffer.shape) != tuple(want_shape):
                problems.append(f"{kind}: {attr} {None if buffer is None else buffer.shape}")
            elif buffer.dtype != want_dtype:
                problems.append(f"{kind}: {attr} dtype {buffer.dtype} != {want_dtype}")
        if not internal and (tuple(empty.shape) != shape or empty.dtype != torch.bfloat16):
            problems.append(f"{kind}: logical {tuple(empty.shape)} {empty.dtype}")
        if not internal:
            like = torch.empty_like(empty)  # megatron's fully parallel load exchange
            if type(like) is not type(empty) or like.get_usages() != empty.get_usages():
                problems.append(f"{kind}: empty_like gave {type(like).__name__}")
    return problems


def test_make_empty_quantized_tensors_on_cpu():
    cases = [
        (kind, rowwise, columnwise, internal)
        for kind in ("mxfp8", "blockwise1d", "blockwise2d")
        for rowwise, columnwise in ((True, True), (True, False), (False, True))
        for internal in (False, True)
    ]
    [problems] = run_on_ranks(empty_tensors_match_te, cases, world_size=1, boot=FP8)
    assert problems == []


def cpu_adam_state_layout() -> dict:
    """megatron's Adam on CPU keeps FusedAdam's layout: moments per parameter, step per group."""
    import megatron.core.optimizer as megatron_optimizer

    from nemo_lw_fp8.cpu.megatron.fused_adam import CPUFusedAdam

    assert megatron_optimizer.Adam is CPUFusedAdam
    assert not megatron_optimizer.USING_PYTORCH_OPTIMIZER
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))]
    optimizer = CPUFusedAdam([{"params": params}, {"params": []}], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()
    state = optimizer.state_dict()
    restored = CPUFusedAdam([{"params": [p.detach().clone() for p in params]}, {"params": []}])
    restored.load_state_dict(state)
    return {
        "group_steps": [group["step"] for group in optimizer.param_groups],
        "keys": sorted({key for s in optimizer.state.values() for key in s}),
        "restored": all(
            torch.equal(restored.state[r][key], optimizer.state[p][key])
            and restored.state[r][key].dtype == torch.float32
            for p, r in zip(params, restored.param_groups[0]["params"], strict=True)
            for key in ("exp_avg", "exp_avg_sq")
        ),
    }


def test_cpu_adam_keeps_fused_adams_state_layout():
    [result] = run_on_ranks(cpu_adam_state_layout, world_size=1, boot=FP8)
    # TE 2.20.2 advances the step of empty groups too (ranks sharing a shard agree on it).
    assert result["group_steps"] == [3, 3]
    assert result["keys"] == ["exp_avg", "exp_avg_sq"]
    assert result["restored"]


# --------------------------------------------------------------------------- Bridge's save


def bridge_metadata_save(scenario: Scenario, directory: str) -> dict:
    """Megatron-Bridge's own metadata builder for a layer-wise run, with the plugin's
    ``bridge_checkpoint_sharding`` patch and (control) without it, feeding a real save."""
    import os
    import types

    import megatron.bridge.training.checkpointing as bridge_checkpointing
    from megatron.bridge.training.config import CheckpointConfig
    from megatron.core import parallel_state

    import nemo_lw_fp8
    from nemo_lw_fp8.mechanics import checkpointing
    from tests.support import dist_checkpoints as ckpt
    from tests.support.training import train_step

    nemo_lw_fp8.apply()  # Bridge is imported now: its patches apply
    dp_rank = parallel_state.get_data_parallel_rank()
    model, optimizer = _build(scenario, scenario.seed)
    train_step(scenario, model, optimizer, 0, dp_rank)
    cfg = types.SimpleNamespace(
        optimizer=types.SimpleNamespace(
            use_distributed_optimizer=False, use_layer_wise_distributed_optimizer=True
        )
    )
    ckpt_cfg = CheckpointConfig()

    def save(tag: str) -> str:
        os.makedirs(f"{directory}/{tag}", exist_ok=True)
        with checkpointing.saving_config(cfg):  # what the patched save_checkpoint does
            metadata = bridge_checkpointing._build_sharded_state_dict_metadata(False, ckpt_cfg)
        sharding = metadata.get("distrib_optim_sharding_type")
        try:
            with ckpt.in_process_write_results():
                model_sd = ckpt.model_sharded_state_dict(model, metadata)
                state = {"optimizer": optimizer.sharded_state_dict(model_sd, metadata=metadata)}
                from megatron.core import dist_checkpointing

                dist_checkpointing.save(state, f"{directory}/{tag}", async_strategy="mcore")
        except Exception as error:  # noqa: BLE001 - the control reports what megatron raised
            return f"{sharding}: {type(error).__name__}: {error}"
        return f"{sharding}: saved"

    patched = save("patched")
    nemo_lw_fp8.revert(["bridge_checkpoint_sharding"])
    stock = save("stock")
    return {"patched": patched, "stock": stock}


def test_bridge_names_the_sharding_type_of_layer_wise_saves(tmp_path):
    for result in run_on_ranks(bridge_metadata_save, BASE, str(tmp_path), boot=FP8, timeout=400):
        assert result["patched"] == "dp_reshardable: saved"
        # Control: Bridge's stock metadata has no sharding type; megatron refuses the fallback.
        assert result["stock"] == (
            "None: CheckpointingException: ShardedTensor.flattened_range is not supported."
        ), result["stock"]
