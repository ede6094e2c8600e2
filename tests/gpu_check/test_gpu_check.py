"""``make gpu-check`` on a machine without a GPU, and its plan (issue 45): the plan lists every
``gpu``-marked test the suite collects and each recipe check; here it refuses in one line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.gpu_check import check

ROOT = Path(__file__).resolve().parents[2]


def _collected_gpu_files() -> set[str]:
    """The files of the tests pytest itself selects with ``-m gpu`` (its collection, not the
    check's reading of the files)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "tests"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}


def test_the_plan_lists_every_gpu_test_and_every_recipe_check():
    steps = check.plan(10, 2)
    listed = {s.name.removeprefix("gpu-tests ") for s in steps if s.name.startswith("gpu-tests ")}
    collected = _collected_gpu_files()
    assert collected and listed == collected
    names = [s.name for s in steps if not s.name.startswith("gpu-tests ")]
    assert names == ["train on", "train off", "on = off", "resume", "table"]
    assert "tiny_deepseek_v3" in steps[-5].what
    hopper = [s.what for s in check.plan(9, 8) if s.name == "train on"]
    assert hopper and "tiny_qwen3_30b_a3b_hopper" in hopper[0]
    assert check.plan(10, 1)[-1].what == "not run: needs 2 GPUs"
    assert check.plan(8, 2)[-1].what == "not run: no tiny recipe for SM 8.x"


def test_make_gpu_check_refuses_in_one_line_without_a_gpu():
    done = subprocess.run(["make", "--no-print-directory", "-s", "gpu-check"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)  # fmt: skip
    assert done.returncode != 0
    # make's own "make: *** [gpu-check] Error 1" aside ("make[2]: ***" under `make test`), the
    # command prints one line.
    own = re.compile(r"^make(\[\d+\])?: \*\*\*")
    lines = [line for line in done.stdout.splitlines() + done.stderr.splitlines()
             if line and not own.match(line)]  # fmt: skip
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA GPU here"), lines
