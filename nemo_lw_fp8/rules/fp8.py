"""The rules of layer-wise Muon's FP8 param gather and of the compact layout's basics.

Each rule reads a :class:`nemo_lw_fp8.rules.settings.Settings` and returns a one-line message
naming the flag and the fix, or ``None``; :data:`nemo_lw_fp8.rules.RULES` lists them with every
other rule (docs/guards.md).
"""

from __future__ import annotations

from nemo_lw_fp8.rules.settings import Rule, Settings


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
            f"--fp8-recipe blockwise (Hopper) only, got {s.fp8_recipe!r}. Fix: set --fp8-recipe "
            "mxfp8 or --fp8-recipe blockwise, or drop --fp8-param-gather (FP8 compute with bf16 "
            "parameters works with any recipe)."
        )
    return None


def _fp8_recipe_agreement(s: Settings) -> str | None:
    recipes = (s.optimizer_fp8_recipe, s.fp8_recipe)
    # NVFP4 parameters: megatron's optimizers branch on the tensor's type
    # (``is_nvfp4tensor``) and never read ``OptimizerConfig.fp8_recipe`` for them, which Bridge
    # fills from its preset's FP8 default ("tensorwise") with FP8 off: nothing to disagree with.
    if s.fp8_recipe == "nvfp4":
        return None
    if s.layer_wise and all(recipes) and recipes[0] != recipes[1]:
        return (
            f"OptimizerConfig.fp8_recipe={s.optimizer_fp8_recipe!r}, but the model's FP8 "
            f"parameters are built for {s.fp8_recipe!r}: megatron's optimizer and the plugin's "
            "param gather would each follow a different recipe. Fix: set "
            f"--fp8-recipe {s.fp8_recipe} (OptimizerConfig.fp8_recipe={s.fp8_recipe!r}), or leave "
            "OptimizerConfig.fp8_recipe unset."
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
        names=("--fp8-param-gather", "--fp8-recipe mxfp8", "--reuse-grad-buf-for-mxfp8-param-ag"),
        fix="add --reuse-grad-buf-for-mxfp8-param-ag, or drop --fp8-param-gather",
    ),
    Rule(
        "fp8-gather-recipe",
        "layer-wise FP8 gather supports MXFP8 and blockwise",
        _fp8_gather_recipe,
        names=("--fp8-param-gather", "--fp8-recipe mxfp8", "--fp8-recipe blockwise"),
        fix="set --fp8-recipe mxfp8 or --fp8-recipe blockwise, or drop --fp8-param-gather",
    ),
    Rule(
        "fp8-recipe-agreement",
        "the optimizer's fp8_recipe matches the parameters' recipe",
        _fp8_recipe_agreement,
        names=("OptimizerConfig.fp8_recipe", "--fp8-recipe <the parameters' recipe>"),
        fix="set --fp8-recipe <the parameters' recipe> (OptimizerConfig.fp8_recipe=<the same>), "
        "or leave OptimizerConfig.fp8_recipe unset",
    ),
    Rule(
        "blockwise-gather-no-grad-buffer-reuse",
        "blockwise layer-wise gather ships FP8 bytes, no grad-buffer staging",
        _blockwise_gather_no_reuse,
        names=(
            "--fp8-param-gather", "--fp8-recipe blockwise", "--reuse-grad-buf-for-mxfp8-param-ag"
        ),
        fix="drop --reuse-grad-buf-for-mxfp8-param-ag",
    ),
    Rule(
        "fp8-gather-layout",
        "layer-wise FP8 gather needs a param layout",
        _fp8_gather_layout,
        names=("--fp8-param-gather", "--no-use-layer-wise-param-layout"),
        fix="drop --no-use-layer-wise-param-layout",
    ),
    Rule(
        "fp8-gather-bf16",
        "layer-wise FP8 gather needs bf16 training",
        _fp8_gather_bf16,
        names=("--fp8-param-gather", "--bf16"),
        fix="add --bf16",
    ),
    Rule(
        "compact-single-instance",
        "compact layout needs one distributed-optimizer instance",
        _compact_single_instance,
        names=("layer_wise_layout='compact'", "--num-distributed-optimizer-instances"),
        fix="set --num-distributed-optimizer-instances 1, or use layer_wise_layout='padded'",
    ),
    Rule(
        "compact-needs-param-layout",
        "compact layout needs use_layer_wise_param_layout=True",
        _compact_needs_param_layout,
        names=("layer_wise_layout='compact'", "--no-use-layer-wise-param-layout"),
        fix="drop --no-use-layer-wise-param-layout (keep use_layer_wise_param_layout=True), or "
        "use layer_wise_layout='legacy'",
    ),
)
