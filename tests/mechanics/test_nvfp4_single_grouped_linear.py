"""NVFP4 on TE 2.20.2's op-fuser grouped-tensor path on CPU (issue 30): ``ops.GroupedLinear``
on NVFP4 members (``nemo_lw_fp8/cpu/te/tex/grouped_tensor_nvfp4.py``), on the B200 target,
stochastic rounding off and the RHT on, against TE's module ``GroupedLinear``, bitwise.

Single grouped weights that are already NVFP4 (FP4 primary weights, ``quantized_model_init``)
go to the grouped GEMM as they are: those run (bf16 single grouped weights stop at TE's own
error, ``test_nvfp4_single_grouped_quantize.py``). Discrete bf16 weights take the
grouped-tensor path too.

Every TE call runs in a spawned rank (this process never imports TE or megatron). Each parity
has a control kept in the suite (``tests.support.parity.assert_diverges``); the shared inputs
and mutations: ``tests.support.nvfp4_grouped_path``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.harness import run_on_ranks
from tests.support.nvfp4_grouped_path import (
    BUFFERS,
    K,
    N,
    expert_inputs,
    mutate_grouped_path,
    nvfp4_recipe,
    record_grouped_kernels,
)
from tests.support.parity import assert_diverges
from tests.support.te_module_parity import BOOT, assert_te_equals

SPLITS = [256, 0, 128, 128]  # tokens per expert (one without tokens), multiples of 128


def _run(module: Any, x0: torch.Tensor, dy: torch.Tensor, splits: Any) -> dict[str, Any]:
    """One forward / backward of ``module`` under the recipe: output and dgrad."""
    import transformer_engine.pytorch as te

    x = x0.clone().requires_grad_()
    with te.autocast(enabled=True, recipe=nvfp4_recipe()):
        y = module(x, splits)
    y.backward(dy)
    return {"out": y.detach(), "dx": x.grad.detach()}


def _single_grouped_once(mutation: str | None, fuse_wgrad: bool) -> dict[str, Any]:
    """TE's ``ops.GroupedLinear(single_grouped_weight=True)`` with FP4 primary weights (built
    under ``quantized_model_init``), on the grouped-tensor path, against TE's module
    ``GroupedLinear`` (discrete FP4 primary weights ``weight0..3``, its ``split_quantize`` path)
    whose weights are cast from the same bf16 values; an expert without tokens included. With
    ``fuse_wgrad`` both accumulate their wgrads into fp32 ``main_grad`` buffers (megatron's
    ``gradient_accumulation_fusion``), else they return bf16 ``.grad``."""
    import transformer_engine.pytorch as te

    from nemo_lw_fp8.cpu.te import device as te_device

    experts = len(SPLITS)
    gen = torch.Generator().manual_seed(30)
    weights = [(torch.randn(N, K, generator=gen) * 0.05).bfloat16() for _ in range(experts)]
    x0, dy = expert_inputs(SPLITS, gen)
    main_grad0 = torch.randn(experts, N, K, generator=gen) * 1e-3
    seen: list[str] = []
    with pytest.MonkeyPatch.context() as mp, te_device.target_gpu(te_device.BLACKWELL):
        mp.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1")
        with te.quantized_model_init(enabled=True, recipe=nvfp4_recipe()):
            op = te.ops.GroupedLinear(
                experts, K, N, bias=False, device="cpu", dtype=torch.bfloat16,
                single_grouped_weight=True, accumulate_into_main_grad=fuse_wgrad,
            )  # fmt: skip
            module = te.GroupedLinear(
                experts, K, N, bias=False, params_dtype=torch.bfloat16, device="cpu",
                fuse_wgrad_accumulation=fuse_wgrad,
            )  # fmt: skip
        with torch.no_grad():
            for i, w in enumerate(weights):
                op.weight.quantized_tensors[i].copy_(w)  # TE's cast, into the grouped buffers
                getattr(module, f"weight{i}").copy_(w)
        stored = all(
            torch.equal(
                getattr(op.weight.quantized_tensors[i], "_" + name),
                getattr(getattr(module, f"weight{i}"), "_" + name),
            )
            for i in range(experts)
            for name in (*BUFFERS, "amax_rowwise", "amax_columnwise")
        )
        if fuse_wgrad:
            op.weight.main_grad = main_grad0.clone().view(-1)
            op.weight.overwrite_main_grad = False
            for i in range(experts):
                getattr(module, f"weight{i}").main_grad = main_grad0[i].clone()
        mutate_grouped_path(mp, mutation)
        record_grouped_kernels(mp, seen)
        got = _run(op, x0, dy, torch.tensor(SPLITS, dtype=torch.int64))
        op_kernels = list(seen)
        seen.clear()
        ref = _run(module, x0, dy, SPLITS)
        module_kernels = sorted(set(seen))
    for i in range(experts):
        if fuse_wgrad:
            got[f"dw{i}"] = op.weight.main_grad.view(experts, N, K)[i].clone()
            ref[f"dw{i}"] = getattr(module, f"weight{i}").main_grad.clone()
        else:
            got[f"dw{i}"] = op.weight.grad.reshape(experts, N, K)[i].clone()
            ref[f"dw{i}"] = getattr(module, f"weight{i}").grad.clone()
    return {
        "losses": [float(got["out"].float().sum())],  # what tests.support.parity expects of a run
        "te": got, "ref": ref, "stored": stored, "op_kernels": sorted(set(op_kernels)),
        "module_kernels": module_kernels, "weight_type": type(op.weight).__name__,
        "member_type": type(op.weight.quantized_tensors[0]).__name__,
    }  # fmt: skip


def single_grouped_fp4_run(mutations: tuple[str | None, ...], fuse_wgrad: bool) -> dict:
    """:func:`_single_grouped_once` for each of ``mutations`` in one rank (None: unmutated)."""
    return {str(m): _single_grouped_once(m, fuse_wgrad) for m in mutations}


def _te_equals_reference(reference: list[dict], results: list[dict]) -> None:
    """Bitwise: the op's tensors of ``results`` against the module's of ``reference``."""
    assert_te_equals(reference, results, "the op differs from the module")


def _discrete_bf16_once(mutation: str | None) -> dict[str, Any]:
    """TE's ``ops.GroupedLinear`` with discrete bf16 weights under NVFP4 on the grouped-tensor
    path (``group_quantize`` for the input and the gradient, the weights cast one by one, the
    discrete-in / discrete-out GEMMs) against TE's module ``GroupedLinear`` with the same weights
    (its ``split_quantize`` path, ``tests/cpu/test_nvfp4_grouped.py``: equal to one TE ``Linear``
    per expert); an expert without tokens included."""
    import transformer_engine.pytorch as te

    from nemo_lw_fp8.cpu.te import device as te_device

    experts = len(SPLITS)
    gen = torch.Generator().manual_seed(29)
    weights = [(torch.randn(N, K, generator=gen) * 0.05).bfloat16() for _ in range(experts)]
    x0, dy = expert_inputs(SPLITS, gen)
    seen: list[str] = []
    with pytest.MonkeyPatch.context() as mp, te_device.target_gpu(te_device.BLACKWELL):
        op = te.ops.GroupedLinear(experts, K, N, bias=False, device="cpu", dtype=torch.bfloat16)
        module = te.GroupedLinear(
            experts, K, N, bias=False, params_dtype=torch.bfloat16, device="cpu"
        )
        with torch.no_grad():
            for i, w in enumerate(weights):
                getattr(op, f"weight{i}").copy_(w)
                getattr(module, f"weight{i}").copy_(w)
        mutate_grouped_path(mp, mutation)
        record_grouped_kernels(mp, seen)
        got = _run(op, x0, dy, torch.tensor(SPLITS, dtype=torch.int64))
        op_kernels = sorted(set(seen))
        seen.clear()
        ref = _run(module, x0, dy, SPLITS)
        module_kernels = sorted(set(seen))
    for i in range(experts):
        got[f"dw{i}"] = getattr(op, f"weight{i}").grad.clone()
        ref[f"dw{i}"] = getattr(module, f"weight{i}").grad.clone()
    return {
        "losses": [float(got["out"].float().sum())],
        "te": got, "ref": ref, "op_kernels": op_kernels, "module_kernels": module_kernels,
    }  # fmt: skip


def discrete_bf16_run(mutations: tuple[str | None, ...]) -> dict:
    """:func:`_discrete_bf16_once` for each of ``mutations`` in one rank (None: unmutated)."""
    return {str(m): _discrete_bf16_once(m) for m in mutations}


def _run_and_controls(runs: dict, controls: tuple[str, ...]) -> None:
    reference = [runs["None"]]
    _te_equals_reference(reference, reference)
    for control in controls:
        assert_diverges(reference, [runs[control]], compare=_te_equals_reference)


@pytest.mark.parametrize(
    "fuse_wgrad",
    [
        pytest.param(False, marks=pytest.mark.extended, id="wgrad"),
        pytest.param(True, id="main_grad"),
    ],
)
def test_single_grouped_fp4_weights_equal_module_grouped_linear(fuse_wgrad):
    """TE's op-fuser ``GroupedLinear`` with one grouped NVFP4 weight (FP4 primary, the only
    single grouped NVFP4 weight TE 2.20.2 runs) on its grouped-tensor path (``group_quantize``,
    ``te_general_grouped_gemm_for_grouped_tensor``) = TE's module ``GroupedLinear`` with the
    same FP4 weights as ``weight0..3`` on its ``split_quantize`` path, bitwise: output, dgrad
    and every expert's wgrad (accumulated into fp32 ``main_grad`` when fused), an expert without
    tokens included; both hold the same weight bytes. Controls: weights paired with the next
    expert's tokens, and every weight member read with the first one's amax, diverge."""
    controls = ("member_order", "weight_amax")
    runs = run_on_ranks(
        single_grouped_fp4_run, (None, *controls), fuse_wgrad, world_size=1, boot=BOOT
    )[0]
    plain = runs["None"]
    assert plain["stored"] is True
    assert (plain["weight_type"], plain["member_type"]) == ("GroupedTensor", "NVFP4Tensor")
    assert plain["op_kernels"] == ["group_quantize", "te_general_grouped_gemm_for_grouped_tensor"]
    assert plain["module_kernels"] == ["split_quantize", "te_general_grouped_gemm"]
    _run_and_controls(runs, controls)


@pytest.mark.extended
def test_op_discrete_bf16_weights_nvfp4_equal_module_grouped_linear():
    """TE's op-fuser ``GroupedLinear`` with discrete bf16 weights under NVFP4 takes the
    grouped-tensor path too (``group_quantize`` for x and dy, discrete-in / discrete-out GEMMs)
    and equals TE's module ``GroupedLinear`` on its ``split_quantize`` path, bitwise: output,
    dgrad, every expert's wgrad. Controls: ``group_quantize`` mutated to one amax shared by the
    members (the output diverges) and to a dropped RHT (the wgrads diverge)."""
    controls = ("shared_amax", "no_rht")
    runs = run_on_ranks(discrete_bf16_run, (None, *controls), world_size=1, boot=BOOT)[0]
    assert runs["None"]["op_kernels"] == [
        "group_quantize", "te_general_grouped_gemm_for_discrete_in",
        "te_general_grouped_gemm_for_discrete_out",
    ]  # fmt: skip
    assert runs["None"]["module_kernels"] == ["split_quantize", "te_general_grouped_gemm"]
    _run_and_controls(runs, controls)
    assert torch.equal(runs["no_rht"]["te"]["out"], runs["None"]["ref"]["out"])  # fprop: rowwise
    assert not torch.equal(runs["shared_amax"]["te"]["out"], runs["None"]["ref"]["out"])
