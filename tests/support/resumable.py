"""A rank's training steps between an optional checkpoint load and save, and the bitwise
comparison of two such runs' losses, evaluations and optimizer state: what the NVFP4 tests
(``test_nvfp4_layer_wise.py``, ``test_nvfp4_param_gather.py``) share."""

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
