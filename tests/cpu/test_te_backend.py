"""TE 2.20.2's own MXFP8 classes over the CPU emulation (and, on Blackwell, against TE's kernels).

The backend is activated in a subprocess so this process's imports stay clean (no TE, no
megatron flags fixed). Where TE lives comes from this interpreter's ``sys.path`` (an installed
``transformer_engine``) or from ``NEMO_LW_FP8_TE_PATH`` (extra ``os.pathsep``-separated
directories, e.g. a ``pip install --target`` folder), or ``<venv>/te-emulation`` where
``make env`` puts it. The tests skip only when none has TE's Python package (``make test``
refuses to run at all then).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from nemo_lw_fp8.cpu.te import backend as te_backend
from tests.support.te_test_support import (
    needs_te,
    real_te_gpu_skip_reason,
    run_te_script,
    te_script_results,
)

MAIN_SCRIPT = r"""
import os, sys, json, pickle, io, random, threading
os.environ.pop("NVTE_PROJECT_BUILDING", None)
from nemo_lw_fp8.cpu.te import activate, active_backend, backend as te_backend, is_emulated
R = {}
R["before"] = active_backend()
R["backend"] = activate()
R["again"] = activate()
R["active"] = active_backend()
R["is_emulated"] = is_emulated()
R["env_restored"] = "NVTE_PROJECT_BUILDING" not in os.environ

import torch
import transformer_engine
import transformer_engine.pytorch as te
import transformer_engine_torch as tex
from transformer_engine.common.recipe import MXFP8BlockScaling
from transformer_engine.pytorch import MXFP8Quantizer, MXFP8Tensor
from transformer_engine.pytorch.tensor.storage.mxfp8_tensor_storage import MXFP8TensorStorage
from transformer_engine.pytorch.tensor.utils import (
    cast_master_weights_to_fp8, post_all_gather_processing, quantize_master_weights)
from nemo_lw_fp8.cpu.formats import mxfp8 as mx
from nemo_lw_fp8.cpu.layers.mxfp8_linear import MXFP8Linear, quantize_dequantize
R["te_version"] = transformer_engine.__version__
R["dtype_members"] = {m.name: int(m) for m in tex.DType}

# --- megatron sees TE's MXFP8Tensor
import megatron.core
from megatron.core import fp8_utils
R["megatron_flags"] = [fp8_utils.HAVE_TE, fp8_utils.HAVE_TE_MXFP8TENSOR]

# --- parameter under quantized_model_init(preserve_high_precision_init_val=True)
torch.manual_seed(1234)
reference = MXFP8Linear(96, 64, fp8_params=False)
torch.manual_seed(1234)
with te.quantized_model_init(enabled=True, recipe=MXFP8BlockScaling(),
                             preserve_high_precision_init_val=True):
    layer = MXFP8Linear(96, 64)
w = layer.weight
R["param_type"] = type(w).__name__
R["is_parameter"] = isinstance(w, torch.nn.Parameter)
R["is_mxfp8tensor"] = fp8_utils.is_mxfp8tensor(w)
init = w.get_high_precision_init_val()
R["init_val_exact"] = init is not None and torch.equal(init, reference.weight.detach())
R["init_val_cpu_bf16"] = [str(init.device), str(init.dtype)]
R["has_both_directions"] = [w._rowwise_data is not None, w._columnwise_data is not None]
R["weight_dequant_is_qdq"] = torch.equal(w.dequantize(), quantize_dequantize(init))
w.clear_high_precision_init_val()
R["init_val_cleared"] = w.get_high_precision_init_val() is None

# --- TE's quantize bytes == the emulation's bytes, for every quantizer setting
mismatch = []
torch.manual_seed(0)
for shape in [(64, 96), (2, 48, 160), (256, 128)]:
    x = (torch.randn(shape) * 10).bfloat16()
    x.view(-1)[7] = float("nan")
    for fmt, te_fmt in [(torch.float8_e4m3fn, tex.DType.kFloat8E4M3),
                        (torch.float8_e5m2, tex.DType.kFloat8E5M2)]:
        for two_d in (False, True):
            for swizzle in (False, True):
                for usage in ((True, True), (True, False), (False, True)):
                    q = MXFP8Quantizer(te_fmt, rowwise=usage[0], columnwise=usage[1],
                                       with_2d_quantization=two_d)
                    q.optimize_for_gemm = swizzle
                    t = q(x)
                    ref = mx.quantize(x, fmt, rowwise=usage[0], columnwise=usage[1],
                                      two_d=two_d, swizzle=swizzle)
                    key = (shape, str(fmt), two_d, swizzle, usage)
                    for name in ("rowwise_data", "rowwise_scale_inv",
                                 "columnwise_data", "columnwise_scale_inv"):
                        a, b = getattr(t, "_" + name), getattr(ref, name)
                        if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                            mismatch.append(str(key) + name)
                    if t._with_gemm_swizzled_scales != swizzle or not isinstance(t, MXFP8Tensor):
                        mismatch.append(str(key) + "flags")
                    got, want = t.dequantize(), mx.dequantize(ref, torch.bfloat16)
                    if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                        mismatch.append(str(key) + "dequantize")
R["quantize_mismatches"] = mismatch

# internal quantizer -> storage class; fp32/fp16 inputs; in-place paths
q = MXFP8Quantizer(tex.DType.kFloat8E4M3)
q.internal = True
s = q(torch.randn(64, 64))
R["internal_type"] = type(s).__name__
x = torch.randn(64, 64, dtype=torch.bfloat16)
y = torch.randn(64, 64, dtype=torch.bfloat16)
t = MXFP8Quantizer(tex.DType.kFloat8E4M3)(x)
keep = t._rowwise_data
t.quantize_(y)
R["quantize_inplace"] = torch.equal(t._rowwise_data, mx.quantize(y).rowwise_data) and (
    t._rowwise_data.data_ptr() == keep.data_ptr())
t2 = MXFP8Quantizer(tex.DType.kFloat8E4M3)(x)
t2.copy_(t)
R["copy_bytes"] = torch.equal(t2._columnwise_data, t._columnwise_data)
t2.copy_(x)
R["copy_from_plain"] = torch.equal(t2._rowwise_data, mx.quantize(x).rowwise_data)
buf = io.BytesIO(); torch.save(t, buf); buf.seek(0)
t3 = torch.load(buf, weights_only=False)
R["pickle"] = type(t3).__name__ == "MXFP8Tensor" and torch.equal(t3.dequantize(), t.dequantize())
t.update_usage(rowwise_usage=False)
col_ref = mx.dequantize(mx.quantize(y), use="columnwise")
R["dequant_columnwise"] = torch.equal(t.dequantize(), col_ref)
noop = torch.ones(1)
t4 = MXFP8Quantizer(tex.DType.kFloat8E4M3)(x)
before = t4._rowwise_data.clone()
tex.quantize(y, t4._quantizer, t4, noop)
R["noop_flag"] = torch.equal(t4._rowwise_data, before)

# --- FP8 linear: identical outputs and gradients in both modes
torch.manual_seed(7)
hp = MXFP8Linear(96, 64, fp8_params=False)
with te.quantized_model_init(enabled=True, recipe=MXFP8BlockScaling()):
    f8 = MXFP8Linear(96, 64)
with torch.no_grad():
    f8.weight.copy_(hp.weight)   # quantises the same bf16 values
    f8.bias.copy_(hp.bias)
xs = torch.randn(2, 16, 96, dtype=torch.bfloat16)
x1 = xs.clone().requires_grad_(True); x2 = xs.clone().requires_grad_(True)
y1, y2 = hp(x1), f8(x2)
R["linear_identical"] = torch.equal(y1, y2)
y1.float().square().sum().backward(); y2.float().square().sum().backward()
R["linear_grads_identical"] = [torch.equal(x1.grad, x2.grad),
                               torch.equal(hp.weight.grad, f8.weight.grad),
                               torch.equal(hp.bias.grad, f8.bias.grad)]
R["linear_weight_grad"] = [type(f8.weight.grad).__name__, str(f8.weight.grad.dtype)]
ref = (quantize_dequantize(xs).float() @ quantize_dequantize(hp.weight.detach()).float().t()
       + hp.bias.float()).bfloat16()
R["linear_matches_formula"] = torch.equal(y1, ref)
# control: the same persistent weight, but its columnwise copy (dgrad's operand) left as it
# was before the copy of hp's weight: the forward (rowwise) still equals, the input grad not
with te.quantized_model_init(enabled=True, recipe=MXFP8BlockScaling()):
    stale = MXFP8Linear(96, 64)
old_columnwise = stale.weight._columnwise_data.clone()
with torch.no_grad():
    stale.weight.copy_(hp.weight)
    stale.bias.copy_(hp.bias)
R["stale_copy_was_refreshed"] = not torch.equal(stale.weight._columnwise_data, old_columnwise)
stale.weight._columnwise_data.copy_(old_columnwise)
x3 = xs.clone().requires_grad_(True)
y3 = stale(x3)
R["stale_linear_identical"] = torch.equal(y1, y3)
y3.float().square().sum().backward()
R["stale_linear_grads_identical"] = [torch.equal(x1.grad, x3.grad),
                                     torch.equal(hp.weight.grad, stale.weight.grad),
                                     torch.equal(hp.bias.grad, stale.bias.grad)]

# --- TE's quantize_master_weights with simulated ranks (threads + MAX all-reduce)
from tests.support.te_test_support import RepeatedMaxAllReduce as ThreadedMaxAllReduce

dist_ok = []
rng = random.Random(5)
for world, api in ((2, quantize_master_weights), (4, cast_master_weights_to_fp8),
                   (4, quantize_master_weights)):
    shapes = [(96, 160), (64, 64)]
    masters = [torch.randn(s) * 3 for s in shapes]
    full = [mx.quantize(m.bfloat16()) for m in masters]
    torch.distributed.all_reduce = ThreadedMaxAllReduce(world)
    models = [[MXFP8Quantizer(tex.DType.kFloat8E4M3)(torch.zeros(s, dtype=torch.bfloat16))
               for s in shapes] for _ in range(world)]
    cuts = []
    for m in masters:
        inner = sorted(rng.randrange(m.numel() + 1) for _ in range(world - 1))
        cuts.append([0, *inner, m.numel()])
    errors = []
    def rank(r):
        try:
            shards, offsets = [], []
            for i, m in enumerate(masters):
                a, b = cuts[i][r], cuts[i][r + 1]
                shards.append(m.reshape(-1)[a:b] if b > a else None)
                offsets.append(a)
            api(models[r], shards, offsets, group=None)
            post_all_gather_processing(models[r])
        except BaseException as exc:
            errors.append(repr(exc)); raise
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    [t.start() for t in threads]; [t.join() for t in threads]
    ok = not errors
    for i in range(len(shapes)):
        row = torch.cat([models[r][i]._rowwise_data.reshape(-1)[cuts[i][r]:cuts[i][r + 1]]
                         for r in range(world)])
        col = torch.cat([models[r][i]._columnwise_data.reshape(-1)[cuts[i][r]:cuts[i][r + 1]]
                         for r in range(world)])
        ok &= torch.equal(row, full[i].rowwise_data.reshape(-1))
        ok &= torch.equal(col, full[i].columnwise_data.reshape(-1))
        for r in range(world):
            ok &= torch.equal(models[r][i]._rowwise_scale_inv, full[i].rowwise_scale_inv)
            ok &= torch.equal(models[r][i]._columnwise_scale_inv, full[i].columnwise_scale_inv)
    dist_ok.append([world, api.__name__, bool(ok), errors])
R["distributed"] = dist_ok

# --- strict dummies and absent names
try:
    tex.dbias_dgelu(None)
    R["dummy"] = "no error"
except NotImplementedError as exc:
    R["dummy"] = str(exc)
try:
    tex.CommOverlap()
    R["dummy_class"] = "no error"
except NotImplementedError as exc:
    R["dummy_class"] = str(exc)
R["hasattr_unknown"] = hasattr(tex, "fused_attn_fwd")
try:
    MXFP8Quantizer(tex.DType.kFloat8E4M3)(torch.zeros(48, 32, dtype=torch.bfloat16))
    R["bad_shape"] = "no error"
except ValueError as exc:
    R["bad_shape"] = str(exc)
print("RESULT " + json.dumps(R))
"""


@pytest.fixture(scope="module")
def backend_results() -> dict:
    return te_script_results(MAIN_SCRIPT)


@needs_te
def test_activate_emulates_pinned_te(backend_results):
    r = backend_results
    assert r["before"] is None
    assert r["backend"] == r["again"] == r["active"] == "emulated"
    assert r["is_emulated"] is True
    assert r["env_restored"], "NVTE_PROJECT_BUILDING must not leak out of activate()"
    assert r["te_version"] == te_backend.pinned_te_version == "2.20.2"
    assert r["dtype_members"] == {
        "kByte": 0, "kInt32": 2, "kFloat32": 4, "kFloat16": 5, "kBFloat16": 6,
        "kFloat8E4M3": 7, "kFloat8E5M2": 8, "kFloat4E2M1": 10,
    }  # fmt: skip
    assert r["megatron_flags"] == [True, True]


@needs_te
def test_quantized_model_init_parameter(backend_results):
    r = backend_results
    assert r["param_type"] == "MXFP8Tensor" and r["is_parameter"]
    assert r["is_mxfp8tensor"], "megatron.core.fp8_utils.is_mxfp8tensor must see the parameter"
    assert r["init_val_exact"], "get_high_precision_init_val() must be the pre-quantisation value"
    assert r["init_val_cpu_bf16"] == ["cpu", "torch.bfloat16"]
    assert r["has_both_directions"] == [True, True]
    assert r["weight_dequant_is_qdq"]
    assert r["init_val_cleared"]


@needs_te
def test_te_quantize_bytes_equal_emulation(backend_results):
    r = backend_results
    assert r["quantize_mismatches"] == []
    assert r["internal_type"] == "MXFP8TensorStorage"
    assert r["quantize_inplace"] and r["copy_bytes"] and r["copy_from_plain"]
    assert r["pickle"] and r["dequant_columnwise"] and r["noop_flag"]
    assert "multiples of 32" in r["bad_shape"] and "(48, 32)" in r["bad_shape"]


@needs_te
def test_fp8_linear_identical_in_both_modes(backend_results):
    r = backend_results
    assert r["linear_identical"]
    assert r["linear_grads_identical"] == [True, True, True]
    assert r["linear_weight_grad"] == ["Tensor", "torch.bfloat16"]
    assert r["linear_matches_formula"]


@needs_te
def test_control_fp8_linear_with_a_stale_columnwise_weight_differs(backend_results):
    """Control of ``test_fp8_linear_identical_in_both_modes``: a persistent MXFP8 weight whose
    columnwise copy (the dgrad GEMM's operand) is left stale after the weight copy gives the
    same forward output (rowwise) but fails the same gradient comparison in the input
    gradient; the weight and bias gradients do not read the weight."""
    r = backend_results
    assert r["stale_copy_was_refreshed"], "the copy itself rewrites the columnwise bytes"
    assert r["stale_linear_identical"]
    assert r["stale_linear_grads_identical"] == [False, True, True]


@needs_te
def test_te_quantize_master_weights_shards(backend_results):
    for world, api, ok, errors in backend_results["distributed"]:
        assert ok and not errors, (world, api, errors)


@needs_te
def test_strict_dummies(backend_results):
    r = backend_results
    assert "transformer_engine_torch.dbias_dgelu" in r["dummy"]
    assert "transformer_engine_torch.CommOverlap" in r["dummy_class"]
    assert r["hasattr_unknown"] is False


@needs_te
def test_megatron_imported_first_is_refused():
    script = r"""
    import json, sys
    import nemo_lw_fp8  # its NVRx shim must precede megatron (nemo_lw_fp8/compat.py)
    sys.modules["transformer_engine"] = None  # TE unimportable while megatron-core loads
    import megatron.core.fp8_utils as fu
    assert fu.HAVE_TE is False
    del sys.modules["transformer_engine"]
    from nemo_lw_fp8.cpu.te import backend as te_backend
    try:
        te_backend.activate()
        out = "no error"
    except te_backend.TEBackendError as exc:
        out = str(exc)
    te_loaded = any(name.startswith("transformer_engine") for name in sys.modules)
    print("RESULT " + json.dumps({"error": out, "te_imported": te_loaded}))
    """
    r = run_te_script(script)
    assert "megatron.core.fp8_utils.HAVE_TE" in r["error"] and "before" in r["error"]
    assert r["te_imported"] is False


def test_missing_te_is_a_clear_error(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformer_engine" else real_find_spec(name, *a),
    )
    monkeypatch.delitem(sys.modules, "transformer_engine.pytorch", raising=False)
    with pytest.raises(te_backend.TEBackendError, match="not installed"):
        te_backend.activate()


def test_other_te_version_is_refused(monkeypatch):
    if "transformer_engine.pytorch" in sys.modules:
        pytest.skip("TE is already imported in this process")
    monkeypatch.setattr(te_backend, "installed_te_version", lambda: "2.19.1")
    monkeypatch.setattr(te_backend, "_real_te_possible", lambda: False)
    monkeypatch.setattr(te_backend, "_check_megatron_order", lambda: None)
    before = set(sys.modules)
    path_before = list(sys.path)
    with pytest.raises(te_backend.TEBackendError, match=r"2\.19\.1.*exactly 2\.20\.2"):
        te_backend.activate()
    assert not any(name.startswith("transformer_engine") for name in set(sys.modules) - before)
    # The side folder holding TE's package is off the import path again after a failure.
    assert sys.path == path_before


def test_working_te_is_never_shadowed(monkeypatch):
    """An already-imported TE with its real extension is left alone."""
    assert _activate_over_an_imported_te(monkeypatch) == (
        "transformer_engine",
        "transformer_engine",
        False,
        "TE's Python untouched",
    )


def _activate_over_an_imported_te(monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, bool, str]:
    """``activate()`` with a TE whose extension is not the emulation already imported (stand-in
    modules; this process never imports TE): what it returns, ``active_backend()``,
    ``is_emulated()``, and whether it patched TE's Python (recorded, not done)."""
    import types

    fake_ext = types.ModuleType("transformer_engine_torch")
    monkeypatch.setitem(sys.modules, "transformer_engine_torch", fake_ext)
    monkeypatch.setitem(
        sys.modules, "transformer_engine.pytorch", types.ModuleType("transformer_engine.pytorch")
    )
    patched: list[bool] = []
    monkeypatch.setattr(te_backend, "_patch_te_python", lambda: patched.append(True))
    answer = te_backend.activate()
    assert sys.modules["transformer_engine_torch"] is fake_ext
    touched = "TE's Python patched" if patched else "TE's Python untouched"
    return answer, te_backend.active_backend(), te_backend.is_emulated(), touched


def test_control_te_taken_for_the_emulation_is_shadowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control of ``test_working_te_is_never_shadowed``: a detector that takes every loaded
    extension for the emulation makes ``activate()`` answer "emulated" over the real TE and
    patch TE's Python, which the same check catches."""
    monkeypatch.setattr(te_backend, "_emulated_extension_loaded", lambda: True)
    assert _activate_over_an_imported_te(monkeypatch) == (
        "emulated",
        "emulated",
        True,
        "TE's Python patched",
    )


# --------------------------------------------------------------------------------------------
# Blackwell: the emulation against TE's real kernels
# --------------------------------------------------------------------------------------------


def _blackwell_te_reason() -> str | None:
    return real_te_gpu_skip_reason(
        lambda major, minor: major == 10, "TE's MXFP8 kernels need compute capability 10.x"
    )


@pytest.mark.gpu
def test_emulation_matches_te_kernels_on_blackwell():
    reason = _blackwell_te_reason()
    if reason is not None:
        pytest.skip(reason)
    assert te_backend.activate() == "transformer_engine"
    import torch
    import transformer_engine_torch as tex
    from transformer_engine.pytorch import MXFP8Quantizer
    from transformer_engine.pytorch.optimizers.multi_tensor_apply import multi_tensor_applier

    from nemo_lw_fp8.cpu.formats import mxfp8 as mx
    from nemo_lw_fp8.cpu.formats import mxfp8_layout as mxf
    from nemo_lw_fp8.cpu.formats import mxfp8_sharded_cast as mxs

    torch.manual_seed(0)
    cases = []
    for shape in [(128, 256), (96, 160), (2, 64, 544), (4096, 1024)]:
        x = (torch.randn(shape) * torch.exp2(torch.randint(-20, 20, shape).float())).bfloat16()
        cases.append(x)
    special = torch.randn(64, 128).bfloat16()
    special[0, :32] = float("nan")
    special[1, 3] = float("inf")
    special[2, :32] = 0.0
    special[3, :4] = torch.tensor([2.0**-127, -(2.0**-130), 2.0**-133, 2.0**-110])
    special[4, 9] = float("nan")
    cases.append(special)
    cases.append(torch.randn(64, 128, dtype=torch.float32) * 1e3)
    cases.append(torch.randn(64, 128, dtype=torch.float16))
    failures = []
    for x in cases:
        rows, cols = mxf.flat_2d_shape(x.shape)
        for fmt, te_fmt in [
            (torch.float8_e4m3fn, tex.DType.kFloat8E4M3),
            (torch.float8_e5m2, tex.DType.kFloat8E5M2),
        ]:
            for two_d in (False, True):
                for swizzle in (False, True):
                    q = MXFP8Quantizer(te_fmt, with_2d_quantization=two_d)
                    q.optimize_for_gemm = swizzle
                    t = q(x.cuda())
                    ref = mx.quantize(x, fmt, two_d=two_d, swizzle=swizzle)
                    key = f"{tuple(x.shape)} {x.dtype} {fmt} 2d={two_d} swz={swizzle}"
                    for name in ("rowwise_data", "columnwise_data"):
                        if not torch.equal(getattr(t, "_" + name).cpu(), getattr(ref, name)):
                            failures.append(f"{key} {name}")
                    got_r, got_c = t._rowwise_scale_inv.cpu(), t._columnwise_scale_inv.cpu()
                    if swizzle:
                        got_r = mxf.unswizzle_scales(got_r, columnwise=False)
                        got_c = mxf.unswizzle_scales(got_c, columnwise=True)
                        want_r = mxf.unswizzle_scales(ref.rowwise_scale_inv, columnwise=False)
                        want_c = mxf.unswizzle_scales(ref.columnwise_scale_inv, columnwise=True)
                    else:
                        want_r, want_c = ref.rowwise_scale_inv, ref.columnwise_scale_inv
                    # compact padding is uninitialised on the GPU: compare the valid region
                    if not torch.equal(got_r[:rows, : cols // 32], want_r[:rows, : cols // 32]):
                        failures.append(f"{key} rowwise_scale_inv")
                    if not torch.equal(got_c[: rows // 32, :cols], want_c[: rows // 32, :cols]):
                        failures.append(f"{key} columnwise_scale_inv")
                    if not swizzle:
                        deq = t.dequantize(dtype=torch.float32).cpu()
                        want = mx.dequantize(ref, torch.float32)
                        if not torch.equal(deq.nan_to_num(), want.nan_to_num()):
                            failures.append(f"{key} dequantize")

    # distributed-optimizer kernels
    shape, start, n = (96, 160), 1234, 5000
    full = torch.randn(shape).bfloat16()
    shard = full.reshape(-1)[start : start + n].contiguous()
    amax_r = torch.zeros(mxf.rowwise_scale_shape(shape), dtype=torch.bfloat16, device="cuda")
    amax_c = torch.zeros(mxf.columnwise_scale_shape(shape), dtype=torch.bfloat16, device="cuda")
    tex.mxfp8_scaling_compute_partial_amax(shard.cuda(), amax_r, amax_c, *shape, start)
    ref_r, ref_c = mxs.compute_partial_amax(shard, shape, start)
    if not (torch.equal(amax_r.cpu(), ref_r) and torch.equal(amax_c.cpu(), ref_c)):
        failures.append("partial amax")
    scale_r = torch.empty_like(amax_r, dtype=torch.uint8)
    scale_c = torch.empty_like(amax_c, dtype=torch.uint8)
    multi_tensor_applier(
        tex.multi_tensor_compute_scale_inv_e8m0, None, [[amax_r, amax_c], [scale_r, scale_c]]
    )
    if not (
        torch.equal(scale_r.cpu(), mxf.e8m0_from_amax(ref_r))
        and torch.equal(scale_c.cpu(), mxf.e8m0_from_amax(ref_c))
    ):
        failures.append("compute_scale_inv_e8m0")
    out_r = torch.empty(n, dtype=torch.uint8, device="cuda")
    out_c = torch.empty(n, dtype=torch.uint8, device="cuda")
    tex.mxfp8_scaling_partial_cast(shard.cuda(), out_r, out_c, scale_r, scale_c, *shape, start)
    want_r, want_c = mxs.partial_cast(shard, scale_r.cpu(), scale_c.cpu(), shape, start)
    if not (torch.equal(out_r.cpu(), want_r) and torch.equal(out_c.cpu(), want_c)):
        failures.append("partial cast")
    assert failures == []
