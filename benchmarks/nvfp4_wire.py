"""Bytes per parameter on the wire: bf16 vs the layer-wise NVFP4 param gather (FP4 primary weights).

For DeepSeek-V3 and Qwen3-235B-A22B (shapes from :mod:`nemo_lw_fp8.planner.shapes`), every distinct
Muon-managed matrix shape is gathered once on 2 CPU ranks over gloo, through the plugin's real
gather code, and the bytes are counted by wrapping ``torch.distributed.all_gather`` /
``all_gather_into_tensor`` (bytes of the received buffers):

* **bf16**: the compact layout's gather (``compact_gather.dispatch``): the owner's weight as bf16,
what
  FP4 param gather off (NVFP4 compute on bf16 parameters) ships;
* **NVFP4**: the owner-packed gather (``blockwise._dispatch`` with ``nvfp4_gather``'s packing):
  for each TE linear weight (``quantized``, both dims multiples of 16) the FP4 codes, one E4M3
  byte per 16x16 tile and the fp32 amax, read from a TE ``NVFP4Tensor``'s own buffers; bf16 for
  the other Muon matrices (the router).

Counts are multiplied by how often each shape occurs in the model (all experts, all layers) and
divided by the parameter count (the measuring is ``wire_bytes.py``'s, shared with
``fp8_gather_wire.py``). The planner's count (``nemo_lw_fp8.planner.weight_bytes``) must equal
the bytes counted. Wire bytes do not depend on the values, so the owner ships an
empty weight and skips quantising (no master); the quantising and the receivers' rebuild are
tested bit for bit in ``tests/mechanics/test_nvfp4_param_gather.py``. The uneven gather is used
(payload only).

Run: ``.venv/bin/python benchmarks/nvfp4_wire.py`` (needs TE's Python package, as ``make test``;
about a minute per model on 2 cores). Exits 1 if a ratio exceeds the target 0.29 or the
planner's count differs.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.wire_bytes import cli, fmt_bytes, model_totals  # noqa: E402

TARGET = 0.29
MODELS = ("deepseek-v3", "qwen3-235b-a22b")


def _planned_bytes(key: tuple[tuple[int, ...], bool]) -> int:
    """What ``nemo-lw-fp8 plan`` counts for one matrix on the NVFP4 wire: a TE linear weight
    as codes + tile scales + amax, any other Muon matrix (the router) as bf16."""
    from nemo_lw_fp8.planner.weight_bytes import PARAM_BYTES, nvfp4_wire_bytes

    shape, quantized = key
    numel = 1
    for dim in shape:
        numel *= dim
    return nvfp4_wire_bytes(shape) if quantized else numel * PARAM_BYTES


def run(models: tuple[str, ...]) -> tuple[str, bool]:
    from tests.support.harness import shutdown_pools

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
            t = model_totals(model, "nvfp4")
            numel, bf16, fp4 = t["numel"], t["bf16"], t["quantized"]
            ratio = fp4 / bf16
            ok &= ratio <= TARGET
            lines.append(
                f"{model:<17} {numel:>15,} {fmt_bytes(bf16):>11} {fmt_bytes(fp4):>11} "
                f"{bf16 / numel:>12.4f} {fp4 / numel:>11.4f} {ratio:>9.4f}"
            )
            counts = t["counts"]
            planned = sum(_planned_bytes(key) * n for key, n in counts.items())
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
    return cli(run, MODELS, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
