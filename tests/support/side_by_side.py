"""Run a test module's independent commands at the same time.

Why: several tests each start one interpreter that spends nearly all its time importing NeMo,
Megatron-Bridge or megatron-core on one core, and then check its output. The gate runs tests one
after another on a 2-core machine, so started together these commands take about half the time
of one after another; each still runs alone in its own fresh process, exactly as before.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


def run_side_by_side(
    commands: Mapping[str, Sequence[str]],
    directory: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    envs: Mapping[str, Mapping[str, str]] | None = None,
    timeout: float = 600.0,
) -> dict[str, subprocess.CompletedProcess]:
    """Start every command of ``commands`` (name -> argv) at once and wait for all of them:
    name -> its completed process (text stdout / stderr). Output goes to files in ``directory``,
    so no command blocks on a full pipe while another one is being read. ``envs`` gives a
    command (by name) an environment of its own instead of ``env``."""
    done: dict[str, subprocess.CompletedProcess] = {}
    with contextlib.ExitStack() as files:
        running = {}
        for index, (name, argv) in enumerate(commands.items()):
            streams = [files.enter_context(open(directory / f"{index}.{kind}", "w+"))
                       for kind in ("out", "err")]  # fmt: skip
            proc = subprocess.Popen(
                list(argv), stdout=streams[0], stderr=streams[1],
                env=(envs or {}).get(name, env), cwd=cwd,
            )  # fmt: skip
            running[name] = (proc, streams)
        for name, (proc, streams) in running.items():
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                for other, _ in running.values():
                    other.kill()
                raise
            text = []
            for stream in streams:
                stream.seek(0)
                text.append(stream.read())
            done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, *text)
    return done
