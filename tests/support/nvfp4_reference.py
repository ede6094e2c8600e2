"""Independent scalar reference of TE 2.20.2's NVFP4 rules, shared by the NVFP4 emulation tests
(``tests/cpu/test_nvfp4_cast.py``, ``test_nvfp4_rht.py``, ``test_nvfp4_te_quantizer.py``).

Python floats and ``fractions.Fraction`` only, one element at a time: E2M1 by enumerating the
16 codes' values and picking the nearest (ties to the even code), E4M3 scales by enumerating
all 127 non-negative codes the same way, fp32 arithmetic by rounding each exact product or
quotient to fp32 (``struct``). The mutations the controls use (round half away from zero, no
global scale) are parameters of the reference. Also the random Hadamard transform of the
columnwise copy: Sylvester's matrix, TE's wgrad signs, the transform of ``x^T`` exactly.

Not a test module; tests import it as ``tests.support.nvfp4_reference``.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import torch

from nemo_lw_fp8.cpu.formats import nvfp4 as fp4

FLT_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]


def f32(x: float | Fraction) -> float:
    """Round a real number to the nearest fp32 (ties to even); beyond FLT_MAX to inf."""
    x = float(x)  # a Fraction of our sizes is exact in double, or rounds once correctly
    if math.isnan(x) or math.isinf(x):
        return x
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def e2m1_value(code: int) -> Fraction:
    exp, man = (code >> 1) & 0x3, code & 0x1
    mag = Fraction(man, 2) if exp == 0 else Fraction(2 + man, 2) * Fraction(2) ** (exp - 1)
    return -mag if code & 0x8 else mag


def ref_e2m1(x: float, *, ties_away: bool = False) -> int:
    """E2M1 code of an fp32 value: nearest of the 16 codes' values, ties to the even code,
    saturating; NaN to +6; the sign of zero kept. ``ties_away`` is the control's mutation."""
    if math.isnan(x):
        return 0x7
    sign = 0x8 if math.copysign(1.0, x) < 0 else 0
    if math.isinf(x):
        return sign | 0x7
    a = abs(Fraction(x))
    best = None
    for code in range(8):
        dist = abs(a - e2m1_value(code))
        key = (dist, -code if ties_away else code % 2, code)
        if best is None or key < best[0]:
            best = (key, code)
    return sign | best[1]


def _e4m3_value(code: int) -> Fraction:
    exp, man = code >> 3, code & 0x7
    if exp == 0:
        return Fraction(man, 8) * Fraction(2) ** -6
    return Fraction(8 + man, 8) * Fraction(2) ** (exp - 7)


_E4M3 = [(_e4m3_value(c), c) for c in range(0x7F)]  # 0x7F is NaN


def ref_e4m3(x: float, *, ties_away: bool = False) -> int:
    """Saturating round-to-nearest-even E4M3 code of a non-negative fp32 value (``ties_away``:
    the control's mutation)."""
    a = Fraction(x) if not math.isinf(x) else Fraction(10**6)
    return min(_E4M3, key=lambda vc: (abs(a - vc[0]), -vc[1] if ties_away else vc[1] % 2))[1]


def ref_s_enc(amax: float) -> float:
    """fp32 ``2688 / amax``, capped at FLT_MAX; 1 for a zero amax or a zero quotient."""
    if amax == 0 or math.isinf(amax):
        return 1.0
    return min(f32(Fraction(2688) / Fraction(amax)), FLT_MAX)


def ref_block(
    values: list[float], s_enc: float, ties_away: bool = False, e4m3_ties_away: bool = False
) -> tuple[list[int], int]:
    """Codes and E4M3 scale code of one block of fp32 values (NaN skipped by the amax)."""
    amax = max([abs(v) for v in values if not math.isnan(v)] + [0.0])
    s_dec = f32(Fraction(1) / Fraction(s_enc))
    multiplier = f32(Fraction(s_enc) * Fraction(f32(Fraction(1, 6))))
    decode = math.inf if math.isinf(amax) else f32(Fraction(amax) * Fraction(multiplier))
    scale = ref_e4m3(min(decode, FLT_MAX), ties_away=e4m3_ties_away)
    denom = f32(_e4m3_value(scale) * Fraction(s_dec))
    encode = FLT_MAX if denom == 0 else min(f32(Fraction(1) / Fraction(denom)), FLT_MAX)
    codes = []
    for v in values:
        if math.isnan(v) or math.isinf(v):
            scaled = v
        else:
            # IEEE: a zero product carries the sign of v (encode > 0); Fraction has no -0
            scaled = math.copysign(f32(Fraction(v) * Fraction(encode)), v)
        codes.append(ref_e2m1(scaled, ties_away=ties_away))
    return codes, scale


def ref_quantize(x: torch.Tensor, two_d: bool = False, global_scale: bool = True, **mut) -> dict:
    """Scalar NVFP4 cast of a 2-D fp32-representable tensor: unpacked codes and compact scales
    of both usages, and the amax."""
    rows, cols = x.shape
    v = [[float(e) for e in row] for row in x.float().tolist()]
    amax = max([abs(e) for row in v for e in row if not math.isnan(e)] + [0.0])
    s_enc = ref_s_enc(f32(amax)) if global_scale else 1.0
    out = {"amax": f32(amax)}
    for usage, mat in (("row", v), ("col", [list(c) for c in zip(*v, strict=True)])):
        n_rows, n_cols = len(mat), len(mat[0])
        codes = [[0] * n_cols for _ in range(n_rows)]
        scales = [[0] * (n_cols // 16) for _ in range(n_rows)]
        for r in range(n_rows):
            for b in range(n_cols // 16):
                if two_d:  # the 16x16 tile's amax, shared by both usages
                    r0 = (r // 16) * 16
                    tile = [mat[rr][b * 16 + k] for rr in range(r0, r0 + 16) for k in range(16)]
                    finite = [abs(e) for e in tile if not math.isnan(e)]
                    big = max(finite + [0.0])
                    block = mat[r][b * 16 : b * 16 + 16]
                    # the tile amax as an extra member makes it the block's amax
                    codes_b, scale = ref_block(block + [big], s_enc, **mut)
                    codes_b = codes_b[:16]
                else:
                    codes_b, scale = ref_block(mat[r][b * 16 : b * 16 + 16], s_enc, **mut)
                codes[r][b * 16 : b * 16 + 16] = codes_b
                scales[r][b] = scale
        out[usage] = (codes, scales)
    return out


def ref_pack(codes: list[list[int]]) -> list[list[int]]:
    return [[row[2 * i] + 16 * row[2 * i + 1] for i in range(len(row) // 2)] for row in codes]


def compare(data: fp4.NVFP4Data, ref: dict) -> dict:
    """Which buffers of ``data`` equal the scalar reference (scales: compact region, and zero
    padding)."""
    res = {"amax": float(data.amax_rowwise) == ref["amax"] == float(data.amax_columnwise)}
    for usage, packed, scale in (
        ("row", data.rowwise_data, data.rowwise_scale_inv),
        ("col", data.columnwise_data, data.columnwise_scale_inv),
    ):
        codes, scales = ref[usage]
        rows = len(codes)
        res[f"{usage}_data"] = packed.reshape(rows, -1).tolist() == ref_pack(codes)
        compact = scale[:rows, : len(scales[0])]
        res[f"{usage}_scales"] = compact.tolist() == scales
        pad = scale.clone()
        pad[:rows, : len(scales[0])] = 0
        res[f"{usage}_padding_zero"] = not bool(pad.any())
    return res


#: TE's hard-coded wgrad signs (``get_wgrad_sign_vector``), as written there.
TE_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]


def ref_sign_mask(signs: list[int]) -> int:
    """Bit ``i`` set where ``signs[i]`` is -1 (``get_sign_from_vector``)."""
    return sum(1 << i for i, v in enumerate(signs) if v == -1)


def ref_sylvester(n: int) -> list[list[int]]:
    """The +-1 Hadamard matrix of order ``n`` by Sylvester's doubling ``[[H, H], [H, -H]]``."""
    h = [[1]]
    while len(h) < n:
        h = [row + row for row in h] + [row + [-e for e in row] for row in h]
    return h


def ref_bf16(x: float) -> float:
    """Round an fp32 value to bf16, nearest even, from its bits (finite values)."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def ref_rht_t(x: torch.Tensor, signs: list[int], *, bf16: bool = True) -> torch.Tensor:
    """The RHT of ``x^T`` (``(K, M)``): each 16 consecutive elements ``v`` of a row of ``x^T``
    to ``sum_k v_k * signs[k] * H[k][n] / 4``, exact (Fraction), then fp32, then bf16."""
    h = ref_sylvester(16)
    xt = [[Fraction(float(e)) for e in row] for row in x.float().t().tolist()]
    out = []
    for row in xt:
        res = []
        for g in range(0, len(row), 16):
            v = row[g : g + 16]
            for n in range(16):
                exact = sum(v[k] * signs[k] * h[k][n] for k in range(16)) / 4
                y = f32(exact)
                res.append(ref_bf16(y) if bf16 else y)
        out.append(res)
    return torch.tensor(out, dtype=torch.float32)


def compare_rht(data: fp4.NVFP4Data, x: torch.Tensor, y: torch.Tensor) -> dict:
    """``data`` (a RHT cast of ``x``) against the scalar reference: the rowwise copy is the plain
    cast of ``x`` with ``max |x|``, the columnwise copy the plain cast of ``y`` (``(K, M)``) with
    ``max |y|``."""
    rows = x.shape[0]
    ref_row, ref_col = ref_quantize(x), ref_quantize(y)
    res = {
        "amax_rowwise": float(data.amax_rowwise) == ref_row["amax"],
        "amax_columnwise": float(data.amax_columnwise) == ref_col["amax"],
        "row_data": data.rowwise_data.reshape(rows, -1).tolist() == ref_pack(ref_row["row"][0]),
        "col_data": data.columnwise_data.tolist() == ref_pack(ref_col["row"][0]),
    }
    for usage, scale, ref in (
        ("row", data.rowwise_scale_inv, ref_row["row"][1]),
        ("col", data.columnwise_scale_inv, ref_col["row"][1]),
    ):
        res[f"{usage}_scales"] = scale[: len(ref), : len(ref[0])].tolist() == ref
        pad = scale.clone()
        pad[: len(ref), : len(ref[0])] = 0
        res[f"{usage}_padding_zero"] = not bool(pad.any())
    return res
