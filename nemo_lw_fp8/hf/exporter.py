"""``nemo-lw-fp8 hf-export``: a run's ``torch_dist`` checkpoint to Hugging Face safetensors.

Which weights. A run with FP8 param gather computes with FP8 weights (MXFP8 / blockwise bytes,
re-quantized from the fp32 masters after every step); the checkpoint's model entries hold those,
dequantized. The trained weights are the fp32 masters the optimizer keeps. ``masters`` (the
default) exports bf16(master) for every parameter that has one in the checkpoint (layer-wise
Muon saves them whole as ``<chained_N>.optimizer.state.fp32_param.<model key>``) and the model
entry for the others (Adam's parameters: embeddings, output layer, norms; never FP8, so their
bf16 model weight is bf16(master) already). ``compute`` exports the model entries: what the
run's forward passes used. ``AutoBridge.export_ckpt`` exports the latter without saying so, and
cannot rebuild a run with single grouped expert weights at all (``Fused GroupedMLP is not
supported for this configuration``); here the model is rebuilt with discrete expert weights and
the op fuser off (:func:`.setup.conversion_provider`: the checkpoint's keys and values do not
depend on either).

The HF config comes from the run (Bridge's ``megatron_to_hf_config`` of the run's model), not
from an HF checkpoint, so a run trained from scratch exports too; ``nemo_lw_fp8_export.json``
beside it says which weights were exported and where each came from.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from nemo_lw_fp8.errors import UsageError
from nemo_lw_fp8.hf import checks, setup, torch_dist

WEIGHTS = ("masters", "compute")
RECORD = "nemo_lw_fp8_export.json"
#: fp32 master bytes read per load: the masters arrive in batches of about this size (at least
#: one checkpoint entry: every layer of one stacked weight), so the export holds the bf16 model
#: plus one batch, not a second fp32 copy of every matrix.
MASTER_BATCH_BYTES = 2 << 30

#: HF architecture -> transformers' model type, for the families the import supports.
ARCHITECTURES = {
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def hf_architecture(provider: Any) -> str:
    """The HF architecture of a run's model, read from its megatron fields."""
    if getattr(provider, "multi_latent_attention", False):
        if getattr(provider, "q_lora_rank", None) is None:
            return "DeepseekV2ForCausalLM"
        return "DeepseekV3ForCausalLM"
    if getattr(provider, "experimental_attention_variant", None) == "gated_delta_net":
        return "Qwen3NextForCausalLM"
    if getattr(provider, "num_moe_experts", None):
        return "Qwen3MoeForCausalLM"
    raise UsageError(
        f"no HF architecture for a {type(provider).__name__} without MoE experts",
        "hf-export converts the Qwen3 MoE and DeepSeek recipes' runs",
    )


def rope_parameters(provider: Any) -> dict[str, Any]:
    """DeepSeek's YaRN rotary scaling as transformers 5 reads it (``rope_parameters``).

    Why: Bridge 0.6.2's ``megatron_to_hf_config`` looks for ``yarn_*`` fields, which an MLA
    provider names ``rotary_scaling_factor``, ``mscale``, ...; without this the exported config
    says ``rope_type: default`` and transformers computes other rotary angles than the run
    (measured: logits off by 0.2, a tenth of the argmax changed)."""
    if getattr(provider, "rope_type", None) != "yarn":
        return {}
    fields = {
        "factor": "rotary_scaling_factor",
        "original_max_position_embeddings": "original_max_position_embeddings",
        "mscale": "mscale",
        "mscale_all_dim": "mscale_all_dim",
        "beta_fast": "beta_fast",
        "beta_slow": "beta_slow",
    }
    rope = {"rope_type": "yarn", "rope_theta": float(provider.rotary_base)}
    for hf_name, name in fields.items():
        value = getattr(provider, name, None)
        if value is not None:
            rope[hf_name] = float(value) if hf_name != "original_max_position_embeddings" else value
    return {"rope_parameters": rope}


def hf_bridge(provider: Any) -> Any:
    """A config-only ``AutoBridge`` whose HF config is the run's model (Bridge's own
    ``megatron_to_hf_config``, then transformers' config class of that architecture)."""
    import transformers
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.conversion.auto_bridge import _drop_readonly_config_properties

    architecture = hf_architecture(provider)
    config_class = type(transformers.AutoConfig.for_model(ARCHITECTURES[architecture]))
    reference = config_class(architectures=[architecture])
    values = AutoBridge.from_hf_config(reference)._model_bridge.megatron_to_hf_config(provider)
    values = _drop_readonly_config_properties(values, config_class)
    values |= rope_parameters(provider)
    values["architectures"] = [architecture]
    values.pop("model_type", None)
    dtype = values.pop("torch_dtype", "bfloat16")
    config = config_class(**values)
    config.dtype = dtype
    return AutoBridge.from_hf_config(config)


def run_provider(ckpt: Path) -> Any:
    """The run's model provider, from the checkpoint's ``run_config.yaml``."""
    from megatron.bridge.training.model_load_save import load_model_config
    from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix

    register_allowed_target_prefix("nemo_lw_fp8")
    provider, _ = load_model_config(str(ckpt))
    return provider


def load_compute(model: list[Any], ckpt: Path) -> None:
    """The checkpoint's model entries into ``model`` (FP8 weights arrive dequantized)."""
    from megatron.bridge.training.checkpointing import _load_model_weights_from_checkpoint

    _load_model_weights_from_checkpoint(str(ckpt), model, strict=False)


def load_masters(model: list[Any], ckpt: Path) -> tuple[list[str], list[str]]:
    """bf16 of the checkpoint's fp32 masters into ``model`` where it has them; returns the
    parameter names written from masters and those kept from the model entries."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    master_keys = torch_dist.masters(ckpt)
    common = dist_checkpointing.load_common_state_dict(str(ckpt))
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    module = model[0]
    while hasattr(module, "module"):  # Float16Module: the names Bridge and megatron key by
        module = module.module
    sharded = module.sharded_state_dict(metadata=metadata)
    params = dict(module.named_parameters())
    request: dict[str, tuple[Any, str]] = {}
    for name, entry in sharded.items():
        if name not in params or not isinstance(entry, (ShardedTensor, ShardedTensorFactory)):
            continue
        key = master_keys.get(entry.key)
        if key is None:
            continue
        request[name] = (entry, key[: -len(entry.key) - 1])
    for names in _batches(request, params):
        batch = {}
        for name in names:  # fp32 buffers for this batch only
            entry, prefix = request[name]
            buffer = torch.empty(entry.data.shape, dtype=torch.float32, device=entry.data.device)
            batch[name] = make_sharded_optimizer_tensor(entry, buffer, prefix)
        loaded = dist_checkpointing.load(batch, str(ckpt))
        with torch.no_grad():
            for name in batch:
                params[name].copy_(loaded[name].to(torch.bfloat16).view(params[name].shape))
        del loaded, batch
    kept = sorted(set(params) - set(request))
    return sorted(request), kept


def _batches(
    request: dict[str, tuple[Any, str]], params: dict[str, torch.Tensor]
) -> list[list[str]]:
    """Parameter names in loads of about :data:`MASTER_BATCH_BYTES` of fp32 each, every
    checkpoint entry whole: megatron's loader reads a stacked entry (all layers of one weight)
    in one load or refuses (``Number of local shards ... does not match``)."""
    by_entry: dict[str, list[str]] = {}
    for name, (entry, _) in request.items():
        by_entry.setdefault(entry.key, []).append(name)
    batches: list[list[str]] = [[]]
    size = 0
    for names in by_entry.values():
        nbytes = sum(4 * params[name].numel() for name in names)
        if batches[-1] and size + nbytes > MASTER_BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].extend(names)
        size += nbytes
    return batches


def export_hf(run_dir: str, out: str, weights: str = "masters") -> dict[str, Any]:
    """Export the latest checkpoint under ``run_dir`` (or that iteration folder) to ``out``."""
    if weights not in WEIGHTS:
        raise UsageError(f"--weights {weights!r}", f"one of {', '.join(WEIGHTS)}")
    if os.path.exists(out) and os.listdir(out):
        raise UsageError(f"{out} exists and is not empty", "give a new directory for the export")
    try:
        ckpt = torch_dist.iteration_dir(run_dir)
    except FileNotFoundError as error:
        raise UsageError(str(error), "give a run's checkpoint.save folder") from error
    setup.boot()
    if weights == "masters" and not torch_dist.masters(ckpt):
        raise UsageError(
            f"{ckpt} holds no fp32 masters (saved without the optimizer state, or an import)",
            "export it with --weights compute: its model entries are all it has",
        )
    provider = run_provider(ckpt)
    with setup.one_rank():
        setup.conversion_provider(provider)
        provider.finalize()
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
        load_compute(model, ckpt)
        from_masters: list[str] = []
        kept = sorted(name.removeprefix("module.") for name, _ in model[0].named_parameters())
        if weights == "masters":
            from_masters, kept = load_masters(model, ckpt)
        bridge = hf_bridge(provider)
        bridge.save_hf_pretrained(model, out, show_progress=False)
    record = {
        "run": str(ckpt.resolve()),
        "weights": weights,
        "what": (
            "bf16 of the run's fp32 masters (the trained weights); parameters without a saved "
            "master (Adam's: never FP8) from the model entries, which equal bf16(master)"
            if weights == "masters"
            else "the run's model entries: the weights its forward passes computed with "
            "(FP8 weights dequantized)"
        ),
        "from_masters": from_masters,
        "from_model_entries": kept,
    }
    if hf_architecture(provider) == "DeepseekV3ForCausalLM":
        routing = checks.group_routing_difference(provider)
        if routing:  # the weights are right; transformers routes them otherwise
            record["transformers_differs"] = routing
    Path(out, RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return record
