"""``--losses-json``'s per-name state record on the backend a GPU run uses.

``state_by_name`` puts the sibling DistributedOptimizer's Adam state back together with an
all-reduce over its data-parallel group. NCCL reduces CUDA tensors only (a CPU tensor raises
inside ``torch.distributed``), gloo CPU tensors: the reduce buffers follow the group's backend.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nemo_lw_fp8.mechanics import state_by_name


@pytest.mark.parametrize(
    ("backend", "expected"), [(dist.Backend.NCCL, "cuda:3"), (dist.Backend.GLOO, "cpu")]
)
def test_reduce_buffers_live_where_the_backend_reduces(monkeypatch, backend, expected):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert state_by_name._collective_device(object()) == torch.device(expected)


def test_ranks_that_disagree_are_named():
    same = {"pp0/chunk0/w": {"master": "a"}}
    assert state_by_name.union([same, same]) == same
    with pytest.raises(state_by_name.StateDisagreement, match="rank 1 disagrees on pp0/chunk0/w"):
        state_by_name.union([same, {"pp0/chunk0/w": {"master": "b"}}])
