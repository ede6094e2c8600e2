"""The emulation is faithful where upstream already works: megatron-core's own MXFP8 param gather
with DistributedOptimizer (Adam) matches FP8 param gather off, bitwise, on 2 CPU ranks.

Compared: losses, forward output, the weights the GEMMs use and every other parameter. Masters and
main_grads are per-rank shards whose boundaries move when the MXFP8 weights get their own (uint8)
buffer, so they are not comparable between the two runs.
"""

from __future__ import annotations

import pytest
import torch

from nemo_lw_fp8.emulation import te_backend
from tests.support.harness import BootOptions, run_on_ranks
from tests.support.scenarios import Scenario
from tests.support.training import train

if te_backend.te_package_dirs() is None:
    pytest.skip("the MXFP8 emulation needs TE's Python package", allow_module_level=True)

FP8 = BootOptions(fp8_emulation=True)


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_distopt_adam_mxfp8_param_gather_on_equals_off(overlap):
    base = Scenario(
        optimizer="adam",
        distribution="distopt",
        model="fp8mlp",
        fp8=True,
        micro_batch=32,
        overlap=overlap,
        snapshots=True,
    )
    off = run_on_ranks(train, base, boot=FP8)
    on = run_on_ranks(train, base.with_(fp8_param_gather=True), boot=FP8)
    for a, b in zip(off, on, strict=True):
        assert a["losses"] == b["losses"]
        assert torch.equal(a["probe_output"], b["probe_output"])
        for name, weight in a["effective_weights"].items():
            assert torch.equal(weight, b["effective_weights"][name]), name
        mxfp8_weights = {f"{name}.weight" for name in a["effective_weights"]}
        for name, value in a["params"].items():
            if name not in mxfp8_weights:
                assert torch.equal(value, b["params"][name]), name
    assert len({r["digest"] for r in on}) == 1
