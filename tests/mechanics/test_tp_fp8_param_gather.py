"""Layer-wise Muon with FP8 param gather at tensor parallel 2 (issue 29), through TE's own
modules on CPU: a tiny GPT from megatron's TE spec at TP 2 x DP 2 on 4 gloo ranks, each rank a
TP shard of every matrix, persistent FP8 weights (``quantized_model_init``) whose shards the
DP owners update and gather.

The claim: FP8 param gather ON (persistent FP8 TP shards, gathered over DP) = OFF (bf16 TP
shards TE quantizes at each forward), bitwise, for every loss and every rank's fp32 masters,
with the compact layout, the owner reduce, gradient clipping and overlapped gathers (extended:
gathers not overlapped, MXFP8 and blockwise). MXFP8 (``MXFP8Tensor``, 1x32
blocks; SP off and on, MoE at ETP 1) and blockwise FP8 (TE's ``Float8BlockScaling``,
``Float8BlockwiseQTensor`` weights of 128x128 tiles, the plugin's blockwise gather of FP8 codes
+ tile scales; SP off and on, MoE at ETP 1), with widths whose TP shards hold whole blocks.
Controls: ON with each persistent weight's columnwise copy left stale after the gather
diverges. ON and OFF synced their Muon gradients by the owner reduce (over the DP group, and the
experts' over theirs), as the ranks issued them (``tests/support/owner_reduce_probe.py``).

Expert tensor parallel 2 (discrete expert linears, ``SequentialMLP``; each expert's ETP shards
owned over the 2-rank expert data-parallel group): ON = OFF bitwise with MXFP8 (extended) and
blockwise FP8 (gate), the same controls.

The runs go through the guards as a user's would: the rules ``fp8-gather-tensor-parallel``
(grouped experts at ETP > 1 stay refused) and ``fp8-gather-tp-block-boundary`` (no shard may
split a quantization block) let these models through (docs/guards.md); a width whose TP shard
splits a 128x128 tile is refused where the layer-wise optimizer is built, read from the built
model's ``TransformerConfig``. The gate runs the MXFP8 case with SP and MoE, the blockwise cases
with SP (Bridge's H100 TP-2 layout) and with SP and MoE at ETP 2, and the refusal; the other
cases, which repeat them with less turned on, are in the extended tier.
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
TP2 = ParallelSpec(tp=2)


def tp2(etp: int) -> ParallelSpec:
    """TP 2 with expert tensor parallel ``etp``: the process groups must agree with the model's
    ``expert_tensor_parallel_size`` (megatron builds the expert groups from the ranks' groups,
    not from the config; ``ParallelSpec``'s default ETP is TP)."""
    return ParallelSpec(tp=2, etp=etp)
STEPS = 3


#: MoE layers as Bridge's TP-2 recipes run them: experts whole per rank (expert-tensor
#: parallel 1) next to TP-2 attention, experts as megatron's ``SequentialMLP`` of TE linears.
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
           moe_token_dispatcher_type="allgather", expert_tensor_parallel_size=1)  # fmt: skip
#: Blockwise experts of whole 128x128 tiles.
MOE_DIMS = {"mxfp8": MOE, "blockwise": {**MOE, "moe_ffn_hidden_size": 128}}


def _moe_dims(recipe: str, etp: int) -> dict:
    """The MoE settings at expert tensor parallel ``etp``: expert widths scaled by ``etp`` for
    blockwise FP8, so each ETP shard still holds whole 128x128 tiles (MXFP8's 64 gives 32 per
    shard at ETP 2, one 1x32 block)."""
    dims = {**MOE_DIMS[recipe], "expert_tensor_parallel_size": etp}
    if recipe == "blockwise":
        dims["moe_ffn_hidden_size"] *= etp
    return dims


#: Model sizes per recipe, chosen so every TP shard holds whole quantization blocks: MXFP8's
#: 1x32 blocks, blockwise FP8's 128x128 weight tiles (hidden 256, 4 heads of 64: linear_qkv
#: 768 rows, 384 per shard; linear_proj 128 input columns per shard; ffn 512, 256 per shard).
DIMS = {
    "mxfp8": dict(hidden_size=64, ffn_hidden_size=128, num_attention_heads=4),
    "blockwise": dict(hidden_size=256, ffn_hidden_size=512, num_attention_heads=4),
}


def build_tp_gpt(
    fp8_params: bool, sequence_parallel: bool, seed: int, moe: bool = False,
    recipe: str = "mxfp8", etp: int = 1, **dims: int,
):  # fmt: skip
    """A 2-layer GPT from megatron's TE spec with ``recipe``'s FP8 compute (MXFP8 or blockwise)
    at this pool's TP size; with ``fp8_params`` its linear weights are persistent quantized TP
    shards (``MXFP8Tensor`` / ``Float8BlockwiseQTensor``). Built with
    ``use_cpu_initialization=False`` (TE keeps the high-precision init value the fp32 masters
    of persistent weights start from; tests/mechanics/test_te_model_training.py says why)."""
    from transformer_engine.pytorch import quantized_model_init

    from tests.support.scenarios import build_gpt, seed_all, transformer_config
    from tests.support.te_helpers import te_recipe

    seed_all(seed)
    config = transformer_config(
        **(DIMS[recipe] | dims), fp8="e4m3", fp8_recipe=recipe, fp8_param=fp8_params,
        use_cpu_initialization=False, sequence_parallel=sequence_parallel,
        add_bias_linear=False,
        **(_moe_dims(recipe, etp) if moe else {}),
    )  # fmt: skip
    with quantized_model_init(
        enabled=fp8_params, recipe=te_recipe(recipe)[0], preserve_high_precision_init_val=True
    ):
        module = build_gpt(config)
    for param in module.parameters():  # persistent FP8 weights are final
        if type(param.data) is torch.Tensor:
            param.data = param.data.to(torch.bfloat16)
    return module, config


#: The persistent weight class of each recipe.
PERSISTENT = {"mxfp8": "MXFP8Tensor", "blockwise": "Float8BlockwiseQTensor"}


def tp_gather_run(
    fp8_param_gather: bool, sequence_parallel: bool, mutation: str | None, moe: bool = False,
    recipe: str = "mxfp8", etp: int = 1, overlap: bool = True,
):  # fmt: skip
    """Three steps of layer-wise Muon (compact layout, owner reduce, gradient clipping at 1.0,
    gathers overlapped with the forward or not; Q/K/V parts owned apart for MXFP8, whole for
    blockwise) on the TP-2 GPT; losses, this rank's fp32 masters and how many persistent FP8
    weights it held."""
    from megatron.core import parallel_state

    import nemo_lw_fp8
    from nemo_lw_fp8.cpu.te import device as te_device
    from tests.support import training
    from tests.support.scenarios import Scenario
    from tests.support.te_helpers import te_recipe

    assert parallel_state.get_tensor_model_parallel_world_size() == 2
    scenario = Scenario(
        model="moe_gpt" if moe else "gpt", fp8=True, fp8_recipe=recipe,
        fp8_param_gather=fp8_param_gather, plugin=True, optimizer="muon",
        distribution="layerwise_compact", overlap=overlap, clip_grad=1.0, seed=5, steps=STEPS,
    )  # fmt: skip
    nemo_lw_fp8.apply()
    with pytest.MonkeyPatch.context() as mp, te_device.target_gpu(te_recipe(recipe)[1]):
        if mutation == "stale_columnwise":
            stale_columnwise(mp, recipe)
        elif mutation is not None:
            raise ValueError(mutation)
        module, config = build_tp_gpt(
            fp8_param_gather, sequence_parallel, seed=5, moe=moe, recipe=recipe, etp=etp
        )
        model, optimizer = training.wrap_and_build_optimizer(module, config, scenario)
        dp_rank = parallel_state.get_data_parallel_rank()
        losses = []
        for step in range(STEPS):
            if step == 0 and overlap:
                from megatron.training.training import disable_forward_pre_hook

                disable_forward_pre_hook(model, param_sync=False)
            losses.append(training.train_step(scenario, model, optimizer, step, dp_rank))
            if step == 0 and overlap:
                from megatron.training.training import enable_forward_pre_hook

                enable_forward_pre_hook(model)
        training.final_sync(model, optimizer)
    persistent = sum(type(p).__name__ == PERSISTENT[recipe] for p in model[0].module.parameters())
    from nemo_lw_fp8.mechanics import blockwise

    groups = model[0].bucket_groups + model[0].expert_parallel_bucket_groups
    fc1_rows = {
        p.shape[0]
        for n, p in model[0].module.named_parameters()
        if ".experts." in n and "linear_fc1.weight" in n
    }
    full_rows = (config.moe_ffn_hidden_size or 0) * (2 if config.gated_linear_unit else 1)
    return {
        # each expert's linear_fc1 rows on this rank, times ETP: the full width if sharded
        "expert_fc1_rows_times_etp": sorted(rows * etp for rows in fc1_rows),
        "expert_fc1_full_rows": full_rows,
        "blockwise_gathers": sum(blockwise.plan_of(group) is not None for group in groups),
        "losses": losses,
        "masters": training.state_by_part(optimizer, model[0].module),
        "persistent_fp8": persistent,
        "layer_wise": training.uses_layer_wise(optimizer),
    }


EXTENDED = pytest.mark.extended


@pytest.mark.parametrize(
    ("sequence_parallel", "moe", "etp", "overlap"),
    [pytest.param(False, False, 1, True, id="tp2", marks=EXTENDED),
     pytest.param(True, False, 1, True, id="tp2-sp", marks=EXTENDED),
     pytest.param(True, True, 1, True, id="tp2-sp-moe"),
     pytest.param(True, True, 1, False, id="tp2-sp-moe-no-overlap", marks=EXTENDED),
     pytest.param(True, True, 2, True, id="tp2-sp-moe-etp2", marks=EXTENDED)],
)  # fmt: skip
def test_mxfp8_param_gather_at_tp2_on_equals_off(sequence_parallel, moe, etp, overlap):
    """ON = OFF bitwise at TP 2 x DP 2 (the ON run held persistent MXFP8 TP shards, the OFF run
    none); with ``moe`` the MoE layers' experts are whole on every rank (ETP 1, owned over the
    4-rank expert data-parallel group) or, at ``etp`` 2, ETP shards of discrete expert linears
    (``SequentialMLP``) owned over the 2-rank expert data-parallel group. Control: a stale
    columnwise copy after the gather diverges."""

    def run(on: bool, mutation: str | None = None) -> list[dict]:
        return run_on_ranks(probe.run_probed, tp_gather_run, on, sequence_parallel, mutation, moe,
                            "mxfp8", etp, overlap, world_size=4, parallel=tp2(etp),
                            boot=BOOT)  # fmt: skip

    _assert_on_equals_off_and_control_diverges(run)


def _assert_on_equals_off_and_control_diverges(run, recipe: str = "mxfp8") -> None:
    """``run(on, mutation)``: probed runs of :func:`tp_gather_run` (the control's verdict is
    not read)."""
    on, off = run(True), run(False)
    probe.assert_reduced_to_owners(on, "gather on")
    probe.assert_reduced_to_owners(off, "gather off")
    for r in on + off:  # experts' linear_fc1 rows x ETP: the full width (sharded as asked)
        full = r["expert_fc1_full_rows"]
        assert r["expert_fc1_rows_times_etp"] == ([full] if full else []), r
    # Blockwise ON gathers through the plugin's blockwise groups (FP8 codes + tile scales);
    # MXFP8 and OFF runs through megatron's own.
    gathers = [r["blockwise_gathers"] for r in on + off]
    blockwise_on = recipe == "blockwise"
    assert all((r["blockwise_gathers"] > 0) == blockwise_on for r in on), gathers
    assert all(r["blockwise_gathers"] == 0 for r in off), gathers
    assert all(r["layer_wise"] for r in on + off)
    assert all(r["persistent_fp8"] > 0 for r in on), [r["persistent_fp8"] for r in on]
    assert all(r["persistent_fp8"] == 0 for r in off), [r["persistent_fp8"] for r in off]
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in on)
    assert_same_losses_and_masters(off, on)
    assert_diverges(off, run(True, "stale_columnwise"), compare=assert_same_losses_and_masters)


@pytest.mark.parametrize(
    ("sequence_parallel", "moe", "etp", "overlap"),
    [pytest.param(False, False, 1, True, id="tp2", marks=EXTENDED),
     pytest.param(True, False, 1, True, id="tp2-sp"),
     pytest.param(True, True, 1, True, id="tp2-sp-moe", marks=EXTENDED),
     pytest.param(True, True, 2, True, id="tp2-sp-moe-etp2"),
     pytest.param(True, True, 2, False, id="tp2-sp-moe-etp2-no-overlap", marks=EXTENDED)],
)  # fmt: skip
def test_blockwise_param_gather_at_tp2_on_equals_off(sequence_parallel, moe, etp, overlap):
    """Blockwise FP8 (TE's ``Float8BlockScaling``, persistent ``Float8BlockwiseQTensor`` TP
    shards of whole 128x128 tiles, the plugin's blockwise gather: owners ship FP8 codes + tile
    scales) at TP 2 x DP 2, sequence parallelism off and on: ON = OFF bitwise; with ``moe`` the
    experts are whole per rank (ETP 1) or ETP-2 shards of discrete expert linears of width 256
    (per shard: 256 rows of the gated linear_fc1, two 128-row tiles; 128 columns of
    linear_fc2, one tile).
    Control: receivers that skip deriving the columnwise copy after the gather diverge."""

    def run(on: bool, mutation: str | None = None) -> list[dict]:
        return run_on_ranks(probe.run_probed, tp_gather_run, on, sequence_parallel, mutation, moe,
                            "blockwise", etp, overlap, world_size=4, parallel=tp2(etp),
                            boot=BOOT)  # fmt: skip

    _assert_on_equals_off_and_control_diverges(run, "blockwise")


def refusal_at_build(ffn_hidden_size: int) -> str:
    """Build the blockwise TP-2 GPT with persistent weights and ``ffn_hidden_size`` and its
    layer-wise optimizer with FP8 gather; the guards' refusal ("" if none)."""
    import nemo_lw_fp8
    from nemo_lw_fp8.cpu.te import device as te_device
    from nemo_lw_fp8.errors import ConfigError
    from tests.support import training
    from tests.support.scenarios import Scenario

    scenario = Scenario(
        model="gpt", fp8=True, fp8_recipe="blockwise", fp8_param_gather=True, plugin=True,
        optimizer="muon", distribution="layerwise_compact", overlap=True, seed=5,
    )  # fmt: skip
    nemo_lw_fp8.apply()
    with te_device.target_gpu(te_device.HOPPER):
        module, config = build_tp_gpt(True, True, 5, recipe="blockwise",
                                      ffn_hidden_size=ffn_hidden_size)  # fmt: skip
        try:
            training.wrap_and_build_optimizer(module, config, scenario)
        except ConfigError as error:
            return str(error)
    return ""


def test_a_shard_splitting_a_block_is_refused_when_the_optimizer_is_built():
    """The block-boundary rule where every run meets it, the layer-wise optimizer's build, on
    the widths of the built model's ``TransformerConfig``: ffn 640 gives each TP shard 320 rows
    of linear_fc1, two and a half 128x128 tiles. Control: ffn 512 (256 per shard) builds."""

    def refusal(ffn: int) -> list[str]:
        return run_on_ranks(refusal_at_build, ffn, world_size=4, parallel=TP2, boot=BOOT)

    for message in refusal(640):
        assert "fp8-gather-tp-block-boundary" in message, message
        assert "model.ffn_hidden_size=640 gives each shard 320" in message, message
        assert "ffn_hidden_size=640 from TransformerConfig.ffn_hidden_size" in message, message
    assert refusal(512) == [""] * 4
