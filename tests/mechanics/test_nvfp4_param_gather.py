"""NVFP4 primary weights under layer-wise Muon, FP4 bytes on the data-parallel wire (issue 30).

The OFF run is ``tests/mechanics/test_nvfp4_layer_wise.py``'s: a 2-layer GPT from megatron's TE
spec with ``fp4="e2m1"`` (NVFP4 compute, stochastic rounding off on megatron's own recipe), bf16
weights that TE quantizes (16x16 blocks) at every forward. The ON run builds the same model with
megatron's ``fp4_param`` (persistent ``NVFP4Tensor`` weights, fp32 masters from TE's preserved
init values) and DDP's ``fp4_param_gather``: each owner quantizes the bf16 cast of its master
once and ships FP4 codes + 16x16 tile scales + the amax; receivers derive the columnwise copy.

Why ON = OFF bitwise: in the OFF run the inner step writes ``bf16(master)`` into the weight and
TE's weight quantizer casts it at the forward; in the ON run the owner casts the same
``bf16(master)`` with a quantizer of the same settings (16x16 blocks, no RHT, no SR), the cast is
deterministic and local to the whole matrix (its amax too), so every rank's GEMMs read the same
codes, scales and amax. Where the persistent weight keeps its scales swizzled, the GEMM reads the
same values in another byte order. On the compact layout ON and OFF (and a resume's steps)
synced their Muon gradients by the owner reduce, as the ranks issued them
(``tests/support/owner_reduce_probe.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nemo_lw_fp8.cpu.te import backend as te_backend
from nemo_lw_fp8.vocabulary import NVFP4_NO_SR_ENV as NVFP4_NO_SR
from tests.support import owner_reduce_probe as probe
from tests.support.harness import BootOptions, RankFailure, run_on_ranks
from tests.support.parity import assert_diverges
from tests.support.resumable import assert_same_run
from tests.support.te_test_support import blackwell_script, needs_te, run_te_script

if te_backend.te_package_dirs() is None:  # find, never import, TE in this process
    pytest.skip("TE's own modules need TE's Python package", allow_module_level=True)

BOOT = BootOptions(fp8_emulation=True)
HIDDEN, FFN = 128, 256

#: mutation name -> (attribute of mechanics.nvfp4_gather, replacement); each leaves receivers
#: with something stale after the gather.
MUTATIONS = {
    # receivers keep their old per-tensor amax (the GEMM's global scale)
    "stale_amax": ("write_amax", lambda param, amax: None),
    # receivers keep their old columnwise copy (dgrad and wgrad read it)
    "stale_columnwise": ("derive_columnwise", lambda param: None),
}


#: MoE layers with discrete experts (``test_nvfp4_layer_wise``'s: megatron's ``SequentialMLP`` of
#: TE linears, each padding its tokens to megatron's FP4 alignment of 128 rows).
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128,
           moe_token_dispatcher_type="allgather", moe_router_dtype="fp64")  # fmt: skip


def build_gpt(fp4_param: bool, seed: int, moe: bool = False):
    """``test_nvfp4_layer_wise``'s 2-layer GPT (SwiGLU, RMSNorm; MoE with ``moe``), NVFP4
    compute; persistent NVFP4 weights with ``fp4_param``."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.support.scenarios import build_gpt as build
    from tests.support.scenarios import seed_all, transformer_config

    seed_all(seed)
    model_parallel_cuda_manual_seed(seed)
    config = transformer_config(
        hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=4, add_bias_linear=False,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", use_cpu_initialization=False, fp4="e2m1", fp4_recipe="nvfp4",
        fp4_param=fp4_param, **(MOE if moe else {}),
    )  # fmt: skip
    return build(config), config


def fp4_weights(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    from nemo_lw_fp8.mechanics import nvfp4_gather

    return [p for p in module.parameters() if nvfp4_gather.is_nvfp4(p)]


def fp4_run(
    fp4_param: bool,
    layout: str = "padded",
    overlap: bool = False,
    mutation: str | None = None,
    steps: tuple[int, int] = (0, 3),
    moe: bool = False,
    save_dir: str | None = None,
    load_dir: str | None = None,
    nudge_loaded_master: bool = False,
    ddp_gather: bool | None = None,
) -> dict[str, Any]:
    """Steps ``steps[0]..steps[1]-1`` of layer-wise Muon with an eval forward after step 0; a
    ``torch_dist`` load (into a build from another seed) before and a save after. Returns losses,
    eval losses, this rank's masters and momenta, TE's GEMM operand kinds, the NVFP4 weights'
    count and what each gather sent. ``ddp_gather``: DDP's ``fp4_param_gather`` when it differs
    from ``fp4_param``."""

    from nemo_lw_fp8.mechanics import nvfp4_gather
    from tests.support import nvfp4_runs
    from tests.support.scenarios import Scenario

    scenario = Scenario(
        model="gpt", optimizer="muon", plugin=True, seed=5, micro_batch=4,
        distribution=f"layerwise_{layout}", overlap=overlap,
        fp4_param_gather=fp4_param if ddp_gather is None else ddp_gather,
    )  # fmt: skip
    weight_kinds: list[str] = []
    sends: list[dict[str, Any]] = []
    with nvfp4_runs.nvfp4_on_blackwell() as mp:
        nvfp4_runs.record_gemm_operands(mp, weight_kinds)
        nvfp4_runs.record_owner_gathers(mp, sends)
        if mutation is not None:
            attr, replacement = MUTATIONS[mutation]
            mp.setattr(nvfp4_gather, attr, replacement)
        module, config = build_gpt(fp4_param, seed=5 if load_dir is None else 17, moe=moe)
        report, _ = nvfp4_runs.train_and_report(
            scenario, module, config, steps, load_dir=load_dir, save_dir=save_dir,
            nudge_loaded_master=nudge_loaded_master,
        )  # fmt: skip
        return {
            **report,
            **nvfp4_runs.gemm_counts(weight_kinds),
            "nvfp4_weights": sum(nvfp4_gather.is_nvfp4(p) for p in module.parameters()),
            "swizzled": sorted({p._with_gemm_swizzled_scales for p in fp4_weights(module)}),
            "sends": sends,
        }


@pytest.mark.parametrize(
    "layout, overlap, moe",
    [("padded", False, False), ("compact", True, False),
     pytest.param("padded", False, True, marks=pytest.mark.extended),
     pytest.param("compact", True, True, marks=pytest.mark.extended)],
    ids=["dense-padded", "dense-compact-overlap", "moe-padded", "moe-compact-overlap"],
)  # fmt: skip
def test_fp4_param_gather_on_equals_off(layout, overlap, moe):
    """GPT at DP 2 (dense; discrete experts in the extended tier), megatron's padded layer-wise
    layout without overlap or the plugin's compact layout with overlapped gathers: FP4 param
    gather ON = OFF bitwise (losses, the eval, masters, momenta); every TE GEMM read NVFP4
    operands; the ON run's Muon weights are NVFP4 tensors, gathered as uint8 payloads."""
    compact = layout == "compact"  # megatron's padded layout has no owner reduce to probe
    fn, first = (probe.run_probed, (fp4_run,)) if compact else (fp4_run, ())
    off, on = (
        run_on_ranks(fn, *first, gather, layout, overlap, moe=moe, world_size=2, boot=BOOT)
        for gather in (False, True)
    )
    if compact:
        probe.assert_reduced_to_owners(off, "gather off")
        probe.assert_reduced_to_owners(on, "gather on")
    assert all(r["nvfp4_gemms"] == r["gemms"] > 0 for r in off + on), on
    assert all(r["nvfp4_weights"] == 0 for r in off)
    assert all(r["nvfp4_weights"] > 0 for r in on)
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in on)
    # the ON run's gathers were the plugin's owner-packed uint8 collectives; the OFF run's (the
    # compact layout's own owner-packed gathers) carry bf16
    assert all(r["sends"] and {s["dtype"] for s in r["sends"]} == {"torch.uint8"} for r in on)
    assert all(s["dtype"] != "torch.uint8" for r in off for s in r["sends"])
    assert_same_run(off, on)


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_fp4_param_gather_controls_diverge(mutation):
    """Controls: receivers that keep a stale global amax, or a stale columnwise copy, after the
    gather train differently from FP4 param gather off (the ON run itself equals it)."""
    off = run_on_ranks(fp4_run, False, world_size=2, boot=BOOT)
    mutated = run_on_ranks(fp4_run, True, mutation=mutation, world_size=2, boot=BOOT)
    assert_diverges(off, mutated, assert_same_run)


@pytest.mark.extended
def test_fp4_primary_weights_without_the_gather_are_refused_at_build():
    """NVFP4 primary weights (``fp4_param``) with DDP's ``fp4_param_gather`` off: no gather
    would ship the owners' weights; the layer-wise optimizer's build stops with the rule."""
    with pytest.raises(RankFailure, match=r"fp4-primary-weights-layer-wise.*fp4-param-gather"):
        run_on_ranks(fp4_run, True, ddp_gather=False, world_size=2, boot=BOOT)


def test_fp4_param_gather_resumes_bitwise(tmp_path):
    """FP4 param gather ON, compact layout with overlap: save (``torch_dist``) after two steps,
    load into a build from another seed, two more steps: the losses, masters and momenta of four
    uninterrupted steps, bitwise. Control: one loaded master one ulp off diverges."""
    saved = str(tmp_path)
    args = dict(world_size=2, boot=BOOT)
    whole = run_on_ranks(probe.run_probed, fp4_run, True, "compact", True, steps=(0, 4), **args)
    first = run_on_ranks(fp4_run, True, "compact", True, steps=(0, 2), save_dir=saved, **args)
    resumed = run_on_ranks(
        probe.run_probed, fp4_run, True, "compact", True, steps=(2, 4), load_dir=saved, **args
    )
    probe.assert_reduced_to_owners(whole, "uninterrupted")
    probe.assert_reduced_to_owners(resumed, "resumed")
    for rank in range(2):
        assert first[rank]["losses"] + resumed[rank]["losses"] == whole[rank]["losses"]
    no_evals = [{**r, "losses": [], "eval_losses": []} for r in whole]
    assert_same_run(no_evals, [{**r, "losses": [], "eval_losses": []} for r in resumed])
    nudged = run_on_ranks(
        fp4_run, True, "compact", True, steps=(2, 4), load_dir=saved, nudge_loaded_master=True,
        **args,
    )  # fmt: skip
    assert_diverges(
        [{**r, "eval_losses": []} for r in resumed],
        [{**r, "eval_losses": []} for r in nudged],
        assert_same_run,
    )


def test_weights_with_1x16_blocks_are_refused():
    """The build-time check: a weight whose quantizer casts 1x16 blocks has a columnwise copy
    with its own blocks along the other dim, which receivers could not derive; 16x16 passes."""
    from types import SimpleNamespace

    from nemo_lw_fp8.errors import ConfigError
    from nemo_lw_fp8.mechanics import nvfp4_gather

    def weight(shape, two_d):
        return SimpleNamespace(shape=shape, _quantizer=SimpleNamespace(with_2d_quantization=two_d))

    nvfp4_gather.check([weight((128, 128), True)])
    with pytest.raises(ConfigError, match=r"fp4-primary-weights-layer-wise.*\(256, 128\)"):
        nvfp4_gather.check([weight((128, 128), True), weight((256, 128), False)])


# --------------------------------------------------------------------------- stock megatron

#: An NVFP4 weight's buffers, compared between ranks and with their values at init.
WEIGHT_BUFFERS = ("_rowwise_data", "_rowwise_scale_inv", "_amax_rowwise", "_columnwise_data",
                  "_columnwise_scale_inv", "_amax_columnwise")  # fmt: skip


def _nvfp4_2d_multi_tensor_transpose(rows, columns, row_scales, column_scales, ms, ks) -> None:
    """``tex.nvfp4_2d_multi_tensor_transpose``, which megatron's ``post_all_gather_processing``
    reaches through TE's ``_nvfp4_2d_multi_tensor_transpose`` and the CPU emulation lacks: per
    tensor, what TE's ``NVFP4TensorStorage._create_columnwise`` does (the emulated
    ``nvfp4_data_transpose``, ``nvfp4_2d_scale_transpose`` over ``ceil(M/16) x ceil(K/16)``
    tiles). It derives the columnwise copy from the rowwise buffers the rank holds; what the
    test checks (the rowwise scales and amaxes) is never written by it."""
    import transformer_engine_torch as tex

    for row, column, row_scale, column_scale, m, k in zip(
        rows, columns, row_scales, column_scales, ms, ks, strict=True
    ):
        tex.nvfp4_data_transpose(row, out=column)
        tex.nvfp4_2d_scale_transpose(row_scale, column_scale, (m + 15) // 16, (k + 15) // 16)


def stock_fp4_run(fp4_param: bool) -> dict[str, Any]:
    """Stock megatron-core 0.19.2, the plugin not applied: layer-wise Muon on megatron's padded
    layout, NVFP4 compute, with ``fp4_param`` and DDP's ``fp4_param_gather`` (``fp4_param``) or
    bf16 weights, three steps and an eval. Returns the report of :func:`fp4_run` (losses,
    masters, momenta), the features of the plugin applied during the run, and every NVFP4
    weight's buffers at init and after the run."""
    import transformer_engine_torch as tex

    import nemo_lw_fp8
    from nemo_lw_fp8.cpu.te import device as te_device
    from nemo_lw_fp8.mechanics import nvfp4_gather
    from tests.support import nvfp4_runs
    from tests.support.scenarios import Scenario

    scenario = Scenario(
        model="gpt", optimizer="muon", plugin=False, seed=5, micro_batch=4,
        distribution="layerwise_padded", overlap=False, fp4_param_gather=fp4_param,
    )  # fmt: skip

    def buffers(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            f"{n}:{b}": getattr(w, b).clone() for n, w in weights.items() for b in WEIGHT_BUFFERS
        }

    with pytest.MonkeyPatch.context() as mp, te_device.target_gpu(te_device.BLACKWELL):
        nvfp4_runs.pin_recipe_without_stochastic_rounding(mp)
        mp.setattr(tex, "nvfp4_2d_multi_tensor_transpose", _nvfp4_2d_multi_tensor_transpose,
                   raising=False)  # fmt: skip
        module, config = build_gpt(fp4_param, seed=5)
        weights = {n: p for n, p in module.named_parameters() if nvfp4_gather.is_nvfp4(p)}
        initial = buffers(weights)
        report, _ = nvfp4_runs.train_and_report(scenario, module, config, (0, 3))
        return {**report, "plugin": nemo_lw_fp8.applied(), "initial": initial,
                "final": buffers(weights)}  # fmt: skip


def test_stock_megatron_gathers_fp4_codes_without_their_scales():
    """What stock megatron-core 0.19.2 does with layer-wise Muon + NVFP4 primary weights +
    ``fp4_param_gather`` (Megatron-Bridge's Kimi-K2 GB300 NVFP4 recipe asks for it; docs/nvfp4.md,
    "Stock megatron-core with layer-wise FP4 param gather"), the plugin not applied: no error,
    and silently wrong. Each owner re-quantizes its weights (codes, tile scales, amax); DDP's
    param gather ships the rowwise FP4 codes only, so every other rank combines the new codes
    with the tile scales and amax of the init, and the run departs from NVFP4 compute on bf16
    weights after the first gather (same first loss). The plugin's run of the same settings
    equals that reference bitwise (``test_fp4_param_gather_on_equals_off[dense-padded]``)."""
    off = run_on_ranks(stock_fp4_run, False, world_size=2, boot=BOOT)
    on = run_on_ranks(stock_fp4_run, True, world_size=2, boot=BOOT)
    assert all(r["plugin"] == [] for r in off + on)
    assert not off[0]["initial"] and on[0]["initial"]
    names = sorted({key.split(":")[0] for key in on[0]["initial"]})
    assert len(names) == 8, names  # 2 layers x (qkv, proj, fc1, fc2)
    for name in names:
        codes = f"{name}:_rowwise_data"
        # the gathered codes: the same on both ranks, changed since the init
        assert torch.equal(on[0]["final"][codes], on[1]["final"][codes]), name
        assert not torch.equal(on[0]["final"][codes], on[0]["initial"][codes]), name
        for buffer in ("_rowwise_scale_inv", "_amax_rowwise", "_amax_columnwise"):
            key = f"{name}:{buffer}"
            moved = [not torch.equal(r["final"][key], r["initial"][key]) for r in on]
            # the owner's moved, the receiver's is still the init's
            assert sorted(moved) == [False, True], (key, moved)
    for rank in range(2):
        assert on[rank]["losses"][0] == off[rank]["losses"][0], rank
        assert on[rank]["losses"][1] != off[rank]["losses"][1], rank
    assert_diverges(off, on, assert_same_run)


CODEC_SCRIPT = blackwell_script(
    r"""
from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer
from nemo_lw_fp8.mechanics import nvfp4_gather as g

BUFFERS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv",
           "_amax_rowwise", "_amax_columnwise")

def same(a, b):
    return all(torch.equal(getattr(a, n).view(torch.uint8), getattr(b, n).view(torch.uint8))
               for n in BUFFERS)

gen = torch.Generator().manual_seed(3)
for swizzle in (True, False):
    q = NVFP4Quantizer(with_2d_quantization=True)
    q.optimize_for_gemm = swizzle
    old = (torch.randn(256, 384, generator=gen) * 0.02).bfloat16()
    new = (torch.randn(256, 384, generator=gen) * 0.05).bfloat16()
    owner, receiver = q(new), q(old)        # the receiver holds last step's weight
    wire = torch.empty(g.param_wire_bytes(owner), dtype=torch.uint8)
    g.pack_param(owner, None, wire)
    g.unpack_param(receiver, wire)
    g.derive_columnwise(receiver)
    key = "swizzled" if swizzle else "compact"
    R[key] = {
        "flag": bool(owner._with_gemm_swizzled_scales),
        "bytes": int(wire.numel()),
        "equal": same(owner, receiver),
        # TE's own derivation reads the rowwise scales as compact
        "te_create_columnwise": None,
    }
    te_derived = q(old)
    g.unpack_param(te_derived, wire)
    te_derived._create_columnwise()
    R[key]["te_create_columnwise"] = same(owner, te_derived)
    # controls: what the gather writes matters (stale amax, stale columnwise)
    stale = q(old)
    g.unpack_param(stale, wire)
    R[key]["stale_columnwise_equal"] = same(owner, stale)
    g.derive_columnwise(stale)
    stale._amax_rowwise.copy_(q(old)._amax_rowwise)
    stale._amax_columnwise.copy_(q(old)._amax_columnwise)
    R[key]["stale_amax_equal"] = same(owner, stale)
print("RESULT " + json.dumps(R))
""", env=(NVFP4_NO_SR,)
)


@needs_te
def test_receiver_rebuilds_te_cast_bitwise():
    """One weight through the wire (codes + one E4M3 byte per 16x16 tile + the amax): the
    receiver's rowwise and derived columnwise buffers equal TE's own cast of the owner's bf16
    values, byte for byte, with GEMM-swizzled scales and with compact ones. TE's own
    ``_create_columnwise`` gets the swizzled case wrong (it reads the scales as compact) and the
    compact case right. Controls: a stale columnwise copy, a stale amax differ."""
    result = run_te_script(CODEC_SCRIPT)
    assert result["backend"] == "emulated"
    wire = 256 * 384 // 2 + (256 // 16) * (384 // 16) + 4
    for key, swizzled in (("swizzled", True), ("compact", False)):
        case = result[key]
        assert case["flag"] is swizzled and case["bytes"] == wire, case
        assert case["equal"] is True, case
        assert case["te_create_columnwise"] is (not swizzled), case
        assert case["stale_columnwise_equal"] is False, case
        assert case["stale_amax_equal"] is False, case


if __name__ == "__main__":
    results = run_on_ranks(fp4_run, True, world_size=2, boot=BOOT)
    print([(r["losses"], r["nvfp4_weights"], r["swizzled"], r["sends"][:4]) for r in results])
