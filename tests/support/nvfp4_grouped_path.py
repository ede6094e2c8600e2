"""Shared by the tests of NVFP4 on TE 2.20.2's op-fuser grouped-tensor path
(``tests/mechanics/test_nvfp4_single_grouped_*.py``): the sizes, TE's NVFP4 recipe on that
path (stochastic rounding off, the RHT on), per-expert inputs, the controls' mutations of the
grouped kernels, and a recorder of the grouped kernels TE calls. Imports TE only inside the
functions: call them inside a rank.

Not a test module; tests import it as ``tests.support.nvfp4_grouped_path``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

K, N = 256, 128  # in / out features: multiples of 128, as TE's grouped NVFP4 kernels need


BUFFERS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def nvfp4_recipe() -> Any:
    from transformer_engine.common.recipe import NVFP4BlockScaling

    return NVFP4BlockScaling(disable_stochastic_rounding=True)  # RHT on: TE's default


def expert_inputs(tokens: list[int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens at a different scale per expert (a shared amax would change the smaller ones)."""
    x = torch.cat([torch.randn(s, K, generator=gen) * 2.0**-i for i, s in enumerate(tokens)])
    dy = torch.randn(sum(tokens), N, generator=gen) * 0.01
    return x.bfloat16(), dy.bfloat16()


class MutatedCast:
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


def mutate_grouped_path(mp: pytest.MonkeyPatch, mutation: str | None) -> None:
    """``shared_amax`` / ``no_rht``: :class:`MutatedCast` in ``group_quantize`` (inputs and
    gradients). ``member_order``: the grouped GEMMs pair each expert's tokens with the next
    expert's grouped weight. ``weight_amax``: every grouped weight member read with the first
    member's amaxes (one global scale for all experts' weights)."""
    from nemo_lw_fp8.cpu.te.tex import grouped_tensor_nvfp4 as grouped

    if mutation in ("shared_amax", "no_rht"):
        shim, real = MutatedCast(mutation), grouped.group_quantize_nvfp4

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


def record_grouped_kernels(mp: pytest.MonkeyPatch, seen: list[str]) -> None:
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
