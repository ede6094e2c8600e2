"""Grouped expert weights split over expert tensor parallel 2 with layer-wise Muon and FP8 param
gather (issue 29), through TE's own modules on CPU: the tiny MoE GPT the recipes' experts run as
(megatron's TE spec, ``TEGroupedMLP``) at TP 2 x DP 2 with sequence parallelism and ETP 2 on 4
gloo ranks. Each rank holds its ETP shard of every local expert (rows of the gated
``linear_fc1``, columns of ``linear_fc2``); the expert data-parallel group (2 ranks) owns and
gathers them.

megatron-core 0.19.2 builds grouped experts through TE's op fuser only at expert TP 1
(``TEGroupedMLP._is_fused_impl_supported``; rule ``op-fuser-experts-expert-tensor-parallel``),
and single grouped weights only through the op fuser, so at ETP 2 the experts are TE's
``GroupedLinear`` module with discrete weights (``weight0..3``), under both recipes:

* MXFP8 (B200 / GB200), persistent ``MXFP8Tensor`` shards; expert width 256, so each ETP
  shard is 128 columns of ``linear_fc2`` and 256 rows of ``linear_fc1``;
* blockwise FP8 (H100), persistent ``Float8BlockwiseQTensor`` shards of whole 128x128 tiles
  (expert width 256), the plugin's blockwise gather of FP8 codes + tile scales.

The claim: FP8 param gather ON (persistent FP8 ETP shards gathered over expert DP) = OFF (bf16
shards TE quantizes at each forward), bitwise, for every loss and every rank's fp32 masters and
Muon momentum, with the compact layout, the owner reduce, overlapped gathers, gradient clipping
and ``muon_tp_mode="duplicated"`` (the factory's default: each expert's ETP shards gathered
and orthogonalized whole). Control: ON with each persistent weight's columnwise copy left stale
after the gather diverges.
"""

from __future__ import annotations

import pytest
import torch

from nemo_lw_fp8.cpu.te import backend as te_backend
from tests.support import owner_reduce_probe as probe
from tests.support.harness import BootOptions, ParallelSpec, run_on_ranks
from tests.support.parity import assert_diverges, assert_same_losses_and_masters
from tests.support.te_helpers import stale_columnwise

if te_backend.te_package_dirs() is None:  # find, never import, TE in this process
    pytest.skip("TE's own modules need TE's Python package", allow_module_level=True)

BOOT = BootOptions(fp8_emulation=True)
#: TP 2 with expert tensor parallel 2 (the process groups must match the model's ETP).
TP2_ETP2 = ParallelSpec(tp=2, etp=2)
ETP = 2
STEPS = 3
#: The experts' FFN width: 128 per ETP shard (whole 128-wide MXFP8 grouped members, whole
#: 128x128 blockwise tiles).
EXPERT_FFN = 256
#: The hidden size per recipe: MXFP8's 128 gives TP shards of whole 1x32 blocks in attention;
#: blockwise needs 256 (4 heads of 64: ``linear_qkv``'s 768 rows are 384 per TP shard,
#: ``linear_proj``'s 256 columns 128, whole 128x128 tiles). The dense ``ffn_hidden_size``
#: (no dense layer here; the block-boundary rule reads it) is the expert width.
HIDDEN = {"mxfp8": 128, "blockwise": 256}
#: The persistent weight class per recipe.
PERSISTENT = {"mxfp8": "MXFP8Tensor", "blockwise": "Float8BlockwiseQTensor"}


def _persistent(module: torch.nn.Module, recipe: str) -> int:
    return sum(type(p).__name__ == PERSISTENT[recipe] for p in module.parameters())


def grouped_etp2_run(recipe: str, fp8_param_gather: bool, mutation: str | None) -> dict:
    """Three steps of layer-wise Muon on the TP-2 / ETP-2 grouped-expert MoE; the losses, this
    rank's fp32 masters and momentum, its persistent FP8 weights and its expert shard widths."""
    from megatron.core import parallel_state
    from megatron.training.training import disable_forward_pre_hook, enable_forward_pre_hook

    from tests.support import training
    from tests.support.scenarios import Scenario, build_model

    assert parallel_state.get_expert_tensor_parallel_world_size() == ETP
    scenario = Scenario(
        model="moe_grouped", fp8=True, fp8_recipe=recipe, fp8_param_gather=fp8_param_gather,
        plugin=True,
        optimizer="muon", distribution="layerwise_compact", overlap=True, clip_grad=1.0,
        muon_tp_mode="duplicated", seed=5, steps=STEPS,
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        if mutation == "stale_columnwise":
            stale_columnwise(mp, recipe)
        elif mutation is not None:
            raise ValueError(mutation)
        module, config = build_model(
            scenario, sequence_parallel=True, use_transformer_engine_op_fuser=False,
            hidden_size=HIDDEN[recipe],
            ffn_hidden_size=EXPERT_FFN, moe_ffn_hidden_size=EXPERT_FFN,
            expert_tensor_parallel_size=ETP,
        )  # fmt: skip
        model, optimizer = training.wrap_and_build_optimizer(module, config, scenario)
        dp_rank = parallel_state.get_data_parallel_rank()
        losses = []
        for step in range(STEPS):
            if step == 0:  # megatron's loop: the first step's params are already in place
                disable_forward_pre_hook(model, param_sync=False)
            losses.append(training.train_step(scenario, model, optimizer, step, dp_rank))
            if step == 0:
                enable_forward_pre_hook(model)
        training.final_sync(model, optimizer)
    experts = [
        (name, tuple(p.shape)) for name, p in model[0].module.named_parameters()
        if ".experts." in name and "layers.0." in name
    ]  # fmt: skip
    return {
        "losses": losses,
        "masters": training.state_by_part(optimizer, model[0].module),
        "persistent_fp8": _persistent(model[0].module, recipe),
        "persistent_experts": sum(
            type(p).__name__ == PERSISTENT[recipe]
            for name, p in model[0].module.named_parameters() if ".experts." in name
        ),  # fmt: skip
        "expert_shapes": experts,
        "layer_wise": training.uses_layer_wise(optimizer),
    }


def _expected_shapes(hidden: int) -> list[tuple[str, tuple[int, ...]]]:
    """Layer 0's expert weights on each rank: the ETP shard of 4 discrete experts (gated
    ``linear_fc1`` rows ``2 x 256 / 2``, ``linear_fc2`` columns ``256 / 2``)."""
    rows, cols = 2 * EXPERT_FFN // ETP, EXPERT_FFN // ETP
    prefix = "decoder.layers.0.mlp.experts."
    return [(f"{prefix}linear_fc1.weight{i}", (rows, hidden)) for i in range(4)] + [
        (f"{prefix}linear_fc2.weight{i}", (hidden, cols)) for i in range(4)
    ]


def _check_on_equals_off(recipe: str) -> None:
    def run(on: bool, mutation: str | None = None) -> list[dict]:
        return run_on_ranks(probe.run_probed, grouped_etp2_run, recipe, on, mutation,
                            world_size=4, parallel=TP2_ETP2, boot=BOOT)  # fmt: skip

    on, off = run(True), run(False)
    # Both synced their Muon gradients, the expert shards' over the expert data-parallel
    # group, by the owner reduce (tests/support/owner_reduce_probe.py).
    probe.assert_reduced_to_owners(on, "gather on")
    probe.assert_reduced_to_owners(off, "gather off")
    shapes = sorted(_expected_shapes(HIDDEN[recipe]))
    for r in on + off:
        assert r["layer_wise"]
        assert sorted(r["expert_shapes"]) == shapes, r["expert_shapes"]
    assert all(r["persistent_fp8"] > 0 for r in on), [r["persistent_fp8"] for r in on]
    assert all(r["persistent_fp8"] == 0 for r in off), [r["persistent_fp8"] for r in off]
    # every expert shard is a persistent FP8 weight (2 layers x 4 experts x 2 linears)
    assert [r["persistent_experts"] for r in on] == [16] * 4
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in on)
    assert_same_losses_and_masters(off, on)
    assert_diverges(off, run(True, "stale_columnwise"), compare=assert_same_losses_and_masters)


def test_mxfp8_grouped_experts_at_etp2_on_equals_off():
    """MXFP8 grouped experts (TE's ``GroupedLinear``, discrete weights) at TP 2 / SP / ETP 2:
    FP8 param gather ON = OFF bitwise; control: a stale columnwise copy after the gather
    diverges."""
    _check_on_equals_off("mxfp8")


def test_blockwise_grouped_experts_at_etp2_on_equals_off():
    """Blockwise FP8 grouped experts (TE's ``GroupedLinear``, discrete weights) at TP 2 / SP /
    ETP 2: FP8 param gather ON = OFF bitwise; control: receivers that skip deriving the
    columnwise copy after the gather diverge."""
    _check_on_equals_off("blockwise")
