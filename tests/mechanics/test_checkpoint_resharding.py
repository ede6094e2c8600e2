"""A checkpoint of a layer-wise MXFP8 run resumes at another data-parallel size (2 -> 4 -> 2)
with the same fp32 masters, Muon momentum and Adam state, in both sharding types of the sibling
Adam DistributedOptimizer: ``fully_reshardable`` (model space) and ``dp_reshardable`` (megatron's
default: each bucket one flat tensor of its unpadded size, which does not depend on the DP size).

Layer-wise ownership depends on the data-parallel size (a DP 4 rank owns other matrices than a
DP 2 rank), so the loaded state is compared where it is global: each load is saved again at
once, and the two checkpoints' tensors (model weights, masters, momentum, Adam moments) must be
equal bit for bit. A ``dp_reshardable`` bucket tensor also holds the gaps that align each
parameter's start to 64 elements, written from uninitialised memory: there only the parameters'
elements are compared (their ranges, read from the buckets, are the same at both sizes). The
comparison can fail: a save after each rank's first Muon master is nudged by one ulp differs
(the control).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from nemo_lw_fp8.cpu.te import backend as te_backend
from tests.mechanics.test_checkpointing import BASE, _build
from tests.support.harness import BootOptions, run_on_ranks

if te_backend.te_package_dirs() is None:  # find, never import, TE in this process
    pytest.skip("the MXFP8 emulation needs TE's Python package", allow_module_level=True)

FP8 = BootOptions(fp8_emulation=True)


def adam_param_ranges(optimizer) -> list[tuple[int, int, int, int, int]]:
    """Where the sibling Adam's parameters sit in its ``dp_reshardable`` bucket tensors:
    ``(dp_group_idx, gbuf_idx, bucket_idx, start, end)``, as the bucket keys number them."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer):
            continue
        for gbuf_idx, buffer in enumerate(opt.buffers):
            for start, end, bucket_id in buffer.param_index_map.values():
                offset = buffer.buckets[bucket_id].offset
                group = opt.data_parallel_group_idx
                out.append((group, gbuf_idx, bucket_id, start - offset, end - offset))
    return sorted(out)


def train_and_save(scenario, directory: str, steps: int, sharding: str) -> list:
    from megatron.core import parallel_state

    from tests.support import dist_checkpoints as ckpt
    from tests.support.training import train_step

    dp_rank = parallel_state.get_data_parallel_rank()
    model, optimizer = _build(scenario, scenario.seed)
    for step in range(steps):
        train_step(scenario, model, optimizer, step, dp_rank)
    ckpt.save_torch_dist(model, optimizer, directory, sharding, fully_parallel=False)
    return adam_param_ranges(optimizer)


def load_save_and_train(
    scenario, source: str, again: str, nudged: str | None, sharding: str
) -> tuple[float, list]:
    """Load ``source`` into a model built from another seed, save it to ``again`` at once; with
    ``nudged``, also save after moving one Muon master by one ulp. Then train one step; the
    loss, and where the Adam parameters sit in the buckets."""
    from megatron.core import parallel_state

    from tests.support import dist_checkpoints as ckpt
    from tests.support.training import train_step

    dp_rank = parallel_state.get_data_parallel_rank()
    model, optimizer = _build(scenario, scenario.seed + 1)
    ckpt.load_torch_dist(model, optimizer, source, fully_parallel=False)
    ckpt.save_torch_dist(model, optimizer, again, sharding, fully_parallel=False)
    if nudged is not None:
        live = ckpt.optimizer_tensors(optimizer, model[0].module)
        masters = [v for k, v in sorted(live.items()) if k.startswith("layerwise:master:")]
        if masters:  # the ranks that own a Muon matrix
            first = masters[0].view(-1)
            first[0] = torch.nextafter(first[0], torch.tensor(math.inf))
        ckpt.save_torch_dist(model, optimizer, nudged, sharding, fully_parallel=False)
    return train_step(scenario, model, optimizer, 3, dp_rank), adam_param_ranges(optimizer)


def _tensors(directory) -> dict[str, torch.Tensor]:
    """Every tensor of a ``torch_dist`` checkpoint, read without megatron."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    return state


#: A ``dp_reshardable`` bucket tensor's key: its DP group, buffer and bucket indices.
_BUCKET_KEY = re.compile(r"dp_group_idx_(\d+)\.gbuf_idx_(\d+)\..*\.bucket_idx_(\d+)\.")


def _compared(key: str, tensor: torch.Tensor, ranges: list) -> torch.Tensor:
    """``tensor``, or for a ``dp_reshardable`` bucket its parameters' elements only."""
    bucket = _BUCKET_KEY.search(key)
    if bucket is None:
        return tensor
    where = tuple(int(i) for i in bucket.groups())
    spans = sorted((s, e) for *at, s, e in ranges if tuple(at) == where)
    assert spans, (key, ranges)  # a bucket of parameters
    return torch.cat([tensor[s:e] for s, e in spans])


def _differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], ranges=()) -> list[str]:
    keys = sorted(set(a) | set(b))
    return [
        k for k in keys
        if k not in a or k not in b
        or not torch.equal(_compared(k, a[k], ranges), _compared(k, b[k], ranges))
    ]  # fmt: skip


@pytest.mark.parametrize("sharding", ["fully_reshardable", "dp_reshardable"])
def test_resume_at_another_data_parallel_size_keeps_the_state(tmp_path, sharding):
    scenario = BASE.with_(steps=3)
    at2, at4, back2, nudged = (tmp_path / name for name in ("dp2", "dp4", "dp2-again", "nudged"))
    for directory in (at2, at4, back2, nudged):
        directory.mkdir()
    ranges = run_on_ranks(train_and_save, scenario, str(at2), 3, sharding, world_size=2,
                          boot=FP8, timeout=400)[0]  # fmt: skip
    at_dp4 = run_on_ranks(load_save_and_train, scenario, str(at2), str(at4), str(nudged),
                          sharding, world_size=4, boot=FP8, timeout=400)  # fmt: skip
    at_dp2 = run_on_ranks(load_save_and_train, scenario, str(at4), str(back2), None, sharding,
                          world_size=2, boot=FP8, timeout=400)  # fmt: skip
    # The Adam buckets keep their parameters where they were at either size.
    assert ranges and all(r == ranges for _, r in at_dp4 + at_dp2)
    losses = [loss for loss, _ in at_dp4 + at_dp2]

    saved = _tensors(at2)
    kinds = ("fp32_param", "momentum_buffer", "exp_avg", "exp_avg_sq")
    for kind in kinds:  # what must be in the checkpoint, to be compared
        assert any(kind in key for key in saved), (kind, sorted(saved))
    assert _differences(saved, _tensors(at4), ranges) == []  # DP 2 -> DP 4
    assert _differences(saved, _tensors(back2), ranges) == []  # DP 4 -> DP 2
    assert all(math.isfinite(loss) for loss in losses)  # training goes on
    # Control: one ulp on one master shows.
    moved = _differences(saved, _tensors(nudged), ranges)
    assert moved and all("fp32_param" in key for key in moved), moved
