"""TE 2.20.2's own ``LayerNormLinear`` on CPU (issue 28), with only ``transformer_engine_torch``
emulated and the device questions answered as the recipe's GPU, against the project's
``CPULayerNormColumnParallelLinear``, bitwise. Control: the GEMMs' operands read in the
other usage make the dgrad diverge; shared data and mutations in
``tests.support.te_module_parity``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.harness import run_on_ranks
from tests.support.parity import assert_diverges
from tests.support.te_helpers import te_recipe
from tests.support.te_module_parity import (
    BOOT,
    K,
    N,
    mutate_gemms,
    parity_data,
    te_equals_reference,
)


def _copy_params(
    layer: Any, d: dict, gamma: torch.Tensor, beta: torch.Tensor, normalization: str, bias: bool
) -> None:
    """The same weight, norm parameters and bias into TE's layer and into the CPU layer."""
    with torch.no_grad():
        layer.weight.copy_(d["w"])
        layer.layer_norm_weight.copy_(gamma)
        if normalization == "LayerNorm":
            layer.layer_norm_bias.copy_(beta)
        if bias:
            layer.bias.copy_(d["b"])


def norm_linear_run(recipe: str, normalization: str, zero_centered: bool, mutation: str | None):
    """TE's ``LayerNormLinear`` and the project's CPU fused norm + linear
    (``CPULayerNormColumnParallelLinear`` of the recipe) on equal data."""
    import transformer_engine.pytorch as te
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_lw_fp8.cpu.layers.norm_linear import (
        CPULayerNormColumnParallelLinear,
        _NormBeforeLinear,
    )
    from nemo_lw_fp8.cpu.te import device as te_device
    from nemo_lw_fp8.cpu.te.tex import normalization as te_kernels_norm

    fp8_recipe, target = te_recipe(recipe)
    bias = recipe != "bf16"  # megatron's bf16 linear adds its bias after the cast (see doc)
    d = parity_data(bias)
    gen = torch.Generator().manual_seed(5)
    gamma = (torch.rand(K, generator=gen) * 0.5 + (0.0 if zero_centered else 0.5)).bfloat16()
    beta = (torch.randn(K, generator=gen) * 0.1).bfloat16()
    eps = 1e-5
    with pytest.MonkeyPatch.context() as mp, te_device.target_gpu(target):
        mutate_gemms(mp, mutation)
        layer = te.LayerNormLinear(
            K,
            N,
            eps=eps,
            bias=bias,
            normalization=normalization,
            zero_centered_gamma=zero_centered,
            params_dtype=torch.bfloat16,
            device="cpu",
        )
        _copy_params(layer, d, gamma, beta, normalization, bias)
        x = d["x"].clone().requires_grad_()
        with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
            y = layer(x)
        y.backward(d["dy"])
        te_out = {"out": y.detach(), "dx": x.grad, "dw": layer.weight.grad}
        if bias:
            te_out["db"] = layer.bias.grad

        config = TransformerConfig(
            num_layers=1,
            hidden_size=K,
            num_attention_heads=4,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_cpu_initialization=True,
            gradient_accumulation_fusion=False,
            normalization=normalization,
            layernorm_epsilon=eps,
            layernorm_zero_centered_gamma=zero_centered,
        )
        config.fp8 = None if recipe == "bf16" else "e4m3"
        config.fp8_recipe = recipe
        cpu = CPULayerNormColumnParallelLinear(
            K,
            N,
            config=config,
            init_method=torch.nn.init.zeros_,
            bias=bias,
            gather_output=False,
            skip_bias_add=False,
            is_expert=False,
        )
        _copy_params(cpu, d, gamma, beta, normalization, bias)
        x2 = d["x"].clone().requires_grad_()
        with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
            h = cpu.norm(x2)
            h.retain_grad()
            y2, _ = super(_NormBeforeLinear, cpu).forward(h)
        y2.backward(d["dy"])
        ref = {"out": y2.detach(), "dw": cpu.weight.grad}
        dh = h.grad
        if bias:
            ref["db"] = cpu.bias.grad
        if recipe == "bf16":
            # megatron's local bf16 linear runs torch's bf16 CPU GEMM (its own accumulation
            # order): the bitwise reference is the documented fp32 GEMM on the CPU norm's output
            hf, wf, dyf = h.detach().float(), d["w"].float(), d["dy"].float()
            ref = {
                "out": torch.matmul(hf, wf.t()).bfloat16(),
                "dw": torch.matmul(dyf.t(), hf).bfloat16(),
            }
            dh = torch.matmul(dyf, wf).bfloat16()
            local = {"out": y2.detach(), "dw": cpu.weight.grad}
        # dx: the CPU linear's dgrad (h.grad) through the emulated norm backward (the norm
        # itself is a stand-in, checked against float64 in test_te_kernels.py).
        if normalization == "RMSNorm":
            _, _, rsigma = te_kernels_norm.rmsnorm_fwd(
                d["x"], gamma, eps, None, None, None, 0, zero_centered
            )
            ref["dx"] = te_kernels_norm.rmsnorm_bwd(dh, d["x"], rsigma, gamma, 0, zero_centered)[0]
        else:
            _, mu, rsigma = te_kernels_norm.layernorm_fwd(
                d["x"], gamma, beta, eps, None, None, None, 0, zero_centered
            )
            ref["dx"] = te_kernels_norm.layernorm_bwd(
                dh, d["x"], mu, rsigma, gamma, 0, zero_centered
            )[0]
        autograd_dx = x2.grad
        # How far the CPU layer's own results are: its autograd through torch's norm (and for
        # bf16 torch's bf16 GEMM), relative to each tensor's largest magnitude.
        far = {"dx": (x.grad, autograd_dx)}
        if recipe == "bf16":
            far.update({k: (te_out[k], v) for k, v in local.items()})
    return {
        "losses": [float(y.float().sum())],
        "te": te_out,
        "ref": ref,
        "relative_to_cpu_autograd": {
            k: float((a.float() - b.float()).abs().max() / b.float().abs().max())
            for k, (a, b) in far.items()
        },
    }


@pytest.mark.parametrize(
    "recipe,normalization,zero_centered",
    [
        ("mxfp8", "RMSNorm", False),
        ("mxfp8", "LayerNorm", True),
        ("blockwise", "RMSNorm", True),
        ("blockwise", "LayerNorm", False),
        ("bf16", "RMSNorm", False),
    ],
)
def test_te_layernorm_linear_equals_cpu_norm_linear(recipe, normalization, zero_centered):
    """TE's ``LayerNormLinear`` = the project's ``CPULayerNormColumnParallelLinear`` bitwise:
    output (the norm's output equals torch's norm in both), wgrad, bias grad, and dx = the CPU
    linear's dgrad through the emulated norm backward. Against the CPU layer's own autograd
    through torch's norm, dx agrees within 2 bf16 ulps of its largest value (two fp32 formulas
    of the same gradient, each rounded once to bf16). bf16 (without bias: megatron's bf16 linear
    adds its bias after the cast, TE's cuBLAS epilogue before it): bitwise against the
    documented fp32 GEMM on the CPU norm's output; megatron's local linear (torch's bf16 CPU
    GEMM, another accumulation order) within 2 bf16 ulps of each tensor's largest value."""
    run = run_on_ranks(
        norm_linear_run, recipe, normalization, zero_centered, None, world_size=1, boot=BOOT
    )
    te_equals_reference(run, run)
    for key, relative in run[0]["relative_to_cpu_autograd"].items():
        assert relative <= 2 * 2.0**-8, (key, relative)


def test_te_layernorm_linear_control_diverges():
    """Control: the wrong operand usage in the GEMMs makes LayerNormLinear's dgrad differ."""
    reference, mutated = (
        run_on_ranks(norm_linear_run, "mxfp8", "RMSNorm", False, m, world_size=1, boot=BOOT)
        for m in (None, "usage")
    )
    what = assert_diverges(reference, mutated, compare=te_equals_reference)
    assert "'dx'" in what
