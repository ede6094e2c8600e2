"""The rules of single grouped expert weights (#5464) and of the launch environment TE's
op-fuser experts need.

Each rule reads a :class:`nemo_lw_fp8.rules.settings.Settings` and returns a one-line message
naming the flag and the fix, or ``None``; :data:`nemo_lw_fp8.rules.RULES` lists them with every
other rule (docs/guards.md).
"""

from __future__ import annotations

from nemo_lw_fp8.rules.settings import Rule, Settings
from nemo_lw_fp8.vocabulary import CUTEDSL_ENV, SINGLE_GROUPED_WEIGHT_ENV

# --------------------------------------------------------------------------- single grouped
# expert weights (#5464, issue 6; docs/moe-grouped-weights.md)

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
            enabled = int(os.environ.get(SINGLE_GROUPED_WEIGHT_ENV, "0")) > 0
        except ValueError:
            enabled = False
    if not enabled:
        return (
            f"--moe-single-grouped-weight is set but {SINGLE_GROUPED_WEIGHT_ENV} is not: "
            "Transformer Engine then silently builds E discrete expert weights (only a "
            "UserWarning), so the run would not use what it was configured for. "
            f"Fix: export {SINGLE_GROUPED_WEIGHT_ENV}=1 on every rank, or drop "
            "--moe-single-grouped-weight."
        )
    return None


def _grouped_nvfp4_layer_wise(s: Settings) -> str | None:
    """Single grouped weights under an FP4 recipe with layer-wise Muon (docs/nvfp4.md, "Single
    grouped weights (the grouped-tensor path)" and "FP4 primary single grouped weights under
    layer-wise Muon"): bf16 ones cannot run in TE 2.20.2 at all; FP4 primary ones, owned whole or
    in runs of experts, train with the owner's FP4 gather
    (tests/mechanics/test_fp4_grouped_param_gather.py; the rest of their checks are
    ``fp4-primary-weights-layer-wise``'s)."""
    if not (s.moe_single_grouped_weight and s.layer_wise and s.fp4_recipe):
        return None
    if s.fp4_param or s.fp4_param_gather:
        return None
    return (
        f"--moe-single-grouped-weight with layer-wise Muon and --fp4-recipe {s.fp4_recipe}: "
        "TE 2.20.2 cannot run bf16 single grouped weights under NVFP4: its op-fuser "
        "GroupedLinear casts them with group_quantize at every forward, and group_quantize "
        "has no NVFP4 kernel for the weight quantizer (16x16 blocks, no RHT; TE raises '2D "
        "scaling grouped quant kernel is not ready yet') (docs/nvfp4.md). Fix: use FP4 primary "
        "weights (--fp4-param-gather), --fp8-recipe mxfp8 or bf16 for the experts, or drop "
        "--moe-single-grouped-weight (discrete expert weights)."
    )


def _fp4_primary_unproven(s: Settings) -> tuple[str, str] | None:
    """Why layer-wise NVFP4 primary weights are not verified in these settings, and the fix
    (None: they are: tests/mechanics/test_nvfp4_param_gather.py, dense and discrete experts, padded
    and compact layouts, overlapped gathers or not, resume)."""
    if s.fp4_param and not s.fp4_param_gather:
        return (
            "need DDP's fp4_param_gather as well: without it no gather ships the owners' NVFP4 "
            "weights, so the other ranks would keep their old ones",
            "set --fp4-param-gather (DistributedDataParallelConfig.fp4_param_gather) with "
            "fp4_param",
        )
    if s.layer_wise_layout == "legacy" or not s.use_layer_wise_param_layout:
        return (
            "need a layer-wise param layout (padded or compact): the FP4 owner gather runs on "
            "its bucket groups, the legacy path flattens params",
            "drop --no-use-layer-wise-param-layout",
        )
    if s.tensor_model_parallel_size > 1 or (s.expert_tensor_parallel_size or 1) > 1:
        return (
            "are verified at TP 1 and ETP 1 only: at tensor parallelism an owner holds one TP "
            "shard, whose per-tensor amax would need a reduction across the TP group that has "
            "not been compared",
            "--tensor-model-parallel-size 1 --expert-tensor-parallel-size 1",
        )
    if s.fp4_recipe not in (None, "nvfp4"):
        return (
            f"are verified with the nvfp4 recipe only, not {s.fp4_recipe}",
            "--fp4-recipe nvfp4",
        )
    if not s.bf16 or s.num_distributed_optimizer_instances > 1:
        return (
            "are verified with bf16 parameters and one distributed-optimizer instance only",
            "--bf16 --num-distributed-optimizer-instances 1",
        )
    return None


def _fp4_primary_weights_layer_wise(s: Settings) -> str | None:
    if not (s.layer_wise and (s.fp4_param or s.fp4_param_gather)):
        return None
    unproven = _fp4_primary_unproven(s)
    if unproven is None:
        return None
    why, fix = unproven
    return (
        f"NVFP4 primary weights (--fp4-param-gather / fp4_param) with layer-wise Muon {why} "
        "(docs/nvfp4.md, FP4 primary weights). Fix: "
        f"{fix}, or drop --fp4-param-gather (NVFP4 compute on bf16 parameters)."
    )


GROUPED_WEIGHT_RULES: tuple[Rule, ...] = (
    Rule(
        "grouped-weight-fsdp",
        "single grouped expert weights do not work with FSDP",
        _grouped_fsdp,
        names=("--moe-single-grouped-weight", "--use-<megatron-fsdp or torch-fsdp2>"),
        fix="drop --use-<megatron-fsdp or torch-fsdp2> (use DDP with the distributed or "
        "layer-wise optimizer), or drop --moe-single-grouped-weight",
    ),
    Rule(
        "grouped-weight-mxfp8-primary-needs-reuse",
        "grouped MXFP8 primary weights stage their gather in the grad buffer",
        _grouped_mxfp8_primary_needs_reuse,
        names=(
            "--moe-single-grouped-weight", "--fp8-param-gather", "--fp8-recipe mxfp8",
            "--reuse-grad-buf-for-mxfp8-param-ag",
        ),
        fix="add --reuse-grad-buf-for-mxfp8-param-ag",
    ),
    Rule(
        "grouped-weight-te-version",
        "single grouped weights need TE >= 2.14",
        _grouped_te_version,
        names=("--moe-single-grouped-weight", f"transformer-engine >= {GROUPED_WEIGHT_MIN_TE}"),
        fix=f"install transformer-engine >= {GROUPED_WEIGHT_MIN_TE} (tested: 2.20.2), or drop "
        "--moe-single-grouped-weight",
    ),
    Rule(
        "grouped-weight-te-switch",
        "single grouped weights need NVTE_GROUPED_LINEAR_SINGLE_PARAM=1",
        _grouped_te_switch,
        names=("--moe-single-grouped-weight", f"{SINGLE_GROUPED_WEIGHT_ENV}=1"),
        fix=f"export {SINGLE_GROUPED_WEIGHT_ENV}=1 on every rank, or drop "
        "--moe-single-grouped-weight",
    ),
    Rule(
        "grouped-weight-nvfp4-layer-wise",
        "single grouped weights under an FP4 recipe with layer-wise Muon (TE cannot run bf16 "
        "ones; FP4 primary ones train)",
        _grouped_nvfp4_layer_wise,
        names=(
            "--moe-single-grouped-weight", "--fp4-recipe", "--fp4-param-gather",
            "--fp8-recipe mxfp8",
        ),
        fix="use FP4 primary weights (--fp4-param-gather), --fp8-recipe mxfp8 or bf16 for the "
        "experts, or drop --moe-single-grouped-weight",
    ),
    Rule(
        "fp4-primary-weights-layer-wise",
        "NVFP4 primary weights under layer-wise Muon outside what is verified",
        _fp4_primary_weights_layer_wise,
        # (also what the optimizer build's refusal of 1x16 blocks says, mechanics/nvfp4_gather.py)
        names=("--fp4-param-gather",),
        fix="<the verified setting>, or drop --fp4-param-gather",
    ),
)


# --------------------------------------------------------------------------- the launch
# environment TE's op-fuser experts need (issue 28; docs/recipes.md, "Launch environment")


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
    # pass what they export (recipes/te_env.py, check_environment).
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
        names=("model.use_transformer_engine_op_fuser", f"{CUTEDSL_ENV}=1"),
        fix=f"export {CUTEDSL_ENV}=1 on every rank before transformer_engine is imported "
        "(<who sets it>), or set model.use_transformer_engine_op_fuser=False with discrete "
        "expert weights",
    ),
)
