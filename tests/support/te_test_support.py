"""Shared by the emulation tests: TE in a subprocess, and a MAX all-reduce over threads.

Not a test module (pytest collects only ``test_*.py``); tests import it as
``tests.support.te_test_support`` (pytest puts the repository root on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from nemo_lw_fp8.cpu.te import backend as te_backend

REPO = Path(__file__).resolve().parents[2]

#: sys.path entries that make TE's Python package importable ([] if it already is), or None.
TE_PATH = te_backend.te_package_dirs()
needs_te = pytest.mark.skipif(
    TE_PATH is None,
    reason=(
        "Transformer Engine's Python package is not installed (make env puts it into "
        ".venv/te-emulation; or point NEMO_LW_FP8_TE_PATH at a folder holding it)"
    ),
)


def blackwell_script(body: str, *, env: tuple[str, ...] = ()) -> str:
    """A script for :func:`run_te_script` that runs TE's NVFP4 (a Blackwell recipe) over the
    emulation: the TE launch variables ``env`` set to 1 before TE is imported (the CPU harness
    turns off what its bytes cannot reproduce, e.g. stochastic rounding's random bits), the
    backend activated, and TE's device questions answered as a B200 for the whole script
    (``NVFP4Quantizer.__init__`` asks ``torch.cuda.current_device`` for its Hadamard tensors).
    ``body`` follows, with ``R`` (the results), ``torch`` and ``te_device`` in scope."""
    lines = ["import json, os"]
    lines += [f'os.environ["{name}"] = "1"' for name in env]
    lines += [
        "from nemo_lw_fp8.cpu.te import activate",
        'R = {"backend": activate()}',
        "import torch",
        "from nemo_lw_fp8.cpu.te import device as te_device",
        "SCOPE = te_device.target_gpu(te_device.BLACKWELL)  # kept: a dropped one exits",
        "SCOPE.__enter__()",
    ]
    return "\n" + "\n".join(lines) + "\n" + body


def te_script_results(script: str) -> dict:
    """:func:`run_te_script`'s results, or the test skipped (with the reason) where Transformer
    Engine's Python package is not installed."""
    if TE_PATH is None:
        pytest.skip("Transformer Engine's Python package is not installed")
    return run_te_script(script)


def run_te_script(script: str, *, timeout: int = 240) -> dict:
    """Run ``script`` in a fresh interpreter that can import TE; return its ``RESULT`` JSON.

    A subprocess keeps this process's imports clean (no TE, no megatron TE flags fixed).
    """
    env = dict(os.environ)
    paths = [str(REPO), *(TE_PATH or [])] + [p for p in sys.path if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["NEMO_LW_FP8_TE_PATH"] = os.pathsep.join(TE_PATH or [])
    env.pop("NVTE_PROJECT_BUILDING", None)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=str(REPO),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"subprocess failed (rc={proc.returncode})\nstdout:\n{proc.stdout[-4000:]}\n"
            f"stderr:\n{proc.stderr[-6000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def real_te_gpu_skip_reason(supported: Callable[[int, int], bool], needs: str) -> str | None:
    """Why a test of real TE kernels cannot run here, or None when it can: it needs a CUDA GPU
    whose compute capability (major, minor) ``supported`` accepts (``needs`` says which) and
    the real Transformer Engine, not only its Python package."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if not supported(major, minor):
        return f"{needs}, this GPU is {major}.{minor}"
    if not te_backend._extension_file_present():
        return "real Transformer Engine (transformer-engine[pytorch]) is not installed"
    return None


class ThreadedMaxAllReduce:
    """Simulates a MAX all-reduce between ``world`` threads (one per rank) in one process."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world)
        self.buffers: list[torch.Tensor] = []
        self.lock = threading.Lock()

    def __call__(self, buffer: torch.Tensor) -> None:
        with self.lock:
            self.buffers.append(buffer)
        self.barrier.wait()
        reduced = torch.stack(self.buffers).amax(0)
        self.barrier.wait()
        buffer.copy_(reduced)


class RepeatedMaxAllReduce(ThreadedMaxAllReduce):
    """:class:`ThreadedMaxAllReduce` in ``torch.distributed.all_reduce``'s place (a TE script
    assigns it there): that signature, and the buffers emptied after each call, so the same
    threads can reduce again."""

    def __call__(self, tensor: torch.Tensor, op=None, group=None, async_op=False) -> None:
        super().__call__(tensor)
        self.barrier.wait()
        with self.lock:
            self.buffers.clear()
