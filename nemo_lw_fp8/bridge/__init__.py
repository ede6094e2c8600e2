"""Megatron-Bridge integration: layer-wise Muon + FP8 param gather from Bridge configs.

Guarded optional integration: importing this package needs Megatron-Bridge 0.6.2 (``pip install
'nemo-lw-fp8[bridge]'``); without it, :func:`require_bridge` raises an ``ImportError`` naming the
install command. Nothing in the core plugin imports this package.

Pieces:

* :class:`LayerWiseMuonConfig` / :func:`layer_wise_muon_fp8_with_cosine_annealing`: the optimizer
  factory, in the style of Bridge's ``recipes/utils/optimizer_utils.py``. The config is Bridge's
  ``OptimizerConfig`` plus the plugin's two layout fields; Bridge's ``setup_optimizer`` calls its
  ``provide()`` hook, which applies the plugin's patches and builds megatron's layer-wise Muon.
* :func:`finalize`: run when the ``ConfigContainer`` is validated (patched into
  ``ConfigContainer.validate`` by ``patches/bridge_config_guards.py``, and called by the plugin's
  launchers): applies the patches, runs every guard of :mod:`nemo_lw_fp8.rules` on the whole
  container, and hands the layout to the DDP config.
* :func:`settings_from_config`: the flat guard view of a ``ConfigContainer``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

BRIDGE_VERSION = "0.6.2"
INSTALL_HINT = "pip install 'nemo-lw-fp8[bridge]' (Megatron-Bridge 0.6.2, nemo-run 0.11.1)"


def require_bridge() -> None:
    """Fail with an actionable message when Megatron-Bridge is not installed."""
    try:
        import megatron.bridge  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"this feature needs Megatron-Bridge: {INSTALL_HINT}. ({error})"
        ) from error


require_bridge()

from megatron.bridge.training.config import (  # noqa: E402
    OptimizerConfig as _BridgeOptimizerConfig,
)
from megatron.bridge.training.config import SchedulerConfig  # noqa: E402

from nemo_lw_fp8.config import (  # noqa: E402
    DEFAULT_GATHER_PADDING_TOLERANCE,
    LAYER_WISE_LAYOUTS,
    LayerWiseConfig,
)
from nemo_lw_fp8.vocabulary import SINGLE_GROUPED_WEIGHT_ENV  # noqa: E402

LAYOUTS = LAYER_WISE_LAYOUTS


@dataclasses.dataclass
class LayerWiseMuonConfig(_BridgeOptimizerConfig):
    """Bridge's ``OptimizerConfig`` for layer-wise Muon, plus the plugin's settings.

    These fields are :class:`nemo_lw_fp8.LayerWiseConfig`'s, flat so that YAML and
    ``key=value`` overrides reach them (``optimizer.layer_wise_layout=padded``):
    ``layer_wise_layout`` (its ``layout``), ``gather_padding_tolerance``,
    ``grouped_weight_ownership``, ``qkv_ownership``, ``layer_wise_grad_sync`` (its
    ``grad_sync``) and ``bucket_cap_numel``; :meth:`plugin_config` builds and checks the object.
    """

    layer_wise_layout: str = LayerWiseConfig.layout
    gather_padding_tolerance: float = DEFAULT_GATHER_PADDING_TOLERANCE
    grouped_weight_ownership: str = LayerWiseConfig.grouped_weight_ownership
    qkv_ownership: str = LayerWiseConfig.qkv_ownership
    layer_wise_grad_sync: str = LayerWiseConfig.grad_sync
    bucket_cap_numel: int | None = LayerWiseConfig.bucket_cap_numel

    def plugin_config(self) -> LayerWiseConfig:
        """The plugin's settings as one checked object (raises ``ConfigError`` when bad)."""
        return LayerWiseConfig(
            layout=self.layer_wise_layout,
            gather_padding_tolerance=self.gather_padding_tolerance,
            grouped_weight_ownership=self.grouped_weight_ownership,
            qkv_ownership=self.qkv_ownership,
            grad_sync=self.layer_wise_grad_sync,
            bucket_cap_numel=self.bucket_cap_numel,
        )

    def provide(
        self,
        model_chunks: Any,
        config_overrides: Any = None,
        use_gloo_process_groups: bool = False,
        pg_collection: Any = None,
    ) -> Any:
        """Bridge's optimizer hook: patch megatron, check the rules, build layer-wise Muon."""
        from megatron.core.optimizer.muon import get_megatron_muon_optimizer

        import nemo_lw_fp8

        # The rules ran on the whole container in finalize(); they run again, on what megatron
        # built, when the layer-wise optimizer is made (patches/muon_fp8_param_gather.py).
        nemo_lw_fp8.apply()
        return get_megatron_muon_optimizer(
            config=self,
            model_chunks=model_chunks,
            config_overrides=config_overrides,
            use_gloo_process_groups=use_gloo_process_groups,
            layer_wise_distributed_optimizer=True,
            pg_collection=pg_collection,
        )

    def _layout_settings(self) -> dict[str, Any]:
        """The plugin fields in the guards' names (unchecked: the guards report bad values)."""
        return {
            "layer_wise_layout": self.layer_wise_layout,
            "use_layer_wise_param_layout": self.layer_wise_layout != "legacy",
            "gather_padding_tolerance": self.gather_padding_tolerance,
            "grouped_weight_ownership": self.grouped_weight_ownership,
            "qkv_ownership": self.qkv_ownership,
            "layer_wise_grad_sync": self.layer_wise_grad_sync,
            "bucket_cap_numel": self.bucket_cap_numel,
        }


#: megatron-core 0.19.2's Newton-Schulz modes for TP-sharded matrices (``muon_tp_mode``).
MUON_TP_MODES = ("duplicated", "blockwise", "distributed")


def layer_wise_muon_fp8_with_cosine_annealing(
    *,
    max_lr: float = 2e-4,
    min_lr: float | None = None,
    lr_warmup_iters: int = 2000,
    lr_decay_iters: int | None = None,
    weight_decay: float = 0.1,
    clip_grad: float = 1.0,
    muon_momentum: float = 0.95,
    muon_use_nesterov: bool = True,
    muon_scale_mode: str = "spectral",
    muon_num_ns_steps: int = 5,
    muon_extra_scale_factor: float = 1.0,
    muon_scalar_optimizer: str = "adam",
    muon_tp_mode: str = "duplicated",
    layer_wise_layout: str = LayerWiseConfig.layout,
    gather_padding_tolerance: float = DEFAULT_GATHER_PADDING_TOLERANCE,
    grouped_weight_ownership: str = LayerWiseConfig.grouped_weight_ownership,
    qkv_ownership: str = LayerWiseConfig.qkv_ownership,
    layer_wise_grad_sync: str = LayerWiseConfig.grad_sync,
    overlap_param_gather: bool = True,
    start_weight_decay: float = 0.033,
    end_weight_decay: float = 0.033,
) -> tuple[LayerWiseMuonConfig, SchedulerConfig]:
    """Optimizer + scheduler configs for layer-wise Muon with FP8 param gather.

    The FP8 settings themselves (``fp8_recipe``, ``fp8_param_gather``, grad-buffer reuse) come
    from the recipe's mixed-precision preset, as everywhere in Megatron-Bridge; this factory
    chooses the optimizer, the layer-wise layout and overlapped param gather. ``min_lr``
    defaults to a tenth of ``max_lr`` (Bridge's Muon helper leaves it ``None``, which its
    scheduler rejects).

    ``muon_tp_mode`` is megatron's ``OptimizerConfig.muon_tp_mode`` with the plugin's default,
    ``"duplicated"``: a TP-sharded matrix is gathered over TP, orthogonalized whole and sliced,
    so the update does not depend on the TP size (megatron's default, ``"blockwise"``,
    orthogonalizes each shard alone; ``"distributed"`` shards the Newton-Schulz matmuls and is
    TP-invariant up to their summation order). ``docs/compact-layout.md``.
    """
    if muon_tp_mode not in MUON_TP_MODES:
        raise ValueError(f"muon_tp_mode={muon_tp_mode!r}: one of {MUON_TP_MODES}")
    optimizer = LayerWiseMuonConfig(
        optimizer="dist_muon",
        lr=max_lr,
        min_lr=0.1 * max_lr if min_lr is None else min_lr,
        weight_decay=weight_decay,
        bf16=True,
        fp16=False,
        clip_grad=clip_grad,
        muon_momentum=muon_momentum,
        muon_nesterov=muon_use_nesterov,
        muon_scale_mode=muon_scale_mode,
        muon_num_ns_steps=muon_num_ns_steps,
        muon_extra_scale_factor=muon_extra_scale_factor,
        muon_scalar_optimizer=muon_scalar_optimizer,
        muon_tp_mode=muon_tp_mode,
        use_distributed_optimizer=False,
        use_layer_wise_distributed_optimizer=True,
        overlap_param_gather=overlap_param_gather,
        layer_wise_layout=layer_wise_layout,
        gather_padding_tolerance=gather_padding_tolerance,
        grouped_weight_ownership=grouped_weight_ownership,
        qkv_ownership=qkv_ownership,
        layer_wise_grad_sync=layer_wise_grad_sync,
    )
    optimizer.plugin_config()  # a bad layout / tolerance / ownership fails here, naming the fix
    scheduler = SchedulerConfig(
        start_weight_decay=start_weight_decay,
        end_weight_decay=end_weight_decay,
        weight_decay_incr_style="constant",
        lr_decay_style="cosine",
        lr_warmup_iters=lr_warmup_iters,
        lr_warmup_init=0.0,
        lr_decay_iters=lr_decay_iters,
        override_opt_param_scheduler=True,
    )
    return optimizer, scheduler


def uses_plugin(cfg: Any) -> bool:
    """Whether a ``ConfigContainer`` asks for the plugin (its optimizer is ours)."""
    return isinstance(getattr(cfg, "optimizer", None), LayerWiseMuonConfig)


def is_hf_directory(path: str | None) -> bool:
    """Whether ``path`` is a Hugging Face model directory (what Bridge's
    ``is_hf_checkpoint_dir`` loads through its name mapping): a ``config.json`` beside
    safetensors or ``pytorch_model`` weight files."""
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return False
    names = os.listdir(path)
    return any(n.endswith(".safetensors") or n.startswith("pytorch_model") for n in names)


def settings_from_config(cfg: Any) -> Any:
    """The guards' flat view of a Bridge ``ConfigContainer`` (model, ddp, optimizer, precision)."""
    from nemo_lw_fp8 import rules as guards

    names = {f.name for f in dataclasses.fields(guards.Settings)} - {"sources"}
    values: dict[str, Any] = {}
    mixed = cfg.mixed_precision if not isinstance(cfg.mixed_precision, str) else None
    # Bridge copies the mixed-precision preset onto model, DDP and optimizer configs before it
    # validates, so the preset wins over their own (default) FP8 fields.
    sources = (cfg.model, cfg.ddp, cfg.optimizer, mixed, getattr(cfg, "logger", None),
               getattr(cfg, "checkpoint", None))
    for source in sources:
        if source is None:
            continue
        for name in names:
            if hasattr(source, name):
                values[name] = getattr(source, name)
    # Bridge keeps a recipe name even with FP8 / FP4 off ("tensorwise", "nvfp4"); the rules
    # read a recipe only when the format is on.
    if getattr(cfg.model, "fp8", None) is None and not getattr(mixed, "fp8", None):
        values["fp8_recipe"] = None
    if getattr(cfg.model, "fp4", None) is None and not getattr(mixed, "fp4", None):
        values["fp4_recipe"] = None
    optimizer = cfg.optimizer
    if isinstance(optimizer, LayerWiseMuonConfig):
        values.update(optimizer._layout_settings())
    values["use_distributed_optimizer"] = bool(getattr(cfg.ddp, "use_distributed_optimizer", False))
    values["ddp_overlap_param_gather"] = bool(getattr(cfg.ddp, "overlap_param_gather", False))
    # TE's switch: Bridge exports cfg.env_vars before it builds (values already in the process
    # environment win), so the rule sees what the model build will see.
    pretrained = getattr(getattr(cfg, "checkpoint", None), "pretrained_checkpoint", None)
    values["pretrained_checkpoint_is_hf"] = is_hf_directory(pretrained)
    switch = SINGLE_GROUPED_WEIGHT_ENV
    if switch not in os.environ and switch in getattr(cfg, "env_vars", {}):
        values["grouped_linear_single_param"] = str(cfg.env_vars[switch]) == "1"
    return guards.Settings(**values)


def finalize(cfg: Any) -> Any:
    """Apply the patches, check every rule on ``cfg``, hand the layout to the DDP config.

    Idempotent; raises :class:`nemo_lw_fp8.rules.ConfigError` for an unsupported combination
    (nothing is corrected silently).
    """
    import nemo_lw_fp8
    from nemo_lw_fp8 import rules as guards

    if not uses_plugin(cfg):
        return cfg
    nemo_lw_fp8.apply()
    guards.check(settings_from_config(cfg))
    cfg.optimizer.plugin_config().attach(cfg.ddp)
    return cfg


__all__ = [
    "BRIDGE_VERSION",
    "LAYOUTS",
    "LayerWiseConfig",
    "LayerWiseMuonConfig",
    "finalize",
    "layer_wise_muon_fp8_with_cosine_annealing",
    "require_bridge",
    "settings_from_config",
    "uses_plugin",
]
