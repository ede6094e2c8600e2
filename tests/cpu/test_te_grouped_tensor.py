"""TE 2.20.2's op-fuser ``GroupedLinear`` on its grouped-tensor path (issue 28): single grouped
MXFP8 weights, as the MXFP8 recipes' ``TEGroupedMLP`` runs them on an SM 10.0 target, with only
``transformer_engine_torch`` emulated (``nemo_lw_fp8/cpu/te/tex/grouped_tensor.py``),
against the project's ``MXFP8Linear`` applied to each expert's split of the tokens, bitwise.

Each parity has a control kept in the suite that must make the same comparison fail by
divergence (``tests.support.parity.assert_diverges``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.harness import BootOptions, run_on_ranks
from tests.support.parity import assert_diverges
from tests.support.te_helpers import spread
from tests.support.te_module_parity import swap_operand_usage

BOOT = BootOptions(fp8_emulation=True)
K, N = 256, 128  # in / out features: multiples of 128, as TE's grouped MXFP8 layout needs
SPLITS = [256, 0, 128]  # tokens per expert, aligned as megatron aligns op-fuser experts


_spread = spread


def _mutate(mp: pytest.MonkeyPatch, mutation: str | None) -> None:
    """Controls. ``usage``: the grouped GEMMs read each quantized operand in the other usage
    (where both copies exist). ``member_order``: the grouped GEMM pairs each input member with
    the next expert's weight."""
    from nemo_lw_fp8.cpu.te.tex import grouped_tensor as te_kernels_grouped_tensor

    if mutation == "usage":
        swap_operand_usage(mp)
    elif mutation == "member_order":
        real_members = te_kernels_grouped_tensor._members

        def rotated(grouped: Any) -> list[Any]:
            members = real_members(grouped)
            if grouped.quantizer is not None and grouped.first_dims is None:
                return members[1:] + members[:1]
            return members

        mp.setattr(te_kernels_grouped_tensor, "_members", rotated)
    elif mutation is not None:
        raise ValueError(mutation)


def op_grouped_linear_run(mutation: str | None, fuse_wgrad: bool) -> dict[str, Any]:
    """TE's ``ops.GroupedLinear(single_grouped_weight=True)`` under ``MXFP8BlockScaling`` on the
    Blackwell target (grouped-tensor path: ``splits_to_offsets_multi``, ``group_quantize``,
    ``te_general_grouped_gemm_for_grouped_tensor``) against one ``MXFP8Linear`` per expert; an
    expert without tokens included. With ``fuse_wgrad`` the op accumulates its wgrads into
    ``main_grad`` (megatron's ``gradient_accumulation_fusion``)."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import MXFP8BlockScaling

    from nemo_lw_fp8.cpu.layers.mxfp8_linear import (
        MXFP8Linear,
        _quantize_dequantize,
        grad_fp8_dtype,
        mxfp8_backward,
    )
    from nemo_lw_fp8.cpu.te import device as te_device

    experts = len(SPLITS)
    gen = torch.Generator().manual_seed(17)
    weights = [(_spread(N, K, gen) * 0.05).bfloat16() for _ in range(experts)]
    x0 = _spread(sum(SPLITS), K, gen).bfloat16()
    dy = _spread(sum(SPLITS), N, gen).bfloat16()
    main_grad0 = torch.randn(experts, N, K, generator=gen) * 1e-2
    recipe = MXFP8BlockScaling()
    with pytest.MonkeyPatch.context() as mp, te_device.target_gpu(te_device.BLACKWELL):
        _mutate(mp, mutation)
        # what the MXFP8 recipes' launch environment sets (without it TE falls back to
        # per-expert parameters with a warning)
        mp.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1")
        op = te.ops.GroupedLinear(
            experts, K, N, bias=False, device="cpu", dtype=torch.bfloat16,
            single_grouped_weight=True, accumulate_into_main_grad=fuse_wgrad,
        )  # fmt: skip
        with torch.no_grad():
            op.weight.rowwise_data.view(experts, N, K).copy_(torch.stack(weights))
        if fuse_wgrad:
            op.weight.main_grad = main_grad0.clone().view(-1)
            op.weight.overwrite_main_grad = False
        x = x0.clone().requires_grad_()
        splits = torch.tensor(SPLITS, dtype=torch.int64)
        with te.autocast(enabled=True, recipe=recipe):
            y = op(x, splits)
        y.backward(dy)
        grads = op.weight.main_grad.view(experts, N, K) if fuse_wgrad else op.weight.grad
        te_out = {"out": y.detach(), "dx": x.grad}
        for i in range(experts):
            te_out[f"dw{i}"] = grads.reshape(experts, N, K)[i].clone()
        path = "grouped_tensor" if op_used_grouped_path(op) else "split_quantize"

        x2 = x0.clone().requires_grad_()
        ref = {}
        with te.autocast(enabled=True, recipe=recipe):
            outs, linears = [], []
            for i, part in enumerate(torch.split(x2, SPLITS)):
                linear = MXFP8Linear(K, N, bias=False, fp8_params=False)
                with torch.no_grad():
                    linear.weight.copy_(weights[i])
                linears.append(linear)
                outs.append(linear(part))
            y2 = torch.cat(outs)
            y2.backward(dy)
            for i, (linear, part) in enumerate(zip(linears, torch.split(x0, SPLITS), strict=True)):
                if not fuse_wgrad:
                    ref[f"dw{i}"] = linear.weight.grad
                    continue
                # TE adds the fp32 wgrad into main_grad before any cast
                rows = torch.split(dy, SPLITS)[i]
                if part.shape[0] == 0:
                    ref[f"dw{i}"] = main_grad0[i]
                    continue
                x_col = _quantize_dequantize(part, torch.float8_e4m3fn, "columnwise")
                wgrad32 = mxfp8_backward(rows, x_col, None, grad_fp8_dtype())[1]
                ref[f"dw{i}"] = main_grad0[i] + wgrad32
        ref = {"out": y2.detach(), "dx": x2.grad, **ref}
    return {"losses": [float(y.float().sum())], "te": te_out, "ref": ref, "path": path}


def op_used_grouped_path(op: Any) -> bool:
    """Whether TE's predicate sends this op to the grouped-tensor path on the active target."""
    from transformer_engine.pytorch.ops.basic.grouped_linear import (
        is_op_fuser_grouped_tensor_path_supported,
    )
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    recipe = FP8GlobalStateManager.get_fp8_recipe()
    return is_op_fuser_grouped_tensor_path_supported(recipe, torch.bfloat16)


def _te_equals_reference(reference: list[dict], results: list[dict]) -> None:
    """Bitwise: TE's tensors of ``results`` against the per-expert layers' of ``reference``."""
    ref, te = reference[0]["ref"], results[0]["te"]
    assert ref.keys() == te.keys(), (ref.keys(), te.keys())
    differ = [k for k in ref if not torch.equal(ref[k], te[k])]
    by = {k: float((te[k].double() - ref[k].double()).abs().max()) for k in differ}
    assert not differ, f"TE's op differs from the per-expert layers in {differ} (max |diff| {by})"


@pytest.mark.parametrize("fuse_wgrad", [False, True], ids=["wgrad", "main_grad"])
def test_single_grouped_weight_op_equals_cpu_linears_per_expert(fuse_wgrad):
    """TE's op-fuser ``GroupedLinear`` with one grouped MXFP8 weight, on its grouped-tensor path
    = ``MXFP8Linear`` per expert, bitwise: output, dgrad and every expert's wgrad (into
    ``main_grad`` when fused), an expert without tokens included. Controls: operands read in the
    other usage, and weights paired with the wrong expert's tokens, diverge."""
    reference = run_on_ranks(op_grouped_linear_run, None, fuse_wgrad, world_size=1, boot=BOOT)
    assert reference[0]["path"] == "grouped_tensor"
    _te_equals_reference(reference, reference)
    for mutation in ("usage", "member_order"):
        mutated = run_on_ranks(op_grouped_linear_run, mutation, fuse_wgrad, world_size=1, boot=BOOT)
        assert_diverges(reference, mutated, compare=_te_equals_reference)


def grouped_tensor_kernels() -> dict[str, Any]:
    """The grouped-tensor path's data kernels on edge cases: offsets of TE's four scans (an empty
    split included), ``group_quantize`` members against the project's MXFP8 quantizer (compact
    and GEMM-swizzled scales, both usages), ``bgrad_group_quantize``'s per-member sums, and the
    refusal of members whose rows are not a multiple of 128."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

    from nemo_lw_fp8.cpu.formats import mxfp8 as mx
    from nemo_lw_fp8.cpu.te import device as te_device

    r: dict[str, Any] = {}
    splits = torch.tensor([256, 0, 128], dtype=torch.int64)
    sizes, outs = tex.splits_to_offsets_multi(
        splits.to(torch.int32), "cpu", strides=[1, 1, K, N],
        include_leading_zero=[False, True, True, True],
        dtypes=[torch.int32, torch.int64, torch.int64, torch.int64],
    )  # fmt: skip
    r["sizes"] = (sizes.dtype == torch.int64, sizes.tolist())
    r["offsets"] = [(o.dtype, o.tolist()) for o in outs]
    gen = torch.Generator().manual_seed(5)
    x = _spread(384, K, gen).bfloat16()
    with te_device.target_gpu(te_device.BLACKWELL):
        for swizzle in (False, True):
            quantizer = MXFP8Quantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True)
            quantizer.optimize_for_gemm = swizzle
            grouped = tex.group_quantize(x, quantizer, 3, splits, tensor_offsets=outs[2])
            same = []
            parts = torch.split(x, [256, 0, 128])
            for member, part in zip(grouped.quantized_tensors, parts, strict=True):
                if part.shape[0] == 0:
                    same.append(member._rowwise_data.numel() == 0)
                    continue
                want = mx.quantize(
                    part, torch.float8_e4m3fn, rowwise=True, columnwise=True, swizzle=swizzle
                )
                same.append(
                    all(
                        torch.equal(getattr(member, "_" + name).view(torch.uint8).flatten(),
                                    getattr(want, name).view(torch.uint8).flatten())
                        for name in ("rowwise_data", "rowwise_scale_inv",
                                     "columnwise_data", "columnwise_scale_inv")
                    )  # fmt: skip
                )
            r[f"members_swizzle_{swizzle}"] = same
        dy = _spread(384, N, gen).bfloat16()
        quantizer = MXFP8Quantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True)
        _, dbias = tex.bgrad_group_quantize(dy, quantizer, 3, splits)
        want = torch.stack(
            [p.float().sum(0).bfloat16() if p.shape[0] else torch.zeros(N).bfloat16()
             for p in torch.split(dy, [256, 0, 128])]
        )  # fmt: skip
        r["dbias"] = torch.equal(dbias, want)
        try:
            tex.group_quantize(x[:352], quantizer, 3, torch.tensor([224, 0, 128]))
            r["unaligned"] = "accepted"
        except NotImplementedError as exc:
            r["unaligned"] = str(exc)
    return r


def test_grouped_tensor_kernels_are_exact():
    """``splits_to_offsets_multi`` gives TE's scans; ``group_quantize`` gives every member the
    project's MXFP8 bytes (data and scales, rowwise and columnwise, compact and swizzled, an
    empty member included); ``bgrad_group_quantize`` sums each member's rows; members whose
    scale layouts would differ between TE's kernel and TE's Python are refused by name."""
    r = run_on_ranks(grouped_tensor_kernels, world_size=1, boot=BOOT)[0]
    assert r["sizes"] == (True, [256, 0, 128])
    assert r["offsets"] == [
        (torch.int32, [256, 256, 384]),
        (torch.int64, [0, 256, 256, 384]),
        (torch.int64, [0, 256 * K, 256 * K, 384 * K]),
        (torch.int64, [0, 256 * N, 256 * N, 384 * N]),
    ]
    assert r["members_swizzle_False"] == [True] * 3 and r["members_swizzle_True"] == [True] * 3
    assert r["dbias"]
    assert "multiples of 128" in r["unaligned"] and "group_quantize" in r["unaligned"]
