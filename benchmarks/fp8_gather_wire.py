"""Bytes per parameter on the wire: bf16 staging vs blockwise FP8 gather, layer-wise Muon.

For DeepSeek-V3 and Qwen3-235B-A22B (shapes from :mod:`nemo_lw_fp8.models.shapes`), every distinct
Muon-managed matrix shape is gathered once on 2 CPU ranks over gloo, through the plugin's real
gather code, and the bytes are counted by wrapping ``torch.distributed.all_gather`` /
``all_gather_into_tensor`` (bytes of the received buffers):

* **bf16 staging**: the compact layout's gather (``compact_layout._compact_dispatch``): the
  owner's weight as bf16, what the MXFP8 layer-wise gather and FP8 gather off also ship;
* **blockwise FP8**: ``blockwise_fp8_param_gather._dispatch``: FP8 codes plus one fp32 scale per
  128x128 tile for TE linear weights (``quantized``), bf16 for other Muon matrices (the router).

Counts are multiplied by how often each shape occurs in the model (all experts, all layers) and
divided by the parameter count. Wire bytes do not depend on the values, so the owner ships
zero-filled weights and skips quantising (``main_param`` is unset); the quantising itself is
tested bit for bit in ``tests/test_blockwise_fp8_param_gather.py``. The uneven gather is used
(payload only); an even ``all_gather_into_tensor`` adds transient padding bounded by
``gather_padding_tolerance`` (see ``nemo-lw-fp8 plan``).

Run: ``.venv/bin/python benchmarks/fp8_gather_wire.py`` (needs TE's Python package, as
``make test``; about a minute per model on 2 cores). Exits 1 if a ratio exceeds the target 0.55.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET = 0.55
MODELS = ("deepseek-v3", "qwen3-235b-a22b")


def muon_matrices(model: str) -> Counter[tuple[tuple[int, ...], bool]]:
    """(shape, quantized) -> how many Muon-managed matrices of the model have it."""
    from nemo_lw_fp8.models import param_shapes

    return Counter(
        (tuple(spec.shape), spec.quantized)
        for spec in param_shapes(model)
        if spec.muon and spec.trainable and len(spec.shape) == 2
    )


class _Group:
    """The attributes of a megatron bucket group that the two gather paths read."""

    def __init__(self, param, process_group) -> None:
        import torch

        self.buckets = [type("Bucket", (), {"params_list": [param], "grad_data": torch.empty(0)})]
        self.data_parallel_group = process_group
        self.param_gather_handle = None


def _blockwise_weight(shape: tuple[int, ...]):
    """A zero-filled TE Float8BlockwiseQTensor (128x128 tiles, rowwise), built without a kernel."""
    import torch
    from transformer_engine.pytorch.constants import DType
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import (
        Float8BlockQuantizer,
        Float8BlockwiseQTensor,
    )

    quantizer = Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=False)
    return Float8BlockwiseQTensor(
        shape=shape,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        rowwise_data=torch.zeros(shape, dtype=torch.uint8),
        rowwise_scale_inv=torch.ones(quantizer.get_scale_shape(shape, False)),
        columnwise_data=None,
        columnwise_scale_inv=None,
        fp8_dtype=DType.kFloat8E4M3,
        quantizer=quantizer,
        is_2D_scaled=True,
    )


def measure(shapes: list[tuple[tuple[int, ...], bool]]) -> list[dict[str, int]]:
    """On every rank: gather one matrix of each shape from rank 0; received bytes per path."""
    import torch
    import torch.distributed as dist

    from nemo_lw_fp8 import layout
    from nemo_lw_fp8.mechanics import blockwise as bwg
    from nemo_lw_fp8.mechanics import compact
    from nemo_lw_fp8.state import group_state

    counted = {"bytes": 0}
    originals = {name: getattr(dist, name) for name in ("all_gather", "all_gather_into_tensor")}

    def wrap(name):
        def counting(*args, **kwargs):
            out = args[0] if name == "all_gather" else [args[0]]
            counted["bytes"] += sum(t.numel() * t.element_size() for t in out)
            return originals[name](*args, **kwargs)

        return counting

    group = dist.group.WORLD
    world = dist.get_world_size()
    rows = []
    for name in originals:
        setattr(dist, name, wrap(name))
    try:
        for shape, quantized in shapes:
            plain = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))
            segments = [[plain]] + [[] for _ in range(world - 1)]
            state = compact.CompactGroup(
                segments, [plain.numel()] + [0] * (world - 1), even=False
            )
            bf16_group = _Group(plain, group)
            group_state(bf16_group).compact = state
            counted["bytes"] = 0
            compact.dispatch(bf16_group, async_op=False)
            bf16 = counted["bytes"]
            del plain, bf16_group, state

            if quantized:
                weight = torch.nn.Parameter(_blockwise_weight(shape))
            else:
                weight = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))
            sizes = [bwg.param_wire_bytes(weight)] + [0] * (world - 1)
            fp8_state = bwg.BlockwiseGroup(
                [[weight]] + [[] for _ in range(world - 1)],
                sizes,
                layout.even_gather_fits(sizes, 0.0),
                group,
            )
            fp8_group = _Group(weight, group)
            group_state(fp8_group).blockwise = fp8_state
            counted["bytes"] = 0
            bwg._dispatch(fp8_group, async_op=False)
            rows.append({"bf16": bf16, "fp8": counted["bytes"], "numel": weight.numel()})
            del weight, fp8_group, fp8_state
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return rows


def _fmt_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def run(models: tuple[str, ...]) -> tuple[str, bool]:
    from tests.support.harness import BootOptions, run_on_ranks, shutdown_pools

    lines = [
        "layer-wise Muon param gather, bytes on the wire per step (whole model, every Muon "
        "matrix once), counted through torch.distributed on 2 gloo ranks",
        "",
        f"{'model':<17} {'Muon params':>15} {'bf16 staging':>13} {'blockwise FP8':>14} "
        f"{'B/param bf16':>12} {'B/param FP8':>11} {'FP8/bf16':>9}",
    ]
    ok = True
    try:
        for model in models:
            counts = muon_matrices(model)
            shapes = sorted(counts)
            rows = run_on_ranks(
                measure, shapes, world_size=2, boot=BootOptions(fp8_emulation=True), timeout=1800
            )[1]
            numel = sum(r["numel"] * counts[s] for s, r in zip(shapes, rows, strict=True))
            bf16 = sum(r["bf16"] * counts[s] for s, r in zip(shapes, rows, strict=True))
            fp8 = sum(r["fp8"] * counts[s] for s, r in zip(shapes, rows, strict=True))
            ratio = fp8 / bf16
            ok &= ratio <= TARGET
            lines.append(
                f"{model:<17} {numel:>15,} {_fmt_bytes(bf16):>13} {_fmt_bytes(fp8):>14} "
                f"{bf16 / numel:>12.4f} {fp8 / numel:>11.4f} {ratio:>9.4f}"
            )
    finally:
        shutdown_pools()
    lines.append("")
    lines.append(f"target: FP8/bf16 <= {TARGET}: {'met' if ok else 'NOT met'}")
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, action="append", help="default: both")
    args = parser.parse_args(argv)
    table, ok = run(tuple(args.model or MODELS))
    print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
