"""A rank's training steps between an optional checkpoint load and save, and the bitwise
comparison of two such runs' losses, evaluations and optimizer state: what the NVFP4 tests
(``test_nvfp4_layer_wise.py``, ``test_nvfp4_param_gather.py``) share. Also what the FP8 resume
tests share: a resume in fresh rank processes and the list of what it got wrong."""

from __future__ import annotations

from typing import Any

import torch


def train_steps(
    scenario: Any,
    model: list,
    optimizer: Any,
    steps: tuple[int, int],
    *,
    load_dir: str | None = None,
    save_dir: str | None = None,
    nudge_loaded_master: bool = False,
) -> tuple[list[float], list[float]]:
    """On this rank: a ``torch_dist`` load from ``load_dir`` (then, with
    ``nudge_loaded_master``, the first layer-wise master one ulp up: the resume control),
    steps ``steps[0]..steps[1]-1`` with an evaluation after step 0, megatron's end-of-training
    sync, and a ``dp_reshardable`` save to ``save_dir``. Returns (losses, eval losses)."""
    from megatron.core import parallel_state

    from tests.support import dist_checkpoints, training
    from tests.support.resume_controls import nudge_first_layer_wise_master

    if load_dir is not None:
        dist_checkpoints.load_torch_dist(model, optimizer, load_dir)
        if nudge_loaded_master:
            nudge_first_layer_wise_master(optimizer)
    dp_rank = parallel_state.get_data_parallel_rank()
    losses, eval_losses = [], []
    for step in range(*steps):
        losses.append(training.train_step(scenario, model, optimizer, step, dp_rank))
        if step == 0:
            eval_losses.append(training.evaluate(scenario, model, optimizer))
    training.final_sync(model, optimizer)
    if save_dir is not None:
        dist_checkpoints.save_torch_dist(model, optimizer, save_dir, "dp_reshardable")
    return losses, eval_losses


def merged_state(results: list[dict]) -> dict[str, torch.Tensor]:
    """Every rank's masters and momenta (``"state"``) in one dict: each is held by its owner
    only, and two layouts may pick different owners."""
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        assert not merged.keys() & result["state"].keys(), "a master with two owners"
        merged.update(result["state"])
    return merged


def assert_same_run(reference: list[dict], results: list[dict]) -> None:
    """Losses and eval losses of every rank, every fp32 master and Muon momentum, bitwise."""
    for rank, (ref, res) in enumerate(zip(reference, results, strict=True)):
        assert ref["losses"] == res["losses"], f"rank {rank}: losses differ"
        assert ref["eval_losses"] == res["eval_losses"], f"rank {rank}: eval losses differ"
    ref_state, res_state = merged_state(reference), merged_state(results)
    assert ref_state.keys() == res_state.keys(), "the runs hold different masters / momenta"
    differ = [k for k, v in ref_state.items() if not torch.equal(v, res_state[k])]
    assert not differ, f"masters / momenta differ in {differ}"


#: scenario -> (its uninterrupted run, its first steps that saved, the checkpoint directory)
_SAVED_RUNS: dict[Any, tuple[list[dict], list[dict], str]] = {}


def runs_to_resume(
    scenario: Any, directory: str, boot: Any, save_after: int = 3
) -> tuple[list[dict], list[dict], str]:
    """``scenario`` uninterrupted and its first ``save_after`` steps saving to ``directory``,
    made once per session: a resume test and its control then compare with the same runs (the
    control reuses the test's own when the test ran first)."""
    from tests.support.harness import run_on_ranks
    from tests.support.training import train

    if scenario not in _SAVED_RUNS:
        uninterrupted = run_on_ranks(train, scenario, boot=boot)
        saving = scenario.with_(steps=save_after, save_dir=directory)
        _SAVED_RUNS[scenario] = (uninterrupted, run_on_ranks(train, saving, boot=boot), directory)
    return _SAVED_RUNS[scenario]


def _same_value(a: Any, b: Any) -> bool:
    """Tensors bit for bit, anything else (a param group's step count) by ``==``."""
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def resume_mismatches(
    uninterrupted: list[dict],
    losses_before: list[list[float]],
    resumed: list[dict],
    named: dict[str, str],
    probe: bool = False,
) -> list[str]:
    """What of a resumed run differs from the run that never stopped, per rank; empty when
    nothing does. ``losses_before``: each rank's losses of the steps before the resume;
    ``named``: result key -> label, a dict compared entry by entry (masters, optimizer state,
    effective weights); ``probe``: the probe's forward output too. Each item names the rank,
    the label and the entry, so a control can show *where* its mutation surfaced."""
    bad = []
    ranks = zip(uninterrupted, losses_before, resumed, strict=True)
    for rank, (full, before, after) in enumerate(ranks):
        if full["losses"] != before + after["losses"]:
            bad.append(f"rank {rank} losses")
        if full["digest"] != after["digest"]:
            bad.append(f"rank {rank} digest")
        for key, label in named.items():
            for name, value in full[key].items():
                if not _same_value(value, after[key][name]):
                    bad.append(f"rank {rank} {label} {name}")
        if probe and not torch.equal(full["probe_output"], after["probe_output"]):
            bad.append(f"rank {rank} probe output")
    return bad


def run_on_fresh_ranks(fn: Any, *args: Any, boot: Any, world_size: int = 2) -> list[Any]:
    """``run_on_ranks`` after ending the pool's rank processes: a resume then reads its
    checkpoint in processes that never held the saving run's state (asserted: the ranks'
    process ids are new)."""
    from tests.support.harness import get_pool, run_on_ranks

    pool = get_pool(world_size, boot)
    old_pids = [proc.pid for proc in pool._procs]
    pool.shutdown()
    results = run_on_ranks(fn, *args, world_size=world_size, boot=boot)
    assert [proc.pid for proc in get_pool(world_size, boot)._procs] != old_pids
    return results
