"""NVFP4 on CPU: the random Hadamard transform of the columnwise copy against a scalar
reference (``tests.support.nvfp4_reference``): Sylvester's matrix with TE's wgrad signs, the
bf16 transform of ``x^T`` with its own amax, its exactness, what TE refuses; controls for each
plausible misreading.
"""

from __future__ import annotations

import pytest
import torch

from nemo_lw_fp8.cpu.formats import nvfp4 as fp4
from tests.support.nvfp4_reference import (
    TE_SIGNS,
    compare_rht,
    ref_rht_t,
    ref_sign_mask,
    ref_sylvester,
)

# --------------------------------------------------------------------------------------------
# The random Hadamard transform (columnwise copy) against a scalar reference
# --------------------------------------------------------------------------------------------


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
