"""TE 2.20.2's fused softmax kernels for the ``transformer_engine_torch`` stand-in.

Why: with ``get_fused_attn_backend`` answering "no backend" (:mod:`.queries`), TE's
``DotProductAttention`` runs ``UnfusedDotProductAttention``, whose ``FusedScaleMaskSoftmax``
(``attention/dot_product_attention/softmax.py``) calls these kernels when its fused path is
available for the shape, else torch's softmax.

Stand-ins, fp32 per row with TE's masking rules (``common/fused_softmax/*.cu``), output cast to
the input's dtype:

* ``scaled_softmax``: ``softmax(scale * x)`` over the last dim;
* ``scaled_masked_softmax``: ``mask == 1`` elements become ``-10000`` after scaling; a row whose
  maximum is ``-10000`` (fully masked) outputs zeros; the mask ``[b or 1, 1, sq, sk]`` is shared
  by all heads;
* ``scaled_upper_triang_masked_softmax`` (``[b*np, sq, sk]``): element ``j > i`` excluded
  (output 0);
* ``scaled_aligned_causal_masked_softmax`` (``[b, np, sq, sk]``): bottom-right aligned causal
  mask, row ``i`` keeps ``j < i + sk - sq + 1``; excluded elements output 0;
* every backward: ``dx = scale * y * (g - sum(g * y))`` in fp32 from the saved output ``y``.
"""

from __future__ import annotations

import torch

__all__ = [
    "scaled_aligned_causal_masked_softmax_backward",
    "scaled_aligned_causal_masked_softmax_forward",
    "scaled_masked_softmax_backward",
    "scaled_masked_softmax_forward",
    "scaled_softmax_backward",
    "scaled_softmax_forward",
    "scaled_upper_triang_masked_softmax_backward",
    "scaled_upper_triang_masked_softmax_forward",
]
TEX_KERNELS = tuple(__all__)
"""The ``transformer_engine_torch`` names this module provides."""


def _softmax_excluding(z: torch.Tensor, excluded: torch.Tensor | None) -> torch.Tensor:
    """fp32 softmax of ``z`` over the last dim; ``excluded`` elements take no part (output 0)."""
    if excluded is not None:
        z = z.masked_fill(excluded, float("-inf"))
    peak = z.amax(-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    e = torch.exp(z - peak)
    return e / e.sum(-1, keepdim=True)


def _backward(grad: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    g, y32 = grad.detach().float(), y.detach().float()
    return (scale * y32 * (g - (g * y32).sum(-1, keepdim=True))).to(grad.dtype)


def scaled_softmax_forward(input: torch.Tensor, scale_factor: float) -> torch.Tensor:  # noqa: A002
    """``tex.scaled_softmax_forward``: ``softmax(scale * x)``."""
    return _softmax_excluding(input.detach().float() * scale_factor, None).to(input.dtype)


def scaled_softmax_backward(
    output_grad: torch.Tensor, softmax_results: torch.Tensor, scale_factor: float
) -> torch.Tensor:
    """``tex.scaled_softmax_backward``."""
    return _backward(output_grad, softmax_results, scale_factor)


def scaled_masked_softmax_forward(
    input: torch.Tensor,  # noqa: A002
    mask: torch.Tensor,
    scale_factor: float,
) -> torch.Tensor:
    """``tex.scaled_masked_softmax_forward`` (see module doc for the masking rule)."""
    z = input.detach().float() * scale_factor
    masked = mask.to(torch.bool).expand_as(z)
    z = z.masked_fill(masked, -10000.0)
    y = _softmax_excluding(z, None)
    fully_masked = z.amax(-1, keepdim=True) == -10000.0
    return torch.where(fully_masked, torch.zeros_like(y), y).to(input.dtype)


def scaled_masked_softmax_backward(
    output_grad: torch.Tensor, softmax_results: torch.Tensor, scale_factor: float
) -> torch.Tensor:
    """``tex.scaled_masked_softmax_backward``."""
    return _backward(output_grad, softmax_results, scale_factor)


def _causal(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """Bottom-right aligned causal exclusion: row ``i`` keeps ``j < i + sk - sq + 1``."""
    rows = torch.arange(sq, device=device).unsqueeze(-1)
    cols = torch.arange(sk, device=device).unsqueeze(0)
    return cols >= rows + (sk - sq + 1)


def scaled_upper_triang_masked_softmax_forward(
    input: torch.Tensor,  # noqa: A002
    scale_factor: float,
) -> torch.Tensor:
    """``tex.scaled_upper_triang_masked_softmax_forward`` (``[b*np, sq, sq]``)."""
    sq, sk = input.shape[-2:]
    if sq != sk:
        raise ValueError(f"upper-triangular softmax needs a square input, got {tuple(input.shape)}")
    z = input.detach().float() * scale_factor
    return _softmax_excluding(z, _causal(sq, sk, input.device)).to(input.dtype)


def scaled_upper_triang_masked_softmax_backward(
    output_grads: torch.Tensor, softmax_results: torch.Tensor, scale_factor: float
) -> torch.Tensor:
    """``tex.scaled_upper_triang_masked_softmax_backward``."""
    return _backward(output_grads, softmax_results, scale_factor)


def scaled_aligned_causal_masked_softmax_forward(
    input: torch.Tensor,  # noqa: A002
    scale_factor: float,
) -> torch.Tensor:
    """``tex.scaled_aligned_causal_masked_softmax_forward`` (``[b, np, sq, sk]``)."""
    sq, sk = input.shape[-2:]
    z = input.detach().float() * scale_factor
    return _softmax_excluding(z, _causal(sq, sk, input.device)).to(input.dtype)


def scaled_aligned_causal_masked_softmax_backward(
    output_grad: torch.Tensor, softmax_results: torch.Tensor, scale_factor: float
) -> torch.Tensor:
    """``tex.scaled_aligned_causal_masked_softmax_backward``."""
    return _backward(output_grad, softmax_results, scale_factor)
