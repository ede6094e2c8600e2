"""nemo_lw_fp8.planner.rank_plan and ``nemo-lw-fp8 plan``'s model form: per-rank memory, buffers,
gathers and gradient sync of the stock padded, compact and DistOpt layouts (by hand on tiny
models, against megatron's own layout code, and TE's own FP8 / NVFP4 weight buffers)."""

from __future__ import annotations

import json
import math

import pytest

from nemo_lw_fp8.cli import plan as plan_cli
from nemo_lw_fp8.planner import rank_plan as planner
from nemo_lw_fp8.planner.shapes import ParamSpec, param_shapes, total_params

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
