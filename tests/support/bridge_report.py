"""Build every recipe and probe the Megatron-Bridge integration in a fresh process.

Run by ``tests/recipes/test_recipes.py`` (``python tests/support/bridge_report.py OUT.json``):
Bridge imports Transformer Engine, which must be booted (emulation) before megatron-core is
imported, so this cannot run inside the pytest process. It writes one JSON report the tests assert
on.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

import nemo_lw_fp8
from nemo_lw_fp8.cpu.te import backend as te_backend

te_backend.activate()

from nemo_lw_fp8 import bridge, recipes  # noqa: E402
from nemo_lw_fp8 import config as plugin_config  # noqa: E402
from nemo_lw_fp8 import planner as architectures  # noqa: E402
from nemo_lw_fp8.cli.pretrain import resolve_config  # noqa: E402
from nemo_lw_fp8.recipes.yaml_files import recipe_row  # noqa: E402
from nemo_lw_fp8.rules import ConfigError  # noqa: E402
from nemo_lw_fp8.vocabulary import SINGLE_GROUPED_WEIGHT_ENV  # noqa: E402

SWITCH = SINGLE_GROUPED_WEIGHT_ENV


def _hf_directory() -> str:
    """A directory Bridge takes for a Hugging Face model (``config.json`` beside a safetensors
    file): the rule looks at its shape only, nothing is loaded."""
    path = tempfile.mkdtemp(prefix="hf-dir-")
    for name, text in (("config.json", "{}"), ("model.safetensors", "")):
        with open(os.path.join(path, name), "w") as handle:
            handle.write(text)
    return path


def guard_case(recipe: str, overrides: list[str]) -> str:
    """The rule a bad override combination trips in finalize ("" if none)."""
    try:
        resolve_config(recipe, None, overrides)
    except ConfigError as error:
        return f"{error.rule}|{error}"
    return ""


GUARD_CASES = {
    "mxfp8-without-reuse": ("tiny_deepseek_v3", [
        "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=false"]),
    "legacy-layout-fp8": ("tiny_deepseek_v3", ["optimizer.layer_wise_layout=legacy"]),
    "overlap-disagree": ("tiny_deepseek_v3", ["ddp.overlap_param_gather=false"]),
    # DeepSeek-V3 (multi-latent attention) at TP 2, experts at ETP 1: passes ("" expected;
    # tests/bridge/test_tp_mla_training.py), every MLA width's TP shard whole 32-wide blocks.
    "tensor-parallel": ("deepseek_v3_mxfp8", ["model.tensor_model_parallel_size=2"]),
    "expert-tensor-parallel": ("qwen3_30b_a3b_mxfp8", ["model.expert_tensor_parallel_size=2"]),
    # Bridge's H100 shape: blockwise gather at TP 2, experts at ETP 1 (passes: "" expected),
    # and the same with an ffn width whose TP shard (3136) splits a 128-wide block.
    "tensor-parallel-hopper": ("qwen3_30b_a3b_hopper", ["model.tensor_model_parallel_size=2"]),
    "tensor-parallel-hybrid": ("qwen3_next_80b_a3b_hopper", [
        "model.tensor_model_parallel_size=2"]),
    "tp-block-boundary": ("qwen3_30b_a3b_hopper", [
        "model.tensor_model_parallel_size=2", "model.ffn_hidden_size=6272"]),
    # The TP-2 twin of Qwen3-235B on H100 with the TP-1 tiny widths (4 heads x 32 channels):
    # 64 linear_proj columns per shard split a 128-wide tile (its own widths pass, above).
    "twin-tp2-tp1-widths": ("twin_qwen3_235b_a22b_hopper", ["model.kv_channels=32"]),
    # The TP-2 twin of DeepSeek-V3 on H100 with the TP-1 tiny MLA widths (4 heads: linear_proj
    # 4 x 32 = 128 columns, 64 per shard) splits a 128-wide tile too.
    "twin-mla-tp2-tp1-widths": ("twin_deepseek_v3_hopper", ["model.num_attention_heads=4"]),
    "fsdp": ("tiny_qwen3_30b_a3b", ["ddp.use_megatron_fsdp=true"]),
    "no-grouped-gemm": ("tiny_deepseek_v3", ["model.moe_grouped_gemm=false"]),
    "no-op-fuser": ("tiny_deepseek_v3", ["model.use_transformer_engine_op_fuser=false"]),
    "cpu-offload": ("tiny_deepseek_v3", ["optimizer.optimizer_cpu_offload=true"]),
    "bad-layout": ("tiny_deepseek_v3", ["optimizer.layer_wise_layout=diagonal"]),
    "blockwise-with-reuse": ("deepseek_v3_hopper", [
        "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=true"]),
    "tensorwise-gather": ("tiny_deepseek_v3", [
        "mixed_precision.fp8_recipe=tensorwise",
        "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=false"]),
    "overlap-with-step": ("tiny_deepseek_v3", [
        "optimizer.overlap_param_gather_with_optimizer_step=true"]),
    "two-instances": ("tiny_deepseek_v3", ["ddp.num_distributed_optimizer_instances=2"]),
    "negative-tolerance": ("tiny_deepseek_v3", ["optimizer.gather_padding_tolerance=-1"]),
    "switch-off": ("tiny_deepseek_v3", [f"env_vars.{SWITCH}='0'"]),
    "gather-without-fp8": ("tiny_deepseek_v3", [
        "mixed_precision.fp8=null", "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=false"]),
    "fp16": ("tiny_qwen3_30b_a3b", ["mixed_precision.bf16=false", "mixed_precision.fp16=true"]),
    "bad-ownership": ("tiny_deepseek_v3", ["optimizer.grouped_weight_ownership=per-expert"]),
    "bad-grad-sync": ("tiny_deepseek_v3", ["optimizer.layer_wise_grad_sync=reduce_scatter"]),
    "grad-norms-logged": ("tiny_deepseek_v3", ["logger.log_l2_norm_grad_to_tensorboard=true"]),
    "expert-runs-padded": ("tiny_deepseek_v3", [
        "optimizer.layer_wise_layout=padded", "optimizer.grouped_weight_ownership=expert"]),
    "context-parallel": ("tiny_deepseek_v3", ["model.context_parallel_size=2"]),
    "torch-checkpoints": ("tiny_deepseek_v3", ["checkpoint.ckpt_format=torch"]),
    "hf-pretrained-directory": ("tiny_deepseek_v3", [
        f"checkpoint.pretrained_checkpoint={_hf_directory()}"]),
    "hf-copy-single-grouped": ("tiny_deepseek_v3", ["checkpoint.also_save_hf_checkpoint=true"]),
    # NVFP4 primary weights are verified at TP 1 and ETP 1 only (an owner would hold a shard).
    "nvfp4-tensor-parallel": ("deepseek_v3_nvfp4", ["model.tensor_model_parallel_size=2"]),
    "nvfp4-expert-tensor-parallel": ("qwen3_235b_a22b_nvfp4", [
        "model.expert_tensor_parallel_size=2"]),
}


def yaml_checks(tmp: str) -> dict:
    path = os.path.join(tmp, "override.yaml")
    with open(path, "w") as handle:
        handle.write(
            "train:\n  train_iters: 7\n"
            "optimizer:\n  lr: 0.001\n  layer_wise_layout: padded\n"
            "model:\n  num_layers: 4\n"
        )
    cfg = resolve_config(
        "tiny_deepseek_v3", path, ["optimizer.lr=0.002", "train.global_batch_size=8"]
    )
    result = {
        "train_iters": cfg.train.train_iters,
        "lr": cfg.optimizer.lr,
        "layout": cfg.optimizer.layer_wise_layout,
        "ddp_layout": getattr(plugin_config.read(cfg.ddp), "layout", None),
        "num_layers": cfg.model.num_layers,
        "global_batch_size": cfg.train.global_batch_size,
        "hidden_size": cfg.model.hidden_size,
        "optimizer_class": type(cfg.optimizer).__name__,
    }
    target = os.path.join(tmp, "target.yaml")
    with open(target, "w") as handle:
        handle.write(
            "optimizer:\n"
            "  _target_: nemo_lw_fp8.bridge.LayerWiseMuonConfig\n"
            "  optimizer: dist_muon\n  lr: 0.003\n  min_lr: 0.0003\n"
            "  use_layer_wise_distributed_optimizer: true\n"
            "  overlap_param_gather: true\n  layer_wise_layout: compact\n"
            "  bf16: true\n  clip_grad: 0.0\n"
        )
    try:
        cfg = resolve_config("tiny_qwen3_30b_a3b", target, [])
        result["target"] = {
            "class": type(cfg.optimizer).__name__,
            "lr": cfg.optimizer.lr,
            "layout": cfg.optimizer.layer_wise_layout,
        }
    except Exception as error:  # reported, asserted by the test
        result["target"] = {"error": f"{type(error).__name__}: {error}"}
    try:
        resolve_config("tiny_deepseek_v3", None, ["train.train_iters"])
        result["bad_override"] = ""
    except ValueError as error:
        result["bad_override"] = str(error)
    return result


def main(out_path: str) -> None:
    report: dict = {"recipes": {}, "errors": {}, "guards": {}}
    nemo_lw_fp8.apply()
    for name in sorted(recipes.RECIPES):
        try:
            cfg = recipes.get_recipe(name)()
            bridge.finalize(cfg)
            row = recipe_row(cfg)
            tiny_of = recipes.tiny_variant_of(name)
            model = tiny_of[0] if tiny_of is not None else name.rsplit("_", 1)[0]
            model = model.removeprefix("twin_")
            arch = architectures.get_architecture(model)
            row["arch"] = {
                "num_layers": arch.num_layers,
                "hidden_size": arch.hidden_size,
                "num_moe_experts": arch.num_moe_experts,
                "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
                "vocab_size": arch.vocab_size,
                "multi_latent_attention": arch.multi_latent_attention,
            }
            report["recipes"][name] = row
        except Exception:
            report["errors"][name] = traceback.format_exc()
    for case, (recipe, overrides) in GUARD_CASES.items():
        try:
            report["guards"][case] = guard_case(recipe, overrides)
        except Exception as error:
            report["guards"][case] = f"!{type(error).__name__}: {error}"
    # The factory's Newton-Schulz mode: a name megatron does not know is refused there.
    try:
        bridge.layer_wise_muon_fp8_with_cosine_annealing(muon_tp_mode="sharded")
        report["bad_muon_tp_mode"] = ""
    except ValueError as error:
        report["bad_muon_tp_mode"] = str(error)
    with tempfile.TemporaryDirectory() as tmp:
        report["yaml"] = yaml_checks(tmp)
    # Each recipes/<name>.yaml applied to its own recipe changes nothing.
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "recipes")
    report["yaml_identity"] = {}
    for name in ("tiny_deepseek_v3", "deepseek_v3_hopper", "qwen3_235b_a22b_mxfp8",
                 "deepseek_v3_nvfp4"):
        path = os.path.join(folder, f"{name}.yaml")
        if os.path.exists(path):
            row = recipe_row(resolve_config(name, path, []))
            built = {k: v for k, v in report["recipes"][name].items() if k != "arch"}
            report["yaml_identity"][name] = row == built
    with open(out_path, "w") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    main(sys.argv[1])
