"""TE 2.20.2's normalization kernels for the ``transformer_engine_torch`` stand-in.

Why: TE's ``LayerNormLinear`` / ``LayerNormMLP`` (``module/_common.py`` ``apply_normalization``,
backward in ``module/layernorm_linear.py``), ``RMSNorm`` / ``LayerNorm`` modules and the op
fuser's ``ops.basic.rmsnorm`` / ``ops.fused.backward_add_rmsnorm`` call ``rmsnorm_fwd``,
``layernorm_fwd``, ``rmsnorm_bwd``, ``layernorm_bwd`` and ``rmsnorm_bwd_add``; ``ops/basic``
imports some of them by name when TE is imported, so they must exist before TE's import.

Stand-ins (a GPU's reduction order is unknowable on CPU), documented fp32 computations:

* forward: ``x`` and ``gamma`` (``+ 1`` when ``zero_centered_gamma``) to fp32;
  RMSNorm ``y = F.rms_norm(x32, gamma32, eps)``, ``rsigma = rsqrt(mean(x32^2) + eps)``;
  LayerNorm ``y = F.layer_norm(x32, gamma32, beta32, eps)``, ``mu = mean(x32)``,
  ``rsigma = rsqrt(var(x32, unbiased=False) + eps)`` (both fp32, as TE saves them). ``y`` is cast
  once to ``otype``, or quantized from that cast by the output quantizer (TE's unfused path:
  the project's exact MXFP8 / blockwise quantizers).
* backward (fp32, from the saved ``rsigma`` / ``mu``): ``xhat = (x - mu) * rsigma``,
  ``g = dz * gamma32``; RMSNorm ``dx = rsigma * (g - xhat * mean(g * xhat))``; LayerNorm
  ``dx = rsigma * (g - mean(g) - xhat * mean(g * xhat))``; ``dgamma = sum(dz * xhat)``,
  ``dbeta = sum(dz)`` over the rows; ``dx`` cast to ``x``'s dtype, ``dgamma`` / ``dbeta`` to
  ``gamma``'s. ``rmsnorm_bwd_add`` adds ``add`` (fp32) to ``dx`` before its cast.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from nemo_lw_fp8.cpu.te.tex.common import BACKEND, torch_dtype

__all__ = ["layernorm_bwd", "layernorm_fwd", "rmsnorm_bwd", "rmsnorm_bwd_add", "rmsnorm_fwd"]

TEX_KERNELS = ("layernorm_bwd", "layernorm_fwd", "rmsnorm_bwd", "rmsnorm_bwd_add", "rmsnorm_fwd")
"""The ``transformer_engine_torch`` names this module provides."""


def _gamma32(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    gamma = weight.detach().float()
    return gamma + 1 if zero_centered_gamma else gamma


def _rows(x: torch.Tensor, hidden: int) -> torch.Tensor:
    if x.shape[-1] != hidden:
        raise ValueError(f"norm input's last dim {x.shape[-1]} != weight size {hidden}")
    return x.detach().reshape(-1, hidden).float()


def _finish(y32: torch.Tensor, x: torch.Tensor, out: Any, quantizer: Any, otype: Any) -> Any:
    """Cast to ``otype`` (default: x's dtype), then write into ``out`` or quantize."""
    dtype = torch_dtype(otype) if otype is not None else x.dtype
    y = y32.to(dtype).reshape(x.shape)
    if quantizer is not None:
        from nemo_lw_fp8.cpu.te.tex import cast

        try:
            return cast.kernel_quantize("norm forward", y, quantizer, out)
        except NotImplementedError as exc:
            raise NotImplementedError(
                f"norm output quantizer {type(quantizer).__name__} is not implemented by {BACKEND}"
            ) from exc
    if out is not None:
        with torch.no_grad():
            out.copy_(y)
        return out
    return y


def rmsnorm_fwd(
    input: torch.Tensor,  # noqa: A002 - TE's argument names
    weight: torch.Tensor,
    eps: float,
    ln_out: Any,
    quantizer: Any,
    otype: Any,
    sm_margin: int,
    zero_centered_gamma: bool,
) -> list[Any]:
    """``tex.rmsnorm_fwd``: ``[y, None, rsigma]`` (see module doc)."""
    hidden = weight.numel()
    x32 = _rows(input, hidden)
    gamma = _gamma32(weight, zero_centered_gamma)
    y32 = F.rms_norm(x32, (hidden,), gamma, eps)
    rsigma = torch.rsqrt(x32.pow(2).mean(-1) + eps)
    return [_finish(y32, input, ln_out, quantizer, otype), None, rsigma]


def layernorm_fwd(
    input: torch.Tensor,  # noqa: A002
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    ln_out: Any,
    quantizer: Any,
    otype: Any,
    sm_margin: int,
    zero_centered_gamma: bool,
) -> list[Any]:
    """``tex.layernorm_fwd``: ``[y, mu, rsigma]`` (see module doc)."""
    hidden = weight.numel()
    x32 = _rows(input, hidden)
    gamma = _gamma32(weight, zero_centered_gamma)
    beta = None if bias is None else bias.detach().float()
    y32 = F.layer_norm(x32, (hidden,), gamma, beta, eps)
    var, mu = torch.var_mean(x32, dim=-1, unbiased=False)
    rsigma = torch.rsqrt(var + eps)
    return [_finish(y32, input, ln_out, quantizer, otype), mu, rsigma]


def _norm_bwd(
    dz: torch.Tensor,
    x: torch.Tensor,
    mu: torch.Tensor | None,
    rsigma: torch.Tensor,
    gamma: torch.Tensor,
    zero_centered_gamma: bool,
    add: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden = gamma.numel()
    x32 = _rows(x, hidden)
    dz32 = _rows(dz, hidden)
    r = rsigma.detach().reshape(-1, 1).float()
    centred = x32 if mu is None else x32 - mu.detach().reshape(-1, 1).float()
    xhat = centred * r
    g = dz32 * _gamma32(gamma, zero_centered_gamma)
    inner = g - xhat * (g * xhat).mean(-1, keepdim=True)
    if mu is not None:
        inner = inner - g.mean(-1, keepdim=True)
    dx32 = r * inner
    if add is not None:
        dx32 = dx32 + _rows(add, hidden)
    dgamma = (dz32 * xhat).sum(0).to(gamma.dtype)
    dbeta = dz32.sum(0).to(gamma.dtype)
    return dx32.to(x.dtype).reshape(x.shape), dgamma, dbeta


def rmsnorm_bwd(
    dz: torch.Tensor,
    x: torch.Tensor,
    rsigma: torch.Tensor,
    gamma: torch.Tensor,
    sm_margin: int,
    zero_centered_gamma: bool,
) -> list[torch.Tensor]:
    """``tex.rmsnorm_bwd``: ``[dx, dgamma]`` (see module doc)."""
    dx, dgamma, _ = _norm_bwd(dz, x, None, rsigma, gamma, zero_centered_gamma)
    return [dx, dgamma]


def rmsnorm_bwd_add(
    dz: torch.Tensor,
    x: torch.Tensor,
    add: torch.Tensor,
    rsigma: torch.Tensor,
    gamma: torch.Tensor,
    sm_margin: int,
    zero_centered_gamma: bool,
) -> list[torch.Tensor]:
    """``tex.rmsnorm_bwd_add`` (``ops/fused/backward_add_rmsnorm.py``): ``[dx + add, dgamma]``."""
    dx, dgamma, _ = _norm_bwd(dz, x, None, rsigma, gamma, zero_centered_gamma, add)
    return [dx, dgamma]


def layernorm_bwd(
    dz: torch.Tensor,
    x: torch.Tensor,
    mu: torch.Tensor,
    rsigma: torch.Tensor,
    gamma: torch.Tensor,
    sm_margin: int,
    zero_centered_gamma: bool,
) -> list[torch.Tensor]:
    """``tex.layernorm_bwd``: ``[dx, dgamma, dbeta]`` (see module doc)."""
    dx, dgamma, dbeta = _norm_bwd(dz, x, mu, rsigma, gamma, zero_centered_gamma)
    return [dx, dgamma, dbeta]
