"""A linear layer whose GEMM sees MXFP8 operands the way TE's ``Linear`` does, for CPU models.

Forward (TE 2.20 ``Linear`` under the ``MXFP8BlockScaling`` recipe): both GEMM operands are
quantised with 1x32 blocks along the reduction dimension -- the input rowwise (blocks along
``in_features``) by the input quantizer, the weight rowwise (blocks along ``in_features``) by
the weight quantizer -- always in e4m3 in the forward pass (``Format.E4M3`` and ``HYBRID`` both
use e4m3 forward), with 32x32 weight tiles when ``enable_2d_quantization`` is set. The GEMM
accumulates in fp32 and adds the bias before the single cast to the output dtype. Here the GEMM
runs on the dequantised operands in fp32, which is what the tensor cores compute up to the
order of the fp32 additions.

Weights come in two modes, giving identical outputs for equal weight values:

* high precision (a bf16 ``nn.Parameter``): quantised and dequantised on the fly each forward;
* FP8 parameters (created under TE's ``quantized_model_init``, or ``fp8_params=True``): the
  parameter *is* TE's persistent ``MXFP8Tensor`` (rowwise and columnwise data) and its rowwise
  data is used directly. With ``preserve_high_precision_init_val=True`` the pre-quantisation
  values are attached exactly as TE's modules do (``get_high_precision_init_val()``).
  This mode needs :func:`nemo_lw_fp8.emulation.activate` (or a real TE).

Backward (kept simple, and equal to TE's ``backward_override="dequantized"`` mode): gradients
are computed in fp32 from the *dequantised* forward operands, ``dgrad = dy @ W_dq`` and
``wgrad = dy^T @ x_dq``, i.e. a straight-through estimator with respect to the quantised
weight. ``dy`` is not quantised and the columnwise copies are not used (TE's default backward
quantises ``dy`` and uses the columnwise data). The weight gradient is returned as a plain
tensor of the parameter's nominal dtype and shape, so autograd accumulates it into ``.grad``
and megatron's DDP hooks can add it to ``main_grad`` as for any parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch

from . import mxfp8 as mx
from .mxfp8_format import BLOCK_SIZE

__all__ = ["MXFP8Linear", "fp8_params_requested", "quantize_dequantize"]


def quantize_dequantize(
    x: torch.Tensor, *, two_d: bool = False, fp8_dtype: torch.dtype = torch.float8_e4m3fn
) -> torch.Tensor:
    """MXFP8 round trip with 1x32 blocks along the last dim (32x32 tiles if ``two_d``)."""
    data = mx.quantize(x, fp8_dtype, rowwise=True, columnwise=False, two_d=two_d)
    return mx.dequantize(data, x.dtype, use="rowwise")


def _te_state() -> Any | None:
    """TE's FP8GlobalStateManager when TE is imported (never imports TE itself)."""
    import sys

    if "transformer_engine.pytorch" not in sys.modules:
        return None
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    return FP8GlobalStateManager


def fp8_params_requested() -> bool:
    """Whether a TE ``quantized_model_init(enabled=True)`` region is active."""
    state = _te_state()
    return bool(state is not None and state.with_fp8_parameters())


def _is_quantized(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "_quantizer") and hasattr(tensor, "dequantize")


def _attach_init_value(param: torch.Tensor, value: torch.Tensor) -> None:
    """TE's contract for ``preserve_high_precision_init_val`` (its helper when available)."""
    try:
        from transformer_engine.pytorch.module.base import _attach_high_precision_init_val
    except ImportError:
        _attach_high_precision_init_val = None
    if _attach_high_precision_init_val is not None:
        _attach_high_precision_init_val(param, value)
        return

    def _get(self: torch.Tensor) -> torch.Tensor | None:
        return getattr(self, "_high_precision_init_val", None)

    def _clear(self: torch.Tensor) -> None:
        if hasattr(self, "_high_precision_init_val"):
            del self._high_precision_init_val

    param._high_precision_init_val = value
    param.get_high_precision_init_val = MethodType(_get, param)
    param.clear_high_precision_init_val = MethodType(_clear, param)


class _MXFP8LinearFunction(torch.autograd.Function):
    """y = Q(x) Q(W)^T + b in fp32; backward on the dequantised operands (see module doc)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        two_d: bool,
    ) -> torch.Tensor:
        x_dq = quantize_dequantize(x)
        if _is_quantized(weight):
            w_dq = weight.dequantize(dtype=weight.dtype)
        else:
            w_dq = quantize_dequantize(weight, two_d=two_d)
        out = torch.matmul(x_dq.float(), w_dq.float().t())
        if bias is not None:
            out = out + bias.float()
        ctx.save_for_backward(x_dq, w_dq)
        ctx.has_bias = bias is not None
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x_dq, w_dq = ctx.saved_tensors
        grad = grad_out.float()
        grad_x = torch.matmul(grad, w_dq.float()).to(x_dq.dtype)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_w = torch.matmul(grad_2d.t(), x_dq.reshape(-1, x_dq.shape[-1]).float())
        grad_b = grad_2d.sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
        return grad_x, grad_w.to(ctx.weight_dtype), grad_b, None


class MXFP8Linear(torch.nn.Module):
    """``y = x W^T + b`` with MXFP8 GEMM operands as TE's ``Linear`` (see module doc).

    ``fp8_params``: ``None`` follows TE's ``quantized_model_init`` (when TE is imported),
    ``True`` forces a persistent ``MXFP8Tensor`` weight, ``False`` keeps it high precision.
    ``two_d_weights``: ``None`` follows the recipe's ``enable_2d_quantization``.
    ``in_features`` (and the product of the input's leading dims) must be multiples of 32.
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
        two_d_weights: bool | None = None,
    ) -> None:
        super().__init__()
        if in_features % BLOCK_SIZE or out_features % BLOCK_SIZE:
            raise ValueError(
                f"MXFP8Linear needs in_features and out_features to be multiples of "
                f"{BLOCK_SIZE}, got ({in_features}, {out_features})"
            )
        self.in_features = in_features
        self.out_features = out_features
        state = _te_state()
        recipe = state.get_fp8_recipe() if state is not None and fp8_params_requested() else None
        if fp8_params is None:
            fp8_params = fp8_params_requested()
        if two_d_weights is None:
            two_d_weights = bool(getattr(recipe, "enable_2d_quantization", False))
        self.two_d_weights = two_d_weights
        self.fp8_params = fp8_params

        weight = torch.empty(out_features, in_features, dtype=params_dtype, device=device)
        if init_method is None:
            torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        else:
            init_method(weight)
        if fp8_params:
            self.weight = self._quantized_weight(weight, recipe, state)
        else:
            self.weight = torch.nn.Parameter(weight)
        if bias:
            self.bias = torch.nn.Parameter(
                torch.zeros(out_features, dtype=params_dtype, device=device)
            )
        else:
            self.register_parameter("bias", None)

    def _quantized_weight(
        self, weight: torch.Tensor, recipe: Any, state: Any
    ) -> torch.nn.Parameter:
        if state is None:
            raise RuntimeError(
                "MXFP8Linear(fp8_params=True) needs Transformer Engine's MXFP8Tensor: call "
                "nemo_lw_fp8.emulation.activate() first (CPU) or install TE (GPU)"
            )
        if recipe is not None and type(recipe).__name__ != "MXFP8BlockScaling":
            raise ValueError(
                f"MXFP8Linear builds MXFP8 weights; quantized_model_init has recipe {recipe!r}"
            )
        from transformer_engine.pytorch.constants import DType
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

        init_value = None
        if state.with_high_precision_init_val():
            init_value = weight.detach().cpu()
        quantizer = MXFP8Quantizer(
            DType.kFloat8E4M3,
            rowwise=True,
            columnwise=torch.is_grad_enabled(),
            with_2d_quantization=self.two_d_weights,
        )
        param = torch.nn.Parameter(quantizer(weight.detach()))
        if init_value is not None:
            _attach_init_value(param, init_value)
        return param

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected last dim {self.in_features}, got shape {tuple(x.shape)}")
        return _MXFP8LinearFunction.apply(x, self.weight, self.bias, self.two_d_weights)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, fp8_params={self.fp8_params}, "
            f"two_d_weights={self.two_d_weights}"
        )
