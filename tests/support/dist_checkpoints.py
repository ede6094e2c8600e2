"""megatron's own ``torch_dist`` checkpoints of the tests' training runs (inside the ranks).

:func:`save_torch_dist` / :func:`load_torch_dist` go through ``megatron.core.dist_checkpointing``
exactly as megatron-training's and Megatron-Bridge's checkpointing do: the model's and the
optimizer's ``sharded_state_dict`` with the content metadata those loops build (the
DistributedOptimizer's sharding type), ``dist_checkpointing.save`` / ``load`` (optionally through
the fully parallel save / load wrappers, which exchange empty tensors between ranks), then the
model's and the optimizer's ``load_state_dict``. :func:`training_save` / :func:`training_load`
call megatron-training's own ``save_checkpoint`` / ``load_checkpoint`` with the ``args`` its
parser builds (:func:`training_args`, :func:`training_globals`). :func:`optimizer_snapshot` and
:func:`weight_snapshot` record what must come back to the bit.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator
from typing import Any

import torch


def content_metadata(sharding: str) -> dict[str, Any]:
    """What megatron-training's ``_build_sharded_state_dict_metadata`` builds for a layer-wise
    run with ``--ckpt-format torch_dist`` (``sharding``: ``dp_reshardable`` or
    ``fully_reshardable``)."""
    metadata: dict[str, Any] = {"distrib_optim_sharding_type": sharding}
    if sharding == "fully_reshardable":
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    metadata["singleton_local_shards"] = False
    metadata["chained_optim_avoid_prefix"] = True
    return metadata


def model_sharded_state_dict(model: list, metadata: dict[str, Any]) -> dict[str, Any]:
    """The model chunk's sharded state dict (megatron's default for plain torch modules:
    every tensor replicated across data-parallel ranks)."""
    from megatron.core.transformer.utils import sharded_state_dict_default

    return sharded_state_dict_default(model[0].module, prefix="", metadata=dict(metadata))


@contextlib.contextmanager
def in_process_write_results() -> Iterator[None]:
    """``FileSystemWriterAsync`` collects write results in a ``multiprocessing.Manager`` queue,
    which a daemonic process (a harness rank) may not start; saves here are synchronous, so a
    thread queue carries the same results."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    before = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = before


def _strategies(fully_parallel: bool, directory: str | None = None) -> tuple[Any, Any]:
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )

    if not fully_parallel:
        return None, None
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    save = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), group)
    load = None
    if directory is not None:
        load = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(directory), group)
    return save, load


def save_torch_dist(
    model: list, optimizer, directory: str, sharding: str, fully_parallel: bool = True
) -> None:
    """Save model and optimizer as megatron's loops do with ``ckpt_format="torch_dist"``."""
    from megatron.core import dist_checkpointing

    metadata = content_metadata(sharding)
    model_sd = model_sharded_state_dict(model, metadata)
    optimizer_sd = optimizer.sharded_state_dict(model_sd, metadata=metadata)
    state = {"model": model_sd, "optimizer": optimizer_sd}
    strategy, _ = _strategies(fully_parallel)
    with in_process_write_results():
        dist_checkpointing.save(
            state,
            directory,
            sharded_strategy=strategy,
            content_metadata=metadata,
            async_strategy="mcore",
        )


def load_torch_dist(model: list, optimizer, directory: str, fully_parallel: bool = True) -> None:
    """Load a :func:`save_torch_dist` checkpoint into a freshly built model and optimizer, with
    the content metadata stored in it (as megatron's loaders do)."""
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_content_metadata(directory)
    model_sd = model_sharded_state_dict(model, metadata)
    optimizer_sd = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)
    _, strategy = _strategies(fully_parallel, directory)
    state = dist_checkpointing.load(
        {"model": model_sd, "optimizer": optimizer_sd}, directory, sharded_strategy=strategy
    )
    model[0].module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


# --------------------------------------------------------------------------- snapshots


def weight_snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's exact storage: a quantized weight's inner buffers (rowwise and
    columnwise data and scales), other parameters' bytes."""
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        inner = getattr(param, "_rowwise_data", None), getattr(param, "_columnwise_data", None)
        if any(buffer is not None for buffer in inner):
            for attr in ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data",
                         "_columnwise_scale_inv"):  # fmt: skip
                buffer = getattr(param, attr, None)
                if buffer is not None:
                    out[f"{name}{attr}"] = buffer.detach().clone()
        else:
            out[name] = param.detach().clone()
    return out


def weight_values(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the GEMMs read from every parameter: an MXFP8 weight's rowwise *and* columnwise
    values (dequantized: a bf16 round trip may store the same values with another block
    exponent), other parameters' bytes."""
    from nemo_lw_fp8.cpu.formats import mxfp8
    from nemo_lw_fp8.cpu.te.tex.common import torch_dtype

    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        if getattr(param, "_rowwise_data", None) is None:
            out[name] = param.detach().clone()
            continue
        swizzled = bool(param._with_gemm_swizzled_scales)
        fp8 = torch_dtype(param._fp8_dtype)
        for direction in ("rowwise", "columnwise"):
            codes = getattr(param, f"_{direction}_data")
            if codes is not None:
                scales = getattr(param, f"_{direction}_scale_inv")
                out[f"{name}:{direction}"] = mxfp8.dequantize_codes(
                    codes, scales, fp8, direction == "columnwise", torch.float32, swizzled
                )
    return out


def optimizer_tensors(optimizer, module: torch.nn.Module) -> dict[str, Any]:
    """Per parameter name: each chained optimizer's fp32 master and state tensors (Muon's
    momentum, Adam's moments on this rank's shards), the live objects; and every param group's
    step."""
    from nemo_lw_fp8.mechanics import qkv_parts

    names = {id(p): n for n, p in module.named_parameters()}
    out: dict[str, Any] = {}

    def _name(param: torch.Tensor) -> str:
        if qkv_parts.is_part(param):  # a QKV part: its fused weight's name and part index
            return f"{names[id(param.parent)]}.qkv_part{param.index}"
        return names[id(param)]

    def record(kind: str, name: str, main: torch.Tensor, inner) -> None:
        out[f"{kind}:master:{name}"] = main
        for key, value in inner.state.get(main, {}).items():
            if torch.is_tensor(value):
                out[f"{kind}:{key}:{name}"] = value

    def walk(opt) -> None:
        for child in getattr(opt, "chained_optimizers", []):
            walk(child)
        if hasattr(opt, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
            pairs = zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True)
            kind = "distopt"
        elif hasattr(opt, "fp32_from_float16_groups"):  # a layer-wise Float16 optimizer
            pairs = zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True)
            kind = "layerwise"
        else:
            return
        for model_group, main_group in pairs:
            for model_param, main_param in zip(model_group, main_group, strict=True):
                record(kind, _name(model_param), main_param, opt.optimizer)
        steps = [group.get("step") for group in opt.optimizer.param_groups]
        out.setdefault(f"{kind}:steps", []).append(steps)

    walk(optimizer)
    return out


def optimizer_snapshot(optimizer, module: torch.nn.Module) -> dict[str, Any]:
    """A copy of :func:`optimizer_tensors`: what must come back to the bit."""
    return {
        key: value.detach().clone() if torch.is_tensor(value) else value
        for key, value in optimizer_tensors(optimizer, module).items()
    }


# --------------------------------------------------------------------------- megatron.training


def training_args(directory: str, fully_reshardable: bool, extra: tuple[str, ...] = ()):
    """megatron-training's ``args`` for a layer-wise Muon run with MXFP8 param gather, from its
    own parser and ``validate_args`` (which the plugin hooks: its rules run on them too).

    They describe the run to ``megatron.training.checkpointing``; the model and optimizer are
    the scenario's (the sizes below only have to agree between save and load, which
    ``check_checkpoint_args`` compares). ``--optimizer muon --use-distributed-optimizer`` is how
    megatron-training 0.19.2 spells the layer-wise optimizer (``validate_args`` turns it into
    ``use_layer_wise_distributed_optimizer``).
    """
    import sys

    import torch.distributed as dist
    from megatron.training import arguments

    argv = [
        "pretrain", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
        "--train-iters", "8", "--lr", "0.01", "--bf16", "--no-gradient-accumulation-fusion",
        "--optimizer", "muon", "--use-distributed-optimizer",
        "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp8-param-gather",
        "--reuse-grad-buf-for-mxfp8-param-ag",
        "--ckpt-format", "torch_dist", "--save", directory, "--load", directory,
        "--save-interval", "1",
    ]  # fmt: skip
    if fully_reshardable:
        argv.append("--dist-ckpt-optim-fully-reshardable")
    before = sys.argv
    sys.argv = argv + list(extra)
    try:
        args = arguments.parse_args()
    finally:
        sys.argv = before
    # parse_args reads the rank and world size from the environment torchrun sets.
    args.rank, args.world_size = dist.get_rank(), dist.get_world_size()
    return arguments.validate_args(args, {})


@contextlib.contextmanager
def training_globals(args) -> Iterator[None]:
    """megatron-training's process globals for ``args`` (what its save / load read: the args and
    the micro-batch calculator a load updates), restored afterwards: the rank processes serve
    other tests."""
    from megatron.core import num_microbatches_calculator as microbatches
    from megatron.core import rerun_state_machine
    from megatron.training import checkpointing, global_vars

    saved = (
        global_vars._GLOBAL_ARGS,
        microbatches._GLOBAL_NUM_MICROBATCHES_CALCULATOR,
        rerun_state_machine._GLOBAL_RERUN_STATE_MACHINE,
        checkpointing._CHECKPOINT_VERSION,
        checkpointing._LOADED_ITERATION,
    )
    global_vars.set_args(args)
    microbatches._GLOBAL_NUM_MICROBATCHES_CALCULATOR = None
    microbatches.init_num_microbatches_calculator(
        args.rank, None, args.global_batch_size, args.micro_batch_size, args.data_parallel_size
    )
    try:
        yield
    finally:
        (
            global_vars._GLOBAL_ARGS,
            microbatches._GLOBAL_NUM_MICROBATCHES_CALCULATOR,
            rerun_state_machine._GLOBAL_RERUN_STATE_MACHINE,
            checkpointing._CHECKPOINT_VERSION,
            checkpointing._LOADED_ITERATION,
        ) = saved


def give_sharded_state_dict(module: torch.nn.Module) -> None:
    """megatron-training's save and load call ``sharded_state_dict`` on each (unwrapped) model
    chunk; a plain torch module gets what megatron's ``sharded_state_dict_default`` gives one
    without it (every tensor replicated across data-parallel ranks)."""
    from megatron.core.transformer.utils import (
        ensure_metadata_has_dp_cp_group,
        make_sharded_tensors_for_checkpoint,
    )

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            module.state_dict(prefix="", keep_vars=True), prefix, {}, sharded_offsets,
            dp_cp_group=metadata["dp_cp_group"],
        )  # fmt: skip

    module.sharded_state_dict = sharded_state_dict


def training_save(model: list, optimizer, iteration: int) -> None:
    """``megatron.training.checkpointing.save_checkpoint`` of ``model`` and ``optimizer`` into
    ``args.save``, as megatron-training's loop calls it (its ``preprocess_common_state_dict``
    drops the per-rank args before the ranks' common state is compared); no scheduler: the
    scenarios train at a constant learning rate."""
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.training import preprocess_common_state_dict

    with in_process_write_results():
        save_checkpoint(
            iteration, model, optimizer, None, 0,
            preprocess_common_state_dict_fn=preprocess_common_state_dict,
        )  # fmt: skip


def training_load(model: list, optimizer) -> int:
    """``megatron.training.checkpointing.load_checkpoint`` from ``args.load``; the iteration."""
    from megatron.training.checkpointing import load_checkpoint

    iteration, _ = load_checkpoint(model, optimizer, None)
    return iteration
