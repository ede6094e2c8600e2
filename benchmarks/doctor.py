"""Wall time of ``nemo-lw-fp8 doctor`` over a few runs, as a table (a benchmark, not a test).

Each run is a fresh process, as a user starts it. Rows: the command as shipped (its detectors
read megatron-core's source, :mod:`nemo_lw_fp8.patches.symbols`), and the same report after
importing what the detectors used to import (``megatron.core`` and ``megatron.training.training``),
which is what ``doctor`` cost before. CPU seconds (user + system of the child) are printed beside
the wall time because a shared machine's load moves the wall time, not the work::

    python benchmarks/doctor.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

CASES = {
    "nemo-lw-fp8 doctor": [sys.executable, "-m", "nemo_lw_fp8.cli", "doctor"],
    "same report, megatron imported": [
        sys.executable,
        "-c",
        "from nemo_lw_fp8.cli import doctor; "
        "import megatron.core.optimizer, megatron.training.training; doctor.collect()",
    ],
}


def _child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(command: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run; fails loudly when the command fails."""
    cpu = _child_cpu()
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return wall, _child_cpu() - cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    print(
        f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
        f"{os.cpu_count()} CPUs, {args.runs} runs each"
    )
    print(f"| {'command':<32} | wall s (each) {'':<12} | wall s median | CPU s median |")
    print(f"|{'-' * 34}|{'-' * 28}|{'-' * 15}|{'-' * 14}|")
    for name, command in CASES.items():
        runs = [measure(command) for _ in range(args.runs)]
        walls = " ".join(f"{w:.1f}" for w, _ in runs)
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(f"| {name:<32} | {walls:<26} | {wall:>13.1f} | {cpu:>12.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
