"""Exact reference of TE 2.20's blockwise FP8 (``Float8BlockScaling``) rules, shared by the
blockwise emulation tests (``tests/cpu/test_blockwise_*.py``).

Python integers and ``fractions.Fraction`` only:

* scale (TE's ``compute_scale_from_amax``): ``amax = max(amax, eps)``; 1 for amax 0/inf/NaN;
  otherwise the fp32 nearest to ``fp8_max / amax`` (inf -> the input type's largest finite
  value), then rounded down to a power of two when ``force_pow_2_scales``;
* codes: the fp32 nearest to ``x * scale``, then the FP8 value nearest to that (ties to even),
  saturating at the largest finite value, NaN -> 0x7F.

Also the inputs the tests quantise: wide-range tensors and ones with special values in chosen
blocks. Not a test module; tests import it as ``tests.support.blockwise_reference``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from nemo_lw_fp8.cpu.formats import blockwise as bw
from tests.support.fp8_reference import floor_log2, ref_cast

F32_MAX = float.fromhex("0x1.fffffep127")
BF16_MAX = float.fromhex("0x1.FEp127")


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


def wide(shape, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    exps = torch.randint(-12, 12, shape, generator=g).float()
    return (base * torch.exp2(exps)).to(dtype)


def with_specials(x: torch.Tensor) -> torch.Tensor:
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


def scales_dict(scale_inv: torch.Tensor, shape, block_dim: int, columnwise: bool) -> dict:
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
