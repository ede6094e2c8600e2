"""The NVFP4 emulation against TE 2.20.2's real CUDA kernels, byte for byte (issue 44).

Until these have run on a Blackwell GPU, the project's NVFP4 claims are "per TE 2.20.2's
source" (docs/nvfp4.md): the emulation follows TE's kernels as read, and
``tests/cpu/test_nvfp4_outside_reference.py`` checks it against torchao, but no GPU has compared
the bytes. Each check runs TE's kernel on CUDA and the emulation on CPU on the same input:

* ``NVFP4Quantizer`` casts, 1x16 and 16x16 blocks, both usages, compact and GEMM-swizzled scales
  (``optimize_for_gemm``), bf16 / fp32 input, random, adversarial and non-finite values: data,
  the valid region of the scales (TE leaves the padding uninitialised) and both amaxes;
* the random Hadamard transform of the columnwise copy (``with_rht``, post-RHT amax, bf16), on
  a shape of TE's fused kernel and one of its unfused path, values whose 16-element groups span
  at most 12 binades (the range the emulation claims);
* ``dequantize`` (rowwise, compact scales) to fp32 and bf16;
* the transposes: ``tex.nvfp4_data_transpose``, ``tex.nvfp4_2d_scale_transpose`` and the
  columnwise copy TE derives from a 16x16 rowwise tensor (``update_usage``).

Marked ``gpu`` like the MXFP8 and blockwise kernel tests (the gate deselects them; they skip
without a CUDA GPU of compute capability 10.x and the real TE).
"""

from __future__ import annotations

import pytest
import torch

from nemo_lw_fp8.cpu.formats import nvfp4 as fp4
from nemo_lw_fp8.cpu.te import backend as te_backend
from tests.support.te_test_support import real_te_gpu_skip_reason


def _blackwell_te_reason() -> str | None:
    return real_te_gpu_skip_reason(
        lambda major, minor: major == 10, "TE's NVFP4 kernels need compute capability 10.x"
    )


@pytest.fixture
def real_te(monkeypatch):
    reason = _blackwell_te_reason()
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.delenv("NVTE_USE_FAST_MATH", raising=False)  # the emulation refuses fast math
    assert te_backend.activate() == "transformer_engine"
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer

    return tex, NVFP4Quantizer


def _spread(shape, seed: int, spread: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Normal values, each 16-element block in a random binade (E4M3-subnormal scales too)."""
    gen = torch.Generator().manual_seed(seed)
    binade = torch.randint(-spread, spread + 1, (*shape[:-1], shape[-1] // 16), generator=gen)
    scale = torch.exp2(binade.float()).repeat_interleave(16, dim=-1)
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def _plain_cases() -> dict[str, torch.Tensor]:
    cases = {
        "bf16_128x256": _spread((128, 256), 0, 4),
        "bf16_256x512_wide": _spread((256, 512), 1, 14),
        "bf16_3d": _spread((2, 64, 128), 2, 6),
        "fp32_96x160": _spread((96, 160), 3, 10, torch.float32),
        "bf16_unaligned_48x80": _spread((48, 80), 4, 3),
    }
    special = torch.zeros(64, 128)
    special[0, 0] = 2688.0  # both global scales 1
    for row in range(1, 32):  # E2M1 midpoints at block scales 2^-9..2^8, both signs
        ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
        special[row, 16:32] = (-1) ** row * ties * 2.0 ** ((row % 18) - 9)
    for j, amax in enumerate((0.01, 0.004, 0.0015, 1e-6)):  # subnormal and zero block scales
        special[32 + j, 32:48] = torch.linspace(-amax, amax, 16)
    special[40, 48:64] = -0.0
    special[41, 64:80] = torch.tensor([float("nan"), 1.0] * 8)
    special[42, 80], special[43, 96] = float("inf"), float("-inf")
    cases["bf16_special"] = special.bfloat16()
    cases["fp32_special"] = special
    cases["zeros"] = torch.zeros(32, 64, dtype=torch.bfloat16)
    return cases


def _rht_input(shape, seed: int) -> torch.Tensor:
    """bf16 values whose 16-element groups span at most 9 binades."""
    gen = torch.Generator().manual_seed(seed)
    mag = (1 + torch.rand(shape, generator=gen)) * torch.exp2(
        torch.randint(0, 9, shape, generator=gen).float()
    )
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    return (sign * mag).bfloat16()


def _unswizzled(t, name: str) -> torch.Tensor:
    scales = getattr(t, f"_{name}_scale_inv").cpu()
    return fp4.unswizzle_scales(scales) if t._with_gemm_swizzled_scales else scales


def _compare(key: str, t, ref: fp4.NVFP4Data, rows: int, cols: int) -> list[str]:
    """Names of the buffers of TE's tensor ``t`` that differ from the emulation's ``ref``."""
    failures = []
    for name, r, c in (("rowwise", rows, cols), ("columnwise", cols, rows)):
        want = getattr(ref, f"{name}_data")
        if want is None:
            continue
        if not torch.equal(getattr(t, f"_{name}_data").cpu().view(torch.uint8), want):
            failures.append(f"{key} {name}_data")
        scales = getattr(ref, f"{name}_scale_inv")
        got = _unswizzled(t, name)
        if not torch.equal(got[:r, : c // 16], scales[:r, : c // 16]):
            failures.append(f"{key} {name}_scale_inv")
        if not torch.equal(getattr(t, f"_amax_{name}").cpu(), getattr(ref, f"amax_{name}")):
            failures.append(f"{key} amax_{name}")
    return failures


@pytest.mark.gpu
def test_nvfp4_casts_and_dequantize_match_te_kernels(real_te):
    _, quantizer_cls = real_te
    failures = []
    for case, x in _plain_cases().items():
        rows, cols = fp4.flat_2d(tuple(x.shape))
        for two_d in (False, True):
            for swizzle in (False, True):
                q = quantizer_cls(with_2d_quantization=two_d, stochastic_rounding=False)
                q.optimize_for_gemm = swizzle
                t = q(x.cuda())
                ref = fp4.quantize(x, two_d=two_d)
                key = f"{case} {'16x16' if two_d else '1x16'} swizzle={swizzle}"
                failures += _compare(key, t, ref, rows, cols)
                if t._with_gemm_swizzled_scales:
                    continue  # TE's dequantize kernel reads compact scales only
                for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
                    got = t.dequantize(dtype=dtype).cpu()
                    if not torch.equal(got.view(bits), fp4.dequantize(ref, dtype).view(bits)):
                        failures.append(f"{key} dequantize {dtype}")
    assert failures == []


@pytest.mark.gpu
def test_nvfp4_rht_columnwise_matches_te_kernels(real_te):
    _, quantizer_cls = real_te
    failures = []
    # (128, 256): TE's fused RHT cast (rows % 64, cols % 128); (80, 144): the unfused path
    for seed, shape in enumerate(((128, 256), (256, 512), (80, 144))):
        x = _rht_input(shape, seed)
        for swizzle in (False, True):
            q = quantizer_cls(with_rht=True, with_post_rht_amax=True, stochastic_rounding=False)
            q.optimize_for_gemm = swizzle
            t = q(x.cuda())
            ref = fp4.quantize(x, rht_sign_mask=int(q.rht_matrix_random_sign_mask_t))
            failures += _compare(f"rht {shape} swizzle={swizzle}", t, ref, *shape)
    assert failures == []


@pytest.mark.gpu
def test_nvfp4_transposes_match_te_kernels(real_te):
    tex, quantizer_cls = real_te
    from nemo_lw_fp8.cpu.te.tex import cast_nvfp4

    failures = []
    for seed, shape in enumerate(((128, 256), (48, 80), (256, 64))):
        x = _spread(shape, 10 + seed, 5)
        rows, cols = shape
        ref = fp4.quantize(x, two_d=True)
        got = tex.nvfp4_data_transpose(ref.rowwise_data.cuda()).cpu()
        if not torch.equal(got, fp4.transpose_packed(ref.rowwise_data)):
            failures.append(f"nvfp4_data_transpose {shape}")
        m_tiles, k_tiles = rows // 16, cols // 16
        out_shape = fp4.scale_shape(cols, rows)
        start = torch.full(out_shape, 0xAB, dtype=torch.uint8)  # untouched columns must stay
        got_scales = start.cuda()
        tex.nvfp4_2d_scale_transpose(ref.rowwise_scale_inv.cuda(), got_scales, m_tiles, k_tiles)
        want_scales = start.clone()
        cast_nvfp4.nvfp4_2d_scale_transpose(ref.rowwise_scale_inv, want_scales, m_tiles, k_tiles)
        if not torch.equal(got_scales.cpu(), want_scales):
            failures.append(f"nvfp4_2d_scale_transpose {shape}")
        # the columnwise copy TE derives from a rowwise-only 16x16 tensor
        q = quantizer_cls(columnwise=False, with_2d_quantization=True, stochastic_rounding=False)
        t = q(x.cuda())
        t.update_usage(rowwise_usage=True, columnwise_usage=True)
        failures += _compare(f"_create_columnwise {shape}", t, ref, rows, cols)
    assert failures == []
