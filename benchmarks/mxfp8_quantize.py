"""CPU cost of the MXFP8 emulation, against a plain FP8 cast of the same tensor.

The floor is ``x.to(torch.float8_e4m3fn)`` (one cast, no scales): an exact MXFP8 quantiser has
to do at least that per direction, plus the block amaxes and the per-block scaling. The
"(info)" row is the same cast into an existing buffer (no fresh pages), for reference. Timings
are interleaved (floor, then each variant, round after round) so machine noise hits all rows
alike; the table reports the median and the best round.

    python benchmarks/mxfp8_quantize.py [--rows 4096] [--cols 4096] [--rounds 15] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nemo_lw_fp8.cpu.formats import mxfp8 as mx  # noqa: E402


def _time_once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    x = torch.randn(args.rows, args.cols, dtype=torch.bfloat16)
    target = mx.quantize(x)  # existing buffers, as a persistent MXFP8 weight re-quantised in place
    fp8_out = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    variants: dict[str, Callable[[], object]] = {
        "floor: x.to(float8_e4m3fn)": lambda: x.to(torch.float8_e4m3fn),
        "(info) cast into existing fp8": lambda: fp8_out.copy_(x),
        "MXFP8 rowwise + columnwise": lambda: mx.quantize(x),
        "MXFP8 rowwise only": lambda: mx.quantize(x, columnwise=False),
        "MXFP8 columnwise only": lambda: mx.quantize(x, rowwise=False),
        "MXFP8 2-D 32x32, both": lambda: mx.quantize(x, two_d=True),
        "MXFP8 both, swizzled scales": lambda: mx.quantize(x, swizzle=True),
        "MXFP8 both, in place (out=)": lambda: mx.quantize(x, out=target),
    }
    for fn in variants.values():  # warm-up: lookup tables, allocator
        fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            samples[name].append(_time_once(fn))

    floor_med = statistics.median(samples["floor: x.to(float8_e4m3fn)"])
    floor_min = min(samples["floor: x.to(float8_e4m3fn)"])
    print(
        f"MXFP8 e4m3 quantisation of a {args.rows}x{args.cols} bf16 tensor on CPU "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds)"
    )
    header = (
        f"{'variant':32s} {'median ms':>10s} {'best ms':>9s} "
        f"{'x floor (med)':>14s} {'x floor (best)':>15s}"
    )
    print(header)
    print("-" * len(header))
    for name, values in samples.items():
        med, best = statistics.median(values), min(values)
        print(
            f"{name:32s} {med * 1e3:10.2f} {best * 1e3:9.2f} "
            f"{med / floor_med:14.2f} {best / floor_min:15.2f}"
        )


if __name__ == "__main__":
    main()
