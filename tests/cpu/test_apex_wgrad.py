"""The stand-in for APEX's ``fused_weight_gradient_mlp_cuda``
(``nemo_lw_fp8.cpu.megatron.apex_wgrad``):
``main_grad += dy^T x`` against a float64 reference within the bound its fp32 arithmetic
explains (an fp32 dot product of ``n`` terms: ``n * 2^-24 * sum|terms|``, Higham's gamma_n; one
more rounding for the add, and half an ulp of bf16 for the bf16 kernel's single cast), and
installed where megatron looks for it, undone by ``uninstall``. Control: the unfused order (the
product rounded to bf16 before it is added, megatron's path without the fusion) leaves the bound
of the fused kernel on values chosen so the early rounding shows."""

from __future__ import annotations

import torch

from nemo_lw_fp8.cpu.megatron import apex_wgrad

U32, U_BF16 = 2.0**-24, 2.0**-8


def _operands(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 48, 64, generator=gen).bfloat16()  # [seq, batch, in], as megatron passes
    dy = torch.randn(2, 48, 32, generator=gen).bfloat16()
    old = torch.randn(32, 64, generator=gen)
    return x, dy, old


def _reference(x: torch.Tensor, dy: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """float64 ``old + dy^T x`` and the bound of the fused kernel's fp32 arithmetic."""
    x64 = x.reshape(-1, x.shape[-1]).double()
    dy64 = dy.reshape(-1, dy.shape[-1]).double()
    terms = dy64.t().abs() @ x64.abs()
    return dy64.t() @ x64 + old.double(), x64.shape[0] * U32 * terms + U32 * (terms + old.abs())


def test_fp32_accumulation_within_its_bound():
    x, dy, old = _operands()
    main_grad = old.clone()
    apex_wgrad.wgrad_gemm_accum_fp32(x, dy, main_grad)
    ref, bound = _reference(x, dy, old)
    assert ((main_grad.double() - ref).abs() <= bound).all()


def test_bf16_accumulation_rounds_once():
    x, dy, old = _operands()
    main_grad = old.bfloat16()
    apex_wgrad.wgrad_gemm_accum_fp16(x, dy, main_grad)
    ref, bound = _reference(x, dy, old.bfloat16().float())
    assert ((main_grad.double() - ref).abs() <= bound + U_BF16 * ref.abs()).all()


def test_control_rounding_the_product_first_leaves_the_bound():
    """1 + 2^-9 (the product) rounds to 1 in bf16 before the add; fused, the fp32 sum keeps it."""
    x = torch.tensor([[1.0 + 2.0**-7], [1.0]]).bfloat16()  # two tokens, one input feature
    dy = torch.tensor([[1.0], [2.0**-9 - 2.0**-7]]).bfloat16()
    old = torch.tensor([[2.0**-8]])
    fused = old.clone()
    apex_wgrad.wgrad_gemm_accum_fp32(x, dy, fused)
    unfused = old + (dy.t() @ x).float()  # megatron without the fusion: bf16 product first
    ref, bound = _reference(x, dy, old)
    assert (fused.double() - ref).abs().item() <= bound.item()
    assert (unfused.double() - ref).abs().item() > bound.item()


def install_round_trip() -> dict:
    """In a rank worker (TE activated before megatron, as every CPU run does): install, check
    where megatron looks, install again, uninstall, check everything is back."""
    import sys

    from megatron.core.tensor_parallel import layers

    before = layers._grad_accum_fusion_available
    first, second = apex_wgrad.install(), None
    try:
        seen = {
            "flag": layers._grad_accum_fusion_available,
            "kernel": layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32
            is apex_wgrad.wgrad_gemm_accum_fp32,
            "emulated": sys.modules[apex_wgrad.EXTENSION].EMULATED,
        }
        second = apex_wgrad.install()
    finally:
        apex_wgrad.uninstall()
    restored = layers._grad_accum_fusion_available == before
    return {"first": first, "second": second, **seen, "restored": restored,
            "gone": apex_wgrad.EXTENSION not in sys.modules}  # fmt: skip


def test_installed_where_megatron_looks_and_undone():
    from tests.support.harness import BootOptions, run_on_ranks

    r = run_on_ranks(install_round_trip, world_size=1, boot=BootOptions(fp8_emulation=True))[0]
    assert r == {"first": True, "second": False, "flag": True, "kernel": True, "emulated": True,
                 "restored": True, "gone": True}, r  # fmt: skip
