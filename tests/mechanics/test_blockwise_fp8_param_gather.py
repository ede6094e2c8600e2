"""Layer-wise Muon with blockwise FP8 (Hopper) param all-gather, FP8 bytes on the wire.

The OFF run keeps bf16 weights and quantizes them with 128x128 tiles on the fly for its GEMMs
(FP8 compute, bf16 parameters); the ON run keeps persistent ``Float8BlockwiseQTensor`` weights,
each owner quantizes the bf16 cast of its fp32 masters once and ships FP8 codes + tile scales,
receivers derive the columnwise form (which the backward's dgrad GEMM reads). Both start from the
same bf16 initial values and train 5 Muon steps (Adam for biases and norms) on CPU ranks with
TE 2.20.2's own classes over the exact emulation; compared with atol = rtol = 0.

Mutation tests switch each step of the patch off on its own and show a test here fails.
"""

from __future__ import annotations

import pytest
import torch

from nemo_lw_fp8.cpu.te import backend as te_backend
from tests.support import owner_reduce_probe as probe
from tests.support.fp8_mlp import FP8_BOOT, MUON_FP8_MLP, skip_module_without_te
from tests.support.harness import RankFailure, run_on_ranks
from tests.support.mutations import train_with_step_off
from tests.support.parity import assert_diverges, assert_same_steps
from tests.support.parity import assert_fp8_gather_parity as assert_bitwise
from tests.support.resumable import resume_mismatches, run_on_fresh_ranks, runs_to_resume
from tests.support.scenarios import Scenario
from tests.support.te_test_support import real_te_gpu_skip_reason
from tests.support.training import train

skip_module_without_te("the FP8 emulation needs TE's Python package")

FP8 = FP8_BOOT
BASE = MUON_FP8_MLP.with_(fp8_recipe="blockwise")
LAYOUTS = ["layerwise_padded", "layerwise_compact"]


def run(scenario: Scenario, world_size: int = 2) -> list[dict]:
    """``train(scenario)``; on the compact layout probed for what its grad syncs issued
    (``tests/support/owner_reduce_probe.py``)."""
    fn = probe.train_probed if probe.owner_reduced(scenario) else train
    return run_on_ranks(fn, scenario, world_size=world_size, boot=FP8)


def _owner_reduced(scenario: Scenario, **runs: list[dict]) -> None:
    """On the compact layout, every one of ``runs`` (label -> results of :func:`run`) synced
    its Muon gradients by the owner reduce, as the probe read it off the ranks."""
    if probe.owner_reduced(scenario):
        for label, results in runs.items():
            probe.assert_reduced_to_owners(results, label)


def _assert_blockwise_groups(groups: list[list[str]]) -> None:
    """Layer-wise FP8 buckets never share a group with DistOpt buckets."""
    assert any("layerwise:fp8" in group for group in groups), groups
    for group in groups:
        assert len({kind.split(":")[0] for kind in group}) == 1, groups


# Four ranks once in the gate (compact layout, overlap on); the other three four-rank cases
# repeat that claim in the extended tier (docs/testing.md, "Two tiers").
@pytest.mark.parametrize(
    "distribution, world_size, overlap",
    [(layout, size, overlap) for layout in LAYOUTS for size in (2, 4) for overlap in (False, True)
     if size == 2 or (layout, overlap) == ("layerwise_compact", True)]
    + [pytest.param(layout, 4, overlap, marks=pytest.mark.extended)
       for layout in LAYOUTS for overlap in (False, True)
       if (layout, overlap) != ("layerwise_compact", True)],
    ids=lambda value: {False: "no-overlap", True: "overlap", "layerwise_padded": "padded",
                       "layerwise_compact": "compact"}.get(value, str(value)),
)  # fmt: skip
def test_blockwise_param_gather_on_equals_off(distribution, world_size, overlap):
    scenario = BASE.with_(distribution=distribution, overlap=overlap)
    off = run(scenario, world_size)
    on = run(scenario.with_(fp8_param_gather=True), world_size)
    _assert_blockwise_groups(on[0]["bucket_groups"])
    _owner_reduced(scenario, off=off, on=on)
    assert_bitwise(off, on)
    # Training moved the weights (the comparison is not of two frozen models).
    first = run(scenario.with_(steps=1), world_size)
    assert first[0]["digest"] != off[0]["digest"]


@pytest.mark.parametrize("distribution", LAYOUTS, ids=["padded", "compact"])
def test_several_bucket_groups_on_equals_off(distribution):
    scenario = BASE.with_(distribution=distribution, bucket_size=60_000, overlap=True)
    off = run(scenario)
    on = run(scenario.with_(fp8_param_gather=True))
    groups = on[0]["bucket_groups"]
    assert sum(1 for g in groups if "layerwise:fp8" in g) >= 2, groups
    _owner_reduced(scenario, off=off, on=on)
    assert_bitwise(off, on)


def test_stock_megatron_is_not_bitwise():
    """Control: without the plugin, blockwise FP8 param gather with layer-wise Muon is wrong."""
    off = run(BASE)
    on = run(BASE.with_(fp8_param_gather=True, plugin=False))
    assert_diverges(off, on)


@pytest.mark.parametrize("distribution", LAYOUTS, ids=["padded", "compact"])
def test_train_eval_train_equals_train_train(distribution):
    scenario = BASE.with_(distribution=distribution, overlap=True, fp8_param_gather=True)
    plain = run(scenario)
    with_eval = run(scenario.with_(eval_after=(1, 3)))
    assert_same_steps(plain, with_eval)
    off = run(scenario.with_(fp8_param_gather=False, eval_after=(1, 3)))
    _owner_reduced(scenario, plain=plain, with_eval=with_eval, off=off)
    assert_bitwise(off, with_eval)


def _resume_runs(
    distribution: str, overlap: bool, directory: str
) -> tuple[list[dict], list[dict], str]:
    """6 uninterrupted steps, the first 3 steps that saved and the checkpoint directory: a
    resume test's runs, made once per session and kept for its control."""
    scenario = BASE.with_(
        distribution=distribution, overlap=overlap, fp8_param_gather=True, steps=6
    )
    return runs_to_resume(scenario, directory, FP8)


def _resume_mismatches(
    uninterrupted: list[dict], first: list[dict], resumed: list[dict]
) -> list[str]:
    """What of the resumed run differs from the run that never stopped (losses, digest, every
    fp32 master and effective weight by name, the probe's output), per rank; empty if nothing."""
    before = [r["losses"] for r in first]
    named = {"masters": "master", "effective_weights": "weight"}
    return resume_mismatches(uninterrupted, before, resumed, named, probe=True)


@pytest.mark.parametrize(
    "distribution, overlap",
    [("layerwise_padded", True), ("layerwise_compact", False)],
    ids=["padded-overlap", "compact"],
)
def test_checkpoint_resume_in_fresh_processes_is_bitwise(distribution, overlap, tmp_path):
    """Save after 3 steps, start new rank processes, load, run steps 3-5: same bits as 6 steps."""
    scenario = BASE.with_(
        distribution=distribution, overlap=overlap, fp8_param_gather=True, steps=6
    )
    uninterrupted, first, directory = _resume_runs(distribution, overlap, str(tmp_path))
    fn = probe.train_probed if probe.owner_reduced(scenario) else train
    resumed = run_on_fresh_ranks(fn, scenario.with_(first_step=3, load_dir=directory), boot=FP8)
    # The resumed steps (3 of them) synced by the owner reduce too.
    _owner_reduced(scenario, resumed=resumed)
    assert _resume_mismatches(uninterrupted, first, resumed) == []


def test_control_resume_with_a_master_one_ulp_off_differs(tmp_path):
    """Control of ``test_checkpoint_resume_in_fresh_processes_is_bitwise`` (compact): the
    resumed run with each rank's first layer-wise master moved up by one ulp after the load
    completes and fails the same comparison with the same uninterrupted run (the test's own,
    when it ran first in this session), in the masters."""
    from tests.support.resume_controls import train_with_a_nudged_loaded_master

    uninterrupted, first, directory = _resume_runs("layerwise_compact", False, str(tmp_path))
    scenario = BASE.with_(
        distribution="layerwise_compact", fp8_param_gather=True, steps=6, first_step=3
    )
    nudged = run_on_ranks(
        train_with_a_nudged_loaded_master, scenario.with_(load_dir=directory), boot=FP8
    )
    bad = _resume_mismatches(uninterrupted, first, nudged)
    assert any(" master " in item for item in bad), bad


# --------------------------------------------------------------------------- mutation checks


def _quantize_from_fp32(param, master):
    """The owner quantizes its fp32 master directly, skipping the bf16 cast FP8-gather-off sees."""
    from megatron.core.fp8_utils import copy_tensor_to_quantized_param

    copy_tensor_to_quantized_param(param, master.detach().view(param.shape))


def _one_list(buffers):
    return [list(buffers)]


#: step -> (module, attribute, replacement that undoes it; None: a no-op)
MUTATIONS = {
    "bf16_cast": ("blockwise", "quantize_owned", _quantize_from_fp32),
    "scales_on_the_wire": ("blockwise", "write_scales", None),
    "columnwise": ("blockwise", "derive_columnwise", None),
    "master_init": ("masters", "init_masters_from_high_precision", None),
    "separate_groups": ("blockwise", "separate_owner_kinds", _one_list),
}


#: Steps whose absence a check catches before any number is computed (not a divergence).
REFUSED_WITHOUT = {
    "separate_groups": "a bucket group mixes layer-wise blockwise FP8 buckets with DistOpt",
}


@pytest.mark.parametrize("step", sorted(set(MUTATIONS) - set(REFUSED_WITHOUT)))
def test_each_step_is_needed(step):
    scenario = BASE.with_(overlap=True)
    off = run(scenario)
    on = run_on_ranks(
        train_with_step_off, scenario.with_(fp8_param_gather=True), MUTATIONS, step, boot=FP8
    )
    # Unmutated, this exact comparison holds (test_blockwise_param_gather_on_equals_off).
    assert_diverges(off, on)


@pytest.mark.parametrize("step", sorted(REFUSED_WITHOUT))
def test_missing_step_is_refused(step):
    """Without the bucket-group separation, a group mixes owner kinds and the set-up refuses it
    (the gather cannot run on such a group); the refusal, not a crash elsewhere, is the result."""
    with pytest.raises(RankFailure, match=REFUSED_WITHOUT[step]):
        scenario = BASE.with_(overlap=True, fp8_param_gather=True)
        run_on_ranks(train_with_step_off, scenario, MUTATIONS, step, boot=FP8)


# --------------------------------------------------------------------------- wire bytes


def gather_bytes(scenario: Scenario) -> dict:
    """What the layer-wise bucket groups gather during steps 1 and 2 (received bytes)."""
    from nemo_lw_fp8.mechanics.blockwise import param_wire_bytes, plan_of
    from tests.support.param_gathers import train_recording_gathers

    seen: list[tuple[str, str, int]] = []

    def record(name: str, out: list) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in out)
        seen.append((name, str(out[0].dtype), nbytes))

    groups = train_recording_gathers(scenario, record, megatron_alias=True)
    weights = [p for g in groups for b in g.buckets for p in b.params_list]
    states = [plan_of(g) for g in groups]
    return {
        "blockwise_states": sum(s is not None for s in states),
        "planned_bytes": sum(s.gather_bytes for s in states if s is not None),
        "calls": [(name, dtype) for name, dtype, _ in seen],
        "bytes_per_step": sum(n for _, _, n in seen) // 2,
        "groups": len(groups),
        "numel": sum(p.numel() for p in weights),
        "wire_bytes": sum(param_wire_bytes(p) for p in weights),
    }


@pytest.mark.parametrize("distribution", LAYOUTS, ids=["padded", "compact"])
def test_fp8_bytes_on_the_wire_are_about_half_of_bf16(distribution):
    # compact: tolerance 0 makes every gather uneven (real bytes only); padded: the default 0.1.
    scenario = BASE.with_(distribution=distribution, gather_padding_tolerance=0.0)
    on = run_on_ranks(gather_bytes, scenario.with_(fp8_param_gather=True), boot=FP8)[0]
    off = run_on_ranks(gather_bytes, scenario, boot=FP8)[0]
    # Every layer-wise group is the patch's, one collective per group and step, all uint8.
    assert on["blockwise_states"] == on["groups"] >= 1
    assert len(on["calls"]) == 2 * on["groups"]
    assert {dtype for _, dtype in on["calls"]} == {"torch.uint8"}
    # The codes plus one fp32 scale per 128x128 tile, plus even-gather padding within tolerance.
    assert on["bytes_per_step"] == on["planned_bytes"]
    if distribution == "layerwise_compact":
        assert on["bytes_per_step"] == on["wire_bytes"]
    assert on["wire_bytes"] <= on["bytes_per_step"] <= 1.1 * on["wire_bytes"]
    assert on["wire_bytes"] < on["numel"] * 1.01
    # FP8 gather off moves bf16 (the padded layout also pads its shards).
    assert {dtype for _, dtype in off["calls"]} == {"torch.bfloat16"}
    assert off["bytes_per_step"] >= 2 * off["numel"]
    assert on["bytes_per_step"] <= 0.55 * off["bytes_per_step"], (on, off)


def _bf16_on_the_wire():
    """Mutation: each blockwise weight travels as its owner's bf16 values (2 bytes an element,
    no scales), and receivers quantize what they get; the gather is otherwise the patch's."""
    from nemo_lw_fp8.mechanics import blockwise

    wire, unpack = blockwise.param_wire_bytes, blockwise._unpack_param

    def param_wire_bytes(param):
        return 2 * param.numel() if blockwise.is_blockwise(param) else wire(param)

    def pack_owned(state, rank, out):
        offset = 0
        for param in state.segments[rank]:
            master = blockwise._master(param)
            if blockwise.is_blockwise(param):
                if master is not None:
                    blockwise.quantize_owned(param, master)
                source = master if master is not None else param.dequantize()
                raw = source.detach().to(torch.bfloat16)
            else:
                raw = (master if master is not None else param).detach().to(param.dtype)
            raw = raw.reshape(-1).contiguous().view(torch.uint8)
            out[offset : offset + raw.numel()].copy_(raw)
            offset += raw.numel()

    def _unpack_param(param, payload):
        if blockwise.is_blockwise(param):
            blockwise.quantize_owned(param, payload.clone().view(torch.bfloat16).float())
        else:
            unpack(param, payload)

    return {"param_wire_bytes": param_wire_bytes, "pack_owned": pack_owned,
            "_unpack_param": _unpack_param}  # fmt: skip


def gather_bytes_of_bf16(scenario: Scenario) -> dict:
    from nemo_lw_fp8.mechanics import blockwise

    with pytest.MonkeyPatch.context() as mp:
        for name, replacement in _bf16_on_the_wire().items():
            mp.setattr(blockwise, name, replacement)
        return gather_bytes(scenario)


def test_control_bf16_on_the_wire_fails_the_byte_bound():
    """Control of ``test_fp8_bytes_on_the_wire_are_about_half_of_bf16`` (compact layout): the
    same gather carrying each blockwise weight as bf16 (what gather off sends) completes, its
    collectives still uint8 and exactly as planned, and the measured ratio fails the 0.55
    bound."""
    scenario = BASE.with_(distribution="layerwise_compact", gather_padding_tolerance=0.0)
    bf16 = run_on_ranks(gather_bytes_of_bf16, scenario.with_(fp8_param_gather=True), boot=FP8)[0]
    off = run_on_ranks(gather_bytes, scenario, boot=FP8)[0]
    assert bf16["blockwise_states"] == bf16["groups"] >= 1
    assert {dtype for _, dtype in bf16["calls"]} == {"torch.uint8"}
    assert bf16["bytes_per_step"] == bf16["planned_bytes"] == bf16["wire_bytes"]
    assert bf16["wire_bytes"] == 2 * bf16["numel"]
    assert bf16["bytes_per_step"] > 0.55 * off["bytes_per_step"], (bf16, off)


# --------------------------------------------------------------------------- guards


def build_with(scenario: Scenario, reuse: bool) -> str:
    from tests.support import scenarios, training

    module, config = scenarios.build_model(scenario)
    saved = training._reuse_grad_buf
    training._reuse_grad_buf = lambda s: reuse
    try:
        training.wrap_and_build_optimizer(module, config, scenario)
    finally:
        training._reuse_grad_buf = saved
    return "built"


def test_grad_buffer_reuse_is_rejected_when_the_optimizer_is_built():
    scenario = BASE.with_(fp8_param_gather=True)
    assert run_on_ranks(build_with, scenario, False, boot=FP8) == ["built", "built"]
    with pytest.raises(RankFailure) as info:
        run_on_ranks(build_with, scenario, True, boot=FP8)
    assert "blockwise-gather-no-grad-buffer-reuse" in str(info.value)
    assert "--reuse-grad-buf-for-mxfp8-param-ag" in str(info.value)


# --------------------------------------------------------------------------- Hopper


def _te_gpu_reason() -> str | None:
    return real_te_gpu_skip_reason(
        lambda major, minor: (major, minor) >= (9, 0),
        "TE's blockwise FP8 needs compute capability >= 9.0",
    )


@pytest.mark.gpu
def test_owner_payload_from_te_kernels_equals_emulation_on_gpu():
    """On an H100/H200: what an owner ships (TE's quantize kernel), and what a receiver derives
    (TE's fp8_transpose), byte for byte equal to the emulation the CPU tests run on."""
    reason = _te_gpu_reason()
    if reason is not None:
        pytest.skip(reason)
    assert te_backend.activate() == "transformer_engine"
    from transformer_engine.pytorch.constants import DType
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    from nemo_lw_fp8.cpu.formats import blockwise as bw
    from nemo_lw_fp8.mechanics import blockwise as bwg

    torch.manual_seed(0)
    for shape in ((256, 384), (576, 7168), (200, 300)):
        master = torch.randn(shape, device="cuda") * torch.exp2(
            torch.randint(-8, 8, shape, device="cuda").float()
        )
        quantizer = Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True)
        weight = torch.nn.Parameter(
            quantizer(torch.zeros(shape, dtype=torch.bfloat16, device="cuda"))
        )
        weight.main_param = master
        size = bwg.param_wire_bytes(weight)
        state = bwg.BlockwiseGroup([[weight]], [size], True, None)
        out = torch.zeros(size, dtype=torch.uint8, device="cuda")
        bwg.pack_owned(state, 0, out)
        ref = bw.quantize(master.cpu().bfloat16())
        m, k = bw.valid_scale_shape(shape)
        want = torch.cat(
            [
                ref.rowwise_data.reshape(-1),
                ref.rowwise_scale_inv[:m, :k].contiguous().view(torch.uint8).reshape(-1),
            ]
        )
        assert torch.equal(out.cpu(), want), shape
        # A receiver: bytes in, columnwise derived by TE's kernel.
        receiver = torch.nn.Parameter(
            quantizer(torch.zeros(shape, dtype=torch.bfloat16, device="cuda"))
        )
        bwg._unpack_param(receiver, out)
        bwg.derive_columnwise([receiver])
        assert torch.equal(receiver._columnwise_data.cpu(), ref.columnwise_data), shape
        assert torch.equal(
            receiver._columnwise_scale_inv[:k, :m].cpu(), ref.columnwise_scale_inv[:k, :m]
        )
