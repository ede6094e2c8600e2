"""Muon on a single grouped expert weight equals Muon on its E separate matrices, bitwise."""

from __future__ import annotations

import pytest
import torch

import nemo_lw_fp8
from nemo_lw_fp8.mechanics.grouped import MEMBERS_ATTR

EXPERTS, ROWS, COLS = 4, 48, 32


def _muon(params):
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    return TensorParallelMuon(
        params,
        lr=0.02,
        momentum=0.95,
        nesterov=True,
        weight_decay=0.01,
        fp32_matmul_prec="highest",
        scale_mode="spectral",
    )


def _grouped_vs_separate(steps: int = 3) -> tuple[torch.Tensor, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(EXPERTS * ROWS, COLS, generator=generator)
    grouped = torch.nn.Parameter(start.clone())
    setattr(grouped, MEMBERS_ATTR, EXPERTS)
    separate = [torch.nn.Parameter(part.clone()) for part in start.view(EXPERTS, ROWS, COLS)]
    grouped_opt, separate_opt = _muon([grouped]), _muon(separate)
    for _ in range(steps):
        grad = torch.randn(EXPERTS * ROWS, COLS, generator=generator)
        grouped.grad = grad.clone()
        for param, part in zip(separate, grad.view(EXPERTS, ROWS, COLS), strict=True):
            param.grad = part.clone()
        grouped_opt.step()
        separate_opt.step()
    return grouped.detach(), [p.detach() for p in separate]


def test_grouped_update_equals_separate_updates():
    nemo_lw_fp8.apply(["grouped_weight_layerwise"])
    try:
        grouped, separate = _grouped_vs_separate()
    finally:
        nemo_lw_fp8.revert()
    for expert, matrix in enumerate(separate):
        assert torch.equal(grouped.view(EXPERTS, ROWS, COLS)[expert], matrix), expert


def test_stock_muon_orthogonalises_the_stack():
    """Control: without the patch the grouped weight trains differently (the bug it fixes)."""
    grouped, separate = _grouped_vs_separate()
    assert not torch.equal(grouped.view(EXPERTS, ROWS, COLS), torch.stack(separate))


def test_members_must_divide_the_rows():
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    nemo_lw_fp8.apply(["grouped_weight_layerwise"])
    try:
        param = torch.nn.Parameter(torch.randn(10, 32))
        setattr(param, MEMBERS_ATTR, 4)
        with pytest.raises(RuntimeError, match="split evenly"):
            TensorParallelMuon.orthogonalize(_muon([param]), param, torch.randn(10, 32))
    finally:
        nemo_lw_fp8.revert()
