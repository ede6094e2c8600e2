"""megatron's TE layers on TE 2.20.2's own modules on CPU (issue 28): ``TEColumnParallelLinear``,
``TERowParallelLinear`` and ``TELayerNormColumnParallelLinear`` against the layers the CPU spec
puts in their place, bitwise, and ``TEDotProductAttention`` against megatron's local attention
within the bf16 roundings. The row-parallel bias added after the cast is the one difference
found, asserted as such."""

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
    parity_data,
    reference_wgrad32,
    te_equals_reference,
)


def megatron_te_linear_run(recipe: str, kind: str, fuse: bool, bias: bool = True) -> dict[str, Any]:
    """megatron's TE linears (``TEColumnParallelLinear``, ``TERowParallelLinear``,
    ``TELayerNormColumnParallelLinear``, TP 1) under TE's autocast against the CPU layers the CPU
    spec puts in their place (``FP8_LINEARS`` / ``CPULayerNormColumnParallelLinear``); with
    ``gradient_accumulation_fusion`` megatron's TE linears accumulate into ``main_grad``."""
    import transformer_engine.pytorch as te
    from megatron.core.extensions import transformer_engine as mte
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_lw_fp8.cpu.layers.norm_linear import CPULayerNormColumnParallelLinear
    from nemo_lw_fp8.cpu.layers.parallel_linears import FP8_LINEARS
    from nemo_lw_fp8.cpu.te import device as te_device

    fp8_recipe, target = te_recipe(recipe)
    d = parity_data(bias)
    config = TransformerConfig(
        num_layers=1, hidden_size=K, num_attention_heads=4, bf16=True,
        params_dtype=torch.bfloat16, use_cpu_initialization=True,
        gradient_accumulation_fusion=fuse, normalization="RMSNorm", layernorm_epsilon=1e-5,
        fp8="e4m3", fp8_recipe=recipe,
    )  # fmt: skip
    gamma = (torch.rand(K, generator=torch.Generator().manual_seed(2)) + 0.5).bfloat16()
    common = dict(config=config, init_method=torch.nn.init.zeros_, bias=bias,
                  skip_bias_add=False, is_expert=False)  # fmt: skip
    results = {}
    with te_device.target_gpu(target):
        for side in ("te", "ref"):
            if side == "te":
                cls = {"column": mte.TEColumnParallelLinear, "row": mte.TERowParallelLinear,
                       "norm_column": mte.TELayerNormColumnParallelLinear}[kind]  # fmt: skip
            elif kind == "norm_column":
                cls = CPULayerNormColumnParallelLinear
            else:
                cls = FP8_LINEARS[recipe][0 if kind == "column" else 1]
            extra = {"input_is_parallel": True} if kind == "row" else {"gather_output": False}
            layer = cls(K, N, **common, **extra)
            with torch.no_grad():
                layer.weight.copy_(d["w"])
                if bias:
                    layer.bias.copy_(d["b"])
                if kind == "norm_column":
                    layer.layer_norm_weight.copy_(gamma)
            if fuse and side == "te":
                layer.weight.main_grad = d["main_grad"].clone()
                # a later microbatch: on the first (is_first_microbatch=True) TE overwrites
                # main_grad instead of accumulating, megatron's grad buffer being zero then
                layer.is_first_microbatch = False
            x = d["x"].clone().requires_grad_()
            with te.autocast(enabled=True, recipe=fp8_recipe):
                y, _ = layer(x)
            y.backward(d["dy"])
            out = {"out": y.detach(), "dw": layer.weight.grad}
            if bias:
                out["db"] = layer.bias.grad
            if kind != "norm_column":
                out["dx"] = x.grad
            if fuse and side == "te":
                out["dw"] = layer.weight.main_grad
            if fuse and side == "ref":  # DDP would add the fp32 wgrad; TE adds it in place
                with te.autocast(enabled=True, recipe=fp8_recipe):
                    out["dw"] = d["main_grad"] + reference_wgrad32(recipe, d["x"], d["dy"])
            results[side] = out
    return {"losses": [float(results["te"]["out"].float().sum())], **results}


@pytest.mark.parametrize(
    "recipe,kind,fuse,bias",
    [
        ("mxfp8", "column", True, True),
        ("mxfp8", "row", False, False),
        ("blockwise", "column", False, True),
        ("blockwise", "row", True, False),
        ("mxfp8", "norm_column", False, True),
    ],
)
def test_megatron_te_linears_equal_cpu_spec_linears(recipe, kind, fuse, bias):
    """megatron's TE linears (TE's modules behind them) = the CPU spec's linears bitwise: output,
    dgrad, wgrad (``main_grad`` = old value + the fp32 wgrad under
    ``gradient_accumulation_fusion``, on a later microbatch), bias grad; the fused norm's output
    and linear grads for ``TELayerNormColumnParallelLinear`` (its dx goes through the norm
    stand-in, see above). Row-parallel without bias: see the next test."""
    run = run_on_ranks(megatron_te_linear_run, recipe, kind, fuse, bias, world_size=1, boot=BOOT)
    te_equals_reference(run, run)


def test_te_row_parallel_bias_is_added_after_the_cast():
    """A difference this path found: TE's row-parallel ``Linear`` adds its bias after the GEMM's
    cast (``gemm_bias_unfused_add``: "for RPL, bias has to be added after TP collectives", at
    any TP size), while the CPU spec's row-parallel linear adds it in the GEMM's fp32 epilogue,
    so outputs with a bias differ in the last bit (the recipes' linears have no bias)."""
    run = run_on_ranks(megatron_te_linear_run, "mxfp8", "row", False, True, world_size=1, boot=BOOT)
    what = assert_diverges(run, run, compare=te_equals_reference)
    assert "['out']" in what, what


def attention_run() -> dict[str, Any]:
    """megatron's ``TEDotProductAttention`` (TE's ``DotProductAttention``: no fused backend on
    CPU, so ``UnfusedDotProductAttention`` with the emulated softmax kernels) against megatron's
    local ``DotProductAttention``, causal, bf16, forward and backward."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_lw_fp8.cpu.te import device as te_device

    sq, b, heads, dim = 64, 2, 4, 32
    config = TransformerConfig(
        num_layers=1, hidden_size=heads * dim, num_attention_heads=heads, kv_channels=dim,
        bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=True,
        attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=True,
        apply_query_key_layer_scaling=False, attention_softmax_in_fp32=True,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(21)
    q0, k0, v0 = (torch.randn(sq, b, heads, dim, generator=gen).bfloat16() for _ in range(3))
    dout = torch.randn(sq, b, heads * dim, generator=gen).bfloat16()
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    model_parallel_cuda_manual_seed(1234)  # megatron's attention forks its RNG (dropout 0)
    results = {}
    with te_device.target_gpu(te_device.BLACKWELL):
        for side, cls in (("te", TEDotProductAttention), ("local", DotProductAttention)):
            # megatron's own fused softmax is a CUDA extension: the local layer takes torch's
            config.masked_softmax_fusion = side == "te"
            attn = cls(config, 1, AttnMaskType.causal, "self", pg_collection=pgs)
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            out = attn(q, k, v, None, attn_mask_type=AttnMaskType.causal)
            out.backward(dout.reshape(out.shape))
            results[side] = {"out": out.detach().reshape(sq, b, -1), "dq": q.grad,
                             "dk": k.grad, "dv": v.grad, "cls": type(attn).__name__}  # fmt: skip
            if side == "te":
                results["te_backend"] = type(attn.unfused_attention).__name__
    scores = torch.einsum("sbhd,tbhd->bhst", q0.float(), k0.float()) / dim**0.5
    return {
        "losses": [],
        "backend": results["te_backend"],
        "relative": {
            key: float(
                (results["te"][key].float() - results["local"][key].float()).abs().max()
                / results["local"][key].float().abs().max()
            )
            for key in ("out", "dq", "dk", "dv")
        },
        "max_score": float(scores.abs().max()),
    }


def test_te_attention_matches_megatron_local_attention():
    """TE's attention on its unfused backend (the emulated softmax kernels) agrees with
    megatron's local ``DotProductAttention`` within the bf16 roundings both make: scores,
    probabilities, the output and each gradient are rounded to bf16 (2^-8 relative) in each
    path, a score's rounding moves its probability by up to ``2^-8 * |score|`` relative; bound
    ``2^-8 * (4 + 2 * max|score|)`` of each tensor's largest value."""
    r = run_on_ranks(attention_run, world_size=1, boot=BOOT)[0]
    assert r["backend"] == "UnfusedDotProductAttention", r
    bound = 2.0**-8 * (4 + 2 * r["max_score"])
    for key, relative in r["relative"].items():
        assert relative <= bound, (key, relative, bound)
