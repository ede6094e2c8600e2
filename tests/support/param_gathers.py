"""Watch the collectives that the layer-wise bucket groups' param gathers issue, inside a rank.

The tests that count gathers (one collective per bucket group and step) and the tests that weigh
them (FP8 bytes on the wire against bf16) look at the same thing: every torch.distributed
gather issued while a chosen bucket group runs ``start_param_sync``, over the steps after the
first. This module watches; each test decides what to record.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

#: The torch.distributed gathers a bucket group's param sync may issue.
GATHERS = ("all_gather", "all_gather_into_tensor")
#: A gather as a recorder sees it: (name, the gathered outputs as a list of tensors).
Recorder = Callable[[str, list], None]


@contextlib.contextmanager
def recording_param_gathers(
    groups: list, record: Recorder, megatron_alias: bool = False
) -> Iterator[None]:
    """Call ``record`` for each gather issued while one of ``groups`` syncs its params (gathers
    elsewhere, the grad reduce's included, go unseen). ``megatron_alias``: megatron's padded
    (DistOpt-style) gather calls its own alias of ``all_gather_into_tensor``; watch it too."""
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as buffer_module

    active = {"depth": 0}
    originals = {name: getattr(dist, name) for name in GATHERS}
    alias = buffer_module.dist_all_gather_func

    def watched(name: str, gather: Callable[..., Any]) -> Callable[..., Any]:
        def gather_and_record(*args: Any, **kwargs: Any) -> Any:
            if active["depth"]:
                record(name, args[0] if name == "all_gather" else [args[0]])
            return gather(*args, **kwargs)

        return gather_and_record

    for group in groups:

        def marked(*args: Any, _method: Callable[..., Any] = group.start_param_sync, **kw: Any):
            active["depth"] += 1
            try:
                return _method(*args, **kw)
            finally:
                active["depth"] -= 1

        group.start_param_sync = marked
    for name, gather in originals.items():
        setattr(dist, name, watched(name, gather))
    if megatron_alias:
        buffer_module.dist_all_gather_func = watched("dist_all_gather_func", alias)
    try:
        yield
    finally:
        buffer_module.dist_all_gather_func = alias
        for name, gather in originals.items():
            setattr(dist, name, gather)
        for group in groups:
            del group.start_param_sync


def layer_wise_bucket_groups(chunk: Any) -> list:
    """The bucket groups of a DDP chunk whose every bucket the layer-wise optimizer manages."""
    return [
        group
        for group in chunk.bucket_groups
        if all(
            getattr(bucket.params_list[0], "is_managed_by_layer_wise_optimizer", False)
            for bucket in group.buckets
        )
    ]


def train_recording_gathers(
    scenario: Any,
    record: Recorder,
    choose_groups: Callable[[Any], list] = layer_wise_bucket_groups,
    megatron_alias: bool = False,
) -> list:
    """Inside a rank: build ``scenario``, train step 0 unwatched (the first step's gathers are
    set-up), then steps 1 and 2 with ``record`` seeing the param gathers of the groups
    ``choose_groups`` picks from the model's first chunk. Returns those groups."""
    from megatron.core import parallel_state

    from tests.support.scenarios import build_model
    from tests.support.training import train_step, wrap_and_build_optimizer

    module, config = build_model(scenario)
    model, optimizer = wrap_and_build_optimizer(module, config, scenario)
    groups = choose_groups(model[0])
    rank = parallel_state.get_data_parallel_rank()
    train_step(scenario, model, optimizer, 0, rank)
    with recording_param_gathers(groups, record, megatron_alias):
        for step in (1, 2):
            train_step(scenario, model, optimizer, step, rank)
    return groups
