"""The kernels of ``transformer_engine_torch`` emulated for TE 2.20.2's own modules (issue 28),
one by one, called through TE's own Python wrappers where TE has one, and the scoped device
answers (``nemo_lw_fp8.cpu.te.device``).

Exact kernels (operand dequantization, quantized outputs, quantized ``dy``) are compared bit for
bit with the project's references; stand-ins (GEMM accumulation, norms, SwiGLU, softmax) with a
float64 reference of the same inputs, within the bound their fp32 arithmetic and the final cast
explain: ``n * 2^-24 * sum|terms|`` for an fp32 sum of ``n`` terms (Higham's gamma_n), plus half a
bf16 ulp (``2^-8 |value|``, bf16 keeps 8 significant bits) for the one cast."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.support.harness import BootOptions, run_on_ranks
from tests.support.te_helpers import spread

BOOT = BootOptions(fp8_emulation=True)
U32, U_BF16 = 2.0**-24, 2.0**-8  # unit roundoffs of fp32 and bf16 (8-bit significand)


_spread = functools.partial(spread, dtype=torch.bfloat16)


def _excess(value: torch.Tensor, ref64: torch.Tensor, bound: torch.Tensor) -> float:
    """How far ``value`` exceeds its bound (<= 0 when within), as a plain float."""
    return float(((value.double() - ref64).abs() - bound).max())


def _quantizer(kind: str, usage: tuple[bool, bool] = (True, True)) -> Any:
    import transformer_engine_torch as tex
    from transformer_engine.pytorch import Float8BlockQuantizer, MXFP8Quantizer

    rowwise, columnwise = usage
    if kind.startswith("mxfp8"):
        q = MXFP8Quantizer(tex.DType.kFloat8E4M3, rowwise=rowwise, columnwise=columnwise)
        q.optimize_for_gemm = kind == "mxfp8-swizzled"
        return q
    dim = 1 if kind == "blockwise-1d" else 2
    return Float8BlockQuantizer(
        tex.DType.kFloat8E4M3, rowwise=rowwise, columnwise=columnwise, block_scaling_dim=dim
    )


def _same_mxfp8_bytes(tensor: Any, reference: Any) -> bool:
    """TE's MXFP8 tensor holds the reference cast's codes and scales, both usages, bitwise."""
    buffers = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
    return all(torch.equal(getattr(tensor, "_" + n), getattr(reference, n)) for n in buffers)


def _reference_dequantize(kind: str, x: torch.Tensor, usage: str) -> torch.Tensor:
    """The project's exact quantize + dequantize of ``x`` in ``usage``, fp32."""
    from nemo_lw_fp8.cpu.formats import blockwise as bw
    from nemo_lw_fp8.cpu.formats import mxfp8 as mx

    if kind.startswith("mxfp8"):
        data = mx.quantize(x, torch.float8_e4m3fn, rowwise=True, columnwise=True)
        return mx.dequantize(data, torch.float32, use=usage)
    data = bw.quantize(x, block_dim=1 if kind == "blockwise-1d" else 2)
    return bw.dequantize(data, torch.float32, use=usage)


def gemm_operands(kind: str) -> dict[str, Any]:
    """``general_gemm`` on quantized operands in TE's three layouts (TN fprop, NN dgrad, NT
    wgrad) against fp32 matmuls of the project's dequantized copies in the usage each layout
    reads; and the same GEMM read in the other usage, which must differ (the data are spread)."""
    from transformer_engine.pytorch.cpp_extensions import general_gemm

    from nemo_lw_fp8.cpu.te import device as te_device

    gen = torch.Generator().manual_seed(3)
    w, x, dy = _spread(128, 256, gen), _spread(256, 256, gen), _spread(256, 128, gen)
    q = _quantizer(kind)
    target = te_device.BLACKWELL if kind.startswith("mxfp8") else te_device.HOPPER
    ref = {
        n: {u: _reference_dequantize(kind, t, u) for u in ("rowwise", "columnwise")}
        for n, t in (("w", w), ("x", x), ("dy", dy))
    }
    out = {}
    with te_device.target_gpu(target):
        wq, xq, dyq = q(w), q(x), q(dy)
        fprop = general_gemm(wq, xq, out_dtype=torch.float32, layout="TN")[0]
        dgrad = general_gemm(wq, dyq, out_dtype=torch.float32, layout="NN")[0]
        wgrad = general_gemm(xq, dyq, out_dtype=torch.float32, layout="NT")[0]
    out["fprop"] = torch.equal(fprop, torch.matmul(ref["x"]["rowwise"], ref["w"]["rowwise"].t()))
    out["dgrad"] = torch.equal(dgrad, torch.matmul(ref["dy"]["rowwise"], ref["w"]["columnwise"]))
    out["wgrad"] = torch.equal(
        wgrad, torch.matmul(ref["dy"]["columnwise"].t(), ref["x"]["columnwise"])
    )
    out["other_usage_differs"] = not torch.equal(
        dgrad, torch.matmul(ref["dy"]["rowwise"], ref["w"]["rowwise"])
    )
    return {"losses": [], **out}


@pytest.mark.parametrize("kind", ["mxfp8", "mxfp8-swizzled", "blockwise-1d", "blockwise-2d"])
def test_gemm_reads_each_operand_in_its_usage(kind):
    """Exact part of ``generic_gemm``: A rowwise if ``transa`` else columnwise, B columnwise if
        ``transb`` else rowwise, dequantized exactly (compact or GEMM-swizzled MXFP8 scales, 1x128 /
        128x128 blockwise); reading the weight rowwise in dgrad would give other bits (except with
    128x128 tiles, whose two copies hold the same values)."""
    r = run_on_ranks(gemm_operands, kind, world_size=1, boot=BOOT)[0]
    # 128x128 tiles share one scale per tile in both directions: the copies hold equal values
    differs = kind != "blockwise-2d"
    assert r == {
        "losses": [],
        "fprop": True,
        "dgrad": True,
        "wgrad": True,
        "other_usage_differs": differs,
    }, r


def gemm_epilogues() -> dict[str, Any]:
    """bf16 ``generic_gemm`` epilogues: bias, alpha, accumulate with beta into an fp32 ``out``
    (``main_grad``), an MXFP8 output quantizer, the bias gradient of ``grad=True``, a 3-D B."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.cpp_extensions import general_gemm

    from nemo_lw_fp8.cpu.formats import mxfp8 as mx
    from nemo_lw_fp8.cpu.te import device as te_device

    gen = torch.Generator().manual_seed(4)
    K = 96
    a = torch.randn(64, K, generator=gen).bfloat16()  # [N, K]
    b = torch.randn(2, 16, K, generator=gen).bfloat16()  # [.., K] -> D [2, 16, 64]
    bias = torch.randn(64, generator=gen).bfloat16()
    a64, b64 = a.double(), b.double()
    prod64 = torch.matmul(b64, a64.t())
    abs64 = torch.matmul(b64.abs(), a64.abs().t())  # sum of |terms| per element
    r: dict[str, Any] = {"losses": []}
    with te_device.target_gpu(te_device.BLACKWELL):
        d, *_ = general_gemm(a, b, out_dtype=torch.bfloat16, bias=bias, alpha=0.5, layout="TN")
        ref = 0.5 * prod64 + bias.double()
        bound = K * U32 * (0.5 * abs64 + bias.double().abs()) + U_BF16 * ref.abs() * 1.01
        r["shape"] = list(d.shape)
        r["bias_alpha_excess"] = _excess(d, ref, bound)

        main_grad = torch.randn(2 * 16, 64, generator=gen)
        before = main_grad.clone()
        general_gemm(
            a,
            b.reshape(32, K),
            out=main_grad,
            out_dtype=torch.float32,
            accumulate=True,
            beta=0.25,
            layout="TN",
        )
        ref = 0.25 * before.double() + prod64.reshape(32, 64)
        bound = (K + 1) * U32 * (0.25 * before.double().abs() + abs64.reshape(32, 64))
        r["accumulate_excess"] = _excess(main_grad, ref, bound)
        fp32 = general_gemm(a, b.reshape(32, K), out_dtype=torch.float32, layout="TN")[0]
        r["accumulate_is_one_fp32_sum"] = torch.equal(main_grad, 0.25 * before + fp32)

        q = _quantizer("mxfp8", (True, True))
        dq, *_ = general_gemm(
            a, b.reshape(32, K), out_dtype=torch.bfloat16, quantization_params=q, layout="TN"
        )
        plain = general_gemm(a, b.reshape(32, K), out_dtype=torch.bfloat16, layout="TN")[0]
        want = mx.quantize(plain)
        r["quantized_output_bytes"] = type(dq).__name__ == "MXFP8Tensor" and _same_mxfp8_bytes(
            dq, want
        )

        x = torch.randn(32, K, generator=gen).bfloat16()
        dy = torch.randn(32, 64, generator=gen).bfloat16()
        dw, db, *_ = general_gemm(
            x, dy, out_dtype=torch.bfloat16, bias=bias, grad=True, layout="NT"
        )
        ref_db = dy.double().sum(0)
        bound_db = 32 * U32 * dy.double().abs().sum(0) + U_BF16 * ref_db.abs() * 1.01
        r["dbias_excess"] = _excess(db, ref_db, bound_db)
        r["dw_shape"] = list(dw.shape)

        def plain_generic_gemm(first, **kwargs):
            """``tex.generic_gemm(first, transa, b, ...)`` with every optional input off (no
            output, bias, gelu, workspace, accumulation): one refusal case varies one input."""
            off = (None, None, None, None, None, False, None, False, torch.empty(0), 0)
            return tex.generic_gemm(first, True, b, False, *off, False, False, **kwargs)

        refusals = {}
        for name, call in {
            "gelu": lambda: general_gemm(a, b, out_dtype=torch.bfloat16, gelu=True),
            "float8": lambda: plain_generic_gemm(_float8_storage(a)),
            "overlap": lambda: plain_generic_gemm(a, comm_overlap=object()),
        }.items():
            try:
                call()
                refusals[name] = "no error"
            except NotImplementedError as exc:
                refusals[name] = str(exc)
        r["refusals"] = refusals
    with te_device.target_gpu(te_device.BLACKWELL):
        try:  # blockwise operands on SM 10.0: TE converts them to MXFP8 scaling
            general_gemm(
                _quantizer("blockwise-2d")(a),
                _quantizer("blockwise-1d")(b.reshape(32, K).repeat(4, 1)),
                out_dtype=torch.bfloat16,
            )
            r["blockwise_on_blackwell"] = "no error"
        except NotImplementedError as exc:
            r["blockwise_on_blackwell"] = str(exc)
    return r


def _float8_storage(a: torch.Tensor) -> Any:
    """A per-tensor-scaled FP8 tensor (delayed / current scaling), which is not emulated."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import (
        Float8TensorStorage,
    )

    return Float8TensorStorage(
        data=torch.zeros(a.shape, dtype=torch.uint8),
        fp8_scale_inv=torch.ones(1),
        fp8_dtype=tex.DType.kFloat8E4M3,
        fake_dtype=torch.bfloat16,
    )


def test_gemm_epilogues_and_refusals():
    """Stand-in part of ``generic_gemm`` (bf16 operands): within gamma_K of float64 plus one bf16
    rounding with bias and alpha; ``accumulate`` into fp32 ``main_grad`` is one fp32 sum
    ``beta * out + D``; the MXFP8 output quantizer gives the project's bytes of the bf16 result;
    dbias within gamma_M; refused by name: GELU epilogue, per-tensor FP8 operands, comm overlap,
    blockwise operands on an SM 10.0 target."""
    r = run_on_ranks(gemm_epilogues, world_size=1, boot=BOOT)[0]
    assert r["shape"] == [2, 16, 64] and r["dw_shape"] == [64, 96]
    for key in ("bias_alpha_excess", "accumulate_excess", "dbias_excess"):
        assert r[key] <= 0, (key, r[key])
    assert r["accumulate_is_one_fp32_sum"] and r["quantized_output_bytes"]
    assert "GELU" in r["refusals"]["gelu"]
    assert "Float8TensorStorage" in r["refusals"]["float8"]
    assert "communication overlap" in r["refusals"]["overlap"]
    assert "blockwise FP8 operands on SM (10, 0)" in r["blockwise_on_blackwell"]


def bgrad_quantize_case() -> dict[str, Any]:
    """``tex.bgrad_quantize`` with an MXFP8 quantizer (TE's MXFP8 backward)."""
    import transformer_engine_torch as tex

    from nemo_lw_fp8.cpu.formats import mxfp8 as mx

    gen = torch.Generator().manual_seed(5)
    dy = _spread(96, 64, gen)
    dbias, q = tex.bgrad_quantize(dy, _quantizer("mxfp8"))
    want = mx.quantize(dy)
    ref = dy.double().sum(0)
    bound = 96 * U32 * dy.double().abs().sum(0) + U_BF16 * ref.abs() * 1.01
    return {
        "losses": [],
        "bytes": _same_mxfp8_bytes(q, want),
        "dbias_excess": _excess(dbias, ref, bound),
        "dtype": str(dbias.dtype),
    }


def test_bgrad_quantize():
    """Exact: the quantized ``dy`` has the project's MXFP8 bytes; stand-in: dbias within
    gamma_M of the float64 column sum plus one bf16 rounding, in dy's dtype."""
    r = run_on_ranks(bgrad_quantize_case, world_size=1, boot=BOOT)[0]
    assert r["bytes"] and r["dbias_excess"] <= 0 and r["dtype"] == "torch.bfloat16", r


def norm_cases() -> dict[str, Any]:
    """RMSNorm / LayerNorm forward and backward (with and without zero-centred gamma) against
    float64 autograd of the same bf16 inputs."""
    import transformer_engine_torch as tex

    gen = torch.Generator().manual_seed(6)
    H, eps = 256, 1e-5
    x = (torch.randn(48, H, generator=gen) * 3 + 1).bfloat16()
    dz = torch.randn(48, H, generator=gen).bfloat16()
    gamma = (torch.rand(H, generator=gen) + 0.5).bfloat16()
    beta = torch.randn(H, generator=gen).bfloat16()
    out: dict[str, Any] = {"losses": []}
    for norm in ("RMSNorm", "LayerNorm"):
        for zc in (False, True):
            x64 = x.double().requires_grad_()
            g64 = gamma.double().requires_grad_()
            b64 = beta.double().requires_grad_()
            scale = g64 + 1 if zc else g64
            if norm == "RMSNorm":
                rs = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
                y64 = x64 * rs * scale
                y, _, rsigma = tex.rmsnorm_fwd(x, gamma, eps, None, None, None, 0, zc)
                dx, dg = tex.rmsnorm_bwd(dz, x, rsigma, gamma, 0, zc)
                db = None
            else:
                mu = x64.mean(-1, keepdim=True)
                rs = torch.rsqrt((x64 - mu).pow(2).mean(-1, keepdim=True) + eps)
                y64 = (x64 - mu) * rs * scale + b64
                y, mu_, rsigma = tex.layernorm_fwd(x, gamma, beta, eps, None, None, None, 0, zc)
                dx, dg, db = tex.layernorm_bwd(dz, x, mu_, rsigma, gamma, 0, zc)
            y64.backward(dz.double())
            xhat = (y64.detach() - (b64.detach() if norm == "LayerNorm" else 0)) / scale.detach()
            # fp32 reductions over H terms, then one bf16 cast of each result.
            tol_y = (
                H * U32 * 8 * (xhat.abs().max() * scale.detach().abs())
                + U_BF16 * 1.01 * y64.detach().abs()
            )
            gx = x64.grad
            tol_dx = H * U32 * 16 * gx.abs().max() + U_BF16 * 1.01 * gx.abs()
            tol_dg = (
                48 * U32 * 16 * (dz.double() * xhat).abs().sum(0) + U_BF16 * 1.01 * g64.grad.abs()
            )
            key = f"{norm}{'-zc' if zc else ''}"
            out[key] = {
                "y": _excess(y, y64.detach(), tol_y),
                "rsigma": _excess(
                    rsigma, rs.detach().reshape(-1), H * U32 * 8 * rs.detach().reshape(-1)
                ),
                "dx": _excess(dx, gx, tol_dx),
                "dgamma": _excess(dg, g64.grad, tol_dg),
            }
            if db is not None:
                tol_db = 48 * U32 * dz.double().abs().sum(0) + U_BF16 * 1.01 * b64.grad.abs()
                out[key]["dbeta"] = _excess(db, b64.grad, tol_db)
    x2 = torch.randn(48, H, generator=gen).bfloat16()
    _, _, rsigma = tex.rmsnorm_fwd(x, gamma, eps, None, None, None, 0, False)
    plain = tex.rmsnorm_bwd(dz, x, rsigma, gamma, 0, False)[0]
    added = tex.rmsnorm_bwd_add(dz, x, x2, rsigma, gamma, 0, False)[0]
    out["bwd_add_is_dx_plus_add"] = _excess(
        added,
        plain.double() + x2.double(),
        U_BF16 * 2.02 * (plain.double().abs() + x2.double().abs()),
    )
    return out


def test_norm_kernels_against_float64():
    """Stand-ins: rmsnorm / layernorm forward and backward within fp32 reductions over H terms
    plus one bf16 rounding of the float64 result (output, rsigma, dx, dgamma, dbeta; zero-centred
    gamma too); ``rmsnorm_bwd_add`` = dx + add within two bf16 roundings."""
    r = run_on_ranks(norm_cases, world_size=1, boot=BOOT)[0]
    for key, value in r.items():
        if isinstance(value, dict):
            for what, excess in value.items():
                assert excess <= 0, (key, what, excess)
    assert r["bwd_add_is_dx_plus_add"] <= 0, r


def activation_and_softmax_cases() -> dict[str, Any]:
    """SwiGLU (plain and scaled) and the four softmax kernels against float64 autograd."""
    import transformer_engine_torch as tex

    gen = torch.Generator().manual_seed(8)
    r: dict[str, Any] = {"losses": []}
    x = (torch.randn(64, 2 * 96, generator=gen) * 2).bfloat16()
    g = torch.randn(64, 96, generator=gen).bfloat16()
    s = torch.rand(64, generator=gen) + 0.5
    x64 = x.double().requires_grad_()
    s64 = s.double().requires_grad_()
    a64, b64 = x64[:, :96], x64[:, 96:]
    y64 = torch.nn.functional.silu(a64) * b64
    ys64 = y64 * s64[:, None]
    elementwise = 16 * U32  # a handful of fp32 operations per element

    def tol(ref: torch.Tensor) -> torch.Tensor:
        return (elementwise + U_BF16 * 1.01) * ref.abs() + 1e-30

    r["swiglu"] = _excess(tex.swiglu(x, None), y64.detach(), tol(y64.detach()))
    r["scaled_swiglu"] = _excess(
        tex.scaled_swiglu(x, s, None, 0), ys64.detach(), tol(ys64.detach())
    )
    dx64 = torch.autograd.grad(y64, x64, g.double(), retain_graph=True)[0]
    r["dswiglu"] = _excess(
        tex.dswiglu(g, x, None), dx64, tol(dx64) + elementwise * dx64.abs().max()
    )
    dxs64, ds64 = torch.autograd.grad(ys64, (x64, s64), g.double())
    dxs, ds = tex.scaled_dswiglu(g, x, s, None, 0, True)
    r["scaled_dswiglu"] = _excess(dxs, dxs64, tol(dxs64) + elementwise * dxs64.abs().max())
    terms = (g.double() * y64.detach()).abs().sum(-1)
    r["scaled_dswiglu_dscales"] = _excess(ds, ds64, 96 * U32 * 4 * terms)
    try:
        tex.scaled_swiglu(x, s, None, 32)
        r["interleave"] = "no error"
    except NotImplementedError as exc:
        r["interleave"] = str(exc)

    b, h, sq, sk, scale = 2, 3, 16, 24, 0.3
    z = (torch.randn(b, h, sq, sk, generator=gen) * 3).bfloat16()
    gz = torch.randn(b, h, sq, sk, generator=gen).bfloat16()
    mask = torch.rand(b, 1, sq, sk, generator=gen) < 0.3
    mask[0, 0, 2] = True  # a fully masked row: zeros
    rows = torch.arange(sq)[:, None]
    cols = torch.arange(sk)[None, :]
    causal = cols >= rows + (sk - sq + 1)
    square = torch.arange(sk)[None, :] > torch.arange(sk)[:, None]
    cases = {
        "scaled": (z, None, "scaled_softmax"),
        "masked": (z, mask, "scaled_masked_softmax"),
        "aligned_causal": (z, causal, "scaled_aligned_causal_masked_softmax"),
        "upper_triang": (
            (torch.randn(b * h, sk, sk, generator=gen) * 3).bfloat16(),
            square,
            "scaled_upper_triang_masked_softmax",
        ),
    }
    for name, (inp, excluded, kernel) in cases.items():
        grad = gz if inp.dim() == 4 else torch.randn(inp.shape, generator=gen).bfloat16()
        z64 = (inp.double() * scale).requires_grad_()
        zz = z64 if excluded is None else z64.masked_fill(excluded.expand_as(z64), float("-inf"))
        p64 = torch.softmax(zz, -1)
        p64 = torch.nan_to_num(p64, nan=0.0)  # fully masked rows: TE outputs zeros
        fwd = getattr(tex, kernel + "_forward")
        y = fwd(inp, mask, scale) if name == "masked" else fwd(inp, scale)
        dz64 = torch.autograd.grad(p64, z64, grad.double())[0] * scale
        dz = getattr(tex, kernel + "_backward")(grad, y, scale)
        # backward from TE's bf16 output y: its rounding (2^-8 relative) enters dx
        dref = (
            scale
            * y.double()
            * (grad.double() - (grad.double() * y.double()).sum(-1, keepdim=True))
        )
        r[f"softmax_{name}"] = _excess(
            y, p64.detach(), (sk * U32 * 8 + U_BF16 * 1.01) * p64.detach().abs() + 1e-30
        )
        r[f"softmax_{name}_bwd"] = _excess(
            dz,
            dref,
            sk * U32 * 8 * (scale * y.double().abs() * grad.double().abs().sum(-1, keepdim=True))
            + U_BF16 * 1.01 * dref.abs(),
        )
        r[f"softmax_{name}_bwd_vs_exact"] = float(
            (dz.double() - dz64).abs().max() / dz64.abs().max()
        )
    return r


def test_activation_and_softmax_kernels_against_float64():
    """Stand-ins: ``swiglu`` / ``scaled_swiglu`` and their backwards elementwise within a few
    fp32 operations plus one bf16 rounding; d(scales) within gamma_H; the interleaved GLU layout
    refused by name; the four softmax kernels of TE's unfused attention within gamma_sk plus one
    bf16 rounding (masked: ``-10000`` fill, fully masked rows zero; causal masks aligned as TE's
    kernels), backwards within gamma_sk of the formula on TE's bf16 output, and within 2^-6 of
    the float64 gradient relative to its largest value."""
    r = run_on_ranks(activation_and_softmax_cases, world_size=1, boot=BOOT)[0]
    for key, value in r.items():
        if key in ("losses", "interleave"):
            continue
        if key.endswith("_vs_exact"):
            assert value <= 2.0**-6, (key, value)
        else:
            assert value <= 0, (key, value)
    assert "glu_interleave_size=32" in r["interleave"]


def device_answers() -> dict[str, Any]:
    """What ``target_gpu`` answers, to whom, and what it restores."""
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex
    from transformer_engine.common.recipe import Float8BlockScaling, MXFP8BlockScaling
    from transformer_engine.pytorch import quantization, utils

    from nemo_lw_fp8.cpu.te import device as te_device

    r: dict[str, Any] = {"losses": []}
    te_frame = {"__name__": "transformer_engine.pytorch.module.base", "torch": torch}
    asked_by_te = "x.is_cuda, torch.cuda.is_available()"
    x = torch.zeros(2)
    original_capability = utils.get_device_compute_capability
    try:
        tex.get_cublasLt_version()
        r["outside"] = "no error"
    except RuntimeError as exc:
        r["outside"] = str(exc)
    with te_device.target_gpu(te_device.HOPPER):
        r["hopper_capability"] = list(quantization.get_device_compute_capability())
        r["hopper_block_scaling"] = quantization.check_fp8_block_scaling_support()[0]
        r["hopper_cublaslt"] = tex.get_cublasLt_version()
        r["te_sees_cuda"] = list(eval(asked_by_te, te_frame, {"x": x}))
        r["others_see_cuda"] = [x.is_cuda, torch.cuda.is_available()]
        try:
            with te.autocast(enabled=True, recipe=MXFP8BlockScaling()):
                pass
            r["mxfp8_on_hopper"] = "no error"
        except RuntimeError as exc:
            r["mxfp8_on_hopper"] = str(exc)
        r["backend"] = int(tex.get_fused_attn_backend(None)[0])
    with te_device.target_gpu(te_device.BLACKWELL):
        r["blackwell_capability"] = list(utils.get_device_compute_capability())
        r["blackwell_cublaslt"] = tex.get_cublasLt_version()
        with te.autocast(enabled=True, recipe=MXFP8BlockScaling()):
            r["mxfp8_on_blackwell"] = True
        with te.autocast(enabled=True, recipe=Float8BlockScaling()):
            r["blockwise_autocast_on_blackwell"] = True
    r["restored"] = [
        utils.get_device_compute_capability is original_capability,
        quantization.get_device_compute_capability is original_capability,
        "is_cuda" not in torch.Tensor.__dict__,
        list(eval(asked_by_te, te_frame, {"x": x})) == [False, False],
    ]
    return r


def test_device_answers_are_scoped():
    """``target_gpu``: TE's helpers (and copies imported by name) answer the target's compute
    capability, cuBLASLt version and support checks; CPU tensors are CUDA and CUDA is available
    only when TE's module code asks; MXFP8 on SM 9.0 is refused with TE's own message; no fused
    attention backend; everything restored on exit; the version queries refuse outside a scope."""
    r = run_on_ranks(device_answers, world_size=1, boot=BOOT)[0]
    assert "tex.get_cublasLt_version" in r["outside"]
    assert r["hopper_capability"] == [9, 0] and r["hopper_block_scaling"]
    assert r["hopper_cublaslt"] == 120900 and r["blackwell_cublaslt"] == 130300
    assert r["te_sees_cuda"] == [True, True] and r["others_see_cuda"] == [False, False]
    assert "Device compute capability 10.0 or higher required for MXFP8" in r["mxfp8_on_hopper"]
    assert r["backend"] == -1
    assert r["blackwell_capability"] == [10, 0] and r["mxfp8_on_blackwell"]
    assert r["restored"] == [True, True, True, True], r["restored"]


def grouped_data_movement() -> dict[str, Any]:
    """``split_quantize`` and the row padding kernels on edge cases (an empty split, a split
    that is not a multiple of 32 for blockwise)."""
    import transformer_engine_torch as tex

    from nemo_lw_fp8.cpu.formats import blockwise as bw
    from nemo_lw_fp8.cpu.formats import mxfp8 as mx

    gen = torch.Generator().manual_seed(9)
    r: dict[str, Any] = {"losses": []}
    x = _spread(160, 256, gen)
    names = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
    for kind, splits in (("mxfp8", [64, 0, 96]), ("blockwise-1d", [40, 0, 120])):
        parts = tex.split_quantize(x, splits, [_quantizer(kind) for _ in splits])
        same = []
        for part, chunk in zip(parts, torch.split(x, splits), strict=True):
            if kind == "mxfp8":
                want = mx.quantize(chunk.contiguous()) if chunk.numel() else None
            else:
                want = bw.quantize(chunk.contiguous(), block_dim=1) if chunk.numel() else None
            if want is None:
                same.append(tuple(part.size()) == (0, 256))
                continue
            same.append(all(torch.equal(getattr(part, "_" + n), getattr(want, n)) for n in names))
        r[f"split_quantize_{kind}"] = same
    rows, padded = [5, 0, 33], [32, 0, 64]
    src = torch.randn(sum(rows), 8, generator=gen).bfloat16()
    out = torch.full((sum(padded), 8), float("nan"), dtype=torch.bfloat16)
    tex.fused_multi_row_padding(src, out, rows, padded)
    want = torch.zeros(sum(padded), 8, dtype=torch.bfloat16)
    want[0:5], want[32:65] = src[0:5], src[5:38]
    r["padding"] = torch.equal(out, want)
    back = torch.empty_like(src)
    tex.fused_multi_row_unpadding(out, back, padded, rows)
    r["unpadding"] = torch.equal(back, src)
    return r


def test_grouped_data_movement_is_exact():
    """Exact kernels of TE's discrete grouped path: ``split_quantize`` gives each split the
    project's bytes (MXFP8 and 1x128 blockwise, an empty split included); row padding writes
    each chunk at its padded offset with zero padding rows, unpadding restores the input."""
    r = run_on_ranks(grouped_data_movement, world_size=1, boot=BOOT)[0]
    assert r["split_quantize_mxfp8"] == [True] * 3, r
    assert r["split_quantize_blockwise-1d"] == [True] * 3, r
    assert r["padding"] and r["unpadding"], r
