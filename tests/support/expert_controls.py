"""The control of the expert-weight presentation tests (single grouped = discrete, across
ownerships): a discrete run whose first MoE layer starts with its first two local experts' fc1
weights swapped, so each of them is paired with the other's initial values.

The router sends each expert other tokens than the weights were drawn for, so the run trains
other numbers from the first step; a presentation comparison that lets it through could not
see a grouped weight's experts put back in the wrong order either. Only the mutated run is
added: the reference is the parity test's own.
"""

from __future__ import annotations

import pytest
import torch

FC1 = "decoder.layers.0.mlp.experts.linear_fc1.weight"


def swap_first_two_experts(module: torch.nn.Module) -> None:
    """Swap the bf16 values of the local experts 0 and 1 of the first MoE layer's fc1 (discrete
    presentation: ``weight0``, ``weight1``)."""
    params = dict(module.named_parameters())
    first, second = params[FC1 + "0"], params[FC1 + "1"]
    assert first.shape == second.shape and not torch.equal(first, second)
    with torch.no_grad():
        saved = first.detach().clone()
        first.copy_(second)
        second.copy_(saved)


def train_with_two_experts_swapped(scenario: object) -> dict:
    """Rank function: :func:`~tests.support.training.train` of a discrete-expert scenario whose
    model is built with :func:`swap_first_two_experts` applied."""
    from tests.support import training

    build = training.build_model

    def build_and_swap(scenario_):
        module, config = build(scenario_)
        swap_first_two_experts(module)
        return module, config

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(training, "build_model", build_and_swap)
        return training.train(scenario)
