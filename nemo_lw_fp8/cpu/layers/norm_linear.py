"""A CPU norm + column-parallel linear in one module, as TE's ``LayerNormColumnParallelLinear``.

Part of the CPU backend (:mod:`nemo_lw_fp8.cpu`). The one CPU class for TE's fused norm +
linear: the ``local_norm_linear`` stand-in (:mod:`nemo_lw_fp8.cpu.megatron.standins`) makes
megatron's local backend offer it (MLA's fused Q / KV norms), and the CPU hybrid block spec
(:mod:`nemo_lw_fp8.cpu.layers.specs`) puts it in Gated DeltaNet's ``in_proj`` slot.

Why
    megatron-core 0.19.2 resolves MLA's Q / KV norms in ``QKNormConfigResolver``
    (``megatron/core/transformer/mla_qk_norm_config.py``). On TE's spec the norm slots are
    ``IdentityOp`` and the resolver fuses each norm into the projection after it, taking
    ``backend.column_parallel_layer_norm_linear()`` (TE's ``LayerNormColumnParallelLinear``):
    ``linear_kv_up_proj`` always, and ``linear_q_up_proj`` with a q LoRA, ``linear_q_proj``
    without one. Without a q LoRA there is no standalone place for the Q norm, so the fused form
    is the only one: megatron's local backend answers ``None`` there and a model such as
    DeepSeek-V2-Lite (``q_lora_rank=None``, ``qk_layernorm=True``) cannot be built on CPU. This
    module is the CPU answer, with TE's parameter names and order (``layer_norm_weight``,
    ``layer_norm_bias``, ``weight``, ``bias``, all the module's own) so the CPU model has the GPU
    model's structure and its ``torch_dist`` checkpoints the GPU's keys (megatron's
    ``GatedDeltaNet.sharded_state_dict`` looks ``in_proj.weight`` up by that name).

What it computes
    The config's norm (``normalization``, ``layernorm_epsilon``, ``layernorm_zero_centered_gamma``)
    through the same torch functions as megatron's ``WrappedTorchNorm``, then the CPU linear: the
    emulated FP8 one of the run's recipe (MXFP8 or blockwise, :data:`NORM_FP8_LINEARS`) when its
    FP8 is on (``config.fp8``), else megatron's ``ColumnParallelLinear`` (bf16). It is therefore
    bitwise the separate norm followed by the same linear. Not emulated: whether TE's fused
    kernel quantizes the fp32 norm output directly instead of its bf16 rounding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from nemo_lw_fp8.cpu.layers.parallel_linears import (
    FP8_LINEARS,
    BlockwiseColumnParallelLinear,
    MXFP8ColumnParallelLinear,
)


class _NormBeforeLinear:
    """Mixin: a norm over the input, with TE's parameter names, ahead of a linear's forward."""

    def _add_norm(self, input_size: int, config: Any) -> None:
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(
                f"the CPU norm+linear supports normalization RMSNorm or LayerNorm, not "
                f"{config.normalization!r}"
            )
        self.normalization = config.normalization
        self.eps = config.layernorm_epsilon
        self.zero_centered_gamma = bool(config.layernorm_zero_centered_gamma)
        make = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(make(input_size, dtype=config.params_dtype))
        self.layer_norm_bias = None
        if config.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(
                torch.zeros(input_size, dtype=config.params_dtype)
            )
        for param in (self.layer_norm_weight, self.layer_norm_bias):
            if param is not None:
                param.sequence_parallel = bool(config.sequence_parallel)  # as TE marks them
        # TE's LayerNormLinear registers its norm parameters before the linear's: the same
        # order here (the layer-wise optimizer assigns matrices to ranks in parameter order).
        for name in ("weight", "bias"):
            if name in self._parameters:
                self._parameters[name] = self._parameters.pop(name)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.layer_norm_weight
        shape = (weight.numel(),)
        if self.zero_centered_gamma:  # TE applies (1 + gamma), in fp32
            y = x.float()
            weight = weight.float() + 1
            bias = None if self.layer_norm_bias is None else self.layer_norm_bias.float()
        else:
            y, bias = x, self.layer_norm_bias
        if self.normalization == "RMSNorm":
            out = F.rms_norm(y, shape, weight, self.eps)
        else:
            out = F.layer_norm(y, shape, weight, bias, self.eps)
        return out.to(x.dtype)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return super().forward(self.norm(x), *args, **kwargs)  # type: ignore[misc]


class NormMXFP8ColumnParallelLinear(_NormBeforeLinear, MXFP8ColumnParallelLinear):
    """The config's norm, then the emulated MXFP8 column-parallel linear."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self._add_norm(input_size, config)


class NormBlockwiseColumnParallelLinear(_NormBeforeLinear, BlockwiseColumnParallelLinear):
    """The config's norm, then the emulated blockwise FP8 column-parallel linear (Hopper)."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self._add_norm(input_size, config)


#: ``fp8_recipe`` -> the norm + emulated FP8 linear (one per entry of
#: ``parallel_linears.FP8_LINEARS``).
NORM_FP8_LINEARS: dict[str, type] = {
    "mxfp8": NormMXFP8ColumnParallelLinear,
    "blockwise": NormBlockwiseColumnParallelLinear,
}
assert set(NORM_FP8_LINEARS) == set(FP8_LINEARS)


class NormColumnParallelLinear(_NormBeforeLinear, ColumnParallelLinear):
    """The config's norm, then megatron's ``ColumnParallelLinear`` (bf16 runs)."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self._add_norm(input_size, config)


class CPULayerNormColumnParallelLinear:
    """What megatron's local backend returns for ``column_parallel_layer_norm_linear()`` while
    the CPU backend is installed. A builder, like megatron's ``WrappedTorchNorm``: it builds a
    :data:`NORM_FP8_LINEARS`' class of the run's FP8 recipe when FP8 is on (``config.fp8``), else a
    :class:`NormColumnParallelLinear` (the resolver compares spec classes with ``is``, so one
    class must stand for both)."""

    def __new__(cls, input_size: int, output_size: int, *, config: Any, **kwargs: Any) -> Any:
        if getattr(config, "fp8", None) is None:
            return NormColumnParallelLinear(input_size, output_size, config=config, **kwargs)
        recipe = getattr(config, "fp8_recipe", "mxfp8")
        if recipe not in NORM_FP8_LINEARS:
            raise ValueError(
                f"the CPU norm+linear emulates fp8_recipe {sorted(NORM_FP8_LINEARS)}, not "
                f"{recipe!r}. Fix: mixed_precision.fp8_recipe=mxfp8 or blockwise on CPU, or a GPU."
            )
        return NORM_FP8_LINEARS[recipe](input_size, output_size, config=config, **kwargs)
