"""TE 2.20.2's SwiGLU kernels for the ``transformer_engine_torch`` stand-in.

Why: TE's op fuser runs megatron's grouped experts (``TEGroupedMLP`` with
``use_transformer_engine_op_fuser``) as ``GroupedLinear`` + ``ScaledSwiGLU`` + ``GroupedLinear``;
``ScaledSwiGLU`` (``ops/basic/swiglu.py``, ``_scaled_glu_forward`` / ``_scaled_glu_backward``)
calls ``scaled_swiglu`` / ``scaled_dswiglu``, ``SwiGLU`` and ``LayerNormMLP`` call ``swiglu`` /
``dswiglu``.

Stand-ins (elementwise; the GPU kernel's fp32 math is reproduced up to its ``expf``), with TE's
layout: the input's last dimension is ``[gate | linear]`` (first half through SiLU), the row
scales of the scaled variants have the input's leading shape:

* forward, fp32: ``y = silu(a) * b`` (``* s`` per row for ``scaled_swiglu``), one cast to the
  input's dtype, then the output quantizer if given (the project's exact quantizers);
* backward, fp32 with ``g`` the incoming gradient (``* s`` first for the scaled variant):
  ``da = g * b * silu'(a)`` with ``silu'(a) = sigmoid(a) * (1 + a * (1 - sigmoid(a)))``,
  ``db = g * silu(a)``, cast to the input's dtype; ``scaled_dswiglu`` also returns
  ``ds = sum(g_unscaled * silu(a) * b)`` per row in the scales' dtype (``compute_scale_grad``).

Refused by name: the block-interleaved GLU layout (``glu_interleave_size != 0``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from nemo_lw_fp8.cpu.te.tex.common import BACKEND

__all__ = ["dswiglu", "scaled_dswiglu", "scaled_swiglu", "swiglu"]
TEX_KERNELS = tuple(__all__)
"""The ``transformer_engine_torch`` names this module provides."""


def _halves(x: torch.Tensor, interleave: int) -> tuple[torch.Tensor, torch.Tensor]:
    if interleave:
        raise NotImplementedError(
            f"SwiGLU with glu_interleave_size={interleave} is not implemented by {BACKEND}"
        )
    if x.shape[-1] % 2:
        raise ValueError(f"SwiGLU input's last dim must be even, got {tuple(x.shape)}")
    x32 = x.detach().float()
    half = x.shape[-1] // 2
    return x32[..., :half], x32[..., half:]


def _out(y32: torch.Tensor, dtype: torch.dtype, quantizer: Any) -> Any:
    y = y32.to(dtype)
    if quantizer is None:
        return y
    from nemo_lw_fp8.cpu.te.tex import cast

    return cast.kernel_quantize("swiglu / dswiglu", y, quantizer)


def _dsilu(a: torch.Tensor) -> torch.Tensor:
    sig = torch.sigmoid(a)
    return sig * (1 + a * (1 - sig))


def swiglu(input: torch.Tensor, quantizer: Any) -> Any:  # noqa: A002 - TE's argument name
    """``tex.swiglu``: ``silu(a) * b`` (see module doc)."""
    a, b = _halves(input, 0)
    return _out(F.silu(a) * b, input.dtype, quantizer)


def dswiglu(grad: torch.Tensor, fwd_input: torch.Tensor, quantizer: Any) -> Any:
    """``tex.dswiglu``: ``[da | db]`` (see module doc)."""
    a, b = _halves(fwd_input, 0)
    g = grad.detach().float()
    return _out(torch.cat([g * b * _dsilu(a), g * F.silu(a)], -1), fwd_input.dtype, quantizer)


def _row_scales(scales: torch.Tensor, lead: torch.Size) -> torch.Tensor:
    s = scales.detach().float()
    if s.numel() != lead.numel():
        raise ValueError(f"act_scales has {s.numel()} elements, expected {lead.numel()}")
    return s.reshape(*lead, 1)


def scaled_swiglu(
    input: torch.Tensor,  # noqa: A002
    act_scales: torch.Tensor,
    quantizer: Any,
    glu_interleave_size: int = 0,
) -> Any:
    """``tex.scaled_swiglu``: ``silu(a) * b * s`` per row (see module doc)."""
    a, b = _halves(input, glu_interleave_size)
    s = _row_scales(act_scales, input.shape[:-1])
    return _out(F.silu(a) * b * s, input.dtype, quantizer)


def scaled_dswiglu(
    grad: torch.Tensor,
    fwd_input: torch.Tensor,
    act_scales: torch.Tensor,
    quantizer: Any,
    glu_interleave_size: int = 0,
    compute_scale_grad: bool = True,
) -> tuple[Any, torch.Tensor | None]:
    """``tex.scaled_dswiglu``: ``(d input, d scales or None)`` (see module doc)."""
    a, b = _halves(fwd_input, glu_interleave_size)
    s = _row_scales(act_scales, fwd_input.shape[:-1])
    g_raw = grad.detach().float()
    g = g_raw * s
    silu = F.silu(a)
    dinput = _out(torch.cat([g * b * _dsilu(a), g * silu], -1), fwd_input.dtype, quantizer)
    dscales = None
    if compute_scale_grad:
        dscales = (g_raw * silu * b).sum(-1).reshape(act_scales.shape).to(act_scales.dtype)
    return dinput, dscales
