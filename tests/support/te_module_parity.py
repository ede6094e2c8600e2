"""Shared by the tests of TE 2.20.2's own modules against the project's CPU layers
(``tests/cpu/test_te_modules_*.py``) and of TE's grouped paths: the rank boot, the layer sizes
and data, the GEMM mutations the controls use, the project's fp32 wgrad, and the bitwise
comparison of TE's tensors with the reference's.

Not a test module; tests import it as ``tests.support.te_module_parity``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.harness import BootOptions
from tests.support.te_helpers import spread

BOOT = BootOptions(fp8_emulation=True)
M, K, N = 64, 256, 128  # tokens, in_features, out_features (multiples of 32 and 128)


def parity_data(bias: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return {
        "w": (spread(N, K, gen) * 0.05).bfloat16(),
        "b": torch.randn(N, generator=gen).bfloat16() if bias else None,
        "x": spread(M, K, gen).bfloat16(),
        "dy": spread(M, N, gen).bfloat16(),
        "main_grad": torch.randn(N, K, generator=gen) * 1e-2,
    }


def swap_operand_usage(mp: pytest.MonkeyPatch) -> None:
    """The ``usage`` control: every GEMM operand that holds both copies is read in the other
    usage (a rowwise read takes the columnwise copy and the reverse)."""
    from nemo_lw_fp8.cpu.te.tex import gemm as te_kernels_gemm

    real = te_kernels_gemm.dequantize_operand

    def other_usage(tensor: Any, usage: str) -> torch.Tensor:
        both = all(
            getattr(tensor, name, None) is not None
            for name in ("_rowwise_data", "_columnwise_data")
        )
        swapped = "rowwise" if usage == "columnwise" else "columnwise"
        return real(tensor, swapped if both else usage)

    mp.setattr(te_kernels_gemm, "dequantize_operand", other_usage)


def mutate_gemms(mp: pytest.MonkeyPatch, mutation: str | None) -> None:
    """Controls: ``usage`` reads each GEMM operand in the other usage where it holds both copies
    (the forward GEMM then reads the weight's and the input's columnwise copies);
    ``bias_after_cast`` adds the bias after the output's cast (megatron's local order)."""
    from nemo_lw_fp8.cpu.te.tex import gemm as te_kernels_gemm

    if mutation == "usage":
        swap_operand_usage(mp)
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


def reference_wgrad32(recipe: str, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
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


def assert_te_equals(reference: list[dict], results: list[dict], sides: str) -> None:
    """Bitwise: the ``"te"`` tensors of ``results`` against the ``"ref"`` tensors of
    ``reference`` (rank 0); ``sides`` names the two in the failure message."""
    ref, te = reference[0]["ref"], results[0]["te"]
    assert ref.keys() == te.keys(), (ref.keys(), te.keys())
    differ = [k for k in ref if not torch.equal(ref[k], te[k])]
    by = {k: float((te[k].double() - ref[k].double()).abs().max()) for k in differ}
    assert not differ, f"{sides} in {differ} (max |diff| {by})"


def te_equals_reference(reference: list[dict], results: list[dict]) -> None:
    """Bitwise: TE's tensors of ``results`` against the CPU layer's of ``reference``."""
    assert_te_equals(reference, results, "TE's module differs from the CPU layer")
