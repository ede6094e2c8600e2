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
  parameter *is* TE's persistent ``MXFP8Tensor``: its rowwise copy feeds the forward GEMM and
  its columnwise copy the dgrad GEMM, both used as stored. With
  ``preserve_high_precision_init_val=True`` the pre-quantisation values are attached exactly as
  TE's modules do (``get_high_precision_init_val()``).
  This mode needs :func:`nemo_lw_fp8.cpu.te.activate` (or a real TE).

Backward (TE 2.20.2's default MXFP8 backward, ``backward_override=None``:
``_linear_backward_impl`` in ``transformer_engine/pytorch/module/linear.py``, with
``grad_output_preprocess`` in ``module/base.py``): every GEMM operand is MXFP8 with its blocks
along that GEMM's reduction dimension, which is why TE keeps a rowwise and a columnwise copy of
each tensor:

* ``dy`` (2-D, ``(tokens, out)``) is quantised by the grad-output quantizer, rowwise and
  columnwise, in the recipe's backward format (e5m2 under ``Format.HYBRID``, else e4m3); the
  bias gradient is the fp32 sum of the unquantised ``dy`` (``tex.bgrad_quantize``);
* dgrad, ``general_gemm(weight, dy, layout="NN")``: ``dx = Q_row(dy) @ Q_col(W)``, the weight's
  **columnwise** copy (blocks along ``out_features``; ``weight_fp8.update_usage(columnwise_usage=
  True)``). A persistent ``MXFP8Tensor`` weight is read as it is at backward time, so its
  columnwise copy must be current: a gather that refreshed only the rowwise copy gives other
  gradients. A high-precision weight is quantised both ways in the forward (TE's weight
  workspace);
* wgrad, ``general_gemm(x, dy, layout="NT")``: ``dW = Q_col(dy)^T @ Q_col(x)``, the columnwise
  copies of the input (quantised in the forward, blocks along the tokens) and of ``dy``.

Each GEMM runs in fp32 on the dequantised operands and is cast once: ``dx`` to the input's
dtype; ``dW`` to the parameter's nominal dtype, returned as a plain tensor so autograd
accumulates it into ``.grad`` and megatron's DDP hooks add it to ``main_grad`` as for any
parameter. The token count (leading dims) must be a multiple of 32, as TE requires.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch

from nemo_lw_fp8.cpu.formats import mxfp8 as mx
from nemo_lw_fp8.cpu.formats.mxfp8_layout import BLOCK_SIZE

__all__ = [
    "MXFP8Linear",
    "QuantizedParamModule",
    "fp8_params_requested",
    "grad_fp8_dtype",
    "mxfp8_backward",
    "quantize_dequantize",
    "weight_columnwise",
]


class QuantizedParamModule(torch.nn.Module):
    """Base of the emulated TE modules: keeps what is attached to a quantized parameter across
    module-wide casts, as TE 2.20.2's ``TransformerEngineBaseModule._apply`` does.

    ``Module._apply`` (megatron's ``Float16Module`` ``module.bfloat16()``, Bridge's ``.cuda()``)
    moves a tensor-subclass parameter with ``torch.utils.swap_tensors``, which exchanges its
    ``__dict__`` with that of the cast result: the parameter object survives, but the attributes
    megatron set on it (``allreduce``, ``tensor_model_parallel``, ...) would be gone -- expert
    weights would then be reduced and sharded as dense ones. TE re-attaches every attribute the
    cast result lacks; so do these modules.
    """

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        try:
            from transformer_engine.pytorch.quantized_tensor import QuantizedTensorStorage
        except ImportError:  # no TE (nor its emulation): no quantized parameters either
            return super()._apply(fn, recurse)
        before = {
            name: (param, dict(param.__dict__))
            for name, param in self._parameters.items()
            if isinstance(param, QuantizedTensorStorage)
        }
        result = super()._apply(fn, recurse)
        for name, (old, attributes) in before.items():
            param = self._parameters.get(name)
            if param is None:
                raise RuntimeError(f"{type(self).__name__}.{name} was dropped by a module cast")
            for key, value in attributes.items():
                if key in param.__dict__:
                    continue  # the quantized tensor's own state: the cast's value is current
                if isinstance(value, MethodType) and value.__self__ is old:
                    value = MethodType(value.__func__, param)
                setattr(param, key, value)
        return result


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


def _quantize_dequantize(
    x: torch.Tensor, fp8_dtype: torch.dtype, use: str, two_d: bool = False
) -> torch.Tensor:
    """One direction of an MXFP8 round trip (``use``: ``"rowwise"`` or ``"columnwise"``)."""
    data = mx.quantize(
        x, fp8_dtype, rowwise=use == "rowwise", columnwise=use == "columnwise", two_d=two_d
    )
    return mx.dequantize(data, x.dtype, use=use)


def grad_fp8_dtype() -> torch.dtype:
    """The format of TE's grad-output quantizer for the active MXFP8 recipe: e5m2 under
    ``Format.HYBRID``, e4m3 otherwise (``MXFP8BlockScaling``'s default format is E4M3)."""
    state = _te_state()
    if state is None or not state.is_fp8_enabled():
        return torch.float8_e4m3fn
    fmt = getattr(state.get_fp8_recipe(), "fp8_format", None)
    return torch.float8_e5m2 if getattr(fmt, "name", "") == "HYBRID" else torch.float8_e4m3fn


def weight_columnwise(weight: torch.Tensor) -> torch.Tensor:
    """A persistent MXFP8 weight as TE's dgrad GEMM reads it: its columnwise copy, dequantised.

    Like TE's ``update_usage(columnwise_usage=True)``, refuses a weight without one."""
    from nemo_lw_fp8.cpu.te.tex.common import torch_dtype

    codes, scales = weight._columnwise_data, weight._columnwise_scale_inv
    if codes is None or scales is None:
        raise RuntimeError(
            "Requested column-wise usage, but the MXFP8 weight has no column-scaled data "
            "(TE's dgrad GEMM reads it; build the weight with a columnwise quantizer)"
        )
    return mx.dequantize_codes(
        codes,
        scales,
        torch_dtype(weight._fp8_dtype),
        columnwise=True,
        dtype=weight.dtype,
        swizzled=bool(weight._with_gemm_swizzled_scales),
    )


def mxfp8_backward(
    dy: torch.Tensor,
    x_col: torch.Tensor | None,
    w_col: torch.Tensor | None,
    grad_dtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """TE's MXFP8 dgrad and wgrad GEMMs for 2-D ``dy`` ``(tokens, out)`` (see module doc):
    ``dx = Q_row(dy) @ W_col`` when ``w_col`` is given, ``dW = Q_col(dy)^T @ x_col`` (fp32) when
    ``x_col`` is given; ``x_col`` and ``w_col`` are the dequantised columnwise copies."""
    grad_x = grad_w = None
    if w_col is not None:
        dy_row = _quantize_dequantize(dy, grad_dtype, "rowwise")
        grad_x = torch.matmul(dy_row.float(), w_col.float())
    if x_col is not None:
        dy_col = _quantize_dequantize(dy, grad_dtype, "columnwise")
        grad_w = torch.matmul(dy_col.float().t(), x_col.float())
    return grad_x, grad_w


def fp32_linear(x_dq: torch.Tensor, w_dq: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The forward GEMM of both emulated linears: the dequantized operands multiplied in fp32,
    plus the bias in fp32 (TE's GEMM accumulates in fp32 and adds the bias in its epilogue)."""
    out = torch.matmul(x_dq.float(), w_dq.float().t())
    return out + bias.float() if bias is not None else out


def save_for_quantized_backward(
    ctx: Any,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    saved: tuple[torch.Tensor | None, torch.Tensor | None],
    persistent: bool,
) -> None:
    """What both emulated linears keep for backward: the columnwise copies ``saved`` (input,
    weight), and a persistent FP8 weight itself, read at backward time as TE's dgrad GEMM reads
    the saved weight."""
    ctx.save_for_backward(*saved)
    ctx.weight = weight if persistent else None
    ctx.grad_dtype = grad_fp8_dtype()
    ctx.has_bias = bias is not None
    ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
    ctx.weight_dtype = weight.dtype
    ctx.bias_dtype = bias.dtype if bias is not None else None


def quantized_backward(
    ctx: Any,
    grad_out: torch.Tensor,
    weight_columnwise_of: Callable[[torch.Tensor], torch.Tensor],
    gemms: Callable[..., tuple[torch.Tensor | None, torch.Tensor | None]],
    bias_grad: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The backward of both emulated linears: the format's dgrad / wgrad GEMMs (``gemms``) over
    the saved columnwise copies (a persistent weight's from ``weight_columnwise_of``), and the
    format's unfused bias gradient (``bias_grad`` of the 2-D ``dy``)."""
    x_col, w_col = ctx.saved_tensors
    if ctx.weight is not None and ctx.needs_input_grad[0]:
        w_col = weight_columnwise_of(ctx.weight)
    ctx.weight = None
    dy = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
    grad_x, grad_w = gemms(dy, x_col, w_col, ctx.grad_dtype)
    if grad_x is not None:
        grad_x = grad_x.to(ctx.x_dtype).view(ctx.x_shape)
    if grad_w is not None:
        grad_w = grad_w.to(ctx.weight_dtype)
    grad_b = bias_grad(dy).to(ctx.bias_dtype) if ctx.has_bias else None
    return grad_x, grad_w, grad_b


class _MXFP8LinearFunction(torch.autograd.Function):
    """y = Q(x) Q(W)^T + b in fp32; TE's MXFP8 backward (see module doc)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        two_d: bool,
    ) -> torch.Tensor:
        x_dq = quantize_dequantize(x)
        quantized = _is_quantized(weight)
        if quantized:
            w_dq = weight.dequantize(dtype=weight.dtype)
        else:
            w_dq = quantize_dequantize(weight, two_d=two_d)
        out = fp32_linear(x_dq, w_dq, bias)
        x_col = w_col = None
        if ctx.needs_input_grad[1]:
            x_col = _quantize_dequantize(
                x.reshape(-1, x.shape[-1]), torch.float8_e4m3fn, "columnwise"
            )
        if ctx.needs_input_grad[0] and not quantized:
            w_col = _quantize_dequantize(weight.detach(), torch.float8_e4m3fn, "columnwise", two_d)
        save_for_quantized_backward(ctx, x, weight, bias, (x_col, w_col), quantized)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        grads = quantized_backward(
            ctx, grad_out, weight_columnwise, mxfp8_backward, lambda dy: dy.float().sum(0)
        )
        return *grads, None


class MXFP8Linear(QuantizedParamModule):
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
                "nemo_lw_fp8.cpu.te.activate() first (CPU) or install TE (GPU)"
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
