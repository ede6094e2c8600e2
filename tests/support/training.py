"""Small, deterministic training runs over real megatron-core DDP and optimizers (CPU ranks).

Every function here runs *inside* a rank of :mod:`tests.support.harness`. :func:`train` builds
the :class:`~tests.support.scenarios.Scenario`'s model, wraps it in megatron DDP with the
optimizer it names, trains it for a few steps on per-rank data, and returns what parity tests
compare: per-step losses, the final parameters, and a digest of them (plus, on request, eval
losses, main_grads, fp32 masters and the weights the FP8 GEMMs see).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from tests.support.checkpoints import (
    load_checkpoint,
    load_named_checkpoint,
    save_checkpoint,
    save_named_checkpoint,
)
from tests.support.scenarios import (
    DISTRIBUTIONS,
    GPT_SEQ,
    GPT_VOCAB,
    TE_MODELS,
    Scenario,
    build_model,
    te_scope,
)

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
        fp4_param_gather=scenario.fp4_param_gather,
        reuse_grad_buf_for_mxfp8_param_ag=_reuse_grad_buf(scenario),
    )
    if dist_mode == "layerwise_compact":
        if not scenario.plugin:
            raise ValueError("distribution='layerwise_compact' needs plugin=True")
        from nemo_lw_fp8.config import DEFAULT_GATHER_PADDING_TOLERANCE, LayerWiseConfig

        tolerance = scenario.gather_padding_tolerance
        chosen = {} if scenario.grad_sync is None else {"grad_sync": scenario.grad_sync}
        LayerWiseConfig(
            layout="compact",
            gather_padding_tolerance=DEFAULT_GATHER_PADDING_TOLERANCE
            if tolerance is None
            else tolerance,
            grouped_weight_ownership=scenario.grouped_weight_ownership,
            qkv_ownership=scenario.qkv_ownership,
            **chosen,
            bucket_cap_numel=scenario.bucket_cap_numel,
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
        muon_split_qkv=scenario.muon_split_qkv,
        muon_tp_mode=scenario.muon_tp_mode,
        fp8_recipe=scenario.fp8_recipe if scenario.fp8 else None,
        reuse_grad_buf_for_mxfp8_param_ag=_reuse_grad_buf(scenario),
    )
    if not scenario.fp8_on_optimizer_config:
        opt_config.fp8_recipe = None
        opt_config.reuse_grad_buf_for_mxfp8_param_ag = False
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
    # megatron's forward_step marks each step's first microbatch: TE's linears then re-quantize
    # their bf16 weights instead of reusing the FP8 copy cached at the last step
    if hasattr(model[0], "set_is_first_microbatch"):
        model[0].set_is_first_microbatch()
    with te_scope(scenario):  # TE's modules ask the device in their forward and backward
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
        if hasattr(model[0], "set_is_first_microbatch"):  # megatron's first eval step does too
            model[0].set_is_first_microbatch()
        with te_scope(scenario):
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
    from nemo_lw_fp8.cpu.formats import mxfp8 as mx
    from nemo_lw_fp8.cpu.layers.blockwise_linear import (
        BlockwiseFP8Linear,
        _columnwise_weight,
        quantize_dequantize_weight,
    )
    from nemo_lw_fp8.cpu.layers.mxfp8_linear import (
        MXFP8Linear,
        quantize_dequantize,
        weight_columnwise,
    )

    def blockwise_forms(sub) -> tuple[torch.Tensor, torch.Tensor]:
        value = quantize_dequantize_weight(sub.weight.detach()).float()
        return value, value

    def mxfp8_forms(sub) -> tuple[torch.Tensor, torch.Tensor]:
        weight = sub.weight.detach()
        columnwise = mx.quantize(weight, rowwise=False, columnwise=True, two_d=sub.two_d_weights)
        return (
            quantize_dequantize(weight, two_d=sub.two_d_weights).float(),
            mx.dequantize(columnwise, use="columnwise").float(),
        )

    #: linear class -> (columnwise form of a quantized weight, both forms of a bf16 weight)
    kinds = {
        BlockwiseFP8Linear: (_columnwise_weight, blockwise_forms),
        MXFP8Linear: (weight_columnwise, mxfp8_forms),
    }
    out = {}
    for name, sub in module.named_modules():
        kind = next((k for k in kinds if isinstance(sub, k)), None)
        if kind is None:
            continue
        stored_columnwise, computed_forms = kinds[kind]
        if _uses_quantized_storage(sub.weight):
            out[name] = sub.weight.dequantize().detach().float()
            # The dgrad GEMM reads the columnwise copy: it must be the same, current weight.
            out[name + ":columnwise"] = stored_columnwise(sub.weight).detach().float()
        else:
            out[name], out[name + ":columnwise"] = computed_forms(sub)
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


def state_by_part(optimizer, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """fp32 masters and Muon momentum of every mixed-precision optimizer (not the sibling
    DistributedOptimizer's shards) by name, a fused QKV weight's per part
    (:func:`master_snapshot`'s naming), however it is owned."""

    names = {id(p): n for n, p in module.named_parameters()}
    out: dict[str, torch.Tensor] = {}

    def walk(opt) -> None:
        for child in getattr(opt, "chained_optimizers", None) or []:
            walk(child)
        if not hasattr(opt, "fp32_from_float16_groups"):
            return
        for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True):
            for param, main in zip(models, mains, strict=True):
                state = opt.optimizer.state.get(main, {})
                kinds = {"master": main, "momentum": state.get("momentum_buffer")}
                for kind, value in kinds.items():
                    if value is not None:
                        for name, part in _named_master(names, param, value).items():
                            out[f"{kind}:{name}"] = part

    walk(optimizer)
    return out


def _named_master(
    names: dict[int, str], model_param: torch.Tensor, main_param: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A master by its parameter's name; an expert slice's master as its experts' masters
    under the discrete names (``<grouped name><expert>``); a fused QKV weight's master as its
    parts' (``<name>.qkv_part<j>``), whether one rank owns it whole or several own its parts."""
    from nemo_lw_fp8.mechanics import qkv_parts
    from nemo_lw_fp8.mechanics.expert_slices import is_slice

    if qkv_parts.is_part(model_param):
        name = names[id(model_param.parent)]
        return {f"{name}.qkv_part{model_param.index}": main_param.detach().clone()}
    shapes = qkv_parts.split_shapes(model_param)
    if shapes is not None:
        name = names[id(model_param)]
        parts = qkv_parts.parts_of(main_param.detach(), shapes)
        return {f"{name}.qkv_part{j}": part for j, part in enumerate(parts)}
    if not is_slice(model_param):
        return {names[id(model_param)]: main_param.detach().clone()}
    name = names[id(model_param.parent)]
    return {
        f"{name}{model_param.lo + k}": member.detach().clone()
        for k, member in enumerate(main_param.unbind(0))
    }


def qkv_parts_owned(optimizer) -> int:
    """How many QKV parts (:class:`nemo_lw_fp8.mechanics.qkv_parts.QKVPart`) this rank owns."""
    from nemo_lw_fp8.mechanics import qkv_parts

    children = getattr(optimizer, "chained_optimizers", None)
    if children is not None:
        return sum(qkv_parts_owned(child) for child in children)
    groups = getattr(optimizer, "float16_groups", [])
    return sum(1 for group in groups for param in group if qkv_parts.is_part(param))


def qkv_part_names(optimizer, module: torch.nn.Module) -> list[str]:
    """The QKV parts this rank owns, as ``<fused weight's name>.qkv_part<j>``."""
    from nemo_lw_fp8.mechanics import qkv_parts

    names = {id(p): n for n, p in module.named_parameters()}
    children = getattr(optimizer, "chained_optimizers", None)
    if children is not None:
        return [name for child in children for name in qkv_part_names(child, module)]
    return [
        f"{names[id(param.parent)]}.qkv_part{param.index}"
        for group in getattr(optimizer, "float16_groups", [])
        for param in group
        if qkv_parts.is_part(param)
    ]


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
            save_named_checkpoint(model, optimizer, scenario.save_dir)
        else:
            save_checkpoint(model, optimizer, scenario.save_dir)
    params = param_snapshot(model[0].module)
    extra: dict[str, Any] = {
        "eval_losses": eval_losses,
        "bucket_groups": bucket_group_layout(model),
    }
    if scenario.model in TE_MODELS:
        extra["te_modules"] = te_module_names(model[0].module)
    if scenario.fp8:
        extra["effective_weights"] = effective_weights(model[0].module)
        extra["probe_output"] = probe_output(scenario, model)
    if record is not None:
        extra["main_grads"] = record.get("main_grads", [])
        extra["masters"] = master_snapshot(optimizer, model[0].module)
        extra["momenta"] = {
            name.removeprefix("momentum:"): value
            for name, value in state_by_part(optimizer, model[0].module).items()
            if name.startswith("momentum:")
        }
    return {
        "losses": losses,
        "params": params,
        "digest": digest(params),
        "optimizer": type(optimizer).__name__,
        "layer_wise": uses_layer_wise(optimizer),
        "qkv_parts": qkv_parts_owned(optimizer),
        "qkv_part_names": qkv_part_names(optimizer, model[0].module),
        "seconds": elapsed,
        **extra,
    }


def te_module_names(module: torch.nn.Module) -> list[str]:
    """The class names of the model's Transformer Engine modules (TE's ``Linear``,
    ``LayerNormLinear``, ``DotProductAttention``, norms, and megatron's wrappers of them)."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
    from transformer_engine.pytorch.module.layernorm import LayerNorm
    from transformer_engine.pytorch.module.rmsnorm import RMSNorm

    kinds = (TransformerEngineBaseModule, LayerNorm, RMSNorm)
    return sorted({type(sub).__name__ for sub in module.modules() if isinstance(sub, kinds)})


def probe_output(scenario: Scenario, model: list) -> torch.Tensor:
    """The model's output on a fixed input (call after :func:`final_sync`: pre-hooks are off)."""
    with torch.no_grad(), te_scope(scenario):
        inputs, _ = _rank_batch(scenario, model[0].module, step=20_000, dp_rank=0)
        if scenario.model in ("gpt", "moe_gpt", "moe_grouped"):
            positions = torch.arange(GPT_SEQ).unsqueeze(0).expand_as(inputs)
            return model[0](inputs, positions, None).detach().clone()
        return model[0](inputs).detach().clone()
