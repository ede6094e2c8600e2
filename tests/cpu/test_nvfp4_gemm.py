"""NVFP4 on CPU (issue 30, second slice): GEMM-swizzled scales, ``tex.generic_gemm`` on NVFP4
operands, and TE 2.20.2's ``Linear`` training under ``NVFP4BlockScaling`` with the random
Hadamard transform and stochastic rounding off, and with the RHT on (SR off).

Everything TE runs in one subprocess (this process never imports TE). The references are built
in the script from the plain-torch cast (:mod:`nemo_lw_fp8.cpu.formats.nvfp4`, itself checked
against a scalar reference in ``test_nvfp4_cast.py``) and code written here: the swizzled
byte position of each compact scale from cuBLAS's layout formula, E2M1 nibbles decoded through
a table of their values, E4M3 bytes through torch's ``float8_e4m3fn``, the GEMM alpha from the
two amaxes. Each parity has a control that must diverge (compact read of swizzled scales, the
other usage, no global scale).
"""

from __future__ import annotations

import pytest

from nemo_lw_fp8.vocabulary import NVFP4_NO_SR_ENV as NVFP4_NO_SR
from tests.support.te_test_support import blackwell_script, needs_te, run_te_script

TE_SCRIPT = blackwell_script(
    r"""
import transformer_engine.pytorch as te
import transformer_engine_torch as tex
from transformer_engine.common.recipe import NVFP4BlockScaling
from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer
from nemo_lw_fp8.cpu.formats import nvfp4 as fp4

# ---- independent helpers (test-side) ---------------------------------------------------------
E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])

def swizzled_position(i, j, cols):
    # cuBLAS 1D block scaling factors layout: 128x4 tiles row-major, rows in 4 groups of 32
    tiles_x = (cols + 3) // 4
    return (((i // 128) * tiles_x + j // 4) * 32 + i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4

def unswizzle(buf):
    rows, cols = buf.shape
    i = torch.arange(rows)[:, None].expand(rows, cols)
    j = torch.arange(cols)[None, :].expand(rows, cols)
    return buf.reshape(-1)[swizzled_position(i, j, cols)]

def decode(packed, scales, rows, cols, global_scale=None):
    # (rows, cols) values of one usage: e2m1 nibble (low first) * e4m3 block scale [* amax/2688]
    b = packed.reshape(rows, cols // 2).long()
    nib = torch.stack((b & 15, b >> 4), -1).reshape(rows, cols)
    s = scales[:rows, : cols // 16].contiguous().view(torch.float8_e4m3fn).float()
    if global_scale is not None:
        s = (s * global_scale) * torch.tensor(1 / 2688, dtype=torch.float32)
    return E2M1[nib] * s.repeat_interleave(16, 1)

def operand(data, use, swizzled=False, compact_read=False, with_global=False):
    # the logical (rows, cols) operand of an NVFP4Data / TE tensor in one usage, in the layout
    # the GEMM stand-in documents (columnwise bytes decoded as (cols, rows), then viewed .t())
    get = (lambda n: getattr(data, "_" + n)) if hasattr(data, "_rowwise_data") or hasattr(
        data, "_columnwise_data") else (lambda n: getattr(data, n))
    if use == "rowwise":
        packed, scales, amax = get("rowwise_data"), get("rowwise_scale_inv"), get("amax_rowwise")
        rows = packed.numel() * 2 // (packed.shape[-1] * 2)
        cols = packed.shape[-1] * 2
    else:
        packed, scales, amax = (get("columnwise_data"), get("columnwise_scale_inv"),
                                get("amax_columnwise"))
        rows, cols = packed.shape[0], packed.shape[1] * 2
    if swizzled and not compact_read:
        scales = unswizzle(scales)
    vals = decode(packed, scales, rows, cols, amax.float() if with_global else None)
    return vals if use == "rowwise" else vals.t()

def alpha(amax_a, amax_b, a=1.0):
    f = lambda v: torch.tensor(v, dtype=torch.float32)
    return ((f(a) * amax_a.float().reshape(())) * amax_b.float().reshape(())) * f(1 / 7225344)

def ref_gemm(a, transa, b, transb, al, dtype, bias=None):
    acc = torch.matmul(b.t() if transb else b, a.t() if transa else a)
    if al is not None:
        acc = acc * al
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(dtype)

def eq(x, y):
    # bitwise (NaN payloads and -0 included)
    x, y = x.contiguous(), y.contiguous()
    return x.dtype == y.dtype and bool(torch.equal(x.view(torch.uint8), y.view(torch.uint8)))

gen = torch.Generator().manual_seed(11)

# ---- 1. swizzled scales ------------------------------------------------------------------------
sw = {}
w = (torch.randn(256, 384, generator=gen) * 2).bfloat16()
q = NVFP4Quantizer(with_2d_quantization=True)
q.optimize_for_gemm = True
t = q(w)
ref = fp4.quantize(w, two_d=True)
sw["flag"] = bool(t._with_gemm_swizzled_scales)
sw["data"] = eq(t._rowwise_data, ref.rowwise_data) and eq(t._columnwise_data, ref.columnwise_data)
sw["amax"] = eq(t._amax_rowwise, ref.amax_rowwise) and eq(t._amax_columnwise, ref.amax_columnwise)
sw["rowwise_unswizzled"] = eq(unswizzle(t._rowwise_scale_inv), ref.rowwise_scale_inv)
sw["columnwise_unswizzled"] = eq(unswizzle(t._columnwise_scale_inv), ref.columnwise_scale_inv)
sw["control_compact_read"] = eq(t._rowwise_scale_inv, ref.rowwise_scale_inv)
sw["control_columnwise_compact_read"] = eq(t._columnwise_scale_inv, ref.columnwise_scale_inv)
# where TE's rule writes compact scales: 1D blocks, dims not multiples of 128, no optimize_for_gemm
q1 = NVFP4Quantizer(); q1.optimize_for_gemm = True
t1 = q1(w)
sw["1d_compact"] = (not t1._with_gemm_swizzled_scales) and eq(
    t1._rowwise_scale_inv, fp4.quantize(w).rowwise_scale_inv)
t2 = q(w[:144])
sw["unaligned_compact"] = (not t2._with_gemm_swizzled_scales) and eq(
    t2._rowwise_scale_inv, fp4.quantize(w[:144], two_d=True).rowwise_scale_inv)
t3 = NVFP4Quantizer(with_2d_quantization=True)(w)
sw["no_optimize_compact"] = not t3._with_gemm_swizzled_scales
# in place (update_quantized) and make_empty
e = q.make_empty((256, 384), dtype=torch.bfloat16, device="cpu")
keep = e._rowwise_scale_inv
e.quantize_(w)
sw["inplace"] = (bool(e._with_gemm_swizzled_scales) and e._rowwise_scale_inv is keep
                 and eq(e._rowwise_scale_inv, t._rowwise_scale_inv)
                 and eq(e._columnwise_scale_inv, t._columnwise_scale_inv))
try:
    t.dequantize(); sw["dequantize_swizzled_refused"] = "accepted"
except NotImplementedError as exc:
    sw["dequantize_swizzled_refused"] = "GEMM-swizzled" in str(exc)
R["swizzle"] = sw

# ---- 2. generic_gemm on NVFP4 operands ---------------------------------------------------------
gm = {}
W = (torch.randn(128, 256, generator=gen) * 0.5).bfloat16()
X = (torch.randn(64, 256, generator=gen) * 3).bfloat16()
DY = (torch.randn(64, 128, generator=gen) * 0.01).bfloat16()
qw = NVFP4Quantizer(with_2d_quantization=True); qw.optimize_for_gemm = True
qx = NVFP4Quantizer(); qx.optimize_for_gemm = True
tw, tx, tdy = qw(W), qx(X), qx(DY)
gm["weight_swizzled"] = bool(tw._with_gemm_swizzled_scales)
ws = torch.empty(32 * 1024 * 1024 + 1024, dtype=torch.uint8)
bias = torch.randn(128, generator=gen).bfloat16()

def gemm(A, transa, B, transb, b=None, alpha_=1.0):
    return tex.generic_gemm(A, transa, B, transb, None, None, tex.DType.kBFloat16, b,
                            tex.DType.kBFloat16, False, None, False, ws, ws.numel(), False,
                            False, None, None, None, False, alpha_)[0]

rw, rx, rdy = (fp4.quantize(W, two_d=True), fp4.quantize(X), fp4.quantize(DY))
cases = {
    # name: (A, transa, B, transb, A ref, A use, B ref, B use, A swizzled)
    "fprop": (tw, True, tx, False, rw, "rowwise", rx, "rowwise", True),
    "dgrad": (tw, False, tdy, False, rw, "columnwise", rdy, "rowwise", True),
    "wgrad": (tx, False, tdy, True, rx, "columnwise", rdy, "columnwise", False),
}
other = {"rowwise": "columnwise", "columnwise": "rowwise"}
for name, (A, ta, B, tb, ra, ua, rb, ub, asw) in cases.items():
    b = bias if name == "fprop" else None
    got = gemm(A, ta, B, tb, b, 0.5 if name == "dgrad" else 1.0)  # a caller's alpha too
    scale = 0.5 if name == "dgrad" else 1.0
    al = alpha(getattr(ra, "amax_" + ua), getattr(rb, "amax_" + ub), scale)
    # the reference reads TE's own bytes (swizzled for the weight) through the test's unswizzle
    a_te, b_te = operand(A, ua, swizzled=asw), operand(B, ub)
    gm[name] = eq(got, ref_gemm(a_te, ta, b_te, tb, al, torch.bfloat16, b))
    # and the plain cast's compact bytes give the same operands
    gm[name + "_ref_bytes"] = eq(got, ref_gemm(operand(ra, ua), ta, operand(rb, ub), tb, al,
                                               torch.bfloat16, b))
    # controls (the other usage of the 1D operand: a 2D weight's two usages hold equal values)
    if asw:
        flipped = (operand(ra, ua), operand(rb, other[ub]))
    else:
        flipped = (operand(ra, other[ua]), operand(rb, ub))
    gm[name + "_control_other_usage"] = eq(got, ref_gemm(flipped[0], ta, flipped[1], tb, al,
                                                         torch.bfloat16, b))
    gm[name + "_2d_usages_equal"] = (not asw) or eq(operand(ra, "rowwise"),
                                                    operand(ra, "columnwise"))
    gm[name + "_control_no_global_scale"] = eq(got, ref_gemm(operand(ra, ua), ta, operand(rb, ub),
                                                             tb, None, torch.bfloat16, b))
    if asw:
        gm[name + "_control_compact_read"] = eq(got, ref_gemm(
            operand(A, ua, swizzled=True, compact_read=True), ta, b_te, tb, al, torch.bfloat16, b))
    # the operands with their global scales folded in (the dequantize formula) are another
    # computation: documented, not what the GPU's alpha epilogue gives
    gm[name + "_folded_differs"] = not eq(got, ref_gemm(
        operand(ra, ua, with_global=True), ta, operand(rb, ub, with_global=True), tb, None,
        torch.bfloat16, b))
try:
    gemm(tw, True, X, False); gm["mixed_refused"] = "accepted"
except NotImplementedError as exc:
    gm["mixed_refused"] = "NVFP4 operand beside" in str(exc)
R["gemm"] = gm

# ---- 3. TE Linear under NVFP4BlockScaling (RHT and SR off) ------------------------------------
lin_r = {}
recipe = NVFP4BlockScaling()
lin_r["recipe_off"] = (recipe.disable_rht, recipe.disable_stochastic_rounding)
torch.manual_seed(3)
lin = te.Linear(256, 128, bias=True, params_dtype=torch.bfloat16, device="cpu")
with torch.no_grad():
    lin.bias.copy_(torch.randn(128, generator=gen).bfloat16())
x = (torch.randn(2, 32, 256, generator=gen) * 2).bfloat16().requires_grad_(True)
dy = (torch.randn(2, 32, 128, generator=gen) * 0.01).bfloat16()
SEEN = []
real_gemm = tex.generic_gemm
def recording_gemm(A, transa, B, transb, *rest, **kw):
    SEEN.append([type(A).__name__, bool(getattr(A, "_with_gemm_swizzled_scales", False)),
                 bool(transa), type(B).__name__, bool(transb)])
    return real_gemm(A, transa, B, transb, *rest, **kw)
tex.generic_gemm = recording_gemm
try:
    with te.autocast(enabled=True, recipe=recipe):
        y = lin(x)
    y.backward(dy)
finally:
    tex.generic_gemm = real_gemm
lin_r["gemms"] = SEEN

x2, dy2, wt = x.detach().reshape(64, 256), dy.reshape(64, 128), lin.weight.detach()
qx_, qw_, qdy_ = fp4.quantize(x2), fp4.quantize(wt, two_d=True), fp4.quantize(dy2)
def lin_refs(use_x_fwd="rowwise", use_x_wgrad="columnwise", use_w_dgrad="columnwise",
             global_scale=True):
    a = (lambda p, q_: alpha(getattr(p, "amax_rowwise"), getattr(q_, "amax_rowwise"))) if \
        global_scale else (lambda p, q_: None)
    y_ref = ref_gemm(operand(qw_, "rowwise"), True, operand(qx_, use_x_fwd), False,
                     a(qw_, qx_), torch.bfloat16, lin.bias.detach())
    dx_ref = ref_gemm(operand(qw_, use_w_dgrad), False, operand(qdy_, "rowwise"), False,
                      a(qw_, qdy_), torch.bfloat16)
    dw_ref = ref_gemm(operand(qx_, use_x_wgrad), False, operand(qdy_, "columnwise"), True,
                      a(qx_, qdy_), torch.bfloat16)
    return y_ref, dx_ref, dw_ref
y_ref, dx_ref, dw_ref = lin_refs()
lin_r["forward"] = eq(y.detach().reshape(64, 128), y_ref)
lin_r["dgrad"] = eq(x.grad.reshape(64, 256), dx_ref)
lin_r["wgrad"] = eq(lin.weight.grad, dw_ref)
lin_r["bgrad"] = eq(lin.bias.grad, dy2.float().sum(0).bfloat16())
lin_r["finite"] = bool(torch.isfinite(lin.weight.grad.float()).all() and
                       (lin.weight.grad.float().abs().sum() > 0))
_, _, dw_c = lin_refs(use_x_wgrad="rowwise")
lin_r["control_wgrad_rowwise_x"] = eq(lin.weight.grad, dw_c)
y_c, dx_c, dw_c2 = lin_refs(global_scale=False)
lin_r["control_no_global_scale"] = [eq(y.detach().reshape(64, 128), y_c),
                                   eq(x.grad.reshape(64, 256), dx_c), eq(lin.weight.grad, dw_c2)]
# a second step re-casts the changed weight and still matches
x.grad = None; lin.weight.grad = None; lin.bias.grad = None
with torch.no_grad():
    lin.weight.add_(0.01)
with te.autocast(enabled=True, recipe=recipe):
    y = lin(x)
y.backward(dy)
wt = lin.weight.detach()
qw_ = fp4.quantize(wt, two_d=True)
y_ref, dx_ref, dw_ref = lin_refs()
lin_r["step2"] = [eq(y.detach().reshape(64, 128), y_ref), eq(x.grad.reshape(64, 256), dx_ref),
                  eq(lin.weight.grad, dw_ref)]
R["linear"] = lin_r

# ---- 4. TE Linear under NVFP4BlockScaling with the RHT on (SR off) -----------------------------
rl = {}
recipe_rht = NVFP4BlockScaling(disable_rht=False, disable_stochastic_rounding=True)
rl["recipe"] = (recipe_rht.disable_rht, recipe_rht.disable_stochastic_rounding,
                recipe_rht.fp4_quant_fwd_inp.random_hadamard_transform,
                recipe_rht.fp4_quant_fwd_weight.random_hadamard_transform,
                recipe_rht.fp4_quant_bwd_grad.random_hadamard_transform)
torch.manual_seed(5)
lin3 = te.Linear(256, 128, bias=True, params_dtype=torch.bfloat16, device="cpu")
with torch.no_grad():
    lin3.bias.copy_(torch.randn(128, generator=gen).bfloat16())
x3 = x.detach().clone().requires_grad_(True)
SEEN = []
def recording_gemm3(A, transa, B, transb, *rest, **kw):
    SEEN.append([type(A).__name__, bool(getattr(A, "_with_gemm_swizzled_scales", False)),
                 bool(transa), type(B).__name__,
                 bool(getattr(B, "_with_gemm_swizzled_scales", False)), bool(transb)])
    return real_gemm(A, transa, B, transb, *rest, **kw)
tex.generic_gemm = recording_gemm3
try:
    with te.autocast(enabled=True, recipe=recipe_rht):
        y3 = lin3(x3)
    y3.backward(dy)
finally:
    tex.generic_gemm = real_gemm
rl["gemms"] = SEEN
MASK = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True).rht_matrix_random_sign_mask_t
rl["mask"] = MASK
w3 = lin3.weight.detach()
def rht_refs(mask=MASK, x_mask=None, dy_rht=True, col_amax=True):
    qw3 = fp4.quantize(w3, two_d=True)
    qx3 = fp4.quantize(x2, rht_sign_mask=mask if x_mask is None else x_mask)
    qdy3 = fp4.quantize(dy2, rht_sign_mask=mask) if dy_rht else fp4.quantize(dy2)
    use = "amax_columnwise" if col_amax else "amax_rowwise"
    y_ref = ref_gemm(operand(qw3, "rowwise"), True, operand(qx3, "rowwise"), False,
                     alpha(qw3.amax_rowwise, qx3.amax_rowwise), torch.bfloat16,
                     lin3.bias.detach())
    dx_ref = ref_gemm(operand(qw3, "columnwise"), False, operand(qdy3, "rowwise"), False,
                      alpha(qw3.amax_columnwise, qdy3.amax_rowwise), torch.bfloat16)
    dw_ref = ref_gemm(operand(qx3, "columnwise"), False, operand(qdy3, "columnwise"), True,
                      alpha(getattr(qx3, use), getattr(qdy3, use)), torch.bfloat16)
    return y_ref, dx_ref, dw_ref
y_ref, dx_ref, dw_ref = rht_refs()
rl["forward"] = eq(y3.detach().reshape(64, 128), y_ref)
rl["dgrad"] = eq(x3.grad.reshape(64, 256), dx_ref)
rl["wgrad"] = eq(lin3.weight.grad, dw_ref)
rl["bgrad"] = eq(lin3.bias.grad, dy2.float().sum(0).bfloat16())
# the transform cancels in wgrad (both operands rotated along the tokens by one orthogonal
# matrix): close to the bf16 product; rotating one operand only is not
true_dw = dy2.float().t() @ x2.float()
rel = lambda a: float((a.float() - true_dw).norm() / true_dw.norm())
rl["wgrad_rel_error"] = rel(lin3.weight.grad)
_, _, dw_one = rht_refs(dy_rht=False)
rl["control_one_side_rel_error"] = rel(dw_one)
# controls: the other sign mask, the non-RHT columnwise copies, the rowwise (pre-RHT) amaxes
rl["control_no_signs"] = eq(lin3.weight.grad, rht_refs(mask=0)[2])
px, pdy = fp4.quantize(x2), fp4.quantize(dy2)
rl["control_plain_columnwise"] = eq(lin3.weight.grad, ref_gemm(
    operand(px, "columnwise"), False, operand(pdy, "columnwise"), True,
    alpha(px.amax_columnwise, pdy.amax_columnwise), torch.bfloat16))
rl["control_pre_rht_amax"] = eq(lin3.weight.grad, rht_refs(col_amax=False)[2])
R["linear_rht"] = rl

# ---- 5. stochastic rounding stays refused by name ---------------------------------------------
ref_ = {}
for label, kw in {"default": dict(disable_rht=False, disable_stochastic_rounding=False),
                  "sr": dict(disable_rht=True, disable_stochastic_rounding=False)}.items():
    lin2 = te.Linear(256, 128, bias=False, params_dtype=torch.bfloat16, device="cpu")
    xx = x.detach().clone().requires_grad_(True)
    stage = "forward"
    try:
        with te.autocast(enabled=True, recipe=NVFP4BlockScaling(**kw)):
            out = lin2(xx)
        stage = "backward"
        out.backward(dy)
        ref_[label] = "accepted"
    except NotImplementedError as exc:
        ref_[label] = stage + ": " + str(exc)
R["refused"] = ref_
print("RESULT " + json.dumps(R))
""", env=("NVTE_NVFP4_DISABLE_RHT", NVFP4_NO_SR)
)


@pytest.fixture(scope="module")
def te_results() -> dict:
    return run_te_script(TE_SCRIPT, timeout=600)


@needs_te
def test_swizzled_scales_are_the_compact_ones_in_cublas_order(te_results):
    """``optimize_for_gemm`` with 16x16 blocks on 128-aligned dims (SM 10.0): both usages' scales
    are TE's compact bytes moved to cuBLAS's 128x4-tile positions (the test's own formula), data
    and amaxes unchanged, in place too; compact where TE's rule says so (1D, unaligned dims, no
    ``optimize_for_gemm``). Controls: the swizzled buffers read as compact differ."""
    sw = te_results["swizzle"]
    assert te_results["backend"] == "emulated"
    for key in (
        "flag",
        "data",
        "amax",
        "rowwise_unswizzled",
        "columnwise_unswizzled",
        "1d_compact",
        "unaligned_compact",
        "no_optimize_compact",
        "inplace",
        "dequantize_swizzled_refused",
    ):
        assert sw[key] is True, (key, sw)
    assert sw["control_compact_read"] is False
    assert sw["control_columnwise_compact_read"] is False


@needs_te
@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_generic_gemm_nvfp4_equals_matmul_of_decoded_operands(te_results, gemm):
    """``tex.generic_gemm`` on NVFP4 operands (the weight's scales swizzled) equals the fp32
    matmul of the test-decoded ``e2m1 * e4m3`` operands in the usages the GEMM reads, times the
    alpha of the two amaxes, bitwise, whether decoded from TE's bytes or the plain cast's.
    Controls: the other usage of the 1D operand (a 16x16-block weight holds equal values in both
    usages), no global scale, compact read of swizzled scales; folding
    the global scales into the operands is another computation."""
    gm = te_results["gemm"]
    assert gm["weight_swizzled"] is True
    assert gm[gemm] is True and gm[gemm + "_ref_bytes"] is True, gm
    assert gm[gemm + "_control_other_usage"] is False
    assert gm[gemm + "_2d_usages_equal"] is True
    assert gm[gemm + "_control_no_global_scale"] is False
    assert gm.get(gemm + "_control_compact_read", False) is False
    assert gm[gemm + "_folded_differs"] is True
    assert gm["mixed_refused"] is True


@needs_te
def test_te_linear_nvfp4_trains_bitwise_like_reference(te_results):
    """TE's ``Linear`` (bias, 3-D input) under ``NVFP4BlockScaling`` with RHT and SR off:
    forward, dgrad, wgrad equal the reference (the plain cast + fp32 matmul in the usages TE's
    GEMMs read, alpha epilogue), bias gradient the fp32 column sum, over two steps (the weight
    re-cast). Controls: wgrad from x's rowwise copy, no global scale."""
    lin = te_results["linear"]
    assert lin["recipe_off"] == [True, True]
    # fprop (weight rowwise, swizzled), dgrad (weight columnwise, swizzled), wgrad (x, dy)
    assert lin["gemms"] == [
        ["NVFP4TensorStorage", True, True, "NVFP4TensorStorage", False],
        ["NVFP4TensorStorage", True, False, "NVFP4TensorStorage", False],
        ["NVFP4TensorStorage", False, False, "NVFP4TensorStorage", True],
    ], lin["gemms"]
    for key in ("forward", "dgrad", "wgrad", "bgrad", "finite"):
        assert lin[key] is True, (key, lin)
    assert lin["step2"] == [True, True, True]
    assert lin["control_wgrad_rowwise_x"] is False
    assert lin["control_no_global_scale"] == [False, False, False]


@needs_te
def test_te_linear_nvfp4_rht_trains_bitwise_like_reference(te_results):
    """TE's ``Linear`` under ``NVFP4BlockScaling(disable_rht=False,
    disable_stochastic_rounding=True)``: the recipe puts the RHT on the input and the gradient,
    not the weight; x's and dy's casts take the fused shape (64 x 256, 64 x 128) and write
    swizzled scales; forward, dgrad, wgrad (the RHT'd columnwise copies with their post-RHT
    amaxes) and the bias gradient equal the reference bitwise, and the wgrad is close to the
    bf16 product (the transform cancels). Controls: no signs, the copies without the RHT, the
    pre-RHT amaxes in the wgrad alpha, and the RHT on one operand only (far from the product)."""
    rl = te_results["linear_rht"]
    assert rl["recipe"] == [False, True, True, False, True], rl["recipe"]
    assert rl["mask"] == 0xD7E8
    storage = "NVFP4TensorStorage"
    assert rl["gemms"] == [
        [storage, True, True, storage, True, False],
        [storage, True, False, storage, True, False],
        [storage, True, False, storage, True, True],
    ], rl["gemms"]
    for key in ("forward", "dgrad", "wgrad", "bgrad"):
        assert rl[key] is True, (key, rl)
    assert rl["wgrad_rel_error"] < 0.3, rl
    assert rl["control_one_side_rel_error"] > 0.8, rl
    for key in ("control_no_signs", "control_plain_columnwise", "control_pre_rht_amax"):
        assert rl[key] is False, (key, rl)


@needs_te
def test_stochastic_rounding_refused_by_name(te_results):
    """The recipe as it is without the two variables (RHT on, SR on): the forward runs (the
    input's RHT is emulated), refused at the gradient's stochastic rounding; with RHT off, the
    same."""
    refused = te_results["refused"]
    assert refused["default"].startswith("backward: NVFP4 stochastic rounding"), refused
    assert refused["sr"].startswith("backward: NVFP4 stochastic rounding"), refused
