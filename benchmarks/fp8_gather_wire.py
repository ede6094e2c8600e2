"""Bytes per parameter on the wire: bf16 staging vs blockwise FP8 gather, layer-wise Muon.

For DeepSeek-V3 and Qwen3-235B-A22B (shapes from :mod:`nemo_lw_fp8.planner.shapes`), every distinct
Muon-managed matrix shape is gathered once on 2 CPU ranks over gloo, through the plugin's real
gather code, and the bytes are counted by wrapping ``torch.distributed.all_gather`` /
``all_gather_into_tensor`` (bytes of the received buffers):

* **bf16 staging**: the compact layout's gather (``compact_layout._compact_dispatch``): the
  owner's weight as bf16, what the MXFP8 layer-wise gather and FP8 gather off also ship;
* **blockwise FP8**: ``blockwise_fp8_param_gather._dispatch``: FP8 codes plus one fp32 scale per
  128x128 tile for TE linear weights (``quantized``), bf16 for other Muon matrices (the router).

Counts are multiplied by how often each shape occurs in the model (all experts, all layers) and
divided by the parameter count (the measuring is ``wire_bytes.py``'s, shared with
``nvfp4_wire.py``). Wire bytes do not depend on the values, so the owner ships zero-filled
weights and skips quantising (``main_param`` is unset); the quantising itself is tested bit for
bit in ``tests/mechanics/test_blockwise_fp8_param_gather.py``. The uneven gather is used
(payload only); an even ``all_gather_into_tensor`` adds transient padding bounded by
``gather_padding_tolerance`` (see ``nemo-lw-fp8 plan``).

Run: ``.venv/bin/python benchmarks/fp8_gather_wire.py`` (needs TE's Python package, as
``make test``; about a minute per model on 2 cores). Exits 1 if a ratio exceeds the target 0.55.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.wire_bytes import cli, fmt_bytes, model_totals  # noqa: E402

TARGET = 0.55
MODELS = ("deepseek-v3", "qwen3-235b-a22b")


def run(models: tuple[str, ...]) -> tuple[str, bool]:
    from tests.support.harness import shutdown_pools

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
            t = model_totals(model, "blockwise")
            numel, bf16, fp8 = t["numel"], t["bf16"], t["quantized"]
            ratio = fp8 / bf16
            ok &= ratio <= TARGET
            lines.append(
                f"{model:<17} {numel:>15,} {fmt_bytes(bf16):>13} {fmt_bytes(fp8):>14} "
                f"{bf16 / numel:>12.4f} {fp8 / numel:>11.4f} {ratio:>9.4f}"
            )
    finally:
        shutdown_pools()
    lines.append("")
    lines.append(f"target: FP8/bf16 <= {TARGET}: {'met' if ok else 'NOT met'}")
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    return cli(run, MODELS, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
