"""Run a function on N gloo ranks that drive real megatron-core on CPU.

Design (see ``docs/testing.md``):

* A :class:`RankPool` starts ``world_size`` worker processes once. Each joins a gloo process
  group, installs the CPU stand-ins (:mod:`nemo_lw_fp8.cpu.megatron.standins`), imports
  megatron-core and then serves tasks. The ranks are forked from a "zygote" (:class:`_Zygote`), one
  process per boot (:class:`BootOptions`) and test session that has imported torch, the TE
  emulation, the stand-ins and megatron-core once, so a rank does not import them again: a rank of
  the default boot started on 16 CPU-seconds instead of 33 (the rest is mostly
  ``megatron.training``, which stays per rank: :data:`PREIMPORTED_MODULES`).
  ``NEMO_LW_FP8_POOL_START=spawn`` spawns every rank as a fresh interpreter instead (the former
  start; each rank imports the stack itself).
* A task is a picklable module-level function. It runs on every rank with megatron's parallel
  state initialised for the requested :class:`ParallelSpec`; each rank's return value (or
  traceback) comes back to the caller.
* Nothing hangs: every task has a deadline. When it passes, each worker is asked to dump the stacks
  of all its threads (``faulthandler`` on ``SIGUSR1``), the pool is killed, and
  :class:`RankTimeout` reports what each rank was doing.
* A rank that raises ends the call within a few seconds, whatever the deadline: the other ranks
  get :data:`FAILURE_GRACE_S` to report (they may fail too), those still running (typically
  waiting in a collective for the failed rank) dump their stacks and are killed, and
  :class:`RankFailure` carries the tracebacks and the stacks. The pool is discarded and the next
  call starts a fresh one. ``RankFailure`` is not an ``AssertionError``: a test that expects a
  comparison to fail cannot be satisfied by a crash.
* After every task the worker reverts any plugin patches the task applied, puts megatron's own
  objects back wherever a task left a mock at an attribute the plugin patches (recorded at
  start-up), and restores megatron's parallel state, so tasks do not leak into each other.
* Between tasks a pool's ranks are stopped (``SIGSTOP``, resumed for the next task): megatron's
  process groups keep gloo loop threads waking in every idle rank (:class:`RankPool`).
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
import tempfile
import time
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from tests.support.rank_worker import (  # noqa: F401 - BootOptions, ParallelSpec: the tests' names
    POOL_LOG,
    STARTUP_TIMEOUT_S,
    BootOptions,
    ParallelSpec,
    _worker_main,
)
from tests.support.zygote import POOL_START, _ForkedRank, _zygote, shutdown_zygotes

DEFAULT_TIMEOUT_S = 180.0
#: After one rank fails, how long the others get to report before the pool is killed (a rank
#: stuck in a collective with the failed rank would otherwise wait until the task's deadline).
FAILURE_GRACE_S = 2.0
#: How long the parent waits for a signalled rank to write its stack dump.
STACK_DUMP_WAIT_S = 2.0


class RankFailure(Exception):
    """One or more ranks raised; the message holds every failing rank's traceback and the stacks
    of the ranks that were still running when the pool was ended.

    Deliberately not an ``AssertionError``: ``pytest.raises(AssertionError)`` around a run must
    never be satisfied by a rank crashing.
    """

    def __init__(self, message: str, per_rank: dict[int, str], stuck: dict[int, str] | None = None):
        super().__init__(message)
        #: rank -> traceback (for :class:`RankTimeout`: rank -> stack of a rank still running)
        self.per_rank = per_rank
        #: rank -> stack dump of each rank that had not finished when another one failed
        self.stuck = stuck or {}


class RankTimeout(RankFailure):
    """The deadline passed; the message holds the stack of every rank still running."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------- parent side


class RankPool:
    """``world_size`` long-lived rank processes that run one task at a time on all ranks.

    Between tasks the ranks are stopped (``SIGSTOP``; ``SIGCONT`` before the next task, before
    shutting down). Why: an idle rank is not idle. Each of megatron's process groups runs a gloo
    loop thread that wakes about a hundred times a second; an idle rank with ~40 groups took
    ~6 % of a core, and the suite keeps up to ``MAX_LIVE_RANKS`` of them alive, which on a
    2-core machine took a third of the CPU from whatever test was running.
    """

    def __init__(
        self, world_size: int, boot: BootOptions = BootOptions(), start: str | None = None
    ):
        self.world_size = world_size
        self.boot = boot
        #: "fork": ranks forked from the boot's zygote; "spawn": fresh interpreters.
        self.start = start or POOL_START
        if self.start not in ("fork", "spawn"):
            raise ValueError(f"pool start {self.start!r}: expected 'fork' or 'spawn'")
        self._ctx = mp.get_context("spawn")
        self._dump_dir = tempfile.mkdtemp(prefix=f"nemo_lw_fp8_ranks{world_size}_")
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self.alive = False
        self._start()

    def _dump_path(self, rank: int) -> str:
        return os.path.join(self._dump_dir, f"rank{rank}.stacks")

    def _start(self) -> None:
        try:
            zygote = _zygote(self.boot) if self.start == "fork" else None
        except RuntimeError as exc:
            return self._spawn_instead(exc)
        port = _free_port()
        for rank in range(self.world_size):
            parent_conn, child_conn = self._ctx.Pipe()
            name = f"nemo_lw_fp8-rank{rank}"
            dump = self._dump_path(rank)
            if zygote is not None:
                try:
                    pid = zygote.fork(rank, self.world_size, port, child_conn, dump)
                except RuntimeError as exc:
                    parent_conn.close()
                    child_conn.close()
                    self._kill(list(range(rank)))  # they wait in gloo's init for this one
                    for conn in self._conns:
                        conn.close()
                    self._procs, self._conns = [], []
                    return self._spawn_instead(exc)
                proc = _ForkedRank(zygote, pid, name)
            else:
                proc = self._ctx.Process(
                    target=_worker_main,
                    args=(rank, self.world_size, port, child_conn, dump, self.boot),
                    daemon=True,
                    name=name,
                )
                proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        self.alive = True
        #: CPU seconds the ranks spent starting, summed (``NEMO_LW_FP8_POOL_LOG``).
        self.start_cpu_seconds = sum(self._collect(STARTUP_TIMEOUT_S, what="start-up"))
        self._pause()

    def _spawn_instead(self, reason: Exception) -> None:
        """Start this pool's ranks as fresh interpreters: the zygote could not fork them."""
        warnings.warn(f"{self.boot}: spawning the ranks instead of forking: {reason}", stacklevel=3)
        self.start = "spawn"
        self._start()

    def _signal_ranks(self, sig: int) -> None:
        for proc in self._procs:
            if proc.pid is not None and proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    def _pause(self) -> None:
        """Stop the idle ranks (all of them: no collective is in flight between tasks)."""
        self._signal_ranks(signal.SIGSTOP)

    def _resume(self) -> None:
        self._signal_ranks(signal.SIGCONT)

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = DEFAULT_TIMEOUT_S,
        parallel: ParallelSpec = ParallelSpec(),
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results ordered by rank."""
        if not self.alive:
            raise RuntimeError("this RankPool was shut down; get a new one")
        payload = pickle.dumps((fn, args, kwargs, parallel, list(sys.path)))
        self._resume()
        for conn in self._conns:
            conn.send_bytes(payload)
        results = self._collect(timeout, what=getattr(fn, "__qualname__", repr(fn)))
        self._pause()
        return results

    def _collect(self, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        while pending:
            remaining = deadline - time.monotonic()
            if errors:
                remaining = min(remaining, FAILURE_GRACE_S)
            if remaining <= 0:
                break
            ready = wait(list(pending.values()), timeout=remaining)
            if not ready:
                break
            for conn in ready:
                rank = next(r for r, c in pending.items() if c is conn)
                del pending[rank]
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    errors[rank] = f"rank {rank} exited (exit code {self._procs[rank].exitcode})"
                    continue
                if status == "error":
                    errors[rank] = value
                else:
                    results[rank] = value
        if pending and not errors:
            stacks = self._dump_stacks(sorted(pending))
            self.shutdown()
            detail = "\n".join(f"--- rank {r} was doing:\n{s}" for r, s in stacks.items())
            raise RankTimeout(
                f"{what}: deadline of {timeout:.0f}s passed with ranks {sorted(pending)} "
                f"still running; all ranks were ended.\n{detail}",
                stacks,
            )
        if errors:
            stuck = self._dump_stacks(sorted(pending)) if pending else {}
            self._kill(sorted(pending))
            self.shutdown()
            detail = "\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(errors.items()))
            waiting = "\n".join(
                f"--- rank {r} (still running, ended) was doing:\n{s}" for r, s in stuck.items()
            )
            note = f" (ranks {sorted(stuck)} did not finish and were ended)" if stuck else ""
            raise RankFailure(
                f"{what}: ranks {sorted(errors)} failed{note}.\n{detail}\n{waiting}".rstrip(),
                errors,
                stuck,
            )
        return [results[r] for r in range(self.world_size)]

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask each rank to dump every thread's stack (``faulthandler``: works while a rank is
        blocked in C code such as a gloo collective) and read the dumps."""
        signalled = []
        for rank in ranks:
            proc = self._procs[rank]
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGUSR1)
                signalled.append(rank)
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        stacks: dict[int, str] = {}
        while True:
            for rank in ranks:
                try:
                    with open(self._dump_path(rank)) as handle:
                        stacks[rank] = handle.read()
                except OSError as exc:
                    stacks[rank] = f"(could not read stack dump: {exc})"
            waiting = [r for r in signalled if not stacks[r]]
            if not waiting or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        # A dump is complete when its size stops changing; give a writer a moment to finish.
        time.sleep(0.1)
        for rank in signalled:
            with contextlib.suppress(OSError), open(self._dump_path(rank)) as handle:
                stacks[rank] = handle.read()
        return {rank: stack or "(no stack dumped)" for rank, stack in stacks.items()}

    def _kill(self, ranks: list[int]) -> None:
        """End ranks that cannot finish (blocked in a collective with a failed rank)."""
        for rank in ranks:
            proc = self._procs[rank]
            if proc.is_alive():
                proc.kill()
        for rank in ranks:
            self._procs[rank].join(timeout=5.0)

    def shutdown(self) -> None:
        """Stop every rank process (politely, then by force)."""
        if not self._procs:
            return
        self.alive = False
        self._resume()
        for conn in self._conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send_bytes(pickle.dumps(None))
        deadline = time.monotonic() + 3.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []


_POOLS: dict[tuple[int, BootOptions, str], RankPool] = {}


#: Rank processes kept alive across pools. Each holds ~1 GB once megatron is imported, and the
#: suite's pool shapes (world size x boot options) add up to ~18 processes: beyond this many,
#: the least recently used pools stop before a new one starts, so idle pools do not crowd out
#: the Bridge runs' ranks on a 2-core, ~20 GB machine (8 restarted ~30 pools in a suite run,
#: ~7 s each; 12 still ~18).
MAX_LIVE_RANKS = int(os.environ.get("NEMO_LW_FP8_MAX_LIVE_RANKS", "16"))


def _make_room(needed: int) -> None:
    live = sum(pool.world_size for pool in _POOLS.values() if pool.alive)
    for key in list(_POOLS):  # least recently used first
        if live + needed <= MAX_LIVE_RANKS:
            return
        pool = _POOLS.pop(key)
        if pool.alive:
            live -= pool.world_size
        pool.shutdown()


def get_pool(
    world_size: int, boot: BootOptions = BootOptions(), start: str | None = None
) -> RankPool:
    """A live pool for this world size and boot options, started on first use (its ranks
    forked from the boot's zygote, or spawned: ``start``, by default ``POOL_START``)."""
    start = start or POOL_START
    key = (world_size, boot, start)
    pool = _POOLS.pop(key, None)  # put back last: the dict runs from least to most recent
    if pool is None or not pool.alive:
        _make_room(world_size)
        started = time.monotonic()
        pool = RankPool(world_size, boot, start)
        if POOL_LOG:
            with open(POOL_LOG, "a") as log:
                test = os.environ.get("PYTEST_CURRENT_TEST", "?")
                seconds = time.monotonic() - started
                cpu = f"cpu={pool.start_cpu_seconds:.1f}s"
                log.write(f"{seconds:.1f}s {world_size} {boot} {pool.start} {cpu} {test}\n")
    _POOLS[key] = pool
    return pool


def run_on_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = DEFAULT_TIMEOUT_S,
    parallel: ParallelSpec = ParallelSpec(),
    boot: BootOptions = BootOptions(),
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn`` on ``world_size`` CPU ranks (reusing a pool) and return per-rank results."""
    return get_pool(world_size, boot).run(fn, *args, timeout=timeout, parallel=parallel, **kwargs)


def _resume_all_pools() -> None:
    """At interpreter exit, before multiprocessing ends its daemon children (a stopped rank
    would ignore that ``SIGTERM`` and the exit would wait for it)."""
    for pool in _POOLS.values():
        pool._resume()


import multiprocessing.util  # noqa: E402 - its exit handler is registered first, so runs last

atexit.register(_resume_all_pools)


def shutdown_pools() -> None:
    """Stop every pool this process started, then the zygotes their ranks were forked from."""
    for pool in _POOLS.values():
        pool.shutdown()
    _POOLS.clear()
    shutdown_zygotes()
