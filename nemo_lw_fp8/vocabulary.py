"""The settings' vocabulary: the values a layer-wise setting may take, and the names of the
Transformer Engine launch variables the plugin reads, sets or checks, each defined once.

Everything that speaks about a setting (the plugin's :class:`~nemo_lw_fp8.config.LayerWiseConfig`,
the rules, the layout math, the recipes, the launchers) imports the words from here, so a value
or a variable name cannot drift between the place that sets it and the place that checks it.
Nothing here imports anything.
"""

from __future__ import annotations

#: The layer-wise buffer layouts: megatron 0.19.2's shard-aligned one, the plugin's compact one,
#: and no layout at all (flatten + all_gather).
LAYER_WISE_LAYOUTS = ("padded", "compact", "legacy")

#: How the compact layout syncs Muon gradients: each reduced to its owner only
#: (``"reduce_to_owner"``, in place, one reduce per owner's span of each bucket), or all-reduced to
#: every rank (``"all_reduce"``, upstream #5388's choice).
GRAD_SYNC_MODES = ("reduce_to_owner", "all_reduce")

#: How a single grouped expert weight is owned: ``"whole"`` (one rank, like any parameter),
#: ``"expert"`` (runs of its experts, each owned by one rank), ``"auto"`` (per ownership group:
#: expert runs when that lowers the busiest rank's Newton-Schulz work by more than
#: :data:`AUTO_SPLIT_GAIN`, else whole).
GROUPED_WEIGHT_OWNERSHIP = ("whole", "expert", "auto")
AUTO_SPLIT_GAIN = 0.02

#: How a fused ``linear_qkv`` weight that Muon orthogonalizes in parts (megatron's
#: ``muon_split_qkv``, tagged ``is_qkv`` with ``qkv_split_shapes``) is owned: ``"whole"`` (one
#: rank, like any parameter), ``"split"`` (each part, Q / K / V, and the gate with
#: ``attention_output_gate``, an independent matrix with its own owner), or ``"auto"`` (the
#: default: split wherever that can happen, whole otherwise; :func:`resolve_qkv_ownership`).
QKV_OWNERSHIP = ("auto", "whole", "split")
#: What ``"auto"`` resolves to: the two ways a fused QKV weight is actually owned.
QKV_RESOLVED = ("whole", "split")

#: Default bound on the transient padding of an even compact gather, relative to its payload.
DEFAULT_GATHER_PADDING_TOLERANCE = 0.1

#: TE's switch for one grouped parameter per ``GroupedLinear`` (read by TE when it builds one).
SINGLE_GROUPED_WEIGHT_ENV = "NVTE_GROUPED_LINEAR_SINGLE_PARAM"
#: TE's fused grouped MLP on Blackwell (evaluated once, when ``transformer_engine.pytorch.ops``
#: is imported).
CUTEDSL_ENV = "NVTE_CUTEDSL_FUSED_GROUPED_MLP"
#: TE's default of ``NVFP4BlockScaling.disable_stochastic_rounding``, read when
#: ``transformer_engine`` is imported.
NVFP4_NO_SR_ENV = "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"
