"""The NVFP4 and MXFP8 casts of the CPU emulation against a reference the project did not write:
torchao 0.18.0's eager (CPU) quantizers (issue 44).

What each side computes, as read from its source:

* torchao, ``torchao/prototype/mx_formats/nvfp4_tensor.py`` (``nvfp4_quantize``,
  ``per_tensor_amax_to_scale``, ``NVFP4Tensor.dequantize``), ``kernels.py`` (``pack_uint4``,
  ``f32_to_f4_unpacked``), ``torchao/prototype/custom_fp_utils.py``
  (``_f32_to_floatx_unpacked``: round to nearest even, saturating, sign of zero kept) and
  ``mx_tensor.py`` (``to_mx`` with ``ScaleCalculationMode.RCEIL``, ``_to_mx_rceil``'s eager
  fallback);
* TE 2.20.2, ``transformer_engine/common/cast/nvfp4/core_nvfp4.cuh``
  (``compute_global_encode_scaling_factor_FP4``, ``compute_decoding_scaling_factor``),
  ``cast/nvfp4/quantize_transpose_nvfp4.cuh`` (``block_scale_inverse``),
  ``cast/nvfp4/dequantize_nvfp4.cuh`` and, for MXFP8, ``cast/mxfp8/quantize_mxfp8.cuh``
  (``float_to_e8m0(amax * max_norm_rcp)``, ``exp2f_rcp``), read in the mirrored TE history;
  the emulation is ``nemo_lw_fp8/cpu/formats/nvfp4.py`` and ``mxfp8.py``.

Both NVFP4 casts write E2M1 codes two per byte (even index in the low nibble) with E4M3 scales
of 1x16 blocks; they differ in four documented places, each a named class below:

* ``global_scale``: torchao's per-tensor decode scale is ``fp32(amax / 2688)``
  (``per_tensor_amax_to_scale``), TE's is ``fp32(1 / fp32(2688 / amax))`` (1 for a zero amax);
  they differ by an ulp for many amaxes, and torchao's is 0 (NaN block scales) for a zero
  tensor;
* ``scale_floor``: torchao clamps the block scale to at least ``finfo(float8_e4m3fn).tiny``
  (2^-6, E4M3's smallest normal), TE keeps E4M3's subnormals and zero (a zero scale makes TE's
  encode scale FLT_MAX: the block's non-zero elements saturate to +-6);
* ``block_scale``: torchao rounds ``fp32(fp32(block_amax / 6) / S_dec)`` to E4M3, TE
  ``fp32(block_amax * fp32(S_enc * fp32(1/6)))``;
* ``encode_scale``: torchao scales elements by ``fp32(fp32(1 / S_dec) / scale)``, TE by
  ``fminf(fp32(1 / fp32(scale * S_dec)), FLT_MAX)``.

The comparison walks from torchao to the emulation one class at a time: torchao itself, torchao
given TE's decode scale, then a model of the two cast formulas (written here from the two
sources, using torchao's own E2M1 rounding and packing) with the other three classes switched to
TE's one by one. The first model must equal torchao bitwise and the last the emulation bitwise,
and every byte that changes along a step must lie where that step's intermediate differs
(an unexplained byte fails the test). Where the arithmetic is the same (the E2M1 rounding, the
packing, the code-to-value table) the two are compared bitwise directly. Non-finite input is
left out: torchao's cast defines no special values.

MXFP8 (``to_mx``, RCEIL, E4M3 elements, E8M0 scales, 1x32 blocks) differs in two classes:
``descale`` (torchao ``fp32(amax / 448)``, TE ``fp32(amax * fp32(1/448))``) and ``exponent``
(torchao's eager ``ceil(log2(descale))`` in fp32, which rounds a value a few ulps above a power
of two down to it, against TE's exact round-up ``cvt.rp.satfinite.ue8m0x2.f32``).
"""

from __future__ import annotations

import os

import pytest
import torch

from nemo_lw_fp8.cpu.formats import mxfp8 as mx
from nemo_lw_fp8.cpu.formats import nvfp4 as fp4

if os.environ.get("NEMO_LW_FP8_REQUIRE_TE") == "1":
    import torchao.prototype.mx_formats.nvfp4_tensor as ao_nvfp4
else:
    ao_nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
from torchao.prototype.mx_formats import kernels as ao_kernels  # noqa: E402
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_mx  # noqa: E402

F32 = torch.float32
FLT_MAX = torch.finfo(F32).max
E4M3_TINY = torch.finfo(torch.float8_e4m3fn).tiny


def _f(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=F32)


# --------------------------------------------------------------------------------------------
# Inputs: random and adversarial
# --------------------------------------------------------------------------------------------

TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0)


def _random(seed: int, shape=(32, 128), dtype=torch.float32, spread: int = 12) -> torch.Tensor:
    """Normal values with a random binade per 16-element block: block amaxes from far below to
    far above each other (E4M3-subnormal and zero block scales among them)."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape
    binade = torch.randint(-spread, spread + 1, (rows, cols // 16), generator=gen).float()
    x = torch.randn(shape, generator=gen) * torch.exp2(binade).repeat_interleave(16, dim=1)
    return x.to(dtype).float() if dtype != torch.float32 else x


def _adversarial() -> dict[str, torch.Tensor]:
    cases = {}
    x = torch.zeros(32, 64)
    x[0, 63] = 2688.0  # tensor amax 2688: both global scales are 1
    for row in range(1, 32):  # E2M1 rounding midpoints at block scales 2^k, both signs
        k = (row % 18) - 9
        sign = -1.0 if row % 2 else 1.0
        x[row, :16] = sign * torch.tensor(TIES * 2) * 2.0**k
        x[row, 16:24] = sign * torch.tensor(TIES) * 2.0**k
        x[row, 24:32] = -0.0
    cases["ties"] = x
    cases["zeros"] = torch.zeros(16, 32)
    neg_zero = torch.full((16, 32), -0.0)
    neg_zero[3, 5] = 1.5
    cases["negative_zero"] = neg_zero
    sub = torch.zeros(16, 64)
    sub[0, 0] = 2688.0
    for j, amax in enumerate((0.09, 0.01, 0.004, 0.005, 0.0015, 1e-6)):
        sub[1 + j, 16 * (j % 4) : 16 * (j % 4) + 16] = torch.linspace(-amax, amax, 16)
    cases["e4m3_subnormal_scales"] = sub
    gen = torch.Generator().manual_seed(11)
    cases["tiny"] = torch.randn(16, 64, generator=gen) * 1e-39  # fp32 subnormals
    cases["huge"] = torch.randn(16, 64, generator=gen) * 1e37
    cases["huge"][0, 0] = FLT_MAX
    cases["mixed_extremes"] = _random(12, (16, 64), spread=60)
    return cases


def _cases() -> dict[str, torch.Tensor]:
    cases = _adversarial()
    for seed in range(24):
        dtype = torch.bfloat16 if seed % 2 else torch.float32
        cases[f"random{seed}"] = _random(seed, dtype=dtype)
    return cases


# --------------------------------------------------------------------------------------------
# NVFP4: the walk from torchao to the emulation
# --------------------------------------------------------------------------------------------


def _ao_cast(x2: torch.Tensor, s_dec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's own cast with the given per-tensor decode scale: (packed codes, scale bytes)."""
    scales, data = ao_nvfp4.nvfp4_quantize(x2, 16, s_dec)
    return data, scales.view(torch.uint8)


def _te_global(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's ``S_enc`` and ``S_dec`` (``compute_global_encode_scaling_factor_FP4``)."""
    s_enc = torch.minimum(_f(448.0 * 6.0) / amax, _f(FLT_MAX))
    if bool(amax == 0) or bool(s_enc == 0):
        s_enc = _f(1.0)
    return s_enc, _f(1.0) / s_enc


def _model(x2, s_enc, s_dec, *, floor: bool, block: str, encode: str) -> dict:
    """The cast with each of the classes ``scale_floor``, ``block_scale``, ``encode_scale``
    chosen as torchao or TE computes it; E2M1 rounding and packing are torchao's functions."""
    rows, cols = x2.shape
    blocks = x2.reshape(rows, cols // 16, 16)
    block_amax = torch.amax(torch.abs(blocks), dim=-1)
    if block == "torchao":
        pre = (block_amax / 6.0) / s_dec
    else:
        pre = torch.minimum(block_amax * (s_enc * _f(1.0 / 6.0)), _f(FLT_MAX))
    pre = torch.clamp(pre, min=E4M3_TINY, max=448.0) if floor else torch.clamp(pre, max=448.0)
    scale = pre.to(torch.float8_e4m3fn)
    scale_f = scale.to(F32)
    if encode == "torchao":
        enc = (1.0 / s_dec) / scale_f
    else:
        enc = torch.minimum(_f(1.0) / (scale_f * s_dec), _f(FLT_MAX))
    scaled = torch.clamp(blocks * enc.unsqueeze(-1), -6.0, 6.0).reshape(rows, cols)
    codes = ao_kernels.pack_uint4(ao_kernels.f32_to_f4_unpacked(scaled))
    return {"codes": codes, "scales": scale.view(torch.uint8), "pre": pre, "enc": enc,
            "scaled": scaled}  # fmt: skip


def _unpacked(codes: torch.Tensor) -> torch.Tensor:
    return ao_kernels.unpack_uint4(codes.contiguous())


def _walk_nvfp4(x2: torch.Tensor, emulated: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """Counts of the bytes each class changes, and the unexplained ones (by name)."""
    amax = torch.amax(torch.abs(x2))
    s_dec_ao = ao_nvfp4.per_tensor_amax_to_scale(amax)
    s_enc, s_dec = _te_global(amax)
    counts: dict[str, int] = {}
    unexplained: list[str] = []

    def step(name, before, after, allowed_blocks, allowed_elems=None):
        """Scale bytes may change only in ``allowed_blocks``; codes only where ``allowed_elems``
        says, by default in the blocks whose scale byte changed."""
        moved = before[1] != after[1]
        bad_scale = moved & ~allowed_blocks
        elems = _unpacked(before[0]) != _unpacked(after[0])
        allowed = moved.repeat_interleave(16, dim=1) if allowed_elems is None else allowed_elems
        bad_code = elems & ~allowed
        if bool(bad_scale.any()) or bool(bad_code.any()):
            unexplained.append(name)
        changed = int((before[1] != after[1]).sum()) + int(elems.sum())
        if changed:
            counts[name] = counts.get(name, 0) + changed

    ao_own = _ao_cast(x2, s_dec_ao)
    ao_te_global = _ao_cast(x2, s_dec)
    m0 = _model(x2, s_enc, s_dec, floor=True, block="torchao", encode="torchao")
    if not (
        torch.equal(m0["codes"], ao_te_global[0]) and torch.equal(m0["scales"], ao_te_global[1])
    ):
        unexplained.append("model != torchao")
    whole = torch.full_like(m0["scales"], bool(s_dec_ao != s_dec), dtype=torch.bool)
    step("global_scale", ao_own, ao_te_global, whole, whole.repeat_interleave(16, dim=1))
    m1 = _model(x2, s_enc, s_dec, floor=False, block="torchao", encode="torchao")
    step("scale_floor", (m0["codes"], m0["scales"]), (m1["codes"], m1["scales"]),
         m1["pre"] < E4M3_TINY)  # fmt: skip
    m2 = _model(x2, s_enc, s_dec, floor=False, block="te", encode="torchao")
    step("block_scale", (m1["codes"], m1["scales"]), (m2["codes"], m2["scales"]),
         m1["pre"] != m2["pre"])  # fmt: skip
    m3 = _model(x2, s_enc, s_dec, floor=False, block="te", encode="te")
    step("encode_scale", (m2["codes"], m2["scales"]), (m3["codes"], m3["scales"]),
         torch.zeros_like(whole), m2["scaled"] != m3["scaled"])  # fmt: skip
    if not (torch.equal(m3["codes"], emulated[0]) and torch.equal(m3["scales"], emulated[1])):
        unexplained.append("TE model != emulation")
    return {"counts": counts, "unexplained": unexplained}


def _compare_nvfp4(x: torch.Tensor) -> dict:
    """Both usages of the emulation's cast of ``x`` (its amax too) walked against torchao."""
    x2 = x.float()
    data = fp4.quantize(x, rowwise=True, columnwise=True)
    rows, cols = x2.shape
    out = {"counts": {}, "unexplained": []}
    if not torch.equal(data.amax_rowwise, torch.amax(torch.abs(x2)).reshape(1)):
        out["unexplained"].append("amax")
    usages = (
        (x2, data.rowwise_data, data.rowwise_scale_inv[:rows, : cols // 16]),
        (x2.t().contiguous(), data.columnwise_data, data.columnwise_scale_inv[:cols, : rows // 16]),
    )
    for src, codes, scales in usages:
        result = _walk_nvfp4(src, (codes, scales))
        for name, n in result["counts"].items():
            out["counts"][name] = out["counts"].get(name, 0) + n
        out["unexplained"] += result["unexplained"]
    return out


# --------------------------------------------------------------------------------------------
# Same arithmetic: bitwise
# --------------------------------------------------------------------------------------------


def _e2m1_probes() -> torch.Tensor:
    points = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0,
                           5.0, 6.0, 7.0, 1e30, 1e-45, 1e-40, 2.0**-126])  # fmt: skip
    around = torch.cat(
        [torch.nextafter(points, _f(0.0)), points, torch.nextafter(points, _f(1e38))]
    )
    values = torch.cat([around, torch.linspace(0, 8, 4097), torch.tensor([float("inf")])])
    return torch.cat([values, -values])


def test_e2m1_rounding_packing_and_decoding_equal_torchao_bitwise():
    probes = _e2m1_probes()
    ao_codes = ao_kernels.f32_to_f4_unpacked(probes)
    assert torch.equal(fp4.encode_e2m1(probes), ao_codes)
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(fp4.decode_e2m1(codes).view(torch.int32),
                       ao_kernels.f4_unpacked_to_f32(codes).view(torch.int32))  # fmt: skip
    pairs = ao_codes[: (ao_codes.numel() // 2) * 2].reshape(-1, 2)
    assert torch.equal(fp4.pack_fp4(pairs), ao_kernels.pack_uint4(pairs))


# --------------------------------------------------------------------------------------------
# The NVFP4 cast
# --------------------------------------------------------------------------------------------


def test_nvfp4_cast_against_torchao_only_classified_differences():
    totals: dict[str, int] = {}
    failures = []
    for name, x in _cases().items():
        result = _compare_nvfp4(x)
        failures += [f"{name}: {what}" for what in result["unexplained"]]
        for cls, n in result["counts"].items():
            totals[cls] = totals.get(cls, 0) + n
    assert failures == []
    # every documented class shows up on these inputs, and nothing else does
    assert set(totals) == {"global_scale", "scale_floor", "block_scale", "encode_scale"}, totals


def test_nvfp4_same_arithmetic_cases_equal_torchao_bitwise():
    """Where both global scales are 1 and no block scale is below 2^-6, the two casts are the
    same arithmetic: torchao's own bytes equal the emulation's (ties at every E2M1 midpoint,
    both signs, negative zeros, block scales 2^-6..2^8). An all-zero block is not such a case:
    torchao floors its scale (class ``scale_floor``)."""
    x = torch.zeros(32, 64)
    for row in range(32):
        sign = -1.0 if row % 2 else 1.0
        x[row, :16] = sign * torch.tensor(TIES * 2) * 2.0 ** ((row % 15) - 6)
        x[row, 16:32] = -0.0
        x[row, 31] = 1.0
        x[row, 32:48] = torch.linspace(-3.0, 3.0, 16) * 2.0 ** ((row % 9) - 4)
        x[row, 48:63] = -0.0
        x[row, 63] = 6.0
    x[0, 63] = 2688.0
    data = fp4.quantize(x, rowwise=True, columnwise=False)
    codes, scales = _ao_cast(x, ao_nvfp4.per_tensor_amax_to_scale(torch.amax(x.abs())))
    assert torch.equal(codes, data.rowwise_data)
    assert torch.equal(scales, data.rowwise_scale_inv[:32, :4])


def test_nvfp4_dequantize_against_torchao():
    """torchao's ``dequantize`` of the emulation's bytes (with torchao's per-tensor scale):
    ``e2m1 * fp32(S_dec_ao * scale)`` against TE's ``e2m1 * fp32(fp32(scale * amax) *
    fp32(1/2688))``: bitwise equal in every block where the two factors agree; the others are
    class ``dequant_factor`` and differ by at most 2 ulps of the factor."""
    differing = 0
    for name, x in _cases().items():
        if name == "zeros":
            continue  # torchao's scale is 0 there: class global_scale
        x2 = x.float()
        data = fp4.quantize(x2, rowwise=True, columnwise=False)
        rows, cols = x2.shape
        scales = data.rowwise_scale_inv[:rows, : cols // 16].contiguous()
        s_dec_ao = ao_nvfp4.per_tensor_amax_to_scale(data.amax_rowwise.reshape(()))
        tensor = ao_nvfp4.NVFP4Tensor(data.rowwise_data, scales.view(torch.float8_e4m3fn), 16,
                                      F32, s_dec_ao)  # fmt: skip
        ao = tensor.dequantize(F32)
        ours = fp4.dequantize(data, F32)
        scale_f = scales.view(torch.float8_e4m3fn).to(F32)
        f_ao = s_dec_ao * scale_f
        f_te = (scale_f * data.amax_rowwise.reshape(())) * _f(1.0 / 2688.0)
        same = (f_ao == f_te).repeat_interleave(16, dim=1)
        assert torch.equal(ao[same].view(torch.int32), ours[same].view(torch.int32)), name
        finite = (f_ao != f_te) & (f_te > 0) & torch.isfinite(f_te)
        ulps = (f_ao.view(torch.int32) - f_te.view(torch.int32)).abs()[finite]
        assert ulps.numel() == 0 or int(ulps.max()) <= 2, name
        differing += int((ao != ours).sum())
    assert differing > 0  # the class exists on these inputs


# --------------------------------------------------------------------------------------------
# Control: a mutated emulation must fail the same comparison
# --------------------------------------------------------------------------------------------


def _round_half_up(x: torch.Tensor) -> torch.Tensor:
    """E2M1 with ties rounded away from zero instead of to even (the mutation)."""
    x = x.float()
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8)
    for point in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        code += (mag >= point).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def test_control_round_half_up_emulation_diverges(monkeypatch):
    x = _adversarial()["ties"]
    assert _compare_nvfp4(x)["unexplained"] == []
    monkeypatch.setattr(fp4, "encode_e2m1", _round_half_up)
    assert "TE model != emulation" in _compare_nvfp4(x)["unexplained"]


# --------------------------------------------------------------------------------------------
# MXFP8: torchao's to_mx (RCEIL) against the emulation
# --------------------------------------------------------------------------------------------


def _mx_model(x2: torch.Tensor, *, descale: str, exponent: str) -> dict:
    rows, cols = x2.shape
    blocks = x2.float().reshape(rows, cols // 32, 32)
    amax = torch.amax(torch.abs(blocks), dim=-1)
    d = amax / 448.0 if descale == "torchao" else amax * _f(1.0 / 448.0)
    if exponent == "torchao":
        e = torch.ceil(torch.log2(d))
    else:  # the power of two at or above d, exactly (frexp: d = m 2^k, 0.5 <= m < 1)
        m, k = torch.frexp(d)
        e = torch.where(d == 0, -127, torch.where(m == 0.5, k - 1, k)).to(F32)
    biased = (torch.clamp(e, min=-127, max=127) + 127).to(torch.uint8)
    rcp = torch.where(biased == 0, 1.0, torch.exp2(127 - biased.to(F32)))
    scaled = torch.clamp(blocks * rcp.unsqueeze(-1), -448.0, 448.0).reshape(rows, cols)
    return {"codes": scaled.to(torch.float8_e4m3fn).view(torch.uint8), "scales": biased,
            "d": d, "e": e}  # fmt: skip


def _compare_mxfp8(x: torch.Tensor) -> dict:
    counts: dict[str, int] = {}
    unexplained: list[str] = []
    data = mx.quantize(x, torch.float8_e4m3fn, rowwise=True, columnwise=True)
    rows, cols = x.shape
    usages = (
        (x, data.rowwise_data, data.rowwise_scale_inv[:rows, : cols // 32]),
        (
            x.t().contiguous(),
            data.columnwise_data.t(),
            data.columnwise_scale_inv[: rows // 32, :cols].t(),
        ),
    )
    for src, codes, scales in usages:
        ao_scale, ao_data = to_mx(src, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
        m0 = _mx_model(src, descale="torchao", exponent="torchao")
        m1 = _mx_model(src, descale="te", exponent="torchao")
        m2 = _mx_model(src, descale="te", exponent="te")
        if not (torch.equal(m0["codes"], ao_data.view(torch.uint8))
                and torch.equal(m0["scales"], ao_scale.view(torch.uint8))):  # fmt: skip
            unexplained.append("model != torchao")
        if not (torch.equal(m2["codes"], codes) and torch.equal(m2["scales"], scales)):
            unexplained.append("TE model != emulation")
        exact_above = m2["e"] == m1["e"] + 1  # fp32 log2 rounded down to the power of two
        for name, a, b, allowed in (("descale", m0, m1, m0["d"] != m1["d"]),
                                    ("exponent", m1, m2, exact_above)):  # fmt: skip
            blocks = a["scales"] != b["scales"]
            elems = (a["codes"] != b["codes"]).reshape(blocks.shape[0], -1, 32).any(-1)
            if bool((blocks & ~allowed).any()) or bool((elems & ~blocks).any()):
                unexplained.append(name)
            if bool(blocks.any()):
                counts[name] = counts.get(name, 0) + int(blocks.sum())
    return {"counts": counts, "unexplained": unexplained}


def _mx_cases() -> dict[str, torch.Tensor]:
    cases = {}
    for seed in range(8):
        x = _random(100 + seed, (64, 128), spread=30)
        cases[f"random{seed}"] = x.bfloat16() if seed % 2 else x
    powers = torch.zeros(64, 128)
    for row in range(64):  # block amaxes 448 * 2^k, and one to four ulps above it
        k = (row % 40) - 20
        for col in range(4):
            above = torch.tensor(448.0 * 2.0**k, dtype=F32)
            for _ in range(col):
                above = torch.nextafter(above, _f(FLT_MAX))
            powers[row, 32 * col : 32 * col + 32] = torch.linspace(-1, 1, 32) * above
    cases["powers_of_two"] = powers
    cases["zeros_and_negative_zero"] = torch.full((32, 64), -0.0).index_fill_(
        1, torch.arange(32), 0
    )
    gen = torch.Generator().manual_seed(5)
    cases["tiny"] = torch.randn(32, 64, generator=gen) * 1e-39
    return cases


def test_mxfp8_cast_against_torchao_only_classified_differences():
    totals: dict[str, int] = {}
    failures = []
    for name, x in _mx_cases().items():
        result = _compare_mxfp8(x)
        failures += [f"{name}: {what}" for what in result["unexplained"]]
        for cls, n in result["counts"].items():
            totals[cls] = totals.get(cls, 0) + n
    assert failures == []
    assert "exponent" in totals, totals
