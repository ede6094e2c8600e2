"""NVFP4 on CPU (issue 30, first slice): the plain-torch cast against an independent scalar
reference of TE 2.20.2's rules, and TE's own ``NVFP4Quantizer`` over the emulation against it.

The scalar reference below uses Python floats and ``fractions.Fraction`` only, one element at a
time: E2M1 by enumerating the 16 codes' values and picking the nearest (ties to the even code),
E4M3 scales by enumerating all 127 non-negative codes the same way, fp32 arithmetic by rounding
each exact product or quotient to fp32 (``struct``). Every parity has a control kept in the
suite: a mutated rule (round half away from zero, no global scale, a dequantize without the
tensor amax) must make the same comparison diverge.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch

from nemo_lw_fp8.cpu.formats import nvfp4 as fp4
from tests.support.te_test_support import needs_te, run_te_script

# --------------------------------------------------------------------------------------------
# Independent scalar reference
# --------------------------------------------------------------------------------------------

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


def _e2m1_value(code: int) -> Fraction:
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
        dist = abs(a - _e2m1_value(code))
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


# --------------------------------------------------------------------------------------------
# Edge-case tensors
# --------------------------------------------------------------------------------------------


def _case(name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    if name == "random_bf16":
        return (torch.randn(32, 64, generator=gen) * 3).bfloat16().float()
    if name == "zeros":
        return torch.zeros(16, 32)
    if name == "all_equal_blocks":
        return torch.full((16, 32), -1.5).index_fill_(1, torch.arange(16, 32), 0.75)
    x = torch.zeros(16, 64)
    if name == "ties":  # global amax 2688 makes S_enc = 1; block amax 6 makes scale 1
        x[:, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
        x[0, 16] = 2688.0
        x[:, 32:48] = torch.tensor([-0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0] * 2)
        return x
    if name == "subnormal_scales":  # block scales in E4M3's subnormal range, and one rounding to 0
        x[0, 0] = 2688.0
        for j, amax in enumerate((0.01, 0.004, 0.005, 0.0015)):
            x[1 + j, 16 * (j % 4) : 16 * (j % 4) + 16] = torch.linspace(-amax, amax, 16)
        return x
    if name == "saturation":  # block scale rounds down (1.0625 -> 1, ties to even): 6.375 -> 6
        x[0, 0] = 2688.0
        x[1, :16] = torch.linspace(-6.375, 6.375, 16)
        x[2, 16:32] = 6.375
        return x
    if name == "nan_inf":
        x = (torch.randn(16, 64, generator=gen) * 2).bfloat16().float()
        x[0, 3], x[1, 20], x[2, 40] = float("nan"), float("inf"), float("-inf")
        x[3, 0:16] = float("nan")
        x[4, 50] = -0.0
        return x
    raise KeyError(name)


CASES = ["random_bf16", "zeros", "all_equal_blocks", "ties", "subnormal_scales", "saturation",
         "nan_inf"]  # fmt: skip


# --------------------------------------------------------------------------------------------
# The plain-torch cast against the scalar reference
# --------------------------------------------------------------------------------------------


def _e2m1_probe_values() -> torch.Tensor:
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:], strict=False)]
    near = []
    for m in mids + grid:
        near += [math.nextafter(m, -math.inf), math.nextafter(m, math.inf)]
    special = [6.5, 7.0, 1e30, math.inf, math.nan, 1e-45, 2**-126, 0.1, 0.3, 0.8, 5.5]
    vals = grid + mids + near + special
    return torch.tensor(vals + [-v for v in vals], dtype=torch.float32)


def test_e2m1_encode_matches_scalar_reference():
    """Every E2M1 decision point (midpoints, their fp32 neighbours, saturation, inf, NaN, signed
    zeros, fp32 subnormals) encodes as the scalar reference; decode is the code's value."""
    x = _e2m1_probe_values()
    ours = fp4.encode_e2m1(x).tolist()
    ref = [ref_e2m1(float(v)) for v in x.tolist()]
    assert ours == ref
    assert fp4.decode_e2m1(torch.arange(16)).tolist() == [float(_e2m1_value(c)) for c in range(16)]


def test_e2m1_control_ties_away_diverges():
    """Control: round half away from zero differs from the cast on the midpoints."""
    x = _e2m1_probe_values()
    ours = fp4.encode_e2m1(x).tolist()
    away = [ref_e2m1(float(v), ties_away=True) for v in x.tolist()]
    assert ours != away
    assert sum(a != b for a, b in zip(ours, away, strict=True)) >= 6


def test_packing_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 4, 0xF, 0x8]], dtype=torch.uint8)
    assert fp4.pack_fp4(codes).tolist() == [[0x21, 0x43, 0x8F]]
    assert torch.equal(fp4.unpack_fp4(fp4.pack_fp4(codes)), codes)


@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
@pytest.mark.parametrize("case", CASES)
def test_quantize_matches_scalar_reference(case, two_d):
    """All buffers (rowwise and transposed columnwise codes, compact E4M3 scales, zero scale
    padding, the amax of both usages) equal the scalar reference, bit for bit."""
    x = _case(case)
    res = compare(fp4.quantize(x, two_d=two_d), ref_quantize(x, two_d=two_d))
    assert all(res.values()), res


def test_quantize_control_ties_away_diverges():
    """Control: the reference with E2M1 round half away from zero gives other codes."""
    x = _case("ties")
    res = compare(fp4.quantize(x), ref_quantize(x, ties_away=True))
    assert not res["row_data"], res  # the rowwise blocks hold the midpoints at scale 1
    assert res["row_scales"] and res["col_scales"], res


def test_quantize_control_scale_ties_away_diverges():
    """Control: an E4M3 block scale rounded half away (1.0625 -> 1.125) leaves 6.375 unsaturated:
    other scales and other codes."""
    x = _case("saturation")
    res = compare(fp4.quantize(x), ref_quantize(x, e4m3_ties_away=True))
    assert not res["row_scales"] and not res["row_data"], res


def test_quantize_control_without_global_scale_diverges():
    """Control: block scales computed without the FP32 global scale (S_enc = 1) differ."""
    x = _case("random_bf16")
    res = compare(fp4.quantize(x), ref_quantize(x, global_scale=False))
    assert not res["row_scales"] and not res["col_scales"], res


def test_quantize_odd_shapes_refused_like_te():
    """``NVFP4Quantizer::create_tensor``: both flattened dims must be multiples of 16."""
    for shape in [(20, 32), (32, 24), (2, 5, 32), (16,)]:
        with pytest.raises(ValueError, match="divisible by 16"):
            fp4.quantize(torch.ones(shape))


def test_quantize_3d_and_fp32_input():
    """A 3-D input keeps its leading dims in the rowwise bytes; fp32 input (not bf16-exact) is
    cast from its fp32 values."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 48, generator=gen)
    data = fp4.quantize(x)
    assert tuple(data.rowwise_data.shape) == (2, 16, 24)
    assert tuple(data.columnwise_data.shape) == (48, 16)
    res = compare(
        fp4.NVFP4Data(
            (32, 48),
            data.rowwise_data.reshape(32, 24),
            data.rowwise_scale_inv,
            data.columnwise_data,
            data.columnwise_scale_inv,
            data.amax_rowwise,
            data.amax_columnwise,
        ),
        ref_quantize(x.reshape(32, 48)),
    )
    assert all(res.values()), res


def _round_trip_excess(
    x: torch.Tensor, dq: torch.Tensor, data: fp4.NVFP4Data, use: str = "rowwise"
) -> float:
    """How far ``|x - dq|`` exceeds the E2M1 bound: half a grid step of the scaled value, i.e.
    at most ``max(0.25 s, |x| / 4)`` with ``s`` the block's decode scale (saturation after a
    scale rounded down stays within it too), plus fp32 slack."""
    rows, cols = x.shape
    if use == "rowwise":
        scales = data.rowwise_scale_inv[:rows, : cols // 16]
    else:
        scales = data.columnwise_scale_inv[:cols, : rows // 16]
    s = scales.view(torch.float8_e4m3fn).float() * float(data.amax_rowwise) / 2688.0
    s = s.repeat_interleave(16, dim=1)
    if use != "rowwise":
        s = s.t()
    bound = torch.maximum(0.25 * s, 0.25 * x.abs()) * (1 + 1e-5)
    return float(((x - dq).abs() - bound).max())


def test_dequantize_round_trip_within_bound():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(64, 128, generator=gen) * 5
    data = fp4.quantize(x)
    assert _round_trip_excess(x, fp4.dequantize(data), data) <= 0
    dq_col = fp4.dequantize(data, use="columnwise")
    assert _round_trip_excess(x, dq_col, data, "columnwise") <= 0
    # dequantize follows dequantize_fp4_kernel: e2m1 * fp32(fp32(e4m3 * amax) / 2688)
    codes = fp4.unpack_fp4(data.rowwise_data)
    e4m3 = data.rowwise_scale_inv[:64, :8].view(torch.float8_e4m3fn).tolist()
    amax = float(data.amax_rowwise)
    expect = [
        [
            f32(float(_e2m1_value(int(codes[r, c])))
                * f32(f32(e4m3[r][c // 16] * amax) * f32(Fraction(1, 2688))))
            for c in range(128)
        ]
        for r in range(0, 64, 9)
    ]  # fmt: skip
    assert fp4.dequantize(data)[::9].tolist() == expect


def test_dequantize_control_without_amax_diverges():
    """Control: dequantizing with the block scales alone (no ``amax / 2688``) breaks the bound."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(64, 128, generator=gen) * 5
    data = fp4.quantize(x)
    wrong = fp4.dequantize_codes(data.rowwise_data, data.rowwise_scale_inv, torch.tensor(2688.0))
    assert _round_trip_excess(x, wrong, data) > 0


def test_transpose_packed_matches_columnwise_of_2d():
    """``nvfp4_data_transpose`` of 16x16-block rowwise bytes gives the columnwise bytes."""
    x = _case("random_bf16")
    data = fp4.quantize(x, two_d=True)
    assert torch.equal(fp4.transpose_packed(data.rowwise_data), data.columnwise_data)
    data1 = fp4.quantize(x)  # control: 1x16 blocks differ between the two directions
    assert not torch.equal(fp4.transpose_packed(data1.rowwise_data), data1.columnwise_data)


# --------------------------------------------------------------------------------------------
# The random Hadamard transform (columnwise copy) against a scalar reference
# --------------------------------------------------------------------------------------------

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


def _rht_case(name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(13)
    if name == "random":
        return (torch.randn(32, 48, generator=gen) * 3).bfloat16()
    if name == "zeros":
        return torch.zeros(16, 32, dtype=torch.bfloat16)
    if name == "spread":  # magnitudes over 2^0 .. 2^-10 inside each group: fp32 sums, bf16 ties
        exps = torch.randint(0, 11, (48, 32), generator=gen).float()
        return (torch.randn(48, 32, generator=gen) * 2.0**-exps).bfloat16()
    if name == "one_hot":  # one element per group: the output is that element's row of +-x/4
        x = torch.zeros(32, 32)
        x[3, 0], x[16 + 9, 17], x[7, 31] = 2.0, -5.0, 1e-3
        return x.bfloat16()
    raise KeyError(name)


RHT_CASES = ["random", "zeros", "spread", "one_hot"]


def test_rht_matrix_is_signed_sylvester_over_four():
    """``rht_matrix``: Sylvester's +-1 matrix of order 16 over 4, row ``k`` negated where bit
    ``k`` of the mask is set; orthogonal. TE's wgrad signs give mask 0xD7E8 (bit i per sign)."""
    mask = ref_sign_mask(TE_SIGNS)
    assert mask == 0xD7E8
    h = ref_sylvester(16)
    expect = [[TE_SIGNS[k] * h[k][n] / 4 for n in range(16)] for k in range(16)]
    assert fp4.rht_matrix(mask).tolist() == expect
    m = fp4.rht_matrix(mask)
    assert torch.equal(m @ m.t(), torch.eye(16))
    assert fp4.rht_matrix(0).tolist() == [[e / 4 for e in row] for row in h]
    # control: the signs applied to the columns (H @ diag(s)) is another matrix
    assert fp4.rht_matrix(mask).tolist() != [
        [h[k][n] * TE_SIGNS[n] / 4 for n in range(16)] for k in range(16)
    ]


@pytest.mark.parametrize("signs", ["te", "none"])
@pytest.mark.parametrize("case", RHT_CASES)
def test_rht_quantize_matches_scalar_reference(case, signs):
    """The RHT cast: rowwise the plain cast (pre-RHT amax), columnwise the plain cast of the
    bf16 RHT of ``x^T`` (exact sum, fp32, bf16) with its own amax; all buffers bitwise."""
    vec = TE_SIGNS if signs == "te" else [1] * 16
    x = _rht_case(case)
    data = fp4.quantize(x, rht_sign_mask=ref_sign_mask(vec))
    y = ref_rht_t(x, vec)
    res = compare_rht(data, x.float(), y)
    assert all(res.values()), res
    # the transform itself, bitwise
    got = fp4.hadamard_transform(x.t().contiguous(), ref_sign_mask(vec))
    assert torch.equal(got.float(), y)


def test_rht_rowwise_only_and_columnwise_only():
    x = _rht_case("random")
    mask = ref_sign_mask(TE_SIGNS)
    both = fp4.quantize(x, rht_sign_mask=mask)
    row = fp4.quantize(x, columnwise=False, rht_sign_mask=mask)
    col = fp4.quantize(x, rowwise=False, rht_sign_mask=mask)
    assert row.columnwise_data is None and row.amax_columnwise is None
    assert col.rowwise_data is None and col.amax_rowwise is None
    assert torch.equal(row.rowwise_data, both.rowwise_data)
    assert torch.equal(col.columnwise_data, both.columnwise_data)
    assert torch.equal(col.amax_columnwise, both.amax_columnwise)
    plain = fp4.quantize(x)
    assert torch.equal(row.rowwise_data, plain.rowwise_data)  # RHT leaves the rowwise copy alone


def test_rht_controls_diverge():
    """Controls, each a plausible misreading that must give other bytes: the signs reversed
    (bit 15 - i), the signs on the columns, the transform along the rows of ``x`` instead of
    ``x^T``, the columnwise copy scaled by the pre-RHT amax, and the fp32 transform without
    the bf16 rounding."""
    x = _rht_case("random")
    mask = ref_sign_mask(TE_SIGNS)
    data = fp4.quantize(x, rht_sign_mask=mask)
    y = ref_rht_t(x, TE_SIGNS)
    assert all(compare_rht(data, x.float(), y).values())
    reversed_signs = TE_SIGNS[::-1]
    assert not compare_rht(data, x.float(), ref_rht_t(x, reversed_signs))["col_data"]
    # signs on the output index: y = v @ H @ diag(s)
    h = torch.tensor(ref_sylvester(16), dtype=torch.float64)
    s = torch.tensor(TE_SIGNS, dtype=torch.float64)
    cols_signed = (x.t().double().reshape(-1, 16) @ (h * s[None, :] / 4)).float().bfloat16()
    assert not compare_rht(data, x.float(), cols_signed.float().reshape(y.shape))["col_data"]
    # along the rows of x: the transform of x, then transposed
    other_dim = fp4.hadamard_transform(x, mask).t().contiguous()
    assert not torch.equal(fp4.quantize(other_dim.t()).rowwise_data, data.columnwise_data)
    # pre-RHT amax for the columnwise copy
    pre = fp4.quantize(y, amax=fp4.tensor_amax(x), columnwise=False)
    assert not torch.equal(pre.rowwise_scale_inv, data.columnwise_scale_inv)
    # no bf16 rounding of the transform
    xs = _rht_case("spread")
    ds = fp4.quantize(xs, rht_sign_mask=mask)
    unrounded = ref_rht_t(xs, TE_SIGNS, bf16=False)
    assert not torch.equal(fp4.quantize(unrounded, columnwise=False).rowwise_data,
                           ds.columnwise_data)  # fmt: skip


def _order_results(span: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output 0 of the RHT of 400 groups whose bf16 values span ``span`` binades: the
    emulation's fp32 sum, and fp32 sums accumulated one term at a time in 6 random orders."""
    gen = torch.Generator().manual_seed(seed)
    mant = 1 + torch.randint(0, 128, (400, 16), generator=gen).float() / 128  # 8 bits
    sign = torch.randint(0, 2, (400, 16), generator=gen).float() * 2 - 1
    x = sign * mant * 2.0 ** -torch.randint(0, span + 1, (400, 16), generator=gen).float()
    x = x.bfloat16()
    m = fp4.rht_matrix(ref_sign_mask(TE_SIGNS))
    ours = (x.double() @ m.double()).float()[:, 0]
    terms = x.float() * m[:, 0]  # exact products
    orders = []
    for _ in range(6):
        acc = torch.zeros(400)
        for k in torch.randperm(16, generator=gen).tolist():
            acc = acc + terms[:, k]
        orders.append(acc)
    return ours, orders


def test_rht_sum_is_order_free_within_12_binades():
    """The exactness claim of the docstring: when a group's terms span at most 12 binades, any
    fp32 summation order gives the emulation's sum. Control: over 30 binades, orders differ."""
    ours, orders = _order_results(11, 1)  # mantissa in [1, 2): terms span at most 12 binades
    assert all(torch.equal(o, ours) for o in orders)
    ours, orders = _order_results(30, 2)
    assert not all(torch.equal(o, ours) for o in orders)


def test_rht_refuses_what_te_refuses():
    """TE's checks: bf16 input only, both dims multiples of 16; the RHT cast takes 1x16 blocks."""
    mask = ref_sign_mask(TE_SIGNS)
    with pytest.raises(ValueError, match="bfloat16"):
        fp4.quantize(torch.ones(16, 32), rht_sign_mask=mask)
    for shape in [(20, 32), (32, 24)]:
        with pytest.raises(ValueError, match="divisible by 16"):
            fp4.quantize(torch.ones(shape, dtype=torch.bfloat16), rht_sign_mask=mask)
    with pytest.raises(ValueError, match="1x16"):
        fp4.quantize(torch.ones(16, 32, dtype=torch.bfloat16), two_d=True, rht_sign_mask=mask)


# --------------------------------------------------------------------------------------------
# TE's NVFP4Quantizer over the emulation (in a subprocess: this process never imports TE)
# --------------------------------------------------------------------------------------------

TE_SCRIPT = r"""
import json
from nemo_lw_fp8.cpu.te import activate
R = {"backend": activate()}
import torch
from nemo_lw_fp8.cpu.te import device as te_device
# NVFP4 is a Blackwell recipe: TE's device questions (NVFP4Quantizer.__init__ asks
# torch.cuda.current_device for its Hadamard tensors) get the B200's answers, as in a run.
SCOPE = te_device.target_gpu(te_device.BLACKWELL)  # kept: a dropped one exits
SCOPE.__enter__()
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
