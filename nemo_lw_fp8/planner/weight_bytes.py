"""Bytes of one weight as the planner counts them: a persistent MXFP8 or NVFP4 weight, a
blockwise FP8 or NVFP4 weight on the wire, and one step's Muon gather payload.

Kept apart from :mod:`.planner` (which re-exports them) so the layout comparison reads without
the byte formats of Transformer Engine's FP8 tensors around it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from nemo_lw_fp8.planner.shapes import ParamSpec

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


def nvfp4_wire_bytes(shape: Sequence[int]) -> int:
    """Bytes the layer-wise NVFP4 gather ships for one TE linear weight with 16x16 blocks
    (``fp4_param``): E2M1 codes (two per byte), one E4M3 scale per 16x16 tile and the owner's
    fp32 tensor amax; receivers rebuild the rest (docs/nvfp4.md). TE needs both flattened dims
    to be multiples of 16; a partial tile would still carry one scale, hence the ceilings."""
    rows = math.prod(shape[:-1])
    cols = shape[-1]
    return -(-rows * cols // 2) + (-(-rows // 16)) * (-(-cols // 16)) + 4


def nvfp4_weight_bytes(shape: Sequence[int]) -> int:
    """Bytes of a persistent NVFP4 weight (TE's ``NVFP4Tensor`` with both usages): rowwise
    codes ``(M, K / 2)`` and columnwise codes ``(K, M / 2)``, each usage's E4M3 scales in TE's
    padded buffer ``roundup(rows, 128) x roundup(cols / 16, 4)`` of that usage's data (rows M,
    cols K rowwise; rows K, cols M columnwise), and one fp32 amax per usage."""

    def up(x: int, m: int) -> int:
        return -(-x // m) * m

    k = int(shape[-1])
    m = math.prod(int(d) for d in shape[:-1])
    codes = 2 * (-(-m * k // 2))
    rowwise_scales = up(m, 128) * up(-(-k // 16), 4)
    columnwise_scales = up(k, 128) * up(-(-m // 16), 4)
    return codes + rowwise_scales + columnwise_scales + 2 * 4


def muon_gather_wire(specs: Sequence[ParamSpec]) -> dict[str, Any]:
    """Payload of one param gather of every Muon matrix in ``specs`` (what each rank receives per
    step, its own segment included), bf16 vs blockwise FP8 (``--fp8-recipe blockwise``:
    TE linear weights as codes + tile scales) vs NVFP4 primary weights (``fp4_param``: codes +
    16x16 tile scales + amax); other Muon matrices such as the router travel as bf16 in all.
    Even-gather padding is not included (bounded by ``gather_padding_tolerance``)."""
    muon = [s for s in specs if s.muon and s.trainable]
    numel = sum(s.numel for s in muon)
    bf16 = numel * PARAM_BYTES

    def payload(quantized_bytes) -> int:
        return sum(quantized_bytes(s.shape) if s.quantized else s.numel * PARAM_BYTES for s in muon)

    fp8, fp4 = payload(blockwise_wire_bytes), payload(nvfp4_wire_bytes)
    return {
        "muon_params": numel,
        "bf16_bytes": bf16,
        "blockwise_fp8_bytes": fp8,
        "nvfp4_bytes": fp4,
        "bytes_per_param": {
            "bf16": bf16 / numel if numel else 0.0,
            "blockwise_fp8": fp8 / numel if numel else 0.0,
            "nvfp4": fp4 / numel if numel else 0.0,
        },
        "blockwise_over_bf16": fp8 / bf16 if bf16 else 1.0,
        "nvfp4_over_bf16": fp4 / bf16 if bf16 else 1.0,
    }
