"""TE 2.20.2's own ``Linear`` and ``GroupedLinear`` on CPU (issue 28), with only
``transformer_engine_torch`` emulated and the device questions answered as the recipe's GPU
(``nemo_lw_fp8.cpu.te.device``), against the project's CPU linears, bitwise. Controls
(operands read in the other usage, a stale columnwise copy, the bias added after the cast)
must make the same comparison diverge (``tests.support.parity.assert_diverges``), never
crash."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from tests.support.harness import run_on_ranks
from tests.support.parity import assert_diverges
from tests.support.te_helpers import spread, te_recipe
from tests.support.te_module_parity import (
    BOOT,
    K,
    N,
    mutate_gemms,
    parity_data,
    reference_wgrad32,
    te_equals_reference,
)


def _stale_columnwise(weight: Any, w: torch.Tensor) -> None:
    """Overwrite a persistent FP8 weight's columnwise copy with that of another weight value
    (what a gather that refreshed only the rowwise copy leaves)."""
    other = weight._quantizer.copy()
    other.set_usage(rowwise=True, columnwise=True)
    fresh = other(w * 1.25 + 0.01)
    with torch.no_grad():
        weight._columnwise_data.copy_(fresh._columnwise_data)
        weight._columnwise_scale_inv.copy_(fresh._columnwise_scale_inv)


def linear_run(recipe: str, bias: bool, fp8_params: bool, fuse: bool, mutation: str | None):
    """TE's ``Linear`` and the project's CPU linear of ``recipe`` on equal data: output, dx, dW
    (or ``main_grad`` after fused accumulation) and bias grad of each."""
    import transformer_engine.pytorch as te

    from nemo_lw_fp8.cpu.layers.blockwise_linear import BlockwiseFP8Linear
    from nemo_lw_fp8.cpu.layers.mxfp8_linear import MXFP8Linear
    from nemo_lw_fp8.cpu.te import device as te_device

    fp8_recipe, target = te_recipe(recipe)
    d = parity_data(bias)
    autocast = lambda: te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe)  # noqa: E731
    with pytest.MonkeyPatch.context() as mp, te_device.target_gpu(target):
        mutate_gemms(mp, mutation)
        init = (
            te.quantized_model_init(enabled=True, recipe=fp8_recipe)
            if fp8_params
            else contextlib.nullcontext()
        )
        with init:
            layer = te.Linear(
                K,
                N,
                bias=bias,
                params_dtype=torch.bfloat16,
                device="cpu",
                fuse_wgrad_accumulation=fuse,
            )
        with torch.no_grad():
            layer.weight.copy_(d["w"])
            if bias:
                layer.bias.copy_(d["b"])
        if fuse:
            layer.weight.main_grad = d["main_grad"].clone()
        x = d["x"].clone().requires_grad_()
        with autocast():
            y = layer(x)
        if mutation == "stale_columnwise":
            _stale_columnwise(layer.weight, d["w"])
        y.backward(d["dy"])
        te_out = {
            "out": y.detach(),
            "dx": x.grad,
            "dw": layer.weight.main_grad if fuse else layer.weight.grad,
        }
        if bias:
            te_out["db"] = layer.bias.grad

        if recipe == "bf16":  # TE's cuBLAS: fp32 accumulation, bias in the fp32 epilogue
            out32 = torch.matmul(d["x"].float(), d["w"].float().t())
            ref = {
                "out": (out32 + d["b"].float() if bias else out32).bfloat16(),
                "dx": torch.matmul(d["dy"].float(), d["w"].float()).bfloat16(),
                "dw": reference_wgrad32(recipe, d["x"], d["dy"]).bfloat16(),
            }
            if bias:
                ref["db"] = d["dy"].float().sum(0).bfloat16()
        else:
            cls = MXFP8Linear if recipe == "mxfp8" else BlockwiseFP8Linear
            cpu = cls(K, N, bias=bias, fp8_params=False)
            with torch.no_grad():
                cpu.weight.copy_(d["w"])
                if bias:
                    cpu.bias.copy_(d["b"])
            x2 = d["x"].clone().requires_grad_()
            with autocast():
                y2 = cpu(x2)
                wgrad32 = reference_wgrad32(recipe, d["x"], d["dy"])
            y2.backward(d["dy"])
            ref = {"out": y2.detach(), "dx": x2.grad, "dw": cpu.weight.grad}
            if bias:
                ref["db"] = cpu.bias.grad
        if fuse:
            ref["dw"] = d["main_grad"] + (
                wgrad32 if recipe != "bf16" else reference_wgrad32(recipe, d["x"], d["dy"])
            )
    return {"losses": [float(y.float().sum())], "te": te_out, "ref": ref}


LINEAR_CASES = [
    # recipe, bias, fp8 params, fused wgrad accumulation into main_grad
    ("bf16", True, False, False),
    ("bf16", False, False, True),
    ("mxfp8", True, False, False),
    ("mxfp8", True, True, True),
    ("blockwise", True, False, False),
    ("blockwise", False, True, True),
]


@pytest.mark.parametrize("recipe,bias,fp8_params,fuse", LINEAR_CASES)
def test_te_linear_equals_cpu_linear(recipe, bias, fp8_params, fuse):
    """TE's ``Linear`` = the project's CPU linear, bitwise: output, dgrad, wgrad (or the fp32
    ``main_grad`` after ``fuse_wgrad_accumulation``: the old value plus the fp32 wgrad, one
    rounding) and bias grad. MXFP8 -> ``MXFP8Linear``, blockwise -> ``BlockwiseFP8Linear``, both on
    high-precision and on TE's persistent FP8 weights; bf16 -> cuBLAS's order as documented
    (fp32 products, bias in the fp32 epilogue, one cast)."""
    run = run_on_ranks(linear_run, recipe, bias, fp8_params, fuse, None, world_size=1, boot=BOOT)
    te_equals_reference(run, run)


@pytest.mark.parametrize(
    "recipe,fp8_params,mutation,diverging",
    [
        ("mxfp8", False, "usage", "dx"),
        ("blockwise", False, "usage", "dx"),
        ("mxfp8", True, "stale_columnwise", "dx"),
        ("blockwise", True, "stale_columnwise", "dx"),
        ("bf16", False, "bias_after_cast", "out"),
    ],
)
def test_te_linear_controls_diverge(recipe, fp8_params, mutation, diverging):
    """Controls of the parity: GEMM operands read in the wrong usage (columnwise where TE's
    forward GEMM reads the rowwise copies), a stale columnwise copy of a persistent weight, the bias
    added after the cast (megatron's local order) make TE's module differ from the CPU layer."""
    reference = run_on_ranks(
        linear_run, recipe, True, fp8_params, False, None, world_size=1, boot=BOOT
    )
    mutated = run_on_ranks(
        linear_run, recipe, True, fp8_params, False, mutation, world_size=1, boot=BOOT
    )
    what = assert_diverges(reference, mutated, compare=te_equals_reference)
    assert f"'{diverging}'" in what


def grouped_linear_run(recipe: str, mutation: str | None) -> dict[str, Any]:
    """TE's ``GroupedLinear`` (discrete weights: ``split_quantize`` + ``te_general_grouped_gemm``)
    against one CPU linear of the recipe per expert on its split of the tokens (one expert gets
    none)."""
    import transformer_engine.pytorch as te

    from nemo_lw_fp8.cpu.layers.blockwise_linear import BlockwiseFP8Linear
    from nemo_lw_fp8.cpu.layers.mxfp8_linear import MXFP8Linear
    from nemo_lw_fp8.cpu.te import device as te_device

    fp8_recipe, target = te_recipe(recipe)
    cpu_linear = MXFP8Linear if recipe == "mxfp8" else BlockwiseFP8Linear
    splits, experts = [64, 0, 96], 3
    gen = torch.Generator().manual_seed(13)
    weights = [(spread(N, K, gen) * 0.05).bfloat16() for _ in range(experts)]
    biases = [torch.randn(N, generator=gen).bfloat16() for _ in range(experts)]
    x0 = spread(sum(splits), K, gen).bfloat16()
    dy = spread(sum(splits), N, gen).bfloat16()
    with pytest.MonkeyPatch.context() as mp, te_device.target_gpu(target):
        mutate_gemms(mp, mutation)
        layer = te.GroupedLinear(
            experts, K, N, bias=True, params_dtype=torch.bfloat16, device="cpu"
        )
        with torch.no_grad():
            for i in range(experts):
                getattr(layer, f"weight{i}").copy_(weights[i])
                getattr(layer, f"bias{i}").copy_(biases[i])
        x = x0.clone().requires_grad_()
        with te.autocast(enabled=True, recipe=fp8_recipe):
            y = layer(x, splits)
        y.backward(dy)
        te_out = {"out": y.detach(), "dx": x.grad}
        for i in range(experts):
            te_out[f"dw{i}"] = getattr(layer, f"weight{i}").grad
            te_out[f"db{i}"] = getattr(layer, f"bias{i}").grad

        x2 = x0.clone().requires_grad_()
        cpu = []
        with te.autocast(enabled=True, recipe=fp8_recipe):
            outs = []
            for i, part in enumerate(torch.split(x2, splits)):
                linear = cpu_linear(K, N, fp8_params=False)
                with torch.no_grad():
                    linear.weight.copy_(weights[i])
                    linear.bias.copy_(biases[i])
                cpu.append(linear)
                outs.append(linear(part))
        y2 = torch.cat(outs)
        y2.backward(dy)
        ref = {"out": y2.detach(), "dx": x2.grad}
        for i, linear in enumerate(cpu):
            ref[f"dw{i}"] = linear.weight.grad
            ref[f"db{i}"] = linear.bias.grad
    return {"losses": [float(y.float().sum())], "te": te_out, "ref": ref}


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_te_grouped_linear_equals_cpu_linears_per_expert(recipe):
    """TE's ``GroupedLinear`` with discrete weights (its default split-quantize path; the
    grouped-tensor path is opt-in through ``use_grouped_tensor`` or
    ``NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM``, or forced by single grouped weights) on the
    recipe's target = the project's ``BlockwiseFP8Linear`` /
    ``MXFP8Linear`` applied to each expert's split, bitwise: output, dgrad, every expert's wgrad
    and bias grad (an expert without tokens included); control: the wrong operand usage
    diverges."""
    reference = run_on_ranks(grouped_linear_run, recipe, None, world_size=1, boot=BOOT)
    te_equals_reference(reference, reference)
    mutated = run_on_ranks(grouped_linear_run, recipe, "usage", world_size=1, boot=BOOT)
    assert_diverges(reference, mutated, compare=te_equals_reference)
