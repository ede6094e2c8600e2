"""Client of the launch server of tests/support/fork_run.py (``fork_run.py --serve``): one process
per test session imports Megatron-Bridge, megatron-core and the TE emulation once, and every Bridge
run of the suite is forked from it (``bridge_runs.pretrain(launcher="fork")``, the default).

Why: a run launched as its own process spends ~20 s of CPU on those imports before its ranks
fork; the suite launches ~50 runs. What a run executes is unchanged: the same entry point, rank
environment and freshly imported state (see :func:`fork_run.serve`).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

FORK_RUN = Path(__file__).parent / "fork_run.py"
#: Read per request by tests/support/bridge_run.py; kept out of the server's own environment.
PER_RUN_VARIABLES = (
    "NEMO_LW_FP8_TEST_MUTATION", "NEMO_LW_FP8_TEST_PROBE", "NEMO_LW_FP8_TEST_STATE_TENSORS"
)
START_TIMEOUT_S = 600.0


class LaunchServer:
    """A running ``fork_run.py --serve`` and the requests it answers, one at a time."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in PER_RUN_VARIABLES}
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - open while the server lives
            prefix="fork-server-", suffix=".log", delete=False
        )
        self._proc = subprocess.Popen(
            [sys.executable, str(FORK_RUN), "--serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env, text=True,
            bufsize=1,
        )  # fmt: skip
        self._read(START_TIMEOUT_S, "start")

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def _read(self, timeout: float, what: str) -> dict:
        with selectors.DefaultSelector() as selector:
            selector.register(self._proc.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                raise TimeoutError(f"launch server: no answer within {timeout:.0f} s ({what})")
        line = self._proc.stdout.readline()
        if not line:
            self._log.flush()
            tail = Path(self._log.name).read_text()[-4000:]
            raise RuntimeError(f"launch server exited ({what}); its output:\n{tail}")
        return json.loads(line)

    def run(
        self,
        nproc: int,
        port: str,
        words: list[str],
        env: dict[str, str],
        timeout: float,
        output_dir: Path,
        tag: str,
    ) -> subprocess.CompletedProcess:
        """Launch one run and wait for it, as ``subprocess.run(..., timeout=timeout)`` would:
        its stdout / stderr in the result, ``TimeoutExpired`` after killing it at the deadline."""
        fields = {"nproc": nproc, "port": port, "words": words}
        return self._request(fields, env, timeout, output_dir, tag, [str(FORK_RUN), *words])

    def run_script(
        self, script: str | Path, argv: list[str], timeout: float, output_dir: Path, tag: str
    ) -> subprocess.CompletedProcess:
        """Run a script (Python source, or a file's path) in a process forked from the server,
        as ``subprocess.run([sys.executable, "-c", source | path, *argv], capture_output=True,
        timeout=timeout)`` would in a fresh interpreter whose first steps were the server's
        imports (TE's emulation booted, then megatron-core and Bridge)."""
        fields: dict = {"script": script, "argv": argv}
        cmd = [sys.executable, "-c", script, *argv]
        if isinstance(script, Path):
            fields.update(script=script.read_text(), file=str(script))
            cmd = [sys.executable, str(script), *argv]
        return self._request(fields, dict(os.environ), timeout, output_dir, tag, cmd)

    def _request(
        self, fields: dict, env: dict[str, str], timeout: float, output_dir: Path, tag: str,
        cmd: list[str],
    ) -> subprocess.CompletedProcess:  # fmt: skip
        out, err = output_dir / f"{tag}.stdout", output_dir / f"{tag}.stderr"
        request = {**fields, "env": env, "cwd": os.getcwd(), "stdout": str(out),
                   "stderr": str(err)}  # fmt: skip
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        pid = self._read(60.0, tag)["pid"]
        try:
            code = self._read(timeout, tag)["code"]
        except TimeoutError:
            os.killpg(pid, signal.SIGKILL)
            self._read(60.0, f"{tag} (killed)")
            stdout, stderr = out.read_text(), err.read_text()
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr) from None
        return subprocess.CompletedProcess(cmd, code, out.read_text(), err.read_text())

    def stop(self) -> None:
        if self.alive:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)


_SERVER: LaunchServer | None = None


def server() -> LaunchServer:
    """The session's launch server, started on first use (again if it died)."""
    global _SERVER
    if _SERVER is None or not _SERVER.alive:
        _SERVER = LaunchServer()
    return _SERVER


def run_script(
    script: str | Path, *argv: str, timeout: float = 900.0
) -> subprocess.CompletedProcess:
    """:meth:`LaunchServer.run_script` on the session's server, its output kept in memory.

    For the tests that inspect the installed stack in a process of their own (TE booted over the
    emulation before megatron-core, a process group, CPU stand-ins) and assert on what it prints:
    each saves the ~20-45 s of CPU a fresh interpreter spends importing Bridge."""
    with tempfile.TemporaryDirectory(prefix="fork-script-") as tmp:
        return server().run_script(script, list(argv), timeout, Path(tmp), "script")


def stop_server() -> None:
    global _SERVER
    if _SERVER is not None:
        _SERVER.stop()
        _SERVER = None
