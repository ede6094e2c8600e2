"""NVFP4 outputs of TE's norms (issue 30): ``LayerNormLinear`` under ``NVFP4BlockScaling``.

TE 2.20.2's ``LayerNormLinear`` hands its input quantizer to ``tex.rmsnorm_fwd`` /
``tex.layernorm_fwd``; TE's C++ (``normalization.cpp``) has no NVFP4 norm kernel: it writes the
norm in the input's dtype and casts that
(``nemo_lw_fp8.cpu.te.tex.cast.NVFP4_OUTPUT_IS_THE_CAST`` says why both of its paths give the
plain cast). So the claim, bitwise: ``LayerNormLinear(x)`` equals TE's
own norm module followed by TE's ``Linear`` with the same weights (output, dx, dW, the norm's
dgamma / dbeta), with the recipe's RHT on the input's columnwise copy and stochastic rounding
off. Control: the norm's output cast without the RHT (the Linear still rotates dy) makes dW
diverge while the output stays equal (the RHT touches only the wgrad operands).

Everything TE runs in one subprocess (this process never imports TE).
"""

from __future__ import annotations

import pytest

from nemo_lw_fp8.vocabulary import NVFP4_NO_SR_ENV as NVFP4_NO_SR
from tests.support.te_test_support import blackwell_script, needs_te, run_te_script

TE_SCRIPT = blackwell_script(
    r"""
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import NVFP4BlockScaling
from nemo_lw_fp8.cpu.te.tex import normalization as te_kernels_norm

RECIPE = NVFP4BlockScaling(disable_rht=False, disable_stochastic_rounding=True)
TOKENS, HIDDEN, OUT = 64, 128, 96

# output, dx and the grads of params, of forward on a fresh leaf copy of x
def forward_backward(forward, x, dy, params):
    xx = x.clone().requires_grad_()
    y = forward(xx)
    y.backward(dy)
    return [y.detach(), xx.grad] + [p.grad for p in params]

# the same linear weight, gamma and (LayerNorm) beta in both variants; returns the parameters
# whose grads are compared, in the order dW, dgamma(, dbeta)
def load_weights(linear, norm_weight, norm_bias, weight, gamma, beta):
    with torch.no_grad():
        linear.weight.copy_(weight); norm_weight.copy_(gamma)
        if beta is not None:
            norm_bias.copy_(beta)
    return [linear.weight, norm_weight] + ([norm_bias] if beta is not None else [])

def run_fused(kind, x, dy, weight, gamma, beta):
    m = te.LayerNormLinear(HIDDEN, OUT, bias=False, normalization=kind,
                           params_dtype=torch.bfloat16, device="cpu")
    params = load_weights(m, m.layer_norm_weight, getattr(m, "layer_norm_bias", None),
                          weight, gamma, beta)
    def forward(xx):
        with te.autocast(enabled=True, recipe=RECIPE):
            return m(xx)
    return forward_backward(forward, x, dy, params)

def run_split(kind, x, dy, weight, gamma, beta):
    norm = (te.RMSNorm(HIDDEN, params_dtype=torch.bfloat16, device="cpu") if kind == "RMSNorm"
            else te.LayerNorm(HIDDEN, params_dtype=torch.bfloat16, device="cpu"))
    lin = te.Linear(HIDDEN, OUT, bias=False, params_dtype=torch.bfloat16, device="cpu")
    params = load_weights(lin, norm.weight, getattr(norm, "bias", None), weight, gamma, beta)
    def forward(xx):
        h = norm(xx)  # outside autocast: a bf16 norm, no output quantizer
        with te.autocast(enabled=True, recipe=RECIPE):
            return lin(h)
    return forward_backward(forward, x, dy, params)

def eq(a, b):
    return [bool(torch.equal(u, v)) for u, v in zip(a, b, strict=True)]

g = torch.Generator().manual_seed(7)
x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
dy = torch.randn(TOKENS, OUT, generator=g).to(torch.bfloat16)
weight = (torch.randn(OUT, HIDDEN, generator=g) * 0.05).to(torch.bfloat16)
gamma = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(torch.bfloat16)
beta = (0.1 * torch.randn(HIDDEN, generator=g)).to(torch.bfloat16)

calls = []
original_finish = te_kernels_norm._finish
def counting_finish(y32, x_, out, quantizer, otype):
    calls.append(type(quantizer).__name__)
    return original_finish(y32, x_, out, quantizer, otype)
te_kernels_norm._finish = counting_finish
for kind, b in (("RMSNorm", None), ("LayerNorm", beta)):
    fused = run_fused(kind, x, dy, weight, gamma, b)
    R[kind] = {
        "equal": eq(fused, run_split(kind, x, dy, weight, gamma, b)),
        "finite": all(bool(t.float().isfinite().all()) for t in fused),
    }
R["norm_quantizers"] = sorted(set(calls))

# control: the norm output's columnwise copy cast without the RHT
def finish_without_rht(y32, x_, out, quantizer, otype):
    if quantizer is not None and getattr(quantizer, "with_rht", False):
        quantizer = quantizer.copy()
        quantizer.with_rht = False
        quantizer.with_post_rht_amax = False
    return original_finish(y32, x_, out, quantizer, otype)
te_kernels_norm._finish = finish_without_rht
R["control_no_rht"] = eq(run_fused("RMSNorm", x, dy, weight, gamma, None),
                         run_split("RMSNorm", x, dy, weight, gamma, None))
te_kernels_norm._finish = original_finish
print("RESULT " + json.dumps(R))
""", env=(NVFP4_NO_SR,)
)


@pytest.fixture(scope="module")
def te_results() -> dict:
    return run_te_script(TE_SCRIPT, timeout=600)


@needs_te
@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_layernorm_linear_nvfp4_equals_norm_then_linear(te_results, kind):
    """``LayerNormLinear`` (RHT on, SR off) = TE's norm module then TE's ``Linear``, bitwise:
    output, dx, dW, dgamma (and dbeta for LayerNorm); the norm kernels really got an
    ``NVFP4Quantizer``."""
    assert te_results["backend"] == "emulated"
    assert "NVFP4Quantizer" in te_results["norm_quantizers"], te_results["norm_quantizers"]
    result = te_results[kind]
    assert result["finite"] is True
    assert all(result["equal"]), result


@needs_te
def test_control_norm_output_without_rht_diverges(te_results):
    """Control: the norm's NVFP4 output cast without the RHT gives the same forward (the RHT
    only rotates the columnwise copy) and a different dW."""
    y_equal, _dx_equal, dw_equal, _dgamma_equal = te_results["control_no_rht"]
    assert y_equal is True
    assert dw_equal is False, te_results["control_no_rht"]
