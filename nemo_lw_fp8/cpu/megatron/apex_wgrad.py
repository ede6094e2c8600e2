"""Stand-in for APEX's compiled ``fused_weight_gradient_mlp_cuda`` (gradient-accumulation fusion
of megatron's own linears) on CPU ranks.

Why: Bridge turns ``gradient_accumulation_fusion`` on whenever TE imports
(``megatron/bridge/utils/fusions.py``), and several recipes ship it. TE's linears then
accumulate their weight gradients into ``main_grad`` inside TE's GEMM (emulated by
``generic_gemm``'s ``accumulate``), but megatron's own ``ColumnParallelLinear`` -- the output
layer -- calls APEX's kernel (``tensor_parallel/layers.py``,
``LinearWithGradAccumulationAndAsyncCommunication.backward``) and refuses to build without it.
NVIDIA's containers ship APEX; a CPU machine cannot build it.

The two kernels: ``main_grad += grad_output^T @ input``, one GEMM with the old ``main_grad`` as
its C operand (cuBLAS, fp32 compute, ``beta = 1``). Here the same computation: the fp32 product
of the operands (the GPU's accumulation order inside the GEMM is unknowable; the CPU's fp32
matmul is deterministic on one machine), plus the old value in fp32, rounded once to
``main_grad``'s dtype (fp32, or fp16 / bf16 for ``wgrad_gemm_accum_fp16``).

:func:`install` puts the module where megatron looks it up (its ``layers`` module's global and
availability flag, and ``sys.modules`` for the lazy import of ``core/utils.py``), never on a
machine where the real extension imports; :func:`uninstall` restores all three.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import torch

__all__ = ["install", "uninstall", "wgrad_gemm_accum_fp16", "wgrad_gemm_accum_fp32"]

EXTENSION = "fused_weight_gradient_mlp_cuda"


def _product(inp: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    x = inp.reshape(-1, inp.shape[-1]).to(torch.float32)
    dy = grad_output.reshape(-1, grad_output.shape[-1]).to(torch.float32)
    return dy.t() @ x


def wgrad_gemm_accum_fp32(
    input: torch.Tensor,  # noqa: A002 - APEX's argument name
    grad_output: torch.Tensor,
    main_grad: torch.Tensor,
) -> None:
    """``main_grad (fp32) += grad_output^T @ input``."""
    if main_grad.dtype != torch.float32:
        raise TypeError(f"wgrad_gemm_accum_fp32 into a {main_grad.dtype} main_grad")
    main_grad.add_(_product(input, grad_output))


def wgrad_gemm_accum_fp16(
    input: torch.Tensor,  # noqa: A002 - APEX's argument name
    grad_output: torch.Tensor,
    main_grad: torch.Tensor,
) -> None:
    """``main_grad (fp16 / bf16) += grad_output^T @ input``, summed in fp32, rounded once."""
    if main_grad.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"wgrad_gemm_accum_fp16 into a {main_grad.dtype} main_grad")
    total = main_grad.to(torch.float32) + _product(input, grad_output)
    main_grad.copy_(total.to(main_grad.dtype))


_undo: list[Callable[[], None]] = []


def _real_extension_present() -> bool:
    module = sys.modules.get(EXTENSION)
    if module is not None:
        return not getattr(module, "EMULATED", False)
    import importlib.util

    return importlib.util.find_spec(EXTENSION) is not None


def install() -> bool:
    """Make megatron's linears find the stand-in; False (nothing done) where APEX's extension
    exists or the stand-in is already in place."""
    if _undo or _real_extension_present():
        return False
    from megatron.core.tensor_parallel import layers

    module = types.ModuleType(EXTENSION, __doc__)
    module.EMULATED = True  # type: ignore[attr-defined]
    module.wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp32  # type: ignore[attr-defined]
    module.wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp16  # type: ignore[attr-defined]
    missing = object()
    before = (getattr(layers, EXTENSION, missing), layers._grad_accum_fusion_available)
    sys.modules[EXTENSION] = module
    setattr(layers, EXTENSION, module)
    layers._grad_accum_fusion_available = True

    def restore() -> None:
        sys.modules.pop(EXTENSION, None)
        if before[0] is missing:
            delattr(layers, EXTENSION)
        else:
            setattr(layers, EXTENSION, before[0])
        layers._grad_accum_fusion_available = before[1]

    _undo.append(restore)
    return True


def uninstall() -> None:
    while _undo:
        _undo.pop()()
