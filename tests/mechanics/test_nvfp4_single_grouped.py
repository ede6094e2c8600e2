"""NVFP4 on TE 2.20.2's op-fuser grouped-tensor path on CPU (issue 30): ``tex.group_quantize``
with NVFP4 quantizers and the grouped-tensor GEMMs on NVFP4 members
(``nemo_lw_fp8/cpu/te/tex/grouped_tensor_nvfp4.py``), on the B200 target, stochastic
rounding off and the RHT on (TE's predicate sends NVFP4 to this path only then).

What TE itself allows, read from its C++ (docs/nvfp4.md, "Single grouped weights (the
grouped-tensor path)"): ``group_quantize`` has an NVFP4 kernel only for 1x16 blocks with the
RHT, so the weight quantizer (16x16 blocks, or no RHT) fails with TE's own error, and bf16
single grouped weights, cast with ``group_quantize`` at every forward, do not run. Single
grouped weights that are already NVFP4 (FP4 primary weights, ``quantized_model_init``) go to the
grouped GEMM as they are: those run, and are what is compared here.

Every TE call runs in a spawned rank (this process never imports TE or megatron). Each parity
has a control kept in the suite (``tests.support.parity.assert_diverges``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.harness import BootOptions, run_on_ranks
from tests.support.parity import assert_diverges

BOOT = BootOptions(fp8_emulation=True)
K, N = 256, 128  # in / out features: multiples of 128, as TE's grouped NVFP4 kernels need
SPLITS = [256, 0, 128, 128]  # tokens per expert (one without tokens), multiples of 128
BUFFERS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def _recipe() -> Any:
    from transformer_engine.common.recipe import NVFP4BlockScaling

    return NVFP4BlockScaling(disable_stochastic_rounding=True)  # RHT on: TE's default


def _inputs(tokens: list[int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens at a different scale per expert (a shared amax would change the smaller ones)."""
    x = torch.cat([torch.randn(s, K, generator=gen) * 2.0**-i for i, s in enumerate(tokens)])
    dy = torch.randn(sum(tokens), N, generator=gen) * 0.01
    return x.bfloat16(), dy.bfloat16()


class _Cast:
    """The controls' mutation of the plain-torch cast the grouped-tensor kernel calls: each
    member's rowwise copy cast with the whole input's amax (``shared_amax``), or the columnwise
    copy without the RHT (``no_rht``)."""

    def __init__(self, what: str) -> None:
        from nemo_lw_fp8.cpu.formats import nvfp4

        self.fp4, self.what, self.whole = nvfp4, what, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fp4, name)

    def quantize(self, part, rowwise=True, columnwise=True, rht_sign_mask=None, **kwargs):
        if self.what == "no_rht":
            return self.fp4.quantize(part, rowwise=rowwise, columnwise=columnwise, **kwargs)
        data = self.fp4.quantize(
            part, rowwise=rowwise, columnwise=columnwise, rht_sign_mask=rht_sign_mask, **kwargs
        )
        if rowwise:
            plain = self.fp4.quantize(part, rowwise=True, columnwise=False, amax=self.whole)
            data.rowwise_data, data.rowwise_scale_inv = plain.rowwise_data, plain.rowwise_scale_inv
            data.amax_rowwise = plain.amax_rowwise
        return data


def _mutate(mp: pytest.MonkeyPatch, mutation: str | None) -> None:
    """``shared_amax`` / ``no_rht``: :class:`_Cast` in ``group_quantize`` (inputs and
    gradients). ``member_order``: the grouped GEMMs pair each expert's tokens with the next
    expert's grouped weight. ``weight_amax``: every grouped weight member read with the first
    member's amaxes (one global scale for all experts' weights)."""
    from nemo_lw_fp8.cpu.te.tex import grouped_tensor_nvfp4 as grouped

    if mutation in ("shared_amax", "no_rht"):
        shim, real = _Cast(mutation), grouped.group_quantize_nvfp4

        def group_quantize(tensor, *args, **kwargs):
            shim.whole = tensor.detach().float().abs().max().reshape(1)
            return real(tensor, *args, **kwargs)

        mp.setattr(grouped, "_fp4", shim)
        mp.setattr(grouped, "group_quantize_nvfp4", group_quantize)
    elif mutation in ("member_order", "weight_amax"):
        real_members = grouped.nvfp4_members

        def members(tensor: Any, shapes: Any) -> list[Any]:
            out = real_members(tensor, shapes)
            if tensor.first_dims is not None:  # an activation or gradient, not the weight
                return out
            if mutation == "member_order":
                return out[1:] + out[:1]
            for m in out[1:]:
                m._amax_rowwise, m._amax_columnwise = out[0]._amax_rowwise, out[0]._amax_columnwise
            return out

        mp.setattr(grouped, "nvfp4_members", members)
    elif mutation is not None:
        raise ValueError(mutation)


def _record(mp: pytest.MonkeyPatch, seen: list[str]) -> None:
    """Name every grouped kernel TE calls (with the types of its quantized operands)."""
    import transformer_engine_torch as tex

    names = (
        "group_quantize", "split_quantize", "te_general_grouped_gemm",
        "te_general_grouped_gemm_for_grouped_tensor", "te_general_grouped_gemm_for_discrete_in",
        "te_general_grouped_gemm_for_discrete_out",
    )  # fmt: skip
    for name in names:
        real = getattr(tex, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            seen.append(_name)
            return _real(*args, **kwargs)

        mp.setattr(tex, name, wrapped)


def _run(module: Any, x0: torch.Tensor, dy: torch.Tensor, splits: Any) -> dict[str, Any]:
    """One forward / backward of ``module`` under the recipe: output and dgrad."""
    import transformer_engine.pytorch as te

    x = x0.clone().requires_grad_()
    with te.autocast(enabled=True, recipe=_recipe()):
        y = module(x, splits)
    y.backward(dy)
    return {"out": y.detach(), "dx": x.grad.detach()}


def _single_grouped_once(mutation: str | None, fuse_wgrad: bool) -> dict[str, Any]:
    """TE's ``ops.GroupedLinear(single_grouped_weight=True)`` with FP4 primary weights (built
    under ``quantized_model_init``), on the grouped-tensor path, against TE's module
    ``GroupedLinear`` (discrete FP4 primary weights ``weight0..3``, its ``split_quantize`` path)
    whose weights are cast from the same bf16 values; an expert without tokens included. With
    ``fuse_wgrad`` both accumulate their wgrads into fp32 ``main_grad`` buffers (megatron's
    ``gradient_accumulation_fusion``), else they return bf16 ``.grad``."""
    import transformer_engine.pytorch as te

    from nemo_lw_fp8.cpu.te import device as te_device

    experts = len(SPLITS)
    gen = torch.Generator().manual_seed(30)
    weights = [(torch.randn(N, K, generator=gen) * 0.05).bfloat16() for _ in range(experts)]
    x0, dy = _inputs(SPLITS, gen)
    main_grad0 = torch.randn(experts, N, K, generator=gen) * 1e-3
    seen: list[str] = []
    with pytest.MonkeyPatch.context() as mp, te_device.target_gpu(te_device.BLACKWELL):
        mp.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1")
        with te.quantized_model_init(enabled=True, recipe=_recipe()):
            op = te.ops.GroupedLinear(
                experts, K, N, bias=False, device="cpu", dtype=torch.bfloat16,
                single_grouped_weight=True, accumulate_into_main_grad=fuse_wgrad,
            )  # fmt: skip
            module = te.GroupedLinear(
                experts, K, N, bias=False, params_dtype=torch.bfloat16, device="cpu",
                fuse_wgrad_accumulation=fuse_wgrad,
            )  # fmt: skip
        with torch.no_grad():
            for i, w in enumerate(weights):
                op.weight.quantized_tensors[i].copy_(w)  # TE's cast, into the grouped buffers
                getattr(module, f"weight{i}").copy_(w)
        stored = all(
            torch.equal(
                getattr(op.weight.quantized_tensors[i], "_" + name),
                getattr(getattr(module, f"weight{i}"), "_" + name),
            )
            for i in range(experts)
            for name in (*BUFFERS, "amax_rowwise", "amax_columnwise")
        )
        if fuse_wgrad:
            op.weight.main_grad = main_grad0.clone().view(-1)
            op.weight.overwrite_main_grad = False
            for i in range(experts):
                getattr(module, f"weight{i}").main_grad = main_grad0[i].clone()
        _mutate(mp, mutation)
        _record(mp, seen)
        got = _run(op, x0, dy, torch.tensor(SPLITS, dtype=torch.int64))
        op_kernels = list(seen)
        seen.clear()
        ref = _run(module, x0, dy, SPLITS)
        module_kernels = sorted(set(seen))
    for i in range(experts):
        if fuse_wgrad:
            got[f"dw{i}"] = op.weight.main_grad.view(experts, N, K)[i].clone()
            ref[f"dw{i}"] = getattr(module, f"weight{i}").main_grad.clone()
        else:
            got[f"dw{i}"] = op.weight.grad.reshape(experts, N, K)[i].clone()
            ref[f"dw{i}"] = getattr(module, f"weight{i}").grad.clone()
    return {
        "losses": [float(got["out"].float().sum())],  # what tests.support.parity expects of a run
        "te": got, "ref": ref, "stored": stored, "op_kernels": sorted(set(op_kernels)),
        "module_kernels": module_kernels, "weight_type": type(op.weight).__name__,
        "member_type": type(op.weight.quantized_tensors[0]).__name__,
    }  # fmt: skip


def single_grouped_fp4_run(mutations: tuple[str | None, ...], fuse_wgrad: bool) -> dict:
    """:func:`_single_grouped_once` for each of ``mutations`` in one rank (None: unmutated)."""
    return {str(m): _single_grouped_once(m, fuse_wgrad) for m in mutations}


def _te_equals_reference(reference: list[dict], results: list[dict]) -> None:
    """Bitwise: the op's tensors of ``results`` against the module's of ``reference``."""
    ref, te = reference[0]["ref"], results[0]["te"]
    assert ref.keys() == te.keys(), (ref.keys(), te.keys())
    differ = [k for k in ref if not torch.equal(ref[k], te[k])]
    by = {k: float((te[k].double() - ref[k].double()).abs().max()) for k in differ}
    assert not differ, f"the op differs from the module in {differ} (max |diff| {by})"


def _discrete_bf16_once(mutation: str | None) -> dict[str, Any]:
    """TE's ``ops.GroupedLinear`` with discrete bf16 weights under NVFP4 on the grouped-tensor
    path (``group_quantize`` for the input and the gradient, the weights cast one by one, the
    discrete-in / discrete-out GEMMs) against TE's module ``GroupedLinear`` with the same weights
    (its ``split_quantize`` path, ``tests/cpu/test_nvfp4_grouped.py``: equal to one TE ``Linear``
    per expert); an expert without tokens included."""
    import transformer_engine.pytorch as te

    from nemo_lw_fp8.cpu.te import device as te_device

    experts = len(SPLITS)
    gen = torch.Generator().manual_seed(29)
    weights = [(torch.randn(N, K, generator=gen) * 0.05).bfloat16() for _ in range(experts)]
    x0, dy = _inputs(SPLITS, gen)
    seen: list[str] = []
    with pytest.MonkeyPatch.context() as mp, te_device.target_gpu(te_device.BLACKWELL):
        op = te.ops.GroupedLinear(experts, K, N, bias=False, device="cpu", dtype=torch.bfloat16)
        module = te.GroupedLinear(
            experts, K, N, bias=False, params_dtype=torch.bfloat16, device="cpu"
        )
        with torch.no_grad():
            for i, w in enumerate(weights):
                getattr(op, f"weight{i}").copy_(w)
                getattr(module, f"weight{i}").copy_(w)
        _mutate(mp, mutation)
        _record(mp, seen)
        got = _run(op, x0, dy, torch.tensor(SPLITS, dtype=torch.int64))
        op_kernels = sorted(set(seen))
        seen.clear()
        ref = _run(module, x0, dy, SPLITS)
        module_kernels = sorted(set(seen))
    for i in range(experts):
        got[f"dw{i}"] = getattr(op, f"weight{i}").grad.clone()
        ref[f"dw{i}"] = getattr(module, f"weight{i}").grad.clone()
    return {
        "losses": [float(got["out"].float().sum())],
        "te": got, "ref": ref, "op_kernels": op_kernels, "module_kernels": module_kernels,
    }  # fmt: skip


def discrete_bf16_run(mutations: tuple[str | None, ...]) -> dict:
    """:func:`_discrete_bf16_once` for each of ``mutations`` in one rank (None: unmutated)."""
    return {str(m): _discrete_bf16_once(m) for m in mutations}


def _refused(fn: Any) -> str:
    try:
        fn()
    except (RuntimeError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def group_quantize_kernels() -> dict[str, Any]:
    """``tex.group_quantize`` with TE's input quantizer (RHT, post-RHT amax, 1x16 blocks, both
    usages) on four members of 256 / 0 / 128 / 256 rows, compact and GEMM-swizzled scales:
    each member against the plain-torch cast of its rows and against ``tex.split_quantize``
    (TE's module path); the controls' casts; and what TE refuses on this path."""
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex
    from transformer_engine.common.recipe import NVFP4BlockScaling
    from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer

    from nemo_lw_fp8.cpu.formats import nvfp4 as fp4
    from nemo_lw_fp8.cpu.te import device as te_device

    def quantizer(rht: bool = True, two_d: bool = False, optimize: bool = True) -> Any:
        q = NVFP4Quantizer(with_rht=rht, with_post_rht_amax=rht, with_2d_quantization=two_d)
        q.optimize_for_gemm, q.internal = optimize, True
        return q

    def compact(t: Any, name: str) -> torch.Tensor:
        v = getattr(t, "_" + name)
        if "scale" in name and t._with_gemm_swizzled_scales:
            v = fp4.unswizzle_scales(v)
        return v.reshape(-1)

    sizes = [256, 0, 128, 256]
    gen = torch.Generator().manual_seed(31)
    x, _ = _inputs(sizes, gen)
    splits = torch.tensor(sizes, dtype=torch.int64)
    offsets = torch.tensor([0, *torch.cumsum(splits, 0).tolist()]) * K
    whole = x.float().abs().max().reshape(1)
    r: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as mp, te_device.target_gpu(te_device.BLACKWELL):
        mask = quantizer().rht_matrix_random_sign_mask_t
        for optimize in (False, True):
            grouped = tex.group_quantize(x, quantizer(optimize=optimize), 4, splits, None, offsets)
            split = tex.split_quantize(x, sizes, [quantizer(optimize=optimize) for _ in sizes])
            own, module, shared, rht, empty = [], [], [], [], []
            for member, other, part in zip(
                grouped.quantized_tensors, split, torch.split(x, sizes), strict=True
            ):
                amaxes = (member._amax_rowwise, member._amax_columnwise)
                if part.shape[0] == 0:
                    empty.append(
                        member._rowwise_data.numel() == 0 and all(float(a) == 0 for a in amaxes)
                    )
                    continue
                want = fp4.quantize(part, rht_sign_mask=mask)
                own.append(
                    all(torch.equal(compact(member, n), getattr(want, n).reshape(-1))
                        for n in BUFFERS)
                    and torch.equal(amaxes[0], want.amax_rowwise)
                    and torch.equal(amaxes[1], want.amax_columnwise)
                )  # fmt: skip
                module.append(
                    all(torch.equal(compact(member, n), compact(other, n)) for n in BUFFERS)
                    and torch.equal(amaxes[0], other._amax_rowwise)
                    and torch.equal(amaxes[1], other._amax_columnwise)
                )
                # controls: the rows cast with the whole input's amax; the columns without RHT
                sh = fp4.quantize(part, rowwise=True, columnwise=False, amax=whole)
                shared.append(
                    torch.equal(compact(member, "rowwise_data"), sh.rowwise_data.view(-1))
                )
                plain = fp4.quantize(part, rowwise=False, columnwise=True)
                rht.append(
                    torch.equal(compact(member, "columnwise_data"), plain.columnwise_data.view(-1))
                )
            r[f"swizzled_{optimize}"] = bool(grouped._with_gemm_swizzled_scales)
            r[f"members_{optimize}"] = {
                "own": own, "module": module, "empty": empty,
                "control_shared_amax": shared, "control_no_rht": rht,
            }  # fmt: skip
        gq = tex.group_quantize
        r["weight_2d"] = _refused(lambda: gq(x, quantizer(False, True), 4, splits))
        r["weight_no_rht"] = _refused(lambda: gq(x, quantizer(False), 4, splits))
        r["rows_192"] = _refused(lambda: gq(x[:192], quantizer(), 2, torch.tensor([128, 64])))
        r["member_64"] = _refused(lambda: gq(x[:256], quantizer(), 2, torch.tensor([192, 64])))
        sr = quantizer()
        sr.stochastic_rounding = True
        r["stochastic"] = _refused(lambda: gq(x, sr, 4, splits))
        r["bgrad"] = _refused(lambda: tex.bgrad_group_quantize(x, quantizer(), 4, splits))
        # bf16 single grouped weights: the op casts them with group_quantize at every forward
        mp.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1")
        for label, two_d in (("bf16_single_weight_2d", True), ("bf16_single_weight_1d", False)):
            recipe = NVFP4BlockScaling(
                disable_stochastic_rounding=True, disable_2d_quantization=not two_d
            )
            op = te.ops.GroupedLinear(
                4, K, N, bias=False, device="cpu", dtype=torch.bfloat16, single_grouped_weight=True
            )

            def forward(op: Any = op, recipe: Any = recipe) -> None:
                with te.autocast(enabled=True, recipe=recipe):
                    op(x, splits)

            r[label] = _refused(forward)
    return r


@pytest.fixture(scope="module")
def kernels() -> dict[str, Any]:
    return run_on_ranks(group_quantize_kernels, world_size=1, boot=BOOT)[0]


def test_group_quantize_nvfp4_members_are_the_cast_of_each_split(kernels):
    """Every member of ``tex.group_quantize`` (RHT on) is, bitwise, the plain-torch cast of its
    rows with its own two amaxes (the rowwise ``max |x|``, the post-RHT columnwise one), and
    equals ``tex.split_quantize``'s split (TE's module path), with compact and with swizzled
    scales (the quantizer's ``optimize_for_gemm``); the member without rows has zero amaxes and
    no bytes. Controls: the rows cast with the whole input's amax differ from every member whose
    own amax is smaller, and the columns cast without the RHT from every member."""
    for optimize in (False, True):
        assert kernels[f"swizzled_{optimize}"] is optimize
        m = kernels[f"members_{optimize}"]
        assert m["own"] == [True] * 3 and m["module"] == [True] * 3, m
        assert m["empty"] == [True], m
        # the first member holds the largest values (its amax is the whole input's): equal
        assert m["control_shared_amax"] == [True, False, False], m
        assert not any(m["control_no_rht"]), m


def test_group_quantize_nvfp4_refuses_like_te(kernels):
    """TE 2.20.2's checks with TE's words: no kernel for 16x16 blocks or without the RHT (so
    bf16 single grouped weights, whose 16x16 / no-RHT quantizer ``group_quantize`` gets at every
    forward, stop at TE's error), 128-row totals, no fused dbias for NVFP4; refused by name:
    members that are not multiples of 128 rows, stochastic rounding."""
    assert kernels["weight_2d"] == "RuntimeError: 2D scaling grouped quant kernel is not ready yet"
    no_rht = "RuntimeError: graph safe grouped quant kernel for non-RHT path is not ready yet"
    assert kernels["weight_no_rht"] == no_rht
    assert kernels["bf16_single_weight_2d"] == kernels["weight_2d"]
    assert kernels["bf16_single_weight_1d"] == no_rht
    assert "First dimension of a grouped tensor should be divisible by 128" in kernels["rows_192"]
    assert (
        kernels["member_64"].startswith("NotImplementedError")
        and "[192, 64]" in (kernels["member_64"])
    )
    assert (
        "stochastic rounding" in kernels["stochastic"] and "not emulated" in kernels["stochastic"]
    )
    assert "only MXFP8 and FP8 block-scaling" in kernels["bgrad"]


def _run_and_controls(runs: dict, controls: tuple[str, ...]) -> None:
    reference = [runs["None"]]
    _te_equals_reference(reference, reference)
    for control in controls:
        assert_diverges(reference, [runs[control]], compare=_te_equals_reference)


@pytest.mark.parametrize(
    "fuse_wgrad",
    [
        pytest.param(False, marks=pytest.mark.extended, id="wgrad"),
        pytest.param(True, id="main_grad"),
    ],
)
def test_single_grouped_fp4_weights_equal_module_grouped_linear(fuse_wgrad):
    """TE's op-fuser ``GroupedLinear`` with one grouped NVFP4 weight (FP4 primary, the only
    single grouped NVFP4 weight TE 2.20.2 runs) on its grouped-tensor path (``group_quantize``,
    ``te_general_grouped_gemm_for_grouped_tensor``) = TE's module ``GroupedLinear`` with the
    same FP4 weights as ``weight0..3`` on its ``split_quantize`` path, bitwise: output, dgrad
    and every expert's wgrad (accumulated into fp32 ``main_grad`` when fused), an expert without
    tokens included; both hold the same weight bytes. Controls: weights paired with the next
    expert's tokens, and every weight member read with the first one's amax, diverge."""
    controls = ("member_order", "weight_amax")
    runs = run_on_ranks(
        single_grouped_fp4_run, (None, *controls), fuse_wgrad, world_size=1, boot=BOOT
    )[0]
    plain = runs["None"]
    assert plain["stored"] is True
    assert (plain["weight_type"], plain["member_type"]) == ("GroupedTensor", "NVFP4Tensor")
    assert plain["op_kernels"] == ["group_quantize", "te_general_grouped_gemm_for_grouped_tensor"]
    assert plain["module_kernels"] == ["split_quantize", "te_general_grouped_gemm"]
    _run_and_controls(runs, controls)


@pytest.mark.extended
def test_op_discrete_bf16_weights_nvfp4_equal_module_grouped_linear():
    """TE's op-fuser ``GroupedLinear`` with discrete bf16 weights under NVFP4 takes the
    grouped-tensor path too (``group_quantize`` for x and dy, discrete-in / discrete-out GEMMs)
    and equals TE's module ``GroupedLinear`` on its ``split_quantize`` path, bitwise: output,
    dgrad, every expert's wgrad. Controls: ``group_quantize`` mutated to one amax shared by the
    members (the output diverges) and to a dropped RHT (the wgrads diverge)."""
    controls = ("shared_amax", "no_rht")
    runs = run_on_ranks(discrete_bf16_run, (None, *controls), world_size=1, boot=BOOT)[0]
    assert runs["None"]["op_kernels"] == [
        "group_quantize", "te_general_grouped_gemm_for_discrete_in",
        "te_general_grouped_gemm_for_discrete_out",
    ]  # fmt: skip
    assert runs["None"]["module_kernels"] == ["split_quantize", "te_general_grouped_gemm"]
    _run_and_controls(runs, controls)
    assert torch.equal(runs["no_rht"]["te"]["out"], runs["None"]["ref"]["out"])  # fprop: rowwise
    assert not torch.equal(runs["shared_amax"]["te"]["out"], runs["None"]["ref"]["out"])


# ---- megatron's TEGroupedMLP through TE's op fuser (compute only) -------------------------------


def _megatron_experts_once(single: bool, fp4_param: bool, mutation: str | None) -> dict:
    """``tests/mechanics/test_nvfp4_layer_wise.py``'s 2-layer TE-spec MoE GPT (4 experts, top-2) with
    megatron's ``TEGroupedMLP`` through TE's op fuser (``ops.GroupedLinear`` + ``ScaledSwiGLU``;
    megatron pads each expert's tokens to 256), NVFP4 compute (megatron's recipe, SR off, RHT
    on): one forward and backward from the same seed. ``single``: one grouped weight per expert
    linear (``moe_single_grouped_weight``); ``fp4_param``: FP4 primary weights. Returns the loss
    and every parameter's gradient under the discrete names, the grouped kernels TE called, or
    TE's error."""
    import dataclasses
    import functools
    import traceback

    import tests.mechanics.test_nvfp4_layer_wise as base
    from nemo_lw_fp8.cpu.te import device as te_device
    from tests.cpu.test_nvfp4_grouped import _build_gpt_grouped_experts
    from tests.support import scenarios

    seen: list[str] = []
    with pytest.MonkeyPatch.context() as mp, te_device.target_gpu(te_device.BLACKWELL):
        from megatron.core import fp4_utils

        recipe = fp4_utils.get_fp4_recipe
        mp.setattr(
            fp4_utils,
            "get_fp4_recipe",
            lambda config: dataclasses.replace(recipe(config), disable_stochastic_rounding=True),
        )
        mp.setenv("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1")  # megatron's op-fuser GLU switch
        mp.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1" if single else "0")
        moe = dict(
            base.MOE, moe_grouped_gemm=True, use_transformer_engine_op_fuser=True,
            moe_single_grouped_weight=single, fp4_param=fp4_param,
        )  # fmt: skip
        mp.setattr(base, "MOE", moe)
        mp.setattr(
            scenarios, "build_gpt", functools.partial(_build_gpt_grouped_experts, grouped=True)
        )
        module, config = base.build_nvfp4_gpt(True, 5, True)
        kinds = sorted({type(p).__name__ for n, p in module.named_parameters() if "experts" in n})
        _mutate(mp, mutation)
        _record(mp, seen)
        gen = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, scenarios.GPT_VOCAB, (2, 64), generator=gen)
        positions = torch.arange(64).unsqueeze(0).expand(2, -1)
        try:
            with fp4_utils.get_fp4_context(config):
                loss = module(tokens, positions, None).float().square().mean()
            loss.backward()
        except RuntimeError:
            return {"error": traceback.format_exc(limit=1).strip().splitlines()[-1]}
    grads = {}
    for name, param in module.named_parameters():
        grad = param.grad
        if type(param).__name__ == "GroupedTensor":
            rows, cols = (int(d) for d in param.logical_shape)
            experts = int(param.num_tensors)
            for i, part in enumerate(grad.reshape(experts, rows // experts, cols)):
                grads[f"{name}{i}"] = part.clone()
        else:
            grads[name] = grad.clone()
    return {
        "losses": [float(loss)], "grads": grads, "weight_types": kinds,
        "kernels": sorted(set(seen)),
    }  # fmt: skip


def megatron_experts_runs() -> dict[str, dict]:
    """:func:`_megatron_experts_once` in each variant (one rank)."""
    variants = {
        "bf16_single": (True, False, None),
        "bf16_discrete": (False, False, None),
        "fp4_discrete": (False, True, None),
        "fp4_single": (True, True, None),
        "fp4_single_member_order": (True, True, "member_order"),
    }
    return {label: _megatron_experts_once(*args) for label, args in variants.items()}


def _same_step(reference: list[dict], results: list[dict]) -> None:
    """Bitwise: the loss and every parameter's gradient (discrete names)."""
    a, b = reference[0], results[0]
    assert a["losses"] == b["losses"], (a["losses"], b["losses"])
    assert a["grads"].keys() == b["grads"].keys()
    differ = [k for k in a["grads"] if not torch.equal(a["grads"][k], b["grads"][k])]
    assert not differ, f"gradients differ: {differ}"


@pytest.mark.extended
def test_megatron_op_fuser_experts_single_grouped_nvfp4():
    """megatron's ``TEGroupedMLP`` through TE's op fuser under NVFP4 (RHT on, SR off), compute
    only: bf16 single grouped weights stop at TE 2.20.2's own error (``group_quantize`` has no
    kernel for the weight quantizer); FP4 primary single grouped weights (``GroupedTensor``s)
    run the grouped-tensor path and equal FP4 primary discrete weights, bitwise in the loss and
    every parameter's gradient, and both equal the step on bf16 discrete weights (each weight
    cast once from the same values: the same bytes). Control: the grouped weights paired with
    the next expert's tokens diverge."""
    runs = run_on_ranks(megatron_experts_runs, world_size=1, boot=BOOT)[0]
    assert runs["bf16_single"] == {
        "error": "RuntimeError: 2D scaling grouped quant kernel is not ready yet"
    }
    single, discrete = runs["fp4_single"], runs["fp4_discrete"]
    assert single["weight_types"] == ["GroupedTensor"], single["weight_types"]
    assert discrete["weight_types"] == ["NVFP4Tensor"], discrete["weight_types"]
    assert runs["bf16_discrete"]["weight_types"] == ["Parameter"]
    assert "te_general_grouped_gemm_for_grouped_tensor" in single["kernels"]
    assert "te_general_grouped_gemm_for_discrete_in" in discrete["kernels"]
    assert "group_quantize" in single["kernels"] and "split_quantize" not in single["kernels"]
    _same_step([discrete], [single])
    _same_step([runs["bf16_discrete"]], [discrete])
    assert_diverges([discrete], [runs["fp4_single_member_order"]], compare=_same_step)


def op_fuser_moe_run(layout: str, mutation: str | None = None) -> dict:
    """``tests/mechanics/test_nvfp4_layer_wise.py``'s MoE run (NVFP4 compute, SR off, layer-wise Muon in
    ``layout``, three steps and an eval) with megatron's ``TEGroupedMLP`` through TE's op fuser
    and discrete bf16 expert weights: the grouped-tensor path (``group_quantize``, discrete-in /
    discrete-out GEMMs). ``mutation``: :func:`_mutate`'s (a control). Also names the grouped
    kernels TE called."""
    import functools

    import tests.mechanics.test_nvfp4_layer_wise as base
    from tests.cpu.test_nvfp4_grouped import _build_gpt_grouped_experts
    from tests.support import scenarios

    seen: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1")  # megatron's op-fuser GLU switch
        moe = dict(base.MOE, moe_grouped_gemm=True, use_transformer_engine_op_fuser=True)
        mp.setattr(base, "MOE", moe)
        mp.setattr(
            scenarios, "build_gpt", functools.partial(_build_gpt_grouped_experts, grouped=True)
        )
        _mutate(mp, mutation)
        _record(mp, seen)
        result = base.nvfp4_run(layout, True, moe=True)
    return {**result, "kernels": sorted(set(seen))}


@pytest.mark.extended
def test_op_fuser_experts_nvfp4_layer_wise_compact_equals_stock():
    """megatron's ``TEGroupedMLP`` through TE's op fuser with discrete bf16 expert weights under
    NVFP4 compute (RHT on, SR off) trains under layer-wise Muon on two data-parallel ranks
    through TE's grouped-tensor path: the plugin's compact layout equals megatron's layer-wise
    layout, bitwise in losses, the eval loss, every master and Muon momentum. Control: the same
    run with ``group_quantize`` casting the members with one shared amax diverges."""
    from tests.mechanics.test_nvfp4_layer_wise import assert_same_run

    compact = run_on_ranks(op_fuser_moe_run, "compact", world_size=2, boot=BOOT)
    stock = run_on_ranks(op_fuser_moe_run, "stock", world_size=2, boot=BOOT)
    for r in compact + stock:
        assert r["kernels"] == [
            "group_quantize", "te_general_grouped_gemm_for_discrete_in",
            "te_general_grouped_gemm_for_discrete_out",
        ], r["kernels"]  # fmt: skip
        assert r["nvfp4_gemms"] == r["gemms"] > 0
        assert all(torch.isfinite(torch.tensor(r["losses"])))
    assert_same_run(stock, compact)
    shared = run_on_ranks(op_fuser_moe_run, "compact", "shared_amax", world_size=2, boot=BOOT)
    assert_diverges(compact, shared, assert_same_run)
