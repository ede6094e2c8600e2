"""TE 2.20.2's fused MoE permutation (``moe_permute_fusion``) on CPU: TE's own
``transformer_engine.pytorch.permutation`` functions over the stand-ins of its Triton launch
wrappers (``nemo_lw_fp8.cpu.te.triton_permutation``), against per-token loop references
written from the kernels' definition (expert-major destination rows; an fp32 accumulator per
token over its routed rows in descending row order, rounded once).

Edge cases: tokens routed nowhere and to every expert, a routed slot whose prob is 0 (written as
zeros), per-expert padding (``moe_permute_and_pad_with_probs``), MXFP8 tokens (data bytes and
scale rows move together), the backward of both directions, chunk sorting with tokens past the
split sizes. Control: the stand-in accumulating in ascending row order diverges on three terms
whose fp32 sum depends on the order (random bf16 terms would not show it: their fp32 sums are
almost always exact)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nemo_lw_fp8.cpu.te import backend as te_backend
from tests.support.harness import BootOptions, run_on_ranks

if te_backend.te_package_dirs() is None:  # find, never import, TE in this process
    pytest.skip("TE's permutation needs TE's Python package", allow_module_level=True)

BOOT = BootOptions(fp8_emulation=True)
TOKENS, EXPERTS, HIDDEN = 128, 5, 64


def _routing(gen: torch.Generator) -> torch.Tensor:
    routing = torch.rand(TOKENS, EXPERTS, generator=gen) < 0.4
    routing[0] = False  # routed nowhere
    routing[1] = True  # routed to every expert
    return routing


def _destinations(routing: torch.Tensor, pad: list[int] | None) -> dict[tuple[int, int], int]:
    """(token, expert) -> permuted row: experts in order, tokens in order within an expert."""
    rows, row = {}, 0
    for e in range(routing.shape[1]):
        for t in range(routing.shape[0]):
            if routing[t, e]:
                rows[(t, e)] = row + (pad[e] if pad else 0)
                row += 1
    return rows


def _ref_unpermute(
    permuted: torch.Tensor, routing: torch.Tensor, rows: dict, merging: torch.Tensor | None
) -> torch.Tensor:
    out = torch.empty(routing.shape[0], permuted.shape[1], dtype=permuted.dtype)
    for t in range(routing.shape[0]):
        acc = torch.zeros(permuted.shape[1], dtype=torch.float32)
        for e in reversed(range(routing.shape[1])):  # descending permuted row
            if routing[t, e]:
                term = permuted[rows[(t, e)]].float()
                if merging is not None:
                    term = term * merging[t, e].float()
                acc = acc + term
        out[t] = acc.to(permuted.dtype)
    return out


def permutation_case() -> dict[str, Any]:
    """TE's fused permute / unpermute / pad / chunk sort on CPU vs the loop references."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch import permutation as te_perm
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

    from nemo_lw_fp8.cpu.te import device as te_device

    gen = torch.Generator().manual_seed(5)
    routing = _routing(gen)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16().requires_grad_(True)
    probs = torch.rand(TOKENS, EXPERTS, generator=gen) * routing
    routing[2, 0], probs[2, 0] = True, 0.0  # a routed slot with prob 0
    n_out = int(routing.sum())
    rows = _destinations(routing, None)
    r: dict[str, Any] = {}
    with te_device.target_gpu(te_device.BLACKWELL):
        out, pprobs, row_id_map = te_perm.moe_permute_with_probs(
            x, probs, routing.int(), num_out_tokens=n_out
        )
        ref = torch.zeros(n_out, HIDDEN, dtype=torch.bfloat16)
        ref_probs = torch.zeros(n_out)
        for (t, e), row in rows.items():
            ref[row] = x.detach()[t] if probs[t, e] != 0 else 0
            ref_probs[row] = probs[t, e]
        r["permute"] = torch.equal(out.detach(), ref) and torch.equal(pprobs.detach(), ref_probs)

        # permute backward: each token's gradient sums its routed rows (fp32, rounded once)
        g = torch.randn(n_out, HIDDEN, generator=gen).bfloat16()
        out.backward(g)
        r["permute_backward"] = torch.equal(x.grad, _ref_unpermute(g, routing, rows, None))

        # unpermute with merging probs, forward and backward
        y = torch.randn(n_out, HIDDEN, generator=gen).bfloat16().requires_grad_(True)
        merging = probs.clone().requires_grad_(True)
        merged = te_perm.moe_unpermute(
            y, row_id_map, merging_probs=merging, restore_shape=(TOKENS, HIDDEN)
        )
        r["unpermute"] = torch.equal(
            merged.detach(), _ref_unpermute(y.detach(), routing, rows, probs)
        )
        dz = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16()
        merged.backward(dz)
        ref_dy = torch.zeros(n_out, HIDDEN, dtype=torch.bfloat16)
        ref_dp = torch.zeros(TOKENS, EXPERTS)
        for (t, e), row in rows.items():
            ref_dy[row] = (dz[t].float() * probs[t, e]).bfloat16()
            prod = y.detach()[row].float() * dz[t].float()
            ref_dp[t, e] = prod.double().sum().float()
        r["unpermute_backward"] = torch.equal(y.grad, ref_dy) and torch.equal(merging.grad, ref_dp)

        # per-expert padding to a multiple of 16 rows, MXFP8 tokens (bytes and scales move)
        counts = routing.sum(0)
        padded = ((counts + 15) // 16) * 16
        pad = (torch.cumsum(padded - counts, 0) - (padded - counts)).tolist()
        quantizer = MXFP8Quantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False)
        quantizer.optimize_for_gemm = False  # compact scales, as the permutation requires
        xq = quantizer(x.detach())
        data, scales = xq._rowwise_data.view(torch.uint8), xq._rowwise_scale_inv.view(torch.uint8)
        pout, _pp, _map, offsets, target = te_perm.moe_permute_and_pad_with_probs(
            xq, probs, routing.int(), counts, 16
        )
        rows_pad = _destinations(routing, pad)
        ref_data = torch.zeros(int(padded.sum()), HIDDEN, dtype=torch.uint8)
        ref_scale = torch.zeros(int(padded.sum()), scales.shape[1], dtype=torch.uint8)
        for (t, e), row in rows_pad.items():
            if probs[t, e] != 0:
                ref_data[row] = data[t]
            ref_scale[row] = scales[t]
        r["pad_offsets"] = offsets.tolist() == pad and torch.equal(target, padded)
        r["padded_mxfp8"] = torch.equal(
            pout._rowwise_data.view(torch.uint8), ref_data
        ) and torch.equal(pout._rowwise_scale_inv.view(torch.uint8), ref_scale)

        # chunk sort: 4 chunks reordered, 6 tokens past the chunks keep their rows
        sizes = torch.tensor([3, 0, 5, 2])
        order = torch.tensor([2, 0, 3, 1])
        z = torch.randn(16, HIDDEN, generator=gen).bfloat16()
        sorted_z = te_perm.moe_sort_chunks_by_index(z, sizes, order)
        chunks = list(z[:10].split(sizes.tolist()))
        ref_sorted = torch.cat([chunks[i] for i in order.tolist()] + [z[10:]])
        r["chunk_sort"] = torch.equal(sorted_z, ref_sorted)
    return r


def order_case(ascending: bool) -> dict[str, Any]:
    """Three fp32 terms whose sum depends on the order: 1 + 2^-24 + 2^-24 is 1 (ties to even)
    summed from the largest, 1 + 2^-23 from the smallest."""
    from transformer_engine.pytorch import permutation as te_perm

    from nemo_lw_fp8.cpu.te import device as te_device

    if ascending:  # the control: each token's rows ascending, so its sum runs the other way
        import transformer_engine.pytorch.triton.permutation as te_triton

        from nemo_lw_fp8.cpu.te import triton_permutation as stand_in

        original = stand_in.make_row_id_map

        def ascending_map(routing_map: Any, num_tokens: int, num_experts: int) -> Any:
            m = original(routing_map, num_tokens, num_experts)
            m[:, :3] = m[:, :3].flip(1)
            m[:, 3:6] = m[:, 3:6].flip(1)
            return m

        te_triton.make_row_id_map = ascending_map
    routing = torch.ones(1, 3, dtype=torch.int32)
    with te_device.target_gpu(te_device.BLACKWELL):
        _, _, row_id_map = te_perm.moe_permute_with_probs(
            torch.zeros(1, 4), torch.ones(1, 3), routing, num_out_tokens=3
        )
        permuted = torch.tensor([[2.0**-24] * 4, [2.0**-24] * 4, [1.0] * 4])  # experts 0, 1, 2
        total = te_perm.moe_unpermute(permuted, row_id_map, restore_shape=(1, 4))
    return {"sum": total[0, 0].item()}


def test_fused_permutation_matches_the_kernels_definition():
    r = run_on_ranks(permutation_case, world_size=1, boot=BOOT)[0]
    assert r == dict.fromkeys(r, True) and len(r) == 7, r


def test_unpermute_sums_in_the_row_maps_order():
    assert run_on_ranks(order_case, False, world_size=1, boot=BOOT)[0] == {"sum": 1.0}


def test_control_ascending_rows_diverge():
    """The control: the same stand-ins with each token's rows ascending."""
    assert run_on_ranks(order_case, True, world_size=1, boot=BOOT)[0] == {"sum": 1.0 + 2.0**-23}
