"""Every configuration rule the plugin knows, in one place.

A rule looks at a flat view of the settings (:class:`Settings`, built from megatron's
``OptimizerConfig`` + ``DistributedDataParallelConfig``, from megatron-training ``args``, or by
hand) and returns a message when the combination is unsupported. :func:`check` raises
:class:`ConfigError` naming the flag and the fix; nothing is ever corrected silently.

Rules run when the configuration is finalised: in megatron-training's ``validate_args`` (patched),
and when the plugin's patched ``LayerWiseDistributedOptimizer`` is built. ``docs/guards.md`` lists
them; each has a test in ``tests/test_guards.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any


class ConfigError(ValueError):
    """An unsupported combination of settings, caught before training starts."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"[nemo_lw_fp8:{rule}] {message}")
        self.rule = rule


@dataclass(frozen=True)
class Settings:
    """The settings the rules read, under megatron's names (CLI flags in the messages)."""

    optimizer: str = "adam"
    use_layer_wise_distributed_optimizer: bool = False
    use_distributed_optimizer: bool = False
    #: How layer-wise buffers are laid out: "padded" (0.19.2's shard-aligned layout),
    #: "legacy" (no layout, flatten + all_gather), or "compact" (issue #5).
    layer_wise_layout: str = "padded"
    fp8_recipe: str | None = None
    fp8_param_gather: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    overlap_param_gather: bool = False
    bf16: bool = True
    num_distributed_optimizer_instances: int = 1
    #: megatron's own flag (True: a layer-wise param layout is computed; False: legacy path).
    use_layer_wise_param_layout: bool = True

    @property
    def layer_wise(self) -> bool:
        return self.use_layer_wise_distributed_optimizer or self.optimizer.startswith("dist_")

    @classmethod
    def from_megatron(cls, optimizer_config: Any, ddp_config: Any = None, **extra: Any) -> Settings:
        """Read the fields the rules need from megatron config objects (missing ones default)."""
        values: dict[str, Any] = {}
        for source in (ddp_config, optimizer_config):
            if source is None:
                continue
            for field in fields(cls):
                if hasattr(source, field.name):
                    values[field.name] = getattr(source, field.name)
        values.update(extra)
        return cls(**values)

    @classmethod
    def from_args(cls, args: Any) -> Settings:
        """Read megatron-training ``args`` (argparse namespace)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if hasattr(args, "use_layer_wise_param_layout") and "layer_wise_layout" not in values:
            values["layer_wise_layout"] = "padded" if args.use_layer_wise_param_layout else "legacy"
        return cls(**values)


@dataclass(frozen=True)
class Rule:
    name: str
    summary: str
    violated: Callable[[Settings], str | None]


def _fp8_gather_needs_reuse(s: Settings) -> str | None:
    mxfp8_gather = s.layer_wise and s.fp8_param_gather and s.fp8_recipe == "mxfp8"
    if mxfp8_gather and not s.reuse_grad_buf_for_mxfp8_param_ag:
        return (
            "layer-wise Muon with --fp8-param-gather and --fp8-recipe mxfp8 needs "
            "--reuse-grad-buf-for-mxfp8-param-ag (reuse_grad_buf_for_mxfp8_param_ag=True): "
            "the bf16 staging buffer for the MXFP8 all-gather is the idle grad buffer. "
            "Fix: add --reuse-grad-buf-for-mxfp8-param-ag, or drop --fp8-param-gather."
        )
    return None


#: Recipes whose layer-wise FP8 param gather is wired: MXFP8 (bf16 staged in the grad buffer,
#: muon_fp8_param_gather) and blockwise (FP8 codes + scales, blockwise_fp8_param_gather).
LAYER_WISE_FP8_GATHER_RECIPES = ("mxfp8", "blockwise")


def _fp8_gather_recipe(s: Settings) -> str | None:
    if s.layer_wise and s.fp8_param_gather and s.fp8_recipe not in LAYER_WISE_FP8_GATHER_RECIPES:
        return (
            f"layer-wise Muon with --fp8-param-gather supports --fp8-recipe mxfp8 (Blackwell) or "
            f"--fp8-recipe blockwise (Hopper) only, got {s.fp8_recipe!r}. Fix: use one of them, "
            "or drop --fp8-param-gather (FP8 compute with bf16 parameters works with any recipe)."
        )
    return None


def blockwise_reuse_message() -> str:
    return (
        "layer-wise Muon with --fp8-param-gather and --fp8-recipe blockwise ships FP8 codes and "
        "scales from each weight's owner and stages nothing in the grad buffer; "
        "--reuse-grad-buf-for-mxfp8-param-ag (reuse_grad_buf_for_mxfp8_param_ag=True) is "
        "MXFP8-only and would make megatron copy raw FP8 bytes as bf16 values. "
        "Fix: drop --reuse-grad-buf-for-mxfp8-param-ag."
    )


def _blockwise_gather_no_reuse(s: Settings) -> str | None:
    blockwise_gather = s.layer_wise and s.fp8_param_gather and s.fp8_recipe == "blockwise"
    if blockwise_gather and s.reuse_grad_buf_for_mxfp8_param_ag:
        return blockwise_reuse_message()
    return None


def _fp8_gather_layout(s: Settings) -> str | None:
    if s.layer_wise and s.fp8_param_gather and s.layer_wise_layout == "legacy":
        return (
            "layer-wise Muon with --fp8-param-gather needs a layer-wise param layout; the legacy "
            "path (--no-use-layer-wise-param-layout) flattens parameters, which MXFP8 and "
            "blockwise FP8 tensors cannot do. Fix: drop --no-use-layer-wise-param-layout."
        )
    return None


def _fp8_gather_bf16(s: Settings) -> str | None:
    if s.layer_wise and s.fp8_param_gather and not s.bf16:
        return (
            "layer-wise Muon with --fp8-param-gather needs --bf16: the fp32 masters are staged "
            "as bf16 for the all-gather. Fix: add --bf16."
        )
    return None


def _compact_single_instance(s: Settings) -> str | None:
    compact = s.layer_wise and s.layer_wise_layout == "compact"
    if compact and s.num_distributed_optimizer_instances != 1:
        return (
            f"layer_wise_layout='compact' needs one distributed-optimizer instance, got "
            f"--num-distributed-optimizer-instances {s.num_distributed_optimizer_instances}: "
            "Muon buffers all-reduce over the whole data-parallel group. Fix: set "
            "--num-distributed-optimizer-instances 1, or use layer_wise_layout='padded'."
        )
    return None


def _compact_needs_param_layout(s: Settings) -> str | None:
    if s.layer_wise and s.layer_wise_layout == "compact" and not s.use_layer_wise_param_layout:
        return (
            "layer_wise_layout='compact' is built from the layer-wise param layout, but "
            "--no-use-layer-wise-param-layout (use_layer_wise_param_layout=False) selects "
            "megatron's legacy path. Fix: drop --no-use-layer-wise-param-layout (keep "
            "use_layer_wise_param_layout=True), or use layer_wise_layout='legacy'."
        )
    return None


RULES: tuple[Rule, ...] = (
    Rule(
        "fp8-gather-needs-grad-buffer-reuse",
        "MXFP8 layer-wise gather stages in the grad buffer",
        _fp8_gather_needs_reuse,
    ),
    Rule(
        "fp8-gather-recipe",
        "layer-wise FP8 gather supports MXFP8 and blockwise",
        _fp8_gather_recipe,
    ),
    Rule(
        "blockwise-gather-no-grad-buffer-reuse",
        "blockwise layer-wise gather ships FP8 bytes, no grad-buffer staging",
        _blockwise_gather_no_reuse,
    ),
    Rule("fp8-gather-layout", "layer-wise FP8 gather needs a param layout", _fp8_gather_layout),
    Rule("fp8-gather-bf16", "layer-wise FP8 gather needs bf16 training", _fp8_gather_bf16),
    Rule(
        "compact-single-instance",
        "compact layout needs one distributed-optimizer instance",
        _compact_single_instance,
    ),
    Rule(
        "compact-needs-param-layout",
        "compact layout needs use_layer_wise_param_layout=True",
        _compact_needs_param_layout,
    ),
)


def violations(settings: Settings) -> list[tuple[str, str]]:
    """Every rule the settings break, as ``(rule, message)``."""
    found = []
    for rule in RULES:
        message = rule.violated(settings)
        if message:
            found.append((rule.name, message))
    return found


def check(settings: Settings) -> None:
    """Raise :class:`ConfigError` for the first rule the settings break."""
    found = violations(settings)
    if found:
        rule, message = found[0]
        raise ConfigError(rule, message)
