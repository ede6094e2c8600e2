"""Bytes per parameter on the wire: bf16 vs the layer-wise NVFP4 param gather (FP4 primary weights).

For DeepSeek-V3 and Qwen3-235B-A22B (shapes from :mod:`nemo_lw_fp8.models.shapes`), every distinct
Muon-managed matrix shape is gathered once on 2 CPU ranks over gloo, through the plugin's real
gather code, and the bytes are counted by wrapping ``torch.distributed.all_gather`` /
``all_gather_into_tensor`` (bytes of the received buffers):

* **bf16**: the compact layout's gather (``compact.dispatch``): the owner's weight as bf16, what
  FP4 param gather off (NVFP4 compute on bf16 parameters) ships;
* **NVFP4**: the owner-packed gather (``blockwise._dispatch`` with ``nvfp4_gather``'s packing):
  for each TE linear weight (``quantized``, both dims multiples of 16) the FP4 codes, one E4M3
  byte per 16x16 tile and the fp32 amax, read from a TE ``NVFP4Tensor``'s own buffers; bf16 for
  the other Muon matrices (the router).

Counts are multiplied by how often each shape occurs in the model (all experts, all layers) and
divided by the parameter count. Wire bytes do not depend on the values, so the owner ships an
empty weight and skips quantising (no master); the quantising and the receivers' rebuild are
tested bit for bit in ``tests/test_nvfp4_param_gather.py``. The uneven gather is used (payload
only).

Run: ``.venv/bin/python benchmarks/nvfp4_wire.py`` (needs TE's Python package, as ``make test``;
about a minute per model on 2 cores). Exits 1 if a ratio exceeds the target 0.29.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET = 0.29
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


def _nvfp4_weight(shape: tuple[int, ...]):
    """An empty TE NVFP4Tensor with 16x16 blocks, rowwise only (what the owner reads to pack)."""
    import torch
    from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer

    quantizer = NVFP4Quantizer(with_2d_quantization=True, rowwise=True, columnwise=False)
    return quantizer.make_empty(shape, dtype=torch.bfloat16, device=torch.device("cpu"))


def _fp4_shape(shape: tuple[int, ...]) -> bool:
    return all(dim % 16 == 0 for dim in shape)


def measure(shapes: list[tuple[tuple[int, ...], bool]]) -> list[dict[str, int]]:
    """On every rank: gather one matrix of each shape from rank 0; received bytes per path."""
    import torch
    import torch.distributed as dist

    from nemo_lw_fp8.cpu import te_device
    from nemo_lw_fp8.mechanics import blockwise, compact
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
        with te_device.target_gpu(te_device.BLACKWELL), torch.no_grad():
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

                if quantized and _fp4_shape(shape):
                    weight = torch.nn.Parameter(_nvfp4_weight(shape), requires_grad=False)
                else:
                    weight = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))
                sizes = [blockwise.param_wire_bytes(weight)] + [0] * (world - 1)
                fp4_state = blockwise.BlockwiseGroup(
                    [[weight]] + [[] for _ in range(world - 1)], sizes, False, group
                )
                fp4_group = _Group(weight, group)
                group_state(fp4_group).blockwise = fp4_state
                counted["bytes"] = 0
                blockwise._dispatch(fp4_group, async_op=False)
                rows.append({"bf16": bf16, "fp4": counted["bytes"], "numel": weight.numel()})
                del weight, fp4_group, fp4_state
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return rows


def _planned_bytes(key: tuple[tuple[int, ...], bool]) -> int:
    """What ``nemo-lw-fp8 plan`` counts for one matrix on the NVFP4 wire: a TE linear weight
    as codes + tile scales + amax, any other Muon matrix (the router) as bf16."""
    from nemo_lw_fp8.models.weight_bytes import PARAM_BYTES, nvfp4_wire_bytes

    shape, quantized = key
    numel = 1
    for dim in shape:
        numel *= dim
    return nvfp4_wire_bytes(shape) if quantized else numel * PARAM_BYTES


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
        f"{'model':<17} {'Muon params':>15} {'bf16':>11} {'NVFP4':>11} "
        f"{'B/param bf16':>12} {'B/param FP4':>11} {'FP4/bf16':>9}",
    ]
    ok = True
    planner_rows: list[str] = []
    try:
        for model in models:
            counts = muon_matrices(model)
            shapes = sorted(counts)
            rows = run_on_ranks(
                measure, shapes, world_size=2, boot=BootOptions(fp8_emulation=True), timeout=1800
            )[1]
            numel = sum(r["numel"] * counts[s] for s, r in zip(shapes, rows, strict=True))
            bf16 = sum(r["bf16"] * counts[s] for s, r in zip(shapes, rows, strict=True))
            fp4 = sum(r["fp4"] * counts[s] for s, r in zip(shapes, rows, strict=True))
            ratio = fp4 / bf16
            ok &= ratio <= TARGET
            lines.append(
                f"{model:<17} {numel:>15,} {_fmt_bytes(bf16):>11} {_fmt_bytes(fp4):>11} "
                f"{bf16 / numel:>12.4f} {fp4 / numel:>11.4f} {ratio:>9.4f}"
            )
            planned = sum(_planned_bytes(s) * counts[s] for s in shapes)
            agrees = planned == fp4
            ok &= agrees
            planner_rows.append(
                f"{model}: the planner's NVFP4 payload (weight_bytes.nvfp4_wire_bytes) "
                f"{'equals' if agrees else 'DIFFERS from'} the bytes counted ({planned:,})"
            )
    finally:
        shutdown_pools()
    lines.append("")
    lines += planner_rows
    lines.append(f"target: FP4/bf16 <= {TARGET}: {'met' if ok else 'NOT met'}")
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
