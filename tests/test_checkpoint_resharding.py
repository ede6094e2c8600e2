"""A ``fully_reshardable`` checkpoint of a layer-wise MXFP8 run resumes at another
data-parallel size (2 -> 4 -> 2) with the same fp32 masters, Muon momentum and Adam state.

Layer-wise ownership depends on the data-parallel size (a DP 4 rank owns other matrices than a
DP 2 rank), so the loaded state is compared where it is global: each load is saved again at
once, and the two checkpoints' tensors (model weights, masters, momentum, Adam moments, all in
model space with ``fully_reshardable``) must be equal bit for bit. The comparison can fail: a
save after each rank's first Muon master is nudged by one ulp differs (the control).
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_lw_fp8.emulation import te_backend
from tests.support.harness import BootOptions, run_on_ranks
from tests.test_checkpointing import BASE, _build

if te_backend.te_package_dirs() is None:  # find, never import, TE in this process
    pytest.skip("the MXFP8 emulation needs TE's Python package", allow_module_level=True)

FP8 = BootOptions(fp8_emulation=True)
SHARDING = "fully_reshardable"


def train_and_save(scenario, directory: str, steps: int) -> None:
    from megatron.core import parallel_state

    from tests.support import dist_checkpoints as ckpt
    from tests.support.training import train_step

    dp_rank = parallel_state.get_data_parallel_rank()
    model, optimizer = _build(scenario, scenario.seed)
    for step in range(steps):
        train_step(scenario, model, optimizer, step, dp_rank)
    ckpt.save_torch_dist(model, optimizer, directory, SHARDING, fully_parallel=False)


def load_save_and_train(scenario, source: str, again: str, nudged: str | None) -> float:
    """Load ``source`` into a model built from another seed, save it to ``again`` at once; with
    ``nudged``, also save after moving one Muon master by one ulp. Then train one step."""
    from megatron.core import parallel_state

    from tests.support import dist_checkpoints as ckpt
    from tests.support.training import train_step

    dp_rank = parallel_state.get_data_parallel_rank()
    model, optimizer = _build(scenario, scenario.seed + 1)
    ckpt.load_torch_dist(model, optimizer, source, fully_parallel=False)
    ckpt.save_torch_dist(model, optimizer, again, SHARDING, fully_parallel=False)
    if nudged is not None:
        live = ckpt.optimizer_tensors(optimizer, model[0].module)
        masters = [v for k, v in sorted(live.items()) if k.startswith("layerwise:master:")]
        if masters:  # the ranks that own a Muon matrix
            first = masters[0].view(-1)
            first[0] = torch.nextafter(first[0], torch.tensor(math.inf))
        ckpt.save_torch_dist(model, optimizer, nudged, SHARDING, fully_parallel=False)
    return train_step(scenario, model, optimizer, 3, dp_rank)


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


def _differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    keys = sorted(set(a) | set(b))
    return [k for k in keys if k not in a or k not in b or not torch.equal(a[k], b[k])]


def test_resume_at_another_data_parallel_size_keeps_the_state(tmp_path):
    scenario = BASE.with_(steps=3)
    at2, at4, back2, nudged = (tmp_path / name for name in ("dp2", "dp4", "dp2-again", "nudged"))
    for directory in (at2, at4, back2, nudged):
        directory.mkdir()
    run_on_ranks(train_and_save, scenario, str(at2), 3, world_size=2, boot=FP8, timeout=400)
    losses4 = run_on_ranks(load_save_and_train, scenario, str(at2), str(at4), str(nudged),
                           world_size=4, boot=FP8, timeout=400)  # fmt: skip
    losses2 = run_on_ranks(load_save_and_train, scenario, str(at4), str(back2), None,
                           world_size=2, boot=FP8, timeout=400)  # fmt: skip

    saved = _tensors(at2)
    kinds = ("fp32_param", "momentum_buffer", "exp_avg", "exp_avg_sq")
    for kind in kinds:  # what must be in the checkpoint, to be compared
        assert any(kind in key for key in saved), (kind, sorted(saved))
    assert _differences(saved, _tensors(at4)) == []  # DP 2 -> DP 4
    assert _differences(saved, _tensors(back2)) == []  # DP 4 -> DP 2
    assert all(math.isfinite(loss) for loss in losses4 + losses2)  # training goes on
    # Control: one ulp on one master shows.
    moved = _differences(saved, _tensors(nudged))
    assert moved and all("fp32_param" in key for key in moved), moved
