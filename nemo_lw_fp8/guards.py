"""Every configuration rule the plugin knows, in one place.

A rule looks at a flat view of the settings (:class:`Settings`, built from megatron's
``OptimizerConfig`` + ``DistributedDataParallelConfig``, from megatron-training ``args``, or by
hand) and returns a message when the combination is unsupported. :func:`check` raises
:class:`ConfigError` naming the flag and the fix; nothing is ever corrected silently.

Rules run when the configuration is finalised: in megatron-training's ``validate_args`` (patched),
and when the plugin's patched ``LayerWiseDistributedOptimizer`` is built. ``docs/guards.md`` lists
them; each has a test in ``tests/test_guards.py``. The rules on loading a checkpoint another run
wrote are in :mod:`nemo_lw_fp8.checkpoint_guards` and importable from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from . import scope_guards

# The checkpoint-load rules: a module of their own, listed here with every other rule.
from .checkpoint_guards import CHECKPOINT_FIXED_FIELDS as CHECKPOINT_FIXED_FIELDS
from .checkpoint_guards import CHECKPOINT_RULES as CHECKPOINT_RULES
from .checkpoint_guards import checkpoint_mismatch as checkpoint_mismatch
from .checkpoint_guards import checkpoint_missing_files as checkpoint_missing_files
from .checkpoint_guards import checkpoint_truncated_files as checkpoint_truncated_files
from .layout import (
    DEFAULT_GATHER_PADDING_TOLERANCE,
    GRAD_SYNC_MODES,
    GROUPED_WEIGHT_OWNERSHIP,
    LAYER_WISE_LAYOUTS,
    QKV_OWNERSHIP,
)


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
    # --- single grouped expert weights (#5464, issue 6) ---
    #: TransformerConfig / args: TE's one GroupedTensor per expert linear.
    moe_single_grouped_weight: bool = False
    use_megatron_fsdp: bool = False
    use_torch_fsdp2: bool = False
    #: "fp4" recipe name (megatron's ``fp4_recipe`` when ``--fp4-format`` is set), else None.
    fp4_recipe: str | None = None
    #: Transformer Engine version; None: the installed one (read without importing TE).
    te_version: str | None = None
    #: TE's switch ``NVTE_GROUPED_LINEAR_SINGLE_PARAM``; None: read the environment.
    grouped_linear_single_param: bool | None = None
    moe_grouped_gemm: bool = True
    use_transformer_engine_op_fuser: bool = True
    # --- the launch environment of TE's op-fuser experts (issue 28; docs/recipes.md) ---
    #: TransformerConfig: MoE experts (None / 0: a dense model).
    num_moe_experts: int | None = None
    #: TransformerConfig: gated experts (SwiGLU with ``activation_func`` silu).
    gated_linear_unit: bool = False
    #: TransformerConfig: the activation (a function, or its name).
    activation_func: Any = None
    #: TE / megatron switch ``NVTE_CUTEDSL_FUSED_GROUPED_MLP``; None: read the environment
    #: (where only a value set to 0 is refused: unset, the recipe's env_vars may still give it).
    cutedsl_fused_grouped_mlp: bool | None = None
    # --- recipes and launchers (issue 7); None = not known at this call site ---
    #: FP8 format (``--fp8-format`` / Bridge ``fp8``); None when FP8 is off.
    fp8: str | None = None
    tensor_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    #: The DDP config's ``overlap_param_gather`` when it can differ from the optimizer's.
    ddp_overlap_param_gather: bool | None = None
    overlap_param_gather_with_optimizer_step: bool = False
    optimizer_cpu_offload: bool = False
    gather_padding_tolerance: float = DEFAULT_GATHER_PADDING_TOLERANCE
    #: Compact layout: how a single grouped weight is owned ("whole", "expert", "auto").
    grouped_weight_ownership: str = "whole"
    #: Fused QKV weights owned as their Q, K, V parts ("split"), "whole", or "auto" (split on the
    #: compact layout unless the weights are blockwise FP8; layout.resolve_qkv_ownership).
    qkv_ownership: str = "auto"
    #: Compact layout: how Muon gradients are synced ("reduce_to_owner", "all_reduce").
    layer_wise_grad_sync: str = "reduce_to_owner"
    #: Bridge's ``logger.log_l2_norm_grad_to_tensorboard``: logs every parameter's main_grad.
    log_l2_norm_grad_to_tensorboard: bool = False
    #: Compact layout: cap on a layer-wise bucket's closing threshold (None: no cap).
    bucket_cap_numel: int | None = None
    #: ``OptimizerConfig.fp8_recipe`` when the recipe itself was read elsewhere (the parameters'
    #: types, ``TransformerConfig``); None: not set or not known at this call site.
    optimizer_fp8_recipe: str | None = None
    #: TransformerConfig / ``--context-parallel-size`` (rule ``layer-wise-context-parallel``).
    context_parallel_size: int = 1
    #: Bridge ``checkpoint.ckpt_format`` / ``--ckpt-format``; None: not known at this call site.
    ckpt_format: str | None = None
    #: Where each value was read (``(field, "DistributedDataParallelConfig.fp8_param_gather")``
    #: pairs); a rule's message names the sources of the fields it read. Empty: not recorded.
    sources: tuple[tuple[str, str], ...] = ()

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
                if field.name != "sources" and hasattr(source, field.name):
                    values[field.name] = getattr(source, field.name)
        values.update(extra)
        return cls(**values)

    @classmethod
    def from_args(cls, args: Any) -> Settings:
        """Read megatron-training ``args`` (argparse namespace)."""
        values = {
            f.name: getattr(args, f.name)
            for f in fields(cls)
            if f.name != "sources" and hasattr(args, f.name)
        }
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
    recipe_known = s.fp8_recipe is not None or s.fp8 is not None  # else fp8-gather-without-fp8
    wrong_recipe = s.fp8_recipe not in LAYER_WISE_FP8_GATHER_RECIPES
    if s.layer_wise and s.fp8_param_gather and recipe_known and wrong_recipe:
        return (
            f"layer-wise Muon with --fp8-param-gather supports --fp8-recipe mxfp8 (Blackwell) or "
            f"--fp8-recipe blockwise (Hopper) only, got {s.fp8_recipe!r}. Fix: use one of them, "
            "or drop --fp8-param-gather (FP8 compute with bf16 parameters works with any recipe)."
        )
    return None


def _fp8_recipe_agreement(s: Settings) -> str | None:
    recipes = (s.optimizer_fp8_recipe, s.fp8_recipe)
    if s.layer_wise and all(recipes) and recipes[0] != recipes[1]:
        return (
            f"the optimizer config says fp8_recipe={s.optimizer_fp8_recipe!r}, but the model's FP8 "
            f"parameters are built for {s.fp8_recipe!r}: megatron's optimizer and the plugin's "
            f"param gather would each follow a different recipe. Fix: --fp8-recipe "
            f"{s.fp8_recipe} (OptimizerConfig.fp8_recipe={s.fp8_recipe!r}), or leave the "
            "optimizer's fp8_recipe unset."
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
        "fp8-recipe-agreement",
        "the optimizer's fp8_recipe matches the parameters' recipe",
        _fp8_recipe_agreement,
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


# --------------------------------------------------------------------------- single grouped
# expert weights (#5464, issue 6; docs/moe-grouped-weights.md)

#: TE's switch; without it TE's GroupedLinear silently builds discrete weights.
GROUPED_SINGLE_PARAM_ENV = "NVTE_GROUPED_LINEAR_SINGLE_PARAM"
#: First TE with ``GroupedLinear(single_grouped_weight=...)`` (megatron-core 0.19.2's own floor).
GROUPED_WEIGHT_MIN_TE = "2.14.0"


def _installed_te_version() -> str | None:
    from importlib import metadata

    for dist in ("transformer_engine", "transformer-engine"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _grouped_fsdp(s: Settings) -> str | None:
    if s.moe_single_grouped_weight and (s.use_megatron_fsdp or s.use_torch_fsdp2):
        flag = "--use-megatron-fsdp" if s.use_megatron_fsdp else "--use-torch-fsdp2"
        return (
            f"--moe-single-grouped-weight with {flag}: FSDP shards parameters by element ranges "
            "and cannot hold TE's GroupedTensor (its storage lives in member tensors and scale "
            "buffers, not in the parameter); megatron-core 0.19.2 has no FSDP support for it. "
            f"Fix: drop {flag} (use DDP with the distributed or layer-wise optimizer), or drop "
            "--moe-single-grouped-weight."
        )
    return None


def _grouped_mxfp8_primary_needs_reuse(s: Settings) -> str | None:
    mxfp8_primary = s.fp8_param_gather and s.fp8_recipe == "mxfp8"
    if s.moe_single_grouped_weight and mxfp8_primary and not s.reuse_grad_buf_for_mxfp8_param_ag:
        return (
            "--moe-single-grouped-weight with MXFP8 primary weights (--fp8-param-gather, "
            "--fp8-recipe mxfp8) needs --reuse-grad-buf-for-mxfp8-param-ag: a grouped MXFP8 "
            "weight cannot be remapped into DDP's param buffer, so the all-gather stages bf16 in "
            "the idle grad buffer and re-quantizes each expert after it. "
            "Fix: add --reuse-grad-buf-for-mxfp8-param-ag."
        )
    return None


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _grouped_te_version(s: Settings) -> str | None:
    if not s.moe_single_grouped_weight:
        return None
    version = s.te_version or _installed_te_version()
    if version is None or _version_tuple(version) < _version_tuple(GROUPED_WEIGHT_MIN_TE):
        found = "no Transformer Engine" if version is None else f"transformer-engine {version}"
        return (
            f"--moe-single-grouped-weight needs transformer-engine >= {GROUPED_WEIGHT_MIN_TE} "
            f"(GroupedLinear(single_grouped_weight=True)); found {found}. "
            f"Fix: install transformer-engine >= {GROUPED_WEIGHT_MIN_TE} (tested: 2.20.2), or "
            "drop --moe-single-grouped-weight."
        )
    return None


def _grouped_te_switch(s: Settings) -> str | None:
    if not s.moe_single_grouped_weight:
        return None
    enabled = s.grouped_linear_single_param
    if enabled is None:
        import os

        try:
            enabled = int(os.environ.get(GROUPED_SINGLE_PARAM_ENV, "0")) > 0
        except ValueError:
            enabled = False
    if not enabled:
        return (
            f"--moe-single-grouped-weight is set but {GROUPED_SINGLE_PARAM_ENV} is not: "
            "Transformer Engine then silently builds E discrete expert weights (only a "
            "UserWarning), so the run would not use what it was configured for. "
            f"Fix: export {GROUPED_SINGLE_PARAM_ENV}=1 on every rank, or drop "
            "--moe-single-grouped-weight."
        )
    return None


def _grouped_nvfp4_layer_wise(s: Settings) -> str | None:
    if s.moe_single_grouped_weight and s.layer_wise and s.fp4_recipe:
        return (
            f"--moe-single-grouped-weight with layer-wise Muon and --fp4-recipe {s.fp4_recipe} is "
            "not verified: the plugin's per-expert Muon is tested bitwise on CPU for bf16 and "
            "MXFP8 only, and the CPU emulation of Transformer Engine has no NVFP4 kernels, so "
            "the NVFP4 grouped path (packed rowwise bytes in DDP's param buffer) has never run "
            "under layer-wise Muon. Fix: use --fp8-recipe mxfp8 or bf16 for the experts, or "
            "--moe-single-grouped-weight off (discrete expert weights)."
        )
    return None


GROUPED_WEIGHT_RULES: tuple[Rule, ...] = (
    Rule(
        "grouped-weight-fsdp", "single grouped expert weights do not work with FSDP", _grouped_fsdp
    ),
    Rule(
        "grouped-weight-mxfp8-primary-needs-reuse",
        "grouped MXFP8 primary weights stage their gather in the grad buffer",
        _grouped_mxfp8_primary_needs_reuse,
    ),
    Rule(
        "grouped-weight-te-version", "single grouped weights need TE >= 2.14", _grouped_te_version
    ),
    Rule(
        "grouped-weight-te-switch",
        "single grouped weights need NVTE_GROUPED_LINEAR_SINGLE_PARAM=1",
        _grouped_te_switch,
    ),
    Rule(
        "grouped-weight-nvfp4-layer-wise",
        "NVFP4 grouped weights under layer-wise Muon are unverified",
        _grouped_nvfp4_layer_wise,
    ),
)
RULES = RULES + GROUPED_WEIGHT_RULES


# --------------------------------------------------------------------------- the launch
# environment TE's op-fuser experts need (issue 28; docs/recipes.md, "Launch environment")

#: megatron-core 0.19.2 builds op-fuser GLU experts only with this set (TE's CuTe-DSL switch).
CUTEDSL_ENV = "NVTE_CUTEDSL_FUSED_GROUPED_MLP"


def _env_flag(value: bool | None, name: str) -> bool | None:
    """``value`` when given, else the environment's ``name`` (None: unset)."""
    if value is not None:
        return value
    import os

    text = os.environ.get(name)
    if text is None:
        return None
    try:
        return int(text) > 0
    except ValueError:
        return False


def _op_fuser_glu_env(s: Settings) -> str | None:
    activation = s.activation_func
    name = activation if isinstance(activation, str) else getattr(activation, "__name__", None)
    glu = s.gated_linear_unit and name in ("silu", "quick_gelu")
    fused = s.num_moe_experts and s.moe_grouped_gemm and s.use_transformer_engine_op_fuser
    # Unset in the environment and not given: not a contradiction here, the recipe's env_vars
    # (exported by Bridge before it builds) or the launchers may still set it; the launchers
    # pass what they export (launch/te_env.py, check_environment).
    if not (glu and fused) or _env_flag(s.cutedsl_fused_grouped_mlp, CUTEDSL_ENV) is not False:
        return None
    return (
        f"MoE experts with {name} GLU through TE's op fuser "
        f"(model.use_transformer_engine_op_fuser=True) need {CUTEDSL_ENV}=1 in the launch "
        "environment: without it megatron-core 0.19.2's TEGroupedMLP asserts 'Fused GroupedMLP "
        "is not supported for this configuration.' at model build (_is_fused_impl_supported). "
        f"Fix: export {CUTEDSL_ENV}=1 on every rank before transformer_engine is imported "
        "(nemo-lw-fp8 pretrain, nemo llm pretrain, nemo-lw-fp8 slurm and the recipes' env_vars "
        f"set it; remove a {CUTEDSL_ENV}=0 from the environment or --env), or set "
        "model.use_transformer_engine_op_fuser=False with discrete expert weights."
    )


LAUNCH_ENV_RULES: tuple[Rule, ...] = (
    Rule(
        "op-fuser-glu-experts-env",
        f"op-fuser GLU experts need {CUTEDSL_ENV}=1",
        _op_fuser_glu_env,
    ),
)


# --------------------------------------------------------------------------- recipes and
# launchers (issue 7): what a Megatron-Bridge config can combine (docs/recipes.md)


def _grouped_needs_grouped_gemm(s: Settings) -> str | None:
    if s.moe_single_grouped_weight and not s.moe_grouped_gemm:
        return (
            "--moe-single-grouped-weight needs --moe-grouped-gemm (model.moe_grouped_gemm=True): "
            "the single grouped weight belongs to TE's grouped GEMM experts. Fix: set "
            "model.moe_grouped_gemm=True, or drop --moe-single-grouped-weight."
        )
    return None


def _grouped_needs_op_fuser(s: Settings) -> str | None:
    if s.moe_single_grouped_weight and not s.use_transformer_engine_op_fuser:
        return (
            "--moe-single-grouped-weight needs model.use_transformer_engine_op_fuser=True: "
            "megatron-core 0.19.2 trains one grouped parameter only through TE's op fuser. Fix: "
            "set model.use_transformer_engine_op_fuser=True, or drop --moe-single-grouped-weight."
        )
    return None


def _fp8_gather_without_fp8(s: Settings) -> str | None:
    if s.layer_wise and s.fp8_param_gather and s.fp8 is None and s.fp8_recipe is None:
        return (
            "--fp8-param-gather is set but FP8 is off (no --fp8-format): there are no FP8 "
            "parameters to gather. Fix: choose mixed_precision=bf16_with_mxfp8_mixed (Blackwell) "
            "or a blockwise FP8 preset (Hopper), or set mixed_precision.fp8_param_gather=false."
        )
    return None


def _fp8_gather_tensor_parallel(s: Settings) -> str | None:
    tp = max(s.tensor_model_parallel_size, s.expert_tensor_parallel_size or 1)
    if s.layer_wise and s.fp8_param_gather and tp > 1:
        return (
            f"layer-wise Muon with --fp8-param-gather is verified with whole matrices per rank "
            f"only (tensor / expert-tensor parallel 1), got TP={s.tensor_model_parallel_size}, "
            f"ETP={s.expert_tensor_parallel_size}: a TP shard's FP8 scales and Muon's "
            "orthogonalisation both need the whole matrix. Fix: set "
            "model.tensor_model_parallel_size=1 and model.expert_tensor_parallel_size=1 (use "
            "PP / EP for memory), or drop --fp8-param-gather."
        )
    return None


def _overlap_agreement(s: Settings) -> str | None:
    ddp = s.ddp_overlap_param_gather
    if s.layer_wise and ddp is not None and ddp != s.overlap_param_gather:
        return (
            f"ddp.overlap_param_gather={ddp} but optimizer.overlap_param_gather="
            f"{s.overlap_param_gather}: Megatron-Bridge would silently switch both on; the plugin "
            "does not guess which one you meant. Fix: set both to the same value."
        )
    return None


def _layer_wise_fsdp(s: Settings) -> str | None:
    if s.layer_wise and (s.use_megatron_fsdp or s.use_torch_fsdp2):
        return (
            "layer-wise Muon gives each data-parallel rank whole matrices; FSDP shards every "
            "parameter by element ranges instead. Fix: set ddp.use_megatron_fsdp=false (and no "
            "torch FSDP2), or use Adam with the distributed optimizer for FSDP runs."
        )
    return None


def _layer_wise_overlap_with_step(s: Settings) -> str | None:
    if s.layer_wise and s.overlap_param_gather_with_optimizer_step:
        return (
            "--overlap-param-gather-with-optimizer-step is a distributed-optimizer (Adam) feature "
            "for interleaved pipelines; layer-wise Muon gathers from each matrix's owner after its "
            "step. Fix: drop --overlap-param-gather-with-optimizer-step (keep "
            "--overlap-param-gather)."
        )
    return None


def _layer_wise_cpu_offload(s: Settings) -> str | None:
    if s.layer_wise and s.optimizer_cpu_offload:
        return (
            "--optimizer-cpu-offload is implemented for the distributed optimizer (Adam) only; "
            "layer-wise Muon keeps masters and momentum on the GPU. Fix: drop "
            "--optimizer-cpu-offload, or use PP / EP to reduce per-rank optimizer memory."
        )
    return None


def _layout_value(s: Settings) -> str | None:
    if s.layer_wise and s.layer_wise_layout not in LAYER_WISE_LAYOUTS:
        return (
            f"layer_wise_layout={s.layer_wise_layout!r} is not a layout. Fix: use 'compact' "
            "(no padding, the plugin's default), 'padded' (megatron 0.19.2's) or 'legacy'."
        )
    return None


def _grouped_blockwise_gather(s: Settings) -> str | None:
    blockwise_gather = s.layer_wise and s.fp8_param_gather and s.fp8_recipe == "blockwise"
    if blockwise_gather and s.moe_single_grouped_weight:
        return (
            "--moe-single-grouped-weight with layer-wise Muon and blockwise FP8 param gather is "
            "not supported: the blockwise gather ships each weight's FP8 codes and 128x128 tile "
            "scales, and a single grouped weight is one GroupedTensor whose per-expert blockwise "
            "members it does not handle. Fix: discrete expert weights "
            "(model.moe_single_grouped_weight=false), or MXFP8 (Blackwell), or no FP8 gather."
        )
    return None


def _padding_tolerance(s: Settings) -> str | None:
    if s.layer_wise and s.layer_wise_layout == "compact" and not s.gather_padding_tolerance >= 0:
        return (
            f"gather_padding_tolerance={s.gather_padding_tolerance} must be >= 0 (a fraction of "
            "the gathered payload; inf always takes the even all_gather). Fix: use e.g. 0.1."
        )
    return None


def _bucket_cap(s: Settings) -> str | None:
    cap = s.bucket_cap_numel
    bad = isinstance(cap, bool) or not isinstance(cap, int) or cap < 0
    if s.layer_wise and cap is not None and bad:
        return (
            f"bucket_cap_numel={cap!r} must be None (buckets end where the padded layout ends "
            "them) or an element count >= 0 (0: megatron's plain bucket_size). Fix: leave it "
            "unset, or use e.g. 500000000."
        )
    return None


def _ownership_value(s: Settings) -> str | None:
    if s.layer_wise and s.grouped_weight_ownership not in GROUPED_WEIGHT_OWNERSHIP:
        return (
            f"grouped_weight_ownership={s.grouped_weight_ownership!r} is not an ownership mode. "
            "Fix: use 'whole' (one rank per grouped weight), 'expert' or 'auto'."
        )
    return None


def _qkv_ownership_value(s: Settings) -> str | None:
    if s.layer_wise and s.qkv_ownership not in QKV_OWNERSHIP:
        return (
            f"qkv_ownership={s.qkv_ownership!r} is not an ownership mode. Fix: use 'auto' (the "
            "default: parts owned apart where the layout can), 'split' or 'whole'."
        )
    return None


def _qkv_split_needs_compact(s: Settings) -> str | None:
    if s.layer_wise and s.qkv_ownership == "split" and s.layer_wise_layout != "compact":
        return (
            f"qkv_ownership='split' owns a fused linear_qkv weight's Q, K and V parts apart, "
            f"which only the compact layout can; the {s.layer_wise_layout!r} layout owns whole "
            "parameters, so the setting would be dropped. Fix: qkv_ownership='auto' (the "
            "default) or 'whole', or layer_wise_layout='compact'."
        )
    return None


def qkv_split_blockwise_message() -> str:
    """The refusal of an explicit ``qkv_ownership='split'`` on blockwise FP8 weights (also raised
    by the compact layout when it finds the model blockwise, mechanics/compact.py)."""
    return (
        "qkv_ownership='split' with --fp8-recipe blockwise: a blockwise FP8 weight's owner "
        "quantizes whole 128x128 tiles, which span the Q, K and V parts, so its parts cannot be "
        "owned apart and the setting would be dropped. Fix: qkv_ownership='auto' (the default: "
        "whole for blockwise weights) or 'whole'."
    )


def _qkv_split_blockwise(s: Settings) -> str | None:
    if s.layer_wise and s.qkv_ownership == "split" and s.fp8_recipe == "blockwise":
        return qkv_split_blockwise_message()
    return None


def _split_ownership_needs_compact(s: Settings) -> str | None:
    split = s.grouped_weight_ownership in ("expert", "auto")
    if s.layer_wise and split and s.layer_wise_layout != "compact":
        return (
            f"grouped_weight_ownership={s.grouped_weight_ownership!r} splits grouped weights "
            "into expert runs, which only the compact layout can gather; the "
            f"{s.layer_wise_layout!r} layout owns whole parameters. Fix: "
            "layer_wise_layout='compact', or grouped_weight_ownership='whole'."
        )
    return None


def _grad_sync_value(s: Settings) -> str | None:
    if s.layer_wise and s.layer_wise_grad_sync not in GRAD_SYNC_MODES:
        return (
            f"layer_wise_grad_sync={s.layer_wise_grad_sync!r} is not a gradient sync. Fix: use "
            "'reduce_to_owner' (each Muon gradient to its owner) or 'all_reduce'."
        )
    return None


def _owner_grads_logged(s: Settings) -> str | None:
    to_owner = s.layer_wise_layout == "compact" and s.layer_wise_grad_sync == "reduce_to_owner"
    if s.layer_wise and to_owner and s.log_l2_norm_grad_to_tensorboard:
        return (
            "logger.log_l2_norm_grad_to_tensorboard logs every parameter's main_grad, but with "
            "layer_wise_grad_sync='reduce_to_owner' only a Muon matrix's owner holds its reduced "
            "gradient (other ranks keep their local one), so the logged norms would be wrong. "
            "Fix: optimizer.layer_wise_grad_sync=all_reduce, or "
            "logger.log_l2_norm_grad_to_tensorboard=false (the optimizer's grad norm is right "
            "either way)."
        )
    return None


INTEGRATION_RULES: tuple[Rule, ...] = (
    Rule("grouped-weight-needs-grouped-gemm", "one grouped weight = TE grouped GEMM experts",
         _grouped_needs_grouped_gemm),
    Rule("grouped-weight-needs-op-fuser", "0.19.2 trains grouped weights via TE's op fuser",
         _grouped_needs_op_fuser),
    Rule("fp8-gather-without-fp8", "FP8 param gather needs FP8 on", _fp8_gather_without_fp8),
    Rule("fp8-gather-tensor-parallel", "layer-wise FP8 gather is verified with TP = ETP = 1",
         _fp8_gather_tensor_parallel),
    Rule("overlap-param-gather-agreement", "DDP and optimizer agree on overlapped gather",
         _overlap_agreement),
    Rule("layer-wise-fsdp", "layer-wise Muon owns whole matrices, FSDP shards them",
         _layer_wise_fsdp),
    Rule("layer-wise-overlap-with-optimizer-step", "an Adam-only overlap mode",
         _layer_wise_overlap_with_step),
    Rule("layer-wise-cpu-offload", "optimizer CPU offload is Adam-only", _layer_wise_cpu_offload),
    Rule("grouped-weight-blockwise-gather", "blockwise gather handles discrete experts only",
         _grouped_blockwise_gather),
    Rule("layer-wise-layout-name", "layout is padded, compact or legacy", _layout_value),
    Rule("compact-gather-padding-tolerance", "tolerance is a non-negative fraction",
         _padding_tolerance),
    Rule("compact-grad-sync-name", "grad sync is reduce_to_owner or all_reduce",
         _grad_sync_value),
    Rule("compact-owner-grads-not-logged", "per-parameter grad norms need all-reduced grads",
         _owner_grads_logged),
    Rule("compact-bucket-cap", "bucket cap is None or a non-negative element count",
         _bucket_cap),
    Rule("grouped-weight-ownership-name", "ownership is whole, expert or auto",
         _ownership_value),
    Rule("grouped-weight-split-ownership-needs-compact", "expert runs need the compact gather",
         _split_ownership_needs_compact),
    Rule("qkv-ownership-name", "QKV ownership is auto, split or whole", _qkv_ownership_value),
    Rule("qkv-split-needs-compact", "Q / K / V parts are owned apart on the compact layout only",
         _qkv_split_needs_compact),
    Rule("qkv-split-blockwise", "blockwise FP8 QKV weights are owned whole",
         _qkv_split_blockwise),
)
RULES = RULES + INTEGRATION_RULES
#: Settings outside what the plugin is tested on (nemo_lw_fp8/scope_guards.py).
SCOPE_RULES: tuple[Rule, ...] = (
    Rule("layer-wise-context-parallel", "layer-wise Muon is tested with context parallel 1",
         scope_guards.layer_wise_context_parallel),
    Rule("layer-wise-checkpoint-format", "layer-wise runs save and resume torch_dist",
         scope_guards.layer_wise_ckpt_format),
)
INTEGRATION_RULES = INTEGRATION_RULES + SCOPE_RULES
RULES = RULES + SCOPE_RULES
# A recipe / launcher-level rule too (its case is in tests/test_guard_catalogue.py).
INTEGRATION_RULES = INTEGRATION_RULES + LAUNCH_ENV_RULES
RULES = RULES + LAUNCH_ENV_RULES


class _RecordingView:
    """The settings as a rule sees them, recording which fields the rule reads."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self.read: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.read.append(name)
        return getattr(self._settings, name)


def _with_sources(message: str, settings: Settings, read: list[str]) -> str:
    """``message`` plus where the fields the rule read came from (when that was recorded)."""
    sources = dict(settings.sources)
    named = []
    for name in dict.fromkeys(read):
        if name in sources:
            named.append(f"{name}={getattr(settings, name)!r} from {sources[name]}")
    return f"{message} (read: {'; '.join(named)})" if named else message


def violations(settings: Settings) -> list[tuple[str, str]]:
    """Every rule the settings break, as ``(rule, message)``."""
    found = []
    for rule in RULES:
        view = _RecordingView(settings)
        message = rule.violated(view)  # type: ignore[arg-type]
        if message:
            found.append((rule.name, _with_sources(message, settings, view.read)))
    return found


def check(settings: Settings) -> None:
    """Raise :class:`ConfigError` for the first rule the settings break."""
    found = violations(settings)
    if found:
        rule, message = found[0]
        raise ConfigError(rule, message)


# --------------------------------------------------------------------------- checkpoint loads:
# the rules ``checkpoint-mismatch``, ``-missing-shard`` and ``-truncated-shard``
# (CHECKPOINT_RULES) live in nemo_lw_fp8/checkpoint_guards.py (imported above): they read a
# saved run's config and files, not Settings, and are checked when Bridge loads a checkpoint
# (mechanics/checkpointing.py).
