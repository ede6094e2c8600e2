"""A CPU expert layer that presents its weights exactly as TE 2.20.2's ``GroupedLinear`` does.

Part of the CPU backend (:mod:`nemo_lw_fp8.cpu`): the routed experts of the CPU layer specs
(:mod:`nemo_lw_fp8.cpu.layers.specs`) under ``--cpu``, and of the tests' tiny MoE models.

Why it exists
    megatron-core 0.19.2 trains single grouped expert weights only through TE's op fuser
    (``TEGroupedMLP._make_fused_ops`` -> ``te.pytorch.ops.GroupedLinear``), whose grouped GEMMs are
    CUDA kernels. To run megatron's real MoE layer (router, token dispatcher), DDP buffers and
    optimizers on CPU ranks, this layer replaces only the expert GEMMs. Its *parameters* are what
    TE builds, so every megatron code path that inspects them runs unchanged:

    * single grouped weight (``config.moe_single_grouped_weight`` and TE's switch
      ``NVTE_GROUPED_LINEAR_SINGLE_PARAM``, resolved by TE's own
      ``resolve_grouped_linear_single_param_flags``): ONE ``torch.nn.Parameter`` named ``weight``
      holding TE's ``GroupedTensor`` of wrapper shape ``(E, out, in)`` built by
      ``GroupedTensor.make_grouped_tensor_with_shapes`` -- bf16 members, or MXFP8 members when built
      under ``quantized_model_init`` (persistent MXFP8 primary weights, with the stacked
      high-precision init values attached as TE does);
    * discrete weights: ``weight0 .. weight{E-1}``, each ``(out, in)``: bf16 or TE ``MXFP8Tensor``.

    Both carry what megatron reads from TE's grouped linears: ``allreduce=False`` (expert
    gradients reduce over the expert-data-parallel group), tensor-parallel attributes, and on the
    module ``num_gemms`` and ``single_grouped_weight``.

Arithmetic
    One code path for both presentations, per expert ``e``: ``y_e = x_e W_e^T`` in fp32 from the
    GEMM operands, cast once to the activation dtype. With MXFP8 compute (``config.fp8 ==
    "mxfp8"``-like, selected by ``fp8``) both operands are MXFP8 quantize-dequantized (1x32 blocks
    along the reduction dimension, e4m3), as :mod:`nemo_lw_fp8.cpu.layers.mxfp8_linear` does for
    TE's ``Linear``; persistent MXFP8 weights are dequantized instead. Token rows per expert are
    zero-padded to a multiple of 32 for the quantizer (rowwise blocks make rows independent) and
    the padding is dropped. With MXFP8 compute the backward is TE's MXFP8 backward, per expert
    (:func:`~nemo_lw_fp8.cpu.layers.mxfp8_linear.mxfp8_backward`, which mirrors TE 2.20.2's
    ``_linear_backward_impl``): ``dx_e = Q_row(dy_e) @ W_e`` from the weight's **columnwise**
    copy (a persistent MXFP8 member's stored columnwise data, read at backward time) and
    ``dW_e = Q_col(dy_e)^T @ Q_col(x_e)``, on the zero-padded rows (zero rows add nothing), ``dy``
    in the recipe's backward format; in bf16 compute it is the plain fp32 backward. The
    weight gradient is cast to the parameter dtype; with ``fuse_wgrad_accumulation`` (what
    megatron's ``gradient_accumulation_fusion`` turns on in TE's grouped linears) the fp32 weight
    gradient is added straight into ``main_grad`` (``grad_added_to_main_grad``), as TE does. It is
    an argument here, not read from the config: on CPU megatron's local attention linears cannot
    run ``gradient_accumulation_fusion`` (they need apex's fused kernel).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nemo_lw_fp8.cpu.formats import mxfp8 as mx
from nemo_lw_fp8.cpu.layers.mxfp8_linear import (
    QuantizedParamModule,
    grad_fp8_dtype,
    mxfp8_backward,
    quantize_dequantize,
    weight_columnwise,
)

_ALIGN = 32


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    padded = math.ceil(max(rows, 1) / _ALIGN) * _ALIGN
    if padded == rows:
        return x
    return torch.cat([x, x.new_zeros(padded - rows, x.shape[1])], dim=0)


def _columnwise(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The columnwise MXFP8 round trip (blocks of 32 along dim 0) TE's backward GEMMs read."""
    data = mx.quantize(x, fp8_dtype, rowwise=False, columnwise=True)
    return mx.dequantize(data, x.dtype, use="columnwise")


def _is_quantized(tensor: Any) -> bool:
    return hasattr(tensor, "dequantize") and hasattr(tensor, "_quantizer")


class _GroupedGemm(torch.autograd.Function):
    """Per-expert ``x_e W_e^T`` for either weight presentation (see module doc)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        splits: list[int],
        layer: GroupedExpertLinear,
        *weights: torch.Tensor,
    ) -> torch.Tensor:
        members = layer.member_weights()
        outputs, saved = [], []
        for part, weight in zip(torch.split(x, splits), members, strict=True):
            if layer.fp8:
                padded = _pad_rows(part)
                x_dq = quantize_dequantize(padded)[: part.shape[0]]
                if _is_quantized(weight):
                    w_dq = weight.dequantize(dtype=layer.params_dtype)
                    w_col = None  # read from the member's columnwise copy at backward time
                else:
                    w_dq = quantize_dequantize(weight)
                    w_col = _columnwise(weight.detach(), torch.float8_e4m3fn)
                x_saved = _columnwise(padded, torch.float8_e4m3fn)
            else:
                x_dq = part
                w_dq = (
                    weight.dequantize(dtype=layer.params_dtype) if _is_quantized(weight) else weight
                )
                x_saved, w_col = x_dq, w_dq
            outputs.append(torch.matmul(x_dq.float(), w_dq.float().t()).to(x.dtype))
            saved.append((part.shape[0], x_saved, w_col))
        ctx.saved = saved
        ctx.layer = layer
        ctx.x_dtype = x.dtype
        ctx.grad_dtype = grad_fp8_dtype()
        ctx.num_weights = len(weights)
        return torch.cat(outputs, dim=0) if outputs else x.new_zeros(0, layer.out_features)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        layer: GroupedExpertLinear = ctx.layer
        splits = [rows for rows, _, _ in ctx.saved]
        members = layer.member_weights() if layer.fp8 else None
        grad_x, wgrads = [], []
        for expert, (dy, (rows, x_saved, w_col)) in enumerate(
            zip(torch.split(grad_out, splits), ctx.saved, strict=True)
        ):
            if not layer.fp8:
                dy = dy.float()
                grad_x.append(torch.matmul(dy, w_col.float()).to(ctx.x_dtype))
                wgrads.append(torch.matmul(dy.t(), x_saved.float()))
                continue
            if w_col is None:
                w_col = weight_columnwise(members[expert])
            dx, dw = mxfp8_backward(_pad_rows(dy.contiguous()), x_saved, w_col, ctx.grad_dtype)
            grad_x.append(dx[:rows].to(ctx.x_dtype))
            wgrads.append(dw)
        del ctx.saved
        weight_grads = layer.weight_grads(wgrads)
        return (torch.cat(grad_x, dim=0), None, None, *weight_grads)


class GroupedExpertLinear(QuantizedParamModule):
    """E expert matrices ``(out, in)``: one TE ``GroupedTensor`` parameter or E parameters."""

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        *,
        config: Any,
        init_method: Any,
        single_grouped_weight: bool,
        fp8: bool,
        parallel_mode: str,
        fuse_wgrad_accumulation: bool = False,
    ) -> None:
        super().__init__()
        from transformer_engine.pytorch.utils import resolve_grouped_linear_single_param_flags

        # TE's own resolution: without NVTE_GROUPED_LINEAR_SINGLE_PARAM it silently falls back.
        single_grouped_weight, _ = resolve_grouped_linear_single_param_flags(
            single_grouped_weight, False
        )
        self.num_gemms = num_gemms
        self.in_features = in_features
        self.out_features = out_features
        self.single_grouped_weight = single_grouped_weight
        self.single_grouped_bias = False
        self.use_bias = False
        self.fp8 = fp8
        self.params_dtype = config.params_dtype
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        from nemo_lw_fp8.cpu.layers.mxfp8_linear import _te_state, fp8_params_requested

        self.fp8_params = fp8_params_requested()
        state = _te_state()
        keep_init = bool(
            self.fp8_params and state is not None and state.with_high_precision_init_val()
        )

        # Same RNG draws in the same order for both presentations.
        values = []
        for _ in range(num_gemms):
            value = torch.empty(out_features, in_features, dtype=self.params_dtype)
            init_method(value)
            values.append(value)
        quantizer = self._quantizer() if self.fp8_params else None

        if single_grouped_weight:
            from transformer_engine.pytorch.tensor.grouped_tensor import GroupedTensor

            grouped = GroupedTensor.make_grouped_tensor_with_shapes(
                num_tensors=num_gemms,
                shapes=[(out_features, in_features)] * num_gemms,
                quantizer=quantizer,
                dtype=self.params_dtype,
                device=torch.device("cpu"),
            )
            with torch.no_grad():
                for member, value in zip(grouped.quantized_tensors, values, strict=True):
                    if quantizer is None:
                        member.copy_(value)
                    else:
                        quantizer.update_quantized(value, member)
            param = torch.nn.Parameter(grouped)
            if keep_init:
                from transformer_engine.pytorch.module.base import _attach_high_precision_init_val

                _attach_high_precision_init_val(param, torch.stack(values, dim=0))
            self.weight = param
            params = [param]
        else:
            params = []
            for index, value in enumerate(values):
                if quantizer is None:
                    param = torch.nn.Parameter(value)
                else:
                    param = torch.nn.Parameter(quantizer(value))
                    if keep_init:
                        from transformer_engine.pytorch.module.base import (
                            _attach_high_precision_init_val,
                        )

                        _attach_high_precision_init_val(param, value.clone())
                self.register_parameter(f"weight{index}", param)
                params.append(param)

        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        for param in params:
            param.allreduce = False  # expert parameter: reduce over expert-data-parallel ranks
            set_tensor_model_parallel_attributes(
                param, is_parallel=True, dim=0 if parallel_mode == "column" else 1, stride=1
            )

    @staticmethod
    def _quantizer():
        from transformer_engine.pytorch.constants import DType
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

        return MXFP8Quantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True)

    def weight_params(self) -> list[torch.nn.Parameter]:
        if self.single_grouped_weight:
            return [self.weight]
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def member_weights(self) -> list[torch.Tensor]:
        """The E matrices the GEMMs read (views of live storage; MXFP8 members stay quantized)."""
        if not self.single_grouped_weight:
            return self.weight_params()
        grouped = self.weight
        if grouped.quantizer is None:
            # DDP may have remapped rowwise_data into its param buffer: read it, not a cache.
            return list(grouped.rowwise_data.view(self.num_gemms, self.out_features, -1).unbind(0))
        from megatron.core.fp8_utils import get_grouped_quantized_members

        return list(get_grouped_quantized_members(grouped, create_if_missing=True))

    def weight_grads(self, wgrads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Gradients for :meth:`weight_params` from fp32 per-expert wgrads."""
        params = self.weight_params()
        if self.fuse_wgrad_accumulation:
            for param in params:
                if getattr(param, "main_grad", None) is None:
                    raise RuntimeError("gradient_accumulation_fusion needs DDP's main_grad")
            if self.single_grouped_weight:
                main = params[0].main_grad.view(self.num_gemms, self.out_features, -1)
                for expert, wgrad in enumerate(wgrads):
                    main[expert].add_(wgrad)
            else:
                for param, wgrad in zip(params, wgrads, strict=True):
                    param.main_grad.add_(wgrad)
            out = []
            for param in params:
                param.grad_added_to_main_grad = True
                out.append(torch.zeros(param.shape, dtype=self.params_dtype))
            return out
        if self.single_grouped_weight:
            return [torch.stack([w.to(self.params_dtype) for w in wgrads], dim=0)]
        return [w.to(self.params_dtype) for w in wgrads]

    def forward(self, x: torch.Tensor, splits: list[int]) -> torch.Tensor:
        return _GroupedGemm.apply(x, splits, self, *self.weight_params())

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in={self.in_features}, out={self.out_features}, "
            f"single_grouped_weight={self.single_grouped_weight}, fp8={self.fp8}"
        )


class GroupedExperts(torch.nn.Module):
    """megatron's experts interface (``ExpertsBuilder``): fc1 -> activation x probs -> fc2."""

    def __init__(
        self,
        num_local_experts: int,
        config: Any,
        /,
        *,
        pg_collection: Any = None,
        name: str | None = None,
        fp8: bool = False,
        fuse_wgrad_accumulation: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.num_local_experts = num_local_experts
        self.pg_collection = pg_collection
        single = bool(getattr(config, "moe_single_grouped_weight", False))
        common = dict(
            config=config,
            single_grouped_weight=single,
            fp8=fp8,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
        )
        self.linear_fc1 = GroupedExpertLinear(
            num_local_experts,
            config.hidden_size,
            config.moe_ffn_hidden_size,
            init_method=config.init_method,
            parallel_mode="column",
            **common,
        )
        self.linear_fc2 = GroupedExpertLinear(
            num_local_experts,
            config.moe_ffn_hidden_size,
            config.hidden_size,
            init_method=config.output_layer_init_method,
            parallel_mode="row",
            **common,
        )
        self.activation_func = config.activation_func

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
        /,
    ) -> tuple[torch.Tensor, None]:
        splits = [int(n) for n in tokens_per_expert.tolist()]
        hidden = self.linear_fc1(permuted_local_hidden_states, splits)
        dtype = hidden.dtype
        hidden = (self.activation_func(hidden) * permuted_probs.unsqueeze(-1)).to(dtype)
        return self.linear_fc2(hidden, splits), None

    def backward_dw(self) -> None:
        """Weight gradients are computed in the main backward (no delayed wgrad)."""

    def _groups(self) -> tuple[Any, Any, Any]:
        """Expert-parallel, expert-tensor-parallel and expert-data-parallel groups."""
        from megatron.core import parallel_state

        pg = self.pg_collection
        ep = getattr(pg, "ep", None) or parallel_state.get_expert_model_parallel_group()
        tp = getattr(pg, "expt_tp", None) or parallel_state.get_expert_tensor_parallel_group()
        dp = getattr(pg, "expt_dp", None) or parallel_state.get_expert_data_parallel_group()
        return ep, tp, dp

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """megatron's ``torch_dist`` layout of TE grouped experts (``TEGroupedMLP`` over
        ``TEGroupedLinear._sharded_state_dict_grouped``): each expert under
        ``<prefix>experts.linear_fc{1,2}.weight`` at its global expert index, fc1 of a gated MLP
        in its [W; V] halves, one writer per expert-data-parallel group. A single grouped
        weight is one :class:`~nemo_lw_fp8.mechanics.grouped_checkpoint.GroupedWeightFactory`
        whose data is the parameter, so optimizers find its entry (and runs of its experts
        theirs). No ``_extra_state``: the CPU layer keeps no FP8 metadata."""
        from megatron.core.utils import get_pg_rank, get_pg_size

        from nemo_lw_fp8.mechanics import grouped_checkpoint as gc

        metadata = metadata or {}
        ep, tp, dp = self._groups()
        replica_id = (0, 0, get_pg_rank(dp))
        out: dict[str, Any] = {}
        for name, linear in (("linear_fc1", self.linear_fc1), ("linear_fc2", self.linear_fc2)):
            layout = gc.GroupedLayout(
                sharded_offsets=tuple(sharded_offsets),
                first_global_expert=get_pg_rank(ep) * self.num_local_experts,
                num_global_experts=get_pg_size(ep) * self.num_local_experts,
                tp_axis=0 if name == "linear_fc1" else 1,
                tp_rank=get_pg_rank(tp),
                tp_size=get_pg_size(tp),
                gated=name == "linear_fc1" and bool(self.config.gated_linear_unit),
                singleton_local_shards=bool(metadata.get("singleton_local_shards", False)),
                tail=f"{name}.weight",
                tp_group=tp,
                dp_group=metadata.get("dp_cp_group"),
            )
            key = f"{prefix}experts.{name}.weight"
            if linear.single_grouped_weight:
                out[f"{prefix}{name}.weight"] = gc.factory(
                    key, linear.weight, layout, 0, self.num_local_experts, replica_id
                )
                continue
            for index, param in enumerate(linear.weight_params()):
                out[f"{prefix}{name}.weight{index}"] = gc.expert_entry(
                    layout, key, param, index, replica_id
                )
        return out
