"""Bytes of one weight as the planner counts them: a persistent MXFP8 weight, a blockwise FP8
weight on the wire, and one step's Muon gather payload.

Kept apart from :mod:`.planner` (which re-exports them) so the layout comparison reads without
the byte formats of Transformer Engine's FP8 tensors around it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .shapes import ParamSpec

PARAM_BYTES = 2  # bf16 model parameters and bf16 on the wire (also for MXFP8 param gather)


def mxfp8_weight_bytes(shape: Sequence[int]) -> int:
    """Bytes of a persistent MXFP8 weight: rowwise and columnwise e4m3 codes plus their padded
    E8M0 scales (rowwise ``roundup(M, 128) x roundup(K / 32, 4)``, columnwise
    ``roundup(M / 32, 4) x roundup(K, 128)``), leading dimensions flattened into ``M``."""

    def up(x: int, m: int) -> int:
        return -(-x // m) * m

    k = int(shape[-1])
    m = math.prod(int(d) for d in shape[:-1])
    rowwise_scales = up(m, 128) * up(-(-k // 32), 4)
    columnwise_scales = up(-(-m // 32), 4) * up(k, 128)
    return 2 * m * k + rowwise_scales + columnwise_scales


def blockwise_wire_bytes(shape: Sequence[int]) -> int:
    """Bytes the layer-wise blockwise FP8 gather ships for one TE linear weight: e4m3 codes plus
    one fp32 scale per 128x128 tile (the patch sends the scales' valid region, no padding)."""
    rows = math.prod(shape[:-1])
    cols = shape[-1]
    return rows * cols + 4 * (-(-rows // 128)) * (-(-cols // 128))


def muon_gather_wire(specs: Sequence[ParamSpec]) -> dict[str, Any]:
    """Payload of one param gather of every Muon matrix in ``specs`` (what each rank receives per
    step, its own segment included), bf16 vs blockwise FP8 (``--fp8-recipe blockwise``:
    TE linear weights as codes + tile scales, other Muon matrices such as the router as bf16).
    Even-gather padding is not included (bounded by ``gather_padding_tolerance``)."""
    muon = [s for s in specs if s.muon and s.trainable]
    numel = sum(s.numel for s in muon)
    bf16 = numel * PARAM_BYTES
    fp8 = sum(blockwise_wire_bytes(s.shape) if s.quantized else s.numel * PARAM_BYTES for s in muon)
    return {
        "muon_params": numel,
        "bf16_bytes": bf16,
        "blockwise_fp8_bytes": fp8,
        "bytes_per_param": {
            "bf16": bf16 / numel if numel else 0.0,
            "blockwise_fp8": fp8 / numel if numel else 0.0,
        },
        "blockwise_over_bf16": fp8 / bf16 if bf16 else 1.0,
    }
