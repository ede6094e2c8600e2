"""NVFP4 through TE 2.20.2's ``GroupedLinear`` on CPU (issue 30): ``tex.split_quantize`` with
NVFP4 quantizers (TE's grouped NVFP4 cast: one amax per split, the grouped RHT path, the
group-wide scale layout) and ``tex.te_general_grouped_gemm`` on NVFP4 operands.

Everything TE runs in one subprocess (this process never imports TE), on the B200 target, with
stochastic rounding off. The claims:

* each split of ``split_quantize`` is, bitwise, ``tex.quantize`` of that split alone (its own
  amax; TE's grouped kernels never share one), in the group's layout (swizzled scales only when
  every split is a multiple of 128 rows with the RHT and ``optimize_for_gemm``), empty experts
  included; TE's own checks (64-row splits, no 16x16 blocks) raise;
* TE's ``GroupedLinear`` with N experts and uneven splits (one empty) equals N TE ``Linear``
  modules with the same weights run on the splits, bitwise in the output, dgrad and every
  expert's wgrad, with the RHT (both grouped RHT paths) and without.

Controls kept: the split cast with the whole tensor's amax (a shared amax), and the grouped run
with the emulation mutated to a shared amax or to a dropped RHT, diverge from TE's bytes / the
Linear reference.
"""

from __future__ import annotations

import math

import pytest

from nemo_lw_fp8.vocabulary import NVFP4_NO_SR_ENV as NVFP4_NO_SR
from tests.support.nvfp4_grouped_path import MutatedCast
from tests.support.te_test_support import blackwell_script, needs_te, run_te_script

TE_SCRIPT = blackwell_script(
    r"""
import transformer_engine.pytorch as te
import transformer_engine_torch as tex
from transformer_engine.common.recipe import NVFP4BlockScaling
from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer
from nemo_lw_fp8.cpu.formats import nvfp4 as fp4
from nemo_lw_fp8.cpu.te.tex import split_quantize_nvfp4 as G

BUFS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv",
        "_amax_rowwise", "_amax_columnwise")

def eq(x, y):
    # bitwise (NaN payloads and -0 included)
    if x is None or y is None:
        return x is None and y is None
    x, y = x.contiguous(), y.contiguous()
    return (x.dtype == y.dtype and x.shape == y.shape
            and bool(torch.equal(x.view(torch.uint8), y.view(torch.uint8))))

def compact(t, name):
    # a buffer of an NVFP4 tensor, its scales read back to compact where they are swizzled
    v = getattr(t, name)
    if "scale" in name and v is not None and t._with_gemm_swizzled_scales:
        v = fp4.unswizzle_scales(v)
    return v

def same_tensor(a, b):
    # all buffers of two NVFP4 tensors, scales compared in the compact layout
    return all(eq(compact(a, n), compact(b, n)) for n in BUFS)

gen = torch.Generator().manual_seed(30)
MASK = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True).rht_matrix_random_sign_mask_t

def quantizer(rht, optimize=True, two_d=False):
    q = NVFP4Quantizer(with_rht=rht, with_post_rht_amax=rht, with_2d_quantization=two_d)
    q.optimize_for_gemm = optimize
    q.internal = True
    return q

def rows_of(x, sizes):
    return list(torch.split(x, sizes))

# ---- 1. tex.split_quantize with NVFP4 quantizers ------------------------------------------------
sq = {}
for label, rht, sizes in (("plain", False, [128, 64, 0, 192]),
                          ("rht_aligned", True, [128, 0, 256, 128]),
                          ("rht_64", True, [128, 64, 0, 192])):
    # each split at its own scale, so a shared amax would change the smaller ones
    x = torch.cat([torch.randn(n, 256, generator=gen) * s
                   for n, s in zip(sizes, (4.0, 1.0, 0.3, 0.05))]).bfloat16()
    qs = [quantizer(rht) for _ in sizes]
    outs = tex.split_quantize(x, sizes, qs)
    r = {"types": sorted({type(o).__name__ for o in outs}),
         "swizzled": [bool(o._with_gemm_swizzled_scales) for o in outs]}
    own, shared, empty_ok = True, True, True
    whole = x.float().abs().max().reshape(1)
    for part, out, q in zip(rows_of(x, sizes), outs, qs):
        if part.shape[0] == 0:
            empty_ok = empty_ok and out._rowwise_data.numel() == 0 and out._amax_rowwise.item() == 0
            continue
        single = quantizer(rht)(part)   # tex.quantize of the split alone
        own = own and same_tensor(out, single)
        ref = fp4.quantize(part, rht_sign_mask=MASK if rht else None)
        own = own and all(eq(compact(out, "_" + n), getattr(ref, n)) for n in (
            "rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"))
        own = own and eq(out._amax_columnwise, ref.amax_columnwise)
        # control: the same split cast with the whole tensor's amax (a shared group amax)
        sh = fp4.quantize(part, rowwise=True, columnwise=False, amax=whole)
        shared = shared and eq(out._rowwise_data, sh.rowwise_data) and eq(
            out._amax_rowwise, sh.amax_rowwise)
    r["own_amax"], r["control_shared_amax"], r["empty"] = own, shared, empty_ok
    if rht:
        # control: the columnwise copies without the transform
        part = rows_of(x, sizes)[0]
        plain = fp4.quantize(part)
        r["control_no_rht"] = eq(outs[0]._columnwise_data, plain.columnwise_data) and eq(
            compact(outs[0], "_columnwise_scale_inv"), plain.columnwise_scale_inv)
    sq[label] = r
# TE's own checks, and the unfused fallback for an inner dim that is not a multiple of 128
def refused(fn):
    try:
        fn(); return "accepted"
    except (RuntimeError, NotImplementedError) as exc:
        return str(exc)
xx = torch.randn(128, 256, generator=gen).bfloat16()
sq["split_not_64"] = refused(lambda: tex.split_quantize(xx, [48, 80], [quantizer(True)] * 2))
sq["two_d"] = refused(lambda: tex.split_quantize(
    xx, [64, 64], [quantizer(False, two_d=True)] * 2))
sq["nan"] = refused(lambda: tex.split_quantize(
    torch.full((128, 256), float("nan")).bfloat16(), [64, 64], [quantizer(False)] * 2))
x144 = torch.randn(48, 144, generator=gen).bfloat16()
o144 = tex.split_quantize(x144, [32, 16], [quantizer(False)] * 2)
sq["unfused_144"] = all(same_tensor(o, quantizer(False)(p))
                        for o, p in zip(o144, rows_of(x144, [32, 16])))
R["split_quantize"] = sq

# ---- 2. GroupedLinear == N Linear ----------------------------------------------------------------
SEEN = []
real_grouped = tex.te_general_grouped_gemm
def recording_grouped(A, transa, B, transb, *rest, **kw):
    SEEN.append(sorted({type(t).__name__ for t in (*A, *B)}))
    return real_grouped(A, transa, B, transb, *rest, **kw)

def run_grouped(gl, x, dy, sizes, recipe):
    xg = x.detach().clone().requires_grad_(True)
    with te.autocast(enabled=True, recipe=recipe):
        y = gl(xg, sizes)
    y.backward(dy)
    return (y.detach(), xg.grad.detach(),
            [getattr(gl, f"weight{i}").grad.detach() for i in range(len(sizes))])

def run_linears(lins, x, dy, sizes, recipe):
    ys, dxs, dws = [], [], []
    for lin, xi, dyi in zip(lins, rows_of(x, sizes), rows_of(dy, sizes)):
        if xi.shape[0] == 0:
            # an empty expert: TE's grouped GEMM writes zeros (no GEMM runs)
            ys.append(torch.zeros(0, dy.shape[1], dtype=dy.dtype))
            dxs.append(torch.zeros(0, x.shape[1], dtype=x.dtype))
            dws.append(torch.zeros_like(lin.weight))
            continue
        xi = xi.detach().clone().requires_grad_(True)
        with te.autocast(enabled=True, recipe=recipe):
            yi = lin(xi)
        yi.backward(dyi)
        ys.append(yi.detach()); dxs.append(xi.grad.detach()); dws.append(lin.weight.grad.detach())
    return torch.cat(ys), torch.cat(dxs), dws

def compare(got, ref):
    return [eq(got[0], ref[0]), eq(got[1], ref[1]), [eq(a, b) for a, b in zip(got[2], ref[2])]]

class Mutated:
    # the emulation's plain-torch cast with one thing changed: a shared amax or no RHT
    def __init__(self, what):
        self.what, self.whole = what, None
    def __getattr__(self, name):
        return getattr(fp4, name)
    def quantize(self, part, rowwise=True, columnwise=True, rht_sign_mask=None, **kw):
        if self.what == "no_rht":
            return fp4.quantize(part, rowwise=rowwise, columnwise=columnwise, **kw)
        d = fp4.quantize(part, rowwise=rowwise, columnwise=columnwise,
                         rht_sign_mask=rht_sign_mask, **kw)
        if rowwise:
            p = fp4.quantize(part, rowwise=True, columnwise=False, amax=self.whole)
            d.rowwise_data, d.rowwise_scale_inv = p.rowwise_data, p.rowwise_scale_inv
            d.amax_rowwise = p.amax_rowwise
        return d

real_split = G.split_quantize_nvfp4
def mutated_run(what, gl, x, dy, sizes, recipe):
    shim = Mutated(what)
    def split(tensor, *a, **kw):
        shim.whole = tensor.detach().float().abs().max().reshape(1)
        return real_split(tensor, *a, **kw)
    G._fp4, G.split_quantize_nvfp4 = shim, split
    try:
        return run_grouped(gl, x, dy, sizes, recipe)
    finally:
        G._fp4, G.split_quantize_nvfp4 = fp4, real_split

gm = {}
CASES = (("rht_64", False, [128, 64, 0, 192]), ("rht_aligned", False, [128, 0, 256, 128]),
         ("plain", True, [128, 64, 0, 192]))
for label, disable_rht, sizes in CASES:
    recipe = NVFP4BlockScaling(disable_rht=disable_rht, disable_stochastic_rounding=True)
    n, tokens = len(sizes), sum(sizes)
    torch.manual_seed(5)
    gl = te.GroupedLinear(n, 256, 128, bias=False, params_dtype=torch.bfloat16, device="cpu")
    lins = []
    for i in range(n):
        lin = te.Linear(256, 128, bias=False, params_dtype=torch.bfloat16, device="cpu")
        with torch.no_grad():
            lin.weight.copy_(getattr(gl, f"weight{i}"))
        lins.append(lin)
    x = torch.cat([torch.randn(s, 256, generator=gen) * (2.0 ** -i)
                   for i, s in enumerate(sizes)]).bfloat16()
    dy = (torch.randn(tokens, 128, generator=gen) * 0.01).bfloat16()
    SEEN.clear()
    tex.te_general_grouped_gemm = recording_grouped
    try:
        got = run_grouped(gl, x, dy, sizes, recipe)
    finally:
        tex.te_general_grouped_gemm = real_grouped
    ref = run_linears(lins, x, dy, sizes, recipe)
    r = {"gemms": list(SEEN), "equal": compare(got, ref),
         "finite": bool(torch.isfinite(got[0].float()).all())}
    # a second step (the weights re-cast after an update) stays equal
    with torch.no_grad():
        for i, lin in enumerate(lins):
            w = getattr(gl, f"weight{i}")
            w.sub_(0.01 * w.grad); w.grad = None
            lin.weight.copy_(w); lin.weight.grad = None
    r["step2"] = compare(run_grouped(gl, x, dy, sizes, recipe), run_linears(lins, x, dy, sizes,
                                                                              recipe))
    for i, lin in enumerate(lins):
        getattr(gl, f"weight{i}").grad = None; lin.weight.grad = None
    ref2 = run_linears(lins, x, dy, sizes, recipe)
    for i, lin in enumerate(lins):
        getattr(gl, f"weight{i}").grad = None; lin.weight.grad = None
    r["control_shared_amax"] = compare(mutated_run("shared", gl, x, dy, sizes, recipe), ref2)
    if not disable_rht:
        for i in range(n):
            getattr(gl, f"weight{i}").grad = None
        r["control_no_rht"] = compare(mutated_run("no_rht", gl, x, dy, sizes, recipe), ref2)
    gm[label] = r
R["grouped_linear"] = gm
print("RESULT " + json.dumps(R))
""", env=(NVFP4_NO_SR,)
)


@pytest.fixture(scope="module")
def te_results() -> dict:
    return run_te_script(TE_SCRIPT, timeout=900)


@needs_te
@pytest.mark.parametrize("case", ["plain", "rht_aligned", "rht_64"])
def test_split_quantize_nvfp4_is_the_cast_of_each_split(te_results, case):
    """``tex.split_quantize`` with NVFP4 quantizers: every split equals ``tex.quantize`` of that
    split alone and the plain-torch cast (its own amax, the RHT'd columnwise copy), in
    ``NVFP4TensorStorage``; scales swizzled only with the RHT when every split is a multiple of
    128 rows (TE's group-wide rule); an empty expert gets empty buffers. Controls: the split cast
    with the whole tensor's amax, and the columnwise copy without the RHT, differ."""
    assert te_results["backend"] == "emulated"
    r = te_results["split_quantize"][case]
    assert r["types"] == ["NVFP4TensorStorage"], r
    assert r["swizzled"] == [case == "rht_aligned"] * 4, r
    assert r["own_amax"] is True and r["empty"] is True, r
    assert r["control_shared_amax"] is False, r
    if case != "plain":
        assert r["control_no_rht"] is False, r


@needs_te
def test_split_quantize_nvfp4_checks_like_te(te_results):
    """TE's grouped NVFP4 kernels' own checks raise with TE's words (a split not a multiple of
    64 rows, 16x16 blocks); non-finite input on the grouped kernels is refused by name; an inner
    dim that is not a multiple of 128 takes TE's per-split fallback, the single-tensor cast."""
    sq = te_results["split_quantize"]
    assert "should be 64 multiple" in sq["split_not_64"], sq
    assert "does not support 2D quantization" in sq["two_d"], sq
    assert "is not emulated yet" in sq["nan"], sq
    assert sq["unfused_144"] is True


@needs_te
@pytest.mark.parametrize("case", ["rht_64", "rht_aligned", "plain"])
def test_grouped_linear_nvfp4_equals_linears(te_results, case):
    """TE's ``GroupedLinear`` (4 experts, uneven splits, one empty) under ``NVFP4BlockScaling``
    (SR off; the RHT on in both grouped RHT paths, and off) equals 4 TE ``Linear`` with the same
    weights on the splits, bitwise in output, dgrad and each expert's wgrad, over two steps; its
    grouped GEMMs took NVFP4 operands. Controls: the emulation mutated to one amax shared by the
    splits (output and dgrad diverge) and to a dropped RHT (wgrad diverges)."""
    r = te_results["grouped_linear"][case]
    assert r["gemms"] == [["NVFP4TensorStorage"]] * 3, r["gemms"]
    assert r["finite"] is True
    assert r["equal"] == [True, True, [True] * 4], r
    assert r["step2"] == [True, True, [True] * 4], r
    shared = r["control_shared_amax"]
    assert shared[0] is False and shared[1] is False, shared
    if case != "plain":
        no_rht = r["control_no_rht"]
        assert no_rht[0] is True and no_rht[1] is True, no_rht  # fprop / dgrad do not read it
        assert not all(no_rht[2]), no_rht


# ---- megatron's TEGroupedMLP (discrete expert weights) under layer-wise Muon --------------------


def _build_gpt_grouped_experts(config, grouped: bool):
    """``tests.support.scenarios.build_gpt`` with megatron's grouped experts (``TEGroupedMLP``:
    ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``, TE's ``GroupedLinear``
    with discrete weights ``weight0..weightN``, no op fuser) when ``grouped``."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    from tests.support.scenarios import GPT_SEQ, GPT_VOCAB

    spec = get_gpt_layer_with_transformer_engine_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=grouped
    )
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=GPT_VOCAB,
        max_sequence_length=GPT_SEQ, pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False, position_embedding_type="rope",
    )  # fmt: skip


def _sequential_build(config):
    return _build_gpt_grouped_experts(config, grouped=False)


def _copy_sequential_weights(reference, module) -> None:
    """Every parameter of ``module`` (grouped experts) from ``reference`` (SequentialMLP): the
    same names outside the experts; expert ``i``'s ``linear_fc{1,2}.weight`` to the grouped
    linear's ``weight{i}``."""
    import re

    import torch

    source = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in module.named_parameters():
            match = re.match(r"(.*\.experts)\.(linear_fc[12])\.weight(\d+)$", name)
            if match:
                prefix, fc, index = match.groups()
                name = f"{prefix}.local_experts.{index}.{fc}.weight"
            param.copy_(source[name])


def grouped_moe_run(
    layout: str, experts: str = "grouped", fp4: bool = True, shared_amax: bool = False
) -> dict:
    """``tests/mechanics/test_nvfp4_layer_wise.py``'s MoE run (2-layer TE-spec GPT, NVFP4 compute
    with SR off, layer-wise Muon in ``layout``, three steps and an eval) with the experts as
    megatron's ``TEGroupedMLP`` (``experts="grouped"``, starting from the weights the
    ``SequentialMLP`` model of the same seed has) or ``SequentialMLP`` of TE linears; also counts
    the grouped GEMMs and how many took NVFP4 operands. ``shared_amax``: the control's mutated
    cast."""
    import functools

    import transformer_engine_torch as tex

    import tests.mechanics.test_nvfp4_layer_wise as base
    from nemo_lw_fp8.cpu.te.tex import split_quantize_nvfp4 as grouped_cast
    from tests.support import scenarios

    grouped = experts == "grouped"
    seen: list[bool] = []
    real = tex.te_general_grouped_gemm

    def counting(A, transa, B, transb, *args, **kwargs):  # noqa: N803 - TE's names
        seen.append(all(type(t).__name__.startswith("NVFP4") for t in (*A, *B)))
        return real(A, transa, B, transb, *args, **kwargs)

    build, sequential_moe = base.build_nvfp4_gpt, base.MOE

    def build_with_sequential_weights(fp4_: bool, seed: int, moe: bool = False):
        # the grouped model with the weights the SequentialMLP model of this seed starts from
        with pytest.MonkeyPatch.context() as inner:
            inner.setattr(base, "MOE", sequential_moe)
            inner.setattr(scenarios, "build_gpt", _sequential_build)
            reference, _ = build(fp4_, seed, moe)
        module, config = build(fp4_, seed, moe)
        _copy_sequential_weights(reference, module)
        return module, config

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(base, "MOE", {**base.MOE, "moe_grouped_gemm": grouped})
        mp.setattr(
            scenarios, "build_gpt", functools.partial(_build_gpt_grouped_experts, grouped=grouped)
        )
        if grouped:
            mp.setattr(base, "build_nvfp4_gpt", build_with_sequential_weights)
        mp.setattr(tex, "te_general_grouped_gemm", counting)
        if shared_amax:
            shim, real_split = MutatedCast("shared_amax"), grouped_cast.split_quantize_nvfp4

            def split(tensor, *args, **kwargs):
                shim.whole = tensor.detach().float().abs().max().reshape(1)
                return real_split(tensor, *args, **kwargs)

            mp.setattr(grouped_cast, "_fp4", shim)
            mp.setattr(grouped_cast, "split_quantize_nvfp4", split)
        result = base.nvfp4_run(layout, fp4, moe=True)
    return {**result, "grouped_gemms": len(seen), "nvfp4_grouped_gemms": sum(seen)}


def _sequential_names(results: list[dict]) -> list[dict]:
    """Grouped-expert runs with their state keyed as the SequentialMLP model names it
    (``experts.linear_fc1.weight3`` -> ``experts.local_experts.3.linear_fc1.weight``)."""
    import re

    pattern = re.compile(r"\.experts\.(linear_fc[12])\.weight(\d+)")
    rename = lambda key: pattern.sub(r".experts.local_experts.\2.\1.weight", key)  # noqa: E731
    return [{**r, "state": {rename(k): v for k, v in r["state"].items()}} for r in results]


@pytest.mark.extended
@needs_te
def test_te_grouped_mlp_nvfp4_layer_wise_equals_sequential():
    """megatron's ``TEGroupedMLP`` (TE's ``GroupedLinear`` with discrete expert weights, no op
    fuser) under NVFP4 compute (RHT on, SR off) trains under layer-wise Muon, every grouped GEMM
    on NVFP4 operands: the plugin's compact layout equals megatron's layer-wise layout without
    overlap, and both equal the same model with ``SequentialMLP`` of TE linears from the same
    weights, bitwise in losses, eval losses, every master and Muon momentum (both pad each
    expert to 128 rows; TE's grouped cast keeps one amax per expert, so each expert's GEMMs
    are the Linear's). Control: the grouped cast mutated to one amax shared by the experts
    diverges from the SequentialMLP run."""
    from tests.mechanics.test_nvfp4_layer_wise import assert_same_run
    from tests.support.harness import BootOptions, run_on_ranks
    from tests.support.parity import assert_diverges

    boot = BootOptions(fp8_emulation=True)
    compact = run_on_ranks(grouped_moe_run, "compact", world_size=2, boot=boot)
    stock = run_on_ranks(grouped_moe_run, "stock", world_size=2, boot=boot)
    for r in compact + stock:
        assert r["nvfp4_grouped_gemms"] == r["grouped_gemms"] > 0, r["grouped_gemms"]
        assert r["nvfp4_gemms"] == r["gemms"] > 0
        assert all(math.isfinite(v) for v in r["losses"])
    assert_same_run(stock, compact)
    sequential = run_on_ranks(grouped_moe_run, "compact", "sequential", world_size=2, boot=boot)
    assert all(r["grouped_gemms"] == 0 for r in sequential)
    assert_same_run(sequential, _sequential_names(compact))
    shared = run_on_ranks(
        grouped_moe_run, "compact", "grouped", True, True, world_size=2, boot=boot
    )
    assert_diverges(sequential, _sequential_names(shared), assert_same_run)
