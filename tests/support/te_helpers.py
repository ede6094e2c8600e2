"""Shared by the tests of TE's own modules: the recipes they run under, inputs that tell FP8
copies apart, and the stale-columnwise mutation their controls use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def te_recipe(name: str) -> tuple[Any, Any]:
    """(TE recipe, target GPU) of ``"bf16"``, ``"mxfp8"`` or ``"blockwise"``: the GPU whose
    branch TE takes for it (SM 10.0; SM 9.0 for blockwise, which TE converts on SM 10.0).
    Imports TE: call it inside a rank."""
    from transformer_engine.common.recipe import Float8BlockScaling, MXFP8BlockScaling

    from nemo_lw_fp8.cpu.te import device as te_device

    return {
        "bf16": (None, te_device.BLACKWELL),
        "mxfp8": (MXFP8BlockScaling(), te_device.BLACKWELL),
        "blockwise": (Float8BlockScaling(), te_device.HOPPER),
    }[name]


def spread(
    rows: int, cols: int, gen: torch.Generator, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Gaussian values times powers of two from 1 down to 2^-13 per row and per column.

    Rowwise and columnwise FP8 copies of well-scaled data hold the same values (power-of-two
    scales only move the exponent); with magnitudes spread this wide, the small elements of a
    block fall into e4m3's subnormals in one direction and not in the other, so a GEMM that reads
    the wrong copy, or a stale one, gives other bits."""
    row = 2.0 ** -torch.randint(0, 14, (rows, 1), generator=gen).float()
    col = 2.0 ** -torch.randint(0, 14, (1, cols), generator=gen).float()
    return (torch.randn(rows, cols, generator=gen) * row * col).to(dtype)


def rowwise_only_refresh(refresh: Callable[..., Any]) -> Callable[..., Any]:
    """The stale-columnwise mutation of ``MXFP8Quantizer.update_quantized`` (``refresh``): every
    re-quantization into a persistent MXFP8 weight (the gathers' copy into the weights, TE's
    and the grouped members alike) refreshes the rowwise copy only; the columnwise copy the
    dgrad GEMM reads keeps its old bytes."""

    def rowwise_only(self: Any, src: Any, dst: Any, *, noop_flag: Any = None) -> Any:
        names = ("_columnwise_data", "_columnwise_scale_inv")
        kept = {name: getattr(dst, name) for name in names}
        kept = {name: value.clone() for name, value in kept.items() if value is not None}
        out = refresh(self, src, dst, noop_flag=noop_flag)
        for name, old in kept.items():
            getattr(dst, name).copy_(old)
        return out

    return rowwise_only


def stale_columnwise(mp: Any, recipe: str) -> None:
    """The stale-columnwise control of an FP8 param gather, on ``mp`` (a
    ``pytest.MonkeyPatch``): every persistent weight's columnwise copy (what the dgrad GEMM
    reads) left stale after the gather. MXFP8: the gathers' re-quantization refreshes the
    rowwise copy only (:func:`rowwise_only_refresh`; TE's weights and grouped members alike);
    blockwise: the derivation of the columnwise copy from the gathered rowwise codes is skipped
    (receivers keep the previous step's columnwise bytes). Imports TE: call it inside a rank."""
    if recipe == "mxfp8":
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

        refresh = rowwise_only_refresh(MXFP8Quantizer.update_quantized)
        mp.setattr(MXFP8Quantizer, "update_quantized", refresh)
    elif recipe == "blockwise":
        from nemo_lw_fp8.mechanics import blockwise

        mp.setattr(blockwise, "derive_columnwise", lambda params: None)
    else:
        raise ValueError(f"no stale-columnwise control for recipe {recipe!r}")
