"""``nemo-lw-fp8 pretrain``: build a recipe, apply YAML + ``key=value`` overrides, check, train.

Run it under ``torchrun`` (one process per GPU, or per CPU rank with ``--cpu``)::

    torchrun --nproc-per-node 8 -m nemo_lw_fp8.cli pretrain --recipe deepseek_v3_mxfp8 \\
        --config-file recipes/deepseek_v3_mxfp8.yaml train.train_iters=1000
    torchrun --nproc-per-node 2 -m nemo_lw_fp8.cli pretrain --recipe tiny_deepseek_v3 --cpu

Order (as Megatron-Bridge's own ``run_recipe.py``): recipe < YAML file < command line. The
plugin's patches are applied before megatron builds anything, and every rule of
:mod:`nemo_lw_fp8.rules` runs on the final configuration (also from Bridge's
``ConfigContainer.validate``), so a bad combination fails before a model exists.
``--cpu`` is the development / demo path: it boots the MXFP8 emulation, installs the CPU
stand-ins of :mod:`nemo_lw_fp8.cpu.megatron.bridge_pretrain` and swaps in the CPU layers.

Before anything is built, the recipe name, the YAML file and every override are checked
(:mod:`.overrides`: keys exist, values have the field's type, counts and rates are in range), so
a mistake is one line naming the key and the fix (:class:`nemo_lw_fp8.cli.UsageError`). Rank 0
prints one progress line with an ETA per iteration (every few on long runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from nemo_lw_fp8.cli import overrides as checks
from nemo_lw_fp8.errors import BRIDGE_INSTALL_HINT, UsageError

#: How many progress lines a run prints at most (one per iteration below that).
PROGRESS_LINES = 50


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", required=True, help="recipe name (nemo-lw-fp8 recipes lists)")
    parser.add_argument("--config-file", help="YAML with partial overrides keyed by section")
    parser.add_argument(
        "--cpu", action="store_true", help="train on CPU ranks (gloo) with the FP8 emulation"
    )
    parser.add_argument(
        "--cpu-modules",
        choices=CPU_MODULES,
        default=None,
        help="with --cpu (refused without it): 'te' (the default) builds the model as on the "
        "GPU (Bridge's provider, megatron's TE spec, TE's own modules over the emulated "
        "kernels; docs/te-modules.md); 'project' swaps in the project's CPU layers (the "
        "earlier path, kept as a cross-check)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="resolve, check and print the config; no training"
    )
    parser.add_argument(
        "--losses-json",
        help="write per-iteration losses (and grad norms) to this file, and to FILE.rank<N> "
        "each rank's digest of its fp32 masters and optimizer state and their SHA-256 per "
        "parameter, at the start of training (after a load) and at the end",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra-style key=value overrides")


CPU_MODULES = ("te", "project")
"""The model paths of ``--cpu`` (:func:`nemo_lw_fp8.cpu.megatron.bridge_pretrain.adapt_config`)."""


def check_command_line(
    recipe: str, config_file: str | None = None, overrides: Sequence[str] = ()
) -> None:
    """What can be checked before importing Bridge: the recipe name, the file, key=value form,
    and that Megatron-Bridge is installed."""
    import importlib.util

    from nemo_lw_fp8 import recipes

    if recipes.recipe_key(recipe) not in recipes.RECIPES:
        import difflib

        close = difflib.get_close_matches(recipes.recipe_key(recipe), recipes.RECIPES, n=3)
        raise UsageError(
            f"unknown recipe {recipe!r}" + (f"; did you mean {', '.join(close)}?" if close else ""),
            "`nemo-lw-fp8 recipes` lists the recipes",
        )
    if config_file and not os.path.isfile(config_file):
        raise UsageError(
            f"--config-file {config_file!r} does not exist", "give the path of a YAML file"
        )
    for item in overrides:
        checks.split(item)
    if importlib.util.find_spec("megatron.bridge") is None:
        raise UsageError("Megatron-Bridge is not installed", BRIDGE_INSTALL_HINT)


def _boot_cpu() -> None:
    from nemo_lw_fp8.cpu.te import backend as te_backend

    te_backend.activate()


def resolve_config(
    recipe: str,
    config_file: str | None = None,
    overrides: Sequence[str] = (),
    cpu: bool = False,
    dry_run: bool = False,
    cpu_modules: str = "te",
) -> Any:
    """The final ``ConfigContainer``: recipe, then YAML, then ``key=value``; checked.

    ``cpu`` / ``dry_run`` boot Transformer Engine (Bridge imports it) through
    :func:`nemo_lw_fp8.cpu.te.backend.activate`: the real TE where it works, the CPU
    emulation otherwise, so a configuration can be checked on any machine.
    """
    check_command_line(recipe, config_file, overrides)
    from nemo_lw_fp8.recipes import te_env

    # What the recipe's TE layers need (docs/recipes.md, "Launch environment"). TE reads
    # NVTE_CUTEDSL_FUSED_GROUPED_MLP when its op fuser is imported, so on a GPU it goes into the
    # environment before Bridge imports TE; the CPU boot exports it after TE's import (with it
    # set, importing TE's op fuser asks the CUDA driver for the compute capability).
    exported = {} if cpu or dry_run else te_env.export_for_launch(recipe, overrides)
    if exported and te_env.te_ops_imported():
        import warnings

        warnings.warn(
            f"{te_env.CUTEDSL_ENV} was exported after transformer_engine was imported: TE's "
            "CuTe-DSL grouped MLP fusion is not registered in this process (the op fuser "
            "runs its ops unfused). Export it before Python starts to get it.",
            stacklevel=2,
        )
    if cpu or dry_run:
        _boot_cpu()
        te_env.export_for_launch(recipe, overrides)
    import nemo_lw_fp8
    from nemo_lw_fp8 import bridge, recipes

    nemo_lw_fp8.apply()
    from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix

    from nemo_lw_fp8.recipes.factory import TARGET_PREFIX, with_overrides

    register_allowed_target_prefix(TARGET_PREFIX)  # before the YAML checks instantiate anything
    cfg = recipes.get_recipe(recipe)()
    if config_file or overrides:
        checks.check_overrides(cfg, config_file, overrides)
        hint = "check the keys and values against `--dry-run` of the recipe"
        cfg = with_overrides(cfg, overrides, config_file, hint)
    checks.check_ranges(cfg)
    if cpu:
        from nemo_lw_fp8.cpu.megatron import bridge_pretrain as cpu_bridge

        cpu_bridge.adapt_config(cfg, cpu_modules)
    bridge.finalize(cfg)
    return cfg


def _count_pieces(optimizer: Any, kind: type) -> int:
    """Pieces of type ``kind`` (``ExpertSlice``, ``QKVPart``) among the pieces of ``optimizer``
    and its chained children (every rank's: each rank knows all pieces)."""
    from nemo_lw_fp8.state import peek

    record = peek(optimizer)
    pieces = getattr(record, "pieces", {})
    count = sum(1 for group in pieces.values() for piece in group if isinstance(piece, kind))
    for child in getattr(optimizer, "chained_optimizers", []):
        count += _count_pieces(child, kind)
    return count


def optimizer_state_digest(optimizer: Any) -> str:
    """SHA-256 over this rank's fp32 masters and optimizer state (Muon momentum, Adam moments),
    in the optimizer's own order: two runs that trained alike give the same digest."""
    import hashlib

    import torch

    digest = hashlib.sha256()

    def add(tensor: torch.Tensor) -> None:
        data = tensor.detach().cpu().contiguous()
        digest.update(str((tuple(data.shape), data.dtype)).encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())

    def walk(opt: Any) -> None:
        children = getattr(opt, "chained_optimizers", None)
        if children is not None:  # a ChainedOptimizer: its children hold the state
            for child in children:
                walk(child)
            return
        for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups",
                     "fp32_from_fp32_groups", "shard_fp32_groups"):
            for group in getattr(opt, name, None) or []:
                for tensor in group:
                    add(tensor)
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            for group in inner.param_groups:
                for param in group["params"]:
                    state = inner.state.get(param, {})
                    for key in sorted(state):
                        if isinstance(state[key], torch.Tensor):
                            add(state[key])

    walk(optimizer)
    return digest.hexdigest()


def _reports_losses() -> bool:
    """The first rank of the last pipeline stage (megatron's loss is reduced there)."""
    from megatron.core import parallel_state as ps

    return (
        ps.is_pipeline_last_stage(ignore_virtual=True)
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    )


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Rank 0's progress line: iteration, loss, seconds per iteration and the ETA, measured
    from the first finished iteration (the first one pays for set-up and warm-up)."""

    def __init__(self, total: int, every: int | None = None, stream: Any = None) -> None:
        self.total = total
        self.every = every or max(1, total // PROGRESS_LINES)
        self.stream = stream or sys.stdout
        self.start = time.monotonic()
        self.first: tuple[int, float] | None = None

    def line(self, iteration: int, loss: float | None, now: float | None = None) -> str | None:
        """The line for ``iteration`` (1-based), or ``None`` when this one is not reported."""
        now = time.monotonic() if now is None else now
        if self.first is None:
            self.first = (iteration, now)
        if iteration % self.every and iteration != self.total:
            return None
        done_since, since = self.first
        text = f"progress: iteration {iteration}/{self.total}"
        if loss is not None:
            text += f", lm loss {loss:.6f}"
        text += f", elapsed {_clock(now - self.start)}"
        if iteration > done_since:
            per = (now - since) / (iteration - done_since)
            text += f", {per:.2f} s/it, ETA {_clock(per * (self.total - iteration))}"
        return text

    def report(self, iteration: int, loss: float | None) -> None:
        text = self.line(iteration, loss)
        if text is not None:
            self.stream.write(text + "\n")
            self.stream.flush()


class _LossRecorder:
    """A Bridge callback keeping each iteration's reduced losses (and eval losses)."""

    def __init__(self, progress: Progress | None = None) -> None:
        self.progress = progress
        self.train: list[dict[str, float]] = []
        self.eval: list[dict[str, float]] = []
        #: Optimizer pieces that are expert runs of grouped weights, on this rank (see
        #: ``grouped_weight_ownership``); counted once, at the first step.
        self.expert_slices: int | None = None
        #: Q / K / V parts of fused QKV weights among the pieces (``qkv_ownership``).
        self.qkv_parts: int | None = None
        #: Whether this rank reports the run: the first rank of the last pipeline stage, where
        #: megatron reduces the losses (rank 0 unless pipeline parallel).
        self.reports: bool | None = None
        #: Whether to take :func:`optimizer_state_digest` at the end and
        #: :func:`~.state_by_name.state_by_name` at the start and end (``--losses-json``).
        self.digest_wanted = False
        self.state_digest: str | None = None
        self.by_name: dict[str, Any] = {}
        #: Wall seconds of each training step (between two step ends; the first from the
        #: start of training), and the peak memory CUDA allocated (None on CPU): what
        #: ``make gpu-check`` tabulates ON against OFF.
        self.step_seconds: list[float] = []
        self.peak_memory_bytes: int | None = None
        self._last_step_end: float | None = None

    @staticmethod
    def _floats(losses: dict[str, Any] | None) -> dict[str, float]:
        out = {}
        for key, value in (losses or {}).items():
            out[key] = float(value.float().item() if hasattr(value, "item") else value)
        return out

    def as_callback(self) -> Any:
        from megatron.bridge.training.callbacks import Callback

        from nemo_lw_fp8.mechanics.state_by_name import state_by_name

        recorder = self

        class Recorder(Callback):
            def on_train_step_end(self, context: Any) -> None:
                now = time.perf_counter()
                if recorder._last_step_end is not None:
                    recorder.step_seconds.append(now - recorder._last_step_end)
                recorder._last_step_end = now
                losses = recorder._floats(context.loss_dict)
                if context.grad_norm is not None:
                    losses["grad norm"] = float(context.grad_norm)
                recorder.train.append(losses)
                if recorder.progress is not None:
                    # The run's iteration (a resumed run starts after the checkpoint's);
                    # Bridge counts the step after this callback.
                    iteration = int(context.state.train_state.step) + 1
                    recorder.progress.report(iteration, losses.get("lm loss"))
                if recorder.expert_slices is None:
                    from nemo_lw_fp8.mechanics.expert_slices import ExpertSlice
                    from nemo_lw_fp8.mechanics.qkv_parts import QKVPart

                    recorder.expert_slices = _count_pieces(context.optimizer, ExpertSlice)
                    recorder.qkv_parts = _count_pieces(context.optimizer, QKVPart)
                    recorder.reports = _reports_losses()

            def on_train_start(self, context: Any) -> None:
                recorder._last_step_end = time.perf_counter()
                if recorder.digest_wanted:  # after a checkpoint load, before any step
                    recorder.by_name["start"] = state_by_name(context.optimizer, context.model)

            def on_eval_end(self, context: Any) -> None:
                recorder.eval.append(recorder._floats(context.total_loss_dict))

            def on_train_end(self, context: Any) -> None:
                import torch

                if torch.cuda.is_available():
                    recorder.peak_memory_bytes = int(torch.cuda.max_memory_allocated())
                if recorder.digest_wanted:
                    recorder.state_digest = optimizer_state_digest(context.optimizer)
                    recorder.by_name["end"] = state_by_name(context.optimizer, context.model)

        return Recorder()


def run(
    recipe: str,
    config_file: str | None = None,
    overrides: Sequence[str] = (),
    cpu: bool = False,
    losses_json: str | None = None,
    cpu_modules: str = "te",
) -> _LossRecorder:
    """Resolve the config and train with Megatron-Bridge's ``pretrain``."""
    cfg = resolve_config(recipe, config_file, overrides, cpu, cpu_modules=cpu_modules)
    return train(cfg, cpu, losses_json, cpu_modules)


def train(
    cfg: Any, cpu: bool = False, losses_json: str | None = None, cpu_modules: str = "te"
) -> _LossRecorder:
    """Train a resolved config with Megatron-Bridge's ``pretrain`` (progress on rank 0).

    On CPU with TE's modules, TE's device questions are answered as the recipe's target GPU
    would for the whole run (:func:`nemo_lw_fp8.cpu.megatron.bridge_pretrain.device_answers`)."""
    scope: contextlib.AbstractContextManager = contextlib.nullcontext()
    if cpu:
        from nemo_lw_fp8.cpu.megatron import bridge_pretrain as cpu_bridge

        cpu_bridge.install(cpu_modules)
        scope = cpu_bridge.device_answers(cfg, cpu_modules)
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    progress = Progress(cfg.train.train_iters) if int(os.environ.get("RANK", "0")) == 0 else None
    recorder = _LossRecorder(progress)
    recorder.digest_wanted = bool(losses_json)
    with scope:
        pretrain(cfg, forward_step, callbacks=[recorder.as_callback()])
    reports = recorder.reports
    if reports is None:
        reports = int(os.environ.get("RANK", "0")) == 0
    if losses_json and recorder.state_digest is not None:
        # Every rank: its own masters and optimizer state (the losses are reduced ones).
        with open(f"{losses_json}.rank{os.environ.get('RANK', '0')}", "w") as handle:
            json.dump(
                {"optimizer_state": recorder.state_digest, "state_by_name": recorder.by_name},
                handle,
            )
    if losses_json and reports:
        with open(losses_json, "w") as handle:
            json.dump(
                {
                    "train": recorder.train,
                    "eval": recorder.eval,
                    "grouped_weight_ownership": getattr(
                        cfg.optimizer, "grouped_weight_ownership", None
                    ),
                    "layer_wise_grad_sync": getattr(cfg.optimizer, "layer_wise_grad_sync", None),
                    "expert_slices": recorder.expert_slices,
                    "qkv_parts": recorder.qkv_parts,
                    "step_seconds": recorder.step_seconds,
                    "peak_memory_bytes": recorder.peak_memory_bytes,
                },
                handle,
            )
    return recorder


def main(args: argparse.Namespace) -> int:
    """``nemo-lw-fp8 pretrain``: check everything, then print the config (``--dry-run``) or
    train. Third-party import warnings of the check are held back to one line (all of them,
    and tracebacks, with ``--debug``)."""
    from nemo_lw_fp8.cli.quiet import held_back
    from nemo_lw_fp8.errors import DEBUG_ENV

    check_command_line(args.recipe, args.config_file, args.overrides)
    if args.cpu_modules is not None and not args.cpu:
        raise UsageError(
            f"--cpu-modules {args.cpu_modules} chooses the model path of CPU ranks only; a GPU "
            "run always builds megatron's TE spec",
            "add --cpu, or drop --cpu-modules",
        )
    args.cpu_modules = args.cpu_modules or "te"
    if os.environ.get(DEBUG_ENV) == "1":
        cfg = resolve_config(
            args.recipe, args.config_file, args.overrides, args.cpu, args.dry_run,
            args.cpu_modules,
        )  # fmt: skip
    else:
        with held_back() as held:
            cfg = resolve_config(
                args.recipe, args.config_file, args.overrides, args.cpu, args.dry_run,
                args.cpu_modules,
            )  # fmt: skip
        if held.messages:
            sys.stderr.write(held.summary().replace("--verbose", "--debug") + "\n")
    if args.dry_run:
        print(summary(cfg))
        return 0
    train(cfg, args.cpu, args.losses_json, args.cpu_modules)
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
