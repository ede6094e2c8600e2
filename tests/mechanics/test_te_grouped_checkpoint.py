"""``torch_dist`` checkpoints of single grouped expert weights on TE's OWN modules.

The model is a tiny MoE ``GPTModel`` built from megatron's Transformer Engine spec
(``get_gpt_layer_with_transformer_engine_spec(num_experts, moe_grouped_gemm=True)``): TE 2.20.2's
``TEGroupedMLP`` through the op fuser with single grouped expert weights (one ``GroupedTensor``
per expert linear), bf16 or MXFP8 primary weights, over the project's TE emulation. It is wrapped
in megatron DDP with the plugin's layer-wise Muon (compact layout, whole or expert-run
ownership of the grouped weights), stepped once on fixed gradients, saved with megatron's
``dist_checkpointing`` (``torch_dist``) and loaded into a build from another seed.

The model is built with ``use_cpu_initialization=False`` (TE initialises its weights, so the
high-precision init values the masters start from are the weights' own; with ``True`` megatron
writes the weights afterwards and the layer-wise optimizer refuses the stale values).

TE's module construction asks ``torch.cuda.is_available``; it is answered True during
construction only (:func:`_te_construction`), as ``tests/cpu/test_cpu_norm_linear.py`` does, until
the general scoped device answers land. Construction and ``sharded_state_dict`` need no kernel;
nothing here runs a forward.
"""

from __future__ import annotations

import contextlib
import unittest.mock

import pytest
import torch

from nemo_lw_fp8.cpu.te import backend as te_backend
from tests.support import expert_state
from tests.support.expert_state import differing as _differ
from tests.support.harness import BootOptions, run_on_ranks
from tests.support.te_moe import EXPERTS, TE_ENV, build_te_moe_gpt

if te_backend.te_package_dirs() is None:  # find, never import, TE in this process
    pytest.skip("TE's own modules need TE's Python package", allow_module_level=True)

BOOT = BootOptions(fp8_emulation=True)
#: parameters: mlp.experts.linear_fc1.weight; entries: mlp.experts.experts.linear_fc1.weight
GROUPED = "experts.linear_fc"
FEATURE = "te_grouped_checkpoint"


@contextlib.contextmanager
def _te_construction():
    """TE's module base refuses to start without CUDA; with ``use_cpu_initialization`` its
    construction does no CUDA work. Scoped to construction (a process-wide answer breaks dynamo)."""
    with unittest.mock.patch("torch.cuda.is_available", lambda: True):
        yield


def _scenario(fp8: bool, ownership: str, seed: int):
    from tests.support.scenarios import Scenario

    return Scenario(
        model="moe_grouped", single_grouped_weight=True, fp8=fp8, fp8_param_gather=fp8,
        plugin=True, optimizer="muon", distribution="layerwise_compact",
        grouped_weight_ownership=ownership, seed=seed,
    )  # fmt: skip


def build_te_moe(fp8: bool, seed: int):
    """The tiny MoE GPT from megatron's TE spec: (module, config)."""
    from tests.support.scenarios import env_scope

    quantized = dict(fp8="e4m3", fp8_recipe="mxfp8", fp8_param=True) if fp8 else {}
    return build_te_moe_gpt(
        seed, fp8, (env_scope(TE_ENV), _te_construction()), moe_ffn_hidden_size=64,
        use_cpu_initialization=False, **quantized,
    )  # fmt: skip


def _build(fp8: bool, ownership: str, seed: int):
    import nemo_lw_fp8
    from tests.support.training import wrap_and_build_optimizer

    nemo_lw_fp8.apply()
    module, config = build_te_moe(fp8, seed)
    return wrap_and_build_optimizer(module, config, _scenario(fp8, ownership, seed))


def _step(model: list, optimizer) -> None:
    """One optimizer step on fixed gradients (the same on every rank)."""
    generator = torch.Generator().manual_seed(7)
    for _, param in sorted(model[0].module.named_parameters()):
        grad = torch.randn(param.main_grad.shape, generator=generator) * 0.01
        param.main_grad.copy_(grad.to(param.main_grad.dtype))
    ok, _, _ = optimizer.step()
    assert ok


def _grouped_state(optimizer, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's fp32 masters and Muon momentum of the grouped weights, per expert, whether it
    holds a weight whole or a run of its experts."""
    return expert_state.per_expert_state(
        optimizer, module, keep=lambda name: GROUPED in name, whole_tensors=False
    )


def _runs(optimizer) -> int:
    from nemo_lw_fp8.mechanics.expert_slices import is_slice

    optimizers = expert_state.layer_wise_float16_optimizers(optimizer)
    return sum(is_slice(p) for o in optimizers for g in o.float16_groups for p in g)


def _grouped_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each expert's values of each grouped weight (MXFP8: dequantized)."""
    from nemo_lw_fp8.mechanics.grouped_checkpoint import _expert_tensors

    out = {}
    for name, param in module.named_parameters():
        if GROUPED in name:
            for expert, member in enumerate(_expert_tensors(param, EXPERTS)):
                value = member.dequantize() if hasattr(member, "dequantize") else member
                out[f"{name}:{expert}"] = value.float().clone()
    return out


def _entries(module: torch.nn.Module) -> dict[str, tuple]:
    """The model's ``torch_dist`` entries of the expert weights, built: key -> (global shape,
    global offset, local shape, replica id, axis fragmentations, dtype) per chunk."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from tests.support.dist_checkpoints import content_metadata, model_sharded_state_dict

    state = model_sharded_state_dict([_Wrapped(module)], content_metadata("dp_reshardable"))
    apply_factories(state)
    out: dict[str, tuple] = {}
    for entry in nested_values(state):
        if isinstance(entry, ShardedTensor) and GROUPED in entry.key:
            chunk = (tuple(entry.global_shape), tuple(entry.global_offset),
                     tuple(entry.local_shape), entry.replica_id,
                     tuple(entry.axis_fragmentations), str(entry.dtype))  # fmt: skip
            out.setdefault(entry.key, []).append(chunk)
    return {key: tuple(sorted(chunks)) for key, chunks in out.items()}


class _Wrapped:
    def __init__(self, module):
        self.module = module


def _on_disk(directory: str) -> dict[str, tuple]:
    """The checkpoint's tensors: key -> global shape."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(directory).read_metadata()
    return {
        key: tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if hasattr(meta, "size")
    }


def _load_stock(directory: str, fp8: bool, seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint's model weights loaded into a stock megatron model (the fix reverted)."""
    from megatron.core import dist_checkpointing

    from nemo_lw_fp8 import patches
    from tests.support.dist_checkpoints import model_sharded_state_dict

    patches.revert([FEATURE])
    try:
        module, _ = build_te_moe(fp8, seed)
        metadata = dist_checkpointing.load_content_metadata(directory)
        sharded = model_sharded_state_dict([_Wrapped(module)], metadata)
        assert any(key.endswith(".linear_fc1.weight1") for key in sharded)  # TE's own entries
        state = dist_checkpointing.load({"model": sharded}, directory)
        module.load_state_dict(state["model"])
        return _grouped_weights(module)
    finally:
        patches.apply([FEATURE])


def round_trip(directory: str, fp8: bool, ownership: str, shift_experts: bool = False) -> dict:
    """Build, step, save; load into a build from another seed; load the model weights into a
    stock model. ``shift_experts``: the control, the save writes expert e at expert e+1's slot."""
    from megatron.core import parallel_state

    from nemo_lw_fp8.mechanics import grouped_checkpoint
    from tests.support import dist_checkpoints as ckpt

    dp_rank = parallel_state.get_data_parallel_rank()
    model, optimizer = _build(fp8, ownership, seed=11)
    _step(model, optimizer)
    saved = _grouped_state(optimizer, model[0].module)
    saved_weights = _grouped_weights(model[0].module)
    runs = _runs(optimizer)
    patched_entries = _entries(model[0].module)

    with pytest.MonkeyPatch.context() as mp:
        if shift_experts:
            original = grouped_checkpoint.expert_entry

            def shifted(layout, key, tensor, expert, replica_id):
                return original(layout, key, tensor, (expert + 1) % layout.num_global_experts,
                                replica_id)  # fmt: skip

            mp.setattr(grouped_checkpoint, "expert_entry", shifted)
        ckpt.save_torch_dist(model, optimizer, directory, "dp_reshardable")

    # TE's own entries: the same model, the fix reverted.
    from nemo_lw_fp8 import patches

    patches.revert([FEATURE])
    try:
        te_entries = _entries(model[0].module)
    finally:
        patches.apply([FEATURE])

    model, optimizer = _build(fp8, ownership, seed=23)
    fresh = _grouped_state(optimizer, model[0].module)
    ckpt.load_torch_dist(model, optimizer, directory)
    loaded = _grouped_state(optimizer, model[0].module)
    loaded_weights = _grouped_weights(model[0].module)
    torch.distributed.barrier()
    stock = _load_stock(directory, fp8, seed=31)
    return {
        "saved": saved, "fresh": fresh, "loaded": loaded, "runs": runs + _runs(optimizer),
        "saved_weights": saved_weights, "loaded_weights": loaded_weights, "stock": stock,
        "patched_entries": patched_entries, "te_entries": te_entries,
        "on_disk": _on_disk(directory) if dp_rank == 0 else None,
    }  # fmt: skip


def _merged(results: list[dict], what: str) -> dict[str, torch.Tensor]:
    return expert_state.merged_over_ranks([result[what] for result in results])



CASES = [(False, "whole"), (True, "whole"), (False, "expert"), (True, "expert")]


@pytest.mark.parametrize(("fp8", "ownership"), CASES,
                         ids=[f"{'mxfp8' if f else 'bf16'}-{o}" for f, o in CASES])  # fmt: skip
def test_te_grouped_weights_round_trip_in_tes_layout(tmp_path, fp8, ownership):
    """fp32 masters and Muon momentum of TE's single grouped weights (whole, or runs of experts
    on both ranks) come back bitwise; the model's entries equal TE's own (keys, offsets, shapes,
    replica ids); on disk each optimizer tensor has its weight's key and global shape; a stock
    megatron model loads the same files' weights."""
    results = run_on_ranks(round_trip, str(tmp_path), fp8, ownership, boot=BOOT, timeout=600)
    if ownership == "expert":
        assert all(r["runs"] > 0 for r in results)
    saved, loaded = _merged(results, "saved"), _merged(results, "loaded")
    assert {name.split(":")[0] for name in saved} == {"master", "momentum_buffer"}
    assert len(saved) == 2 * 2 * 2 * EXPERTS  # (master, momentum) x layers x (fc1, fc2) x E
    assert _differ(saved, loaded) == []
    fresh = _merged(results, "fresh")
    masters = [name for name in saved if name.startswith("master:")]
    assert all(not torch.equal(saved[n], fresh[n]) for n in masters)  # a no-op load cannot pass
    for result in results:
        assert result["patched_entries"] == result["te_entries"]
        assert len(result["te_entries"]) == 2  # fc1, fc2 (layers stacked: axis 0)
        assert _differ(result["saved_weights"], result["loaded_weights"]) == []
        assert _differ(result["saved_weights"], result["stock"]) == []
    disk = results[0]["on_disk"]
    weights = {k: shape for k, shape in disk.items() if GROUPED in k and "optimizer" not in k}
    assert sorted(weights) == sorted(results[0]["te_entries"])
    for key, shape in weights.items():
        assert shape[:2] == (2, EXPERTS)  # (layers, global experts, out, in)
        for kind in ("fp32_param", "momentum_buffer"):
            assert disk[f"chained_0.optimizer.state.{kind}.{key}"] == shape, (kind, key)


def save_without_fix(directory: str) -> str:
    """The control: TE's per-expert entries as megatron writes them (the fix reverted)."""
    import traceback

    from nemo_lw_fp8 import patches
    from tests.support import dist_checkpoints as ckpt

    model, optimizer = _build(False, "whole", seed=11)  # applies every patch
    _step(model, optimizer)
    patches.revert([FEATURE])
    try:
        try:
            ckpt.save_torch_dist(model, optimizer, directory, "dp_reshardable")
        except KeyError as exc:
            frames = traceback.extract_tb(exc.__traceback__)
            where = [f"{f.filename.split('site-packages/')[-1]}:{f.name}" for f in frames]
            return f"KeyError {exc!r} in " + " > ".join(where) + f" at: {frames[-1].line}"
        return "saved"
    finally:
        patches.apply([FEATURE])


def test_control_without_the_fix_the_save_raises_key_error(tmp_path):
    """Without the patch megatron's Float16 optimizer finds no entry for the grouped parameter
    (identity lookup over TE's per-expert entries) and raises KeyError at the save."""
    results = run_on_ranks(save_without_fix, str(tmp_path), boot=BOOT, timeout=600)
    for result in results:
        assert result.startswith("KeyError"), result
        # raised where megatron's Float16 optimizer maps its fp32 masters to model entries
        # raised by megatron's Float16 optimizer, under the layer-wise one, where it looks its
        # parameters up in the model's entries by identity
        assert ("layer_wise_optimizer.py:sharded_state_dict > megatron/core/optimizer/"
                "optimizer.py:sharded_state_dict > megatron/core/optimizer/optimizer.py:"
                "sharded_state_dict at: ") in result, result
        assert "id_to_sharded_param_map[" in result.split(" at: ")[1], result


def test_control_shifted_expert_offsets_diverge(tmp_path):
    """A save that writes expert e at expert e+1's offset loads back other masters, momentum and
    weights: the offsets are what the round trip checks."""
    results = run_on_ranks(round_trip, str(tmp_path), False, "whole", True, boot=BOOT,
                           timeout=600)  # fmt: skip
    saved, loaded = _merged(results, "saved"), _merged(results, "loaded")
    differ = _differ(saved, loaded)
    assert len(differ) == len(saved), differ
    for result in results:
        assert _differ(result["saved_weights"], result["loaded_weights"])
        assert _differ(result["saved_weights"], result["stock"])
