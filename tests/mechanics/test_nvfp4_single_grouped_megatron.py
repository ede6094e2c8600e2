"""NVFP4 on TE 2.20.2's op-fuser grouped-tensor path on CPU (issue 30), through megatron:
``TEGroupedMLP`` through TE's op fuser, one step with bf16 / FP4 primary, single grouped /
discrete expert weights, and the op fuser with discrete bf16 experts under layer-wise Muon (2
ranks, 3 steps), compact = stock layout. B200 target, stochastic rounding off, the RHT on.

Every TE call runs in a spawned rank (this process never imports TE or megatron). Each parity
has a control kept in the suite (``tests.support.parity.assert_diverges``); the shared inputs
and mutations: ``tests.support.nvfp4_grouped_path``.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import run_on_ranks
from tests.support.nvfp4_grouped_path import mutate_grouped_path, record_grouped_kernels
from tests.support.parity import assert_diverges
from tests.support.te_module_parity import BOOT

# ---- megatron's TEGroupedMLP through TE's op fuser (compute only) -------------------------------


def _megatron_experts_once(single: bool, fp4_param: bool, mutation: str | None) -> dict:
    """``tests/mechanics/test_nvfp4_layer_wise.py``'s 2-layer TE-spec MoE GPT (4 experts,
    top-2) with megatron's ``TEGroupedMLP`` through TE's op fuser (``ops.GroupedLinear`` +
    ``ScaledSwiGLU``; megatron pads each expert's tokens to 256), NVFP4 compute (megatron's
    recipe, SR off, RHT on): one forward and backward from the same seed. ``single``: one
    grouped weight per expert linear (``moe_single_grouped_weight``); ``fp4_param``: FP4
    primary weights. Returns the loss and every parameter's gradient under the discrete names,
    the grouped kernels TE called, or TE's error."""
    import dataclasses
    import functools
    import traceback

    import tests.mechanics.test_nvfp4_layer_wise as base
    from nemo_lw_fp8.cpu.te import device as te_device
    from tests.cpu.test_nvfp4_grouped import _build_gpt_grouped_experts
    from tests.support import scenarios

    seen: list[str] = []
    with pytest.MonkeyPatch.context() as mp, te_device.target_gpu(te_device.BLACKWELL):
        from megatron.core import fp4_utils

        recipe = fp4_utils.get_fp4_recipe
        mp.setattr(
            fp4_utils,
            "get_fp4_recipe",
            lambda config: dataclasses.replace(recipe(config), disable_stochastic_rounding=True),
        )
        mp.setenv("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1")  # megatron's op-fuser GLU switch
        mp.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1" if single else "0")
        moe = dict(
            base.MOE, moe_grouped_gemm=True, use_transformer_engine_op_fuser=True,
            moe_single_grouped_weight=single, fp4_param=fp4_param,
        )  # fmt: skip
        mp.setattr(base, "MOE", moe)
        mp.setattr(
            scenarios, "build_gpt", functools.partial(_build_gpt_grouped_experts, grouped=True)
        )
        module, config = base.build_nvfp4_gpt(True, 5, True)
        kinds = sorted({type(p).__name__ for n, p in module.named_parameters() if "experts" in n})
        mutate_grouped_path(mp, mutation)
        record_grouped_kernels(mp, seen)
        gen = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, scenarios.GPT_VOCAB, (2, 64), generator=gen)
        positions = torch.arange(64).unsqueeze(0).expand(2, -1)
        try:
            with fp4_utils.get_fp4_context(config):
                loss = module(tokens, positions, None).float().square().mean()
            loss.backward()
        except RuntimeError:
            return {"error": traceback.format_exc(limit=1).strip().splitlines()[-1]}
    grads = {}
    for name, param in module.named_parameters():
        grad = param.grad
        if type(param).__name__ == "GroupedTensor":
            rows, cols = (int(d) for d in param.logical_shape)
            experts = int(param.num_tensors)
            for i, part in enumerate(grad.reshape(experts, rows // experts, cols)):
                grads[f"{name}{i}"] = part.clone()
        else:
            grads[name] = grad.clone()
    return {
        "losses": [float(loss)], "grads": grads, "weight_types": kinds,
        "kernels": sorted(set(seen)),
    }  # fmt: skip


def megatron_experts_runs() -> dict[str, dict]:
    """:func:`_megatron_experts_once` in each variant (one rank)."""
    variants = {
        "bf16_single": (True, False, None),
        "bf16_discrete": (False, False, None),
        "fp4_discrete": (False, True, None),
        "fp4_single": (True, True, None),
        "fp4_single_member_order": (True, True, "member_order"),
    }
    return {label: _megatron_experts_once(*args) for label, args in variants.items()}


def _same_step(reference: list[dict], results: list[dict]) -> None:
    """Bitwise: the loss and every parameter's gradient (discrete names)."""
    a, b = reference[0], results[0]
    assert a["losses"] == b["losses"], (a["losses"], b["losses"])
    assert a["grads"].keys() == b["grads"].keys()
    differ = [k for k in a["grads"] if not torch.equal(a["grads"][k], b["grads"][k])]
    assert not differ, f"gradients differ: {differ}"


@pytest.mark.extended
def test_megatron_op_fuser_experts_single_grouped_nvfp4():
    """megatron's ``TEGroupedMLP`` through TE's op fuser under NVFP4 (RHT on, SR off), compute
    only: bf16 single grouped weights stop at TE 2.20.2's own error (``group_quantize`` has no
    kernel for the weight quantizer); FP4 primary single grouped weights (``GroupedTensor``s)
    run the grouped-tensor path and equal FP4 primary discrete weights, bitwise in the loss and
    every parameter's gradient, and both equal the step on bf16 discrete weights (each weight
    cast once from the same values: the same bytes). Control: the grouped weights paired with
    the next expert's tokens diverge."""
    runs = run_on_ranks(megatron_experts_runs, world_size=1, boot=BOOT)[0]
    assert runs["bf16_single"] == {
        "error": "RuntimeError: 2D scaling grouped quant kernel is not ready yet"
    }
    single, discrete = runs["fp4_single"], runs["fp4_discrete"]
    assert single["weight_types"] == ["GroupedTensor"], single["weight_types"]
    assert discrete["weight_types"] == ["NVFP4Tensor"], discrete["weight_types"]
    assert runs["bf16_discrete"]["weight_types"] == ["Parameter"]
    assert "te_general_grouped_gemm_for_grouped_tensor" in single["kernels"]
    assert "te_general_grouped_gemm_for_discrete_in" in discrete["kernels"]
    assert "group_quantize" in single["kernels"] and "split_quantize" not in single["kernels"]
    _same_step([discrete], [single])
    _same_step([runs["bf16_discrete"]], [discrete])
    assert_diverges([discrete], [runs["fp4_single_member_order"]], compare=_same_step)


def op_fuser_moe_run(layout: str, mutation: str | None = None) -> dict:
    """``tests/mechanics/test_nvfp4_layer_wise.py``'s MoE run (NVFP4 compute, SR off, layer-wise
    Muon in ``layout``, three steps and an eval) with megatron's ``TEGroupedMLP`` through TE's
    op fuser and discrete bf16 expert weights: the grouped-tensor path (``group_quantize``,
    discrete-in / discrete-out GEMMs). ``mutation``: :func:`mutate_grouped_path`'s (a control).
    Also names the grouped kernels TE called."""
    import functools

    import tests.mechanics.test_nvfp4_layer_wise as base
    from tests.cpu.test_nvfp4_grouped import _build_gpt_grouped_experts
    from tests.support import scenarios

    seen: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1")  # megatron's op-fuser GLU switch
        moe = dict(base.MOE, moe_grouped_gemm=True, use_transformer_engine_op_fuser=True)
        mp.setattr(base, "MOE", moe)
        mp.setattr(
            scenarios, "build_gpt", functools.partial(_build_gpt_grouped_experts, grouped=True)
        )
        mutate_grouped_path(mp, mutation)
        record_grouped_kernels(mp, seen)
        result = base.nvfp4_run(layout, True, moe=True)
    return {**result, "kernels": sorted(set(seen))}


@pytest.mark.extended
def test_op_fuser_experts_nvfp4_layer_wise_compact_equals_stock():
    """megatron's ``TEGroupedMLP`` through TE's op fuser with discrete bf16 expert weights under
    NVFP4 compute (RHT on, SR off) trains under layer-wise Muon on two data-parallel ranks
    through TE's grouped-tensor path: the plugin's compact layout equals megatron's layer-wise
    layout, bitwise in losses, the eval loss, every master and Muon momentum. Control: the same
    run with ``group_quantize`` casting the members with one shared amax diverges."""
    from tests.mechanics.test_nvfp4_layer_wise import assert_same_run

    compact = run_on_ranks(op_fuser_moe_run, "compact", world_size=2, boot=BOOT)
    stock = run_on_ranks(op_fuser_moe_run, "stock", world_size=2, boot=BOOT)
    for r in compact + stock:
        assert r["kernels"] == [
            "group_quantize", "te_general_grouped_gemm_for_discrete_in",
            "te_general_grouped_gemm_for_discrete_out",
        ], r["kernels"]  # fmt: skip
        assert r["nvfp4_gemms"] == r["gemms"] > 0
        assert all(torch.isfinite(torch.tensor(r["losses"])))
    assert_same_run(stock, compact)
    shared = run_on_ranks(op_fuser_moe_run, "compact", "shared_amax", world_size=2, boot=BOOT)
    assert_diverges(compact, shared, assert_same_run)
