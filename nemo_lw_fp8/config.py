"""The plugin's own settings for a run, in one frozen object.

Megatron's flags keep their meaning and stay where megatron reads them (``OptimizerConfig``,
``DistributedDataParallelConfig``, ``TransformerConfig``). What megatron has no field for lives
here: how layer-wise buffers are laid out, when the compact gather may pad, and how single
grouped expert weights are owned. A :class:`LayerWiseConfig` checks itself through
:mod:`nemo_lw_fp8.rules` when it is made (a bad value fails at once, naming the rule and the
fix) and is attached to the DDP config that wraps the model; every mechanism reads it back from
there with :func:`read` -- the one place where the plugin's settings meet megatron's configs.

    from nemo_lw_fp8 import LayerWiseConfig
    LayerWiseConfig(layout="compact").attach(ddp_config)   # before wrapping the model in DDP
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from nemo_lw_fp8.vocabulary import (
    DEFAULT_GATHER_PADDING_TOLERANCE,
    GRAD_SYNC_MODES,
    GROUPED_WEIGHT_OWNERSHIP,
    LAYER_WISE_LAYOUTS,
)

#: Attribute of megatron's ``DistributedDataParallelConfig`` that holds the plugin's config.
CONFIG_ATTR = "nemo_lw_fp8"

__all__ = [
    "CONFIG_ATTR",
    "DEFAULT_GATHER_PADDING_TOLERANCE",
    "GRAD_SYNC_MODES",
    "GROUPED_WEIGHT_OWNERSHIP",
    "LAYER_WISE_LAYOUTS",
    "LayerWiseConfig",
    "is_compact",
    "read",
]


@dataclass(frozen=True)
class LayerWiseConfig:
    """How the plugin lays out and gathers the layer-wise (Muon) buffers of one model.

    ``layout``: ``"compact"`` (no padding, cost-balanced owners, one gather per bucket group;
    the plugin's default), ``"padded"`` (megatron-core 0.19.2's shard-aligned layout) or
    ``"legacy"`` (no layout: flatten + all_gather of whole params). Wrap with megatron's own
    ``use_layer_wise_param_layout=True`` for ``padded`` / ``compact`` and ``False`` for ``legacy``.

    ``gather_padding_tolerance`` (compact): a bucket group gathers with one even
    ``all_gather_into_tensor`` when padding every owner's segment to the longest costs at most
    this fraction of the payload, else with one uneven ``all_gather`` (real bytes only);
    ``math.inf`` always takes the even gather.

    ``grouped_weight_ownership`` (compact): a single grouped expert weight is owned ``"whole"``
    by one rank, in runs of experts by several ranks (``"expert"``), or in runs only where that
    lowers the busiest rank's Newton-Schulz work by more than 2 % (``"auto"``). The arithmetic is
    the same in all three.

    ``qkv_ownership``: ``"split"`` owns the Q, K and V parts of a fused ``linear_qkv`` weight as
    matrices of their own wherever megatron's Muon orthogonalizes them apart (``muon_split_qkv``,
    on by default), so ranks that would own no large matrix own the small K and V parts (their
    gradients then need not travel); ``"whole"``: one owner per weight; ``"auto"`` (the default):
    split on the compact layout, whole where parts cannot be owned apart (the padded and legacy
    layouts, blockwise FP8 weights). An explicit ``"split"`` there is refused, not dropped. The
    arithmetic is the same in all; a checkpoint saved under one loads under the other.

    ``grad_sync`` (compact): ``"reduce_to_owner"`` (the default) reduces each Muon gradient in
    place to the rank that owns the matrix only (each bucket's gradients lie in owner order, one
    reduce per owner's span, one launch per bucket group);
    ``"all_reduce"`` all-reduces them to every rank as upstream #5388 does (twice the bytes).
    The padded and legacy layouts reduce-scatter or all-reduce as megatron does, so there a
    non-default ``grad_sync``, ``bucket_cap_numel`` or ``gather_padding_tolerance`` would be
    ignored: it is refused instead (rules ``compact-only-*``, docs/guards.md).
    ``bucket_cap_numel`` (compact): where layer-wise buckets end. ``None`` (default): where
    megatron's padded layout ends them (a bucket closes at ``max(bucket_size, 0.9 x group size x
    its largest matrix)`` elements), so the compact layout issues as many gather and gradient
    launches per step as the padded one, with no padding; each bucket group's transient gather
    buffer is its own size. A number caps that threshold (never below ``bucket_size``): smaller
    transients, more launches; ``0`` is megatron's plain DDP bucketing.
    """

    layout: str = "compact"
    gather_padding_tolerance: float = DEFAULT_GATHER_PADDING_TOLERANCE
    grouped_weight_ownership: str = "whole"
    qkv_ownership: str = "auto"
    grad_sync: str = "reduce_to_owner"
    bucket_cap_numel: int | None = None

    def __post_init__(self) -> None:
        from nemo_lw_fp8 import rules as guards

        guards.check(guards.Settings(use_layer_wise_distributed_optimizer=True, **self.settings()))

    def settings(self) -> dict[str, Any]:
        """The fields :class:`nemo_lw_fp8.rules.Settings` reads, under its names."""
        return {
            "layer_wise_layout": self.layout,
            "gather_padding_tolerance": self.gather_padding_tolerance,
            "grouped_weight_ownership": self.grouped_weight_ownership,
            "qkv_ownership": self.qkv_ownership,
            "layer_wise_grad_sync": self.grad_sync,
            "bucket_cap_numel": self.bucket_cap_numel,
        }

    @property
    def uses_param_layout(self) -> bool:
        """megatron's ``use_layer_wise_param_layout`` that goes with this layout."""
        return self.layout != "legacy"

    def attach(self, ddp_config: Any) -> Any:
        """Put this config on a megatron ``DistributedDataParallelConfig`` (returned)."""
        setattr(ddp_config, CONFIG_ATTR, self)
        return ddp_config

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def read(ddp_config: Any) -> LayerWiseConfig | None:
    """The plugin config attached to ``ddp_config`` (``None``: megatron's own behaviour)."""
    found = getattr(ddp_config, CONFIG_ATTR, None) if ddp_config is not None else None
    return found if isinstance(found, LayerWiseConfig) else None


def is_compact(ddp_config: Any) -> bool:
    """Whether ``ddp_config`` asks for the compact layer-wise layout."""
    found = read(ddp_config)
    return found is not None and found.layout == "compact"


def gather_padding_tolerance(ddp_config: Any) -> float:
    found = read(ddp_config)
    return DEFAULT_GATHER_PADDING_TOLERANCE if found is None else found.gather_padding_tolerance


def grouped_weight_ownership(ddp_config: Any) -> str:
    found = read(ddp_config)
    return "whole" if found is None else found.grouped_weight_ownership


def qkv_ownership(ddp_config: Any) -> str:
    found = read(ddp_config)
    return "whole" if found is None else found.qkv_ownership


def grad_sync(ddp_config: Any) -> str:
    """How compact Muon gradients are synced (megatron's all-reduce when no config is attached)."""
    found = read(ddp_config)
    return "all_reduce" if found is None else found.grad_sync


def bucket_cap_numel(ddp_config: Any) -> int | None:
    found = read(ddp_config)
    return None if found is None else found.bucket_cap_numel
