"""nemo_lw_fp8.planner.shapes, nemo_lw_fp8.planner.rank_plan and nemo_lw_fp8.cli.plan."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from nemo_lw_fp8.cli import plan as plan_cli
from nemo_lw_fp8.planner import rank_plan as planner
from nemo_lw_fp8.planner.shapes import SPECS, ModelSpec, ParamSpec, param_shapes, total_params

# ----------------------------------------------------------------------------- model shapes


@pytest.mark.parametrize(
    ("name", "published"), [("deepseek-v3", 671e9), ("qwen3-235b-a22b", 235e9)]
)
def test_parameter_totals_match_published_sizes(name, published):
    total = total_params(param_shapes(name))
    assert abs(total - published) / published < 0.01
    assert SPECS[name].published_params == published


def test_deepseek_v3_shapes():
    specs = {s.name: s for s in param_shapes("deepseek-v3")}
    attn = "decoder.layers.5.self_attention"
    assert specs[f"{attn}.linear_q_down_proj.weight"].shape == (1536, 7168)
    assert specs[f"{attn}.linear_q_up_proj.weight"].shape == (128 * 192, 1536)
    assert specs[f"{attn}.linear_kv_down_proj.weight"].shape == (512 + 64, 7168)
    assert specs[f"{attn}.linear_kv_up_proj.weight"].shape == (128 * 256, 512)
    assert specs[f"{attn}.linear_proj.weight"].shape == (7168, 128 * 128)
    assert specs["decoder.layers.2.mlp.linear_fc1.weight"].shape == (2 * 18432, 7168)
    assert "decoder.layers.3.mlp.linear_fc1.weight" not in specs  # MoE from layer 3
    router = specs["decoder.layers.3.mlp.router.weight"]
    assert router.shape == (256, 7168) and router.muon and not router.quantized
    bias = specs["decoder.layers.3.mlp.router.expert_bias"]
    assert not bias.trainable and not bias.muon
    expert = specs["decoder.layers.60.mlp.experts.linear_fc2.weight255"]
    assert expert.shape == (7168, 2048) and expert.expert_parallel and expert.muon
    shared = specs["decoder.layers.60.mlp.shared_experts.linear_fc1.weight"]
    assert shared.shape == (4096, 7168) and not shared.expert_parallel
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert specs[name].shape == (129280, 7168) and not specs[name].muon
    assert sum(1 for s in specs.values() if s.expert_parallel) == 58 * 2 * 256


def test_qwen3_shapes_and_muon_routing():
    specs = param_shapes("qwen3-235b-a22b")
    by_name = {s.name: s for s in specs}
    attn = "decoder.layers.93.self_attention"
    assert by_name[f"{attn}.linear_qkv.weight"].shape == ((64 + 2 * 4) * 128, 4096)
    assert by_name[f"{attn}.linear_proj.weight"].shape == (4096, 64 * 128)
    assert by_name[f"{attn}.q_layernorm.weight"].shape == (128,)
    assert by_name["decoder.layers.0.mlp.experts.linear_fc1.weight127"].shape == (3072, 4096)
    # megatron's rule: Muon iff 2-D and not embedding / output
    for s in specs:
        assert s.muon == (len(s.shape) == 2 and not s.embedding_or_output), s.name


def test_more_models_need_only_hyper_parameters():
    """DeepSeek-V2-Lite (MLA without q LoRA, 2 shared experts), Qwen3-30B-A3B and
    Qwen3-Next-80B-A3B (Gated DeltaNet on 3 of 4 layers, gated attention, gated shared expert)
    are plain ModelSpec instances; their totals match the published sizes."""
    models = [
        ModelSpec(
            name="deepseek-v2-lite",
            num_layers=27,
            hidden_size=2048,
            vocab_size=102400,
            num_attention_heads=16,
            multi_latent_attention=True,
            q_lora_rank=None,
            ffn_hidden_size=10944,
            first_k_dense_replace=1,
            num_moe_experts=64,
            moe_ffn_hidden_size=1408,
            moe_shared_expert_intermediate_size=2 * 1408,
            published_params=15.7e9,
        ),
        ModelSpec(
            name="qwen3-30b-a3b",
            num_layers=48,
            hidden_size=2048,
            vocab_size=151936,
            num_attention_heads=32,
            num_query_groups=4,
            kv_channels=128,
            qk_layernorm=True,
            num_moe_experts=128,
            moe_ffn_hidden_size=768,
            published_params=30.5e9,
        ),
        ModelSpec(
            name="qwen3-next-80b-a3b",
            num_layers=48,
            hidden_size=2048,
            vocab_size=151936,
            num_attention_heads=16,
            num_query_groups=2,
            kv_channels=256,
            qk_layernorm=True,
            attention_output_gate=True,
            linear_attention_freq=4,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            num_moe_experts=512,
            moe_ffn_hidden_size=512,
            moe_shared_expert_intermediate_size=512,
            moe_shared_expert_gate=True,
            published_params=80e9,
        ),
    ]
    for model in models:
        specs = model.params()
        assert abs(total_params(specs) - model.published_params) / model.published_params < 0.01
        for s in specs:  # megatron's Muon rule holds for every builder
            assert s.muon == (len(s.shape) == 2 and not s.embedding_or_output), s.name
    nxt = {s.name: s for s in models[2].params()}
    assert nxt["decoder.layers.0.in_proj.weight"].shape == (2 * 2048 + 2 * 4096 + 64, 2048)
    assert nxt["decoder.layers.0.conv1d.weight"].shape == (2 * 2048 + 4096, 1, 4)
    assert "decoder.layers.3.self_attention.linear_qkv.weight" in nxt  # every 4th: attention
    assert nxt["decoder.layers.3.self_attention.linear_qkv.weight"].shape == (
        2 * 16 * 256 + 2 * 2 * 256,
        2048,
    )
    assert nxt["decoder.layers.0.mlp.shared_experts.gate_weight"].shape == (1, 2048)
    lite = {s.name: s for s in models[0].params()}
    assert lite["decoder.layers.0.self_attention.linear_q_proj.weight"].shape == (16 * 192, 2048)


def test_param_spec_local_expert_view():
    e = ParamSpec("w3", (8, 4), True, expert_parallel=True, expert_index=3, num_experts=8)
    assert e.local(1) is e and e.local(2) is e and e.local(4) is None
    grouped = ParamSpec("g", (8, 4, 6), False, expert_parallel=True, num_experts=8)
    assert grouped.local(4).shape == (2, 4, 6)
    with pytest.raises(ValueError):
        e.local(3)
    local = [s.local(64) for s in param_shapes("deepseek-v3")]
    assert sum(1 for s in local if s is not None and s.expert_parallel) == 58 * 2 * 4


def test_unknown_model():
    with pytest.raises(KeyError, match="known"):
        param_shapes("gpt-5")


# ----------------------------------------------------------------------------- planner


@pytest.fixture(scope="module")
def big_plans():
    return {
        "deepseek-v3": planner.plan("deepseek-v3", 64, 64),
        "qwen3-235b-a22b": planner.plan("qwen3-235b-a22b", 64, 32),
    }


def test_plan_fields(big_plans):
    result = big_plans["qwen3-235b-a22b"]
    json.dumps(result)  # JSON-ready
    for key in ("model", "dp", "ep", "expert_dp", "bucket_size", "fp8_param_gather", "grad_dtype"):
        assert key in result
    assert result["expert_dp"] == 2 and result["bucket_size"] == 64_000_000
    assert set(result["layouts"]) == {"stock_padded", "compact", "adam_distopt"}
    for lay in result["layouts"].values():
        assert set(lay["bytes_per_rank"]) == {*planner.MEMORY_FIELDS, "total"}
        for key in ("padding_numel", "padding_bytes", "param_gather", "grad_sync", "buffers"):
            assert key in lay
        for key in ("collectives", "output_bytes", "wire_bytes_per_rank"):
            assert key in lay["param_gather"]
    for name in ("stock_padded", "compact"):
        ns = result["layouts"][name]["newton_schulz"]
        assert ns["max"] >= ns["mean"] > 0 and ns["max_over_mean"] >= 1
    assert result["layouts"]["adam_distopt"]["newton_schulz"] is None
    assert "transient_gather" in result["layouts"]["compact"]
    assert result["summary"]["param_gather_collectives"]["stock_legacy"] > 0
    assert result["assumptions"]


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-235b-a22b"])
def test_compact_beats_stock_at_dp64(big_plans, name):
    result = big_plans[name]
    stock, compact = result["layouts"]["stock_padded"], result["layouts"]["compact"]
    assert compact["bytes_per_rank"]["total"] < stock["bytes_per_rank"]["total"]
    assert compact["muon_padding_numel"] == 0 < stock["muon_padding_numel"]
    assert compact["newton_schulz"]["max_over_mean"] <= 1.05
    assert compact["newton_schulz"]["max_over_mean"] < stock["newton_schulz"]["max_over_mean"]
    # one gather per compact Muon bucket group: far fewer than stock's legacy uneven path
    legacy = result["stock_legacy_param_gather"]["collectives"]
    assert compact["param_gather"]["muon_collectives"] < legacy
    # the same parameters: grads differ by exactly the stock padding
    g = planner.GRAD_BYTES[result["grad_dtype"]]
    diff = stock["bytes_per_rank"]["grads"] - compact["bytes_per_rank"]["grads"]
    assert diff == stock["muon_padding_numel"] * g


def test_tiny_model_by_hand():
    """Two Muon matrices A (64x128) and B (64x64) and a norm (64), dp 2, bf16 params, fp32
    grads, one bucket.

    stock: LPT puts A on shard 0 and B on shard 1, shards padded to 8192: Muon buffer 16384
    (4096 padding); Adam buffer for the norm 64 -> padded to lcm(2, 128) = 128.
    compact: Muon buffer 12288, same owners (A costs more than B).
    adam_distopt: one buffer, backprop order B [0, 4096), A [4096, 12288), norm [12288, 12352),
    end padded to 12416; rank 0's half [0, 6208) holds 6208 parameter elements.
    """
    specs = [
        ParamSpec("norm", (64,), muon=False),
        ParamSpec("a", (64, 128), muon=True),
        ParamSpec("b", (64, 64), muon=True),
    ]
    r = planner.plan(specs, dp=2, fp8_param_gather=False, grad_dtype="fp32")
    stock, compact, adam = (r["layouts"][k] for k in ("stock_padded", "compact", "adam_distopt"))
    # rank 0 is the busiest: A (8192) as Muon + the whole norm (64) as Adam
    master0 = 8192 * 4 + 64 * 4
    states0 = 8192 * 4 + 64 * 8
    assert stock["worst_rank"] == 0
    assert stock["bytes_per_rank"] == {
        "params": (16384 + 128) * 2,
        "grads": (16384 + 128) * 4,
        "masters": master0,
        "optimizer_states": states0,
        "total": (16384 + 128) * 6 + master0 + states0,
    }
    assert stock["padding_numel"] == 4096 + 64 and stock["muon_padding_numel"] == 4096
    assert stock["padding_bytes"] == (4096 + 64) * 6
    assert compact["bytes_per_rank"] == {
        "params": (12288 + 128) * 2,
        "grads": (12288 + 128) * 4,
        "masters": master0,
        "optimizer_states": states0,
        "total": (12288 + 128) * 6 + master0 + states0,
    }
    assert compact["muon_padding_numel"] == 0
    assert adam["bytes_per_rank"] == {
        "params": 12416 * 2,
        "grads": 12416 * 4,
        "masters": 6208 * 4,
        "optimizer_states": 6208 * 8,
        "total": 12416 * 6 + 6208 * 12,
    }
    # Newton-Schulz: A = 64*128*64, B = 64*64*64 on separate ranks in both layouts
    for lay in (stock, compact):
        assert lay["newton_schulz"]["max"] == 64 * 128 * 64
        assert lay["newton_schulz"]["max_over_mean"] == pytest.approx(4 / 3)
    # gathers: stock one Muon + one Adam bucket group. compact: segments 8192 and 4096; an even
    # gather would pad 4096 (33% > 10% tolerance), so one uneven gather of the 12288 real ones
    assert stock["param_gather"]["collectives"] == 2
    assert stock["param_gather"]["output_bytes"] == (16384 + 128) * 2
    assert compact["param_gather"]["collectives"] == 2
    assert compact["param_gather"]["output_bytes"] == (12288 + 128) * 2
    assert compact["transient_gather"]["peak_bytes"] == 12288 * 2
    even = planner.plan(specs, dp=2, fp8_param_gather=False, gather_padding_tolerance=math.inf)
    assert even["layouts"]["compact"]["param_gather"]["output_bytes"] == (2 * 8192 + 128) * 2
    assert compact["transient_gather"]["extra_bytes"] == 0  # fits in 12288 fp32 grads
    assert adam["param_gather"]["collectives"] == 1
    assert r["stock_legacy_param_gather"] == {"collectives": 2, "output_bytes": 12352 * 2}
    # grads: stock reduce-scatters; compact (the default grad_sync) reduces its Muon bucket to
    # the owners: rank 1 sends A's 8192 elements to rank 0, rank 0 B's 4096 to rank 1; the
    # worst rank sends 8192, plus its half of the norm's reduce-scatter
    assert r["grad_sync"] == "reduce_to_owner"
    assert stock["grad_sync"]["op"] == "reduce_scatter"
    assert compact["grad_sync"]["op"] == "reduce_scatter+reduce_to_owner"
    assert compact["grad_sync"]["wire_bytes_per_rank"] == 8192 * 4 + 128 * 4 // 2
    assert compact["grad_sync"]["buffer_bytes"] == (12288 + 128) * 4
    # grad_sync="all_reduce" (upstream's compact path): the whole Muon bucket twice over the ring
    ar = planner.plan(specs, dp=2, fp8_param_gather=False, grad_sync="all_reduce")
    ar_compact = ar["layouts"]["compact"]
    assert ar_compact["grad_sync"]["op"] == "all_reduce+reduce_scatter"
    assert ar_compact["grad_sync"]["wire_bytes_per_rank"] == 12288 * 4 + 128 * 4 // 2
    assert ar_compact["bytes_per_rank"] == compact["bytes_per_rank"]  # same memory either way


def test_grouped_expert_runs_balance_newton_schulz():
    """Three single grouped weights (4, 64, 32) on 2 ranks: whole ownership gives one rank two
    of them (Newton-Schulz 2:1); runs of experts give each rank 6 experts; "auto" splits because
    that lowers the busiest rank by more than 2 %. The padded layout owns whole either way."""
    specs = [
        ParamSpec(f"g{i}", (4, 64, 32), muon=True, expert_parallel=True, num_experts=4)
        for i in range(3)
    ]
    c = 4 * 64 * 32 * 32
    runs = {
        ownership: planner.plan(
            specs, dp=2, fp8_param_gather=False, grouped_weight_ownership=ownership
        )
        for ownership in ("whole", "expert", "auto")
    }
    compact = {k: r["layouts"]["compact"] for k, r in runs.items()}
    assert compact["whole"]["newton_schulz"]["by_rank"] == [2 * c, c]
    assert compact["expert"]["newton_schulz"]["by_rank"] == [3 * c // 2, 3 * c // 2]
    assert compact["auto"]["newton_schulz"] == compact["expert"]["newton_schulz"]
    elements = 4 * 64 * 32
    assert compact["whole"]["bytes_by_rank"]["masters"] == [4 * 2 * elements, 4 * elements]
    assert compact["expert"]["bytes_by_rank"]["masters"] == [4 * 3 * elements // 2] * 2
    assert runs["expert"]["grouped_weight_ownership"] == "expert"
    stock = [r["layouts"]["stock_padded"]["bytes_by_rank"] for r in runs.values()]
    assert stock[0] == stock[1] == stock[2]


def test_mxfp8_weight_bytes():
    # rowwise + columnwise codes, scales padded to (128, 4) and (4, 128) tiles
    assert planner.mxfp8_weight_bytes((128, 128)) == 2 * 128 * 128 + 128 * 4 + 4 * 128
    assert planner.mxfp8_weight_bytes((4096, 7168)) == (2 * 4096 * 7168 + 4096 * 224 + 128 * 7168)
    assert planner.mxfp8_weight_bytes((2, 64, 64)) == planner.mxfp8_weight_bytes((128, 64))


#: TE's own NVFP4 weight buffers over the emulation (a subprocess: no TE in this process).
NVFP4_BUFFERS_SCRIPT = r"""
import json
from nemo_lw_fp8.cpu.te import activate
activate()
import torch
from nemo_lw_fp8.cpu.te import device as te_device
scope = te_device.target_gpu(te_device.BLACKWELL)
scope.__enter__()
from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer
out = {}
for shape in ((128, 128), (48, 160), (2, 64, 32), (256, 7168 // 16)):
    q = NVFP4Quantizer(rowwise=True, columnwise=True, with_2d_quantization=True)
    t = q(torch.randn(shape).bfloat16())
    names = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv",
             "amax_rowwise", "amax_columnwise")
    out[str(list(shape))] = sum(
        getattr(t, "_" + n).numel() * getattr(t, "_" + n).element_size() for n in names
    )
print("RESULT " + json.dumps(out))
"""


def test_nvfp4_bytes():
    """A persistent NVFP4 weight's bytes equal what TE's own ``NVFP4Quantizer`` allocates (both
    usages, 16x16 blocks, padded scale buffers, two amaxes; read from TE's buffers over the
    emulation), and the NVFP4 gather's wire bytes are the codes, one scale per 16x16 tile and
    the amax. Control: the MXFP8 formula on the same shapes is another number."""
    import json

    from tests.support.te_test_support import run_te_script

    te = {tuple(json.loads(k)): v for k, v in run_te_script(NVFP4_BUFFERS_SCRIPT).items()}
    assert {shape: planner.nvfp4_weight_bytes(shape) for shape in te} == te
    assert all(planner.mxfp8_weight_bytes(shape) != te[shape] for shape in te)
    assert planner.nvfp4_wire_bytes((128, 256)) == 128 * 256 // 2 + 8 * 16 + 4
    assert planner.nvfp4_wire_bytes((2, 64, 32)) == planner.nvfp4_wire_bytes((128, 32))


def test_fp8_params_alias_the_grad_buffer():
    """With fp8_param_gather the Muon MXFP8 weights replace the bf16 param buffer, so stock
    padding costs only gradient bytes there."""
    specs = [ParamSpec("a", (64, 128), muon=True, quantized=True), ParamSpec("b", (64, 64), True)]
    r = planner.plan(specs, dp=2, fp8_param_gather=True, grad_dtype="bf16")
    stock = r["layouts"]["stock_padded"]
    names = {b["name"]: b for b in stock["buffers"]}
    assert set(names) == {"muon/dense/mxfp8", "muon/dense/bf16"}
    fp8 = names["muon/dense/mxfp8"]
    bf16 = names["muon/dense/bf16"]
    assert stock["padding_bytes"] == fp8["padding_numel"] * 2 + bf16["padding_numel"] * 4
    assert stock["bytes_per_rank"]["params"] == (
        planner.mxfp8_weight_bytes((64, 128)) + bf16["numel"] * 2
    )


def test_stock_buffers_match_megatron_full_layout():
    """The planner's stock buffers are exactly what megatron's compute_full_param_layout builds
    for the same (tagged) stand-in parameters."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer.layer_wise_optimizer import (
            LayerWiseDistributedOptimizer,
            is_managed_by_layer_wise_optimizer,
        )

    dp, ep, bucket = 64, 32, 64_000_000
    specs = [s.local(ep) for s in param_shapes("qwen3-235b-a22b")]
    params = []
    for s in specs:
        if s is None or not s.trainable:
            continue
        p = torch.nn.Parameter(torch.empty(s.shape, device="meta", dtype=torch.bfloat16))
        p.is_embedding_or_output_parameter = s.embedding_or_output
        p.allreduce = not s.expert_parallel
        p.is_managed_by_layer_wise_optimizer = is_managed_by_layer_wise_optimizer(p)
        assert p.is_managed_by_layer_wise_optimizer == s.muon
        params.append(p)
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = LayerWiseDistributedOptimizer.compute_full_param_layout(
            params, bucket, dp, cfg, expert_data_parallel_world_size=dp // ep
        )
    megatron = {
        (k.is_managed_by_layer_wise_optimizer, k.is_expert_parallel): (
            v.bucket_indices[-1][1],
            len(v.bucket_indices),
        )
        for k, v in full.layouts.items()
    }
    result = planner.plan("qwen3-235b-a22b", dp, ep, bucket, fp8_param_gather=False)
    ours = {
        (b["name"].startswith("muon"), "/expert/" in b["name"]): (b["numel"], b["buckets"])
        for b in result["layouts"]["stock_padded"]["buffers"]
    }
    assert ours == megatron


def test_plan_arguments_and_main(capsys):
    with pytest.raises(ValueError):
        planner.plan("tiny-moe", 6, 4)
    with pytest.raises(ValueError):
        planner.plan("tiny-moe", 2, grad_dtype="fp16")
    single = planner.plan("tiny-moe", 2, overlap_grad_reduce=False)
    assert single["bucket_size"] is None
    assert all(b["buckets"] == 1 for b in single["layouts"]["compact"]["buffers"])
    assert plan_cli.main(["tiny-moe", "--dp", "4", "--ep", "2", "--json"]) == 0
    parsed = json.loads(capsys.readouterr().out)
    assert parsed["expert_dp"] == 2 and parsed["model"] == "tiny-moe"
    assert plan_cli.main(["tiny-moe", "--dp", "2", "--no-fp8-param-gather"]) == 0
    out = capsys.readouterr().out
    assert "stock_padded" in out and "Newton-Schulz max/mean" in out
    from nemo_lw_fp8.errors import UsageError

    with pytest.raises(UsageError, match="ep dividing dp"):
        plan_cli.main(["tiny-moe", "--dp", "3", "--ep", "2"])
    assert math.isclose(
        planner.plan("tiny-moe", 4, 2)["params"]["total"], total_params(param_shapes("tiny-moe"))
    )


# ----------------------------------------------------------------------------- plan --recipe


def test_recipe_plan_pipeline_and_grouped_weights():
    """A tiny recipe at PP 2 plans both pipeline ranks, reports the busiest, groups the experts
    into single (E, m, n) weights and gives a verdict against the GPU."""
    from nemo_lw_fp8.planner import recipe_plan

    setup = recipe_plan.recipe_setup(
        "tiny_qwen3_30b_a3b",
        ["model.pipeline_model_parallel_size=2", "model.expert_model_parallel_size=1"],
    )
    setup.par = dataclasses.replace(setup.par, gpus_per_node=4)
    result = recipe_plan.plan_recipe(setup)
    assert result["parallelism"]["pp"] == 2 and result["parallelism"]["dp"] == 2
    peaks = result["pp_rank_peaks"]
    assert len(peaks) == 2 and result["pp_rank"] == peaks.index(max(peaks))
    assert result["verdict"]["fits"] and result["verdict"]["gpu_bytes"] == 80e9
    # At EP 1 megatron builds the experts with the dense process groups: no expert buffers.
    names = [b["name"] for b in result["layouts"]["compact"]["buffers"]]
    assert names and not any("/expert/" in name for name in names)
    # grouped weights keep their element count
    specs = recipe_plan.stage_param_specs(setup.arch, setup.par, 0) + (
        recipe_plan.stage_param_specs(setup.arch, setup.par, 1)
    )
    single = recipe_plan.group_experts(specs)
    assert sum(s.numel for s in single) == sum(s.numel for s in specs)
    assert any(len(s.shape) == 3 and s.num_experts == 8 for s in single)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # TP 3 does not divide the tiny recipe's 2 ranks (TP 2 plans: test_planner_tp.py)
        (["model.tensor_model_parallel_size=3"], "does not split into TP 3"),
        (["optimizer.muon_tp_mode=rowwise"], "muon_tp_mode='rowwise'"),
        (["optimizer.lr=1"], "plan does not read 'optimizer.lr'"),
        (["model.expert_model_parallel_size=3"], "does not split"),
        (["optimizer.grouped_weight_ownership=experts"], "grouped_weight_ownership='experts'"),
    ],
)
def test_recipe_plan_bad_input(capsys, overrides, message):
    from nemo_lw_fp8 import cli

    assert cli.main(["plan", "--recipe", "tiny_deepseek_v3", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.splitlines()) <= 2


def test_recipe_plan_tiny_hopper_has_discrete_experts():
    """``tiny_<model>_hopper`` plans the tiny architecture with the Hopper variant's discrete
    expert weights (the blockwise gather handles no grouped tensors)."""
    from nemo_lw_fp8.planner import recipe_plan

    hopper = recipe_plan.recipe_setup("tiny_deepseek_v3_hopper")
    mxfp8 = recipe_plan.recipe_setup("tiny_deepseek_v3")
    assert hopper.arch == mxfp8.arch and hopper.par == mxfp8.par
    assert (hopper.single_grouped_weight, mxfp8.single_grouped_weight) == (False, True)


# ----------------------------------------------------------------------------- traffic (issue 19)


def _matrices(shapes):
    return [ParamSpec(f"decoder.layers.0.m{i}.weight", shape, muon=True) for i, shape in
            enumerate(shapes)]  # fmt: skip


@pytest.mark.parametrize("dp", [2, 8, 64])
def test_compact_buckets_end_where_megatron_padded_buckets_end(dp):
    """No cap: the compact buckets hold the same parameters as megatron's padded buckets (its
    own layout code), so the compact layout has as many bucket groups; cap 0: megatron's plain
    DDP buckets."""
    from nemo_lw_fp8.layout import packing as lo

    shapes = [(4096, 9216), (8192, 4096), (128, 4096), (1536, 4096), (4096, 1536)] * 6
    numels = [math.prod(s) for s in shapes][::-1]
    padded = lo.stock_padded_layout(shapes, dp, 40_000_000)
    counts = lo.compact_bucket_counts(numels, 40_000_000, dp)
    assert counts == [len(b) for b in padded.bucket_params]
    plain = lo.default_buckets(shapes, 40_000_000)
    assert lo.compact_bucket_counts(numels, 40_000_000, dp, cap=0) == [
        len(b) for b in plain.bucket_params
    ]
    capped = lo.compact_bucket_counts(numels, 40_000_000, dp, cap=100_000_000)
    assert len(capped) >= len(counts)
    assert lo.compact_bucket_counts(numels, None, dp) == [len(numels)]


def test_owner_reduce_traffic_by_hand():
    """Four equal matrices on four ranks: each owns one, sends the other three once (3/4 of the
    group, an exact reduce-scatter) in one reduce per owner, in place; the all-reduce path sends
    twice that. One matrix four
    times larger: the padded layout pads every shard to it, the owner-reduce path does not."""
    from nemo_lw_fp8.planner.traffic import rank_traffic

    even = rank_traffic([_matrices([(64, 64)] * 4)], 4, bucket_size=10**9)
    assert even["compact_owner_reduce"]["grad_wire_over_exact"] == 1.0
    assert even["compact_all_reduce"]["grad_wire_over_exact"] == 2.0
    # In place: the only transient is the gather's bf16 receive buffer, as without owner reduce.
    assert even["compact_owner_reduce"]["transient_peak_bytes"] == 4 * 64 * 64 * 2
    assert even["compact_owner_reduce"]["grad_reduces"] == 4
    # Eight matrices, two per rank: still one reduce per owner (owner order in the bucket).
    eight = rank_traffic([_matrices([(64, 64)] * 8)], 4, bucket_size=10**9)
    assert eight["compact_owner_reduce"]["grad_reduces"] == 4
    uneven = rank_traffic([_matrices([(128, 128)] + [(64, 64)] * 4)], 4, bucket_size=10**9)
    owner = uneven["compact_owner_reduce"]
    n = 128 * 128 + 4 * 64 * 64
    # The worst rank owns one small matrix: it sends everything else once.
    assert owner["grad_wire_bytes"] == (n - 64 * 64) * 4
    assert owner["exact_reduce_scatter_bytes"] == n * 3 // 4 * 4
    stock = uneven["stock_padded"]
    assert stock["padding_numel"] > 0 and stock["grad_wire_over_exact"] > 1.5
    assert owner["padding_numel"] == 0
    assert owner["gather_collectives"] == stock["gather_collectives"] == 1
    assert owner["newton_schulz"]["lower_bound"] == pytest.approx(
        128**3 * 4 / (128**3 + 4 * 64**3)
    )


def test_traffic_lays_out_each_virtual_pipeline_chunk_on_its_own():
    """megatron buckets only chunk 0 of pipeline rank 0 and gives every later chunk one bucket
    group; the padded layout pads each chunk's buffer on its own, so two chunks of one matrix
    each pad twice where one merged buffer would pad once. Ownership spans both chunks."""
    from nemo_lw_fp8.planner.traffic import rank_traffic

    chunk = _matrices([(256, 256)])
    two = rank_traffic([chunk, chunk], 4, pp_rank=1)
    one = rank_traffic([chunk + chunk], 4, pp_rank=1)
    assert two["stock_padded"]["padding_numel"] == 2 * 3 * 256 * 256
    assert one["stock_padded"]["padding_numel"] < two["stock_padded"]["padding_numel"]
    assert two["compact_owner_reduce"]["grad_collectives"] == 2
    assert one["compact_owner_reduce"]["grad_collectives"] == 1
    # One layer-wise optimizer over both chunks: the two matrices go to two different ranks.
    assert two["compact_owner_reduce"]["newton_schulz"]["max_over_mean"] == 2.0


def test_refine_owners_beats_lpt_where_lpt_is_not_optimal():
    """LPT puts 3, 2, 2 on one rank (7) where 3 + 3 | 2 + 2 + 2 gives 6; the local search after
    it finds 6. Deterministic, and never worse than LPT."""
    from nemo_lw_fp8.layout import packing as lo

    costs = [3, 3, 2, 2, 2]
    lpt = lo.assign_owners(costs, 2)
    assert max(lo.rank_loads(costs, lpt, 2)) == 7  # control: LPT alone
    refined = lo.refine_owners(costs, lpt, 2)
    assert max(lo.rank_loads(costs, refined, 2)) == 6
    assert refined == lo.refine_owners(costs, lpt, 2)
    assert [p.owner for p in lo.choose_pieces(costs, [1] * 5, 2, ownership="whole")] == refined


def test_expert_owners_start_from_each_members_dense_work():
    """A rank that drew the big dense matrix gets fewer experts: the busiest total is lower than
    balancing each kind on its own. Expert groups outside the data-parallel group fall back."""
    from nemo_lw_fp8.layout import packing as lo

    dense = [8, 1, 1, 1]
    experts = [2] * 8
    own_dense = lo.choose_pieces(dense, [1] * 4, 4, ownership="whole")
    loads = lo.piece_loads(dense, [1] * 4, own_dense, 4)
    initial = lo.expert_initial_loads(loads, [10, 11, 12, 13], [10, 12])
    assert initial == [loads[0], loads[2]]
    joint = lo.piece_loads(experts, [1] * 8, lo.choose_pieces(experts, [1] * 8, 2, None, "whole",
                                                               initial), 2)  # fmt: skip
    alone = lo.piece_loads(experts, [1] * 8, lo.choose_pieces(experts, [1] * 8, 2), 2)
    assert max(a + b for a, b in zip(joint, initial, strict=True)) < max(
        a + b for a, b in zip(alone, initial, strict=True)
    )
    assert lo.expert_initial_loads(loads, [10, 11], [10, 99]) is None


@pytest.mark.parametrize(
    "argv",
    [["--recipe", "tiny_deepseek_v3"], ["tiny-deepseek-v3", "--dp", "2", "--pp", "3", "--ep", "2"]],
    ids=["recipe", "model-form"],
)
def test_plan_cli_prints_the_traffic_model(capsys, argv):
    """``nemo-lw-fp8 plan`` prints, for the configuration asked, the per-chunk traffic rows of
    :func:`nemo_lw_fp8.planner.traffic.rank_traffic` (every pipeline rank; the numbers
    benchmarks/layout.py prints), in JSON and as text."""
    from nemo_lw_fp8.planner import traffic
    from nemo_lw_fp8.planner.pipeline import chunk_param_specs
    from nemo_lw_fp8.planner.recipe_plan import group_experts, model_setup, recipe_setup

    if argv[0] == "--recipe":
        setup = recipe_setup(argv[1])
    else:
        setup = model_setup(
            argv[0], tp=1, pp=3, vpp=None, ep=2, etp=1, cp=1, dp=2, gpu="h100",
            single_grouped_weight=False,
        )  # fmt: skip
    par = setup.par
    expected = []
    for rank in range(par.pp):
        chunks = chunk_param_specs(setup.arch, par, rank)
        if setup.single_grouped_weight:
            chunks = [group_experts(c) for c in chunks]
        row = traffic.rank_traffic(
            chunks, par.data_parallel_size, par.ep, pp_rank=rank, ownership=setup.ownership
        )
        expected.append({"config": f"{argv[0] if argv[0] != '--recipe' else argv[1]} PP{par.pp} "
                         f"VP1 EP{par.ep} DP{par.data_parallel_size} rank {rank}",
                         "key": None, **row})  # fmt: skip
    assert plan_cli.main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["traffic"]
    assert rows == json.loads(json.dumps(expected)) and len(rows) == par.pp
    assert plan_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "\n".join(traffic.format_rows(expected)) in out


@pytest.mark.parametrize("dp, ep", [(4, 1), (4, 2), (8, 4)])
def test_main_table_grad_sync_is_the_owner_reduce_of_the_traffic_rows(dp, ep):
    """The compact column plans the default gradient sync: its wire bytes are the traffic
    model's owner-reduce rows for the same parameters (one chunk), not the all-reduce ones."""
    from nemo_lw_fp8.planner import traffic

    specs = param_shapes("tiny-moe")
    compact = planner.plan("tiny-moe", dp, ep)["layouts"]["compact"]["grad_sync"]
    rows = traffic.rank_traffic([specs], dp, ep)
    assert compact["wire_bytes_per_rank"] == rows["compact_owner_reduce"]["grad_wire_bytes"]
    assert compact["wire_bytes_per_rank"] != rows["compact_all_reduce"]["grad_wire_bytes"]
    upstream = planner.plan("tiny-moe", dp, ep, grad_sync="all_reduce")["layouts"]["compact"]
    assert upstream["grad_sync"]["wire_bytes_per_rank"] == (
        rows["compact_all_reduce"]["grad_wire_bytes"]
    )
