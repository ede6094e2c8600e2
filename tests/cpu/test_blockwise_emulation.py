"""Blockwise FP8 (TE 2.20's Float8BlockScaling) emulation against exact references and TE itself.

The references use Python integers and ``fractions.Fraction`` only:

* scale (TE's ``compute_scale_from_amax``): ``amax = max(amax, eps)``; 1 for amax 0/inf/NaN;
  otherwise the fp32 nearest to ``fp8_max / amax`` (inf -> the input type's largest finite
  value), then rounded down to a power of two when ``force_pow_2_scales``;
* codes: the fp32 nearest to ``x * scale``, then the FP8 value nearest to that (ties to even),
  saturating at the largest finite value, NaN -> 0x7F.

TE's own classes run in a subprocess with the CPU backend active (as in test_te_backend.py), so
this process never imports TE or fixes megatron-core's TE flags.
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

from nemo_lw_fp8.cpu.formats import blockwise as bw
from nemo_lw_fp8.cpu.formats import blockwise_sharded_cast as bws
from nemo_lw_fp8.cpu.formats import mxfp8 as mx
from nemo_lw_fp8.cpu.formats import mxfp8_layout as mxf
from nemo_lw_fp8.cpu.te import backend as te_backend
from tests.support.te_test_support import TE_PATH, ThreadedMaxAllReduce, needs_te, run_te_script

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FMT = {E4M3: (3, 7, 0x7E), E5M2: (2, 15, 0x7B)}  # mantissa bits, bias, largest finite code
F32_MAX = float.fromhex("0x1.fffffep127")
BF16_MAX = float.fromhex("0x1.FEp127")

# --------------------------------------------------------------------------------------------
# Exact reference
# --------------------------------------------------------------------------------------------


def floor_log2(v: Fraction) -> int:
    e = v.numerator.bit_length() - v.denominator.bit_length()
    while Fraction(2) ** e > v:
        e -= 1
    while Fraction(2) ** (e + 1) <= v:
        e += 1
    return e


def fp32_nearest(v: Fraction) -> float:
    """|v| rounded to the nearest fp32 (ties to even, subnormals included; inf on overflow)."""
    v = abs(v)
    if v == 0:
        return 0.0
    quantum = Fraction(2) ** (max(floor_log2(v), -126) - 23)
    n, rem = divmod(v, quantum)
    if rem * 2 > quantum or (rem * 2 == quantum and n % 2 == 1):
        n += 1
    value = n * quantum
    return math.inf if value >= Fraction(2) ** 128 else float(value)


def fp32_nearest_of_double(v: float) -> float:
    """The same rounding for a finite double (exact: scaling by powers of two, then Python's
    round-half-even ``round``); used where the exact value is a double, e.g. the product of two
    fp32 numbers (48 significant bits)."""
    if v == 0:
        return v
    _, e = math.frexp(v)  # |v| = m * 2^e, 0.5 <= m < 1
    quantum = max(e - 24, -149)
    value = math.ldexp(round(math.ldexp(v, -quantum)), quantum)
    return math.copysign(math.inf, v) if abs(value) >= 2.0**128 else value


def f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def ref_scale(amax: float, fmax: float, pow2: bool, eps: float, inf_value: float) -> float:
    eps = f32(eps)
    if amax < eps:
        amax = eps
    if math.isinf(amax) or math.isnan(amax) or amax == 0:
        return 1.0
    scale = fp32_nearest(Fraction(fmax) / Fraction(amax))
    if math.isinf(scale):
        scale = inf_value
    if pow2:
        scale = 2.0 ** floor_log2(Fraction(scale))
    return scale


def _fp8_value(code: int, fmt: torch.dtype) -> Fraction:
    man, bias, _ = FMT[fmt]
    exp, frac = code >> man, code & ((1 << man) - 1)
    if exp == 0:
        return Fraction(frac) * Fraction(2) ** (1 - bias - man)
    return Fraction((1 << man) + frac) * Fraction(2) ** (exp - bias - man)


_VALUES: dict[torch.dtype, list[Fraction]] = {}


def ref_cast(v: float | Fraction, fmt: torch.dtype, negative: bool) -> int:
    """RNE, saturating (``__NV_SATFINITE``) cast of a value to an FP8 code; NaN -> 0x7F."""
    if isinstance(v, float) and math.isnan(v):
        return 0x7F
    top = FMT[fmt][2]
    if fmt not in _VALUES:
        _VALUES[fmt] = [_fp8_value(c, fmt) for c in range(top + 1)]
    values = _VALUES[fmt]
    sign = 0x80 if negative else 0
    if isinstance(v, float) and math.isinf(v):
        return sign | top
    a = abs(Fraction(v))
    if a >= values[-1]:
        return sign | top
    hi = bisect.bisect_left(values, a)
    if values[hi] == a:
        return sign | hi
    below, above = a - values[hi - 1], values[hi] - a
    if below < above or (below == above and (hi - 1) % 2 == 0):
        return sign | (hi - 1)
    return sign | hi


def ref_code(x: float, scale: float, fmt: torch.dtype) -> int:
    """``static_cast<fp8>(fp32(x) * scale)`` with exact arithmetic."""
    negative = math.copysign(1.0, x) < 0
    if math.isnan(x):
        return 0x7F
    if math.isinf(x):
        return ref_cast(x, fmt, negative)
    product = x * scale  # exact in a double: two 24-bit significands
    return ref_cast(Fraction(fp32_nearest_of_double(product)), fmt, negative)


def ref_quantize(x: torch.Tensor, fmt, block_dim: int, pow2: bool = True, eps: float = 0.0):
    """Per-block reference: rowwise codes [M, K], columnwise codes [M, K] (not transposed),
    and dicts of scale_inv per block key."""
    rows, cols = bw.flat_2d_shape(x.shape)
    inf_value = bw.value_for_inf(x.dtype)
    vals = x.reshape(rows, cols).float().tolist()
    fmax = bw.fp8_max(fmt)

    def block_scale(cells) -> float:
        amax = max((0.0 if math.isnan(vals[r][c]) else abs(vals[r][c])) for r, c in cells)
        return ref_scale(amax, fmax, pow2, eps, inf_value)

    def blocks(row_len: int, col_len: int):
        for r0 in range(0, rows, row_len):
            for c0 in range(0, cols, col_len):
                cells = [
                    (r, c)
                    for r in range(r0, min(r0 + row_len, rows))
                    for c in range(c0, min(c0 + col_len, cols))
                ]
                yield (r0 // row_len, c0 // col_len), cells

    out = []
    shapes = [(128, 128)] if block_dim == 2 else [(1, 128), (128, 1)]
    for row_len, col_len in shapes:
        codes = [[0] * cols for _ in range(rows)]
        scale_inv = {}
        for key, cells in blocks(row_len, col_len):
            scale = block_scale(cells)
            scale_inv[key] = fp32_nearest(1 / Fraction(scale))
            for r, c in cells:
                codes[r][c] = ref_code(vals[r][c], scale, fmt)
        out += [torch.tensor(codes, dtype=torch.uint8), scale_inv]
    if block_dim == 2:  # one scale per tile for both directions
        out += [out[0], dict(out[1])]
    return out


def _wide(shape, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    exps = torch.randint(-12, 12, shape, generator=g).float()
    return (base * torch.exp2(exps)).to(dtype)


def _with_specials(x: torch.Tensor) -> torch.Tensor:
    """NaN, inf, an all-zero region, tiny values (scale overflow) and -0 in chosen blocks."""
    x = x.clone()
    flat = x.view(-1, x.shape[-1])
    flat[0, 3 % flat.shape[1]] = math.nan
    if flat.shape[0] < 4:
        return x
    flat[1, :] = 0.0
    flat[2, 5] = -0.0
    # tiny values: the whole last band of rows when it is a short partial tile (so that 128x128
    # tiles hit the overflowing division too), else the last row (1x128 blocks)
    rows = flat.shape[0]
    band = (rows - 1) // 128 * 128
    start = band if 0 < rows - band <= 16 else rows - 1
    tiny = 2.0**-130 if x.dtype != torch.float16 else 2.0**-24
    signs = torch.tensor([(-1) ** i * (1 + i % 3) for i in range(flat.shape[1])])
    flat[start:, :] = tiny * signs
    if rows > 130:
        flat[129, 7] = math.inf
        flat[130, 8] = -math.inf
    return x


def _scales_dict(scale_inv: torch.Tensor, shape, block_dim: int, columnwise: bool) -> dict:
    """Map the emulation's padded scale_inv tensor to the reference's block keys."""
    rows, cols = bw.flat_2d_shape(shape)
    valid = bw.valid_scale_shape(shape, block_dim, columnwise)
    s = scale_inv[: valid[0], : valid[1]].tolist()
    out = {}
    for i in range(valid[0]):
        for j in range(valid[1]):
            if block_dim == 2:
                key = (j, i) if columnwise else (i, j)
            else:
                key = (i, j) if columnwise else (j, i)  # [m_block, col] / [k_block, row]
            out[key] = s[i][j]
    return out


# --------------------------------------------------------------------------------------------
# Scale rule
# --------------------------------------------------------------------------------------------


def _positive_finite(dtype: torch.dtype) -> torch.Tensor:
    bits = torch.arange(1, 0x8000, dtype=torch.int32).to(torch.int16)
    v = bits.view(dtype)
    return v[torch.isfinite(v)]


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_pow2_scale_matches_exact_reference_for_every_bf16_amax(fmt):
    amax = _positive_finite(torch.bfloat16)
    got = bw.compute_scale(amax, fmt, True, 0.0, BF16_MAX).tolist()
    fmax = bw.fp8_max(fmt)
    values = amax.float().tolist()
    # The closed form, for every positive finite bf16 amax: 2^floor(log2(fp8_max / amax)),
    # capped at 2^127 (where fp8_max / amax overflows fp32 and bf16's max is substituted).
    closed = [2.0 ** min(floor_log2(Fraction(fmax) / Fraction(a)), 127) for a in values]
    assert got == closed
    # ... which is TE's rule step by step (fp32 division, truncated mantissa); every 5th amax
    assert got[::5] == [ref_scale(a, fmax, True, 0.0, BF16_MAX) for a in values[::5]]
    # no element can exceed fp8_max after scaling
    assert all(a * s <= fmax for a, s in zip(values, got, strict=True))
    # fp16 amaxes never overflow the division
    amax16 = _positive_finite(torch.float16)
    got16 = bw.compute_scale(amax16, fmt, True, 0.0, 65504.0).tolist()
    assert got16 == [2.0 ** floor_log2(Fraction(fmax) / Fraction(a)) for a in amax16.tolist()]


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16])
def test_pow2_scale_inv_is_the_mxfp8_power_of_two(src):
    """scale_inv = 2^-floor(log2(fp8_max/amax)) = 2^ceil(log2(amax/fp8_max)): for every positive
    finite amax the same power of two as MXFP8's E8M0 rule (byte 0 read as 2^-127)."""
    amax = _positive_finite(src)
    for fmt in (E4M3, E5M2):
        e8m0 = mxf.e8m0_from_amax(amax, fmt)
        mxfp8 = torch.where(e8m0 == 0, 2.0**-127, mxf.dequantize_multipliers(e8m0))
        scale = bw.compute_scale(amax, fmt, True, 0.0, bw.value_for_inf(src))
        assert torch.equal(bw.scale_inv_from_scale(scale), mxfp8)


def test_fp32_scales_and_edge_mantissas_match_exact_reference():
    rng = random.Random(3)
    bits = [rng.randrange(1, 0x7F800000) for _ in range(1500)]
    # amax mantissas just around 1.75 (= 448 / 256): where rounding the division could matter
    for e in (-130, -100, -20, 0, 5, 60, 126):
        base = torch.tensor(1.75 * 2.0**e, dtype=torch.float32).view(torch.int32).item()
        bits += [base + d for d in range(-3, 4)]
    amax = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    values = amax.tolist()
    for fmt in (E4M3, E5M2):
        fmax = bw.fp8_max(fmt)
        for pow2 in (True, False):
            got = bw.compute_scale(amax, fmt, pow2, 0.0, F32_MAX).tolist()
            want = [ref_scale(a, fmax, pow2, 0.0, F32_MAX) for a in values]
            assert got == want, (fmt, pow2)
            if pow2:
                closed = [2.0 ** min(floor_log2(Fraction(fmax) / Fraction(a)), 127) for a in values]
                assert got == closed
    scales = bw.compute_scale(amax, E4M3, False, 0.0, F32_MAX)
    inv = bw.scale_inv_from_scale(scales).tolist()
    assert inv == [fp32_nearest(1 / Fraction(s)) for s in scales.tolist()]


def _is_power_of_two(v: Fraction) -> bool:
    return v.numerator & (v.numerator - 1) == 0 and v.denominator & (v.denominator - 1) == 0


@pytest.mark.parametrize("amaxes", ["every_bf16", "fp32_edge_mantissas"])
def test_control_scale_with_fp8_max_one_ulp_low_differs(amaxes: str) -> None:
    """Control of ``test_pow2_scale_matches_exact_reference_for_every_bf16_amax`` and
    ``test_fp32_scales_and_edge_mantissas_match_exact_reference``: the scale rule run with a
    limit one fp32 ulp below 448 must fail the same comparisons with the closed form, exactly
    at the amaxes where ``448 / amax`` is a power of two up to the 2^127 cap (there the true
    ratio is the power itself, the mutated one falls just under it and rounds down a whole
    power; at 2^128 both overflow or round to the cap), and the raw (not power-of-two) scale
    differs from TE's rule at least there."""
    if amaxes == "every_bf16":
        amax = _positive_finite(torch.bfloat16)
    else:
        bits = [1.75 * 2.0**e for e in (-130, -100, -20, 0, 5, 60, 126)]
        amax = torch.tensor(bits, dtype=torch.float32)
    fmax = bw.fp8_max(E4M3)
    below = torch.nextafter(torch.tensor(fmax), torch.tensor(0.0))  # fp32: one ulp below
    low = below.item()
    assert low == fmax - 2.0**-15  # 448 = 1.75 * 2^8: the fp32 ulp is 2^(8 - 23)
    values = amax.float().tolist()
    closed = [2.0 ** min(floor_log2(Fraction(fmax) / Fraction(a)), 127) for a in values]
    assert bw.compute_scale(amax, E4M3, True, 0.0, F32_MAX).tolist() == closed  # unmutated
    mutated = bw.compute_scale(amax, low, True, 0.0, F32_MAX).tolist()
    differ = {a for a, got, want in zip(values, mutated, closed, strict=True) if got != want}
    at_powers = {
        a
        for a in values
        if _is_power_of_two(Fraction(fmax) / Fraction(a))
        and floor_log2(Fraction(fmax) / Fraction(a)) <= 127
    }
    assert at_powers and differ == at_powers
    powers = sorted(at_powers)
    raw = bw.compute_scale(torch.tensor(powers), low, False, 0.0, F32_MAX).tolist()
    want_raw = [ref_scale(a, fmax, False, 0.0, F32_MAX) for a in powers]
    assert all(g != w for g, w in zip(raw, want_raw, strict=True))


ScaleRule = Callable[[torch.Tensor, torch.dtype, bool, float, float], torch.Tensor]


def _check_scale_specials(compute: ScaleRule) -> None:
    """The special cases of the scale rule, asserted on ``compute`` (``bw.compute_scale`` or a
    mutation of it)."""
    amax = torch.tensor([0.0, math.inf, math.nan, 2.0**-140, 1e-3, 448.0, 449.0, 3e38])
    got = compute(amax, E4M3, True, 0.0, BF16_MAX).tolist()
    assert got[:3] == [1.0, 1.0, 1.0], "amax 0 / inf / NaN -> scale 1"
    assert got[3] == 2.0**127, "448 / amax overflows fp32 -> bf16 max -> 2^127"
    assert got[5] == 1.0 and got[6] == 0.5  # rounded DOWN to a power of two
    assert got[7] == 2.0**-120  # 448 / 3e38 = 1.49e-36 = 2^-119.01...
    # without power-of-two scales the overflow substitute is the input type's max
    raw = compute(amax, E4M3, False, 0.0, BF16_MAX).tolist()
    assert raw[3] == BF16_MAX and raw[6] == f32(448.0 / 449.0), "overflow substitute"
    assert compute(amax[3:4], E4M3, False, 0.0, F32_MAX).item() == F32_MAX
    # amax_epsilon floors the amax (0 included)
    eps = compute(torch.tensor([0.0, 1e-9, 1.0]), E4M3, True, 1e-3, F32_MAX).tolist()
    assert eps == [ref_scale(a, 448.0, True, 1e-3, F32_MAX) for a in (0.0, 1e-9, 1.0)]
    assert eps[0] == eps[1] == 2.0**18


def test_scale_specials_epsilon_and_overflow():
    _check_scale_specials(bw.compute_scale)
    assert bw.value_for_inf(torch.float16) == 65504.0
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        bw.value_for_inf(torch.int32)


def test_control_scale_without_the_overflow_substitute_differs() -> None:
    """Control of ``test_scale_specials_epsilon_and_overflow``: a scale rule that leaves an
    overflowed ``fp8_max / amax`` at inf (no substitute for it) must fail the same checks, at
    the first one that meets an overflow."""

    def no_substitute(
        amax: torch.Tensor, fmt: torch.dtype, pow2: bool, eps: float, inf_value: float
    ) -> torch.Tensor:
        return bw.compute_scale(amax, fmt, pow2, eps, math.inf)

    with pytest.raises(AssertionError, match="overflows fp32"):
        _check_scale_specials(no_substitute)


# --------------------------------------------------------------------------------------------
# Element cast (shared with the MXFP8 emulation)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_cast_is_mxfp8_saturating_cast_and_exact(fmt):
    bits = torch.arange(-0x8000, 0x8000, dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.bfloat16).float()
    if fmt == E5M2:  # keep the (slow) reference short: every 7th pattern
        values = values[::7]
    got = bw.saturating_cast(values, fmt)
    one = torch.ones(())
    assert torch.equal(got, mx.scaled_cast(values, one, fmt, saturate=True, canonicalize_nan=True))
    want = [
        ref_cast(v if math.isnan(v) or math.isinf(v) else Fraction(v), fmt, math.copysign(1, v) < 0)
        for v in values.tolist()
    ]
    assert got.tolist() == want
    top = FMT[fmt][2]
    specials = torch.tensor([math.inf, -math.inf, math.nan, 1e30, -1e30, -0.0])
    want = [top, 0x80 | top, 0x7F, top, 0x80 | top, 0x80]
    assert bw.saturating_cast(specials, fmt).tolist() == want


# --------------------------------------------------------------------------------------------
# Quantise against the reference
# --------------------------------------------------------------------------------------------

CASES = [
    # shape, input dtype, fmt, block_dim, pow2, eps
    ((136, 140), torch.bfloat16, E4M3, 2, True, 0.0),
    ((136, 140), torch.bfloat16, E4M3, 1, True, 0.0),
    ((130, 136), torch.float32, E5M2, 2, False, 0.0),
    ((130, 136), torch.float16, E4M3, 1, False, 1e-4),
]


@pytest.mark.parametrize("shape,dtype,fmt,block_dim,pow2,eps", CASES)
def test_quantize_matches_reference(shape, dtype, fmt, block_dim, pow2, eps):
    x = _with_specials(_wide(shape, 11, dtype))
    got = bw.quantize(x, fmt, block_dim=block_dim, force_pow_2_scales=pow2, amax_epsilon=eps)
    row_codes, row_scales, col_codes, col_scales = ref_quantize(x, fmt, block_dim, pow2, eps)
    assert torch.equal(got.rowwise_data, row_codes)
    assert torch.equal(got.columnwise_data, col_codes.t())  # stored transposed
    assert _scales_dict(got.rowwise_scale_inv, shape, block_dim, False) == row_scales
    assert _scales_dict(got.columnwise_scale_inv, shape, block_dim, True) == col_scales
    # padding of the scale tensors: zeros here (uninitialised in TE)
    for scales, col in ((got.rowwise_scale_inv, False), (got.columnwise_scale_inv, True)):
        h, w = bw.valid_scale_shape(shape, block_dim, col)
        assert not scales[:, w:].any() and not scales[h:].any()


def _check_special_blocks() -> None:
    """TE's handling of inf, NaN and saturating values in 128x128 tiles, asserted on
    ``bw.quantize`` (as it stands or mutated by a control)."""
    x = torch.ones(128, 256, dtype=torch.bfloat16)
    x[0, 0] = math.inf  # tile (0, 0): amax inf -> scale 1, finite values cast directly
    x[5, 1] = 1000.0  # ... and saturate at 448
    x[0, 128] = math.nan  # tile (0, 1): NaN ignored by the amax, coded 0x7F
    d = bw.quantize(x)
    assert d.rowwise_scale_inv[0, :2].tolist() == [1.0, 2.0**-8], "tile scales"
    assert d.rowwise_data[0, 0].item() == 0x7E and d.rowwise_data[5, 1].item() == 0x7E
    assert d.rowwise_data[0, 128].item() == 0x7F
    assert d.rowwise_data[1, 128].item() == 0x78  # 1 * 2^8 = 256 (448 rounded down to 2^8)
    z = bw.quantize(torch.zeros(128, 128))
    assert d.rowwise_data.dtype == torch.uint8 and z.rowwise_scale_inv[0, 0].item() == 1.0


def test_special_blocks_behave_like_te():
    _check_special_blocks()


def test_control_special_blocks_with_nan_in_the_amax_differ(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Control of ``test_special_blocks_behave_like_te``: when a NaN element takes part in its
    tile's amax (plain ``abs`` instead of TE's ``fmaxf``, which drops NaN), the tile gets the
    special scale 1 and the same checks fail on the tile scales."""
    monkeypatch.setattr(bw, "abs_ignoring_nan", torch.abs)
    with pytest.raises(AssertionError, match="tile scales"):
        _check_special_blocks()


# --------------------------------------------------------------------------------------------
# Layouts, shapes and the exact-transpose rule
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,row2,col2,row1,col1",
    [
        ((256, 512), (2, 4), (4, 4), (4, 256), (2, 512)),
        ((4096, 1024), (32, 8), (8, 32), (8, 4096), (32, 1024)),
        ((8, 16, 4096), (1, 32), (32, 4), (32, 128), (1, 4096)),
        ((200, 300), (2, 4), (3, 4), (3, 200), (2, 300)),
        ((2, 96, 130), (2, 4), (2, 4), (2, 192), (2, 132)),
        ((1, 5), (1, 4), (1, 4), (1, 4), (1, 8)),
        ((7,), (1, 4), (1, 4), (1, 4), (1, 8)),
    ],
)
def test_scale_shapes_and_transposed_columnwise_layout(shape, row2, col2, row1, col1):
    assert bw.rowwise_scale_shape(shape, 2) == row2
    assert bw.columnwise_scale_shape(shape, 2) == col2
    assert bw.rowwise_scale_shape(shape, 1) == row1
    assert bw.columnwise_scale_shape(shape, 1) == col1
    if math.prod(shape) > 300_000:
        return  # shapes only
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5)).bfloat16()
    for block_dim in (1, 2):
        d = bw.quantize(x, block_dim=block_dim)
        assert tuple(d.rowwise_data.shape) == tuple(shape)
        assert tuple(d.columnwise_data.shape) == (shape[-1], *shape[:-1])
        assert d.rowwise_scale_inv.dtype == d.columnwise_scale_inv.dtype == torch.float32
        # each direction dequantises to the same tensor shape, close to the input
        for use in ("rowwise", "columnwise"):
            y = bw.dequantize(d, torch.float32, use=use)
            assert y.shape == x.shape
            err = (y - x.float()).abs()
            assert bool((err <= x.float().abs() * 2.0**-4 + 2.0**-14).all())


Derive = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _transpose_mismatches(derive: Derive) -> list[tuple[tuple[int, ...], str, str]]:
    """(shape, format, what) wherever the columnwise form ``derive`` makes from the rowwise
    one differs from a direct columnwise quantisation of 128x128 tiles; empty when none does."""
    bad: list[tuple[tuple[int, ...], str, str]] = []
    for shape, seed in [((256, 384), 0), ((200, 300), 1), ((3, 100, 260), 2), ((1, 129), 3)]:
        x = _with_specials(_wide(shape, seed)) if len(shape) == 2 else _wide(shape, seed)
        for fmt in (E4M3, E5M2):
            full = bw.quantize(x, fmt, block_dim=2)
            rowwise_only = bw.quantize(x, fmt, block_dim=2, columnwise=False)
            col_only = bw.quantize(x, fmt, block_dim=2, rowwise=False)
            data, scale_inv = derive(rowwise_only.rowwise_data, rowwise_only.rowwise_scale_inv)
            rows, cols = bw.flat_2d_shape(shape)
            checks = {
                "data": torch.equal(data, col_only.columnwise_data),
                "scales": torch.equal(scale_inv, col_only.columnwise_scale_inv),
                "data of both": torch.equal(data, full.columnwise_data),
                "transpose": torch.equal(
                    data.reshape(cols, rows), full.rowwise_data.reshape(rows, cols).t()
                ),
            }
            bad += [(shape, str(fmt), what) for what, ok in checks.items() if not ok]
    return bad


def test_columnwise_of_128x128_tiles_is_exact_transpose_of_rowwise():
    assert _transpose_mismatches(bw.columnwise_from_rowwise) == []
    # 1x128 blocks: the two directions have different scales, so no such rule
    x = _wide((256, 256), 9)
    d = bw.quantize(x, block_dim=1)
    assert not torch.equal(d.columnwise_data, d.rowwise_data.t())


def test_control_columnwise_with_untransposed_tile_scales_differs() -> None:
    """Control of ``test_columnwise_of_128x128_tiles_is_exact_transpose_of_rowwise``: a
    derivation that transposes the codes but lays the tile scales out in rowwise order
    (read row-major into the columnwise grid) must fail the same comparison, in the scales
    only, and only where the tile grid has more than one tile row and column."""

    def scales_not_transposed(
        data: torch.Tensor, scale_inv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        codes, good = bw.columnwise_from_rowwise(data, scale_inv)
        rows, cols = bw.flat_2d_shape(tuple(data.shape))
        m_tiles, k_tiles = bw.ceil_div(rows, 128), bw.ceil_div(cols, 128)
        wrong = torch.zeros_like(good)
        wrong[:, :m_tiles] = scale_inv[:, :k_tiles].reshape(k_tiles, m_tiles)
        return codes, wrong

    bad = _transpose_mismatches(scales_not_transposed)
    # (256, 384): 2 x 3 tiles, (200, 300): 2 x 3 tiles; (3, 100, 260) is 3 x 3 tiles; the
    # single-tile-row (1, 129) cannot tell the two orders apart.
    assert {what for _, _, what in bad} == {"scales"}
    assert {shape for shape, _, _ in bad} == {(256, 384), (200, 300), (3, 100, 260)}


def test_refused_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="float8_e4m3fn or torch.float8_e5m2"):
        bw.quantize(torch.zeros(128, 128), torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        bw.quantize(torch.zeros(128, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_dim"):
        bw.quantize(torch.zeros(128, 128), block_dim=3)
    with pytest.raises(ValueError, match="128x128"):
        bw.columnwise_from_rowwise(torch.zeros(256, 256, dtype=torch.uint8), torch.zeros(1, 4))
    with pytest.raises(ValueError, match="does not fit"):
        bws.compute_partial_amax(torch.zeros(10), (128, 128), 128 * 128 - 5)
    with pytest.raises(ValueError, match="2-D"):
        bws.compute_partial_amax(torch.zeros(10), (2, 128, 128), 0)
    empty = bw.quantize(torch.zeros(0, 256))
    assert empty.rowwise_data.shape == (0, 256) and empty.columnwise_data.shape == (256, 0)
    assert empty.rowwise_scale_inv.shape == (0, 4)


def test_wire_bytes_ratio():
    """FP8 codes + fp32 scale per 128x128 tile versus bf16: (1 + 4/128^2) / 2 = 4097 / 8192."""
    for shape in [(4096, 4096), (1024, 512), (8192, 2048)]:
        rows, cols = shape
        fp8 = bw.wire_bytes(shape)
        assert Fraction(fp8, 2 * rows * cols) == Fraction(4097, 8192)
    # padding of the scale rows to a multiple of 4 tiles: counted only when padded=True
    assert bw.wire_bytes((128, 128)) == 128 * 128 + 4 * 4
    assert bw.wire_bytes((128, 128), padded=False) == 128 * 128 + 4
    # 1x128 blocks (activations) carry 128x more scales: (1 + 4/128) / 2
    assert Fraction(bw.wire_bytes((4096, 4096), 1), 2 * 4096 * 4096) == Fraction(33, 64)


def test_linear_backward_quantizes_as_te_float8_block_scaling():
    """BlockwiseFP8Linear's GEMM operands (bf16 weight, quantised on the fly) at widths that
    leave partial blocks: forward Q1x128(x) Q128x128(W)^T; dgrad Q_row(dy) (1x128 along out) @
    W; wgrad Q_col(dy)^T (128x1 along tokens) @ Q_col(x) (128x1); bias grad from raw dy."""
    from nemo_lw_fp8.cpu.layers.blockwise_linear import BlockwiseFP8Linear

    torch.manual_seed(0)
    tokens, k, n = 200, 96, 160
    layer = BlockwiseFP8Linear(k, n, fp8_params=False)
    layer.bias.data.normal_()
    x = torch.randn(tokens, k, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, n, dtype=torch.bfloat16)
    y = layer(x)
    y.backward(dy)

    def q(t, block_dim, use, dtype=E4M3):
        data = bw.quantize(
            t, dtype, block_dim=block_dim, rowwise=use == "rowwise", columnwise=use == "columnwise"
        )
        return bw.dequantize(data, t.dtype, use=use).float()

    w_q = q(layer.weight.detach(), 2, "rowwise")
    expected_y = (q(x.detach(), 1, "rowwise") @ w_q.t() + layer.bias.float()).bfloat16()
    assert torch.equal(y, expected_y)
    expected_dx = (q(dy, 1, "rowwise") @ w_q).bfloat16()
    expected_dw = (q(dy, 1, "columnwise").t() @ q(x.detach(), 1, "columnwise")).bfloat16()
    assert torch.equal(x.grad, expected_dx)
    assert torch.equal(layer.weight.grad, expected_dw)
    assert torch.equal(layer.bias.grad, dy.sum(0))
    # The quantisation of dy is visible: unquantised dy gives other gradients.
    assert not torch.equal(x.grad, (dy.float() @ w_q).bfloat16())
    unquantized_dw = (dy.float().t() @ q(x.detach(), 1, "columnwise")).bfloat16()
    assert not torch.equal(layer.weight.grad, unquantized_dw)


# --------------------------------------------------------------------------------------------
# Distributed-optimizer path
# --------------------------------------------------------------------------------------------


def _cuts(numel: int, ranks: int, rng: random.Random) -> list[int]:
    return [0, *sorted(rng.randrange(numel + 1) for _ in range(ranks - 1)), numel]


def _shard_cut_mismatches(
    ranks: int, trial: int, offset_of: Callable[[int], int] = lambda start: start
) -> list[str]:
    """Quantise a tensor as ``ranks`` shards cut at random offsets (partial amaxes, their MAX,
    each shard cast into its slice) and name what differs from a full quantise (empty: none).
    ``offset_of`` maps a shard's start to the offset it is processed at (the identity, or a
    control's mutation)."""
    rng = random.Random(10 * ranks + trial)
    shape = [(256, 384), (200, 300), (128, 128), (384, 136), (130, 1000)][trial]
    master = _wide(shape, trial, torch.float32)
    if trial == 1:
        master.view(-1)[rng.randrange(master.numel())] = math.nan
    x = master.bfloat16()  # TE casts the fp32 master shard to the weight's dtype first
    full = bw.quantize(x)
    flat = x.reshape(-1)
    cuts = _cuts(flat.numel(), ranks, rng)
    if trial == 0 and ranks == 4:
        cuts[2] = cuts[1]  # an empty shard
    shards = list(itertools.pairwise(cuts))
    partial = [bws.compute_partial_amax(flat[a:b], shape, offset_of(a)) for a, b in shards]
    amax = torch.stack(partial).amax(0)  # the MAX all-reduce
    scale = bw.compute_scale(amax, E4M3, True, 0.0, bw.FLT_MAX)
    scale_inv = bw.scale_inv_from_scale(scale)
    h, w = bw.valid_scale_shape(shape)
    bad = []
    if not torch.equal(scale_inv[:h, :w], full.rowwise_scale_inv[:h, :w]):
        bad.append("scales")
    if not bool((scale_inv[:, w:] == 1.0).all()):  # padding: amax 0 -> scale 1
        bad.append("scale padding")
    codes = [bws.partial_cast(flat[a:b], scale, shape, offset_of(a)) for a, b in shards]
    assert [c.numel() for c in codes] == [b - a for a, b in shards]
    if not torch.equal(torch.cat(codes), full.rowwise_data.reshape(-1)):
        bad.append("codes")
    return bad


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("trial", range(5))
def test_shard_cuts_give_full_quantize_bytes(ranks, trial):
    assert _shard_cut_mismatches(ranks, trial) == []


@pytest.mark.parametrize("ranks", [2, 4])
def test_control_shards_processed_at_offset_zero_differ(ranks: int) -> None:
    """Control of ``test_shard_cuts_give_full_quantize_bytes``: when every shard is taken for
    the start of the tensor (offset 0), its elements fall into other tiles; the same
    comparison fails in the codes (in the scales too where a moved element carries a tile's
    amax, as at 4 ranks)."""
    bad = _shard_cut_mismatches(ranks, 0, offset_of=lambda start: 0)
    assert "codes" in bad, bad


def _sharded_hook_mismatches(ranks: int, hook: Callable[[torch.Tensor], None]) -> list[str]:
    """``quantize_shard`` on ``ranks`` threads (random cuts of one tensor) with the amax
    all-reduce ``hook``: what differs from a full quantise (scales on any rank, the gathered
    codes, the columnwise form derived from them); empty when nothing does."""
    rng = random.Random(ranks)
    shape = (384, 260)
    x = _wide(shape, 7)
    full = bw.quantize(x)
    flat = x.reshape(-1)
    cuts = _cuts(flat.numel(), ranks, rng)
    results: dict[int, bws.ShardQuantization] = {}

    def rank(i: int) -> None:
        results[i] = bws.quantize_shard(flat[cuts[i] : cuts[i + 1]], shape, cuts[i], hook)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(ranks)), "a rank did not finish"
    h, w = bw.valid_scale_shape(shape)
    bad = []
    if not all(
        torch.equal(results[i].scale_inv[:h, :w], full.rowwise_scale_inv[:h, :w])
        for i in range(ranks)
    ):
        bad.append("scales")
    gathered = torch.cat([results[i].codes for i in range(ranks)]).view(shape)
    if not torch.equal(gathered, full.rowwise_data):
        bad.append("codes")
    # what the owner would do after the gather: derive the columnwise form locally
    data, scale_inv = bw.columnwise_from_rowwise(gathered, results[0].scale_inv)
    if not torch.equal(data, full.columnwise_data):
        bad.append("columnwise codes")
    if not torch.equal(scale_inv[:w, :h], full.columnwise_scale_inv[:w, :h]):
        bad.append("columnwise scales")
    return bad


@pytest.mark.parametrize("ranks", [2, 4])
def test_quantize_shard_with_all_reduce_hook(ranks):
    assert _sharded_hook_mismatches(ranks, ThreadedMaxAllReduce(ranks)) == []


@pytest.mark.parametrize("ranks", [2, 4])
def test_control_quantize_shard_without_the_all_reduce_differs(ranks: int) -> None:
    """Control of ``test_quantize_shard_with_all_reduce_hook``: with an all-reduce that does
    nothing each rank scales by the amaxes of its own shard (tiles it does not touch count 0);
    the same comparison fails in the scales and in the codes of the tiles a cut splits."""
    bad = _sharded_hook_mismatches(ranks, lambda buffer: None)
    assert "scales" in bad and "codes" in bad, bad


# --------------------------------------------------------------------------------------------
# TE 2.20.2's own classes over the emulated extension (subprocess)
# --------------------------------------------------------------------------------------------


TE_SCRIPT = r"""
import json, math, random, threading
import torch
from nemo_lw_fp8.cpu.te import activate
R = {"backend": activate()}
import transformer_engine_torch as tex
from transformer_engine.common.recipe import Float8BlockScaling, Format
from transformer_engine.pytorch.quantization import Float8BlockScalingRecipeState
from transformer_engine.pytorch.tensor.float8_blockwise_tensor import (
    Float8BlockQuantizer, Float8BlockwiseQTensor)
from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
    Float8BlockwiseQTensorStorage)
from transformer_engine.pytorch.tensor.utils import (
    cast_master_weights_to_fp8, post_all_gather_processing, quantize_master_weights)
from nemo_lw_fp8.cpu.formats import blockwise as bw
import megatron.core.fp8_utils as fu

FMTS = {"e4m3": (torch.float8_e4m3fn, tex.DType.kFloat8E4M3),
        "e5m2": (torch.float8_e5m2, tex.DType.kFloat8E5M2)}

def same(a, b):
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))

# --- which blocks the recipe uses where
state = Float8BlockScalingRecipeState(Float8BlockScaling(), mode="forward", num_quantizers=3,
                                      device=torch.device("cpu"))
R["fwd_block_dims"] = [q.block_scaling_dim for q in state.make_quantizers()]
R["fwd_pow2"] = [q.force_pow_2_scales for q in state.make_quantizers()]
state = Float8BlockScalingRecipeState(Float8BlockScaling(fp8_format=Format.HYBRID),
                                      mode="backward", num_quantizers=2,
                                      device=torch.device("cpu"))
R["bwd_block_dims"] = [q.block_scaling_dim for q in state.make_quantizers()]
R["bwd_dtypes"] = [int(q.dtype) for q in state.make_quantizers()]

# --- bytes of TE's tensors == the emulation's, in every quantizer setting
mismatch = []
torch.manual_seed(0)
shapes = [(256, 384), (200, 300), (2, 96, 260)]
for shape in shapes:
    base = (torch.randn(shape) * torch.exp2(torch.randint(-10, 10, shape).float())).bfloat16()
    base.view(-1)[11] = float("nan")
    for fmt_name, (fmt, te_fmt) in FMTS.items():
        for bd in (1, 2):
            for usage in ((True, True), (True, False), (False, True)):
                for pow2, eps in ((True, 0.0), (False, 0.0), (True, 1e-2)):
                    key = f"{shape} {fmt_name} {bd}D {usage} pow2={pow2} eps={eps}"
                    q = Float8BlockQuantizer(te_fmt, rowwise=usage[0], columnwise=usage[1],
                                             block_scaling_dim=bd, force_pow_2_scales=pow2,
                                             amax_epsilon=eps)
                    for name, want in (("row", q.get_scale_shape(shape, False)),
                                       ("col", q.get_scale_shape(shape, True))):
                        got = (bw.rowwise_scale_shape if name == "row"
                               else bw.columnwise_scale_shape)(shape, bd)
                        if tuple(want) != tuple(got):
                            mismatch.append(f"{key} {name} scale shape {want} != {got}")
                    if tuple(q.get_columnwise_shape(shape)) != bw.columnwise_data_shape(shape):
                        mismatch.append(f"{key} columnwise shape")
                    t = q(base)
                    ref = bw.quantize(base, fmt, block_dim=bd, rowwise=usage[0],
                                      columnwise=usage[1], force_pow_2_scales=pow2,
                                      amax_epsilon=eps)
                    if not isinstance(t, Float8BlockwiseQTensor) or t._is_2D_scaled != (bd == 2):
                        mismatch.append(f"{key} type")
                    for n in ("rowwise_data", "rowwise_scale_inv", "columnwise_data",
                              "columnwise_scale_inv"):
                        if not same(getattr(t, "_" + n), getattr(ref, n)):
                            mismatch.append(f"{key} {n}")
                    got = t.dequantize(dtype=torch.float32)
                    want = bw.dequantize(ref, torch.float32)
                    if not torch.equal(got.nan_to_num(), want.nan_to_num()):
                        mismatch.append(f"{key} dequantize")
R["quantize_mismatches"] = mismatch

x = torch.randn(256, 384).bfloat16()
y = torch.randn(256, 384).bfloat16()
# columnwise-only dequantize (transposed data) in TE's Python == emulation
for bd in (1, 2):
    t = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True,
                             block_scaling_dim=bd)(x)
    t.update_usage(rowwise_usage=False)
    R[f"dequant_columnwise_{bd}d"] = torch.equal(
        t.dequantize(), bw.dequantize(bw.quantize(x, block_dim=bd), use="columnwise"))

# megatron-core sees an FP8 (quantized) parameter, not an MXFP8 one
q = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True)
p = torch.nn.Parameter(q(x), requires_grad=False)
R["megatron"] = [fu.HAVE_TE, fu.HAVE_TE_FP8_TENSOR_CLASS, fu.is_float8tensor(p),
                 fu.is_mxfp8tensor(p), isinstance(p, Float8BlockwiseQTensor)]
try:
    from megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision import (
        is_blockwise_float8tensor)
    R["megatron_fsdp_blockwise"] = bool(is_blockwise_float8tensor(p))
except ImportError as exc:
    R["megatron_fsdp_blockwise"] = repr(exc)

# internal quantizer -> storage class; in-place paths; noop; derived columnwise
q = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True)
q.internal = True
R["internal_type"] = type(q(x)).__name__
t = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True)(x)
keep = t._rowwise_data.data_ptr()
t.quantize_(y)
ry = bw.quantize(y)
R["quantize_inplace"] = [torch.equal(t._rowwise_data, ry.rowwise_data),
                         torch.equal(t._columnwise_data, ry.columnwise_data),
                         torch.equal(t._rowwise_scale_inv, ry.rowwise_scale_inv),
                         t._rowwise_data.data_ptr() == keep]
t.copy_(x)
R["copy_from_plain"] = torch.equal(t._rowwise_data, bw.quantize(x).rowwise_data)
before = t._rowwise_data.clone()
tex.quantize(y, t._quantizer, t, torch.ones(1))
R["noop_flag"] = torch.equal(t._rowwise_data, before)
t.update_usage(rowwise_usage=True, columnwise_usage=False)
t.update_usage(rowwise_usage=True, columnwise_usage=True)  # _create_columnwise: fp8_transpose
rx = bw.quantize(x)
R["create_columnwise"] = [torch.equal(t._columnwise_data, rx.columnwise_data),
                          torch.equal(t._columnwise_scale_inv[:3, :2],
                                      rx.columnwise_scale_inv[:3, :2])]

# --- TE's quantize_master_weights with simulated ranks (threads + MAX all-reduce)
class ThreadedMaxAllReduce:
    def __init__(self, world):
        self.barrier = threading.Barrier(world)
        self.lock = threading.Lock(); self.buffers = []
    def __call__(self, tensor, op=None, group=None, async_op=False):
        with self.lock:
            self.buffers.append(tensor)
        self.barrier.wait()
        reduced = torch.stack(self.buffers).amax(0)
        self.barrier.wait()
        tensor.copy_(reduced)
        self.barrier.wait()
        with self.lock:
            self.buffers.clear()

def no_all_reduce(tensor, op=None, group=None, async_op=False):
    pass  # the control's mutation: each rank keeps the amaxes of its own shard

dist, dist_control = [], []
rng = random.Random(5)
for world, api, control in ((2, quantize_master_weights, False),
                            (4, cast_master_weights_to_fp8, False),
                            (4, quantize_master_weights, False),
                            (2, quantize_master_weights, True)):
    wshapes = [(256, 384), (200, 300), (128, 128)]
    masters = [torch.randn(s) * 3 for s in wshapes]
    full = [bw.quantize(m.bfloat16()) for m in masters]
    torch.distributed.all_reduce = no_all_reduce if control else ThreadedMaxAllReduce(world)
    make = lambda s: Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True,
                                          columnwise=True)(torch.zeros(s, dtype=torch.bfloat16))
    models = [[make(s) for s in wshapes] for _ in range(world)]
    cuts = [[0, *sorted(rng.randrange(m.numel() + 1) for _ in range(world - 1)), m.numel()]
            for m in masters]
    errors = []
    def rank(r):
        try:
            shards, offsets = [], []
            for i, m in enumerate(masters):
                a, b = cuts[i][r], cuts[i][r + 1]
                shards.append(m.reshape(-1)[a:b] if b > a else None)
                offsets.append(a)
            api(models[r], shards, offsets, group=None)
        except BaseException as exc:
            errors.append(repr(exc)); raise
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    [th.start() for th in threads]; [th.join() for th in threads]
    ok = not errors
    for i, shape in enumerate(wshapes):
        h, w = bw.valid_scale_shape(shape)
        gathered = torch.cat([models[r][i]._rowwise_data.reshape(-1)[cuts[i][r]:cuts[i][r + 1]]
                              for r in range(world)])
        ok &= torch.equal(gathered, full[i].rowwise_data.reshape(-1))
        for r in range(world):
            s = models[r][i]._rowwise_scale_inv
            ok &= torch.equal(s[:h, :w], full[i].rowwise_scale_inv[:h, :w])
            ok &= bool((s[:, w:] == 1.0).all())
            ok &= models[r][i]._columnwise_data is None  # dropped until after the gather
        # the all-gather, then TE's post-processing derives the columnwise form locally
        weight = models[0][i]
        weight._rowwise_data.copy_(gathered.view(shape))
        post_all_gather_processing([weight])
        ok &= torch.equal(weight._columnwise_data, full[i].columnwise_data)
        ok &= torch.equal(weight._columnwise_scale_inv[:w, :h],
                          full[i].columnwise_scale_inv[:w, :h])
    (dist_control if control else dist).append([world, api.__name__, bool(ok), errors])
R["distributed"] = dist
R["distributed_control"] = dist_control

# --- megatron's attributes on a quantized weight survive a module-wide cast (Float16Module's
# module.bfloat16()), as TE's TransformerEngineBaseModule._apply keeps them; the control puts
# torch's own Module._apply back, whose swap_tensors drops them
from nemo_lw_fp8.cpu.layers.blockwise_linear import BlockwiseFP8Linear
from nemo_lw_fp8.cpu.layers.mxfp8_linear import MXFP8Linear, QuantizedParamModule
from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
kept = {}
for cls in (BlockwiseFP8Linear, MXFP8Linear):
    for cast in ("module", "torch"):
        layer = cls(128, 64, bias=False, fp8_params=True)
        param = layer.weight
        param.allreduce = False
        keeping = QuantizedParamModule._apply
        if cast == "torch":
            QuantizedParamModule._apply = torch.nn.Module._apply
        try:
            layer.bfloat16()
        finally:
            QuantizedParamModule._apply = keeping
        kept[f"{cls.__name__} {cast}"] = [layer.weight is param,
                                          getattr(layer.weight, "allreduce", None)]
R["cast_keeps_attributes"] = kept
R["te_module_has_apply"] = "_apply" in vars(TransformerEngineBaseModule)
print("RESULT " + json.dumps(R))
"""


@pytest.fixture(scope="module")
def te_results() -> dict:
    if TE_PATH is None:
        pytest.skip("Transformer Engine's Python package is not installed")
    return run_te_script(TE_SCRIPT)


@needs_te
def test_recipe_uses_128x128_for_weights_and_1x128_elsewhere(te_results):
    r = te_results
    assert r["backend"] == "emulated"
    assert r["fwd_block_dims"] == [1, 2, 1]  # input, weight, output
    assert r["fwd_pow2"] == [True, True, True]
    assert r["bwd_block_dims"] == [1, 1]  # grad_output, grad_input
    assert r["bwd_dtypes"] == [8, 8]  # HYBRID: e5m2 gradients


@needs_te
def test_te_quantizer_bytes_equal_emulation(te_results):
    r = te_results
    assert r["quantize_mismatches"] == []
    assert r["dequant_columnwise_1d"] and r["dequant_columnwise_2d"]
    assert r["internal_type"] == "Float8BlockwiseQTensorStorage"
    assert r["quantize_inplace"] == [True, True, True, True]
    assert r["copy_from_plain"] and r["noop_flag"]
    assert r["create_columnwise"] == [True, True]


@needs_te
def test_megatron_recognises_blockwise_parameter(te_results):
    have_te, have_class, is_fp8, is_mxfp8, is_blockwise = te_results["megatron"]
    assert have_te and have_class and is_fp8 and is_blockwise
    assert is_mxfp8 is False
    assert te_results["megatron_fsdp_blockwise"] is True


@needs_te
def test_module_cast_keeps_megatron_attributes_of_quantized_weights(te_results):
    """Issue 14: expert weights that lost ``allreduce=False`` in the Float16Module cast were
    reduced and sharded as dense ones (Hopper twins, FP8 param gather on != off)."""
    assert te_results["te_module_has_apply"]  # the TE behaviour emulated
    kept = te_results["cast_keeps_attributes"]
    for name in ("BlockwiseFP8Linear", "MXFP8Linear"):
        assert kept[f"{name} module"] == [True, False]
        assert kept[f"{name} torch"] == [True, None]  # control: torch's swap drops it


@needs_te
def test_te_quantize_master_weights_shards(te_results):
    for world, api, ok, errors in te_results["distributed"]:
        assert ok and not errors, (world, api, errors)


@needs_te
def test_control_te_quantize_master_weights_without_the_all_reduce_differs(te_results):
    """Control of ``test_te_quantize_master_weights_shards``: TE's ``quantize_master_weights``
    on 2 simulated ranks whose amax all-reduce does nothing (each rank scales its shard by the
    amaxes of that shard alone) completes, and the same checks fail."""
    [(world, api, ok, errors)] = te_results["distributed_control"]
    assert (world, api, errors) == (2, "quantize_master_weights", [])
    assert ok is False


# --------------------------------------------------------------------------------------------
# Hopper / Blackwell: the emulation against TE's real kernels
# --------------------------------------------------------------------------------------------


def _te_gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (9, 0):
        return f"TE's blockwise FP8 needs compute capability >= 9.0, this GPU is {major}.{minor}"
    if not te_backend._extension_file_present():
        return "real Transformer Engine (transformer-engine[pytorch]) is not installed"
    return None


@pytest.mark.gpu
def test_emulation_matches_te_kernels_on_gpu():
    reason = _te_gpu_reason()
    if reason is not None:
        pytest.skip(reason)
    assert te_backend.activate() == "transformer_engine"
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.optimizers.multi_tensor_apply import multi_tensor_applier
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    te_fmt = {E4M3: tex.DType.kFloat8E4M3, E5M2: tex.DType.kFloat8E5M2}
    cases = [_wide((256, 512), 0), _wide((4096, 1024), 1), _wide((200, 300), 2)]
    cases += [_wide((2, 96, 260), 3), _with_specials(_wide((384, 256), 4))]
    cases += [_with_specials(_wide((256, 384), 5, torch.float32))]
    cases += [_with_specials(_wide((256, 256), 6, torch.float16))]
    failures = []
    for x in cases:
        for fmt, block_dim, pow2, eps in itertools.product(
            (E4M3, E5M2), (1, 2), (True, False), (0.0, 1e-3)
        ):
            key = f"{tuple(x.shape)} {x.dtype} {fmt} {block_dim}D pow2={pow2} eps={eps}"
            q = Float8BlockQuantizer(
                te_fmt[fmt],
                rowwise=True,
                columnwise=True,
                block_scaling_dim=block_dim,
                force_pow_2_scales=pow2,
                amax_epsilon=eps,
            )
            t = q(x.cuda())
            ref = bw.quantize(
                x, fmt, block_dim=block_dim, force_pow_2_scales=pow2, amax_epsilon=eps
            )
            for direction in ("rowwise", "columnwise"):
                got = getattr(t, f"_{direction}_data").cpu()
                if not torch.equal(got, getattr(ref, f"{direction}_data")):
                    failures.append(f"{key} {direction}_data")
                h, w = bw.valid_scale_shape(x.shape, block_dim, direction == "columnwise")
                got = getattr(t, f"_{direction}_scale_inv").cpu()[:h, :w]
                if not torch.equal(got, getattr(ref, f"{direction}_scale_inv")[:h, :w]):
                    failures.append(f"{key} {direction}_scale_inv")
            deq = t.dequantize(dtype=torch.float32).cpu()
            if not torch.equal(deq.nan_to_num(), bw.dequantize(ref, torch.float32).nan_to_num()):
                failures.append(f"{key} dequantize")

    # fp8_transpose and the distributed-optimizer kernels
    x = _with_specials(_wide((384, 300), 8, torch.float32)).bfloat16()
    rowwise = bw.quantize(x).rowwise_data
    transposed = tex.fp8_transpose(rowwise.cuda(), tex.DType.kFloat8E4M3, out=None)
    if not torch.equal(transposed.cpu(), rowwise.t().contiguous()):
        failures.append("fp8_transpose")
    shape, start, n = (384, 300), 12345, 50000
    shard = x.reshape(-1)[start : start + n].contiguous()
    amax = torch.zeros(bw.rowwise_scale_shape(shape), dtype=torch.float32, device="cuda")
    tex.fp8_block_scaling_compute_partial_amax(shard.cuda(), amax, *shape, start, 128)
    want_amax = bws.compute_partial_amax(shard, shape, start)
    if not torch.equal(amax.cpu(), want_amax):
        failures.append("partial amax")
    for pow2 in (True, False):
        scale, scale_inv = torch.empty_like(amax), torch.empty_like(amax)
        multi_tensor_applier(
            tex.multi_tensor_compute_scale_and_scale_inv,
            torch.zeros(1, dtype=torch.int, device="cuda"),
            [[amax], [scale], [scale_inv]],
            448.0,
            pow2,
            0.0,
        )
        want = bw.compute_scale(want_amax, E4M3, pow2, 0.0, bw.FLT_MAX)
        if not (
            torch.equal(scale.cpu(), want)
            and torch.equal(scale_inv.cpu(), bw.scale_inv_from_scale(want))
        ):
            failures.append(f"compute_scale_and_scale_inv pow2={pow2}")
        out = torch.zeros(x.numel(), dtype=torch.uint8, device="cuda")
        fragment = out[start : start + n]
        tex.fp8_block_scaling_partial_cast(
            shard.cuda(), fragment, scale, *shape, start, 128, tex.DType.kFloat8E4M3
        )
        if not torch.equal(fragment.cpu(), bws.partial_cast(shard, want, shape, start)):
            failures.append(f"partial cast pow2={pow2}")
    assert failures == []
