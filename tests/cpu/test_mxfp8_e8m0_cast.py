"""The pure-torch MXFP8 emulation's E8M0 scale rule and element cast against an independent
exact reference of TE 2.20's rules (``tests.support.mxfp8_reference``).

E8M0 is ``ceil(log2(amax / fp8_max))`` clamped to [0, 254] (NaN 0xFF, inf 0xFE); elements are
rounded to the nearest FP8 value, ties to even, saturating.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from nemo_lw_fp8.cpu.formats import mxfp8 as mx
from nemo_lw_fp8.cpu.formats import mxfp8_layout as mxf
from tests.support.fp8_reference import E4M3, E5M2, positive_values, ref_cast, top_code
from tests.support.mxfp8_reference import ref_e8m0

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
    values = positive_values(fmt)
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
    mx_code = top_code(fmt)
    assert sat.view(-1).tolist() == [mx_code] * 4 + [0x80 | mx_code] * 2 + [0x7F]
