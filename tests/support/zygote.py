"""Zygotes for :mod:`tests.support.harness`: one process per boot (:class:`BootOptions`) and test
session that has imported torch, the TE emulation, the stand-ins and megatron-core once, and forks
a pool's ranks on request (:class:`_Zygote`, :class:`_ForkedRank`); ``NEMO_LW_FP8_POOL_START=spawn``
spawns ranks as fresh interpreters instead (:data:`POOL_START`).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from tests.support.rank_worker import (
    POOL_LOG,
    STARTUP_TIMEOUT_S,
    BootOptions,
    _import_stack,
    _serve_rank,
    requests,
)


def _native_threads() -> int:
    """Threads of this process as the kernel counts them (C++ and OpenMP threads included)."""
    return len(os.listdir("/proc/self/task"))


def _zygote_main(conn: Connection, boot: BootOptions) -> None:
    """The zygote: imports the stack once, then forks ranks on request until the parent goes.

    Requests (pickled, on ``conn``): ``("fork", rank, world_size, port, dump_path, env, cwd)``,
    followed by the rank's end of its pipe to the parent and the parent's stdout / stderr as
    file descriptors (``SCM_RIGHTS``); answered with ``("forked", pid)``. ``("poll", pids)``
    reaps exited ranks and answers ``{pid: exit code or None}``. ``None`` or the parent's end
    closing ends the zygote, and with it every rank it forked that still runs.
    """
    channel = socket.socket(fileno=os.dup(conn.fileno()))
    exit_codes: dict[int, int] = {}
    children: set[int] = set()

    def reap() -> None:
        for pid in list(children):
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    exit_codes[pid] = os.waitstatus_to_exitcode(status)
                    children.discard(pid)

    # SIGTERM (multiprocessing ending its daemon children at the parent's exit) ends the ranks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        # Importing torch loads numpy, whose OpenBLAS starts an idle worker thread (its fork
        # handlers take care of it, as in any forked torch process); nothing may add to it.
        import torch  # noqa: F401

        threads_after_torch = _native_threads()
        _import_stack(boot, megatron=True)
        import gc

        gc.freeze()  # the imported stack: never collected, never copied by the ranks' collections
        conn.send_bytes(pickle.dumps(("ready", time.process_time())))
        for message in requests(conn):
            reap()
            if message[0] == "poll":
                conn.send_bytes(pickle.dumps({pid: exit_codes.get(pid) for pid in message[1]}))
                continue
            _, fds, _, _ = socket.recv_fds(channel, 1, 3)
            try:
                extra = threading.active_count() - 1, _native_threads() - threads_after_torch
                if extra[0] > 0 or extra[1] > 0:
                    raise RuntimeError(
                        f"the zygote runs {extra[0]} Python and {extra[1]} native threads "
                        "besides its own and numpy's OpenBLAS one: it cannot fork safely"
                    )
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _forked_rank_main(message, fds, conn, channel, boot)  # never returns
                children.add(pid)
                conn.send_bytes(pickle.dumps(("forked", pid)))
            except BaseException:  # noqa: BLE001 - the parent falls back to spawned ranks
                conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
            finally:
                for fd in fds:
                    os.close(fd)
    except BaseException:  # noqa: BLE001 - report a start-up failure to the parent
        with contextlib.suppress(OSError):
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        for pid in children:  # stopped or not, they end (SIGKILL also ends a stopped process)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _forked_rank_main(
    message: tuple, fds: list[int], zygote_conn: Connection, channel: socket.socket,
    boot: BootOptions,
) -> None:  # fmt: skip
    """In a rank just forked from the zygote: take the parent's view of the world (output,
    environment, working directory, fresh random seeds), then serve as a spawned rank does."""
    code = 1
    try:
        _, rank, world_size, port, dump_path, env, cwd = message
        rank_fd, out_fd, err_fd = fds
        channel.close()
        zygote_conn.close()  # the parent must see the zygote's pipe close when the zygote ends
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        # What multiprocessing does in a child it forks (its after-fork hooks, no finalizers of
        # the parent), and the seeds a spawned interpreter would draw (os.fork reseeds random).
        mp.util._finalizer_registry.clear()
        mp.util._run_after_forkers()
        mp.current_process().name = f"nemo_lw_fp8-rank{rank}"
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()
        _serve_rank(rank, world_size, port, Connection(rank_fd), dump_path, boot, imports=False)
        code = 0
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        # The exit handlers a spawned rank's interpreter runs when its task loop ends.
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


class _Zygote:
    """Parent side of a zygote process (one per boot, kept for the session)."""

    def __init__(self, boot: BootOptions) -> None:
        ctx = mp.get_context("spawn")
        self.boot = boot
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_zygote_main, args=(child_conn, boot), daemon=True, name="nemo_lw_fp8-zygote"
        )
        started = time.monotonic()
        self._proc.start()
        child_conn.close()
        self._channel = socket.socket(fileno=os.dup(self._conn.fileno()))
        if not self._conn.poll(STARTUP_TIMEOUT_S):
            self.stop()
            raise RuntimeError(f"zygote for {boot}: not ready within {STARTUP_TIMEOUT_S:.0f}s")
        status, value = self._receive()
        if status != "ready":
            self.stop()
            raise RuntimeError(f"zygote for {boot} failed to start:\n{value}")
        self.start_seconds = time.monotonic() - started
        #: CPU seconds the zygote spent importing (what each spawned rank would spend too).
        self.start_cpu_seconds: float = value

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    def _receive(self) -> Any:
        try:
            return pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise RuntimeError(f"zygote for {self.boot} exited ({self._proc.exitcode})") from exc

    def fork(self, rank: int, world_size: int, port: int, rank_conn: Connection, dump: str) -> int:
        """Fork one rank; returns its pid. The rank writes where this process writes now."""
        sys.stdout.flush()
        sys.stderr.flush()
        request = ("fork", rank, world_size, port, dump, dict(os.environ), os.getcwd())
        self._conn.send_bytes(pickle.dumps(request))
        socket.send_fds(self._channel, [b"F"], [rank_conn.fileno(), 1, 2])
        status, value = self._receive()
        if status != "forked":
            raise RuntimeError(f"zygote for {self.boot} could not fork a rank:\n{value}")
        return value

    def exit_codes(self, pids: list[int]) -> dict[int, int | None]:
        """Each rank's exit code, ``None`` while it runs (or is stopped)."""
        if not self.alive:  # its ranks were ended with it (or are orphans soon reaped)
            return {pid: _orphan_exit_code(pid) for pid in pids}
        self._conn.send_bytes(pickle.dumps(("poll", pids)))
        return self._receive()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send_bytes(pickle.dumps(None))
        self._proc.join(timeout=10.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5.0)
        self._channel.close()
        self._conn.close()


def _orphan_exit_code(pid: int) -> int | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return -signal.SIGKILL
    return None


class _ForkedRank:
    """A rank forked by a zygote, with the part of ``multiprocessing.Process``'s interface the
    pool uses (it is the zygote's child, so the zygote reaps it and knows its exit code)."""

    def __init__(self, zygote: _Zygote, pid: int, name: str) -> None:
        self._zygote = zygote
        self.pid = pid
        self.name = name
        self._exitcode: int | None = None

    @property
    def exitcode(self) -> int | None:
        if self._exitcode is None:
            self._exitcode = self._zygote.exit_codes([self.pid])[self.pid]
        return self._exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_alive() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.02)


_ZYGOTES: dict[BootOptions, _Zygote] = {}
#: How pools start their ranks: "fork" (from the boot's zygote) or "spawn" (fresh interpreters).
POOL_START = os.environ.get("NEMO_LW_FP8_POOL_START", "fork")


def _zygote(boot: BootOptions) -> _Zygote:
    """The session's zygote for ``boot``, started on first use (again if it died)."""
    zygote = _ZYGOTES.get(boot)
    if zygote is None or not zygote.alive:
        zygote = _ZYGOTES[boot] = _Zygote(boot)
        if POOL_LOG:
            with open(POOL_LOG, "a") as log:
                test = os.environ.get("PYTEST_CURRENT_TEST", "?")
                seconds, cpu = zygote.start_seconds, zygote.start_cpu_seconds
                log.write(f"{seconds:.1f}s zygote {boot} cpu={cpu:.1f}s {test}\n")
    return zygote


def shutdown_zygotes() -> None:
    for zygote in _ZYGOTES.values():
        zygote.stop()
    _ZYGOTES.clear()
