"""NVFP4 on CPU (issue 30, first slice): the plain-torch cast (E2M1 data, E4M3 1x16 / 16x16
block scales, fp32 amax), packing, dequantize and the 16x16 transpose against an independent
scalar reference of TE 2.20.2's rules (``tests.support.nvfp4_reference``).

Every parity has a control kept in the suite: a mutated rule (round half away from zero, no
global scale, a dequantize without the tensor amax) must make the same comparison diverge.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from nemo_lw_fp8.cpu.formats import nvfp4 as fp4
from tests.support.nvfp4_reference import compare, e2m1_value, f32, ref_e2m1, ref_quantize

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
    assert fp4.decode_e2m1(torch.arange(16)).tolist() == [float(e2m1_value(c)) for c in range(16)]


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
            f32(float(e2m1_value(int(codes[r, c])))
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
