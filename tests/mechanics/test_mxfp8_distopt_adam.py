"""The emulation is faithful where upstream already works: megatron-core's own MXFP8 param gather
with DistributedOptimizer (Adam) matches FP8 param gather off, bitwise, on 2 CPU ranks.

Compared: losses, forward output, the weights the GEMMs use and every other parameter. Masters and
main_grads are per-rank shards whose boundaries move when the MXFP8 weights get their own (uint8)
buffer, so they are not comparable between the two runs.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.fp8_mlp import FP8_BOOT, FP8_MLP, skip_module_without_te
from tests.support.harness import run_on_ranks
from tests.support.parity import assert_diverges
from tests.support.scenarios import Scenario
from tests.support.training import train

skip_module_without_te("the MXFP8 emulation needs TE's Python package")

FP8 = FP8_BOOT


def _scenario(overlap: bool) -> Scenario:
    return FP8_MLP.with_(optimizer="adam", distribution="distopt", overlap=overlap, snapshots=True)


_OFF: dict[bool, list[dict]] = {}


def _off(overlap: bool) -> list[dict]:
    """FP8 param gather off, run once per session (the parity test and its control compare
    against it)."""
    if overlap not in _OFF:
        _OFF[overlap] = run_on_ranks(train, _scenario(overlap), boot=FP8)
    return _OFF[overlap]


def assert_on_equals_off(off: list[dict], on: list[dict]) -> None:
    for a, b in zip(off, on, strict=True):
        assert a["losses"] == b["losses"]
        assert torch.equal(a["probe_output"], b["probe_output"])
        for name, weight in a["effective_weights"].items():
            assert torch.equal(weight, b["effective_weights"][name]), name
        mxfp8_weights = {f"{name}.weight" for name in a["effective_weights"]}
        for name, value in a["params"].items():
            if name not in mxfp8_weights:
                assert torch.equal(value, b["params"][name]), name


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_distopt_adam_mxfp8_param_gather_on_equals_off(overlap):
    on = run_on_ranks(train, _scenario(overlap).with_(fp8_param_gather=True), boot=FP8)
    assert_on_equals_off(_off(overlap), on)
    assert len({r["digest"] for r in on}) == 1


def train_staging_doubled_masters(scenario: Scenario) -> dict:
    """Mutation: DistOpt's copy of the updated master shards into the param buffer that the
    MXFP8 gather sends (megatron's ``_copy_main_params_to_param_buffer``; the weights are
    quantized from it after the gather) writes every shard times 2. Doubling is exact (fp32,
    bf16, and MXFP8: the same codes, each block scale twice as large), so after the first step
    every gathered weight is exactly twice the OFF run's."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    stage = DistributedOptimizer._copy_main_params_to_param_buffer

    def doubled(self):
        shards = [shard for group in self.shard_fp32_from_float16_groups for shard in group]
        for shard in shards:
            shard.data.mul_(2)
        try:
            stage(self)
        finally:
            for shard in shards:
                shard.data.div_(2)  # exact: the masters go on unchanged

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DistributedOptimizer, "_copy_main_params_to_param_buffer", doubled)
        return train(scenario)


def test_control_distopt_adam_staging_doubled_masters_differs():
    """Control of the parity test (no overlap): the ON run whose param buffer receives doubled
    master shards completes and fails the same comparison with the same OFF run."""
    scenario = _scenario(False).with_(fp8_param_gather=True)
    broken = run_on_ranks(train_staging_doubled_masters, scenario, boot=FP8)
    assert_diverges(_off(False), broken, assert_on_equals_off)
