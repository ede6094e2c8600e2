"""What a layer-wise run needs from Megatron-Bridge's checkpoint save.

Two decisions, each read from the run's configuration as megatron-training 0.19.2 reads its
``args`` (``use_layer_wise_distributed_optimizer``):

* the content metadata of a ``torch_dist`` save names the DistributedOptimizer's sharding type
  also when the layer-wise optimizer brings that DistributedOptimizer (the sibling Adam of
  embeddings, norms and biases): :func:`has_distributed_optimizer` inside
  :func:`saving_config`;
* a save with overlapped param gathers first forces the gather, so the weights written are the
  masters of the last step: :func:`save_needs_param_sync`.
"""

from __future__ import annotations

import contextlib
import contextvars
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
def saving_config(cfg: Any) -> Iterator[None]:
    """While a checkpoint of ``cfg``'s run is saved, remember whether it is layer-wise."""
    token = _LAYER_WISE_SAVE.set(layer_wise_run(cfg))
    try:
        yield
    finally:
        _LAYER_WISE_SAVE.reset(token)


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
