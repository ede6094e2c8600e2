"""The tiny Hopper recipe (blockwise FP8 compute, blockwise FP8 param gather, discrete experts)
trained by Megatron-Bridge's own ``pretrain`` loop on 2 CPU ranks: FP8 param gather ON = OFF
bitwise, with a control that switches the receivers' columnwise refresh off."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import bridge_runs as br

RECIPE = "tiny_deepseek_v3_hopper"
STEPS = 3

#: Extended: the gate checks the same claim with the same control on the flagship Hopper twin
#: (``test_recipe_twins.py``: ``deepseek_v3_hopper`` ON = OFF and its stale-columnwise control).
pytestmark = [pytest.mark.usefixtures("bridge_installed"), pytest.mark.extended]


def _train(tmp: Path, tag: str, *extra: str, mutation: str = "") -> dict:
    """One 2-rank ``nemo-lw-fp8 pretrain --cpu`` run: its losses and, per rank, what the
    layer-wise optimizer was built over (``tests/support/bridge_run.py``'s probe). A control run
    that crashes fails here: it must diverge, not die."""
    return br.pretrain(tmp, tag, RECIPE, f"train.train_iters={STEPS}",
                       f"validation.eval_interval={STEPS}", "train.global_batch_size=4", *extra,
                       mutation=mutation, probe=True)  # fmt: skip


def _losses(run: dict) -> tuple[list[float], list[float]]:
    return [row["lm loss"] for row in run["train"]], [row["lm loss"] for row in run["eval"]]


def test_tiny_hopper_fp8_gather_on_equals_off_through_bridge(tmp_path):
    on = _train(tmp_path, "on")
    off = _train(tmp_path, "off", "mixed_precision.fp8_param_gather=false")
    for rank in on["probe"] + off["probe"]:
        # Both runs on TE's modules (megatron's TE spec, the blockwise recipe's FP8 compute).
        assert rank["te_modules"] > 0 and rank["project_layers"] == 0, rank
    for rank in on["probe"]:
        # ON: persistent Float8BlockwiseQTensor weights, gathered as FP8 codes + scales.
        assert rank["blockwise_weights"] > 0 and rank["blockwise_groups"] > 0, rank
    for rank in off["probe"]:
        assert rank["blockwise_weights"] == 0 and rank["blockwise_groups"] == 0, rank
    train_on, eval_on = _losses(on)
    assert len(train_on) == STEPS and train_on[-1] < train_on[0], train_on
    assert len(eval_on) == 2  # the eval at iteration 3 and the final one
    assert _losses(on) == _losses(off)  # exact float equality, training and eval
    # Control: receivers keep the columnwise copy of the gathered weights stale, so the dgrad
    # GEMMs read last step's weights. After 3 steps the FP8 forward may still round the
    # small difference away; the losses (the evals after step 3 at least) differ.
    stale = _train(tmp_path, "stale-columnwise", mutation="blockwise_columnwise")
    assert stale["probe"][0]["blockwise_groups"] > 0
    assert _losses(stale) != _losses(off)
