"""What the gather-wire benchmarks share: the Muon matrices of a model, one gather per distinct
shape on 2 gloo ranks through the plugin's real gather code, and the bytes counted.

Each shape is gathered twice from rank 0, and the received bytes are counted by wrapping
``torch.distributed.all_gather`` / ``all_gather_into_tensor``:

* **bf16**: the compact layout's gather (``compact_gather.dispatch``), the owner's weight as bf16:
what
  the MXFP8 layer-wise gather and FP8 / FP4 param gather off ship;
* **quantized**: the owner-packed gather (``blockwise._dispatch``) of a TE weight of the
  benchmark's kind, built empty (wire bytes do not depend on the values, so the owner skips
  quantising: there is no master): ``"blockwise"`` a ``Float8BlockwiseQTensor`` of 128x128
  tiles (FP8 codes + one fp32 scale per tile), ``"nvfp4"`` an ``NVFP4Tensor`` of 16x16 blocks
  (FP4 codes + one E4M3 scale per tile + the amax); bf16 for Muon matrices that are not TE
  linears (the router) or, for NVFP4, whose dims are not multiples of 16.

Used by ``fp8_gather_wire.py`` and ``nvfp4_wire.py`` (run those).
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

KINDS = ("blockwise", "nvfp4")


def muon_matrices(model: str) -> Counter[tuple[tuple[int, ...], bool]]:
    """(shape, quantized) -> how many Muon-managed matrices of the model have it."""
    from nemo_lw_fp8.planner import param_shapes

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


def _nvfp4_weight(shape: tuple[int, ...]):
    """An empty TE NVFP4Tensor with 16x16 blocks, rowwise only (what the owner reads to pack)."""
    import torch
    from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer

    quantizer = NVFP4Quantizer(with_2d_quantization=True, rowwise=True, columnwise=False)
    return quantizer.make_empty(shape, dtype=torch.bfloat16, device=torch.device("cpu"))


def _quantized_weight(kind: str, shape: tuple[int, ...], quantized: bool):
    import torch

    if quantized and kind == "blockwise":
        return torch.nn.Parameter(_blockwise_weight(shape))
    if quantized and kind == "nvfp4" and all(dim % 16 == 0 for dim in shape):
        return torch.nn.Parameter(_nvfp4_weight(shape), requires_grad=False)
    return torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))


@contextmanager
def _counting_gathers():
    """Count the bytes every all-gather of this rank receives (``counted["bytes"]``)."""
    import torch.distributed as dist

    counted = {"bytes": 0}
    originals = {name: getattr(dist, name) for name in ("all_gather", "all_gather_into_tensor")}

    def wrap(name):
        def counting(*args, **kwargs):
            out = args[0] if name == "all_gather" else [args[0]]
            counted["bytes"] += sum(t.numel() * t.element_size() for t in out)
            return originals[name](*args, **kwargs)

        return counting

    for name in originals:
        setattr(dist, name, wrap(name))
    try:
        yield counted
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def measure(shapes: list[tuple[tuple[int, ...], bool]], kind: str) -> list[dict[str, int]]:
    """On every rank: gather one matrix of each shape from rank 0 through both paths; the
    received bytes of each (``bf16``, ``quantized``) and the matrix's elements."""
    import torch
    import torch.distributed as dist

    from nemo_lw_fp8.cpu.te import device as te_device
    from nemo_lw_fp8.layout import packing as layout
    from nemo_lw_fp8.mechanics import blockwise, compact, compact_gather
    from nemo_lw_fp8.state import group_state

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    group = dist.group.WORLD
    world = dist.get_world_size()
    gpu = te_device.BLACKWELL if kind == "nvfp4" else te_device.HOPPER
    rows = []
    with _counting_gathers() as counted, te_device.target_gpu(gpu), torch.no_grad():
        for shape, quantized in shapes:
            plain = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))
            state = compact.CompactGroup(
                [[plain]] + [[] for _ in range(world - 1)],
                [plain.numel()] + [0] * (world - 1),
                even=False,
            )
            bf16_group = _Group(plain, group)
            group_state(bf16_group).compact = state
            counted["bytes"] = 0
            compact_gather.dispatch(bf16_group, async_op=False)
            bf16 = counted["bytes"]

            weight = _quantized_weight(kind, shape, quantized)
            sizes = [blockwise.param_wire_bytes(weight)] + [0] * (world - 1)
            packed = blockwise.BlockwiseGroup(
                [[weight]] + [[] for _ in range(world - 1)],
                sizes,
                layout.even_gather_fits(sizes, 0.0),
                group,
            )
            packed_group = _Group(weight, group)
            group_state(packed_group).blockwise = packed
            counted["bytes"] = 0
            blockwise._dispatch(packed_group, async_op=False)
            rows.append({"bf16": bf16, "quantized": counted["bytes"], "numel": weight.numel()})
    return rows


def model_totals(model: str, kind: str) -> dict[str, Any]:
    """Whole-model bytes of one gather of every Muon matrix: ``numel``, ``bf16``, ``quantized``
    (each shape measured once on 2 gloo ranks, times how often it occurs), and the shape
    counts."""
    from tests.support.harness import BootOptions, run_on_ranks

    counts = muon_matrices(model)
    shapes = sorted(counts)
    rows = run_on_ranks(
        measure, shapes, kind, world_size=2, boot=BootOptions(fp8_emulation=True), timeout=1800
    )[1]
    pairs = list(zip(shapes, rows, strict=True))
    return {
        "counts": counts,
        "numel": sum(r["numel"] * counts[s] for s, r in pairs),
        "bf16": sum(r["bf16"] * counts[s] for s, r in pairs),
        "quantized": sum(r["quantized"] * counts[s] for s, r in pairs),
    }


def fmt_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def cli(
    run: Callable[[tuple[str, ...]], tuple[str, bool]],
    models: tuple[str, ...],
    description: str,
    argv: list[str] | None = None,
) -> int:
    """A benchmark's command line: ``--model`` (repeatable, default all of ``models``), the
    table ``run`` makes printed; exit status 1 when its target is not met."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", choices=models, action="append", help="default: all")
    args = parser.parse_args(argv)
    table, ok = run(tuple(args.model or models))
    print(table)
    return 0 if ok else 1
