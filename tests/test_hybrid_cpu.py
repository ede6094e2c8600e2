"""The Gated DeltaNet hybrid recipes train through Megatron-Bridge on 2 CPU ranks (megatron's
``GatedDeltaNet`` on the CPU layers, fla's kernels as the references of
``nemo_lw_fp8/cpu/gated_delta_rule.py``), with FP8 param gather ON = OFF bitwise.

tiny Qwen3-Next and tiny Qwen3.5 are the same tiny model (4 layers: 3 Gated DeltaNet + 1 gated
attention, 8 experts + gated shared expert, MTP); Qwen3-Next runs here. The mutation controls
showing this comparison can fail are in ``test_bridge_training.py`` (same gather, same loop);
run once by hand on this model, the ``init_value_table`` mutation leaves these two training
losses equal but parts the evals (5.642566 vs 5.642514 at iteration 2).
"""

from __future__ import annotations

import math

import pytest

from tests.test_bridge_training import OFF, _eval_losses, _losses, _train

pytestmark = pytest.mark.usefixtures("bridge_installed")


def test_tiny_qwen3_next_fp8_gather_on_equals_off_through_bridge(tmp_path):
    on = _train(tmp_path, "on", "tiny_qwen3_next_80b_a3b", 2, eval_interval=2)
    off = _train(tmp_path, "off", "tiny_qwen3_next_80b_a3b", 2, *OFF, eval_interval=2)
    assert len(_losses(on)) == 2 and all(math.isfinite(x) for x in _losses(on))
    assert _losses(on) == _losses(off)  # exact float equality at every iteration
    # the eval at iteration 2 and the final one
    assert len(_eval_losses(on)) == 2 and all(math.isfinite(x) for x in _eval_losses(on))
    assert _eval_losses(on) == _eval_losses(off)
