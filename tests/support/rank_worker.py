"""The rank side of :mod:`tests.support.harness`: what a pool's rank processes run (start-up,
the task loop, the cleanup after each task) and what travels between them and the parent (the
:class:`ParallelSpec` of a task, the :class:`BootOptions` of a pool, results with tensors as raw
bytes). The zygotes that fork ranks are :mod:`tests.support.zygote`; the parent side (pools,
deadlines, failures) is :mod:`tests.support.harness`.
"""

from __future__ import annotations

import faulthandler
import importlib
import io
import os
import pickle
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

STARTUP_TIMEOUT_S = 400.0
#: If set, a file that gets one line per pool start (what the suite pays in imports).
POOL_LOG = os.environ.get("NEMO_LW_FP8_POOL_LOG", "")


@dataclass(frozen=True)
class ParallelSpec:
    """Megatron model-parallel sizes for a task; data parallel takes the remaining ranks."""

    tp: int = 1
    ep: int = 1
    #: Pipeline stages (megatron's tp-cp-ep-dp-pp order: rank r is on stage r // (world / pp)).
    pp: int = 1
    #: Expert tensor-parallel size; ``None``: megatron's default, TP.
    etp: int | None = None


@dataclass(frozen=True)
class BootOptions:
    """What a worker sets up before it imports megatron-core (fixed for a pool's lifetime)."""

    #: Activate the Transformer Engine MXFP8 emulation backend before megatron is imported.
    fp8_emulation: bool = False
    #: Names of CPU stand-ins to install; ``None`` installs all of them.
    standins: tuple[str, ...] | None = None


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
        expert_tensor_parallel_size=spec.etp,
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
        from nemo_lw_fp8.cpu.te import backend as te_backend

        te_backend.activate()
    if not megatron:
        return
    import nemo_lw_fp8  # noqa: F401 - its NVRx shim must precede megatron's import
    from nemo_lw_fp8.cpu.megatron import standins

    standins.install(boot.standins)
    for name in PREIMPORTED_MODULES:
        importlib.import_module(name)


def requests(conn: Connection) -> Iterator[Any]:
    """The messages the parent sends on ``conn`` until it sends ``None`` or closes its end: the
    loop a rank's task server and a zygote's fork server share, so both stop the same way."""
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if message is None:
            return
        yield message


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
        from nemo_lw_fp8.cpu.megatron import standins

        standins.install(boot.standins)  # a no-op in a forked rank: the zygote installed them
        _init_parallel_state(ParallelSpec())
        _record_true_originals()
        # The CPU time this rank spent starting (a forked rank's count starts at its fork).
        conn.send_bytes(pickle.dumps(("ready", time.process_time())))
    except BaseException:  # noqa: BLE001 - report any start-up failure to the parent
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return

    for message in requests(conn):
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
