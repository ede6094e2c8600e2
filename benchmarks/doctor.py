"""Wall and CPU time of ``nemo-lw-fp8 doctor`` over a few runs, as a table (not a test).

Each run is a fresh process, as a user starts it. Rows: the command as shipped, which imports
megatron-core and Megatron-Bridge's config module (over the CPU emulation of TE where TE has no
GPU) to fingerprint what ``apply()`` would wrap, and, as the baseline in the same run, that
import alone (what any Bridge run pays before training). The ratio column is doctor's CPU
over the baseline's. CPU seconds (user + system of the child) are printed beside the wall time
because a shared machine's load moves the wall time, not the work::

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

BASELINE = "import megatron + Bridge config"
CASES = {
    "nemo-lw-fp8 doctor": [sys.executable, "-m", "nemo_lw_fp8.cli", "doctor"],
    BASELINE: [
        sys.executable,
        "-c",
        "from nemo_lw_fp8.cpu.te import backend; backend.activate(); "
        "import megatron.core.optimizer, megatron.bridge.training.config",
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
    header = f"| {'command':<32} | wall s (each) {'':<12} | wall s median | CPU s median |"
    print(header + " CPU ratio |")
    print(f"|{'-' * 34}|{'-' * 28}|{'-' * 15}|{'-' * 14}|{'-' * 11}|")
    cpu_of = {}
    rows = []
    for name, command in CASES.items():
        runs = [measure(command) for _ in range(args.runs)]
        walls = " ".join(f"{w:.1f}" for w, _ in runs)
        wall = statistics.median(w for w, _ in runs)
        cpu_of[name] = statistics.median(c for _, c in runs)
        rows.append((name, walls, wall))
    for name, walls, wall in rows:
        ratio = cpu_of[name] / cpu_of[BASELINE]
        cpu = cpu_of[name]
        print(f"| {name:<32} | {walls:<26} | {wall:>13.1f} | {cpu:>12.1f} | {ratio:>9.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
