"""TE 2.20.2's own ``NVFP4Quantizer`` over the NVFP4 emulation, bitwise against the emulation
and the scalar reference (``tests.support.nvfp4_reference``): every buffer, in place, the 2D
columnwise copy, the random Hadamard transform on both of TE's paths; RHT, stochastic
rounding, row-scaled and 4over6 NVFP4 refused by name. TE runs in one subprocess: this process
never imports TE.
"""

from __future__ import annotations

import pytest
import torch

from nemo_lw_fp8.cpu.formats import nvfp4 as fp4
from tests.support.nvfp4_reference import (
    TE_SIGNS,
    compare_rht,
    ref_rht_t,
    ref_sign_mask,
    ref_sylvester,
)
from tests.support.te_test_support import blackwell_script, needs_te, run_te_script

# --------------------------------------------------------------------------------------------
# TE's NVFP4Quantizer over the emulation (in a subprocess: this process never imports TE)
# --------------------------------------------------------------------------------------------

TE_SCRIPT = blackwell_script(
    r"""
from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer, NVFP4Tensor
from transformer_engine.pytorch.tensor.storage.nvfp4_tensor_storage import NVFP4TensorStorage
from nemo_lw_fp8.cpu.formats import nvfp4 as fp4

NAMES = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv",
         "amax_rowwise", "amax_columnwise")

def same(t, ref):
    out = {}
    for n in NAMES:
        a, b = getattr(t, "_" + n), getattr(ref, n)
        both = a is not None and b is not None
        out[n] = (a is None and b is None) or (both and torch.equal(a, b))
    return out

gen = torch.Generator().manual_seed(5)
special = (torch.randn(32, 64, generator=gen) * 4).bfloat16()
special[0, 1], special[2, 30], special[5, 17] = float("nan"), float("inf"), -float("inf")
inputs = {
    "bf16": (torch.randn(32, 64, generator=gen) * 3).bfloat16(),
    "fp32": torch.randn(48, 32, generator=gen) * 100,
    "3d": (torch.randn(2, 16, 48, generator=gen)).bfloat16(),
    "special": special,
}
for name, x in inputs.items():
    for two_d in (False, True):
        for usage in ((True, True), (True, False), (False, True)):
            q = NVFP4Quantizer(rowwise=usage[0], columnwise=usage[1], with_2d_quantization=two_d)
            t = q(x)
            ref = fp4.quantize(x, rowwise=usage[0], columnwise=usage[1], two_d=two_d)
            R[f"{name}/{'2d' if two_d else '1d'}/{usage}"] = same(t, ref)
            if usage[0]:
                # bytes, as an infinite amax makes 0 * inf = NaN (in TE's kernel too)
                ours = fp4.dequantize(ref, x.dtype).view(torch.uint8)
                R[f"{name}/{'2d' if two_d else '1d'}/dequant"] = torch.equal(
                    t.dequantize().view(torch.uint8), ours)
    R[f"{name}/type"] = type(NVFP4Quantizer()(x)).__name__

# internal quantizer: the storage class
q = NVFP4Quantizer(); q.internal = True
R["internal_type"] = type(q(inputs["bf16"])).__name__

# control: the reference without the global scale differs from TE's bytes
x = inputs["bf16"]
t = NVFP4Quantizer()(x)
real = fp4.global_encode_scale
fp4.global_encode_scale = lambda amax: torch.tensor(1.0)
try:
    R["control_no_global_scale"] = same(t, fp4.quantize(x))
finally:
    fp4.global_encode_scale = real

# in place (update_quantized), make_empty, noop
q = NVFP4Quantizer()
e = q.make_empty((32, 64), dtype=torch.bfloat16, device="cpu")
R["empty_zero"] = all(not bool(getattr(e, "_" + n).any()) for n in NAMES)
keep = e._rowwise_data
e.quantize_(x)
R["inplace"] = same(e, fp4.quantize(x))
R["inplace_same_buffer"] = e._rowwise_data is keep
before = e._rowwise_data.clone()
e.quantize_(x * 2, noop_flag=torch.ones(1))
R["noop_kept"] = torch.equal(e._rowwise_data, before)

# 2D: columnwise made from rowwise (nvfp4_data_transpose, nvfp4_2d_scale_transpose)
q2 = NVFP4Quantizer(columnwise=False, with_2d_quantization=True)
t2 = q2(x)
t2.update_usage(rowwise_usage=True, columnwise_usage=True)
r2 = fp4.quantize(x, two_d=True)
R["create_columnwise_data"] = torch.equal(t2._columnwise_data, r2.columnwise_data)
R["create_columnwise_scales"] = torch.equal(
    t2._columnwise_scale_inv[:64, :2], r2.columnwise_scale_inv[:64, :2])
R["create_columnwise_amax"] = torch.equal(t2._amax_columnwise, r2.amax_columnwise)

# the random Hadamard transform (columnwise copy): TE's default signs, both paths' shapes
rht = {}
qr = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)
mask = qr.rht_matrix_random_sign_mask_t
rht["mask"] = mask
rht["matrix"] = qr.rht_matrix.float().tolist()
rht["matrix_dtype"] = str(qr.rht_matrix.dtype)
xr = inputs["bf16"]  # 32 x 64: rows not a multiple of 64, TE's unfused path
for usage in ((True, True), (True, False), (False, True)):
    q = NVFP4Quantizer(rowwise=usage[0], columnwise=usage[1], with_rht=True,
                       with_post_rht_amax=True)
    q.optimize_for_gemm = True  # compact all the same: not eligible for the fused cast
    t = q(xr)
    rht[f"unfused/{usage}"] = same(
        t, fp4.quantize(xr, rowwise=usage[0], columnwise=usage[1], rht_sign_mask=mask))
    rht[f"unfused/{usage}/swizzled"] = bool(t._with_gemm_swizzled_scales)
t = qr(xr)
rht["te_bytes"] = {n: getattr(t, "_" + n).tolist() for n in NAMES}
rht["x"] = xr.float().tolist()
rht["3d"] = same(qr(inputs["3d"]), fp4.quantize(inputs["3d"], rht_sign_mask=mask))
q0 = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, with_random_sign_mask=False)
rht["mask_without_signs"] = q0.rht_matrix_random_sign_mask_t
rht["no_signs"] = same(q0(xr), fp4.quantize(xr, rht_sign_mask=0))
rht["control_no_signs"] = same(t, fp4.quantize(xr, rht_sign_mask=0))
rht["control_plain_cast"] = same(t, fp4.quantize(xr))
# 64 x 128 with optimize_for_gemm: the fused cast's shape, both usages' scales swizzled
xf = (torch.randn(2, 32, 128, generator=gen) * 2).bfloat16()
qf = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)
qf.optimize_for_gemm = True
tf = qf(xf)
rf = fp4.quantize(xf, rht_sign_mask=mask)
rht["fused_swizzled"] = bool(tf._with_gemm_swizzled_scales)
rht["fused_data_amax"] = all(same(tf, rf)[n] for n in NAMES if "scale" not in n)
rht["fused_scales"] = (torch.equal(tf._rowwise_scale_inv, fp4.swizzle_scales(rf.rowwise_scale_inv))
                       and torch.equal(tf._columnwise_scale_inv,
                                       fp4.swizzle_scales(rf.columnwise_scale_inv)))
rht["fused_unswizzled_equal_compact"] = all(same(qr(xf), rf).values())
# in place, and an empty tensor of the RHT quantizer
e = qr.make_empty((32, 64), dtype=torch.bfloat16, device="cpu")
keep = e._columnwise_data
e.quantize_(xr)
rht["inplace"] = all(same(e, fp4.quantize(xr, rht_sign_mask=mask)).values())
rht["inplace_same_buffer"] = e._columnwise_data is keep
# what stays refused with the RHT on, by name (or by TE's own error)
def outcome(fn):
    try:
        fn()
        return "accepted"
    except (NotImplementedError, RuntimeError, ValueError) as exc:
        return type(exc).__name__ + ": " + str(exc)
nan_x = xr.clone(); nan_x[1, 2] = float("nan")
bad_matrix = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)
bad_matrix.rht_matrix = fp4.rht_matrix(0).bfloat16()
rht["refused"] = {
    "2d": outcome(lambda: NVFP4Quantizer(with_rht=True, with_post_rht_amax=True,
                                         with_2d_quantization=True)(xr)),
    "pre_rht_amax": outcome(lambda: NVFP4Quantizer(with_rht=True)(xr)),
    "fp32": outcome(lambda: qr(xr.float())),
    "nan": outcome(lambda: qr(nan_x)),
    "noop": outcome(lambda: e.quantize_(xr, noop_flag=torch.ones(1))),
    "matrix": outcome(lambda: bad_matrix(xr)),
    "sr": outcome(lambda: NVFP4Quantizer(with_rht=True, with_post_rht_amax=True,
                                         stochastic_rounding=True)(xr)),
}
R["rht"] = rht

# refusals: by name, before any byte
refused = {}
for label, kw in {
    "stochastic_rounding": dict(stochastic_rounding=True),
    "row_scaled": dict(row_scaled_nvfp4=True),
    "4over6": dict(nvfp4_use_4over6=True),
    "amax_reduction": dict(with_amax_reduction=True),
}.items():
    try:
        NVFP4Quantizer(**kw)(x)
        refused[label] = "accepted"
    except NotImplementedError as exc:
        refused[label] = "not emulated yet" in str(exc)
try:
    NVFP4Quantizer()(torch.ones(20, 32)); refused["odd_shape"] = "accepted"
except ValueError as exc:
    refused["odd_shape"] = "divisible by 16" in str(exc)
import transformer_engine_torch as tex
try:
    # split_quantize takes NVFP4 now (test_nvfp4_grouped.py); SwiGLU's NVFP4 output does not
    tex.swiglu(x, NVFP4Quantizer())
    refused["swiglu"] = "accepted"
except NotImplementedError as exc:
    refused["swiglu"] = "not emulated yet" in str(exc)
t = NVFP4Quantizer(rowwise=False)(x)
try:
    t.dequantize(); refused["columnwise_dequant"] = "accepted"
except NotImplementedError:
    refused["columnwise_dequant"] = True
R["refused"] = refused
print("RESULT " + json.dumps(R))
"""
)


@pytest.fixture(scope="module")
def te_results() -> dict:
    return run_te_script(TE_SCRIPT)


@needs_te
def test_te_quantizer_bytes_equal_reference(te_results):
    """``NVFP4Quantizer(...)(x)`` over the emulation: every buffer equals :mod:`nvfp4`'s bytes
    (bf16, fp32, 3-D and NaN/inf inputs; 1x16 and 16x16 blocks; each usage), and
    ``dequantize()`` equals the reference dequantize."""
    r = te_results
    assert r["backend"] == "emulated"
    parity = {k: v for k, v in r.items() if k.count("/") == 2}
    assert len(parity) == 4 * 2 * 4
    bad = {k: v for k, v in parity.items() if v is False or (v is not True and not all(v.values()))}
    assert not bad, bad
    assert {r[f"{n}/type"] for n in ("bf16", "fp32", "3d", "special")} == {"NVFP4Tensor"}
    assert r["internal_type"] == "NVFP4TensorStorage"


@needs_te
def test_te_quantizer_control_diverges(te_results):
    """Control: the reference without the global scale differs from TE's bytes in data and
    scales (amaxes, which do not depend on it, still agree)."""
    c = te_results["control_no_global_scale"]
    assert not c["rowwise_scale_inv"] and not c["columnwise_scale_inv"], c
    assert c["amax_rowwise"] and c["amax_columnwise"], c


@needs_te
def test_te_quantizer_inplace_empty_noop_and_2d_columnwise(te_results):
    r = te_results
    assert r["empty_zero"]
    assert all(r["inplace"].values()), r["inplace"]
    assert r["inplace_same_buffer"] and r["noop_kept"]
    assert r["create_columnwise_data"] and r["create_columnwise_scales"]
    assert r["create_columnwise_amax"]


@needs_te
def test_te_quantizer_refuses_what_is_not_emulated(te_results):
    """By name, never with other bytes: stochastic rounding, row-scaled and 4over6 NVFP4,
    amax reduction, NVFP4 outputs of the TE-module kernels not compared (SwiGLU), odd
    shapes (TE's own check) and columnwise-only dequantize (TE's own refusal)."""
    assert te_results["refused"] == {
        "stochastic_rounding": True,
        "row_scaled": True,
        "4over6": True,
        "amax_reduction": True,
        "odd_shape": True,
        "swiglu": True,
        "columnwise_dequant": True,
    }


@needs_te
def test_te_quantizer_rht_bytes_equal_scalar_reference(te_results):
    """``NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)`` (TE's default sign mask) over
    the emulation: TE's own sign mask and bf16 matrix are the test's (Sylvester, TE's signs),
    and its bytes equal the scalar reference (the rowwise copy plain, the columnwise copy from
    the bf16 RHT of ``x^T`` with its own amax). Control: the same reference without the signs
    differs."""
    r = te_results["rht"]
    assert r["mask"] == ref_sign_mask(TE_SIGNS) and r["mask_without_signs"] == 0
    h = ref_sylvester(16)
    assert r["matrix_dtype"] == "torch.bfloat16"
    assert r["matrix"] == [[TE_SIGNS[k] * h[k][n] / 4 for n in range(16)] for k in range(16)]
    b = r["te_bytes"]
    x = torch.tensor(r["x"])
    data = fp4.NVFP4Data(
        tuple(x.shape),
        *(
            torch.tensor(b[n], dtype=torch.float32 if n.startswith("amax") else torch.uint8)
            for n in (
                "rowwise_data",
                "rowwise_scale_inv",
                "columnwise_data",
                "columnwise_scale_inv",
                "amax_rowwise",
                "amax_columnwise",
            )
        ),
    )
    res = compare_rht(data, x, ref_rht_t(x, TE_SIGNS))
    assert all(res.values()), res
    control = compare_rht(data, x, ref_rht_t(x, [1] * 16))
    assert not control["col_data"] and not control["amax_columnwise"], control
    assert control["row_data"] and control["amax_rowwise"]  # the rowwise copy has no RHT


@needs_te
def test_te_quantizer_rht_paths_inplace_and_swizzle(te_results):
    """Each usage (unfused shape: compact scales even with ``optimize_for_gemm``), a 3-D input,
    no random signs, in place; on the fused cast's shape (rows % 64, cols % 128, SM 10.0) with
    ``optimize_for_gemm`` both usages' scales are the compact ones swizzled, data and amaxes
    unchanged. Controls: the reference without signs, and the plain cast, differ."""
    r = te_results["rht"]
    for usage in ("(True, True)", "(True, False)", "(False, True)"):
        assert all(r[f"unfused/{usage}"].values()), (usage, r[f"unfused/{usage}"])
        assert r[f"unfused/{usage}/swizzled"] is False
    assert all(r["3d"].values()) and all(r["no_signs"].values())
    assert r["inplace"] and r["inplace_same_buffer"]
    assert r["fused_swizzled"] and r["fused_data_amax"] and r["fused_scales"]
    assert r["fused_unswizzled_equal_compact"]
    for control in ("control_no_signs", "control_plain_cast"):
        c = r[control]
        assert not c["columnwise_data"] and not c["amax_columnwise"], (control, c)
        assert c["rowwise_data"] and c["amax_rowwise"], (control, c)


@needs_te
def test_te_quantizer_rht_refusals(te_results):
    """With the RHT on: what TE refuses too (pre-RHT amax, non-bf16 input) and, by name, what is not
    emulated (16x16 blocks, non-finite input, a set noop flag, an ``rht_matrix`` that is not
    its sign mask's, stochastic rounding)."""
    ref = te_results["rht"]["refused"]
    assert ref["pre_rht_amax"].startswith("RuntimeError: NVFP4 RHT cast with the amax taken "
                                          "before the transform"), ref  # fmt: skip
    assert ref["fp32"].startswith("RuntimeError: NVFP4 RHT cast: TE's transform takes bf16"), ref
    for key, words in {
        "2d": "16x16 blocks",
        "nan": "non-finite input",
        "noop": "noop flag",
        "matrix": "rht_matrix",
        "sr": "stochastic rounding",
    }.items():
        assert ref[key].startswith("NotImplementedError") and words in ref[key], (key, ref)
        assert "not emulated yet" in ref[key]
