"""The CPU fused norm + linear (``nemo_lw_fp8.cpu.layers.norm_linear``) and the
``local_norm_linear`` stand-in: MLA without a q LoRA (DeepSeek-V2-Lite) builds on CPU with TE's
structure."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.harness import BootOptions, run_on_ranks


def _config(**overrides: Any) -> Any:
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    settings: dict[str, Any] = dict(
        num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=16, v_head_dim=16,
        bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, rope_type="rope", normalization="RMSNorm", qk_layernorm=True,
        # as the CPU backend runs (nemo_lw_fp8.cpu.megatron.bridge_pretrain)
        transformer_impl="local",
    )
    settings.update(overrides)
    return MLATransformerConfig(**settings)


def fused_vs_separate(fp8: bool, normalization: str, wrong_eps: bool = False) -> dict[str, Any]:
    """The fused module against the same norm (megatron's WrappedTorchNorm) and linear, applied
    one after the other with equal weights: outputs and all gradients. ``wrong_eps`` (the
    control's mutation): the fused norm uses an epsilon of 1e-3 instead of the config's."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from nemo_lw_fp8.cpu.layers.norm_linear import CPULayerNormColumnParallelLinear
    from nemo_lw_fp8.cpu.layers.parallel_linears import MXFP8ColumnParallelLinear

    config = _config(normalization=normalization)
    config.fp8 = "e4m3" if fp8 else None  # what the builder reads (set after validation)
    config.fp8_recipe = "mxfp8"
    kwargs = dict(config=config, init_method=torch.nn.init.normal_, bias=False,
                  gather_output=False, skip_bias_add=False, is_expert=False)
    torch.manual_seed(0)
    fused = CPULayerNormColumnParallelLinear(64, 96, **kwargs)
    if wrong_eps:
        assert fused.eps == config.layernorm_epsilon != 1e-3
        fused.eps = 1e-3
    with torch.no_grad():
        fused.layer_norm_weight.copy_(torch.rand(64) + 0.5)
        if fused.layer_norm_bias is not None:
            fused.layer_norm_bias.copy_(torch.randn(64) * 0.1)
    norm = WrappedTorchNorm(config, hidden_size=64, eps=config.layernorm_epsilon).bfloat16()
    linear = (MXFP8ColumnParallelLinear if fp8 else ColumnParallelLinear)(64, 96, **kwargs)
    with torch.no_grad():
        norm.weight.copy_(fused.layer_norm_weight)
        if fused.layer_norm_bias is not None:
            norm.bias.copy_(fused.layer_norm_bias)
        linear.weight.copy_(fused.weight)

    x = torch.randn(32, 2, 64, dtype=torch.bfloat16)
    x_fused, x_sep = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_fused, _ = fused(x_fused)
    out_sep, _ = linear(norm(x_sep))
    grad = torch.randn_like(out_sep)
    out_fused.backward(grad)
    out_sep.backward(grad)
    pairs = {
        "out": (out_fused, out_sep),
        "dx": (x_fused.grad, x_sep.grad),
        "dgamma": (fused.layer_norm_weight.grad, norm.weight.grad),
        "dW": (fused.weight.grad, linear.weight.grad),
    }
    if fused.layer_norm_bias is not None:
        pairs["dbeta"] = (fused.layer_norm_bias.grad, norm.bias.grad)
    return {
        "cls": type(fused).__name__,
        "linear_is": isinstance(fused, MXFP8ColumnParallelLinear if fp8 else ColumnParallelLinear),
        "equal": {k: bool(torch.equal(a, b)) for k, (a, b) in pairs.items()},
        "out_changed": not torch.equal(out_sep, linear(x)[0]),  # the norm does something
    }


@pytest.mark.parametrize(
    "fp8, normalization",
    [(True, "RMSNorm"), (False, "RMSNorm"), (False, "LayerNorm")],
    ids=["mxfp8-rmsnorm", "bf16-rmsnorm", "bf16-layernorm"],
)
def test_fused_norm_linear_is_norm_then_linear_bitwise(fp8, normalization):
    r = run_on_ranks(fused_vs_separate, fp8, normalization, world_size=1)[0]
    assert r["linear_is"], r["cls"]
    assert r["out_changed"]
    assert all(r["equal"].values()), r["equal"]


def test_control_fused_norm_with_another_epsilon_differs():
    """Control of ``test_fused_norm_linear_is_norm_then_linear_bitwise`` (MXFP8, RMSNorm): a
    fused norm that reads an epsilon of 1e-3 instead of the config's 1e-5 (inputs of rms about
    1, so a relative change near 5e-4, below one bf16 ulp for most elements) fails the same
    comparison in the output and in every gradient."""
    r = run_on_ranks(fused_vs_separate, True, "RMSNorm", True, world_size=1)[0]
    assert r["linear_is"], r["cls"]
    assert r["equal"] == {"out": False, "dx": False, "dgamma": False, "dW": False}


def mla_structure(q_lora_rank: int | None, standin: bool) -> dict[str, Any]:
    """Build one MLA layer through the CPU spec (bf16) and describe what was built."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    import nemo_lw_fp8
    from nemo_lw_fp8.cpu.layers.specs import cpu_decoder_block_spec
    from nemo_lw_fp8.cpu.megatron import standins

    config = _config(q_lora_rank=q_lora_rank, multi_latent_attention=True)
    nemo_lw_fp8.apply(["mla_local_attention"])
    if not standin:
        standins.STANDINS["local_norm_linear"].uninstall()
    try:
        spec = cpu_decoder_block_spec(config, fp8=False)
        block = TransformerBlock(config, spec)
    except (ValueError, RuntimeError) as error:
        return {"built": False, "error": str(error)}
    finally:
        standins.install(("local_norm_linear",))
        nemo_lw_fp8.revert(["mla_local_attention"])
    attention = block.layers[0].self_attention
    slots = ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj", "q_layernorm",
             "kv_layernorm")
    return {
        "built": True,
        "classes": {s: type(getattr(attention, s)).__name__ for s in slots if
                    hasattr(attention, s)},
        "norm_weights": sorted(n for n, _ in attention.named_parameters() if "norm" in n),
    }


def test_mla_without_q_lora_builds_with_tes_fused_norms():
    r = run_on_ranks(mla_structure, None, True, world_size=1)[0]
    assert r["built"], r
    assert r["classes"] == {
        "linear_q_proj": "NormColumnParallelLinear",
        "linear_kv_up_proj": "NormColumnParallelLinear",
        "kv_layernorm": "IdentityOp",
    }
    assert r["norm_weights"] == [
        "linear_kv_up_proj.layer_norm_weight", "linear_q_proj.layer_norm_weight"
    ]
    # Control: without the stand-in megatron's local backend has no fused form to offer.
    control = run_on_ranks(mla_structure, None, False, world_size=1)[0]
    assert control["built"] is False and "linear_q_proj" in control["error"], control


def test_mla_with_q_lora_keeps_standalone_norms():
    """DeepSeek-V3's shape (q LoRA) builds as before: the local spec's explicit Q / KV norms."""
    r = run_on_ranks(mla_structure, 32, True, world_size=1)[0]
    assert r["built"], r
    assert r["classes"] == {
        "linear_q_up_proj": "ColumnParallelLinear",
        "linear_kv_up_proj": "ColumnParallelLinear",
        "q_layernorm": "RMSNorm",
        "kv_layernorm": "RMSNorm",
    }


def gated_delta_net_checkpoint(
    te: bool, recipe: str, unfused_in_proj: bool = False
) -> dict[str, Any]:
    """One Gated DeltaNet layer (Qwen3.5's shape, FP8 weights of ``recipe``) built from megatron's
    TE spec (TE's own Python over the emulation) or from the CPU hybrid spec: its ``torch_dist``
    entries (key, global shape, dtype; TE's ``_extra_state`` objects by key) and parameters.
    ``unfused_in_proj`` (the control's mutation, CPU spec only): ``in_proj`` is the recipe's
    plain FP8 column linear, without the fused input norm the CPU norm + linear provides."""
    import dataclasses
    import unittest.mock

    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.fp8_utils import get_fp8_context
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_gated_delta_net_module_spec,
    )
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256,
        bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, normalization="RMSNorm",
        layernorm_zero_centered_gamma=True, experimental_attention_variant="gated_delta_net",
        linear_attention_freq=2, linear_conv_kernel_dim=4, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_num_key_heads=8, linear_num_value_heads=16,
        fp8="e4m3", fp8_recipe=recipe, fp8_param=True,
        transformer_impl="transformer_engine" if te else "local",
    )
    if te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        spec = get_gated_delta_net_module_spec(config, backend=TESpecProvider())
    else:
        from nemo_lw_fp8.cpu.layers.specs import cpu_decoder_block_spec

        block = cpu_decoder_block_spec(config, fp8=True, fp8_recipe=recipe)
        spec = block.layer_specs[0].submodules.self_attention  # layer 0: linear attention
        if unfused_in_proj:
            from nemo_lw_fp8.cpu.layers.parallel_linears import FP8_LINEARS

            spec = dataclasses.replace(
                spec,
                submodules=dataclasses.replace(spec.submodules, in_proj=FP8_LINEARS[recipe][0]),
            )
    model_parallel_cuda_manual_seed(1234)
    # TE's module base refuses to start without CUDA; with use_cpu_initialization its
    # construction and state dict do no CUDA work (the emulation serves its quantizers).
    with (
        unittest.mock.patch("torch.cuda.is_available", lambda: te),
        get_fp8_context(config, is_init=True),
    ):
        layer = build_module(
            spec, config=config, layer_number=1,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        )
    entries: dict[str, Any] = {}
    for value in layer.sharded_state_dict(prefix="self_attention.").values():
        built = value.build() if isinstance(value, ShardedTensorFactory) else [value]
        for item in built.values() if isinstance(built, dict) else built:
            if isinstance(item, ShardedTensor):
                entries[item.key] = (tuple(item.global_shape), str(item.dtype))
            else:
                entries[item.key] = type(item).__name__
    return {
        "entries": entries,
        "params": [name for name, _ in layer.named_parameters()],
        "in_proj": type(layer.in_proj).__name__,
    }


_TE_GATED_DELTA_NET: dict[str, dict[str, Any]] = {}


def _te_gated_delta_net(recipe: str) -> dict[str, Any]:
    """The TE layer's entries for ``recipe``, built once per session (the test and its control
    compare against the same build)."""
    if recipe not in _TE_GATED_DELTA_NET:
        boot = BootOptions(fp8_emulation=True)
        _TE_GATED_DELTA_NET[recipe] = run_on_ranks(
            gated_delta_net_checkpoint, True, recipe, world_size=1, boot=boot
        )[0]
    return _TE_GATED_DELTA_NET[recipe]


def _tensor_entries(te: dict[str, Any]) -> dict[str, Any]:
    """TE's checkpoint entries without its FP8 metadata (``_extra_state``, asserted to be
    exactly those of TE's three modules)."""
    extra = {key for key, value in te["entries"].items() if key.endswith("._extra_state")}
    assert extra == {f"self_attention.{m}._extra_state" for m in ("in_proj", "out_norm",
                                                                   "out_proj")}
    return {key: value for key, value in te["entries"].items() if key not in extra}


@pytest.mark.parametrize("recipe", ["mxfp8", "blockwise"])
def test_gated_delta_net_checkpoints_as_tes_layer(recipe):
    """The CPU Gated DeltaNet layer writes the tensors megatron writes for its TE layer on a GPU:
    the same keys (``in_proj.weight`` split into query / key / value / z / beta / alpha,
    ``in_proj.layer_norm_weight``, ``conv1d`` split, ``out_proj.weight``, ...), global shapes and
    dtypes, and the same parameters in the same order (the layer-wise optimizer assigns matrices
    in that order). TE adds its FP8 metadata (``_extra_state``), which the CPU layers keep none
    of; the fused in_proj is the emulated linear of the run's recipe."""
    te = _te_gated_delta_net(recipe)
    cpu = run_on_ranks(
        gated_delta_net_checkpoint, False, recipe, world_size=1,
        boot=BootOptions(fp8_emulation=True),
    )[0]
    tensors = _tensor_entries(te)
    assert "self_attention.in_proj.weight.z" in tensors
    assert cpu["entries"] == tensors
    assert cpu["params"] == te["params"]
    assert cpu["in_proj"] == {"mxfp8": "NormMXFP8ColumnParallelLinear",
                              "blockwise": "NormBlockwiseColumnParallelLinear"}[recipe]


def test_control_gated_delta_net_without_the_fused_norm_differs():
    """Control of ``test_gated_delta_net_checkpoints_as_tes_layer`` (MXFP8): a CPU layer whose
    ``in_proj`` is the plain FP8 linear (what megatron's local backend has to offer without
    the CPU fused norm + linear) still builds, but fails the same comparisons: TE's
    ``in_proj.layer_norm_weight`` entry and parameter are missing, nothing else changes."""
    te = _te_gated_delta_net("mxfp8")
    cpu = run_on_ranks(
        gated_delta_net_checkpoint, False, "mxfp8", True, world_size=1,
        boot=BootOptions(fp8_emulation=True),
    )[0]
    tensors = _tensor_entries(te)
    assert cpu["in_proj"] == "MXFP8ColumnParallelLinear"
    assert cpu["entries"] != tensors
    assert set(tensors) - set(cpu["entries"]) == {"self_attention.in_proj.layer_norm_weight"}
    assert set(cpu["entries"]) <= set(tensors)
    assert cpu["params"] != te["params"]
    assert [p for p in te["params"] if p not in cpu["params"]] == ["in_proj.layer_norm_weight"]
