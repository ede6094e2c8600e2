"""The pure-torch MXFP8 emulation's whole-tensor quantise and dequantise against an independent
exact reference of TE 2.20's rules (``tests.support.mxfp8_reference``), with controls; TE's
special blocks, refused shapes, scale layouts and swizzling, empty tensors, quantising in
place, and ``MXFP8Linear`` without Transformer Engine.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from nemo_lw_fp8.cpu.formats import mxfp8 as mx
from nemo_lw_fp8.cpu.formats import mxfp8_layout as mxf
from tests.support.fp8_reference import E4M3, E5M2
from tests.support.mxfp8_reference import ref_dequant, ref_quantize, wide_range

# --------------------------------------------------------------------------------------------
# Whole-tensor quantise against the reference
# --------------------------------------------------------------------------------------------


def _special_blocks(dtype=torch.bfloat16):
    x = torch.randn(64, 64).to(dtype)
    x[0] = 0.0  # zero block row
    x[1, :32] = -0.0
    x[2, :32] = math.nan  # all-NaN block
    x[3, 5] = math.nan  # one NaN among finite values
    x[4, 7] = math.inf  # inf block: TE multiplies by +0 -> NaN, finite -> +-0
    x[5, 40] = -math.inf
    sub = torch.tensor([2.0**-127, -(2.0**-130), 2.0**-133, 2.0**-126], dtype=torch.float32)
    x[6:8, :32] = 0.0
    x[6, :4] = sub.to(dtype)  # subnormal-only block (bf16 subnormals): scale 0 -> codes 0
    x[7, :4] = sub.to(dtype)
    x[7, 4] = 2.0**-110  # tiny normal amax: subnormal elements get non-zero codes
    x[32:64, 0] = 2.0**-140 if dtype == torch.float32 else 0.0
    x[33, 1] = math.nan
    return x


def _quantize_mismatches(x: torch.Tensor, fmt: torch.dtype, two_d: bool) -> list[str]:
    """Which of the four outputs of ``mx.quantize`` differ from the exact reference (empty when
    all are equal): one check shared by the test and its control, so the control shows that
    this very comparison can fail."""
    q = mx.quantize(x, fmt, two_d=two_d)
    rc, rs, cc, cs = ref_quantize(x, fmt, two_d=two_d)
    rows, cols = rc.shape
    outputs = {
        "rowwise scales": (q.rowwise_scale_inv[:rows, : cols // 32], rs),
        "columnwise scales": (q.columnwise_scale_inv[: rows // 32, :cols], cs),
        "rowwise codes": (q.rowwise_data.view(rows, cols), rc),
        "columnwise codes": (q.columnwise_data.view(rows, cols), cc),
    }
    return [name for name, (got, want) in outputs.items() if not torch.equal(got, want)]


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize(
    "name",
    ["normal", "wide", "special", "special_fp32", "wide_fp16", "two_d", "two_d_special"],
)
def test_quantize_matches_reference(fmt, name):
    two_d = name.startswith("two_d")
    if name in ("normal", "two_d"):
        x = (torch.randn(64, 96, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    elif name == "wide":
        x = wide_range((64, 64), 2)
    elif name == "wide_fp16":
        x = wide_range((32, 64), 3, torch.float32).clamp(-6e4, 6e4).half()
    elif name == "special_fp32":
        x = _special_blocks(torch.float32)
    else:
        x = _special_blocks()
    assert _quantize_mismatches(x, fmt, two_d) == []


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float32])
def test_control_quantize_with_scale_exponent_off_by_one_differs(
    src: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control of ``test_quantize_matches_reference``: a quantizer whose E8M0 scale is one
    power of two too large (finite scales below saturation) must fail the same comparison,
    in the scales and in the codes. bf16 inputs take the scale from the cached lookup table,
    fp32 inputs compute it directly: both paths are mutated (the table is rebuilt)."""
    original = mxf.e8m0_from_amax

    def one_too_large(amax: torch.Tensor, fp8_dtype: torch.dtype = E4M3) -> torch.Tensor:
        e8m0 = original(amax, fp8_dtype)
        return torch.where(e8m0 < 0xFE, e8m0 + 1, e8m0).to(torch.uint8)

    x = (torch.randn(64, 96, generator=torch.Generator().manual_seed(1)) * 3).to(src)
    assert _quantize_mismatches(x, E4M3, False) == []  # unmutated: equal
    with monkeypatch.context() as m:
        m.setattr(mx, "e8m0_from_amax", one_too_large)
        m.setattr(mx, "_AMAX_LUT", {})  # the table was built with the unmutated rule
        assert _quantize_mismatches(x, E4M3, False) == [
            "rowwise scales",
            "columnwise scales",
            "rowwise codes",
            "columnwise codes",
        ]


def test_special_blocks_behave_like_te():
    x = _special_blocks()
    q = mx.quantize(x)
    rd, rs = q.rowwise_data, q.rowwise_scale_inv
    assert rs[0].tolist()[:2] == [0, 0] and rd[0].eq(0).all()
    assert rd[1, :32].eq(0x80).all()  # -0 keeps its sign
    assert rs[2, 0] == 0 and rd[2, :32].eq(0x7F).all()  # NaN ignored in amax, canonical NaN
    assert rd[3, 5] == 0x7F and rs[3, 0] != 0
    assert rs[4, 0] == 0xFE and rd[4, 7] == 0x7F
    finite = rd[4, :32][torch.arange(32) != 7]
    assert finite.bitwise_and(0x7F).eq(0).all()  # finite elements of an inf block -> +-0
    assert rs[6, 0] == 0 and rd[6, :4].tolist() == [0x00, 0x80, 0x00, 0x00]
    assert rd[7, 0] != 0  # 2^-127 (bf16 subnormal) scaled by 2^118: no flush to zero


def test_non_multiple_of_32_shapes_refused():
    for shape in [(31, 32), (32, 48), (3, 5, 32), (64,), (32, 33)]:
        with pytest.raises(ValueError, match=r"multiples of 32.*" + r"\(" + str(shape[0])):
            mx.quantize(torch.zeros(shape, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="0-d"):
        mx.quantize(torch.zeros((), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float8_e4m3fn or torch.float8_e5m2"):
        mx.quantize(torch.zeros(32, 32), torch.float16)


# --------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,row_shape,col_shape",
    [
        ((32, 32), (128, 4), (4, 128)),
        ((64, 96), (128, 4), (4, 128)),
        ((2, 48, 160), (128, 8), (4, 256)),
        ((160, 544), (256, 20), (8, 640)),
        ((4096, 4096), (4096, 128), (128, 4096)),
    ],
)
def test_scale_shapes_and_padding(shape, row_shape, col_shape):
    assert mxf.rowwise_scale_shape(shape) == row_shape
    assert mxf.columnwise_scale_shape(shape) == col_shape
    if math.prod(shape) > 1 << 20:
        return
    q = mx.quantize(torch.randn(shape).bfloat16() + 3)
    rows, cols = mxf.flat_2d_shape(shape)
    assert q.rowwise_data.shape == shape and q.columnwise_data.shape == shape
    assert tuple(q.rowwise_scale_inv.shape) == row_shape
    assert tuple(q.columnwise_scale_inv.shape) == col_shape
    rs, cs = q.rowwise_scale_inv.clone(), q.columnwise_scale_inv.clone()
    assert rs[:rows, : cols // 32].ne(0).all() and cs[: rows // 32, :cols].ne(0).all()
    rs[:rows, : cols // 32] = 0
    cs[: rows // 32, :cols] = 0
    assert rs.eq(0).all() and cs.eq(0).all(), "padding is written as zeros"


def test_swizzle_index_formula():
    # Hand-worked: (i=33, j=5) with 2 tiles per tile row -> tile 1, row 1 of group 1, col 1.
    assert mxf.gemm_swizzled_scale_index(33, 5, 2) == 512 + 1 * 16 + 1 * 4 + 1
    assert mxf.gemm_swizzled_scale_index(0, 0, 3) == 0
    assert mxf.gemm_swizzled_scale_index(127, 3, 1) == 31 * 16 + 3 * 4 + 3
    assert mxf.gemm_swizzled_scale_index(128, 0, 3) == 3 * 512
    rng = random.Random(0)
    for shape in [(32, 128), (256, 544), (96, 4096)]:
        q = mx.quantize(torch.randn(shape).bfloat16(), swizzle=False)
        qs = mx.quantize(torch.randn(shape).bfloat16(), swizzle=True)
        for columnwise in (False, True):
            compact = q.columnwise_scale_inv if columnwise else q.rowwise_scale_inv
            compact = torch.randint(0, 256, compact.shape, dtype=torch.uint8)
            swz = mxf.swizzle_scales(compact, columnwise).reshape(-1)
            r, c = compact.shape
            for _ in range(300):
                i, j = rng.randrange(r), rng.randrange(c)
                if columnwise:  # indexed (column, block row), tiles over the block rows
                    k = mxf.gemm_swizzled_scale_index(j, i, r // 4)
                else:
                    k = mxf.gemm_swizzled_scale_index(i, j, c // 4)
                assert swz[k] == compact[i, j]
            assert torch.equal(mxf.unswizzle_scales(swz.view(r, c), columnwise), compact)
        # quantize(swizzle=True) stores exactly the swizzled compact scales, same shapes
        x = torch.randn(shape).bfloat16()
        a, b = mx.quantize(x), mx.quantize(x, swizzle=True)
        assert torch.equal(b.rowwise_scale_inv, mxf.swizzle_scales(a.rowwise_scale_inv, False))
        assert torch.equal(b.columnwise_scale_inv, mxf.swizzle_scales(a.columnwise_scale_inv, True))
        assert torch.equal(mx.dequantize(a), mx.dequantize(b))
        assert qs.with_gemm_swizzled_scales


# --------------------------------------------------------------------------------------------
# Dequantise
# --------------------------------------------------------------------------------------------


def _dequantize_mismatches(q: mx.MXFP8Data, fmt: torch.dtype) -> list[tuple[str, int, int]]:
    """(direction, row, column) of every element ``mx.dequantize`` gives differently from the
    exact reference (NaN equals NaN); shared by the test and its control."""
    bad: list[tuple[str, int, int]] = []
    for use, codes, scales in (
        ("rowwise", q.rowwise_data, q.rowwise_scale_inv),
        ("columnwise", q.columnwise_data, q.columnwise_scale_inv),
    ):
        out = mx.dequantize(q, torch.float32, use=use)
        rows, cols = out.shape
        for r in range(rows):
            for c in range(cols):
                e = int(scales[r, c // 32] if use == "rowwise" else scales[r // 32, c])
                want = ref_dequant(int(codes[r, c]), e, fmt)
                got = float(out[r, c])
                if not ((math.isnan(want) and math.isnan(got)) or want == got):
                    bad.append((use, r, c))
    return bad


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_dequantize_matches_reference(fmt):
    x = _special_blocks()
    q = mx.quantize(x, fmt)
    assert _dequantize_mismatches(q, fmt) == []
    assert mx.dequantize(q).dtype == torch.bfloat16
    y = torch.tensor([[1.5, -3.0, 0.25, 448.0] * 8] * 32, dtype=torch.bfloat16)
    assert torch.equal(mx.dequantize(mx.quantize(y)), y)


def test_control_dequantize_with_scale_exponent_off_by_one_differs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Control of ``test_dequantize_matches_reference``: a dequantizer that multiplies by
    ``2^(e - 126)`` instead of ``2^(e - 127)`` must fail the same element-wise comparison on
    every non-zero finite element (and on the zeros of the inf block, whose doubled 2^127
    multiplier overflows to inf: 0 * inf is NaN)."""
    q = mx.quantize(_special_blocks(), E4M3)
    rowwise = mx.dequantize(q, torch.float32, use="rowwise")
    nonzero_finite = {
        ("rowwise", r, c) for r, c in (rowwise.isfinite() & rowwise.ne(0)).nonzero().tolist()
    }
    original = mx.dequantize_multipliers

    def one_too_large(e8m0: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return original(e8m0, dtype) * 2

    with monkeypatch.context() as m:
        m.setattr(mx, "dequantize_multipliers", one_too_large)
        bad = _dequantize_mismatches(q, E4M3)
    assert nonzero_finite and nonzero_finite <= set(bad)


def test_empty_tensors():
    for shape in [(0, 32), (32, 0), (2, 0, 64)]:
        q = mx.quantize(torch.zeros(shape, dtype=torch.bfloat16))
        assert q.rowwise_data.shape == shape and q.columnwise_data.shape == shape
        assert tuple(q.rowwise_scale_inv.shape) == mxf.rowwise_scale_shape(shape)
        assert tuple(q.columnwise_scale_inv.shape) == mxf.columnwise_scale_shape(shape)
        assert mx.dequantize(q).shape == shape


# --------------------------------------------------------------------------------------------
# MXFP8Linear without Transformer Engine (bf16 weights)
# --------------------------------------------------------------------------------------------


def test_mxfp8_linear_bf16_weights():
    from nemo_lw_fp8.cpu.layers.mxfp8_linear import MXFP8Linear, quantize_dequantize

    torch.manual_seed(3)
    layer = MXFP8Linear(64, 96, fp8_params=False)
    with torch.no_grad():
        layer.bias.normal_()
        # Magnitudes that vary across rows and columns, so the two block directions differ.
        spread = torch.logspace(-3, 3, 96, base=2).unsqueeze(1) * torch.logspace(2, -2, 64, base=2)
        layer.weight.copy_(torch.randn(96, 64) * spread)
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    xq = quantize_dequantize(x.detach()).float()
    wq = quantize_dequantize(layer.weight.detach()).float()
    assert torch.equal(y, (xq @ wq.t() + layer.bias.float()).bfloat16())
    g = torch.randn_like(y)
    y.backward(g)
    # TE's MXFP8 backward: every GEMM operand blocked along that GEMM's reduction dimension.
    g2 = g.reshape(-1, 96)

    def qdq(t, use):
        data = mx.quantize(t, E4M3, rowwise=use == "rowwise", columnwise=use == "columnwise")
        return mx.dequantize(data, t.dtype, use=use).float()

    w_col = qdq(layer.weight.detach(), "columnwise")
    assert not torch.equal(w_col, wq), "columnwise and rowwise copies coincide: no test"
    want_x = (qdq(g2, "rowwise") @ w_col).bfloat16().view(x.shape)
    assert torch.equal(x.grad, want_x)
    want_w = (qdq(g2, "columnwise").t() @ qdq(x.detach().reshape(-1, 64), "columnwise")).bfloat16()
    assert torch.equal(layer.weight.grad, want_w)
    assert torch.equal(layer.bias.grad, g2.float().sum(0).bfloat16())
    with pytest.raises(ValueError, match="multiples of 32"):
        layer(torch.randn(4, 64, dtype=torch.bfloat16))  # 4 tokens: TE refuses too
    with pytest.raises(ValueError, match="multiples of 32"):
        MXFP8Linear(48, 64)


def test_quantize_in_place_into_existing_buffers():
    x = torch.randn(96, 160).bfloat16()
    for swizzle, two_d in ((False, False), (True, False), (False, True)):
        fresh = mx.quantize(x, swizzle=swizzle, two_d=two_d)
        target = mx.quantize(torch.zeros(96, 160, dtype=torch.bfloat16))
        target.rowwise_data = target.rowwise_data.view(torch.float8_e4m3fn)  # FP8 views work
        ptrs = [t.data_ptr() for t in (target.rowwise_data, target.columnwise_scale_inv)]
        got = mx.quantize(x, swizzle=swizzle, two_d=two_d, out=target)
        assert got is target and got.with_gemm_swizzled_scales == swizzle
        assert ptrs == [t.data_ptr() for t in (got.rowwise_data, got.columnwise_scale_inv)]
        assert torch.equal(got.rowwise_data.view(torch.uint8), fresh.rowwise_data)
        for name in ("columnwise_data", "rowwise_scale_inv", "columnwise_scale_inv"):
            assert torch.equal(getattr(got, name), getattr(fresh, name)), name
    with pytest.raises(ValueError, match="cannot hold"):
        mx.quantize(
            x,
            out=mx.MXFP8Data((96, 160), E4M3, torch.empty(10, dtype=torch.uint8), None, None, None),
        )
