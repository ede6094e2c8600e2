"""Blockwise FP8 (TE 2.20's ``Float8BlockScaling``) emulation: the scale rule and the element
cast against the exact reference (``tests.support.blockwise_reference``), with controls.

The scale of a block is ``fp8_max / amax`` in fp32 (capped, substituted on overflow, rounded
down to a power of two when ``force_pow_2_scales``); the element cast is MXFP8's saturating
round-to-nearest-even cast.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from fractions import Fraction

import pytest
import torch

from nemo_lw_fp8.cpu.formats import blockwise as bw
from nemo_lw_fp8.cpu.formats import mxfp8 as mx
from nemo_lw_fp8.cpu.formats import mxfp8_layout as mxf
from tests.support.blockwise_reference import BF16_MAX, F32_MAX, f32, fp32_nearest, ref_scale
from tests.support.fp8_reference import E4M3, E5M2, floor_log2, ref_cast, top_code

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
    top = top_code(fmt)
    specials = torch.tensor([math.inf, -math.inf, math.nan, 1e30, -1e30, -0.0])
    want = [top, 0x80 | top, 0x7F, top, 0x80 | top, 0x80]
    assert bw.saturating_cast(specials, fmt).tolist() == want
