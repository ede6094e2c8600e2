"""Small, deterministic training runs over real megatron-core DDP and optimizers (CPU ranks).

Every function here runs *inside* a rank of :mod:`nemo_lw_fp8.testing.harness`. A
:class:`Scenario` names the optimizer and the way parameters are distributed; :func:`train` builds
the model from a fixed seed (identical on all ranks and in every scenario), trains it for a few
steps on per-rank data, and returns what parity tests compare: per-step losses, the final
parameters, and a digest of them.

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

import hashlib
from dataclasses import dataclass, replace
from typing import Any

import torch

DISTRIBUTIONS = ("ddp", "distopt", "layerwise_legacy", "layerwise_padded", "layerwise_compact")


@dataclass(frozen=True)
class Scenario:
    """One way to train the same model; parity tests compare scenarios with each other."""

    optimizer: str = "adam"  # "adam" or "muon"
    distribution: str = "ddp"
    overlap: bool = False  # overlap_grad_reduce + overlap_param_gather
    model: str = "mlp"  # "mlp" or "gpt"
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
    #: Expert-parallel size the model is built for (run it with ParallelSpec(ep=...)).
    ep: int = 1
    #: model "moe_grouped": one TE GroupedTensor per expert linear (``moe_single_grouped_weight``
    #: + ``NVTE_GROUPED_LINEAR_SINGLE_PARAM``) instead of E discrete weights.
    single_grouped_weight: bool = False
    #: Checkpoints keyed by parameter name in the discrete expert layout (model "moe_grouped"):
    #: save single grouped, load discrete, and the reverse.
    named_checkpoint: bool = False
    #: model "moe_grouped": fused wgrad accumulation in the expert layers (TE's behaviour under
    #: ``gradient_accumulation_fusion``): expert wgrads go straight into ``main_grad``.
    grad_accum_fusion: bool = False
    #: Compact layout: how single grouped expert weights are owned ("whole", "expert", "auto").
    grouped_weight_ownership: str = "whole"

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
        from nemo_lw_fp8.emulation.fp8_linear import MXFP8Linear

        super().__init__(widths, linear=MXFP8Linear, norm_dtype=torch.bfloat16)


class TinyBlockwiseMLP(TinyMLP):
    """Blockwise FP8 linear layers (128x128 weight tiles; Muon matrices) with bf16 biases and
    LayerNorms (Adam); widths multiples of 128, several tiles per matrix, and K = 128 / 384 so
    TE's scale buffers carry round-up padding."""

    def __init__(self, widths: tuple[int, ...] = (128, 256, 384, 128, 256, 128)):
        from nemo_lw_fp8.emulation.blockwise_linear import BlockwiseFP8Linear

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


def _build_moe_grouped(scenario: Scenario):
    """The tiny MoE GPT whose experts are :class:`~nemo_lw_fp8.testing.grouped_experts.
    GroupedExperts` (TE's grouped-weight presentation, CPU GEMMs); needs the FP8 emulation boot."""
    import contextlib

    from nemo_lw_fp8.testing.grouped_experts import moe_block_spec, single_param_env

    config = transformer_config(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        add_bias_linear=False,
        moe_token_dispatcher_type="allgather",
        expert_model_parallel_size=scenario.ep,
        # fp64 routing takes megatron's torch.mm path (TE's router GEMM is a CUDA kernel).
        moe_router_dtype="fp64",
        moe_grouped_gemm=True,
        use_transformer_engine_op_fuser=True,
        moe_single_grouped_weight=scenario.single_grouped_weight,
    )
    init: Any = contextlib.nullcontext()
    if scenario.fp8_param_gather:
        from transformer_engine.common.recipe import MXFP8BlockScaling
        from transformer_engine.pytorch import quantized_model_init

        init = quantized_model_init(
            enabled=True, recipe=MXFP8BlockScaling(), preserve_high_precision_init_val=True
        )
    from megatron.core.models.gpt import GPTModel

    with single_param_env(scenario.single_grouped_weight), init:
        module = GPTModel(
            config=config,
            transformer_layer_spec=moe_block_spec(
                config.num_layers, scenario.fp8, fuse_wgrad_accumulation=scenario.grad_accum_fusion
            ),
            vocab_size=GPT_VOCAB,
            max_sequence_length=GPT_SEQ,
            pre_process=True,
            post_process=True,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
        )
    # Grouped and MXFP8 expert weights are final; cast only plain parameters.
    for param in module.parameters():
        if type(param.data) is torch.Tensor:
            param.data = param.data.to(torch.bfloat16)
    return module, config


def transformer_config(**overrides: Any):
    """A small TransformerConfig that megatron's DDP and GPT code accept on CPU."""
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
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


GPT_VOCAB = 128
GPT_SEQ = 16


def build_gpt(config) -> torch.nn.Module:
    """A tiny GPTModel on megatron-core's local (non-TE) layer spec (MoE when the config has
    experts)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=GPT_VOCAB,
        max_sequence_length=GPT_SEQ,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )


def seed_all(seed: int) -> None:
    """Seed the CPU generator and megatron's model-parallel RNG tracker identically everywhere."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_model(scenario: Scenario):
    """Build the scenario's bf16 model from its seed; returns (module, transformer_config)."""
    if scenario.plugin:
        import nemo_lw_fp8

        nemo_lw_fp8.apply()
    seed_all(scenario.seed)
    if scenario.model == "gpt":
        config = transformer_config()
        module = build_gpt(config)
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
        module = build_gpt(config)
    elif scenario.model == "moe_grouped":
        return _build_moe_grouped(scenario)
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


# --------------------------------------------------------------------------- wrapping


def wrap_and_build_optimizer(module: torch.nn.Module, config, scenario: Scenario):
    """Wrap ``module`` in megatron DDP as the scenario asks and build its megatron optimizer."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.training import wrap_model_chunks_with_ddp

    dist_mode = scenario.distribution
    if dist_mode not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {dist_mode!r}; one of {DISTRIBUTIONS}")
    layer_wise = dist_mode.startswith("layerwise")
    if layer_wise and scenario.optimizer != "muon":
        raise ValueError("layer-wise distribution needs optimizer='muon'")

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=scenario.overlap,
        overlap_param_gather=scenario.overlap,
        use_distributed_optimizer=dist_mode == "distopt",
        bucket_size=scenario.bucket_size,
        fp8_param_gather=scenario.fp8_param_gather,
        reuse_grad_buf_for_mxfp8_param_ag=_reuse_grad_buf(scenario),
    )
    if dist_mode == "layerwise_compact":
        if not scenario.plugin:
            raise ValueError("distribution='layerwise_compact' needs plugin=True")
        from nemo_lw_fp8.config import DEFAULT_GATHER_PADDING_TOLERANCE, LayerWiseConfig

        tolerance = scenario.gather_padding_tolerance
        LayerWiseConfig(
            layout="compact",
            gather_padding_tolerance=DEFAULT_GATHER_PADDING_TOLERANCE
            if tolerance is None
            else tolerance,
            grouped_weight_ownership=scenario.grouped_weight_ownership,
        ).attach(ddp_config)
    model = wrap_model_chunks_with_ddp(
        [module],
        config,
        ddp_config,
        use_layer_wise_distributed_optimizer=layer_wise,
        use_layer_wise_param_layout=dist_mode in ("layerwise_padded", "layerwise_compact"),
        disable_bucketing_per_chunk=[scenario.single_bucket_group],
    )
    opt_config = OptimizerConfig(
        optimizer=scenario.optimizer,
        lr=scenario.lr,
        min_lr=scenario.lr,
        weight_decay=0.01,
        bf16=True,
        params_dtype=torch.bfloat16,
        clip_grad=scenario.clip_grad,
        use_distributed_optimizer=dist_mode == "distopt",
        use_layer_wise_distributed_optimizer=layer_wise,
        overlap_param_gather=scenario.overlap,
        muon_fp32_matmul_prec="highest",
        fp8_recipe=scenario.fp8_recipe if scenario.fp8 else None,
        reuse_grad_buf_for_mxfp8_param_ag=_reuse_grad_buf(scenario),
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    return model, optimizer


def _reuse_grad_buf(scenario: Scenario) -> bool:
    """MXFP8 gathers stage bf16 in the grad buffer; blockwise gathers ship FP8 bytes instead."""
    return scenario.fp8_param_gather and scenario.fp8_recipe != "blockwise"


# --------------------------------------------------------------------------- data and steps


def _rank_batch(scenario: Scenario, module: torch.nn.Module, step: int, dp_rank: int):
    """Deterministic per-(step, rank) inputs, independent of the global RNG."""
    generator = torch.Generator().manual_seed(scenario.seed * 1000 + step * 17 + dp_rank)
    if scenario.model in ("gpt", "moe_gpt", "moe_grouped"):
        shape = (scenario.micro_batch, GPT_SEQ + 1)
        if scenario.data == "pattern":
            # Each row counts up by a row-specific stride: next token = previous + stride.
            start = torch.randint(0, GPT_VOCAB, (shape[0], 1), generator=generator)
            stride = torch.randint(1, 4, (shape[0], 1), generator=generator)
            tokens = (start + stride * torch.arange(shape[1])) % GPT_VOCAB
        else:
            tokens = torch.randint(0, GPT_VOCAB, shape, generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    x = torch.randn(scenario.micro_batch, module.in_features, generator=generator)
    y = torch.randn(scenario.micro_batch, module.out_features, generator=generator)
    return x.to(torch.bfloat16), y


def forward_loss(scenario: Scenario, model, batch) -> torch.Tensor:
    inputs, target = batch
    if scenario.model in ("gpt", "moe_gpt", "moe_grouped"):
        positions = torch.arange(GPT_SEQ).unsqueeze(0).expand_as(inputs)
        per_token = model(inputs, positions, None, labels=target)
        return per_token.float().mean()
    out = model(inputs)
    return torch.nn.functional.mse_loss(out.float(), target)


def train_step(
    scenario: Scenario, model: list, optimizer, step: int, dp_rank: int, record: dict | None = None
) -> float:
    """One step as megatron's ``train_step`` does it: zero buffers (and, with MXFP8 grad-buffer
    reuse and overlapped gathers, re-stage DistributedOptimizer masters the way megatron's loop
    does), forward/backward, finish grad sync, step."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    _megatron_restage_distopt(model, optimizer)
    batch = _rank_batch(scenario, model[0].module, step, dp_rank)
    loss = forward_loss(scenario, model[0], batch)
    loss.backward()
    for chunk in model:
        chunk.finish_grad_sync()
    if record is not None:
        record.setdefault("main_grads", []).append(main_grad_snapshot(model[0].module))
    ok, _grad_norm, _ = optimizer.step()
    if not ok:
        raise RuntimeError(f"optimizer step {step} was skipped")
    return float(loss.detach())


def _megatron_restage_distopt(model: list, optimizer) -> None:
    """What megatron's ``train_step`` does after zeroing: stage DistOpt masters (only those)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    config = model[0].ddp_config
    if not (config.reuse_grad_buf_for_mxfp8_param_ag and config.overlap_param_gather):
        return
    if not len(model[0].remove_forward_pre_hook_handles):
        return
    for child in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(child, DistributedOptimizer):
            child._copy_main_params_to_param_buffer()


def evaluate(scenario: Scenario, model: list, optimizer) -> float:
    """An eval forward the way megatron's loop does it: forced param sync, no pre-hooks (or,
    with ``eval_pre_hooks``, the pre-hooks gather the last step's params during the forward)."""
    from megatron.training.training import disable_forward_pre_hook, enable_forward_pre_hook

    overlapped = model[0].ddp_config.overlap_param_gather and not scenario.eval_pre_hooks
    if overlapped:
        disable_forward_pre_hook(model, optimizer=optimizer)
    with torch.no_grad():
        batch = _rank_batch(scenario, model[0].module, step=10_000, dp_rank=0)
        loss = float(forward_loss(scenario, model[0], batch))
    if overlapped:
        enable_forward_pre_hook(model)
    return loss


def final_sync(model: list, optimizer=None) -> None:
    """Make the last step's parameters visible the way megatron's ``train()`` ends: pre-hooks
    off with a forced sync, then the final checkpoint save's ``force_param_sync``."""
    if model[0].ddp_config.overlap_param_gather:
        from megatron.training.training import disable_forward_pre_hook, force_param_sync

        disable_forward_pre_hook(model, optimizer=optimizer)
        force_param_sync(model, optimizer=optimizer)


def _optimizer_state(child) -> dict[str, Any]:
    """What one chained optimizer holds on this rank, exactly."""
    if hasattr(child, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
        return {
            "inner": child.optimizer.state_dict(),
            "masters": [
                [p.detach().clone() for p in g] for g in child.shard_fp32_from_float16_groups
            ],
        }
    return {"state_dict": child.state_dict()}


def _load_optimizer_state(child, state: dict[str, Any]) -> None:
    if "inner" in state:
        child.optimizer.load_state_dict(state["inner"])
        for group, saved in zip(
            child.shard_fp32_from_float16_groups, state["masters"], strict=True
        ):
            for param, value in zip(group, saved, strict=True):
                param.data.copy_(value)
    else:
        child.load_state_dict(state["state_dict"])


def save_checkpoint(model: list, optimizer, directory: str) -> None:
    """A fixed-DP, per-rank checkpoint: model state dict and every chained optimizer's state.

    megatron-core 0.19.2's own "torch" format cannot serve here: beside a layer-wise optimizer
    the DistributedOptimizer has no gloo group (``get_parameter_state_dp_zero`` asserts),
    ``ChainedOptimizer.save_parameter_state`` drops the layer-wise child while
    ``load_parameter_state`` indexes by child position, and the dp-zero loader expects TE's
    FusedAdam state layout, not torch's. (torch_dist, megatron's default format, takes none
    of these paths.) What matters to the plugin is that weights, masters and optimizer state
    come back to the bit.
    """
    import os

    import torch.distributed as dist

    os.makedirs(directory, exist_ok=True)
    children = getattr(optimizer, "chained_optimizers", [optimizer])
    torch.save(
        {
            "model": model[0].module.state_dict(),
            "optimizers": [_optimizer_state(child) for child in children],
        },
        os.path.join(directory, f"rank{dist.get_rank()}.pt"),
    )


def load_checkpoint(model: list, optimizer, directory: str) -> None:
    """Load what :func:`save_checkpoint` wrote into a freshly built model and optimizer."""
    import os

    import torch.distributed as dist

    state = torch.load(os.path.join(directory, f"rank{dist.get_rank()}.pt"), weights_only=False)
    model[0].module.load_state_dict(state["model"])
    children = getattr(optimizer, "chained_optimizers", [optimizer])
    for child, child_state in zip(children, state["optimizers"], strict=True):
        _load_optimizer_state(child, child_state)


def bucket_group_layout(model: list) -> list[list[str]]:
    """For each bucket group, who owns each bucket: "layerwise" or "distopt" (+ ":fp8")."""
    groups = []
    for chunk in model:
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            kinds = []
            for bucket in group.buckets:
                param = bucket.params_list[0]
                owner = (
                    "layerwise"
                    if getattr(param, "is_managed_by_layer_wise_optimizer", False)
                    else "distopt"
                )
                fp8 = ":fp8" if any(_uses_quantized_storage(p) for p in bucket.params_list) else ""
                kinds.append(owner + fp8)
            groups.append(kinds)
    return groups


def uses_layer_wise(optimizer) -> bool:
    """Whether ``optimizer`` is, or chains, a LayerWiseDistributedOptimizer."""
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    if isinstance(optimizer, LayerWiseDistributedOptimizer):
        return True
    return any(uses_layer_wise(child) for child in getattr(optimizer, "chained_optimizers", []))


def param_snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameter values as fp32 (MXFP8 parameters dequantized)."""
    return {name: _value(p) for name, p in module.named_parameters()}


def _value(param: torch.Tensor) -> torch.Tensor:
    dequantize = getattr(param, "dequantize", None)
    if dequantize is not None and _uses_quantized_storage(param):
        return dequantize().detach().clone().float()
    return param.detach().clone().float()


def _uses_quantized_storage(param: torch.Tensor) -> bool:
    from megatron.core.distributed.param_and_grad_buffer import _param_uses_quantized_storage

    return bool(_param_uses_quantized_storage(param))


def effective_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What each MXFP8 linear layer's GEMM actually uses: the weight after MXFP8 rounding."""
    from nemo_lw_fp8.emulation.blockwise_linear import (
        BlockwiseFP8Linear,
        _columnwise_weight,
        quantize_dequantize_weight,
    )
    from nemo_lw_fp8.emulation.fp8_linear import MXFP8Linear, quantize_dequantize

    out = {}
    for name, sub in module.named_modules():
        if isinstance(sub, BlockwiseFP8Linear):
            weight = sub.weight
            if _uses_quantized_storage(weight):
                out[name] = weight.dequantize().detach().float()
                # The dgrad GEMM reads the columnwise form: it must be the same weight.
                out[name + ":columnwise"] = _columnwise_weight(weight).detach().float()
            else:
                value = quantize_dequantize_weight(weight.detach()).float()
                out[name] = value
                out[name + ":columnwise"] = value
            continue
        if isinstance(sub, MXFP8Linear):
            weight = sub.weight
            if _uses_quantized_storage(weight):
                out[name] = weight.dequantize().detach().float()
            else:
                out[name] = quantize_dequantize(weight.detach()).float()
    return out


def main_grad_snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: p.main_grad.detach().clone()
        for name, p in module.named_parameters()
        if getattr(p, "main_grad", None) is not None
    }


def master_snapshot(optimizer, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The fp32 masters this rank holds (whole params for layer-wise, shards for DistOpt)."""
    names = {id(p): name for name, p in module.named_parameters()}
    masters: dict[str, torch.Tensor] = {}

    def walk(opt) -> None:
        for child in getattr(opt, "chained_optimizers", []):
            walk(child)
        if hasattr(opt, "shard_fp32_from_float16_groups"):
            pairs = zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True)
        elif hasattr(opt, "fp32_from_float16_groups"):
            pairs = zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True)
        else:
            return
        for model_group, main_group in pairs:
            for model_param, main_param in zip(model_group, main_group, strict=True):
                masters.update(_named_master(names, model_param, main_param))

    walk(optimizer)
    return masters


def _named_master(
    names: dict[int, str], model_param: torch.Tensor, main_param: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A master by its parameter's name; an expert slice's master as its experts' masters
    under the discrete names (``<grouped name><expert>``)."""
    from nemo_lw_fp8.mechanics.expert_slices import is_slice

    if not is_slice(model_param):
        return {names[id(model_param)]: main_param.detach().clone()}
    name = names[id(model_param.parent)]
    return {
        f"{name}{model_param.lo + k}": member.detach().clone()
        for k, member in enumerate(main_param.unbind(0))
    }


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """A hash of the exact bytes, for cheap cross-rank comparisons."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _progress_line(step: int, total: int, loss: float, elapsed: float) -> str:
    width = 24
    filled = round(width * step / total)
    bar = "#" * filled + "." * (width - filled)
    return f"[{bar}] step {step:>3}/{total}  loss {loss:.4f}  {elapsed:6.1f}s"


def train(scenario: Scenario, progress: bool = False) -> dict[str, Any]:
    """Train ``scenario`` on this rank; returns losses, final params and their digest.

    With ``progress=True`` data-parallel rank 0 prints a progress bar and a loss line per step.
    """
    import time

    from megatron.core import parallel_state

    module, config = build_model(scenario)
    model, optimizer = wrap_and_build_optimizer(module, config, scenario)
    dp_rank = parallel_state.get_data_parallel_rank()
    losses: list[float] = []
    eval_losses: list[float] = []
    record: dict | None = {} if scenario.snapshots else None
    overlapped = model[0].ddp_config.overlap_param_gather
    start = time.perf_counter()
    if scenario.load_dir is not None:
        if scenario.named_checkpoint:
            from nemo_lw_fp8.testing.grouped_experts import load_named_checkpoint

            load_named_checkpoint(model, optimizer, scenario.load_dir)
        else:
            load_checkpoint(model, optimizer, scenario.load_dir)
    first = scenario.first_step
    for step in range(first, scenario.steps):
        if overlapped and step == first:
            # megatron's loop: the first step runs without pre-hooks (weights are already in
            # place), hooks go on once a step has succeeded.
            from megatron.training.training import disable_forward_pre_hook

            disable_forward_pre_hook(model, param_sync=False)
        losses.append(train_step(scenario, model, optimizer, step, dp_rank, record))
        if overlapped and step == first:
            from megatron.training.training import enable_forward_pre_hook

            enable_forward_pre_hook(model)
        if step in scenario.eval_after:
            eval_losses.append(evaluate(scenario, model, optimizer))
        if progress and dp_rank == 0:
            line = _progress_line(step + 1, scenario.steps, losses[-1], time.perf_counter() - start)
            print(line, flush=True)
    final_sync(model, optimizer)
    elapsed = time.perf_counter() - start
    if scenario.save_dir is not None:
        if scenario.named_checkpoint:
            from nemo_lw_fp8.testing.grouped_experts import save_named_checkpoint

            save_named_checkpoint(model, optimizer, scenario.save_dir)
        else:
            save_checkpoint(model, optimizer, scenario.save_dir)
    params = param_snapshot(model[0].module)
    extra: dict[str, Any] = {
        "eval_losses": eval_losses,
        "bucket_groups": bucket_group_layout(model),
    }
    if scenario.fp8:
        extra["effective_weights"] = effective_weights(model[0].module)
        extra["probe_output"] = probe_output(scenario, model)
    if record is not None:
        extra["main_grads"] = record.get("main_grads", [])
        extra["masters"] = master_snapshot(optimizer, model[0].module)
    return {
        "losses": losses,
        "params": params,
        "digest": digest(params),
        "optimizer": type(optimizer).__name__,
        "layer_wise": uses_layer_wise(optimizer),
        "seconds": elapsed,
        **extra,
    }


def probe_output(scenario: Scenario, model: list) -> torch.Tensor:
    """The model's output on a fixed input (call after :func:`final_sync`: pre-hooks are off)."""
    with torch.no_grad():
        inputs, _ = _rank_batch(scenario, model[0].module, step=20_000, dp_rank=0)
        if scenario.model in ("gpt", "moe_gpt", "moe_grouped"):
            positions = torch.arange(GPT_SEQ).unsqueeze(0).expand_as(inputs)
            return model[0](inputs, positions, None).detach().clone()
        return model[0](inputs).detach().clone()
