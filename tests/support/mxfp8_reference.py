"""Exact reference of TE 2.20's MXFP8 rules, shared by the MXFP8 emulation tests
(``tests/cpu/test_mxfp8_*.py``).

Python integers and ``fractions.Fraction`` only: E8M0 is ``ceil(log2(amax / fp8_max))``
clamped to [0, 254] (NaN 0xFF, inf 0xFE), elements are multiplied by TE's ``exp2f_rcp`` and
rounded to the nearest FP8 value, ties to even, saturating. Also the wide-range inputs the
tests quantise. Not a test module; tests import it as ``tests.support.mxfp8_reference``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from nemo_lw_fp8.cpu.formats import mxfp8_layout as mxf
from tests.support.fp8_reference import E4M3, E5M2, ceil_log2, fp8_value, ref_cast


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
        value = float(fp8_value(code & 0x7F, fmt))
    scale = 0.0 if e8m0 == 0 else math.inf if e8m0 == 255 else 2.0 ** (e8m0 - 127)
    out = value * scale
    return -out if code & 0x80 else out


def wide_range(shape, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    mant = torch.rand(shape, generator=g) + 1
    exp = torch.randint(-140, 120, shape, generator=g).float()
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    return (sign * mant * torch.exp2(exp)).to(dtype)
