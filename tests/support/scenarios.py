"""What the tests train: a :class:`Scenario` and the tiny models it builds (CPU ranks).

A :class:`Scenario` names the model, the optimizer and the way parameters are distributed;
:func:`build_model` builds its bf16 model from a fixed seed (identical on all ranks and in every
scenario). :mod:`tests.support.training` wraps and trains it. Everything here runs *inside* a
rank of :mod:`tests.support.harness`.

Distribution modes:

``ddp``               plain DDP, every rank holds whole gradients and runs the whole optimizer.
``distopt``           megatron's DistributedOptimizer (byte-level sharding, reduce-scatter).
``layerwise_legacy``  LayerWiseDistributedOptimizer without a param layout (ping-pong ownership,
                      flatten + all_gather of whole params).
``layerwise_padded``  LayerWiseDistributedOptimizer with megatron 0.19.2's shard-aligned padded
                      layout (Muon matrices in layer-wise buffers, the rest under a sibling
                      DistributedOptimizer).
``layerwise_compact`` the plugin's compact layout (needs ``plugin=True``): no padding in the
                      Muon buffers, cost-balanced ownership, one gather per bucket group.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from tests.support.harness import BootOptions

DISTRIBUTIONS = ("ddp", "distopt", "layerwise_legacy", "layerwise_padded", "layerwise_compact")


@dataclass(frozen=True)
class Scenario:
    """One way to train the same model; parity tests compare scenarios with each other."""

    optimizer: str = "adam"  # "adam" or "muon"
    distribution: str = "ddp"
    overlap: bool = False  # overlap_grad_reduce + overlap_param_gather
    model: str = "mlp"  # "mlp", "fp8mlp", "gpt", "mla_gpt", "moe_gpt" or "moe_grouped"
    steps: int = 5
    seed: int = 1234
    lr: float = 1e-2
    bucket_size: int | None = None
    micro_batch: int = 4
    #: 0 disables clipping; a global grad norm is summed in an order the layout decides.
    clip_grad: float = 0.0
    #: "random" tokens / features, or "pattern": a learnable sequence whose loss falls quickly.
    data: str = "random"
    #: Apply the plugin's patches (``nemo_lw_fp8.apply()``) before building anything.
    plugin: bool = False
    #: MXFP8 compute in the linear layers (model "fp8mlp"); needs the FP8 emulation boot on CPU.
    fp8: bool = False
    #: Persistent MXFP8 weights + ``fp8_param_gather`` + ``reuse_grad_buf_for_mxfp8_param_ag``.
    fp8_param_gather: bool = False
    #: DDP's ``fp4_param_gather`` (NVFP4 primary weights; the model sets ``fp4_param`` itself).
    fp4_param_gather: bool = False
    #: The FP8 recipe: "mxfp8" (MXFP8 linear layers) or "blockwise" (TE's Float8BlockScaling:
    #: 128x128 weight tiles, widths multiples of 128); other names only reach the guards.
    fp8_recipe: str = "mxfp8"
    #: Run an evaluation forward (megatron's forced param sync around it) after these steps.
    eval_after: tuple[int, ...] = ()
    #: Evaluate with the forward pre-hooks left on and no forced sync: what megatron-training's
    #: and Megatron-Bridge's loops do when ``use_distributed_optimizer`` is off (layer-wise).
    eval_pre_hooks: bool = False
    #: Record every rank's main_grads per step and fp32 masters at the end.
    snapshots: bool = False
    #: Put the linear weights' buckets and the vectors' buckets in one bucket group.
    single_bucket_group: bool = False
    #: Resume: first step index to run (steps ``first_step .. steps-1`` run).
    first_step: int = 0
    #: Load a checkpoint (written by ``save_dir``) before the first step.
    load_dir: str | None = None
    #: Save a checkpoint after the last step (after megatron's end-of-training sync).
    save_dir: str | None = None
    #: Compact layout: transient padding allowed for an even gather (None: the default).
    gather_padding_tolerance: float | None = None
    #: Compact layout: ``LayerWiseConfig.bucket_cap_numel`` (None: buckets end where the padded
    #: layout ends them; 0: megatron's plain bucket_size).
    bucket_cap_numel: int | None = None
    #: Expert-parallel size the model is built for (run it with ParallelSpec(ep=...)).
    ep: int = 1
    #: model "moe_grouped": one TE GroupedTensor per expert linear (``moe_single_grouped_weight``
    #: + ``NVTE_GROUPED_LINEAR_SINGLE_PARAM``) instead of E discrete weights.
    single_grouped_weight: bool = False
    #: Checkpoints keyed by parameter name in the discrete expert layout (model "moe_grouped"):
    #: save single grouped, load discrete, and the reverse.
    named_checkpoint: bool = False
    #: model "moe_grouped": megatron's ``gradient_accumulation_fusion``: TE's linears (the
    #: grouped experts' included) accumulate their wgrads straight into ``main_grad``.
    grad_accum_fusion: bool = False
    #: Compact layout: how single grouped expert weights are owned ("whole", "expert", "auto").
    grouped_weight_ownership: str = "whole"
    #: Compact layout: fused QKV weights owned as their Q, K, V parts ("split"), "whole", or
    #: "auto" (LayerWiseConfig's default: split unless blockwise FP8).
    qkv_ownership: str = "auto"
    #: ``OptimizerConfig.muon_split_qkv``: Muon orthogonalizes a fused QKV weight's Q, K, V apart.
    muon_split_qkv: bool = True
    #: ``OptimizerConfig.muon_tp_mode``: how Muon runs Newton-Schulz on a TP-sharded matrix
    #: ("blockwise", megatron's default: each shard alone; "duplicated": gather over TP, the
    #: full matrix, slice; "distributed": the NS matmuls sharded over TP).
    muon_tp_mode: str = "blockwise"
    #: Compact layout: how Muon gradients are synced ("reduce_to_owner", "all_reduce"; None:
    #: ``LayerWiseConfig``'s default).
    grad_sync: str | None = None
    #: ``OptimizerConfig`` carries the FP8 settings too (``fp8_recipe``,
    #: ``reuse_grad_buf_for_mxfp8_param_ag``), as megatron-training and Bridge set them. False:
    #: only the DDP config and the parameters do, as megatron-core's own helpers build a run.
    fp8_on_optimizer_config: bool = True

    def with_(self, **changes: Any) -> Scenario:
        return replace(self, **changes)


# --------------------------------------------------------------------------- models


class TinyMLP(torch.nn.Module):
    """Linear layers with biases and LayerNorms: Muon matrices plus Adam vectors."""

    def __init__(
        self,
        widths: tuple[int, ...] = (32, 64, 64, 48, 64, 16),
        linear: Any = torch.nn.Linear,
        norm_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        layers: list[torch.nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
            layers.append(linear(fan_in, fan_out, bias=True))
            if i < len(widths) - 2:
                layers.append(torch.nn.LayerNorm(fan_out, dtype=norm_dtype))
                layers.append(torch.nn.GELU())
        self.net = torch.nn.Sequential(*layers)
        self.in_features = widths[0]
        self.out_features = widths[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TinyFP8MLP(TinyMLP):
    """MXFP8 linear layers (weights: Muon matrices) with bf16 biases and LayerNorms (Adam);
    widths are multiples of 32, as MXFP8 needs."""

    def __init__(self, widths: tuple[int, ...] = (32, 64, 64, 96, 64, 32)):
        from nemo_lw_fp8.cpu.layers.mxfp8_linear import MXFP8Linear

        super().__init__(widths, linear=MXFP8Linear, norm_dtype=torch.bfloat16)


class TinyBlockwiseMLP(TinyMLP):
    """Blockwise FP8 linear layers (128x128 weight tiles; Muon matrices) with bf16 biases and
    LayerNorms (Adam); widths multiples of 128, several tiles per matrix, and K = 128 / 384 so
    TE's scale buffers carry round-up padding."""

    def __init__(self, widths: tuple[int, ...] = (128, 256, 384, 128, 256, 128)):
        from nemo_lw_fp8.cpu.layers.blockwise_linear import BlockwiseFP8Linear

        super().__init__(widths, linear=BlockwiseFP8Linear, norm_dtype=torch.bfloat16)


def _build_blockwise_mlp(scenario: Scenario) -> torch.nn.Module:
    if not scenario.fp8_param_gather:
        return TinyBlockwiseMLP()
    from transformer_engine.common.recipe import Float8BlockScaling
    from transformer_engine.pytorch import quantized_model_init

    with quantized_model_init(
        enabled=True, recipe=Float8BlockScaling(), preserve_high_precision_init_val=True
    ):
        return TinyBlockwiseMLP()


def _build_fp8_mlp(scenario: Scenario) -> torch.nn.Module:
    if scenario.fp8_recipe == "blockwise":
        return _build_blockwise_mlp(scenario)
    if not scenario.fp8_param_gather:
        return TinyFP8MLP()
    from transformer_engine.common.recipe import MXFP8BlockScaling
    from transformer_engine.pytorch import quantized_model_init

    with quantized_model_init(
        enabled=True, recipe=MXFP8BlockScaling(), preserve_high_precision_init_val=True
    ):
        return TinyFP8MLP()


def single_param_env(enabled: bool):
    """Context manager setting TE's switch ``NVTE_GROUPED_LINEAR_SINGLE_PARAM`` while building."""
    from nemo_lw_fp8.vocabulary import SINGLE_GROUPED_WEIGHT_ENV

    @contextlib.contextmanager
    def scope():
        before = os.environ.get(SINGLE_GROUPED_WEIGHT_ENV)
        if enabled:
            os.environ[SINGLE_GROUPED_WEIGHT_ENV] = "1"
        else:
            os.environ.pop(SINGLE_GROUPED_WEIGHT_ENV, None)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(SINGLE_GROUPED_WEIGHT_ENV, None)
            else:
                os.environ[SINGLE_GROUPED_WEIGHT_ENV] = before

    return scope()


#: model "moe_grouped": hidden and expert FFN widths. TE's grouped MXFP8 path needs every
#: expert member's rows and columns in multiples of 128 (its kernel and its Python lay the
#: members' scales out alike only then; ``nemo_lw_fp8/cpu/te/tex/grouped_tensor.py``);
#: the bf16 runs use the same model so every precision trains one architecture.
MOE_GROUPED_HIDDEN = 128
MOE_GROUPED_FFN = 128

#: What the MXFP8 recipes' TE modules read from the environment (docs/recipes.md), set around
#: the ``moe_grouped`` build and its forwards and backwards (:func:`te_scope`).
MOE_GROUPED_ENV = {"NVTE_CUTEDSL_FUSED_GROUPED_MLP": "1"}


def _build_moe_grouped(scenario: Scenario, **overrides: Any):
    """The tiny MoE GPT a GPU builds for grouped experts: megatron's TE spec
    (``get_gpt_layer_with_transformer_engine_spec(num_experts=4, moe_grouped_gemm=True)``) with
    ``TEGroupedMLP`` through TE's op fuser (``ops.GroupedLinear`` + ``ScaledSwiGLU``), SwiGLU
    experts, RMSNorm. ``single_grouped_weight``: one TE ``GroupedTensor`` per expert linear
    (``moe_single_grouped_weight`` + ``NVTE_GROUPED_LINEAR_SINGLE_PARAM``), else TE's discrete
    ``weight0..weight3``; ``fp8``: MXFP8 compute; ``fp8_param_gather``: persistent MXFP8
    weights from ``quantized_model_init``; ``grad_accum_fusion``: megatron's
    ``gradient_accumulation_fusion`` (TE's linears accumulate their wgrads into ``main_grad``;
    megatron's own output layer uses the APEX stand-in, :mod:`nemo_lw_fp8.cpu.megatron.apex_wgrad`).

    Built with ``use_cpu_initialization=False``: TE initialises the weights itself, so the
    preserved high-precision init values of persistent MXFP8 weights are the weights' own
    (``tests/mechanics/test_te_model_training.py``). Build and run it inside :func:`te_scope`.

    ``fp8_recipe="blockwise"`` builds what the Hopper recipes run instead: TE's ``GroupedLinear``
    module with discrete weights (no op fuser; TE's grouped-tensor path needs cuBLASLt 13.6 on
    SM 9.0), persistent ``Float8BlockwiseQTensor`` weights with ``fp8_param_gather``.
    ``overrides`` go to the ``TransformerConfig`` (e.g. wider experts, sequence parallelism at
    the pool's TP size)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    blockwise = scenario.fp8 and scenario.fp8_recipe == "blockwise"
    quantized: dict[str, Any] = {}
    if scenario.fp8:
        quantized = dict(
            fp8="e4m3", fp8_recipe=scenario.fp8_recipe, fp8_param=scenario.fp8_param_gather
        )
    if scenario.grad_accum_fusion:
        from nemo_lw_fp8.cpu.megatron import apex_wgrad

        # megatron's output layer (its own ColumnParallelLinear) refuses the fusion without
        # APEX's kernel; the stand-in stays for the pool (it serves only fused configs).
        apex_wgrad.install()
    settings: dict[str, Any] = dict(
        hidden_size=MOE_GROUPED_HIDDEN,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=MOE_GROUPED_FFN,
        add_bias_linear=False,
        moe_token_dispatcher_type="allgather",
        expert_model_parallel_size=scenario.ep,
        # fp64 routing takes megatron's torch.mm path (TE's router GEMM is a CUDA kernel).
        moe_router_dtype="fp64",
        moe_grouped_gemm=True,
        use_transformer_engine_op_fuser=not blockwise,
        moe_single_grouped_weight=scenario.single_grouped_weight,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        use_cpu_initialization=False,
        gradient_accumulation_fusion=scenario.grad_accum_fusion,
    )
    config = transformer_config(**(settings | quantized | overrides))
    init: Any = contextlib.nullcontext()
    if scenario.fp8_param_gather:
        from transformer_engine.common.recipe import Float8BlockScaling, MXFP8BlockScaling
        from transformer_engine.pytorch import quantized_model_init

        init = quantized_model_init(
            enabled=True,
            recipe=Float8BlockScaling() if blockwise else MXFP8BlockScaling(),
            preserve_high_precision_init_val=True,
        )
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=4, moe_grouped_gemm=True)
    with te_scope(scenario), init:
        module = _tiny_gpt(config, spec)
    # Grouped and MXFP8 expert weights are final; cast only plain parameters.
    for param in module.parameters():
        if type(param.data) is torch.Tensor:
            param.data = param.data.to(torch.bfloat16)
    return module, config


def transformer_config(**overrides: Any):
    """A small TransformerConfig that megatron's DDP and GPT code accept on CPU (for the
    pipeline size the harness initialised: ``ParallelSpec(pp=...)``)."""
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    settings: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


GPT_VOCAB = 128
GPT_SEQ = 16


def build_gpt(config) -> torch.nn.Module:
    """A tiny GPTModel (MoE when the config has experts) on megatron's Transformer Engine spec
    (``get_gpt_layer_with_transformer_engine_spec``), the model a GPU builds: TE 2.20.2's own
    ``TELayerNormColumnParallelLinear`` (input / pre-MLP norm fused into ``linear_qkv`` /
    ``linear_fc1``), ``TERowParallelLinear``, ``TEDotProductAttention``, TE's norms, and MoE
    experts as megatron's ``SequentialMLP`` of TE linears (``moe_grouped_gemm=False``; TE's
    grouped path is ``tests/mechanics/test_te_model_training.py``'s). Build and run it inside
    :func:`te_scope` on a pool booted with :data:`TE_BOOT`. With pipeline parallelism, this
    rank's stage."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    spec = get_gpt_layer_with_transformer_engine_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False
    )
    return _tiny_gpt(config, spec)


def _tiny_gpt(config, spec, position_embedding_type: str = "rope") -> torch.nn.Module:
    """megatron's ``GPTModel`` of ``config`` and layer ``spec`` at the tiny vocabulary and
    sequence length, this rank's pipeline stage, untied output layer."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=GPT_VOCAB,
        max_sequence_length=GPT_SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type=position_embedding_type,
    )


def build_mla_gpt():
    """The tiny GPT with multi-latent attention on megatron's TE spec: the q / kv down
    projections TE linears duplicated on every TP rank (``parallel_mode="duplicated"``), the up
    projections column-parallel with the q / kv norms fused, ``linear_proj`` row-parallel.
    Returns (module, config)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    base = transformer_config()  # the small model's settings, as a plain config
    fields = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "bf16",
              "params_dtype", "pipeline_dtype", "use_cpu_initialization", "hidden_dropout",
              "attention_dropout", "gradient_accumulation_fusion", "bias_dropout_fusion",
              "apply_rope_fusion", "masked_softmax_fusion", "persist_layer_norm",
              "pipeline_model_parallel_size", "tensor_model_parallel_size",
              "expert_tensor_parallel_size")  # fmt: skip
    config = MLATransformerConfig(
        **{name: getattr(base, name) for name in fields},
        q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=16, v_head_dim=16,
        qk_layernorm=True, rope_type="rope", normalization="RMSNorm",
    )  # fmt: skip
    spec = get_gpt_layer_with_transformer_engine_spec(
        multi_latent_attention=True, qk_layernorm=True
    )
    return _tiny_gpt(config, spec, position_embedding_type="none"), config


#: Models built from megatron's TE spec (TE's own modules over the emulated extension).
TE_MODELS = ("gpt", "mla_gpt", "moe_gpt", "moe_grouped")

#: The rank pools that run :data:`TE_MODELS`: TE's Python package over the emulated
#: ``transformer_engine_torch``, activated before megatron is imported (megatron then picks its
#: TE spec's modules as on a GPU).
TE_BOOT = BootOptions(fp8_emulation=True)


def boot_for(scenario: Scenario) -> BootOptions:
    """The pool a scenario needs: :data:`TE_BOOT` for :data:`TE_MODELS`."""
    if scenario.model in TE_MODELS:
        return TE_BOOT
    return BootOptions()


def te_scope(scenario: Scenario) -> contextlib.AbstractContextManager:
    """Where a TE-spec model is built and run: TE's device questions answered as the GPU of the
    scenario's FP8 recipe (:func:`nemo_lw_fp8.cpu.te.device.target_gpu`: ``BLACKWELL``; an H100,
    ``HOPPER``, for blockwise FP8, which TE converts to MXFP8 on SM 10.0), for ``moe_grouped``
    with TE's grouped-linear switches set (:func:`single_param_env`, :data:`MOE_GROUPED_ENV`);
    nothing for other models. Refuses a rank whose pool was not booted with :data:`TE_BOOT`
    (megatron would otherwise fall back to its local modules without a word)."""
    if scenario.model not in TE_MODELS:
        return contextlib.nullcontext()
    from nemo_lw_fp8.cpu.te import backend as te_backend
    from nemo_lw_fp8.cpu.te import device as te_device

    if not te_backend.is_emulated():
        raise RuntimeError(
            f"model {scenario.model!r} is built from megatron's TE spec: run it on a pool booted "
            "with TE_BOOT (run_on_ranks(..., boot=boot_for(scenario)))"
        )
    blockwise = scenario.fp8 and scenario.fp8_recipe == "blockwise"
    target = te_device.target_gpu(te_device.HOPPER if blockwise else te_device.BLACKWELL)
    if scenario.model != "moe_grouped":
        return target
    # TE reads its grouped-linear switches when megatron builds the fused ops (first forward).
    stack = contextlib.ExitStack()
    stack.enter_context(target)
    stack.enter_context(single_param_env(scenario.single_grouped_weight))
    stack.enter_context(env_scope(MOE_GROUPED_ENV))
    return stack


def env_scope(values: dict[str, str]) -> contextlib.AbstractContextManager:
    """Context manager setting environment variables, restoring them after."""

    @contextlib.contextmanager
    def scope():
        before = {name: os.environ.get(name) for name in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    return scope()


def seed_all(seed: int) -> None:
    """Seed the CPU generator and megatron's model-parallel RNG tracker identically everywhere."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_model(scenario: Scenario, **overrides: Any):
    """Build the scenario's bf16 model from its seed; returns (module, transformer_config).
    ``overrides``: ``TransformerConfig`` settings for model "moe_grouped" (others refuse them)."""
    if overrides and scenario.model != "moe_grouped":
        raise ValueError(f"model {scenario.model!r} takes no config overrides: {overrides}")
    if scenario.plugin:
        import nemo_lw_fp8

        nemo_lw_fp8.apply()
    seed_all(scenario.seed)
    if scenario.model == "gpt":
        config = transformer_config()
        with te_scope(scenario):
            module = build_gpt(config)
    elif scenario.model == "mla_gpt":
        with te_scope(scenario):
            module, config = build_mla_gpt()
    elif scenario.model == "moe_gpt":
        # Experts without biases: megatron 0.19.2's layer-wise + DistOpt path cannot hold
        # expert-parallel parameters that Muon does not manage.
        config = transformer_config(
            num_moe_experts=4,
            moe_router_topk=2,
            moe_ffn_hidden_size=64,
            add_bias_linear=False,
            moe_token_dispatcher_type="allgather",
            expert_model_parallel_size=scenario.ep,
        )
        with te_scope(scenario):
            module = build_gpt(config)
    elif scenario.model == "moe_grouped":
        return _build_moe_grouped(scenario, **overrides)
    elif scenario.model == "mlp":
        config = transformer_config()
        module = TinyMLP()
    elif scenario.model == "fp8mlp":
        config = transformer_config()
        module = _build_fp8_mlp(scenario)
        # MXFP8 weights are already final; only cast what is not quantized.
        for param in module.parameters():
            if not hasattr(param, "dequantize"):
                param.data = param.data.to(torch.bfloat16)
        return module, config
    else:
        raise ValueError(f"unknown model {scenario.model!r}; use 'mlp', 'fp8mlp' or 'gpt'")
    return module.to(torch.bfloat16), config
