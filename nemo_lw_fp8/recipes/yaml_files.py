"""YAML versions of the recipes (``recipes/<name>.yaml``), generated so they never drift.

Each file holds partial overrides keyed by section, Megatron-Bridge's format, with the values the
recipe already has for the settings that matter to the plugin (parallelism, batch, optimizer,
layout, overlap, FP8, grouped experts); edit and pass it with ``--config-file``. Regenerate with
``python -m nemo_lw_fp8.recipes.yaml_files`` (needs Megatron-Bridge);
``tests/recipes/test_recipes.py`` checks the files are current and that applying one to its recipe
changes nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

SECTIONS: dict[str, list[tuple[str, str]]] = {
    # section -> (yaml key, row key)
    "model": [
        ("tensor_model_parallel_size", "tp"),
        ("sequence_parallel", "sequence_parallel"),
        ("pipeline_model_parallel_size", "pp"),
        ("expert_model_parallel_size", "ep"),
        ("expert_tensor_parallel_size", "etp"),
        ("moe_grouped_gemm", "grouped_gemm"),
        ("use_transformer_engine_op_fuser", "op_fuser"),
        ("moe_single_grouped_weight", "single_grouped_weight"),
    ],
    "train": [("global_batch_size", "global_batch_size")],
    "dataset": [("seq_length", "seq_length")],
    "optimizer": [
        ("optimizer", "optimizer"),
        ("layer_wise_layout", "layout"),
        ("overlap_param_gather", "overlap_optimizer"),
    ],
    "ddp": [("overlap_param_gather", "overlap_ddp")],
    "mixed_precision": [
        ("fp8", "fp8"),
        ("fp8_recipe", "fp8_recipe"),
        ("fp8_param_gather", "fp8_param_gather"),
        ("reuse_grad_buf_for_mxfp8_param_ag", "reuse_grad_buf"),
    ],
}


#: ``mixed_precision`` keys written only for NVFP4 recipes (the FP8 ones' files stay as they were).
FP4_KEYS: list[tuple[str, str]] = [
    ("fp4", "fp4"),
    ("fp4_recipe", "fp4_recipe"),
    ("fp4_param_gather", "fp4_param_gather"),
    ("first_last_layers_bf16", "first_last_layers_bf16"),
    ("num_layers_at_start_in_bf16", "bf16_layers_at_start"),
    ("num_layers_at_end_in_bf16", "bf16_layers_at_end"),
]


def _layout_text(layout: Any) -> str | None:
    """A pipeline layout as its string (megatron may hold it parsed)."""
    if layout is None or isinstance(layout, str):
        return layout
    return str(getattr(layout, "layout", layout))


def recipe_row(cfg: Any) -> dict[str, Any]:
    """The plugin-relevant settings of a built ``ConfigContainer`` (flat, JSON-friendly)."""
    from nemo_lw_fp8 import config as plugin_config
    from nemo_lw_fp8.vocabulary import NVFP4_NO_SR_ENV, SINGLE_GROUPED_WEIGHT_ENV

    model, mixed, opt = cfg.model, cfg.mixed_precision, cfg.optimizer
    return {
        "provider": type(model).__name__,
        "optimizer": opt.optimizer,
        "optimizer_class": type(opt).__name__,
        "layout": opt.layer_wise_layout,
        "ddp_layout": getattr(plugin_config.read(cfg.ddp), "layout", None),
        "overlap_ddp": cfg.ddp.overlap_param_gather,
        "overlap_optimizer": opt.overlap_param_gather,
        "fp8": mixed.fp8,
        "fp8_recipe": mixed.fp8_recipe,
        "fp8_param_gather": mixed.fp8_param_gather,
        "reuse_grad_buf": mixed.reuse_grad_buf_for_mxfp8_param_ag,
        "fp4": mixed.fp4,
        "fp4_recipe": mixed.fp4_recipe if mixed.fp4 else None,
        "fp4_param_gather": mixed.fp4_param_gather,
        "first_last_layers_bf16": mixed.first_last_layers_bf16,
        "bf16_layers_at_start": mixed.num_layers_at_start_in_bf16,
        "bf16_layers_at_end": mixed.num_layers_at_end_in_bf16,
        "no_sr_env": cfg.env_vars.get(NVFP4_NO_SR_ENV),
        "single_grouped_weight": model.moe_single_grouped_weight,
        "op_fuser": model.use_transformer_engine_op_fuser,
        "grouped_gemm": model.moe_grouped_gemm,
        "switch_env": cfg.env_vars.get(SINGLE_GROUPED_WEIGHT_ENV),
        "tp": model.tensor_model_parallel_size,
        "sequence_parallel": model.sequence_parallel,
        "pp": model.pipeline_model_parallel_size,
        "vpp": model.virtual_pipeline_model_parallel_size,
        "pipeline_layout": _layout_text(model.pipeline_model_parallel_layout),
        "ep": model.expert_model_parallel_size,
        "clip_grad": opt.clip_grad,
        "muon_tp_mode": opt.muon_tp_mode,
        "mtp_num_layers": getattr(model, "mtp_num_layers", None),
        "etp": model.expert_tensor_parallel_size,
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_moe_experts": model.num_moe_experts,
        "moe_ffn_hidden_size": model.moe_ffn_hidden_size,
        "vocab_size": cfg.tokenizer.vocab_size,
        "multi_latent_attention": bool(getattr(model, "multi_latent_attention", False)),
        "global_batch_size": cfg.train.global_batch_size,
        "seq_length": cfg.dataset.seq_length,
    }


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def render(name: str, row: dict[str, Any]) -> str:
    """The YAML file of recipe ``name`` from its :func:`recipe_row`."""
    from nemo_lw_fp8.recipes import RECIPES
    from nemo_lw_fp8.vocabulary import NVFP4_NO_SR_ENV, SINGLE_GROUPED_WEIGHT_ENV

    lines = [
        f"# {name}: {RECIPES[name].__doc__}",
        f"# nemo-lw-fp8 pretrain --recipe {name} --config-file recipes/{name}.yaml [key=value ...]",
        "# Partial overrides keyed by section (Megatron-Bridge's format). Every value equals the",
        "# recipe's own; edit what you need. Generated: python -m nemo_lw_fp8.recipes.yaml_files",
    ]
    for section, keys in SECTIONS.items():
        lines.append(f"{section}:")
        lines.extend(f"  {key}: {_scalar(row[field])}" for key, field in keys)
        if section == "mixed_precision" and row.get("fp4"):
            lines.extend(f"  {key}: {_scalar(row[field])}" for key, field in FP4_KEYS)
    env = {SINGLE_GROUPED_WEIGHT_ENV: row["switch_env"], NVFP4_NO_SR_ENV: row.get("no_sr_env")}
    if any(value is not None for value in env.values()):
        lines.append("env_vars:")
        lines.extend(f'  {key}: "{value}"' for key, value in env.items() if value is not None)
    return "\n".join(lines) + "\n"


def main(folder: str = "recipes") -> int:
    from nemo_lw_fp8.cpu.te import backend as te_backend

    te_backend.activate()
    import nemo_lw_fp8
    from nemo_lw_fp8 import recipes

    nemo_lw_fp8.apply()
    for name in sorted(recipes.RECIPES):
        row = recipe_row(recipes.get_recipe(name)())
        path = Path(folder) / f"{name}.yaml"
        path.write_text(render(name, row))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
