"""The CPU references of fla's Gated DeltaNet kernels (nemo_lw_fp8/cpu/megatron/gated_delta_rule.py)
against a step-by-step recurrence written here, and against fla itself on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nemo_lw_fp8.cpu.megatron import gated_delta_rule as gdr


def _recurrence(q, k, v, g, beta, scale, state):
    """The gated delta rule one step at a time, in float64, head-last layout as fla takes it:
    S <- exp(g) S;  S <- S + beta k (v - S^T k)^T;  o = S^T q * scale."""
    q, k, v, g, beta, state = (t.double() for t in (q, k, v, g, beta, state))
    groups = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        kt, vt = k[:, t], v[:, t]
        error = vt - torch.einsum("bhkv,bhk->bhv", state, kt)
        state = state + beta[:, t][..., None, None] * kt[..., :, None] * error[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]) * scale)
    return torch.stack(outs, dim=1), state


def _inputs(dtype, batch=2, length=150, heads=2, v_heads=4, dk=16, dv=8, seed=0):
    """megatron's kernel inputs: L2-normalised q / k, log decays g < 0, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(rand(batch, length, heads, dk), dim=-1)
    k = F.normalize(rand(batch, length, heads, dk), dim=-1)
    v = rand(batch, length, v_heads, dv)
    g = -F.softplus(rand(batch, length, v_heads)) * 0.3
    beta = torch.sigmoid(rand(batch, length, v_heads))
    h0 = rand(batch, v_heads, dk, dv) * 0.1
    return [t.to(dtype) for t in (q, k, v, g, beta, h0)]


def test_chunked_rule_is_the_recurrence_exactly_in_float64():
    """Same algebra: 150 steps (three chunks of 64, the last padded), grouped value heads, an
    initial and a final state, and the gradients of all inputs; float64 leaves only rounding
    (measured 6e-16)."""
    q, k, v, g, beta, h0 = (t.requires_grad_() for t in _inputs(torch.float64))
    scale = 0.37
    o, final = gdr.chunk_gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True
    )
    o_ref, final_ref = _recurrence(q, k, v, g, beta, scale, h0)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(final, final_ref, rtol=0, atol=1e-12)
    weights = torch.randn_like(o)
    grads = torch.autograd.grad((o * weights).sum() + final.sum(), (q, k, v, g, beta, h0))
    grads_ref = torch.autograd.grad(
        (o_ref * weights).sum() + final_ref.sum(), (q, k, v, g, beta, h0)
    )
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_fp32_kernel_path_as_megatron_calls_it():
    """bf16 q / k / v / beta and fp32 g as megatron passes them: the output comes back in bf16,
    computed in fp32. Against the float64 recurrence of the same bf16 values the fp32 results
    differ by reassociation only (measured: state 6e-7, fp32 output 4e-8; bounds 3-5x that);
    the bf16 output is within one bf16 rounding (2^-8 relative)."""
    q, k, v, g, beta, _ = _inputs(torch.float64, batch=1, length=64, heads=4, v_heads=4, dk=32)
    q, k, v, beta = (t.to(torch.bfloat16) for t in (q, k, v, beta))
    g = g.float()
    o, final = gdr.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    zeros = torch.zeros(1, 4, 32, 8, dtype=torch.float64)
    o_ref, final_ref = _recurrence(q, k, v, g, beta, 32**-0.5, zeros)
    torch.testing.assert_close(final.double(), final_ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(o.double(), o_ref, rtol=2**-8, atol=1e-5)
    o32, _ = gdr.chunk_gated_delta_rule(q.float(), k.float(), v.float(), g=g, beta=beta.float())
    torch.testing.assert_close(o32.double(), o_ref, rtol=0, atol=2e-7)


def test_packed_sequences_restart_the_state():
    """cu_seqlens (batch 1): each packed sequence starts from its own state, as if alone."""
    q, k, v, g, beta, _ = _inputs(torch.float64, batch=1, length=100)
    cu = torch.tensor([0, 37, 100])
    h0 = torch.randn(2, 4, 16, 8, dtype=torch.float64)
    o, final = gdr.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu
    )
    for i, (start, end) in enumerate([(0, 37), (37, 100)]):
        cut = [t[:, start:end] for t in (q, k, v, g, beta)]
        o_ref, final_ref = _recurrence(*cut, 16**-0.5, h0[i : i + 1])
        torch.testing.assert_close(o[:, start:end], o_ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(final[i : i + 1], final_ref, rtol=0, atol=1e-12)


def test_causal_conv1d_and_l2norm_match_torch():
    """The convolution is megatron's own deterministic path (F.conv1d, left padding, SiLU) in
    float64, and zero-padded per packed sequence; l2norm is x / sqrt(sum x^2 + eps)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 20, 12, generator=gen, dtype=torch.float64)
    weight = torch.randn(12, 4, generator=gen, dtype=torch.float64)
    bias = torch.randn(12, generator=gen, dtype=torch.float64)
    y, state = gdr.causal_conv1d(x=x, weight=weight, bias=bias, activation="silu")
    conv = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=3, groups=12)
    torch.testing.assert_close(y, F.silu(conv[..., :20]).transpose(1, 2), rtol=0, atol=1e-14)
    assert state is None
    packed, _ = gdr.causal_conv1d(
        x=x[:1], weight=weight, activation=None, cu_seqlens=torch.tensor([0, 7, 20])
    )
    for start, end in ((0, 7), (7, 20)):
        alone, _ = gdr.causal_conv1d(x=x[:1, start:end], weight=weight)
        torch.testing.assert_close(packed[:, start:end], alone, rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="initial_state"):
        gdr.causal_conv1d(x, weight, initial_state=torch.zeros(2, 12, 4))

    xb = torch.randn(3, 5, 32, generator=gen).to(torch.bfloat16)
    out = gdr.l2norm(xb)
    assert out.dtype == torch.bfloat16
    xf = xb.float()
    want = (xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(out, want)


class _FakeCuda:
    is_cuda = True


def test_cuda_inputs_still_go_to_fla():
    """The installed functions never shadow a working kernel: CUDA inputs reach fla's (here a
    recording stand-in), CPU inputs the reference; without fla the reference is used as is."""
    calls = []

    def kernel(*args, **kwargs):
        calls.append((args, kwargs))
        return "fla"

    dispatch = gdr._kernel_for_cuda(kernel, gdr.l2norm)
    assert dispatch(_FakeCuda()) == "fla"
    assert dispatch(x=_FakeCuda()) == "fla"  # megatron passes causal_conv1d's x by keyword
    assert len(calls) == 2
    x = torch.randn(2, 32)
    assert torch.equal(dispatch(x), gdr.l2norm(x)) and len(calls) == 2
    assert gdr._kernel_for_cuda(None, gdr.l2norm) is gdr.l2norm


def _fla_kernels():
    try:
        from fla.modules.convolution import causal_conv1d
        from fla.modules.l2norm import l2norm
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as err:  # pragma: no cover - GPU machines only
        pytest.skip(f"flash-linear-attention is not importable: {err}")
    return causal_conv1d, l2norm, chunk_gated_delta_rule


@pytest.mark.gpu
def test_references_match_fla_on_gpu():
    """fla's Triton kernels and the references on the same CUDA inputs (the references run on
    any device): both accumulate in fp32, in different orders, so the bf16 outputs agree to a
    bf16 rounding and the fp32 state to reassociation."""
    causal_conv1d, l2norm, chunk_gated_delta_rule = _fla_kernels()
    q, k, v, g, beta, _ = _inputs(torch.float64, batch=2, length=150, heads=4, v_heads=8, dk=64)
    q, k, v, beta = (t.to("cuda", torch.bfloat16) for t in (q, k, v, beta))
    g = g.to("cuda", torch.float32)
    o, final = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True)
    o_ref, final_ref = gdr.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True)
    torch.testing.assert_close(final, final_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(o.float(), o_ref.float(), rtol=2**-7, atol=1e-3)

    x = torch.randn(2, 100, 64, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(64, 4, device="cuda", dtype=torch.bfloat16)
    y, _ = causal_conv1d(x=x, weight=weight, activation="silu")
    y_ref, _ = gdr.causal_conv1d(x=x, weight=weight, activation="silu")
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(l2norm(x).float(), gdr.l2norm(x).float(), rtol=2**-7, atol=1e-3)
