"""``nemo-lw-fp8 hf-import``: a Hugging Face checkpoint into a recipe's ``torch_dist`` checkpoint.

Why not ``AutoBridge.import_ckpt`` as it is: it builds Bridge's model from the HF config (not the
recipe's), needs tokenizer files the weights do not, and copies only the weights Bridge finds,
leaving the rest of the model as uninitialised memory (a DeepSeek-V3 checkpoint re-saved by
transformers has no MTP layer: every MTP weight imported as garbage, values to 3e38 and NaN).
Here the recipe's own model is built for the conversion (:func:`.setup.conversion_provider`),
checked against the HF config first (:mod:`.checks`), every parameter is required to have its
HF weights (refused by name otherwise), and Bridge's mappings copy them. The result is the
checkpoint ``checkpoint.pretrained_checkpoint`` of ``nemo-lw-fp8 pretrain --recipe R`` reads.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_lw_fp8.errors import ConfigError, UsageError
from nemo_lw_fp8.hf import checks, setup

#: Written beside the checkpoint: where it came from and for which recipe.
RECORD = "nemo_lw_fp8_import.json"
#: How many missing weights an error names (then "+N more").
NAMED = 6


def recipe_config(recipe: str, overrides: Sequence[str] = ()) -> Any:
    """The recipe's ``ConfigContainer`` with ``key=value`` overrides applied (Bridge's own
    override syntax, as ``nemo-lw-fp8 pretrain`` reads it)."""
    from nemo_lw_fp8 import recipes

    if recipes.recipe_key(recipe) not in recipes.RECIPES:
        raise UsageError(f"unknown recipe {recipe!r}", "`nemo-lw-fp8 recipes` lists the recipes")
    setup.boot()
    cfg = recipes.get_recipe(recipe)()
    if overrides:
        from nemo_lw_fp8.recipes.factory import with_overrides

        for item in overrides:
            if "=" not in item:
                raise UsageError(f"override {item!r} is not key=value", "model.mtp_num_layers=0")
        hint = "check the keys against `nemo-lw-fp8 pretrain --recipe R --dry-run`"
        cfg = with_overrides(cfg, overrides, hint=hint)
    return cfg


def open_hf(hf_dir: str) -> Any:
    """Bridge's view of an HF checkpoint directory (config now, weights lazily)."""
    import torch

    if not (Path(hf_dir) / "config.json").is_file():
        raise UsageError(
            f"{hf_dir} is not a Hugging Face checkpoint (no config.json)",
            "give the directory that holds config.json and *.safetensors",
        )
    setup.boot()
    from megatron.bridge import AutoBridge

    try:
        return AutoBridge.from_hf_pretrained(hf_dir, dtype=torch.bfloat16)
    except ValueError as error:
        raise UsageError(
            f"Megatron-Bridge cannot read {hf_dir}: {str(error).splitlines()[0]}",
            "a Qwen3 / DeepSeek checkpoint saved by transformers",
        ) from error


def _parameter_names(bridge: Any, model: list[Any]) -> list[str]:
    from megatron.bridge.models.conversion.utils import persistent_buffers

    names = []
    for local_name, _ in itertools.chain(model[0].named_parameters(), persistent_buffers(model[0])):
        if "_extra_state" not in local_name:
            names.append(bridge._model_bridge._unwrap_name(local_name))
    return names


def missing_weights(bridge: Any, model: list[Any]) -> dict[str, list[str]]:
    """Megatron parameter -> the HF names it needs that the checkpoint lacks (``[]``: Bridge
    has no mapping for it at all), for every parameter Bridge would leave unwritten."""
    model_bridge = bridge._model_bridge
    tasks = model_bridge.build_conversion_tasks(bridge.hf_pretrained, model)
    written = {t.param_name for t in tasks if t is not None and t.megatron_module is not None}
    keys = set(bridge.hf_pretrained.state.source.get_all_keys())
    registry = model_bridge.mapping_registry()
    missing: dict[str, list[str]] = {}
    for name in _parameter_names(bridge, model):
        if name in written:
            continue
        mapping = registry.megatron_to_hf_lookup(name)
        wanted: list[str] = []
        if mapping is not None:
            hf = mapping.hf_param
            wanted = [hf] if isinstance(hf, str) else list(hf.values())
        missing[name] = [key for key in wanted if key not in keys]
    return missing


def refuse_missing(missing: dict[str, list[str]], recipe: str, hf_dir: str) -> None:
    """One error naming the first missing weights, how many there are, and the fix."""
    names = sorted(missing)
    shown = ", ".join(names[:NAMED])
    shown += f" (+{len(names) - NAMED} more)" if len(names) > NAMED else ""
    hf_names = sorted({key for keys in missing.values() for key in keys})
    if hf_names:
        shown += "; HF names absent: " + ", ".join(hf_names[:NAMED])
        shown += f" (+{len(hf_names) - NAMED} more)" if len(hf_names) > NAMED else ""
    if all(name.startswith("mtp.") for name in names):
        fix = (
            "this checkpoint has no multi-token-prediction (MTP) weights (transformers drops "
            "them when it re-saves DeepSeek-V3): import and train without MTP, "
            f"`nemo-lw-fp8 hf-import ... --recipe {recipe} model.mtp_num_layers=0` and "
            "`pretrain ... model.mtp_num_layers=0`, or import the original checkpoint with "
            "its MTP layer"
        )
    else:
        fix = "import a checkpoint of this model with all its weights, or choose its recipe"
    raise ConfigError(
        "hf-missing-weights",
        f"the HF checkpoint {hf_dir} lacks the weights of {len(names)} parameters of recipe "
        f"{recipe}, which would stay uninitialised: {shown}. Fix: {fix}.",
    )


def _save(model: list[Any], out: str) -> None:
    from megatron.bridge.training.model_load_save import save_megatron_model

    save_megatron_model(model, out, hf_tokenizer_path=None)


def import_hf(
    hf_dir: str, out: str, recipe: str, overrides: Sequence[str] = ()
) -> dict[str, Any]:
    """Convert ``hf_dir`` into ``out`` (a ``torch_dist`` checkpoint of ``recipe``); returns
    what was done (also written to ``out/nemo_lw_fp8_import.json``)."""
    if os.path.exists(out) and os.listdir(out):
        raise UsageError(f"{out} exists and is not empty", "give a new directory for the import")
    cfg = recipe_config(recipe, overrides)
    bridge = open_hf(hf_dir)
    hf_model = bridge.to_megatron_provider(load_weights=False)
    checks.check(recipe, cfg.model, hf_model, bridge.hf_pretrained.config, hf_dir)
    with setup.one_rank():
        provider = setup.conversion_provider(cfg.model)
        provider.finalize()
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
        missing = missing_weights(bridge, model)
        if missing:
            refuse_missing(missing, recipe, hf_dir)
        bridge.load_hf_weights(model)
        count = len(_parameter_names(bridge, model))
        _save(model, out)
    record = {
        "source": str(Path(hf_dir).resolve()),
        "recipe": recipe,
        "overrides": list(overrides),
        "parameters": count,
        "use": " ".join(
            ["nemo-lw-fp8 pretrain --recipe", recipe, *overrides,
             f"checkpoint.pretrained_checkpoint={out}"]
        ),  # fmt: skip
    }
    Path(out, RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return record
