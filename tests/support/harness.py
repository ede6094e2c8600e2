"""Run a function on N gloo ranks that drive real megatron-core on CPU.

Design (see ``docs/testing.md``):

* A :class:`RankPool` starts ``world_size`` worker processes once. Each joins a gloo process
  group, installs the CPU stand-ins (:mod:`nemo_lw_fp8.cpu.standins`), imports megatron-core and
  then serves tasks. The ranks are forked from a "zygote" (:class:`_Zygote`), one process per
  boot (:class:`BootOptions`) and test session that has imported torch, the TE emulation, the
  stand-ins and megatron-core once, so a rank does not import them again: a rank of the default
  boot started on 16 CPU-seconds instead of 33 (the rest is mostly ``megatron.training``, which
  stays per rank: :data:`PREIMPORTED_MODULES`). ``NEMO_LW_FP8_POOL_START=spawn`` spawns every
  rank as a fresh interpreter instead (the former start; each rank imports the stack itself).
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
import faulthandler
import importlib
import io
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

DEFAULT_TIMEOUT_S = 180.0
STARTUP_TIMEOUT_S = 400.0
#: After one rank fails, how long the others get to report before the pool is killed (a rank
#: stuck in a collective with the failed rank would otherwise wait until the task's deadline).
FAILURE_GRACE_S = 2.0
#: How long the parent waits for a signalled rank to write its stack dump.
STACK_DUMP_WAIT_S = 2.0


@dataclass(frozen=True)
class ParallelSpec:
    """Megatron model-parallel sizes for a task; data parallel takes the remaining ranks."""

    tp: int = 1
    ep: int = 1
    #: Pipeline stages (megatron's tp-cp-ep-dp-pp order: rank r is on stage r // (world / pp)).
    pp: int = 1


@dataclass(frozen=True)
class BootOptions:
    """What a worker sets up before it imports megatron-core (fixed for a pool's lifetime)."""

    #: Activate the Transformer Engine MXFP8 emulation backend before megatron is imported.
    fp8_emulation: bool = False
    #: Names of CPU stand-ins to install; ``None`` installs all of them.
    standins: tuple[str, ...] | None = None


class RankFailure(Exception):
    """One or more ranks raised; the message holds every failing rank's traceback and the stacks
    of the ranks that were still running when the pool was ended.

    Deliberately not an ``AssertionError``: ``pytest.raises(AssertionError)`` around a run must
    never be satisfied by a rank crashing.
    """

    def __init__(
        self, message: str, per_rank: dict[int, str], stuck: dict[int, str] | None = None
    ):
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


# --------------------------------------------------------------------------- result transport


def _rebuild_tensor(raw: bytes, dtype_name: str, shape: tuple[int, ...]):
    import torch

    dtype = getattr(torch, dtype_name)
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


class _ResultPickler(pickle.Pickler):
    """Ships tensors as raw bytes.

    megatron-core registers its own pickling for tensor storages, so a default pickle of a tensor
    made on a rank would make the parent import megatron to read it back. Results are plain
    values; their bytes, dtype and shape are all a test needs.
    """

    def reducer_override(self, obj):  # noqa: ANN001
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            plain = obj.detach().cpu().contiguous()
            raw = plain.reshape(-1).view(torch.uint8).numpy().tobytes() if plain.numel() else b""
            dtype_name = str(plain.dtype).removeprefix("torch.")
            return _rebuild_tensor, (raw, dtype_name, tuple(plain.shape))
        return NotImplemented


def _dump_result(result: tuple[str, Any]) -> bytes:
    buffer = io.BytesIO()
    _ResultPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(result)
    return buffer.getvalue()


# --------------------------------------------------------------------------- worker side

_current_spec: ParallelSpec | None = None


def _init_parallel_state(spec: ParallelSpec) -> None:
    """(Re)initialise megatron's parallel state when the requested sizes differ."""
    global _current_spec
    from megatron.core import parallel_state

    if _current_spec == spec and parallel_state.model_parallel_is_initialized():
        return
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=spec.tp,
        expert_model_parallel_size=spec.ep,
        pipeline_model_parallel_size=spec.pp,
    )
    _current_spec = spec


#: megatron-core's own objects at every attribute a plugin patch replaces, as the worker found
#: them at start-up (before any task): ``[(owner, attr, value)]``.
_TRUE_ORIGINALS: list[tuple[object, str, object]] = []


def _record_true_originals() -> None:
    """Remember what megatron-core holds where the plugin's megatron-core patches write.

    Why: a task may install a mock over such an attribute (e.g. a grad-sync wrapper that sums
    in rank order) and then apply the plugin, which records the mock as "megatron's original";
    the plugin's ``revert()`` after the task then puts the mock back, and it would outlive the
    task in this long-lived process. :func:`_restore_true_originals` undoes any such leftover.
    """
    from nemo_lw_fp8 import patches
    from nemo_lw_fp8.patches import framework

    patches.load_all()
    for patch in framework.registry().values():
        if patch.target != "megatron-core":
            continue
        try:
            overrides = patch.build_overrides()
        except ImportError:  # its targets do not import in this pool (e.g. TE's, without TE)
            continue
        for override in overrides:
            value = framework._own_attr(override.owner, override.attr)
            _TRUE_ORIGINALS.append((override.owner, override.attr, value))


def _restore_true_originals() -> list[str]:
    """Put megatron-core's own objects back wherever a task left something else; returns what
    was put back (``owner.attr``)."""
    from nemo_lw_fp8.patches import framework

    restored = []
    for owner, attr, value in _TRUE_ORIGINALS:
        if framework._own_attr(owner, attr) is value:
            continue
        if value is framework.MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, value)
        restored.append(f"{getattr(owner, '__name__', owner)}.{attr}")
    return restored


def _cleanup_after_task() -> None:
    """Undo what a task may have left behind in this long-lived process: the plugin's patches,
    then anything else left at the attributes they patch (mocks a task installed)."""
    import gc

    plugin = sys.modules.get("nemo_lw_fp8")
    if plugin is not None and hasattr(plugin, "revert"):
        plugin.revert()
    _restore_true_originals()
    gc.collect()


#: Warnings megatron-core prints on every CPU import; they say nothing about the task at hand.
_KNOWN_IMPORT_NOISE = (
    r".*Transformer Engine and Apex are not installed.*",
    r".*Apex is not installed.*",
    r".*transformer-engine>=1.7.0 supports MoE experts.*",
    r".*MimoModelConfig is experimental.*",
    r".*imports from `dynamic_context.py` will be removed.*",
    r".*full scope is deprecated.*",
    # The FP8-gather-off reference runs are MXFP8 without param gather on purpose.
    r".*mxfp8 without using reuse_grad_buf_for_mxfp8_param_ag.*",
    # Tiny test models register parameters in another order than their forward uses them.
    r".*next bucket's parameter all-gather operation has already been dispatched.*",
)


def _quiet_known_import_noise() -> None:
    import logging
    import warnings

    for pattern in _KNOWN_IMPORT_NOISE:
        warnings.filterwarnings("ignore", message=pattern)
    # torch logs "No CUDA runtime is found" when megatron imports its C++ extension helpers.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # GPTModel logs a deprecation notice on every construction (HybridModel is its successor).
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)


#: megatron-core modules the zygote imports (after the boot's stand-ins, as a spawned rank does):
#: parallel state and what the tasks of tests/support/scenarios.py and training.py build with.
#: Not ``megatron.training`` (tasks and the patches recorded by :func:`_record_true_originals`
#: import it in the rank): importing it starts native threads (jemalloc's background thread among
#: them), and the zygote must have no thread but its own (and numpy's idle OpenBLAS one) when it
#: forks.
PREIMPORTED_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.transformer",
    "megatron.core.transformer.torch_norm",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.distributed",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.layer_wise_optimizer",
)


def _import_stack(boot: BootOptions, megatron: bool) -> None:
    """What a rank imports before gloo: torch (one intra-op thread), then the TE emulation when
    the boot asks for it (before anything imports megatron, which looks for TE at import).

    With ``megatron`` (the zygote) also the boot's stand-ins and then megatron-core, in that
    order, as in a spawned rank. Why the order matters: megatron's ``param_and_grad_buffer``
    takes ``torch.distributed._coalescing_manager`` by name at import, so it must see the
    ``gloo_coalescing`` stand-in's function there, as it does when the stand-ins import it.
    """
    _quiet_known_import_noise()
    import torch

    torch.set_num_threads(1)
    if boot.fp8_emulation:
        from nemo_lw_fp8.emulation import te_backend

        te_backend.activate()
    if not megatron:
        return
    import nemo_lw_fp8  # noqa: F401 - its NVRx shim must precede megatron's import
    from nemo_lw_fp8.cpu import standins

    standins.install(boot.standins)
    for name in PREIMPORTED_MODULES:
        importlib.import_module(name)


def _worker_main(
    rank: int, world_size: int, port: int, conn: Connection, dump_path: str, boot: BootOptions
) -> None:
    """A spawned rank (``NEMO_LW_FP8_POOL_START=spawn``): imports the stack, then serves."""
    _serve_rank(rank, world_size, port, conn, dump_path, boot, imports=True)


def _serve_rank(
    rank: int,
    world_size: int,
    port: int,
    conn: Connection,
    dump_path: str,
    boot: BootOptions,
    imports: bool,
) -> None:
    """A rank's life from its start-up (imports first unless forked from a zygote, which did
    them) to the end of its task loop."""
    dump_file = open(dump_path, "w")  # noqa: SIM115 - kept open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True)
    try:
        if imports:
            _import_stack(boot, megatron=False)
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        from nemo_lw_fp8.cpu import standins

        standins.install(boot.standins)  # a no-op in a forked rank: the zygote installed them
        _init_parallel_state(ParallelSpec())
        _record_true_originals()
        # The CPU time this rank spent starting (a forked rank's count starts at its fork).
        conn.send_bytes(pickle.dumps(("ready", time.process_time())))
    except BaseException:  # noqa: BLE001 - report any start-up failure to the parent
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return

    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if message is None:
            return
        fn, args, kwargs, spec, sys_path = message
        for entry in sys_path:
            if entry not in sys.path:
                sys.path.append(entry)
        try:
            _init_parallel_state(spec)
            result = ("ok", fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - every failure goes back to the caller
            result = ("error", traceback.format_exc())
        finally:
            try:
                _cleanup_after_task()
            except BaseException:  # noqa: BLE001
                result = ("error", traceback.format_exc())
        try:
            payload = _dump_result(result)
        except Exception:  # noqa: BLE001
            payload = pickle.dumps(("error", "result is not picklable:\n" + traceback.format_exc()))
        conn.send_bytes(payload)


# --------------------------------------------------------------------------- zygote side


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
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except EOFError:
                return
            if message is None:
                return
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
#: If set, a file that gets one line per pool start (what the suite pays in imports).
POOL_LOG = os.environ.get("NEMO_LW_FP8_POOL_LOG", "")


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
