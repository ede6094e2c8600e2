"""A checkpoint the run cannot resume from is refused before anything is loaded, with the
difference and the fix (rules ``checkpoint-mismatch``, ``pretrained-checkpoint-mismatch``,
``checkpoint-missing-shard`` and ``checkpoint-truncated-shard``, patch
``bridge_checkpoint_compat``)."""

from __future__ import annotations

import pytest

from nemo_lw_fp8 import rules as guards
from nemo_lw_fp8.mechanics import checkpointing
from tests.support import bridge_runs as br

SAVED = {
    "model": {"num_layers": 3, "hidden_size": 128, "fp8": "e4m3", "fp8_recipe": "mxfp8"},
    "optimizer": {"optimizer": "dist_muon"},
}


def test_mismatch_names_every_differing_field():
    same = {section: dict(values) for section, values in SAVED.items()}
    assert guards.checkpoint_mismatch(SAVED, same, "ck/iter_2") is None
    other = {
        "model": {**SAVED["model"], "num_layers": 4, "fp8_recipe": "blockwise"},
        "optimizer": {"optimizer": "adam"},
    }
    message = guards.checkpoint_mismatch(SAVED, other, "ck/iter_2")
    assert "model.num_layers: 3 in the checkpoint, 4 here" in message
    assert "model.fp8_recipe: 'mxfp8' in the checkpoint, 'blockwise' here" in message
    assert "optimizer.optimizer: 'dist_muon'" in message and "checkpoint.load" in message
    assert "hidden_size" not in message


NVFP4_SAVED = {
    "model": {
        **SAVED["model"],
        "fp8": None,
        "fp8_recipe": None,
        "fp4": "e2m1",
        "fp4_recipe": "nvfp4",
        "fp4_param": True,
        "first_last_layers_bf16": True,
        "num_layers_at_start_in_bf16": 0,
        "num_layers_at_end_in_bf16": 1,
    },
    "optimizer": SAVED["optimizer"],
}


def test_an_nvfp4_checkpoint_is_refused_by_a_run_of_another_precision():
    """NVFP4 primary weights are FP4 codes on disk: a bf16 run (the same model otherwise) is
    refused naming the FP4 fields; a run that keeps another count of bf16 last layers too. The
    same NVFP4 run resumes."""
    same = {section: dict(values) for section, values in NVFP4_SAVED.items()}
    assert guards.checkpoint_mismatch(NVFP4_SAVED, same, "ck/iter_2") is None
    bf16_model = {name: None for name in ("fp4", "fp4_recipe")}
    bf16_model |= {"fp4_param": False, "first_last_layers_bf16": False}
    bf16_model |= {"num_layers_at_end_in_bf16": 0}
    bf16 = {**same, "model": {**same["model"], **bf16_model}}
    message = guards.checkpoint_mismatch(NVFP4_SAVED, bf16, "ck/iter_2")
    assert "model.fp4: 'e2m1' in the checkpoint, None here" in message
    assert "model.fp4_param: True in the checkpoint, False here" in message
    assert "Fix:" in message and "checkpoint.load" in message
    fewer_bf16 = {**same, "model": {**same["model"], "num_layers_at_end_in_bf16": 2}}
    message = guards.checkpoint_mismatch(NVFP4_SAVED, fewer_bf16, "ck/iter_2")
    assert message is not None and "num_layers_at_end_in_bf16: 1" in message
    assert "model.fp4:" not in message


#: A Hugging Face import's run config (bf16, Adam) and a run of the same model (MXFP8, Muon),
#: every layer an MoE layer.
IMPORTED = {
    "model": {"num_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
              "num_query_groups": None, "kv_channels": None, "num_moe_experts": 8,
              "moe_ffn_hidden_size": 64, "ffn_hidden_size": 512, "fp8": None,
              "fp8_recipe": None},
    "optimizer": {"optimizer": "adam"},
}  # fmt: skip
RUN = {
    "model": {**IMPORTED["model"], "num_query_groups": 4, "kv_channels": 32,
              "ffn_hidden_size": 256, "moe_layer_freq": 1, "fp8": "e4m3",
              "fp8_recipe": "mxfp8"},
    "optimizer": {"optimizer": "dist_muon"},
}  # fmt: skip


def test_a_pretrained_checkpoint_is_compared_by_its_weight_shapes_only():
    """FP8 recipe, optimizer, an ``ffn_hidden_size`` no layer uses and fields megatron derives
    (``kv_channels``, ``num_query_groups``) written out on one side only: none is a difference
    for a model-only load; the same pair is one for a resume."""
    assert guards.pretrained_checkpoint_mismatch(IMPORTED, RUN, "hf/iter_0") is None
    assert guards.checkpoint_mismatch(IMPORTED, RUN, "hf/iter_0") is not None


def test_a_pretrained_checkpoint_of_other_shapes_is_refused_naming_pretrained_checkpoint():
    other = {**RUN, "model": {**RUN["model"], "moe_ffn_hidden_size": 32, "kv_channels": 16}}
    message = guards.pretrained_checkpoint_mismatch(IMPORTED, other, "hf/iter_0")
    assert "model.moe_ffn_hidden_size: 64 in the checkpoint, 32 here" in message
    assert "model.kv_channels: 32 in the checkpoint, 16 here" in message
    assert "checkpoint.pretrained_checkpoint" in message and "checkpoint.load" not in message
    assert "model.fp8" not in message and "optimizer" not in message


def test_a_dense_layer_makes_ffn_hidden_size_count():
    """Control of the ``ffn_hidden_size`` exception: with a dense first layer
    (``moe_layer_freq=[0, 1]``) the width shapes a weight, and differs."""
    dense_first = {**RUN, "model": {**RUN["model"], "moe_layer_freq": [0, 1]}}
    message = guards.pretrained_checkpoint_mismatch(IMPORTED, dense_first, "hf/iter_0")
    assert "model.ffn_hidden_size: 512 in the checkpoint, 256 here" in (message or "")


def test_missing_files_are_listed(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"a": torch.ones(4), "b": torch.zeros(2)}, checkpoint_id=str(tmp_path), no_dist=True)
    assert checkpointing.missing_files(str(tmp_path)) == []
    shard = next(tmp_path.glob("*.distcp"))
    shard.unlink()
    assert checkpointing.missing_files(str(tmp_path)) == [shard.name]
    message = guards.checkpoint_missing_files([shard.name], str(tmp_path))
    assert shard.name in message and "ckpt_step" in message
    (tmp_path / ".metadata").unlink()
    assert checkpointing.missing_files(str(tmp_path)) == [".metadata"]


def test_truncated_files_are_listed(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"a": torch.ones(64), "b": torch.zeros(8)}, checkpoint_id=str(tmp_path), no_dist=True)
    assert checkpointing.truncated_files(str(tmp_path)) == {}  # control: a complete copy
    shard = next(tmp_path.glob("*.distcp"))
    size = shard.stat().st_size
    with open(shard, "r+b") as handle:  # an interrupted copy: one byte short
        handle.truncate(size - 1)
    short = checkpointing.truncated_files(str(tmp_path))
    assert list(short) == [shard.name] and short[shard.name][0] == size - 1
    assert short[shard.name][1] <= size  # what the metadata needs lies inside the full file
    message = guards.checkpoint_truncated_files(short, str(tmp_path))
    assert shard.name in message and f"{size - 1} of" in message and "ckpt_step" in message
    assert guards.checkpoint_truncated_files({}, str(tmp_path)) is None


@pytest.mark.usefixtures("bridge_installed")
def test_bridge_refuses_another_recipe_and_a_missing_shard(tmp_path):
    """Saved by tiny DeepSeek-V3: loading it into tiny Qwen3 stops at the config comparison on
    every rank; with one shard file cut short, then gone, the same recipe stops before reading
    tensors."""
    ckpt = tmp_path / "ckpt"
    br.pretrain(tmp_path, "save", "tiny_deepseek_v3", "train.train_iters=1",
                "validation.eval_interval=1", f"checkpoint.save={ckpt}",
                "checkpoint.save_interval=1")  # fmt: skip
    load = ("train.train_iters=2", f"checkpoint.load={ckpt}")
    other = br.pretrain_refused(tmp_path, "other", "tiny_qwen3_30b_a3b", *load)
    assert "[nemo_lw_fp8:checkpoint-mismatch]" in other
    assert "model.multi_latent_attention: True in the checkpoint, False here" in other

    shard = sorted((ckpt / "iter_0000001").glob("*.distcp"))[-1]
    with open(shard, "r+b") as handle:
        handle.truncate(shard.stat().st_size // 2)
    cut = br.pretrain_refused(tmp_path, "cut", "tiny_deepseek_v3", *load)
    assert "[nemo_lw_fp8:checkpoint-truncated-shard]" in cut and shard.name in cut
    shard.unlink()
    missing = br.pretrain_refused(tmp_path, "missing", "tiny_deepseek_v3", *load)
    assert "[nemo_lw_fp8:checkpoint-missing-shard]" in missing and shard.name in missing
