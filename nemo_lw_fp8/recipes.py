"""Megatron-Bridge pretraining recipes with layer-wise Muon + FP8 param gather for MoE models.

Each recipe is a function returning a Megatron-Bridge ``ConfigContainer`` built offline from the
explicit hyper-parameters of :mod:`nemo_lw_fp8.models.architectures` (no Hugging Face Hub), with:

* layer-wise Muon from the plugin's optimizer factory
  (:func:`nemo_lw_fp8.bridge.layer_wise_muon_fp8_with_cosine_annealing`): compact layout,
  overlapped param gather;
* FP8 by GPU family: ``mxfp8`` (Blackwell: MXFP8 compute, MXFP8 parameters gathered from the
  grad buffer - Bridge's ``bf16_with_mxfp8_mixed``) or ``hopper`` (Hopper: blockwise FP8
  compute, blockwise FP8 parameters with FP8 codes + scales on the wire, no grad-buffer reuse);
  ``nvfp4`` (GB200 / B200, DeepSeek-V3 and Qwen3-235B only: Bridge's ``bf16_with_nvfp4_mixed``,
  NVFP4 primary weights with FP4 codes + tile scales + amax on the wire, the last 15% of the
  decoder layers in bf16, stochastic rounding off; docs/nvfp4.md, "NVFP4 recipes");
* single grouped expert weights (TE's ``GroupedLinear`` with one parameter) on the grouped GEMM
  (``mxfp8`` recipes, tiny ones included; the blockwise gather handles discrete expert weights
  only, and single grouped NVFP4 weights are not verified: discrete for ``hopper`` and
  ``nvfp4``);
* parallelism from :func:`nemo_lw_fp8.models.parallelism` (best published Bridge recipe
  of the model, adapted to Muon).

Names: ``<model>_<variant>`` (``deepseek_v3_mxfp8``, ``qwen3_235b_a22b_hopper``...),
``tiny_<model>`` (same architecture, tiny widths, MXFP8; trains on 2 CPU ranks with ``--cpu``)
and ``tiny_<model>_hopper`` (the same with the Hopper variant: ``build_tiny(variant="hopper")``,
blockwise FP8 emulated on CPU, discrete experts), ``tiny_<model>_nvfp4`` likewise. Every
recipe can be overridden from YAML / ``key=value`` (see :mod:`nemo_lw_fp8.launch.pretrain`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from . import models
from .models import MoEArchitecture, ParallelismDefaults

VARIANTS = ("mxfp8", "hopper", "nvfp4")
#: GPU family each variant's parallelism is taken from.
VARIANT_GPU = {"mxfp8": "gb200", "hopper": "h100", "nvfp4": "gb200"}
#: Variants shipped for a subset of the models only (the rest: every model). NVFP4 primary
#: weights are verified for the two largest MoE models first (docs/nvfp4.md, "NVFP4 recipes").
VARIANT_MODELS = {"nvfp4": ("deepseek-v3", "qwen3-235b-a22b")}
#: Variants with discrete expert weights (TE's ``GroupedLinear`` modules, no op fuser): the
#: blockwise gather handles discrete weights only, and single grouped NVFP4 weights are not
#: verified under layer-wise Muon (rule ``grouped-weight-nvfp4-layer-wise``).
DISCRETE_EXPERT_VARIANTS = ("hopper", "nvfp4")
#: Share of the transformer layers the NVFP4 recipes keep in bf16, at the end, as Bridge's NVFP4
#: presets do (``nemotron_3_ultra_bf16_with_nvfp4_mixed``: "last 15% of layers in BF16"; Llama3
#: 8B's NVFP4 recipe: its last 4 of 32); none at the start.
NVFP4_BF16_END_SHARE = 0.15


def nvfp4_bf16_layers_at_end(num_layers: int) -> int:
    """How many of ``num_layers`` decoder layers an NVFP4 recipe keeps in bf16 at the end: the
    rounded 15%, at least one (DeepSeek-V3: 9 of 61, Qwen3-235B: 14 of 94, a twin: 1)."""
    return max(1, round(NVFP4_BF16_END_SHARE * num_layers))


#: TE reads it when ``transformer_engine`` is imported (the default of
#: ``NVFP4BlockScaling.disable_stochastic_rounding``): the launchers export it before (it is a
#: launch variable of :mod:`.launch.te_env`); the CPU path re-reads it when megatron builds its
#: recipe (:mod:`nemo_lw_fp8.cpu.bridge`, ``nvfp4_recipe_from_env``).
NVFP4_NO_SR_ENV = "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"
#: Models with recipes (architecture names in :mod:`nemo_lw_fp8.models.architectures`).
MODELS = (
    "deepseek-v3",
    "deepseek-v2-lite",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
    "qwen3-next-80b-a3b",
    "qwen3.5-35b-a3b",
)
#: TE's switch for one grouped parameter per GroupedLinear (read by TE when building).
SINGLE_GROUPED_WEIGHT_ENV = "NVTE_GROUPED_LINEAR_SINGLE_PARAM"


def _key(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


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

    from .bridge import layer_wise_muon_fp8_with_cosine_annealing

    if isinstance(arch, str):
        arch = models.get_architecture(arch)
    if parallel is None:
        parallel = models.parallelism(arch, VARIANT_GPU[variant or "mxfp8"])
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
    # NVTE_CUTEDSL_FUSED_GROUPED_MLP): one place computes it (launch/te_env.py).
    from .launch import te_env

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
        arch = models.get_architecture(arch)
    cfg = build(
        models.tiny(arch),
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


def _make(model: str, variant: str) -> Callable[..., Any]:
    def recipe(**overrides: Any) -> Any:
        return build(model, variant=variant, **overrides)

    recipe.__name__ = f"{_key(model)}_{variant}"
    recipe.__doc__ = (
        f"{model} pretraining, layer-wise Muon, {variant} FP8 param gather "
        f"({VARIANT_GPU[variant]} parallelism)."
    )
    if variant == "nvfp4":
        recipe.__doc__ = (
            f"{model} pretraining, layer-wise Muon, NVFP4 compute, NVFP4 primary weights and "
            f"FP4 param gather, discrete experts ({VARIANT_GPU[variant]} / b200 parallelism)."
        )
    return recipe


def variants_of(model: str) -> tuple[str, ...]:
    """The variants shipped for ``model`` (an architecture name of :data:`MODELS`)."""
    return tuple(v for v in VARIANTS if model in VARIANT_MODELS.get(v, MODELS))


def tiny_name(model: str, variant: str = "mxfp8") -> str:
    """Recipe name of a tiny model: ``tiny_<model>`` (MXFP8), ``tiny_<model>_hopper``,
    ``tiny_<model>_nvfp4``."""
    return f"tiny_{_key(model)}" + ("" if variant == "mxfp8" else f"_{variant}")


def _make_tiny(model: str, variant: str) -> Callable[..., Any]:
    def recipe(**overrides: Any) -> Any:
        return build_tiny(model, **({"variant": variant} | overrides))

    recipe.__name__ = tiny_name(model, variant)
    recipe.__doc__ = f"Tiny {model} architecture (2 CPU ranks with --cpu), every feature on."
    if variant == "hopper":
        recipe.__doc__ = (
            f"Tiny {model} architecture (2 CPU ranks with --cpu), Hopper variant: blockwise FP8 "
            "compute and param gather, discrete experts."
        )
    if variant == "nvfp4":
        recipe.__doc__ = (
            f"Tiny {model} architecture (2 CPU ranks with --cpu), NVFP4 variant: NVFP4 compute, "
            "NVFP4 primary weights and FP4 param gather, discrete experts."
        )
    return recipe


def _make_twin(full: str) -> Callable[..., Any]:
    def recipe(**overrides: Any) -> Any:
        from .twins import build_twin

        return build_twin(full, **overrides)

    recipe.__name__ = f"twin_{full}"
    from .twins import twin_world_size

    recipe.__doc__ = (
        f"{full}'s parallelism structure at CPU size (PP / VPP 2 and EP over TP x DP 2 where "
        "it has them, TP as shipped): "
        f"torchrun --nproc-per-node {twin_world_size(full)} ... --cpu."
    )
    return recipe


RECIPES: dict[str, Callable[..., Any]] = {}
for _model in MODELS:
    for _variant in variants_of(_model):
        RECIPES[f"{_key(_model)}_{_variant}"] = _make(_model, _variant)
    for _variant in variants_of(_model):
        RECIPES[tiny_name(_model, _variant)] = _make_tiny(_model, _variant)
    for _variant in variants_of(_model):
        RECIPES[f"twin_{_key(_model)}_{_variant}"] = _make_twin(f"{_key(_model)}_{_variant}")
del _model, _variant


def get_recipe(name: str) -> Callable[..., Any]:
    try:
        return RECIPES[_key(name)]
    except KeyError:
        raise KeyError(
            f"unknown recipe {name!r}; known: {', '.join(sorted(RECIPES))}"
        ) from None


def tiny_variant_of(name: str) -> tuple[str, str] | None:
    """``(model, variant)`` of a ``tiny_*`` recipe name (None for full-size recipes)."""
    key = _key(name)
    for model in MODELS:
        for variant in variants_of(model):
            if key == tiny_name(model, variant):
                return model, variant
    return None


def tiny_architecture_of(name: str) -> MoEArchitecture | None:
    """The tiny architecture behind a ``tiny_*`` recipe name (None for full-size recipes)."""
    found = tiny_variant_of(name)
    return None if found is None else models.tiny(models.get_architecture(found[0]))


