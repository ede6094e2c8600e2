"""NVFP4 on TE 2.20.2's op-fuser grouped-tensor path on CPU (issue 30): ``tex.group_quantize``
with NVFP4 quantizers (``nemo_lw_fp8/cpu/te/tex/grouped_tensor_nvfp4.py``), on the B200
target, stochastic rounding off and the RHT on (TE's predicate sends NVFP4 to this path only
then): each member the plain-torch cast of its split and ``split_quantize``'s bytes, and what
TE refuses there, with TE's words (docs/nvfp4.md, "Single grouped weights (the grouped-tensor
path)"): no kernel for the weight quantizer (16x16 blocks, or no RHT), so bf16 single grouped
weights, cast with ``group_quantize`` at every forward, do not run.

Every TE call runs in a spawned rank (this process never imports TE or megatron). Each parity
has a control kept in the suite (``tests.support.parity.assert_diverges``); the shared inputs
and mutations: ``tests.support.nvfp4_grouped_path``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.harness import run_on_ranks
from tests.support.nvfp4_grouped_path import BUFFERS, K, N, expert_inputs
from tests.support.te_module_parity import BOOT


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
    x, _ = expert_inputs(sizes, gen)
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
