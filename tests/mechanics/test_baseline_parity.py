"""Stock megatron-core 0.19.2 on CPU ranks: the references every later parity test builds on.

Adam: DDP and DistributedOptimizer (overlap off and on) train to the same bits. Muon: a plain,
non-distributed Muon reference and LayerWiseDistributedOptimizer (legacy path and the padded
shard-aligned layout, overlap off and on) train to the same bits. Gradient clipping is off in
these scenarios: a global grad norm is summed in an order that depends on how parameters are
sharded, so it is not bitwise comparable across layouts (see docs/testing.md).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import run_on_ranks
from tests.support.scenarios import Scenario
from tests.support.training import train


def _run(scenario: Scenario, world_size: int) -> list[dict]:
    results = run_on_ranks(train, scenario, world_size=world_size)
    digests = {r["digest"] for r in results}
    assert len(digests) == 1, f"{scenario}: ranks ended with different parameters"
    return results


def assert_same_training(reference: list[dict], candidate: list[dict], label: str) -> None:
    """Bitwise: same per-step losses on every rank and the same final parameters."""
    for rank, (ref, cand) in enumerate(zip(reference, candidate, strict=True)):
        assert ref["losses"] == cand["losses"], f"{label}: rank {rank} losses differ"
        assert ref["params"].keys() == cand["params"].keys()
        for name, value in ref["params"].items():
            assert torch.equal(value, cand["params"][name]), f"{label}: {name} differs"


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_adam_ddp_equals_distributed_optimizer(world_size):
    base = Scenario(optimizer="adam")
    reference = _run(base, world_size)
    for overlap in (False, True):
        candidate = _run(base.with_(distribution="distopt", overlap=overlap), world_size)
        assert_same_training(reference, candidate, f"distopt overlap={overlap}")


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_plugin_leaves_bf16_training_unchanged(world_size):
    """With every patch applied and FP8 off, layer-wise Muon trains to the stock bits."""
    for overlap in (False, True):
        scenario = Scenario(optimizer="muon", distribution="layerwise_padded", overlap=overlap)
        stock = _run(scenario, world_size)
        patched = _run(scenario.with_(plugin=True), world_size)
        assert_same_training(stock, patched, f"plugin on, overlap={overlap}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_layerwise_muon_equals_plain_muon(world_size):
    reference = _run(Scenario(optimizer="muon"), world_size)
    assert reference[0]["optimizer"] == "ChainedOptimizer"
    # A control: Adam trains differently, so these comparisons are able to fail.
    adam = _run(Scenario(optimizer="adam"), world_size)
    assert adam[0]["losses"][1:] != reference[0]["losses"][1:]
    for distribution in ("layerwise_legacy", "layerwise_padded"):
        for overlap in (False, True):
            scenario = Scenario(optimizer="muon", distribution=distribution, overlap=overlap)
            candidate = _run(scenario, world_size)
            assert candidate[0]["layer_wise"], f"{scenario} did not use the layer-wise optimizer"
            assert_same_training(reference, candidate, f"{distribution} overlap={overlap}")
