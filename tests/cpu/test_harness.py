"""The CPU rank harness: results per rank, failures with tracebacks, deadlines, stand-ins."""

from __future__ import annotations

import os
import time

import pytest
import torch

from nemo_lw_fp8.cpu.megatron import standins
from nemo_lw_fp8.patches import record
from tests.support.harness import (
    BootOptions,
    RankFailure,
    RankPool,
    RankTimeout,
    get_pool,
    run_on_ranks,
)

# Failure tests kill their pool; keep them off the pool the parity tests share.
DISPOSABLE = BootOptions(standins=("cuda_runtime", "cuda_device"))


def _rank_and_pid():
    import torch.distributed as dist

    return dist.get_rank(), os.getpid()


def _raise_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    # The other ranks wait for rank 1 in a collective that never completes.
    dist.barrier()
    return "fine"


def _hang_on_rank_zero():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        while True:
            time.sleep(0.05)
    return "done"


def _uneven_all_gather():
    import torch.distributed as dist

    rank = dist.get_rank()
    world = dist.get_world_size()
    mine = torch.full((rank + 1,), float(rank))
    out = [torch.empty(r + 1) for r in range(world)]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def _cuda_calls_on_cpu():
    from megatron.core import tensor_parallel

    from tests.support.scenarios import seed_all

    seed_all(7)
    made = torch.zeros(3, device="cuda")
    typed = made.to(torch.bfloat16).type()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    outside_before = torch.get_rng_state()
    with tracker.fork():
        inside = torch.rand(2)
    outside_after = torch.get_rng_state()
    return (
        str(made.device),
        typed,
        torch.cuda.current_device(),
        inside,
        bool(torch.equal(outside_before, outside_after)),
    )


def test_results_come_back_per_rank_and_pool_is_reused():
    first = run_on_ranks(_rank_and_pid, world_size=2)
    second = run_on_ranks(_rank_and_pid, world_size=2)
    assert [rank for rank, _ in first] == [0, 1]
    assert first == second, "rank processes were restarted between calls"


def test_rank_exception_ends_every_rank_within_a_bound():
    """Rank 1 raises while rank 0 waits for it in a barrier: the call fails in seconds (not at
    the 120 s deadline) with rank 1's traceback and rank 0's stack, and no rank is left."""
    pool = get_pool(2, DISPOSABLE)
    started = time.monotonic()
    with pytest.raises(RankFailure) as info:
        pool.run(_raise_on_rank_one, timeout=120)
    elapsed = time.monotonic() - started
    assert elapsed < 20, f"took {elapsed:.1f}s to end the ranks"
    assert not isinstance(info.value, AssertionError), "a crash must never satisfy a control"
    message = str(info.value)
    assert "ranks [1] failed (ranks [0] did not finish and were ended)" in message
    assert "ValueError: rank one refuses" in message
    assert "_raise_on_rank_one" in info.value.per_rank[1]
    assert "_raise_on_rank_one" in info.value.stuck[0], "rank 0's stack does not show the wait"
    assert not pool.alive
    assert all(not proc.is_alive() for proc in pool._procs)
    # The broken pool was discarded; the next call gets a working one.
    assert run_on_ranks(_rank_and_pid, world_size=2, boot=DISPOSABLE)[1][0] == 1


def test_hanging_rank_is_ended_at_the_deadline():
    pool = get_pool(2, DISPOSABLE)
    started = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        pool.run(_hang_on_rank_zero, timeout=3)
    assert time.monotonic() - started < 20
    assert "deadline of 3s" in str(info.value)
    assert "_hang_on_rank_zero" in info.value.per_rank[0], "stack dump does not show the hang"
    assert not pool.alive
    assert all(not proc.is_alive() for proc in pool._procs)


@pytest.mark.parametrize("world_size", [2, 4])
def test_uneven_all_gather_fallback(world_size):
    results = run_on_ranks(_uneven_all_gather, world_size=world_size)
    expected = [[float(r)] * (r + 1) for r in range(world_size)]
    assert all(result == expected for result in results)


def test_cuda_call_sites_run_on_cpu():
    results = run_on_ranks(_cuda_calls_on_cpu, world_size=2)
    device, typed, current, inside0, outside_untouched = results[0]
    assert device == "cpu"
    assert typed == "torch.cuda.BFloat16Tensor"
    assert current == torch.device("cpu")
    assert outside_untouched, "fork() leaked its RNG state into the default generator"
    # Model-parallel RNG states are seeded by rank-independent seeds at TP=1: equal across DP.
    assert torch.equal(inside0, results[1][3])


def _model_draws_across_a_resume(use_device_stream: bool) -> bool:
    """Save both generators, draw as the model does, restore them, make a DataLoader iterator
    (a host draw, as Bridge's setup does after a checkpoint load), draw again: equal draws?"""
    import contextlib

    from megatron.core.models.gpt.gpt_model import GPTModel
    from torch.utils.data import DataLoader

    from nemo_lw_fp8.cpu.megatron.standins import DEVICE_RNG

    assert hasattr(GPTModel.forward, "__wrapped__")  # the model's forward runs on the stream
    model = DEVICE_RNG.active if use_device_stream else contextlib.nullcontext
    torch.manual_seed(5)
    host, device = torch.get_rng_state(), torch.cuda.get_rng_state()
    with model():
        first = torch.nn.functional.dropout(torch.ones(64), p=0.5)
    torch.set_rng_state(host)
    torch.cuda.set_rng_state(device)
    iter(DataLoader(list(range(4))))
    with model():
        second = torch.nn.functional.dropout(torch.ones(64), p=0.5)
    return bool(torch.equal(first, second))


def test_cuda_generator_is_a_stream_of_its_own():
    """Dropout draws come back after a restore whatever the host drew in between; control: on
    the one CPU generator (the stand-in's former behaviour) the DataLoader's draw shifts them."""
    [same] = run_on_ranks(_model_draws_across_a_resume, True, world_size=1)
    [shared] = run_on_ranks(_model_draws_across_a_resume, False, world_size=1)
    assert same and not shared


def test_standins_uninstall_restores_originals():
    names = ("cuda_runtime", "uneven_all_gather")
    before = {
        "current_device": torch.cuda.current_device,
        "Stream": torch.cuda.Stream,
        "all_gather": torch.distributed.all_gather,
    }
    standins.install(names)
    try:
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.distributed.all_gather is not before["all_gather"]
        assert set(standins.installed()) == set(names)
    finally:
        standins.uninstall_all()
    assert torch.cuda.current_device is before["current_device"]
    assert torch.cuda.Stream is before["Stream"]
    assert torch.distributed.all_gather is before["all_gather"]
    assert standins.installed() == []


def test_unknown_standin_is_refused():
    with pytest.raises(KeyError, match="unknown CPU stand-in"):
        standins.install(("warp_drive",))


def _mock_under_the_plugin() -> str:
    """A task that does what ``ordered_grad_sync`` does: a wrapper over megatron's
    ``start_grad_sync``, then the plugin applied over it (recording the wrapper as megatron's
    original), the wrapper's context left before the task ends."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    import nemo_lw_fp8

    group_cls = pgb._ParamAndGradBucketGroup
    original = group_cls.__dict__["start_grad_sync"]

    def wrapper(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    # It runs megatron's method: the test-only door counts it as that method.
    with record.counted_as(wrapper, original), pytest.MonkeyPatch.context() as mp:
        mp.setattr(group_cls, "start_grad_sync", wrapper)
        nemo_lw_fp8.apply()
        inside = group_cls.__dict__["start_grad_sync"]
    return inside.__wrapped__.__qualname__


def _start_grad_sync_owner() -> tuple[str, str, bool]:
    from megatron.core.distributed import param_and_grad_buffer as pgb

    function = pgb._ParamAndGradBucketGroup.__dict__["start_grad_sync"]
    return function.__module__, function.__qualname__, hasattr(function, "__wrapped__")


def test_mocks_never_outlive_their_task():
    """The plugin's revert after a task would put a task's mock back (it was the plugin's
    'original'); the harness then restores megatron's own method, recorded at start-up."""
    inside = run_on_ranks(_mock_under_the_plugin, world_size=1)[0]
    # Inside the task the plugin wrapped the mock (recorded as megatron's original).
    assert inside == "_mock_under_the_plugin.<locals>.wrapper"
    module, qualname, wrapped = run_on_ranks(_start_grad_sync_owner, world_size=1)[0]
    assert module == "megatron.core.distributed.param_and_grad_buffer"
    assert qualname == "_ParamAndGradBucketGroup.start_grad_sync" and not wrapped
    # Control: the plugin's revert alone leaves the task's mock in megatron's place.
    leftover = run_on_ranks(_what_revert_alone_leaves, world_size=1)[0]
    assert leftover == "_mock_under_the_plugin.<locals>.wrapper"


def _what_revert_alone_leaves() -> str:
    """Control: the same task, then the plugin's revert (the first half of the clean-up)."""
    import nemo_lw_fp8

    _mock_under_the_plugin()
    nemo_lw_fp8.revert()
    return _start_grad_sync_owner()[1]


def _own_state() -> str:
    import os

    with open(f"/proc/{os.getpid()}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0]


def test_idle_ranks_are_stopped_between_tasks():
    """A pool's ranks run for a task and are stopped (state ``T``) between tasks, so the gloo
    loop threads of idle pools take no CPU from the test that runs."""
    import time

    from tests.support.harness import get_pool

    assert run_on_ranks(_own_state, world_size=2) == ["R", "R"]
    pool = get_pool(2)
    deadline = time.monotonic() + 5.0  # a signal is delivered asynchronously
    while True:
        states = []
        for proc in pool._procs:
            with open(f"/proc/{proc.pid}/stat") as handle:
                states.append(handle.read().rsplit(")", 1)[1].split()[0])
        if states == ["T", "T"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert states == ["T", "T"]


def _tiny_training_and_import_order() -> tuple[list[float], str, bool, int]:
    """The cheapest training scenario (Adam, DDP, the tiny MLP, two steps), and whether
    megatron's grad buffers call the ``gloo_coalescing`` stand-in (a name they import: the
    zygote must import megatron after the stand-ins, as a spawned rank does)."""
    import threading

    from megatron.core.distributed import param_and_grad_buffer

    from tests.support.scenarios import Scenario
    from tests.support.training import train

    result = train(Scenario(optimizer="adam", steps=2))
    coalescing = param_and_grad_buffer._coalescing_manager is torch.distributed._coalescing_manager
    return result["losses"], result["digest"], coalescing, threading.active_count()


def test_forked_ranks_train_as_spawned_ones():
    """Ranks forked from the zygote (the default start) train to the same bits as ranks spawned
    as fresh interpreters (``NEMO_LW_FP8_POOL_START=spawn``), with megatron importing the same
    stand-ins; the forked pool did not fall back to spawning."""
    forked_pool = get_pool(2, start="fork")
    forked = forked_pool.run(_tiny_training_and_import_order)
    assert forked_pool.start == "fork"
    assert all(type(proc).__name__ == "_ForkedRank" for proc in forked_pool._procs)
    spawned_pool = RankPool(2, start="spawn")
    try:
        spawned = spawned_pool.run(_tiny_training_and_import_order)
    finally:
        spawned_pool.shutdown()
    assert forked == spawned
    assert forked[0][2], "megatron's grad buffers do not use the gloo_coalescing stand-in"
    assert len(forked[0][0]) == 2
