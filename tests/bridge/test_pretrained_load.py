"""Continued pretraining from a checkpoint's weights (``checkpoint.pretrained_checkpoint``, a
model-only load into a built model and optimizer) with FP8 param gather (issue 46).

Per weight format (MXFP8: ``tiny_qwen3_30b_a3b``, single grouped expert weights; blockwise FP8:
``tiny_qwen3_30b_a3b_hopper``, discrete experts; NVFP4: ``tiny_qwen3_235b_a22b_nvfp4``), the
source: the recipe with FP8 / FP4 param gather off (bf16 weights) trains one iteration and
saves; its checkpoint's weights are the bf16 casts of that run's fp32 masters. Two runs load
those weights as their pretrained checkpoint, MXFP8's with single grouped expert weights owned in
runs of experts and Q/K/V parts owned apart (``grouped_weight_ownership=expert``,
``qkv_ownership=split``): param gather ON (persistent FP8 / FP4 weights) and OFF.

The claims: after the load, before any step, every master of the ON run (whole weights, expert
runs, Q/K/V parts) equals the checkpoint's value bitwise (the source's master cast to bf16 and
back), and ON = OFF: the losses and grad norms of every step, and every rank's masters and
optimizer state at the start and the end. Control: with the masters left to megatron's
``reload_model_params`` (they copy the MXFP8 weights the load just quantized), the ON run's
masters are not the checkpoint's values and the runs diverge.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support import bridge_runs as br

pytestmark = pytest.mark.usefixtures("bridge_installed")

#: Weight format -> (recipe, the overrides that turn its param gather off, its ownership). Q/K/V
#: parts and expert runs are MXFP8's: a blockwise or NVFP4 weight's owner quantizes the whole
#: matrix (128 x 128 tiles; a per-tensor amax), so those QKV weights are owned whole, and the
#: blockwise and NVFP4 recipes have discrete expert weights.
SPLIT = ("optimizer.grouped_weight_ownership=expert", "optimizer.qkv_ownership=split")
FORMATS = {
    "mxfp8": ("tiny_qwen3_30b_a3b", br.GATHER_OFF, SPLIT),
    "blockwise": ("tiny_qwen3_30b_a3b_hopper", br.GATHER_OFF, ()),
    "nvfp4": ("tiny_qwen3_235b_a22b_nvfp4", ("mixed_precision.fp4_param_gather=false",), ()),
}
STEPS = 3
COMMON = ("train.global_batch_size=4", "validation.eval_interval=2")
_made: dict[tuple[str, str], dict] = {}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory):
    """One folder per weight format (its source's checkpoint and its runs)."""
    made: dict[str, Path] = {}

    def folder(fmt: str) -> Path:
        if fmt not in made:
            made[fmt] = tmp_path_factory.mktemp(f"pretrained-load-{fmt}")
        return made[fmt]

    return folder


def _source(tmp: Path, fmt: str) -> dict:
    """Trains one iteration with bf16 weights and saves them (the pretrained checkpoint)."""
    recipe, gather_off, ownership = FORMATS[fmt]
    if (fmt, "source") not in _made:
        _made[fmt, "source"] = br.pretrain(
            tmp, "source", recipe, *COMMON, *ownership, *gather_off, "train.train_iters=1",
            *br.saving_at(tmp, 1), state_tensors=True,
        )  # fmt: skip
    return _made[fmt, "source"]


def _loaded(tmp: Path, fmt: str, tag: str, mutation: str = "") -> dict:
    """Loads the source's weights as its pretrained checkpoint and trains ``STEPS``; ``tag``
    ``off`` with the param gather off."""
    recipe, gather_off, ownership = FORMATS[fmt]
    _source(tmp, fmt)
    if (fmt, tag) not in _made:
        _made[fmt, tag] = br.pretrain(
            tmp, tag, recipe, *COMMON, *ownership, *(gather_off if tag == "off" else ()),
            f"train.train_iters={STEPS}", f"checkpoint.pretrained_checkpoint={tmp / 'ckpt'}",
            mutation=mutation, state_tensors=True,
        )  # fmt: skip
    return _made[fmt, tag]


def _masters(run: dict, when: str) -> dict[str, torch.Tensor]:
    """Every master of the run at ``when``, by the layout-free name, over all ranks."""
    found: dict[str, torch.Tensor] = {}
    for rank in run["tensors"][when]:
        for name, kinds in rank["state"].items():
            if "master" in kinds:
                found[name] = kinds["master"]
    return found


def _checkpoint_values(tmp: Path, fmt: str) -> dict[str, torch.Tensor]:
    """What the source's save wrote for each weight: its fp32 master's bf16 cast, as fp32."""
    return {
        name: master.to(torch.bfloat16).float()
        for name, master in _masters(_source(tmp, fmt), "end").items()
    }


def _differing(masters: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> list[str]:
    assert masters.keys() == values.keys()
    return [name for name in masters if not torch.equal(masters[name], values[name])]


@pytest.mark.parametrize("fmt", FORMATS)
def test_masters_start_from_the_checkpoint_values(folders, fmt):
    tmp = folders(fmt)
    on = _loaded(tmp, fmt, "on")
    masters = _masters(on, "start")
    if fmt == "mxfp8":  # Q/K/V parts and expert runs are among the masters
        assert on["qkv_parts"] > 0 and on["expert_slices"] > 0, on
    assert _differing(masters, _checkpoint_values(tmp, fmt)) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_pretrained_load_gather_on_equals_off(folders, fmt):
    tmp = folders(fmt)
    on, off = _loaded(tmp, fmt, "on"), _loaded(tmp, fmt, "off")
    assert len(br.losses(on)) == STEPS
    assert br.losses(on) == br.losses(off)
    assert br.grad_norms(on) == br.grad_norms(off)
    assert on["state"] == off["state"]
    assert on["ranks"] == off["ranks"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_control_masters_from_the_loaded_weights_diverge(folders, fmt):
    tmp = folders(fmt)
    off = _loaded(tmp, fmt, "off")
    stale = _loaded(tmp, fmt, "quantized-masters", mutation="masters_from_loaded_fp8")
    assert _differing(_masters(stale, "start"), _checkpoint_values(tmp, fmt)) != []
    assert stale["state"]["start"] != off["state"]["start"]
    assert br.grad_norms(stale) != br.grad_norms(off)
