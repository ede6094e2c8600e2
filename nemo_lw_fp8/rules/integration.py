"""The rules of what a recipe or launcher can combine with layer-wise Muon, and of the plugin's
own settings (layout, ownership, gradient sync, bucket cap).

Each rule reads a :class:`nemo_lw_fp8.rules.settings.Settings` and returns a one-line message
naming the flag and the fix, or ``None``; :data:`nemo_lw_fp8.rules.RULES` lists them with every
other rule (docs/guards.md).
"""

from __future__ import annotations

import nemo_lw_fp8.rules.tensor_parallel as rules_tensor_parallel
from nemo_lw_fp8.rules.settings import Rule, Settings
from nemo_lw_fp8.vocabulary import (
    DEFAULT_GATHER_PADDING_TOLERANCE,
    GRAD_SYNC_MODES,
    GROUPED_WEIGHT_OWNERSHIP,
    LAYER_WISE_LAYOUTS,
    QKV_OWNERSHIP,
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


def _op_fuser_experts_expert_tensor_parallel(s: Settings) -> str | None:
    etp = rules_tensor_parallel.expert_tensor_parallel(s)
    fused = s.num_moe_experts and s.moe_grouped_gemm and s.use_transformer_engine_op_fuser
    if not fused or etp <= 1:
        return None
    return (
        f"grouped MoE experts through TE's op fuser (model.use_transformer_engine_op_fuser=True)"
        f" at expert tensor parallel {etp} (model.expert_tensor_parallel_size; unset, it follows "
        f"model.tensor_model_parallel_size={s.tensor_model_parallel_size}): megatron-core "
        "0.19.2 fuses TEGroupedMLP only at "
        "expert TP 1 (TEGroupedMLP._is_fused_impl_supported) and asserts 'Fused GroupedMLP is "
        "not supported for this configuration.' at model build; single grouped weights exist "
        "only there. Fix: set model.expert_tensor_parallel_size=1 (use EP for memory), or "
        "model.use_transformer_engine_op_fuser=False with model.moe_single_grouped_weight=False "
        "(TE's GroupedLinear with discrete expert weights runs at ETP > 1)."
    )


def _fp8_gather_without_fp8(s: Settings) -> str | None:
    if s.layer_wise and s.fp8_param_gather and s.fp8 is None and s.fp8_recipe is None:
        return (
            "--fp8-param-gather is set but FP8 is off (no --fp8-format): there are no FP8 "
            "parameters to gather. Fix: choose mixed_precision=bf16_with_mxfp8_mixed (Blackwell) "
            "or a blockwise FP8 preset (Hopper), or set mixed_precision.fp8_param_gather=false."
        )
    return None


def _overlap_agreement(s: Settings) -> str | None:
    ddp = s.ddp_overlap_param_gather
    if s.layer_wise and ddp is not None and ddp != s.overlap_param_gather:
        return (
            f"ddp.overlap_param_gather={ddp} but optimizer.overlap_param_gather="
            f"{s.overlap_param_gather}: Megatron-Bridge would silently switch both on; the plugin "
            "does not guess which one you meant. Fix: set ddp.overlap_param_gather and "
            "optimizer.overlap_param_gather to the same value."
        )
    return None


def _layer_wise_fsdp(s: Settings) -> str | None:
    if s.layer_wise and (s.use_megatron_fsdp or s.use_torch_fsdp2):
        flag = (
            "--use-megatron-fsdp (ddp.use_megatron_fsdp=true)"
            if s.use_megatron_fsdp
            else "--use-torch-fsdp2"
        )
        return (
            f"layer-wise Muon with {flag}: layer-wise Muon gives each data-parallel rank whole "
            "matrices; FSDP shards every parameter by element ranges instead. Fix: drop "
            "--use-megatron-fsdp (ddp.use_megatron_fsdp=false) and --use-torch-fsdp2, or use "
            "Adam with the distributed optimizer for FSDP runs."
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
            f"layer_wise_layout={s.layer_wise_layout!r} is not a layout. Fix: set "
            "layer_wise_layout to 'compact' (no padding, the plugin's default), 'padded' "
            "(megatron 0.19.2's) or 'legacy'."
        )
    return None


def _grouped_blockwise_gather(s: Settings) -> str | None:
    blockwise_gather = s.layer_wise and s.fp8_param_gather and s.fp8_recipe == "blockwise"
    if blockwise_gather and s.moe_single_grouped_weight:
        return (
            "--moe-single-grouped-weight with layer-wise Muon and blockwise FP8 param gather "
            "(--fp8-param-gather, --fp8-recipe blockwise) is not supported: the blockwise gather "
            "ships each weight's FP8 codes and 128x128 tile scales, and a single grouped weight "
            "is one GroupedTensor whose per-expert blockwise members it does not handle. Fix: "
            "drop --moe-single-grouped-weight (model.moe_single_grouped_weight=false: discrete "
            "expert weights), or use --fp8-recipe mxfp8 (Blackwell), or drop --fp8-param-gather."
        )
    return None


def _padding_tolerance(s: Settings) -> str | None:
    if s.layer_wise and s.layer_wise_layout == "compact" and not s.gather_padding_tolerance >= 0:
        return (
            f"gather_padding_tolerance={s.gather_padding_tolerance} must be >= 0 (a fraction of "
            "the gathered payload; inf always takes the even all_gather). Fix: set "
            "gather_padding_tolerance to a fraction >= 0, e.g. the default "
            f"{DEFAULT_GATHER_PADDING_TOLERANCE}."
        )
    return None


def _bucket_cap(s: Settings) -> str | None:
    cap = s.bucket_cap_numel
    bad = isinstance(cap, bool) or not isinstance(cap, int) or cap < 0
    if s.layer_wise and cap is not None and bad:
        return (
            f"bucket_cap_numel={cap!r} must be None (buckets end where the padded layout ends "
            "them) or an element count >= 0 (0: megatron's plain bucket_size). Fix: leave "
            "bucket_cap_numel unset, or set it to an element count >= 0, e.g. 500000000."
        )
    return None


def _ownership_value(s: Settings) -> str | None:
    if s.layer_wise and s.grouped_weight_ownership not in GROUPED_WEIGHT_OWNERSHIP:
        return (
            f"grouped_weight_ownership={s.grouped_weight_ownership!r} is not an ownership mode. "
            "Fix: set grouped_weight_ownership to 'whole' (one rank per grouped weight), 'expert' "
            "or 'auto'."
        )
    return None


def _qkv_ownership_value(s: Settings) -> str | None:
    if s.layer_wise and s.qkv_ownership not in QKV_OWNERSHIP:
        return (
            f"qkv_ownership={s.qkv_ownership!r} is not an ownership mode. Fix: set qkv_ownership "
            "to 'auto' (the default: parts owned apart where the layout can), 'split' or 'whole'."
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


def qkv_split_nvfp4_message() -> str:
    """The refusal of an explicit ``qkv_ownership='split'`` on NVFP4 primary weights (also raised
    by the compact layout when it finds them, mechanics/compact.py)."""
    return (
        "qkv_ownership='split' with NVFP4 primary weights (mixed_precision.fp4_param_gather): "
        "an NVFP4 weight's owner quantizes the whole matrix with one per-tensor amax, which "
        "spans the Q, K and V parts, so its parts cannot be owned apart and the setting would "
        "be dropped. Fix: qkv_ownership='auto' (the default: whole for NVFP4 primary weights) or "
        "'whole'."
    )


def _qkv_split_nvfp4(s: Settings) -> str | None:
    if s.layer_wise and s.qkv_ownership == "split" and (s.fp4_param or s.fp4_param_gather):
        return qkv_split_nvfp4_message()
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
            f"layer_wise_grad_sync={s.layer_wise_grad_sync!r} is not a gradient sync. Fix: set "
            "layer_wise_grad_sync to 'reduce_to_owner' (each Muon gradient to its owner) or "
            "'all_reduce'."
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


# Settings only the compact layout reads: on the padded or legacy layout megatron's own bucketing,
# gathers and reduce-scatter / all-reduce run, so a value set there would be silently ignored.


def _compact_only(s: Settings) -> bool:
    """Whether the run is layer-wise on a layout that ignores the compact layout's settings."""
    return s.layer_wise and s.layer_wise_layout in ("padded", "legacy")


def _compact_only_grad_sync(s: Settings) -> str | None:
    if _compact_only(s) and s.layer_wise_grad_sync != "reduce_to_owner":
        return (
            f"layer_wise_grad_sync={s.layer_wise_grad_sync!r} (LayerWiseConfig.grad_sync) is "
            f"read by the compact layout only; the {s.layer_wise_layout!r} layout syncs "
            "gradients as megatron does, so the setting would be ignored. Fix: leave "
            "layer_wise_grad_sync unset, or layer_wise_layout='compact'."
        )
    return None


def _compact_only_bucket_cap(s: Settings) -> str | None:
    if _compact_only(s) and s.bucket_cap_numel is not None:
        return (
            f"bucket_cap_numel={s.bucket_cap_numel!r} is read by the compact layout only; the "
            f"{s.layer_wise_layout!r} layout ends buckets as megatron does, so the setting would "
            "be ignored. Fix: leave bucket_cap_numel unset (use bucket_size for megatron's "
            "buckets), or layer_wise_layout='compact'."
        )
    return None


def _compact_only_padding_tolerance(s: Settings) -> str | None:
    if _compact_only(s) and s.gather_padding_tolerance != DEFAULT_GATHER_PADDING_TOLERANCE:
        return (
            f"gather_padding_tolerance={s.gather_padding_tolerance!r} is read by the compact "
            f"layout only; the {s.layer_wise_layout!r} layout gathers as megatron does, so the "
            "setting would be ignored. Fix: leave gather_padding_tolerance unset (default "
            f"{DEFAULT_GATHER_PADDING_TOLERANCE}), or layer_wise_layout='compact'."
        )
    return None


#: The layout an unsupported compact-only setting is fixed with.
_COMPACT = "layer_wise_layout='compact'"

INTEGRATION_RULES: tuple[Rule, ...] = (
    Rule("grouped-weight-needs-grouped-gemm", "one grouped weight = TE grouped GEMM experts",
         _grouped_needs_grouped_gemm,
         names=("--moe-single-grouped-weight", "--moe-grouped-gemm", "model.moe_grouped_gemm=True"),
         fix="set model.moe_grouped_gemm=True, or drop --moe-single-grouped-weight"),
    Rule("grouped-weight-needs-op-fuser", "0.19.2 trains grouped weights via TE's op fuser",
         _grouped_needs_op_fuser,
         names=("--moe-single-grouped-weight", "model.use_transformer_engine_op_fuser=True"),
         fix="set model.use_transformer_engine_op_fuser=True, or drop --moe-single-grouped-weight"),
    Rule("op-fuser-experts-expert-tensor-parallel",
         "0.19.2 fuses grouped experts (TE's op fuser) at expert TP 1 only",
         _op_fuser_experts_expert_tensor_parallel,
         names=("model.use_transformer_engine_op_fuser=True", "model.expert_tensor_parallel_size",
                "model.tensor_model_parallel_size"),
         fix="set model.expert_tensor_parallel_size=1 (use EP for memory), or "
         "model.use_transformer_engine_op_fuser=False with model.moe_single_grouped_weight=False"),
    Rule("fp8-gather-without-fp8", "FP8 param gather needs FP8 on", _fp8_gather_without_fp8,
         names=("--fp8-param-gather", "--fp8-format", "mixed_precision=bf16_with_mxfp8_mixed",
                "mixed_precision.fp8_param_gather=false"),
         fix="choose mixed_precision=bf16_with_mxfp8_mixed (Blackwell) or a blockwise FP8 preset "
         "(Hopper), or set mixed_precision.fp8_param_gather=false"),
    Rule("fp8-gather-tensor-parallel",
         "layer-wise FP8 gather at TP > 1: verified with standard and multi-latent attention",
         rules_tensor_parallel.fp8_gather_tensor_parallel,
         names=("--fp8-param-gather", "model.tensor_model_parallel_size=1"),
         fix="set model.tensor_model_parallel_size=1 (use PP / EP for memory), or drop "
         "--fp8-param-gather"),
    Rule("fp8-gather-tp-block-boundary", "TP / ETP shards hold whole quantization blocks",
         rules_tensor_parallel.fp8_gather_tp_block_boundary,
         names=("--fp8-param-gather", "model.<dimension>=<width>",
                "model.<tensor_model or expert_tensor>_parallel_size"),
         fix="make <the dimension> a multiple of <TP or ETP x block>, or change "
         "model.<tensor_model or expert_tensor>_parallel_size, or drop --fp8-param-gather"),
    Rule("overlap-param-gather-agreement", "DDP and optimizer agree on overlapped gather",
         _overlap_agreement,
         names=("ddp.overlap_param_gather", "optimizer.overlap_param_gather"),
         fix="set ddp.overlap_param_gather and optimizer.overlap_param_gather to the same value"),
    Rule("layer-wise-fsdp", "layer-wise Muon owns whole matrices, FSDP shards them",
         _layer_wise_fsdp,
         names=("--use-megatron-fsdp", "ddp.use_megatron_fsdp=false", "--use-torch-fsdp2"),
         fix="drop --use-megatron-fsdp (ddp.use_megatron_fsdp=false) and --use-torch-fsdp2, or "
         "use Adam with the distributed optimizer for FSDP runs"),
    Rule("layer-wise-overlap-with-optimizer-step", "an Adam-only overlap mode",
         _layer_wise_overlap_with_step,
         names=("--overlap-param-gather-with-optimizer-step",),
         fix="drop --overlap-param-gather-with-optimizer-step (keep --overlap-param-gather)"),
    Rule("layer-wise-cpu-offload", "optimizer CPU offload is Adam-only", _layer_wise_cpu_offload,
         names=("--optimizer-cpu-offload",),
         fix="drop --optimizer-cpu-offload, or use PP / EP to reduce per-rank optimizer memory"),
    Rule("grouped-weight-blockwise-gather", "blockwise gather handles discrete experts only",
         _grouped_blockwise_gather,
         names=("--moe-single-grouped-weight", "--fp8-param-gather", "--fp8-recipe blockwise",
                "model.moe_single_grouped_weight=false"),
         fix="drop --moe-single-grouped-weight (model.moe_single_grouped_weight=false: discrete "
         "expert weights), or use --fp8-recipe mxfp8 (Blackwell), or drop --fp8-param-gather"),
    Rule("layer-wise-layout-name", "layout is padded, compact or legacy", _layout_value,
         names=("layer_wise_layout",),
         fix="set layer_wise_layout to 'compact' (<why>), 'padded' (<why>) or 'legacy'"),
    Rule("compact-gather-padding-tolerance", "tolerance is a non-negative fraction",
         _padding_tolerance,
         names=("gather_padding_tolerance",),
         fix="set gather_padding_tolerance to a fraction >= 0, e.g. the default "
         f"{DEFAULT_GATHER_PADDING_TOLERANCE}"),
    Rule("compact-grad-sync-name", "grad sync is reduce_to_owner or all_reduce",
         _grad_sync_value,
         names=("layer_wise_grad_sync",),
         fix="set layer_wise_grad_sync to 'reduce_to_owner' (<what>) or 'all_reduce'"),
    Rule("compact-owner-grads-not-logged", "per-parameter grad norms need all-reduced grads",
         _owner_grads_logged,
         names=("logger.log_l2_norm_grad_to_tensorboard", "layer_wise_grad_sync='reduce_to_owner'",
                "optimizer.layer_wise_grad_sync=all_reduce"),
         fix="optimizer.layer_wise_grad_sync=all_reduce, or "
         "logger.log_l2_norm_grad_to_tensorboard=false"),
    Rule("compact-bucket-cap", "bucket cap is None or a non-negative element count",
         _bucket_cap,
         names=("bucket_cap_numel",),
         fix="leave bucket_cap_numel unset, or set it to an element count >= 0"),
    Rule("grouped-weight-ownership-name", "ownership is whole, expert or auto",
         _ownership_value,
         names=("grouped_weight_ownership",),
         fix="set grouped_weight_ownership to 'whole' (<what>), 'expert' or 'auto'"),
    Rule("grouped-weight-split-ownership-needs-compact", "expert runs need the compact gather",
         _split_ownership_needs_compact,
         names=("grouped_weight_ownership", _COMPACT),
         fix=f"{_COMPACT}, or grouped_weight_ownership='whole'"),
    Rule("qkv-ownership-name", "QKV ownership is auto, split or whole", _qkv_ownership_value,
         names=("qkv_ownership",),
         fix="set qkv_ownership to 'auto' (<what>), 'split' or 'whole'"),
    Rule("qkv-split-needs-compact", "Q / K / V parts are owned apart on the compact layout only",
         _qkv_split_needs_compact,
         names=("qkv_ownership='split'", _COMPACT),
         fix=f"qkv_ownership='auto' (the default) or 'whole', or {_COMPACT}"),
    Rule("qkv-split-blockwise", "blockwise FP8 QKV weights are owned whole",
         _qkv_split_blockwise,
         names=("qkv_ownership='split'", "--fp8-recipe blockwise"),
         fix="qkv_ownership='auto' (<what>) or 'whole'"),
    Rule("qkv-split-nvfp4", "NVFP4 primary QKV weights are owned whole",
         _qkv_split_nvfp4,
         names=("qkv_ownership='split'", "mixed_precision.fp4_param_gather"),
         fix="qkv_ownership='auto' (<what>) or 'whole'"),
    Rule("compact-only-grad-sync", "grad sync is a compact-layout setting",
         _compact_only_grad_sync,
         names=("layer_wise_grad_sync", _COMPACT),
         fix=f"leave layer_wise_grad_sync unset, or {_COMPACT}"),
    Rule("compact-only-bucket-cap", "the bucket cap is a compact-layout setting",
         _compact_only_bucket_cap,
         names=("bucket_cap_numel", _COMPACT),
         fix=f"leave bucket_cap_numel unset (<why>), or {_COMPACT}"),
    Rule("compact-only-gather-padding-tolerance",
         "the gather padding tolerance is a compact-layout setting",
         _compact_only_padding_tolerance,
         names=("gather_padding_tolerance", _COMPACT),
         fix=f"leave gather_padding_tolerance unset (<default>), or {_COMPACT}"),
)
