"""The commands as a user runs them, in fresh processes (each conversion builds its own one-rank
process group and TE set-up, which must not leak into the test process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file


def nemo(*words: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``nemo-lw-fp8 WORDS`` (``python -m nemo_lw_fp8.cli``); its output captured."""
    env = dict(os.environ)
    env.pop("NEMO_LW_FP8_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "nemo_lw_fp8.cli", *words],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


def ok(*words: str) -> subprocess.CompletedProcess:
    done = nemo(*words)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done


def errors(done: subprocess.CompletedProcess) -> list[str]:
    """The command's own error lines (``nemo-lw-fp8 ...: error: ...``)."""
    return [line for line in done.stderr.splitlines() if line.startswith("nemo-lw-fp8 ")]


def weights(folder: Path) -> dict:
    """Every tensor of an HF checkpoint's safetensors files."""
    out: dict = {}
    for file in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(file))
    return out


def rewrite(source: Path, target: Path, tensors: dict) -> Path:
    """A copy of the HF checkpoint ``source`` whose weights are ``tensors``."""
    target.mkdir(parents=True)
    for name in ("config.json", "generation_config.json"):
        if (source / name).is_file():
            (target / name).write_text((source / name).read_text())
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(target / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    return target
