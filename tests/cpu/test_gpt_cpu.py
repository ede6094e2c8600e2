"""A tiny megatron-core GPTModel (megatron's Transformer Engine spec: TE's own modules over the
emulated extension) trains on two CPU ranks under DistOpt Adam and layer-wise Muon."""

from __future__ import annotations

import pytest

from tests.support.harness import run_on_ranks
from tests.support.scenarios import Scenario, boot_for
from tests.support.training import train


@pytest.mark.parametrize(
    "scenario",
    [
        Scenario(optimizer="adam", distribution="distopt"),
        Scenario(optimizer="muon", distribution="layerwise_padded", overlap=True),
    ],
    ids=["distopt-adam", "layerwise-muon"],
)
def test_tiny_gpt_trains(scenario):
    scenario = scenario.with_(model="gpt", steps=3, data="pattern", lr=2e-2, micro_batch=8)
    results = run_on_ranks(train, scenario, world_size=2, boot=boot_for(scenario))
    losses = results[0]["losses"]
    assert losses[-1] < losses[0], f"loss did not decrease: {losses}"
    assert len({r["digest"] for r in results}) == 1, "ranks hold different weights"
    assert results[0]["layer_wise"] == scenario.distribution.startswith("layerwise")
    # Built as a GPU builds it: megatron's TE spec, TE's own modules.
    te = {"TELayerNormColumnParallelLinear", "TERowParallelLinear", "TEDotProductAttention"}
    assert te <= set(results[0]["te_modules"]), results[0]["te_modules"]
