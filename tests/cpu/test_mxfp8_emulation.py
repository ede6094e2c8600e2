"""The pure-torch MXFP8 emulation against an independent exact reference of TE 2.20's rules.

The reference below uses Python integers and ``fractions.Fraction`` only: E8M0 is
``ceil(log2(amax / fp8_max))`` clamped to [0, 254] (NaN 0xFF, inf 0xFE), elements are multiplied
by TE's ``exp2f_rcp`` and rounded to the nearest FP8 value, ties to even, saturating.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
import threading
from collections.abc import Callable
from fractions import Fraction

import pytest
import torch

from nemo_lw_fp8.cpu.formats import mxfp8 as mx
from nemo_lw_fp8.cpu.formats import mxfp8_layout as mxf
from nemo_lw_fp8.cpu.formats import mxfp8_sharded_cast as mxs
from tests.support.te_test_support import ThreadedMaxAllReduce

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FMT = {E4M3: (4, 3, 7, 0x7E), E5M2: (5, 2, 15, 0x7B)}  # exp bits, mantissa bits, bias, max code


# --------------------------------------------------------------------------------------------
# Exact reference
# --------------------------------------------------------------------------------------------


def _fp8_value(code: int, fmt: torch.dtype) -> Fraction:
    _, man, bias, _ = FMT[fmt]
    exp, frac = code >> man, code & ((1 << man) - 1)
    if exp == 0:
        return Fraction(frac) * Fraction(2) ** (1 - bias - man)
    return Fraction((1 << man) + frac) * Fraction(2) ** (exp - bias - man)


_POSITIVE: dict[torch.dtype, tuple[list[Fraction], list[int]]] = {}


def _positive_values(fmt: torch.dtype) -> tuple[list[Fraction], list[int]]:
    if fmt not in _POSITIVE:
        codes = list(range(FMT[fmt][3] + 1))
        _POSITIVE[fmt] = ([_fp8_value(c, fmt) for c in codes], codes)
    return _POSITIVE[fmt]


def ref_cast(x: float | Fraction, fmt: torch.dtype, negative: bool | None = None) -> int:
    """Round-nearest-even, saturating cast to an FP8 code; NaN -> canonical 0x7F."""
    if isinstance(x, float) and math.isnan(x):
        return 0x7F
    if negative is None:
        negative = math.copysign(1.0, x) < 0 if isinstance(x, float) else x < 0
    sign = 0x80 if negative else 0
    values, codes = _positive_values(fmt)
    if isinstance(x, float) and math.isinf(x):
        return sign | codes[-1]
    a = abs(Fraction(x))
    if a >= values[-1]:
        return sign | codes[-1]
    hi = bisect.bisect_left(values, a)
    if values[hi] == a:
        return sign | codes[hi]
    lo = hi - 1
    below, above = a - values[lo], values[hi] - a
    if below < above or (below == above and codes[lo] % 2 == 0):
        return sign | codes[lo]
    return sign | codes[hi]


def ceil_log2(v: Fraction) -> int:
    e = v.numerator.bit_length() - v.denominator.bit_length()
    while Fraction(2) ** e < v:
        e += 1
    while Fraction(2) ** (e - 1) >= v:
        e -= 1
    return e


def ref_e8m0(amax: float, fmt: torch.dtype) -> int:
    if math.isnan(amax):
        return 0xFF
    if math.isinf(amax):
        return 0xFE
    if amax == 0:
        return 0
    v = Fraction(amax) / Fraction(mxf.fp8_max(fmt))
    return min(max(ceil_log2(v) + 127, 0), 254)


def ref_multiply(x: float, e8m0: int) -> float | Fraction:
    """``x * exp2f_rcp(e8m0)`` exactly (TE's multipliers: 0 -> 1, 254 -> +0, 255 -> -inf)."""
    if math.isnan(x):
        return x
    if e8m0 == 0:
        mult: Fraction | float = Fraction(1)
    elif e8m0 == 254:
        mult = Fraction(0)
    elif e8m0 == 255:
        mult = -math.inf
    else:
        mult = Fraction(2) ** (127 - e8m0)
    if math.isinf(x):
        return math.nan if mult == 0 else x * float(mult)
    if isinstance(mult, float):
        return math.nan if x == 0 else -math.inf * math.copysign(1.0, x)
    return Fraction(x) * mult


def ref_code(x: float, e8m0: int, fmt: torch.dtype) -> int:
    scaled = ref_multiply(x, e8m0)
    negative = math.copysign(1.0, x) < 0
    if isinstance(scaled, Fraction):
        return ref_cast(scaled, fmt, negative=negative)
    return ref_cast(scaled, fmt)


def ref_quantize(x: torch.Tensor, fmt: torch.dtype, two_d: bool = False):
    """Slow per-block reference of rowwise and columnwise codes and compact scales."""
    rows, cols = mxf.flat_2d_shape(x.shape)
    vals = x.reshape(rows, cols).float().tolist()
    mags = [[0.0 if math.isnan(v) else abs(v) for v in row] for row in vals]

    def block_amax(r0, r1, c0, c1):
        return max(mags[r][c] for r in range(r0, r1) for c in range(c0, c1))

    row_scale = [[0] * (cols // 32) for _ in range(rows)]
    col_scale = [[0] * cols for _ in range(rows // 32)]
    for r in range(rows):
        for b in range(cols // 32):
            if two_d:
                r0 = r // 32 * 32
                amax = block_amax(r0, r0 + 32, b * 32, b * 32 + 32)
            else:
                amax = block_amax(r, r + 1, b * 32, b * 32 + 32)
            row_scale[r][b] = ref_e8m0(amax, fmt)
    for b in range(rows // 32):
        for c in range(cols):
            if two_d:
                c0 = c // 32 * 32
                amax = block_amax(b * 32, b * 32 + 32, c0, c0 + 32)
            else:
                amax = block_amax(b * 32, b * 32 + 32, c, c + 1)
            col_scale[b][c] = ref_e8m0(amax, fmt)
    row_codes = [
        [ref_code(vals[r][c], row_scale[r][c // 32], fmt) for c in range(cols)] for r in range(rows)
    ]
    col_codes = [
        [ref_code(vals[r][c], col_scale[r // 32][c], fmt) for c in range(cols)] for r in range(rows)
    ]
    u8 = torch.uint8
    return (
        torch.tensor(row_codes, dtype=u8),
        torch.tensor(row_scale, dtype=u8),
        torch.tensor(col_codes, dtype=u8),
        torch.tensor(col_scale, dtype=u8),
    )


def ref_dequant(code: int, e8m0: int, fmt: torch.dtype) -> float:
    if code & 0x7F == 0x7F and fmt == E4M3:
        return math.nan
    if fmt == E5M2 and code & 0x7F > 0x7C:
        return math.nan
    if fmt == E5M2 and code & 0x7F == 0x7C:
        value: float = math.inf
    else:
        value = float(_fp8_value(code & 0x7F, fmt))
    scale = 0.0 if e8m0 == 0 else math.inf if e8m0 == 255 else 2.0 ** (e8m0 - 127)
    out = value * scale
    return -out if code & 0x80 else out


def _bf16_from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


# --------------------------------------------------------------------------------------------
# E8M0
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16])
def test_e8m0_matches_exact_arithmetic_for_every_finite_amax(fmt, src):
    """Every positive finite bf16 (and fp16) amax: TE's fp32-product rule == exact ceil(log2)."""
    bits = torch.arange(1, 0x8000, dtype=torch.int32).to(torch.int16)
    amax = bits.view(src)
    amax = amax[torch.isfinite(amax)]
    got = mxf.e8m0_from_amax(amax, fmt).tolist()
    want = [ref_e8m0(a, fmt) for a in amax.float().tolist()]
    bad = [(a, g, w) for a, g, w in zip(amax.float().tolist(), got, want, strict=True) if g != w]
    assert not bad, f"{len(bad)} mismatches, first: {bad[:5]}"


def test_e8m0_specials_and_fp32_bit_rule():
    special = torch.tensor([0.0, -0.0, math.inf, math.nan], dtype=torch.float32)
    assert mxf.e8m0_from_amax(special).tolist() == [0x00, 0x00, 0xFE, 0xFF]
    # The bit rule on fp32 v = amax / 448, at the subnormal and saturation edges.
    v_bits = [0x00000001, 0x00400000, 0x00400001, 0x00800000, 0x00800001, 0x3F800000, 0x3F800001]
    v_bits += [0x7F000000, 0x7F000001, 0x7F7FFFFF]
    v = torch.tensor(v_bits, dtype=torch.int32).view(torch.float32)
    assert mxf.e8m0_round_up(v).tolist() == [0, 0, 1, 1, 2, 127, 128, 0xFE, 0xFE, 0xFE]
    assert mxf.e8m0_round_up(-v[:1]).tolist() == [0]  # -subnormal: sign bit is not the exponent


def test_torch_e8m0_cast_is_not_te_rule():
    """torch's float8_e8m0fnu cast does not round up like TE (the reason it is not used)."""
    amax = torch.tensor([448.0 * 1.25, 448.0 * 1.75, 448.0 * 1.9], dtype=torch.float32)
    te_rule = mxf.e8m0_from_amax(amax)
    assert te_rule.tolist() == [128, 128, 128]
    torch_rule = (amax / 448).to(torch.float8_e8m0fnu).view(torch.uint8)
    assert not torch.equal(te_rule, torch_rule)


# --------------------------------------------------------------------------------------------
# Element cast
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_cast_matches_brute_force_rne_for_every_bf16_in_range(fmt):
    """Every bf16 value with |x| <= fp8 max, quantised in blocks whose amax is the FP8 max.

    The block scale is then 2^0, so each code must be the round-nearest-even FP8 value of x
    (ties included: bf16 has more mantissa bits than either FP8 format).
    """
    top = mxf.fp8_max(fmt)
    bits = torch.arange(0, 0x10000, dtype=torch.int32).to(torch.int16)
    vals = bits.view(torch.bfloat16)
    keep = torch.isfinite(vals) & (vals.float().abs() <= top)
    vals = vals[keep]
    per_block = 31
    pad = (-vals.numel()) % (per_block * 32)
    vals = torch.cat([vals, torch.zeros(pad, dtype=torch.bfloat16)])
    blocks = vals.view(-1, per_block)
    x = torch.cat([blocks, torch.full((blocks.shape[0], 1), top, dtype=torch.bfloat16)], dim=1)
    q = mx.quantize(x.view(-1, 32), fmt, columnwise=False)
    assert set(q.rowwise_scale_inv[: x.numel() // 32, 0].tolist()) == {127}
    got = q.rowwise_data.view(-1, 32)[:, :per_block].reshape(-1).tolist()
    want = [ref_cast(v, fmt) for v in blocks.reshape(-1).float().tolist()]
    flat = blocks.reshape(-1).float().tolist()
    bad = [(v, g, w) for v, g, w in zip(flat, got, want, strict=True) if g != w]
    assert not bad, f"{len(bad)} mismatches, first: {bad[:5]}"


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_cast_ties_neighbours_and_saturation_fp32(fmt):
    """fp32 midpoints between FP8 values, one ulp either side, and values past the max."""
    values, _ = _positive_values(fmt)
    pts: list[float] = []
    for lo, hi in itertools.pairwise(values):
        mid = float((lo + hi) / 2)
        pts += [mid, math.nextafter(mid, 0.0), math.nextafter(mid, math.inf), float(hi)]
    top = float(values[-1])
    x = torch.tensor(pts + [-p for p in pts], dtype=torch.float32)
    x32 = torch.tensor(x.tolist(), dtype=torch.float64).float()  # the fp32 values actually used
    ones = torch.ones(x32.numel(), 1)
    codes = mx.scaled_cast(x32.view(-1, 1), ones, fmt, saturate=True).view(-1).tolist()
    want = [ref_cast(v, fmt) for v in x32.tolist()]
    assert codes == want
    over = torch.tensor([top * 1.01, top * 1.5, 1e30, math.inf, -1e30, -math.inf, math.nan])
    sat = mx.scaled_cast(
        over.view(-1, 1), torch.ones(7, 1), fmt, saturate=True, canonicalize_nan=True
    )
    mx_code = FMT[fmt][3]
    assert sat.view(-1).tolist() == [mx_code] * 4 + [0x80 | mx_code] * 2 + [0x7F]


# --------------------------------------------------------------------------------------------
# Whole-tensor quantise against the reference
# --------------------------------------------------------------------------------------------


def _wide_range(shape, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    mant = torch.rand(shape, generator=g) + 1
    exp = torch.randint(-140, 120, shape, generator=g).float()
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    return (sign * mant * torch.exp2(exp)).to(dtype)


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
        x = _wide_range((64, 64), 2)
    elif name == "wide_fp16":
        x = _wide_range((32, 64), 3, torch.float32).clamp(-6e4, 6e4).half()
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


# --------------------------------------------------------------------------------------------
# Distributed-optimizer path
# --------------------------------------------------------------------------------------------


def _cuts(numel: int, ranks: int, rng: random.Random) -> list[int]:
    inner = sorted(rng.randrange(numel + 1) for _ in range(ranks - 1))
    return [0, *inner, numel]


def _shard_cut_mismatches(
    ranks: int, trial: int, offset_of: Callable[[int], int] = lambda start: start
) -> list[str]:
    """Quantise a tensor as ``ranks`` shards cut at random offsets (partial block amaxes, their
    MAX, E8M0 scales, each shard cast into its slice) and name what differs from a full
    quantise (empty: none). ``offset_of`` maps a shard's start to the offset it is processed
    at (the identity, or a control's mutation)."""
    rng = random.Random(100 * ranks + trial)
    shape = rng.choice([(64, 96), (96, 160), (32, 256), (160, 64)])
    x = _wide_range(shape, trial) if trial % 2 else torch.randn(shape).bfloat16()
    if trial == 3:
        x.view(-1)[rng.randrange(x.numel())] = math.nan
    full = mx.quantize(x)
    flat = x.reshape(-1)
    cuts = _cuts(flat.numel(), ranks, rng)
    if trial == 0:
        cuts[1] = cuts[2] if ranks > 2 else cuts[1]  # an empty shard
    shards = list(itertools.pairwise(cuts))
    partial = [mxs.compute_partial_amax(flat[a:b], shape, offset_of(a)) for a, b in shards]
    amax_row = torch.stack([p[0] for p in partial]).amax(0)  # the MAX all-reduce
    amax_col = torch.stack([p[1] for p in partial]).amax(0)
    scale_row, scale_col = mxf.e8m0_from_amax(amax_row), mxf.e8m0_from_amax(amax_col)
    bad = []
    if not torch.equal(scale_row, full.rowwise_scale_inv):
        bad.append("rowwise scales")
    if not torch.equal(scale_col, full.columnwise_scale_inv):
        bad.append("columnwise scales")
    rows, cols = [], []
    for a, b in shards:
        rc, cc = mxs.partial_cast(flat[a:b], scale_row, scale_col, shape, offset_of(a))
        assert rc.numel() == b - a
        rows.append(rc)
        cols.append(cc)
    if not torch.equal(torch.cat(rows), full.rowwise_data.reshape(-1)):
        bad.append("rowwise codes")
    if not torch.equal(torch.cat(cols), full.columnwise_data.reshape(-1)):
        bad.append("columnwise codes")
    return bad


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("trial", range(6))
def test_shard_cuts_give_full_quantize_bytes(ranks, trial):
    assert _shard_cut_mismatches(ranks, trial) == []


@pytest.mark.parametrize("ranks", [2, 4])
def test_control_shards_processed_at_offset_zero_differ(ranks: int) -> None:
    """Control of ``test_shard_cuts_give_full_quantize_bytes``: when every shard is taken for
    the start of the tensor (offset 0), its elements fall into other blocks; the same
    comparison fails in every scale and code."""
    assert _shard_cut_mismatches(ranks, 1, offset_of=lambda start: 0) == [
        "rowwise scales",
        "columnwise scales",
        "rowwise codes",
        "columnwise codes",
    ]


def _sharded_hook_mismatches(ranks: int, hook: Callable[[torch.Tensor], None]) -> list[str]:
    """``quantize_shard`` on ``ranks`` threads (random cuts of one tensor) with the amax
    all-reduce ``hook``: what differs from a full quantise (any rank's scales, the gathered
    codes); empty when nothing does."""
    rng = random.Random(ranks)
    shape = (128, 96)
    x = _wide_range(shape, 7)
    full = mx.quantize(x)
    flat = x.reshape(-1)
    cuts = _cuts(flat.numel(), ranks, rng)
    results: dict[int, mxs.ShardQuantization] = {}

    def rank(i: int) -> None:
        a, b = cuts[i], cuts[i + 1]
        results[i] = mxs.quantize_shard(flat[a:b], shape, a, hook)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(ranks)), "a rank did not finish"
    bad = []
    for i in range(ranks):
        if not torch.equal(results[i].rowwise_scale_inv, full.rowwise_scale_inv):
            bad.append(f"rank {i} rowwise scales")
        if not torch.equal(results[i].columnwise_scale_inv, full.columnwise_scale_inv):
            bad.append(f"rank {i} columnwise scales")
    codes = torch.cat([results[i].rowwise_codes for i in range(ranks)])
    if not torch.equal(codes, full.rowwise_data.reshape(-1)):
        bad.append("rowwise codes")
    codes = torch.cat([results[i].columnwise_codes for i in range(ranks)])
    if not torch.equal(codes, full.columnwise_data.reshape(-1)):
        bad.append("columnwise codes")
    return bad


@pytest.mark.parametrize("ranks", [2, 4])
def test_quantize_shard_with_all_reduce_hook(ranks):
    assert _sharded_hook_mismatches(ranks, ThreadedMaxAllReduce(ranks)) == []


@pytest.mark.parametrize("ranks", [2, 4])
def test_control_quantize_shard_without_the_all_reduce_differs(ranks: int) -> None:
    """Control of ``test_quantize_shard_with_all_reduce_hook``: with an all-reduce that does
    nothing each rank scales by the amaxes of its own shard (blocks it does not touch count
    0); the same comparison fails on every rank's scales and in the columnwise codes (a
    32-row block spans the cuts)."""
    bad = _sharded_hook_mismatches(ranks, lambda buffer: None)
    assert {f"rank {i} columnwise scales" for i in range(ranks)} <= set(bad), bad
    assert "columnwise codes" in bad, bad


def test_shard_outside_tensor_refused():
    with pytest.raises(ValueError, match="does not fit"):
        mxs.compute_partial_amax(torch.zeros(10, dtype=torch.bfloat16), (32, 32), 1020)
    with pytest.raises(ValueError, match="2-D"):
        mxs.compute_partial_amax(torch.zeros(10, dtype=torch.bfloat16), (2, 32, 32), 0)


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
