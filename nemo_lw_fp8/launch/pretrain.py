"""``nemo-lw-fp8 pretrain``: build a recipe, apply YAML + ``key=value`` overrides, check, train.

Run it under ``torchrun`` (one process per GPU, or per CPU rank with ``--cpu``)::

    torchrun --nproc-per-node 8 -m nemo_lw_fp8.cli pretrain --recipe deepseek_v3_mxfp8 \\
        --config-file recipes/deepseek_v3_mxfp8.yaml train.train_iters=1000
    torchrun --nproc-per-node 2 -m nemo_lw_fp8.cli pretrain --recipe tiny_deepseek_v3 --cpu

Order (as Megatron-Bridge's own ``run_recipe.py``): recipe < YAML file < command line. The
plugin's patches are applied before megatron builds anything, and every rule of
:mod:`nemo_lw_fp8.guards` runs on the final configuration (also from Bridge's
``ConfigContainer.validate``), so a bad combination fails before a model exists.
``--cpu`` is the development / demo path: it boots the MXFP8 emulation, installs the CPU
stand-ins of :mod:`nemo_lw_fp8.cpu.bridge` and swaps in the CPU layers.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

_TARGET_PREFIX = "nemo_lw_fp8"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", required=True, help="recipe name (nemo-lw-fp8 recipes lists)")
    parser.add_argument("--config-file", help="YAML with partial overrides keyed by section")
    parser.add_argument(
        "--cpu", action="store_true", help="train on CPU ranks (gloo) with the FP8 emulation"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="resolve, check and print the config; no training"
    )
    parser.add_argument("--losses-json", help="write per-iteration losses (rank 0) to this file")
    parser.add_argument("overrides", nargs="*", help="Hydra-style key=value overrides")


def _boot_cpu() -> None:
    from nemo_lw_fp8.emulation import te_backend

    te_backend.activate()


def resolve_config(
    recipe: str,
    config_file: str | None = None,
    overrides: Sequence[str] = (),
    cpu: bool = False,
    dry_run: bool = False,
) -> Any:
    """The final ``ConfigContainer``: recipe, then YAML, then ``key=value``; checked.

    ``cpu`` / ``dry_run`` boot Transformer Engine (Bridge imports it) through
    :func:`nemo_lw_fp8.emulation.te_backend.activate`: the real TE where it works, the CPU
    emulation otherwise, so a configuration can be checked on any machine.
    """
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ValueError(f"override {item!r} is not key=value (e.g. train.train_iters=10)")
    if cpu or dry_run:
        _boot_cpu()
    import nemo_lw_fp8
    from nemo_lw_fp8 import bridge, recipes

    nemo_lw_fp8.apply()
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides
    from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix

    register_allowed_target_prefix(_TARGET_PREFIX)
    cfg = recipes.get_recipe(recipe)()
    if config_file or overrides:
        cfg = process_config_with_overrides(
            cfg, config_filepath=config_file, cli_overrides=list(overrides)
        )
    if cpu:
        from nemo_lw_fp8.cpu import bridge as cpu_bridge

        cpu_bridge.adapt_config(cfg)
    bridge.finalize(cfg)
    return cfg


def _count_expert_slices(optimizer: Any) -> int:
    """Expert runs (``ExpertSlice``) among the pieces of ``optimizer`` and its chained children."""
    from nemo_lw_fp8.mechanics.expert_slices import is_slice
    from nemo_lw_fp8.state import peek

    record = peek(optimizer)
    pieces = getattr(record, "pieces", {})
    count = sum(1 for group in pieces.values() for piece in group if is_slice(piece))
    for child in getattr(optimizer, "chained_optimizers", []):
        count += _count_expert_slices(child)
    return count


def _reports_losses() -> bool:
    """The first rank of the last pipeline stage (megatron's loss is reduced there)."""
    from megatron.core import parallel_state as ps

    return (
        ps.is_pipeline_last_stage(ignore_virtual=True)
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    )


class _LossRecorder:
    """A Bridge callback keeping each iteration's reduced losses (and eval losses)."""

    def __init__(self) -> None:
        self.train: list[dict[str, float]] = []
        self.eval: list[dict[str, float]] = []
        #: Optimizer pieces that are expert runs of grouped weights, on this rank (see
        #: ``grouped_weight_ownership``); counted once, at the first step.
        self.expert_slices: int | None = None
        #: Whether this rank reports the run: the first rank of the last pipeline stage, where
        #: megatron reduces the losses (rank 0 unless pipeline parallel).
        self.reports: bool | None = None

    @staticmethod
    def _floats(losses: dict[str, Any] | None) -> dict[str, float]:
        out = {}
        for key, value in (losses or {}).items():
            out[key] = float(value.float().item() if hasattr(value, "item") else value)
        return out

    def as_callback(self) -> Any:
        from megatron.bridge.training.callbacks import Callback

        recorder = self

        class Recorder(Callback):
            def on_train_step_end(self, context: Any) -> None:
                recorder.train.append(recorder._floats(context.loss_dict))
                if recorder.expert_slices is None:
                    recorder.expert_slices = _count_expert_slices(context.optimizer)
                    recorder.reports = _reports_losses()

            def on_eval_end(self, context: Any) -> None:
                recorder.eval.append(recorder._floats(context.total_loss_dict))

        return Recorder()


def run(
    recipe: str,
    config_file: str | None = None,
    overrides: Sequence[str] = (),
    cpu: bool = False,
    losses_json: str | None = None,
) -> _LossRecorder:
    """Resolve the config and train with Megatron-Bridge's ``pretrain``."""
    cfg = resolve_config(recipe, config_file, overrides, cpu)
    if cpu:
        from nemo_lw_fp8.cpu import bridge as cpu_bridge

        cpu_bridge.install()
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    recorder = _LossRecorder()
    pretrain(cfg, forward_step, callbacks=[recorder.as_callback()])
    reports = recorder.reports
    if reports is None:
        reports = int(os.environ.get("RANK", "0")) == 0
    if losses_json and reports:
        with open(losses_json, "w") as handle:
            json.dump(
                {
                    "train": recorder.train,
                    "eval": recorder.eval,
                    "grouped_weight_ownership": getattr(
                        cfg.optimizer, "grouped_weight_ownership", None
                    ),
                    "expert_slices": recorder.expert_slices,
                },
                handle,
            )
    return recorder


def main(args: argparse.Namespace) -> int:
    if args.dry_run:
        cfg = resolve_config(args.recipe, args.config_file, args.overrides, args.cpu, dry_run=True)
        print(summary(cfg))
        return 0
    run(args.recipe, args.config_file, args.overrides, args.cpu, args.losses_json)
    return 0


def summary(cfg: Any) -> str:
    """The settings that matter for the plugin, one per line."""
    model, ddp, opt = cfg.model, cfg.ddp, cfg.optimizer
    mixed = cfg.mixed_precision
    rows = {
        "model": type(model).__name__,
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_moe_experts": model.num_moe_experts,
        "multi_latent_attention": getattr(model, "multi_latent_attention", False),
        "TP/PP/EP/ETP": (
            f"{model.tensor_model_parallel_size}/{model.pipeline_model_parallel_size}/"
            f"{model.expert_model_parallel_size}/{model.expert_tensor_parallel_size}"
        ),
        "optimizer": f"{opt.optimizer} ({type(opt).__name__})",
        "layer_wise_layout": getattr(opt, "layer_wise_layout", None),
        "overlap_param_gather": ddp.overlap_param_gather,
        "fp8": getattr(mixed, "fp8", None),
        "fp8_recipe": getattr(mixed, "fp8_recipe", None),
        "fp8_param_gather": getattr(mixed, "fp8_param_gather", None),
        "reuse_grad_buf": getattr(mixed, "reuse_grad_buf_for_mxfp8_param_ag", None),
        "moe_single_grouped_weight": getattr(model, "moe_single_grouped_weight", False),
        "train_iters": cfg.train.train_iters,
    }
    return "\n".join(f"{key}: {value}" for key, value in rows.items())
