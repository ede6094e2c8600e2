"""Settings the rule tests start from: the layer-wise MXFP8 param gather every rule accepts and
a single grouped expert weight set up as it must be. Kept in one place so that the rule tests
(``tests/rules/``) break one and the same good combination, not three copies that could drift."""

from __future__ import annotations

#: Muon under megatron's layer-wise distributed optimizer: what every layer-wise rule reads.
LAYER_WISE_MUON = dict(optimizer="muon", use_layer_wise_distributed_optimizer=True)

#: Layer-wise Muon whose MXFP8 param gather reuses the grad buffer: what the gather rules need.
LAYER_WISE_MXFP8_GATHER = LAYER_WISE_MUON | dict(
    fp8_recipe="mxfp8", fp8_param_gather=True, reuse_grad_buf_for_mxfp8_param_ag=True
)

#: A single grouped expert weight set up as it must be (TE switch on, a recent TE).
GROUPED_OK = dict(
    moe_single_grouped_weight=True, grouped_linear_single_param=True, te_version="2.20.2"
)
