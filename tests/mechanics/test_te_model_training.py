"""A model built from megatron's Transformer Engine spec trains on CPU with the plugin's layer-wise
Muon (issue 28, "one model path"): TE 2.20.2's own ``TELayerNormColumnParallelLinear``,
``TERowParallelLinear``, ``TEDotProductAttention`` (unfused backend) and ``TEGroupedMLP`` through
the op fuser with single grouped MXFP8 expert weights (``ops.GroupedLinear`` + ``ScaledSwiGLU`` on
the grouped-tensor path), with only ``transformer_engine_torch`` emulated and the device questions
answered as a GB200 would (``nemo_lw_fp8.cpu.te.device.target_gpu(BLACKWELL)``).

The claim: FP8 param gather ON (persistent MXFP8 weights from ``quantized_model_init``, the owners'
MXFP8 weights gathered over data parallel) = OFF (bf16 weights quantized by TE at each forward),
bitwise, for every loss and every rank's fp32 masters, on two data-parallel ranks. Control: ON
with each persistent weight's columnwise copy left stale after the gather diverges. Both runs,
and a resume's uninterrupted and resumed steps, synced their Muon gradients by the compact
layout's owner reduce, as the ranks issued them (``tests/support/owner_reduce_probe.py``).

The model is built with ``use_cpu_initialization=False``: with ``True`` megatron hands TE a no-op
``init_method`` and writes the weights afterwards, so TE's preserved high-precision init value
(which the fp32 masters of persistent FP8 weights start from) stays uninitialised memory
(``test_stale_init_value_is_refused``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nemo_lw_fp8.cpu.te import backend as te_backend
from tests.support import owner_reduce_probe as probe
from tests.support.harness import BootOptions, run_on_ranks
from tests.support.parity import assert_diverges, assert_same_losses_and_masters
from tests.support.te_helpers import rowwise_only_refresh
from tests.support.te_moe import TE_ENV, build_te_moe_gpt

if te_backend.te_package_dirs() is None:  # find, never import, TE in this process
    pytest.skip("TE's own modules need TE's Python package", allow_module_level=True)

BOOT = BootOptions(fp8_emulation=True)
HIDDEN = FFN = 128  # TE's grouped MXFP8 layout needs multiples of 128
STEPS = 2


def build_te_moe(fp8_params: bool, seed: int, cpu_init: bool = False):
    """A 2-layer MoE GPT (4 experts, top 2, SwiGLU, RMSNorm) from megatron's TE spec with MXFP8
    compute; persistent MXFP8 weights with ``fp8_params``. Returns (module, config)."""
    return build_te_moe_gpt(
        seed, fp8_params, hidden_size=HIDDEN, moe_ffn_hidden_size=FFN, fp8="e4m3",
        fp8_recipe="mxfp8", fp8_param=fp8_params, use_cpu_initialization=cpu_init,
    )  # fmt: skip


def _stale_columnwise(mp: pytest.MonkeyPatch) -> None:
    """The control: every re-quantization of a persistent MXFP8 weight (the gather's copy into
    the weights, TE's and the grouped ones alike) refreshes its rowwise copy only; the columnwise
    copy the dgrad GEMM reads keeps its old bytes."""
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

    mp.setattr(
        MXFP8Quantizer, "update_quantized", rowwise_only_refresh(MXFP8Quantizer.update_quantized)
    )


def te_moe_run(
    fp8_param_gather: bool,
    mutation: str | None,
    steps: tuple[int, int] = (0, STEPS),
    save_dir: str | None = None,
    load_dir: str | None = None,
) -> dict[str, Any]:
    """Steps ``steps[0]..steps[1]-1`` of layer-wise Muon (compact layout, owner reduce, Q/K/V
    parts, whole grouped weights) on the TE-spec MoE, after a ``torch_dist`` load from
    ``load_dir`` and before a save to ``save_dir`` (``dp_reshardable``); losses and this rank's
    fp32 masters and Muon momentum."""
    from megatron.core import parallel_state

    import nemo_lw_fp8
    from nemo_lw_fp8.cpu.te import device as te_device
    from tests.support import dist_checkpoints, training
    from tests.support.resume_controls import nudge_first_layer_wise_master
    from tests.support.scenarios import Scenario

    scenario = Scenario(
        model="moe_grouped", single_grouped_weight=True, fp8=True,
        fp8_param_gather=fp8_param_gather, plugin=True, optimizer="muon",
        distribution="layerwise_compact", grouped_weight_ownership="whole", seed=11,
    )  # fmt: skip
    nemo_lw_fp8.apply()
    with pytest.MonkeyPatch.context() as mp, te_device.target_gpu(te_device.BLACKWELL):
        for name, value in TE_ENV.items():
            mp.setenv(name, value)
        if mutation == "stale_columnwise":
            _stale_columnwise(mp)
        elif mutation not in (None, "nudge_loaded_master"):
            raise ValueError(mutation)
        module, config = build_te_moe(fp8_param_gather, seed=11 if load_dir is None else 23)
        model, optimizer = training.wrap_and_build_optimizer(module, config, scenario)
        if load_dir is not None:
            dist_checkpoints.load_torch_dist(model, optimizer, load_dir)
            if mutation == "nudge_loaded_master":
                nudge_first_layer_wise_master(optimizer)
        dp_rank = parallel_state.get_data_parallel_rank()
        losses = [
            training.train_step(scenario, model, optimizer, step, dp_rank)
            for step in range(*steps)
        ]
        training.final_sync(model, optimizer)
        if save_dir is not None:
            dist_checkpoints.save_torch_dist(model, optimizer, save_dir, "dp_reshardable")
        persistent = sum(
            type(p).__name__ in ("MXFP8Tensor", "GroupedTensor")
            and getattr(p, "quantizer", getattr(p, "_quantizer", None)) is not None
            for p in model[0].module.parameters()
        )
        return {
            "losses": losses,
            "masters": training.state_by_part(optimizer, model[0].module),
            "persistent_fp8": persistent,
        }


def test_te_spec_moe_fp8_param_gather_on_equals_off():
    """The TE-spec MoE trains two steps with persistent MXFP8 weights gathered over DP 2 to the
    same losses and masters, bitwise, as with bf16 weights (the ON run held persistent MXFP8
    weights, the OFF run none); control: a stale columnwise copy after the gather diverges."""
    on, off = (
        run_on_ranks(probe.run_probed, te_moe_run, gather, None, world_size=2, boot=BOOT)
        for gather in (True, False)
    )
    probe.assert_reduced_to_owners(on, "gather on")
    probe.assert_reduced_to_owners(off, "gather off")
    assert all(r["persistent_fp8"] > 0 for r in on), [r["persistent_fp8"] for r in on]
    assert all(r["persistent_fp8"] == 0 for r in off), [r["persistent_fp8"] for r in off]
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in on)
    assert_same_losses_and_masters(off, on)
    stale = run_on_ranks(te_moe_run, True, "stale_columnwise", world_size=2, boot=BOOT)
    assert_diverges(off, stale, compare=assert_same_losses_and_masters)


def test_te_spec_moe_resumes_bitwise(tmp_path):
    """Save the TE-spec MoE (persistent MXFP8 weights, single grouped experts) after two steps
    in ``torch_dist``, load it into a build from another seed and train two more steps: the
    losses and every rank's masters and Muon state equal four uninterrupted steps, bitwise (the
    weights after the load are derived from the loaded masters). Control: the same resume with
    one loaded fp32 master one ulp off diverges."""
    (tmp_path / "step2").mkdir()
    saved = str(tmp_path / "step2")
    whole = run_on_ranks(
        probe.run_probed, te_moe_run, True, None, (0, 4), world_size=2, boot=BOOT
    )
    first = run_on_ranks(te_moe_run, True, None, (0, 2), saved, world_size=2, boot=BOOT)
    resumed = run_on_ranks(
        probe.run_probed, te_moe_run, True, None, (2, 4), None, saved, world_size=2, boot=BOOT
    )
    probe.assert_reduced_to_owners(whole, "uninterrupted")
    probe.assert_reduced_to_owners(resumed, "resumed")
    for rank in range(2):
        assert first[rank]["losses"] + resumed[rank]["losses"] == whole[rank]["losses"]
    assert_same_losses_and_masters(
        [{**r, "losses": []} for r in whole], [{**r, "losses": []} for r in resumed]
    )
    nudged = run_on_ranks(
        te_moe_run, True, "nudge_loaded_master", (2, 4), None, saved, world_size=2, boot=BOOT
    )
    assert_diverges(
        [{**r, "losses": []} for r in whole],
        [{**r, "losses": []} for r in nudged],
        compare=assert_same_losses_and_masters,
    )


def build_with_cpu_initialization(cpu_init: bool) -> str:
    """Build the TE-spec MoE with persistent MXFP8 weights and the layer-wise optimizer; the
    error the optimizer build raised, or ``"built"``."""
    import nemo_lw_fp8
    from nemo_lw_fp8.cpu.te import device as te_device
    from tests.support import training
    from tests.support.scenarios import Scenario

    scenario = Scenario(
        model="moe_grouped", single_grouped_weight=True, fp8=True, fp8_param_gather=True,
        plugin=True, optimizer="muon", distribution="layerwise_compact", seed=11,
    )  # fmt: skip
    nemo_lw_fp8.apply()
    with pytest.MonkeyPatch.context() as mp, te_device.target_gpu(te_device.BLACKWELL):
        for name, value in TE_ENV.items():
            mp.setenv(name, value)
        module, config = build_te_moe(True, seed=11, cpu_init=cpu_init)
        try:
            training.wrap_and_build_optimizer(module, config, scenario)
        except ValueError as exc:
            return str(exc)
    return "built"


def test_stale_init_value_is_refused():
    """With ``use_cpu_initialization=True`` megatron writes TE's weights after TE kept their
    high-precision init values (uninitialised memory): the layer-wise optimizer refuses to start
    its fp32 masters from them, in one line naming the flag and the fix. Control: the same
    build with ``use_cpu_initialization=False`` starts. (Restored: docs/muon-fp8-param-gather.md
    cites it, and a past edit had dropped it.)"""
    refused = run_on_ranks(build_with_cpu_initialization, True, world_size=1, boot=BOOT)[0]
    assert "use_cpu_initialization=False" in refused and "init value" in refused, refused
    assert "\n" not in refused
    started = run_on_ranks(build_with_cpu_initialization, False, world_size=1, boot=BOOT)[0]
    assert started == "built", started
