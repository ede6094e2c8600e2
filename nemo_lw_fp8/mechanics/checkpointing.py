"""What a layer-wise run needs from Megatron-Bridge's checkpoint save.

Two decisions, each read from the run's configuration as megatron-training 0.19.2 reads its
``args`` (``use_layer_wise_distributed_optimizer``):

* the content metadata of a ``torch_dist`` save names the DistributedOptimizer's sharding type
  also when the layer-wise optimizer brings that DistributedOptimizer (the sibling Adam of
  embeddings, norms and biases): :func:`has_distributed_optimizer` inside
  :func:`saving_config`;
* a save with overlapped param gathers first forces the gather, so the weights written are the
  masters of the last step: :func:`save_needs_param_sync`.

And what a load needs: the checkpoint's fit to the run (:func:`check_loadable`), its RNG
states at another data-parallel size (:func:`rng_state_for_load`), and after the optimizer's
state is in, every weight re-derived from the loaded fp32 masters
(:func:`rederive_weights_from_masters`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import re
from collections.abc import Iterator
from typing import Any

_LAYER_WISE_SAVE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "nemo_lw_fp8_layer_wise_save", default=False
)


def layer_wise_run(cfg: Any) -> bool:
    """Whether a Bridge ``ConfigContainer`` trains with the layer-wise distributed optimizer."""
    optimizer = getattr(cfg, "optimizer", None)
    return bool(getattr(optimizer, "use_layer_wise_distributed_optimizer", False))


@contextlib.contextmanager
def _holding(var: contextvars.ContextVar[Any], value: Any) -> Iterator[None]:
    """``var`` holds ``value`` for the ``with`` block (this thread / task only), then what it
    held before."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def saving_config(cfg: Any) -> contextlib.AbstractContextManager[None]:
    """While a checkpoint of ``cfg``'s run is saved, remember whether it is layer-wise."""
    return _holding(_LAYER_WISE_SAVE, layer_wise_run(cfg))


def has_distributed_optimizer(use_distributed_optimizer: bool) -> bool:
    """megatron-training's rule: a DistributedOptimizer is checkpointed when
    ``use_distributed_optimizer`` is on or the run is layer-wise (its sibling Adam)."""
    return bool(use_distributed_optimizer) or _LAYER_WISE_SAVE.get()


def save_needs_param_sync(cfg: Any) -> bool:
    """Whether a save must force the param gather that Bridge's own check leaves out.

    Bridge forces it for ``use_distributed_optimizer`` with ``overlap_param_gather`` (its
    ``should_disable_forward_pre_hook``); megatron-training also for the layer-wise optimizer,
    whose overlapped gather of the last step otherwise waits for the next forward.
    """
    ddp = cfg.ddp
    if getattr(ddp, "use_megatron_fsdp", False) or cfg.optimizer.use_distributed_optimizer:
        return False
    return layer_wise_run(cfg) and bool(getattr(ddp, "overlap_param_gather", False))


@dataclasses.dataclass
class _Load:
    """A checkpoint load in progress: the run's config, whether it reads the model's weights
    only (``checkpoint.pretrained_checkpoint``: Bridge's fine-tune load, no optimizer state),
    and the iteration directory once Bridge has read its ``run_config.yaml``
    (:func:`check_loadable`)."""

    cfg: Any
    model_only: bool = False
    iteration_dir: str | None = None


_LOADING_INTO: contextvars.ContextVar[_Load | None] = contextvars.ContextVar(
    "nemo_lw_fp8_loading_into", default=None
)


def loading_into(cfg: Any, load_dir: str | None = None) -> contextlib.AbstractContextManager[None]:
    """While Bridge loads a checkpoint from ``load_dir`` into the run configured by ``cfg``. A
    load of ``checkpoint.pretrained_checkpoint`` (Bridge falls back to it when
    ``checkpoint.load`` holds none, and marks the load ``finetune``) reads the model only."""
    checkpoint = getattr(cfg, "checkpoint", None)
    pretrained = getattr(checkpoint, "pretrained_checkpoint", None)
    model_only = load_dir is not None and load_dir == pretrained
    model_only = model_only or bool(getattr(checkpoint, "finetune", False))
    return _holding(_LOADING_INTO, _Load(cfg, model_only))


def loading_dir() -> str | None:
    """The iteration directory of the Bridge load in progress (known once Bridge has read its
    ``run_config.yaml``), else None."""
    load = _LOADING_INTO.get()
    return None if load is None else load.iteration_dir


def _current_fields(cfg: Any) -> dict[str, dict[str, Any]]:
    """This run's values of the fields the checkpoint rules compare (and ``moe_layer_freq``,
    which says whether ``ffn_hidden_size`` shapes any weight)."""
    from nemo_lw_fp8.rules import CHECKPOINT_FIXED_FIELDS

    current: dict[str, dict[str, Any]] = {}
    for section, name in (*CHECKPOINT_FIXED_FIELDS, ("model", "moe_layer_freq")):
        current.setdefault(section, {})[name] = getattr(getattr(cfg, section), name, None)
    return current


def missing_files(iteration_dir: str) -> list[str]:
    """Files a ``torch_dist`` checkpoint's metadata lists that its directory lacks."""
    import os

    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.exists(os.path.join(iteration_dir, ".metadata")):
        return [".metadata"]
    storage = FileSystemReader(iteration_dir).read_metadata().storage_data or {}
    listed = {info.relative_path for info in storage.values()}
    return [name for name in listed if not os.path.exists(os.path.join(iteration_dir, name))]


def truncated_files(iteration_dir: str) -> dict[str, tuple[int, int]]:
    """Files of a ``torch_dist`` checkpoint shorter than its metadata says they are, as
    ``{file: (bytes on disk, bytes the metadata needs)}`` (an interrupted copy leaves these; the
    load would otherwise stop deep inside ``torch.distributed.checkpoint`` on an ``EOFError``)."""
    import os

    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.exists(os.path.join(iteration_dir, ".metadata")):
        return {}
    storage = FileSystemReader(iteration_dir).read_metadata().storage_data or {}
    needed: dict[str, int] = {}
    for info in storage.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    short = {}
    for name, need in needed.items():
        path = os.path.join(iteration_dir, name)
        if os.path.exists(path) and os.path.getsize(path) < need:
            short[name] = (os.path.getsize(path), need)
    return short


def check_loadable(run_config: dict[str, Any], run_config_file: str) -> None:
    """Refuse, before anything is loaded, a checkpoint this run cannot resume from: one written
    by another model / FP8 recipe / optimizer, or one missing files or holding truncated ones
    (rules ``checkpoint-mismatch``, ``checkpoint-missing-shard``,
    ``checkpoint-truncated-shard``)."""
    import os

    from nemo_lw_fp8.rules import (
        ConfigError,
        checkpoint_bucket_resplit,
        checkpoint_mismatch,
        checkpoint_missing_files,
        checkpoint_tp_resplit,
        checkpoint_truncated_files,
        pretrained_checkpoint_mismatch,
    )

    load = _LOADING_INTO.get()
    if load is None:
        return
    cfg = load.cfg
    iteration_dir = os.path.dirname(run_config_file)
    load.iteration_dir = iteration_dir
    if load.model_only:
        message = pretrained_checkpoint_mismatch(run_config, _current_fields(cfg), iteration_dir)
        if message:
            raise ConfigError("pretrained-checkpoint-mismatch", message)
    else:
        message = checkpoint_mismatch(run_config, _current_fields(cfg), iteration_dir)
        if message:
            raise ConfigError("checkpoint-mismatch", message)
    if getattr(cfg.checkpoint, "ckpt_format", "torch_dist") == "torch_dist":
        message = checkpoint_missing_files(missing_files(iteration_dir), iteration_dir)
        if message:
            raise ConfigError("checkpoint-missing-shard", message)
        message = checkpoint_truncated_files(truncated_files(iteration_dir), iteration_dir)
        if message:
            raise ConfigError("checkpoint-truncated-shard", message)
        if load.model_only:
            return  # no optimizer state is read: its buckets may be cut any way
        saved = run_config.get("checkpoint") or {}
        buckets = saved_optimizer_buckets(iteration_dir)
        message = checkpoint_bucket_resplit(
            bool(saved.get("dist_ckpt_optim_fully_reshardable")),
            (run_config.get("ddp") or {}).get("bucket_size"),
            getattr(cfg.ddp, "bucket_size", None),  # megatron's default is set at wrap time
            buckets,
            iteration_dir,
        )
        if message:
            raise ConfigError("checkpoint-bucket-resplit", message)
        message = checkpoint_tp_resplit(
            bool(saved.get("dist_ckpt_optim_fully_reshardable")),
            (run_config.get("model") or {}).get("tensor_model_parallel_size"),
            getattr(cfg.model, "tensor_model_parallel_size", None),
            buckets,
            iteration_dir,
        )
        if message:
            raise ConfigError("checkpoint-tp-resplit", message)


#: A dp_reshardable distributed-optimizer entry: ``<buffer>.bucket_idx_<n>.param``.
_BUCKET_KEY = re.compile(r"^(.*\.gbuf_idx_\d+\..*)\.bucket_idx_(\d+)\.param$")


def saved_optimizer_buckets(iteration_dir: str) -> dict[str, list[int]]:
    """Per distributed-optimizer buffer of a ``torch_dist`` checkpoint, the elements of each
    saved ``dp_reshardable`` bucket, in bucket order (empty: none saved that way)."""
    from torch.distributed.checkpoint import FileSystemReader

    found: dict[str, dict[int, int]] = {}
    for name, meta in FileSystemReader(iteration_dir).read_metadata().state_dict_metadata.items():
        match = _BUCKET_KEY.match(name)
        size = getattr(meta, "size", None)
        if match and size is not None:
            found.setdefault(match.group(1), {})[int(match.group(2))] = int(math.prod(size))
    return {buffer: [n for _, n in sorted(b.items())] for buffer, b in found.items()}


def saved_rng_data_parallel_size(iteration_dir: str, key: str) -> int | None:
    """The data-parallel size a ``torch_dist`` checkpoint's RNG states ``key`` were sharded
    over (Bridge shards them by (PP, TP, DP) with expert parallelism), or ``None``."""
    from torch.distributed.checkpoint import FileSystemReader

    prefix = f"{key}/shard_"
    for name in FileSystemReader(iteration_dir).read_metadata().state_dict_metadata:
        if name.startswith(prefix):  # "rng_state/shard_<offsets>_<shape>", dot-separated
            shape = name[len(prefix) :].rsplit("_", 1)[-1].split(".")
            return int(shape[2]) if len(shape) == 3 else None
    return None


def _rng_shards(sharded: Any, saved: int, build_key, data, replica_id, flattened_range) -> dict:
    """The saved entries one DP rank reads (see :func:`rng_state_for_load`)."""
    pp, tp, dp = sharded.global_offset
    size = sharded.global_shape[2]
    shape = (*sharded.global_shape[:2], saved)
    # Smaller: every saved entry read once (this rank's and those it stands for); larger: the
    # ranks that read one saved entry are its replicas.
    reads = {j: 0 for j in range(dp, saved, size)} if saved > size else {dp % saved: dp // saved}
    return {
        j: dataclasses.replace(sharded, data=data, global_shape=shape,
                               global_offset=(pp, tp, j), replica_id=replica)
        for j, replica in reads.items()
    }  # fmt: skip


def rng_state_for_load(sharded: Any) -> Any:
    """The RNG entry a load at another data-parallel size can find.

    Bridge 0.6.2 shards the RNG state by (PP, TP, DP) when EP > 1 (each EP rank draws its own
    expert dropout), so a checkpoint saved at DP 2 has no entry for DP rank 3 of 4 and the
    load stops (``Missing key in checkpoint state_dict: rng_state/shard_0.0.3_2.1.4``); saved
    at DP 4 and loaded at DP 2, the validation of the load stops at the entries no rank reads.
    megatron-training shards it by (PP, TP) only and loads at any DP size. Here DP rank ``d``
    takes the state of saved DP rank ``d % saved``, of the same EP rank (megatron orders EP
    inside DP, and EP divides both sizes), whose expert RNG streams it would have had. At a
    larger size, the ranks that read one saved entry are its replicas; at a smaller one, rank
    ``d`` also reads the saved entries ``d + k * size`` and drops them (a factory whose merge
    keeps its own). Other calls, saves and loads at the saved size are untouched.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    load = _LOADING_INTO.get()
    if load is None or load.iteration_dir is None or not isinstance(sharded, ShardedObject):
        return sharded
    if len(sharded.global_shape) != 3:
        return sharded
    saved = saved_rng_data_parallel_size(load.iteration_dir, sharded.key)
    if saved is None or saved == sharded.global_shape[2]:
        return sharded
    own = sharded.global_offset[2] % saved
    return ShardedTensorFactory(
        key=sharded.key,
        data=sharded.data,
        build_fn=functools.partial(_rng_shards, sharded, saved),
        merge_fn=lambda loaded: loaded[own],
        replica_id=sharded.replica_id,
    )


def rederive_weights_from_masters(optimizer: Any) -> None:
    """After a layer-wise optimizer's state is loaded: rebuild every weight it manages from the
    loaded fp32 masters through the gather a step runs.

    Why: a ``torch_dist`` save writes a quantized weight dequantized from its rowwise copy, and
    a load quantizes both copies again from those values, so an MXFP8 weight's columnwise copy
    comes back as ``Q_col(D_row(W))``, not ``Q_col(W)`` (they differ where an element is
    subnormal in its row block but not in its column block), and a blockwise weight's
    transpose likewise. The masters are saved exactly, so a weight derived from them is the
    uninterrupted run's weight by construction, whatever the format (MXFP8, blockwise, grouped
    experts, Q/K/V parts) and whichever load path (Bridge, megatron-training, a direct
    ``dist_checkpointing`` load) called ``load_state_dict``. As in megatron's and Bridge's own
    loads, the model's state must be loaded before the optimizer's.

    The sequence is a step's: each child's master -> model copy (the plugin leaves quantized
    weights to the gather there), then the gather, synchronous: without overlapped gathers the
    one a step runs over the layer-wise optimizer's own buckets; with them the forced sync
    megatron runs before a save (staged first where the gather reads a staging buffer).
    """
    import torch

    chunks = list(getattr(optimizer, "model_chunks", None) or [])
    if not chunks:
        return
    with torch.no_grad():
        for child in optimizer.chained_optimizers:
            if getattr(child, "is_stub_optimizer", False):
                continue
            copy = getattr(child, "_copy_main_params_to_model_params", None)
            if copy is not None:
                copy()
        if optimizer.overlap_param_gather:
            optimizer.prepare_model_params_for_param_sync()
            for chunk in chunks:
                chunk.start_param_sync(force_sync=True)
        elif optimizer.use_buffer_param_sync:
            # A step stages the owned masters in the buffer the gather reads (MXFP8 with grad
            # buffer reuse) before this gather; so must a load.
            stage = getattr(optimizer, "_copy_main_params_to_param_buffer", None)
            if stage is not None:
                stage()
            optimizer.start_param_sync_for_bucket_group_subset()
        else:
            optimizer.allgather_params()
