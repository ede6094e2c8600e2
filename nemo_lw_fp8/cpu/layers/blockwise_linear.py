"""A linear layer whose GEMMs see blockwise FP8 operands as TE's ``Linear`` under
``Float8BlockScaling``, for CPU models (the blockwise sibling of :mod:`.mxfp8_linear`).

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
  modules do. Needs :func:`nemo_lw_fp8.cpu.te.activate` (or a real TE).

Backward (TE 2.20.2's ``_linear_backward_impl`` with ``Float8BlockQuantizer``s,
``grad_block_scaling_dim=1``): ``dy`` (2-D, ``(tokens, out)``) is quantised in the recipe's
backward format (e5m2 under ``Format.HYBRID``, else e4m3) with 1x128 blocks rowwise and 128x1
blocks columnwise; the bias gradient is the sum of the unquantised ``dy`` (TE's unfused bgrad
for blockwise quantizers). dgrad: ``dx = Q_row(dy) @ W_col``; wgrad: ``dW = Q_col(dy)^T @
Q_col(x)``, the input's columnwise copy (128x1 blocks along the tokens) quantised in the
forward. Each GEMM runs in fp32 on the dequantised operands and is cast once: ``dx`` to the
input's dtype, ``dW`` to the parameter's nominal dtype (a plain tensor, so megatron's DDP hooks
add it to ``main_grad``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from nemo_lw_fp8.cpu.formats import blockwise as bw
from nemo_lw_fp8.cpu.layers.mxfp8_linear import (
    QuantizedParamModule,
    _attach_init_value,
    _te_state,
    fp8_params_requested,
    fp32_linear,
    quantized_backward,
    save_for_quantized_backward,
)

__all__ = [
    "BlockwiseFP8Linear",
    "blockwise_backward",
    "quantize_dequantize_input",
    "quantize_dequantize_weight",
]


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


def _columnwise_input(x: torch.Tensor) -> torch.Tensor:
    """The input as TE's wgrad GEMM reads it: 128x1 blocks along the tokens, dequantised."""
    data = bw.quantize(x, block_dim=1, rowwise=False, columnwise=True)
    return bw.dequantize(data, x.dtype, use="columnwise")


def blockwise_backward(
    dy: torch.Tensor,
    x_col: torch.Tensor | None,
    w_col: torch.Tensor | None,
    grad_dtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """TE's ``Float8BlockScaling`` dgrad and wgrad GEMMs for 2-D ``dy`` ``(tokens, out)``:
    ``dx = Q_row(dy) @ W_col`` (1x128 blocks along ``out``) when ``w_col`` is given,
    ``dW = Q_col(dy)^T @ x_col`` (128x1 blocks along the tokens, fp32) when ``x_col`` is."""
    grad_x = grad_w = None
    data = bw.quantize(
        dy, grad_dtype, block_dim=1, rowwise=w_col is not None, columnwise=x_col is not None
    )
    if w_col is not None:
        dy_row = bw.dequantize(data, dy.dtype, use="rowwise")
        grad_x = torch.matmul(dy_row.float(), w_col.float())
    if x_col is not None:
        dy_col = bw.dequantize(data, dy.dtype, use="columnwise")
        grad_w = torch.matmul(dy_col.float().t(), x_col.float())
    return grad_x, grad_w


class _BlockwiseLinearFunction(torch.autograd.Function):
    """y = Q1x128(x) Q128x128(W)^T + b in fp32; TE's blockwise backward (see module doc)."""

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
        out = fp32_linear(x_dq, w_fwd, bias)
        x_col = None
        if ctx.needs_input_grad[1]:
            x_col = _columnwise_input(x.detach().reshape(-1, x.shape[-1]))
        # A high-precision weight is read as quantized here (128x128 tiles: both directions
        # share each tile's scale, so the columnwise form is the same values).
        w_col = None if persistent or not ctx.needs_input_grad[0] else w_fwd
        save_for_quantized_backward(ctx, x, weight, bias, (x_col, w_col), persistent)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        # TE's unfused bgrad for blockwise quantizers: the sum of the unquantised dy.
        return quantized_backward(
            ctx, grad_out, _columnwise_weight, blockwise_backward, lambda dy: dy.sum(0)
        )


class BlockwiseFP8Linear(QuantizedParamModule):
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
                "Float8BlockwiseQTensor: call nemo_lw_fp8.cpu.te.activate() first (CPU) "
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
