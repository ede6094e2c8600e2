"""TE 2.20.2's own modules on CPU (issue 28): ``Linear`` and ``LayerNormLinear`` with only
``transformer_engine_torch`` emulated and the device questions answered as the recipe's GPU
(``nemo_lw_fp8.cpu.te.device``), against the project's CPU layers, bitwise.

Each parity has a control kept in the suite: a mutation that must make the same comparison fail
by divergence (``tests.support.parity.assert_diverges``), never by a crash."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from tests.support.harness import BootOptions, run_on_ranks
from tests.support.parity import assert_diverges
from tests.support.te_helpers import spread, te_recipe

BOOT = BootOptions(fp8_emulation=True)
M, K, N = 64, 256, 128  # tokens, in_features, out_features (multiples of 32 and 128)


_spread = spread


def _data(bias: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return {
        "w": (_spread(N, K, gen) * 0.05).bfloat16(),
        "b": torch.randn(N, generator=gen).bfloat16() if bias else None,
        "x": _spread(M, K, gen).bfloat16(),
        "dy": _spread(M, N, gen).bfloat16(),
        "main_grad": torch.randn(N, K, generator=gen) * 1e-2,
    }


def _mutate(mp: pytest.MonkeyPatch, mutation: str | None) -> None:
    """Controls: ``usage`` reads each GEMM operand in the other usage where it holds both copies
    (the forward GEMM then reads the weight's and the input's columnwise copies);
    ``bias_after_cast`` adds the bias after the output's cast (megatron's local order)."""
    from nemo_lw_fp8.cpu.te.tex import gemm as te_kernels_gemm

    if mutation == "usage":
        real = te_kernels_gemm.dequantize_operand

        def other_usage(tensor: Any, usage: str) -> torch.Tensor:
            both = all(
                getattr(tensor, name, None) is not None
                for name in ("_rowwise_data", "_columnwise_data")
            )
            swapped = "rowwise" if usage == "columnwise" else "columnwise"
            return real(tensor, swapped if both else usage)

        mp.setattr(te_kernels_gemm, "dequantize_operand", other_usage)
    elif mutation == "bias_after_cast":
        real_gemm = te_kernels_gemm.generic_gemm

        def gemm(*args: Any, **kwargs: Any) -> list[Any]:
            args = list(args)
            bias, grad = args[7], args[11]
            if bias is None or grad:
                return real_gemm(*args, **kwargs)
            args[7] = None
            out = real_gemm(*args, **kwargs)
            out[0] = out[0] + bias
            return out

        import transformer_engine_torch as tex

        mp.setattr(tex, "generic_gemm", gemm)
    elif mutation not in (None, "stale_columnwise"):
        raise ValueError(mutation)


def _stale_columnwise(weight: Any, w: torch.Tensor) -> None:
    """Overwrite a persistent FP8 weight's columnwise copy with that of another weight value
    (what a gather that refreshed only the rowwise copy leaves)."""
    other = weight._quantizer.copy()
    other.set_usage(rowwise=True, columnwise=True)
    fresh = other(w * 1.25 + 0.01)
    with torch.no_grad():
        weight._columnwise_data.copy_(fresh._columnwise_data)
        weight._columnwise_scale_inv.copy_(fresh._columnwise_scale_inv)


def _reference_wgrad32(recipe: str, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The project's fp32 wgrad before its cast: what ``main_grad`` accumulates."""
    if recipe == "bf16":
        return torch.matmul(dy.float().t(), x.float())
    from nemo_lw_fp8.cpu.layers.mxfp8_linear import grad_fp8_dtype

    if recipe == "mxfp8":
        from nemo_lw_fp8.cpu.layers.mxfp8_linear import _quantize_dequantize, mxfp8_backward

        x_col = _quantize_dequantize(x, torch.float8_e4m3fn, "columnwise")
        return mxfp8_backward(dy, x_col, None, grad_fp8_dtype())[1]
    from nemo_lw_fp8.cpu.layers.blockwise_linear import _columnwise_input, blockwise_backward

    return blockwise_backward(dy, _columnwise_input(x), None, grad_fp8_dtype())[1]


def linear_run(recipe: str, bias: bool, fp8_params: bool, fuse: bool, mutation: str | None):
    """TE's ``Linear`` and the project's CPU linear of ``recipe`` on equal data: output, dx, dW
    (or ``main_grad`` after fused accumulation) and bias grad of each."""
    import transformer_engine.pytorch as te

    from nemo_lw_fp8.cpu.layers.blockwise_linear import BlockwiseFP8Linear
    from nemo_lw_fp8.cpu.layers.mxfp8_linear import MXFP8Linear
    from nemo_lw_fp8.cpu.te import device as te_device

    fp8_recipe, target = te_recipe(recipe)
    d = _data(bias)
    autocast = lambda: te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe)  # noqa: E731
    with pytest.MonkeyPatch.context() as mp, te_device.target_gpu(target):
        _mutate(mp, mutation)
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
                "dw": _reference_wgrad32(recipe, d["x"], d["dy"]).bfloat16(),
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
                wgrad32 = _reference_wgrad32(recipe, d["x"], d["dy"])
            y2.backward(d["dy"])
            ref = {"out": y2.detach(), "dx": x2.grad, "dw": cpu.weight.grad}
            if bias:
                ref["db"] = cpu.bias.grad
        if fuse:
            ref["dw"] = d["main_grad"] + (
                wgrad32 if recipe != "bf16" else _reference_wgrad32(recipe, d["x"], d["dy"])
            )
    return {"losses": [float(y.float().sum())], "te": te_out, "ref": ref}


def _te_equals_reference(reference: list[dict], results: list[dict]) -> None:
    """Bitwise: TE's tensors of ``results`` against the CPU layer's of ``reference``."""
    ref, te = reference[0]["ref"], results[0]["te"]
    assert ref.keys() == te.keys(), (ref.keys(), te.keys())
    differ = [k for k in ref if not torch.equal(ref[k], te[k])]
    by = {k: float((te[k].double() - ref[k].double()).abs().max()) for k in differ}
    assert not differ, f"TE's module differs from the CPU layer in {differ} (max |diff| {by})"


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
    _te_equals_reference(run, run)


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
    what = assert_diverges(reference, mutated, compare=_te_equals_reference)
    assert f"'{diverging}'" in what


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
    d = _data(bias)
    gen = torch.Generator().manual_seed(5)
    gamma = (torch.rand(K, generator=gen) * 0.5 + (0.0 if zero_centered else 0.5)).bfloat16()
    beta = (torch.randn(K, generator=gen) * 0.1).bfloat16()
    eps = 1e-5
    with pytest.MonkeyPatch.context() as mp, te_device.target_gpu(target):
        _mutate(mp, mutation)
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
        with torch.no_grad():
            layer.weight.copy_(d["w"])
            layer.layer_norm_weight.copy_(gamma)
            if normalization == "LayerNorm":
                layer.layer_norm_bias.copy_(beta)
            if bias:
                layer.bias.copy_(d["b"])
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
        with torch.no_grad():
            cpu.weight.copy_(d["w"])
            cpu.layer_norm_weight.copy_(gamma)
            if normalization == "LayerNorm":
                cpu.layer_norm_bias.copy_(beta)
            if bias:
                cpu.bias.copy_(d["b"])
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
    _te_equals_reference(run, run)
    for key, relative in run[0]["relative_to_cpu_autograd"].items():
        assert relative <= 2 * 2.0**-8, (key, relative)


def test_te_layernorm_linear_control_diverges():
    """Control: the wrong operand usage in the GEMMs makes LayerNormLinear's dgrad differ."""
    reference, mutated = (
        run_on_ranks(norm_linear_run, "mxfp8", "RMSNorm", False, m, world_size=1, boot=BOOT)
        for m in (None, "usage")
    )
    what = assert_diverges(reference, mutated, compare=_te_equals_reference)
    assert "'dx'" in what


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
    weights = [(_spread(N, K, gen) * 0.05).bfloat16() for _ in range(experts)]
    biases = [torch.randn(N, generator=gen).bfloat16() for _ in range(experts)]
    x0 = _spread(sum(splits), K, gen).bfloat16()
    dy = _spread(sum(splits), N, gen).bfloat16()
    with pytest.MonkeyPatch.context() as mp, te_device.target_gpu(target):
        _mutate(mp, mutation)
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
    _te_equals_reference(reference, reference)
    mutated = run_on_ranks(grouped_linear_run, recipe, "usage", world_size=1, boot=BOOT)
    assert_diverges(reference, mutated, compare=_te_equals_reference)


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
    d = _data(bias)
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
                    out["dw"] = d["main_grad"] + _reference_wgrad32(recipe, d["x"], d["dy"])
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
    _te_equals_reference(run, run)


def test_te_row_parallel_bias_is_added_after_the_cast():
    """A difference this path found: TE's row-parallel ``Linear`` adds its bias after the GEMM's
    cast (``gemm_bias_unfused_add``: "for RPL, bias has to be added after TP collectives", at
    any TP size), while the CPU spec's row-parallel linear adds it in the GEMM's fp32 epilogue,
    so outputs with a bias differ in the last bit (the recipes' linears have no bias)."""
    run = run_on_ranks(megatron_te_linear_run, "mxfp8", "row", False, True, world_size=1, boot=BOOT)
    what = assert_diverges(run, run, compare=_te_equals_reference)
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
