"""Patch ``mla_local_attention``: multi-latent attention builds and is right without TE."""

from __future__ import annotations

from tests.support.harness import run_on_ranks
from tests.support.mla_probe import local_attention_probe, mla_gpt_probe


def test_unpatched_local_attention_rejects_mla_channels():
    result = run_on_ranks(local_attention_probe, False, world_size=1)[0]
    assert result["built"] is False and "k_channels" in result["error"]


def test_patched_local_attention_matches_reference_softmax_attention():
    result = run_on_ranks(local_attention_probe, True, world_size=1)[0]
    assert result["built"] and result["shape"] == [8, 2, 4 * 32]
    assert result["max_error"] < 1e-5  # fp32 attention vs an fp32 reference (summation order)


def test_mla_gpt_trains_on_the_local_spec():
    losses = run_on_ranks(mla_gpt_probe, world_size=1)[0]["losses"]
    assert losses[-1] < losses[0], losses
