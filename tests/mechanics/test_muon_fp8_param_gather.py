"""Layer-wise Muon with MXFP8 param all-gather is bitwise identical to FP8 param gather off.

The OFF run keeps bf16 weights and quantizes them on the fly for the MXFP8 GEMMs; the ON run keeps
persistent MXFP8 weights, stages bf16 masters in the grad buffer and gathers them. Both start from
the same bf16 initial values, train 5 Muon steps (Adam for biases and norms) on CPU ranks with
TE's own MXFP8 classes over the exact emulation, and are compared with atol = rtol = 0.

The mutation tests switch each fix of the patches off on its own and show that a test here fails.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import owner_reduce_probe as probe
from tests.support.fp8_mlp import FP8_BOOT, MUON_FP8_MLP, skip_module_without_te
from tests.support.harness import RankFailure, run_on_ranks
from tests.support.mutations import switched_off, train_with_step_off
from tests.support.parity import assert_diverges, assert_same_steps
from tests.support.parity import assert_fp8_gather_parity as assert_bitwise
from tests.support.resumable import resume_mismatches, run_on_fresh_ranks, runs_to_resume
from tests.support.scenarios import Scenario
from tests.support.te_helpers import rowwise_only_refresh
from tests.support.training import train

skip_module_without_te("the MXFP8 emulation needs TE's Python package")

FP8 = FP8_BOOT
BASE = MUON_FP8_MLP


def run(scenario: Scenario, world_size: int = 2) -> list[dict]:
    """``train(scenario)``; on the compact layout probed for what its grad syncs issued
    (``tests/support/owner_reduce_probe.py``)."""
    fn = probe.train_probed if probe.owner_reduced(scenario) else train
    return run_on_ranks(fn, scenario, world_size=world_size, boot=FP8)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
@pytest.mark.parametrize("bucket_size", [None, 4096], ids=["one-bucket", "bucketed"])
def test_fp8_param_gather_on_equals_off(world_size, overlap, bucket_size):
    off = run(BASE.with_(overlap=overlap, bucket_size=bucket_size), world_size)
    on = run(
        BASE.with_(overlap=overlap, bucket_size=bucket_size, fp8_param_gather=True), world_size
    )
    # The model's buckets must form a mixed group: layer-wise MXFP8 + DistOpt bf16 buckets.
    groups = on[0]["bucket_groups"]
    assert any(
        {kind.split(":")[0] for kind in group} == {"layerwise", "distopt"} for group in groups
    ), f"no mixed bucket group in {groups}"
    if bucket_size is not None and world_size == 2:
        # (At DP 4, 0.19.2's padding floor, 0.9 * dp * largest matrix, keeps one bucket.)
        assert len(groups) > 1
    assert_bitwise(off, on)


def test_stock_megatron_is_not_bitwise():
    """Control: without the plugin, FP8 param gather with layer-wise Muon trains wrongly."""
    off = run(BASE)
    on = run(BASE.with_(fp8_param_gather=True, plugin=False))
    assert_diverges(off, on)


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_train_eval_train_equals_train_train(overlap):
    scenario = BASE.with_(overlap=overlap, fp8_param_gather=True)
    plain = run(scenario)
    with_eval = run(scenario.with_(eval_after=(1, 3)))
    assert_same_steps(plain, with_eval)
    # And the eval itself saw the same model as with FP8 param gather off.
    off = run(scenario.with_(fp8_param_gather=False, eval_after=(1, 3)))
    assert_bitwise(off, with_eval)


@pytest.mark.parametrize("distribution", ["layerwise_padded", "layerwise_compact"])
def test_eval_with_pre_hooks_on_equals_off(distribution):
    """megatron-training's and Bridge's loops evaluate a layer-wise run with the pre-hooks on (no
    forced sync, no zero_grad_buffer): the first eval forward must still gather the last step's
    params, Adam's included, not what the grad buffer holds. On the compact layout both runs'
    grad syncs were owner reduces (the probe)."""
    scenario = BASE.with_(
        distribution=distribution,
        overlap=True,
        eval_after=(1, 3),
        eval_pre_hooks=True,
        plugin=True,
    )
    off = run(scenario)
    on = run(scenario.with_(fp8_param_gather=True))
    if probe.owner_reduced(scenario):
        probe.assert_reduced_to_owners(off, "gather off")
        probe.assert_reduced_to_owners(on, "gather on")
    assert_bitwise(off, on)


# --------------------------------------------------------------------------- mutation checks


def _stock_owned_buckets(bucket_group, layer_wise):
    """0.19.2's rule: the whole group belongs to whoever owns its first bucket."""
    from nemo_lw_fp8.mechanics.bucket_owners import owned_by_layer_wise

    first_is_layer_wise = owned_by_layer_wise(bucket_group.buckets[0])
    return list(bucket_group.buckets) if first_is_layer_wise == layer_wise else []


def _stock_chained_prepare(self):
    """megatron-core's own ChainedOptimizer.prepare_model_params_for_param_sync."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    from nemo_lw_fp8.patches import original

    return original(ChainedOptimizer, "prepare_model_params_for_param_sync")(self)


#: fix name -> (module, attribute, replacement that undoes the fix)
MUTATIONS = {
    "master_init": ("masters", "init_masters_from_high_precision", None),
    "staging": ("staging", "stage_owned_masters", None),
    "per_bucket_ownership": ("bucket_owners", "owned_buckets", _stock_owned_buckets),
    "restage_after_zero": ("staging", "restage_after_zero", None),
    "ordering": ("staging", "prepare_chained", _stock_chained_prepare),
    "skip_requantize": ("masters", "skip_requantize_on_inner_step", None),
    "stage_before_hook_gather": ("staging", "stage_if_unstaged", None),
}


def first_step_touches_mxfp8_weights(scenario: Scenario) -> bool:
    """Whether the optimizer step itself (before any gather) rewrites MXFP8 weight bytes."""
    from megatron.core import parallel_state
    from megatron.training.training import disable_forward_pre_hook

    from tests.support.scenarios import build_model
    from tests.support.training import train_step, wrap_and_build_optimizer

    module, config = build_model(scenario)
    model, optimizer = wrap_and_build_optimizer(module, config, scenario)
    disable_forward_pre_hook(model, param_sync=False)  # as megatron's first iteration
    quantized = [p for p in module.parameters() if hasattr(p, "_rowwise_data")]
    before = [p._rowwise_data.clone() for p in quantized]
    train_step(scenario, model, optimizer, 0, parallel_state.get_data_parallel_rank())
    return any(not torch.equal(b, p._rowwise_data) for b, p in zip(before, quantized, strict=True))


def first_step_touches_mxfp8_weights_mutated(scenario: Scenario, fix: str) -> bool:
    with switched_off(MUTATIONS, fix):
        return first_step_touches_mxfp8_weights(scenario)


def test_inner_step_does_not_requantize_mxfp8_weights():
    scenario = BASE.with_(overlap=True, fp8_param_gather=True)
    assert not any(run_on_ranks(first_step_touches_mxfp8_weights, scenario, boot=FP8))
    mutated_results = run_on_ranks(
        first_step_touches_mxfp8_weights_mutated, scenario, "skip_requantize", boot=FP8
    )
    assert any(mutated_results), "switching the fix off did not change the step"


@pytest.mark.parametrize(
    "fix, overlap, eval_after",
    [
        ("master_init", False, ()),
        ("staging", False, ()),
        ("per_bucket_ownership", False, ()),
        # The first gather after a step stages what the step left unstaged (whatever zeroed the
        # buffers before it); the re-stage is what survives a zero that follows a staging with
        # no step in between: the forced sync of an eval, then the next step's zero_grad_buffer.
        ("restage_after_zero", True, (1, 3)),
        ("ordering", True, ()),
    ],
)
def test_each_fix_is_needed(fix, overlap, eval_after):
    scenario = BASE.with_(overlap=overlap, eval_after=eval_after)
    off = run(scenario)
    on = run_on_ranks(
        train_with_step_off, scenario.with_(fp8_param_gather=True), MUTATIONS, fix, boot=FP8
    )
    assert_diverges(off, on)


@pytest.mark.parametrize("distribution", ["layerwise_padded", "layerwise_compact"])
def test_eval_with_pre_hooks_needs_staging_before_the_gather(distribution):
    scenario = BASE.with_(
        distribution=distribution, overlap=True, eval_after=(1, 3), eval_pre_hooks=True
    )
    off = run(scenario)
    on = run_on_ranks(
        train_with_step_off,
        scenario.with_(fp8_param_gather=True),
        MUTATIONS,
        "stage_before_hook_gather",
        boot=FP8,
    )
    assert_diverges(off, on, match="eval losses differ")


def train_with_stale_columnwise(scenario: Scenario) -> dict:
    """Mutation: every re-quantization of an MXFP8 weight (the gathers' copy into the
    persistent weights) updates the rowwise copy only; the columnwise copy keeps its bytes."""
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

    with pytest.MonkeyPatch.context() as mp:
        stale = rowwise_only_refresh(MXFP8Quantizer.update_quantized)
        mp.setattr(MXFP8Quantizer, "update_quantized", stale)
        return train(scenario)


def test_dgrad_needs_the_columnwise_refresh_after_the_gather():
    """The CPU MXFP8 linear's dgrad reads the weight's columnwise copy, as TE's does: a gather
    that leaves it stale gives other gradients, and FP8 gather ON differs from OFF."""
    off = run(BASE)
    on = run_on_ranks(train_with_stale_columnwise, BASE.with_(fp8_param_gather=True), boot=FP8)
    what = assert_diverges(off, on)
    # Training itself diverged (not only the stored copies): the gradients came from the stale
    # columnwise copy. The first step's forward and backward read the initial, current copies.
    assert "losses" in what, what
    assert off[0]["losses"][:2] == on[0]["losses"][:2], what


# --------------------------------------------------------------------------- guards


def build_with(scenario: Scenario) -> str:
    from tests.support.scenarios import build_model
    from tests.support.training import wrap_and_build_optimizer

    module, config = build_model(scenario)
    wrap_and_build_optimizer(module, config, scenario)
    return "built"


def test_a_recipe_other_than_the_parameters_is_rejected_when_the_optimizer_is_built():
    """MXFP8 parameters with ``OptimizerConfig.fp8_recipe='tensorwise'``: the recipe is read from
    the parameters (issue 20), and the optimizer config that disagrees is refused, naming both."""
    scenario = BASE.with_(fp8_param_gather=True, fp8_recipe="tensorwise")
    with pytest.raises(RankFailure) as info:
        run_on_ranks(build_with, scenario, boot=FP8)
    assert "fp8-recipe-agreement" in str(info.value)
    assert "--fp8-recipe mxfp8" in str(info.value)
    assert "from OptimizerConfig.fp8_recipe" in str(info.value)


# --------------------------------------------------------------------------- checkpoint resume


def _resume_runs(overlap: bool, directory: str) -> tuple[list[dict], list[dict], str]:
    """6 uninterrupted steps, the first 3 steps that saved and the checkpoint directory: a
    resume test's runs, made once per session and kept for its control."""
    scenario = BASE.with_(overlap=overlap, fp8_param_gather=True, steps=6)
    return runs_to_resume(scenario, directory, FP8)


def _resume_mismatches(
    uninterrupted: list[dict], first: list[dict], resumed: list[dict]
) -> list[str]:
    """What of the resumed run differs from the run that never stopped: losses, digest, every
    fp32 master (by name), the probe's forward output; per rank. Empty when nothing does."""
    before = [r["losses"] for r in first]
    return resume_mismatches(uninterrupted, before, resumed, {"masters": "master"}, probe=True)


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_checkpoint_resume_in_fresh_processes_is_bitwise(overlap, tmp_path):
    """Save after 3 steps, start new rank processes, load, run steps 3-5: same bits as 6 steps."""
    scenario = BASE.with_(overlap=overlap, fp8_param_gather=True, steps=6)
    uninterrupted, first, directory = _resume_runs(overlap, str(tmp_path))
    resumed = run_on_fresh_ranks(train, scenario.with_(first_step=3, load_dir=directory), boot=FP8)
    assert _resume_mismatches(uninterrupted, first, resumed) == []


def test_control_resume_with_a_master_one_ulp_off_differs(tmp_path):
    """Control of ``test_checkpoint_resume_in_fresh_processes_is_bitwise`` (no overlap): the
    resumed run with each rank's first layer-wise master moved up by one ulp after the load
    completes and fails the same comparison with the same uninterrupted run (the test's own,
    when it ran first in this session), in the masters."""
    from tests.support.resume_controls import train_with_a_nudged_loaded_master

    uninterrupted, first, directory = _resume_runs(False, str(tmp_path))
    scenario = BASE.with_(fp8_param_gather=True, steps=6, first_step=3, load_dir=directory)
    nudged = run_on_ranks(train_with_a_nudged_loaded_master, scenario, world_size=2, boot=FP8)
    bad = _resume_mismatches(uninterrupted, first, nudged)
    assert any(" master " in item for item in bad), bad
