"""Build a recipe's Megatron-Bridge ``ConfigContainer``: the model provider from the architecture,
the variant's mixed precision, the plugin's layer-wise Muon factory, the parallelism table, and
the launch environment the layers need. Megatron-Bridge is imported when a config is built, not
when this module is.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from nemo_lw_fp8.recipes import te_env
from nemo_lw_fp8.recipes.architectures import MoEArchitecture, get_architecture, tiny
from nemo_lw_fp8.recipes.catalogue import (
    DISCRETE_EXPERT_VARIANTS,
    VARIANT_GPU,
    VARIANTS,
    nvfp4_bf16_layers_at_end,
)
from nemo_lw_fp8.recipes.parallel import ParallelismDefaults, parallelism

#: The package whose classes a recipe YAML may name as ``_target_``.
TARGET_PREFIX = "nemo_lw_fp8"


def mixed_precision(variant: str | None) -> Any:
    """Bridge ``MixedPrecisionConfig`` for a variant (``None``: bf16 without FP8)."""
    from megatron.bridge.training.mixed_precision import (
        bf16_mixed,
        bf16_with_mxfp8_mixed,
        bf16_with_nvfp4_mixed,
    )

    if variant is None:
        return bf16_mixed()
    if variant == "mxfp8":
        return bf16_with_mxfp8_mixed()
    if variant == "nvfp4":
        # Bridge's preset: NVFP4 compute, NVFP4 primary weights (fp4_param follows
        # fp4_param_gather), FP4 bytes on the DP wire (:func:`build` adds the bf16 last layers).
        return bf16_with_nvfp4_mixed()
    if variant == "hopper":
        config = bf16_mixed()
        config.fp8 = "e4m3"
        config.fp8_recipe = "blockwise"
        config.fp8_param_gather = True
        config.reuse_grad_buf_for_mxfp8_param_ag = False
        return config
    raise ValueError(f"unknown FP8 variant {variant!r}; one of {VARIANTS} (or None for bf16)")


def _provider(arch: MoEArchitecture, parallel: ParallelismDefaults, transformer_impl: str) -> Any:
    import torch
    from megatron.bridge.models import GPTModelProvider
    from megatron.bridge.models.mla_provider import MLAModelProvider

    kwargs = arch.provider_kwargs() | parallel.model_kwargs()
    kwargs |= {
        "bf16": True,
        "params_dtype": torch.bfloat16,
        "pipeline_dtype": torch.bfloat16 if parallel.pp > 1 else None,
        "moe_grouped_gemm": True,
        "moe_token_dispatcher_type": "alltoall",
        "moe_permute_fusion": transformer_impl == "transformer_engine",
        "transformer_impl": transformer_impl,
    }
    if arch.experimental_attention_variant and transformer_impl == "transformer_engine":
        # as Bridge's qwen3_next / qwen35 bridges: megatron's hybrid block spec (Gated DeltaNet
        # on the linear-attention layers); the default GPT spec would build softmax attention
        # everywhere. (``--cpu`` swaps in the CPU layers' own hybrid spec.)
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec as hybrid_spec,
        )

        kwargs["transformer_layer_spec"] = hybrid_spec
    elif arch.multi_latent_attention and transformer_impl == "transformer_engine":
        # as Bridge's DeepSeek-V2 / V3 bridges: megatron's decoder block spec, which reads MLA
        # and the leading dense layers (moe_layer_freq) from the config. Bridge's default spec
        # builds one layer kind for all: softmax attention with a fused linear_qkv, MoE in
        # every layer -- not DeepSeek.
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        kwargs["transformer_layer_spec"] = functools.partial(
            get_gpt_decoder_block_spec, use_transformer_engine=True
        )
    cls = MLAModelProvider if arch.multi_latent_attention else GPTModelProvider
    return cls(**{k: v for k, v in kwargs.items() if v is not None or k == "q_lora_rank"})


def build(
    arch: MoEArchitecture | str,
    *,
    variant: str | None = "mxfp8",
    parallel: ParallelismDefaults | None = None,
    train_iters: int = 100_000,
    single_grouped_weight: bool | None = None,
    layer_wise_layout: str = "compact",
    max_lr: float = 2e-4,
    transformer_impl: str = "transformer_engine",
    muon_tp_mode: str = "duplicated",
) -> Any:
    """A Megatron-Bridge ``ConfigContainer`` for ``arch`` with every plugin feature on.

    ``single_grouped_weight`` (default: on, except for the Hopper variant, whose blockwise FP8
    gather handles discrete expert weights only; guard ``grouped-weight-blockwise-gather``).
    ``muon_tp_mode``: Muon's Newton-Schulz mode for TP-sharded matrices (default
    ``"duplicated"``, the TP-invariant one; :func:`~nemo_lw_fp8.bridge.
    layer_wise_muon_fp8_with_cosine_annealing`).
    """
    from megatron.bridge.recipes.common import _pretrain_common

    from nemo_lw_fp8.bridge import layer_wise_muon_fp8_with_cosine_annealing

    if isinstance(arch, str):
        arch = get_architecture(arch)
    if parallel is None:
        parallel = parallelism(arch, VARIANT_GPU[variant or "mxfp8"])
    cfg = _pretrain_common()
    cfg.model = _provider(arch, parallel, transformer_impl)
    cfg.mixed_precision = mixed_precision(variant)
    if variant == "nvfp4":
        # The last layers in bf16 (bf16 weights beside the NVFP4 primary ones; docs/nvfp4.md).
        cfg.mixed_precision.first_last_layers_bf16 = True
        cfg.mixed_precision.num_layers_at_start_in_bf16 = 0
        cfg.mixed_precision.num_layers_at_end_in_bf16 = nvfp4_bf16_layers_at_end(arch.num_layers)
    cfg.optimizer, cfg.scheduler = layer_wise_muon_fp8_with_cosine_annealing(
        max_lr=max_lr,
        lr_warmup_iters=min(2000, max(1, train_iters // 50)),
        lr_decay_iters=train_iters,
        layer_wise_layout=layer_wise_layout,
        overlap_param_gather=True,
        muon_tp_mode=muon_tp_mode,
    )
    if variant == "nvfp4":
        # An NVFP4 primary weight's owner computes the amax of the whole matrix, so a fused QKV
        # weight is owned whole when the FP4 gather is on (mechanics/compact.py); saying so here
        # keeps the ownership (and so the grad norm's summation order) the same with it off.
        cfg.optimizer.qkv_ownership = "whole"
    cfg.ddp.use_distributed_optimizer = False  # layer-wise Muon; megatron sets its own buffers
    cfg.ddp.overlap_grad_reduce = True
    cfg.ddp.overlap_param_gather = True
    cfg.ddp.data_parallel_sharding_strategy = "no_shard"
    cfg.train.train_iters = train_iters
    cfg.train.micro_batch_size = parallel.micro_batch_size
    cfg.train.global_batch_size = parallel.global_batch_size
    cfg.dataset.seq_length = parallel.seq_length
    cfg.tokenizer.tokenizer_type = "NullTokenizer"
    cfg.tokenizer.tokenizer_model = None
    cfg.tokenizer.vocab_size = arch.vocab_size
    if single_grouped_weight is None:
        single_grouped_weight = variant not in DISCRETE_EXPERT_VARIANTS
    if single_grouped_weight:
        cfg.model.moe_single_grouped_weight = True
        # megatron 0.19.2 trains single grouped weights only through TE's op fuser.
        cfg.model.use_transformer_engine_op_fuser = True
    # What the layers need in the launch environment (NVTE_GROUPED_LINEAR_SINGLE_PARAM,
    # NVTE_CUTEDSL_FUSED_GROUPED_MLP): one place computes it (recipes/te_env.py).
    cfg.env_vars.update(te_env.as_dict(te_env.needs(cfg.model)))
    if cfg.mixed_precision.fp4:  # Bridge applies the preset's FP4 fields to the model later
        fp4 = {"fp4": cfg.mixed_precision.fp4, "fp4_recipe": cfg.mixed_precision.fp4_recipe}
        cfg.env_vars.update(te_env.as_dict(te_env.needs(fp4)))
    return cfg


def tiny_parallelism(world_size: int = 2, ep: int = 1) -> ParallelismDefaults:
    """2 CPU ranks, data parallel (expert parallel ``ep``), short sequences."""
    return ParallelismDefaults(
        recipe="tiny (CPU)",
        nodes=1,
        gpus_per_node=world_size,
        ep=ep,
        micro_batch_size=1,
        global_batch_size=2 * world_size,
        seq_length=64,
    )


def build_tiny(
    arch: MoEArchitecture | str, *, variant: str | None = "mxfp8", train_iters: int = 20
) -> Any:
    """The tiny version of ``arch`` with every feature on (as :func:`build`)."""
    if isinstance(arch, str):
        arch = get_architecture(arch)
    cfg = build(
        tiny(arch),
        variant=variant,
        parallel=tiny_parallelism(),
        train_iters=train_iters,
        max_lr=3e-3,
    )
    short_run(cfg, train_iters)
    cfg.optimizer.clip_grad = 0.0  # a global norm sums in a layout-dependent order
    cfg.ddp.check_for_nan_in_grad = False
    cfg.model.moe_aux_loss_coeff = 0.0
    return cfg


def short_run(cfg: Any, train_iters: int) -> None:
    """Settings of a short CPU run: warm-up of one step, evals twice, no checkpoints (a user
    adds ``checkpoint.save=...``), a log line per step, no data workers."""
    cfg.scheduler.lr_warmup_iters = 1
    cfg.validation.eval_interval = max(1, train_iters // 2)
    cfg.validation.eval_iters = 2
    cfg.checkpoint.save = None
    cfg.checkpoint.load = None
    cfg.checkpoint.save_interval = None
    cfg.logger.log_interval = 1
    cfg.logger.tensorboard_dir = None
    cfg.train.manual_gc = False
    cfg.dataset.num_workers = 0


def with_overrides(
    cfg: Any, overrides: Sequence[str] = (), config_file: str | None = None, hint: str = ""
) -> Any:
    """``cfg`` with a YAML file and Bridge ``key=value`` overrides applied (Hydra / OmegaConf
    syntax, as ``nemo-lw-fp8 pretrain`` and ``hf-import`` read them); a failure is one
    :class:`~nemo_lw_fp8.errors.UsageError` line, ``hint`` its fix."""
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides
    from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix

    from nemo_lw_fp8.errors import UsageError

    register_allowed_target_prefix(TARGET_PREFIX)  # YAML may name the plugin's classes
    try:
        return process_config_with_overrides(
            cfg, config_filepath=config_file, cli_overrides=list(overrides)
        )
    except Exception as error:  # noqa: BLE001 - Hydra / OmegaConf errors, one line each
        text = str(error).strip().splitlines()
        raise UsageError(
            f"overrides not applied: {text[0] if text else type(error).__name__}", hint
        ) from error
