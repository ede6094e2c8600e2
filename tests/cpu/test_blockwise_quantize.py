"""Blockwise FP8 (TE 2.20's ``Float8BlockScaling``) emulation: whole-tensor quantise against
the exact reference (``tests.support.blockwise_reference``), TE's special blocks, the scale
layouts and shapes, the 128x128 exact-transpose rule, refused inputs, wire bytes, and
``BlockwiseFP8Linear``'s GEMM operands.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

import pytest
import torch

from nemo_lw_fp8.cpu.formats import blockwise as bw
from nemo_lw_fp8.cpu.formats import blockwise_sharded_cast as bws
from tests.support.blockwise_reference import ref_quantize, scales_dict, wide, with_specials
from tests.support.fp8_reference import E4M3, E5M2

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
    x = with_specials(wide(shape, 11, dtype))
    got = bw.quantize(x, fmt, block_dim=block_dim, force_pow_2_scales=pow2, amax_epsilon=eps)
    row_codes, row_scales, col_codes, col_scales = ref_quantize(x, fmt, block_dim, pow2, eps)
    assert torch.equal(got.rowwise_data, row_codes)
    assert torch.equal(got.columnwise_data, col_codes.t())  # stored transposed
    assert scales_dict(got.rowwise_scale_inv, shape, block_dim, False) == row_scales
    assert scales_dict(got.columnwise_scale_inv, shape, block_dim, True) == col_scales
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
        x = with_specials(wide(shape, seed)) if len(shape) == 2 else wide(shape, seed)
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
    x = wide((256, 256), 9)
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
