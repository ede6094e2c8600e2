"""megatron's column- and row-parallel linears with emulated FP8 GEMMs on CPU: the MXFP8 and
blockwise linears of :mod:`.mxfp8_linear` and :mod:`.blockwise_linear` behind megatron's
``ColumnParallelLinear`` / ``RowParallelLinear`` interfaces, one pair per ``fp8_recipe``
(:data:`FP8_LINEARS`). The layer specs (:mod:`.specs`) and the fused norm + linear
(:mod:`.norm_linear`) both build from here.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_lw_fp8.cpu.layers.blockwise_linear import BlockwiseFP8Linear
from nemo_lw_fp8.cpu.layers.mxfp8_linear import MXFP8Linear


def _tp_size(config: Any) -> int:
    return int(getattr(config, "tensor_model_parallel_size", 1) or 1)


class _FP8ParallelLinear(torch.nn.Module):
    """Megatron ``Column/RowParallelLinear`` interface over an emulated FP8 linear (TP = 1).

    A mixin ahead of the emulated linear (``MXFP8Linear`` or ``BlockwiseFP8Linear``) in the
    concrete classes below, not a wrapper around one: the parameters are the module's own
    ``weight`` / ``bias``, as on TE's and megatron's linears, so state dicts and ``torch_dist``
    checkpoints carry megatron's names (``linear_fc1.weight``, not ``linear_fc1.linear.weight``;
    megatron's ``GatedDeltaNet.sharded_state_dict`` looks ``in_proj.weight`` up by name)."""

    partition_dim = 0

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Any = None,
        bias: bool = True,
        skip_bias_add: bool = False,
        is_expert: bool = False,
        **_: Any,
    ) -> None:
        if _tp_size(config) != 1:
            raise ValueError("CPU FP8 linears support tensor_model_parallel_size=1 only")
        # The emulated linear's constructor: (in, out, bias=, params_dtype=, init_method=),
        # following TE's quantized_model_init.
        super().__init__(
            input_size,
            output_size,
            bias=bias,
            params_dtype=config.params_dtype,
            init_method=init_method,
        )
        self.skip_bias_add = skip_bias_add
        expert_parallel = is_expert and config.expert_model_parallel_size > 1
        for param in (self.weight, self.bias):
            if param is None:
                continue
            param.tensor_model_parallel = param.dim() == 2
            param.partition_dim = self.partition_dim if param.dim() == 2 else -1
            param.partition_stride = 1
            param.allreduce = not expert_parallel

    def forward(self, x: torch.Tensor, *_: Any, **__: Any) -> tuple[torch.Tensor, Any]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.skip_bias_add and self.bias is not None:
            bias = self.bias
            self.bias = None
            try:
                out = super().forward(flat)
            finally:
                self.bias = bias
            return out.reshape(*shape[:-1], self.out_features), bias
        return super().forward(flat).reshape(*shape[:-1], self.out_features), None


class MXFP8ColumnParallelLinear(_FP8ParallelLinear, MXFP8Linear):
    """TE ``Linear``'s MXFP8 arithmetic (Blackwell recipes) as a column-parallel linear."""

    partition_dim = 0


class MXFP8RowParallelLinear(_FP8ParallelLinear, MXFP8Linear):
    partition_dim = 1


class BlockwiseColumnParallelLinear(_FP8ParallelLinear, BlockwiseFP8Linear):
    """Hopper's blockwise FP8 (TE ``Float8BlockScaling``): 1x128 input blocks, 128x128 weight
    tiles; persistent ``Float8BlockwiseQTensor`` weights under quantized_model_init."""

    partition_dim = 0


class BlockwiseRowParallelLinear(BlockwiseColumnParallelLinear):
    partition_dim = 1


#: megatron's ``fp8_recipe`` -> the CPU (column, row) parallel linears that emulate it.
FP8_LINEARS: dict[str, tuple[type, type]] = {
    "mxfp8": (MXFP8ColumnParallelLinear, MXFP8RowParallelLinear),
    "blockwise": (BlockwiseColumnParallelLinear, BlockwiseRowParallelLinear),
}
