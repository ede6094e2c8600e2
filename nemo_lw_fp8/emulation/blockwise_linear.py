"""A linear layer whose GEMMs see blockwise FP8 operands as TE's ``Linear`` under
``Float8BlockScaling``, for CPU models (the blockwise sibling of :mod:`.fp8_linear`).

Why: the layer-wise blockwise FP8 param gather must be shown bitwise equal to FP8 gather off
on CPU ranks, and the columnwise (transposed) weight that receivers derive after the gather must
actually feed a GEMM, or a wrong derivation would go unnoticed.

Forward (TE 2.20 ``Float8BlockScaling``, ``Format.E4M3``): the input is quantised with 1x128
blocks along ``in_features`` (``x_block_scaling_dim=1``), the weight with 128x128 tiles
(``w_block_scaling_dim=2``), both e4m3 with power-of-two scales; the GEMM runs here on the
dequantised operands in fp32 and adds the bias before the single cast to the output dtype.

Weights come in two modes, giving identical results for equal weight values:

* high precision (a bf16 ``nn.Parameter``): quantised with 128x128 tiles each forward;
* FP8 parameters (created under TE's ``quantized_model_init``, or ``fp8_params=True``): the
  parameter *is* TE's persistent ``Float8BlockwiseQTensor`` (rowwise and columnwise data). The
  forward GEMM reads the rowwise form, and the backward's data-gradient GEMM
  (``dgrad = dy @ W``) reads the **columnwise** form as it is at backward time, as TE's dgrad
  GEMM reads its saved weight (so a gather that left it stale gives other gradients). With
  ``preserve_high_precision_init_val=True`` the pre-quantisation values are attached as TE's
  modules do. Needs :func:`nemo_lw_fp8.emulation.activate` (or a real TE).

Backward: fp32 gradients from the dequantised operands (``dy`` not quantised), a
straight-through estimator with respect to the quantised weight; the weight gradient is returned
in the parameter's nominal dtype so megatron's DDP hooks add it to ``main_grad``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from . import blockwise as bw
from .fp8_linear import _attach_init_value, _te_state, fp8_params_requested

__all__ = ["BlockwiseFP8Linear", "quantize_dequantize_input", "quantize_dequantize_weight"]


def quantize_dequantize_weight(w: torch.Tensor) -> torch.Tensor:
    """128x128-tile e4m3 round trip of a high-precision weight (what TE's GEMM reads)."""
    data = bw.quantize(w, block_dim=2, rowwise=True, columnwise=False)
    return bw.dequantize(data, w.dtype)


def quantize_dequantize_input(x: torch.Tensor) -> torch.Tensor:
    """1x128-block e4m3 round trip along the last dim (TE's input quantizer, rowwise)."""
    data = bw.quantize(x, block_dim=1, rowwise=True, columnwise=False)
    return bw.dequantize(data, x.dtype)


def _is_blockwise(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "_is_2D_scaled") and hasattr(tensor, "dequantize")


def _columnwise_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight as the dgrad GEMM reads it: from the transposed columnwise data."""
    codes = weight._columnwise_data
    if codes is None:
        raise RuntimeError("persistent blockwise weight has no columnwise data for dgrad")
    return bw.dequantize_codes(
        codes,
        weight._columnwise_scale_inv,
        torch.float8_e4m3fn,
        block_dim=2,
        columnwise=True,
        dtype=weight.dtype,
    )


class _BlockwiseLinearFunction(torch.autograd.Function):
    """y = Q1x128(x) Q128x128(W)^T + b in fp32; backward on dequantised operands."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        x_dq = quantize_dequantize_input(x)
        persistent = _is_blockwise(weight)
        if persistent:
            w_fwd = weight.dequantize(dtype=weight.dtype)
        else:
            w_fwd = quantize_dequantize_weight(weight)
        out = torch.matmul(x_dq.float(), w_fwd.float().t())
        if bias is not None:
            out = out + bias.float()
        # A persistent weight is read at backward time (its columnwise form), as TE's dgrad GEMM
        # reads the saved weight; a high-precision one as quantized here (its tiles are square).
        ctx.save_for_backward(x_dq, None if persistent else w_fwd)
        ctx.weight = weight if persistent else None
        ctx.has_bias = bias is not None
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x_dq, w_bwd = ctx.saved_tensors
        if ctx.weight is not None:
            w_bwd = _columnwise_weight(ctx.weight)
        ctx.weight = None
        grad = grad_out.float()
        grad_x = torch.matmul(grad, w_bwd.float()).to(x_dq.dtype)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_w = torch.matmul(grad_2d.t(), x_dq.reshape(-1, x_dq.shape[-1]).float())
        grad_b = grad_2d.sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
        return grad_x, grad_w.to(ctx.weight_dtype), grad_b


class BlockwiseFP8Linear(torch.nn.Module):
    """``y = x W^T + b`` with blockwise FP8 GEMM operands (see module doc).

    ``fp8_params``: ``None`` follows TE's ``quantized_model_init`` (when TE is imported),
    ``True`` forces a persistent ``Float8BlockwiseQTensor`` weight (128x128 tiles, rowwise and
    columnwise), ``False`` keeps it high precision. ``init_method`` fills the high-precision
    weight (megatron's initializers), default PyTorch's ``Linear`` init. Any widths: edge
    tiles hold fewer elements.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        params_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        init_method: Callable[[torch.Tensor], Any] | None = None,
        fp8_params: bool | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        state = _te_state()
        if fp8_params is None:
            fp8_params = fp8_params_requested()
        self.fp8_params = fp8_params
        weight = torch.empty(out_features, in_features, dtype=params_dtype, device=device)
        if init_method is None:
            torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        else:
            init_method(weight)
        if fp8_params:
            self.weight = self._quantized_weight(weight, state)
        else:
            self.weight = torch.nn.Parameter(weight)
        if bias:
            self.bias = torch.nn.Parameter(
                torch.zeros(out_features, dtype=params_dtype, device=device)
            )
        else:
            self.register_parameter("bias", None)

    @staticmethod
    def _quantized_weight(weight: torch.Tensor, state: Any) -> torch.nn.Parameter:
        if state is None:
            raise RuntimeError(
                "BlockwiseFP8Linear(fp8_params=True) needs Transformer Engine's "
                "Float8BlockwiseQTensor: call nemo_lw_fp8.emulation.activate() first (CPU) "
                "or install TE (GPU)"
            )
        recipe = state.get_fp8_recipe() if fp8_params_requested() else None
        if recipe is not None and type(recipe).__name__ != "Float8BlockScaling":
            raise ValueError(
                f"BlockwiseFP8Linear builds blockwise weights; quantized_model_init has {recipe!r}"
            )
        from transformer_engine.pytorch.constants import DType
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import (
            Float8BlockQuantizer,
        )

        init_value = weight.detach().clone() if state.with_high_precision_init_val() else None
        quantizer = Float8BlockQuantizer(
            DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=2
        )
        param = torch.nn.Parameter(quantizer(weight.detach()))
        if init_value is not None:
            _attach_init_value(param, init_value)
        return param

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected last dim {self.in_features}, got shape {tuple(x.shape)}")
        return _BlockwiseLinearFunction.apply(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, fp8_params={self.fp8_params}"
        )
