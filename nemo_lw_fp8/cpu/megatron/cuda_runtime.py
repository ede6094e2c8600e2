"""The CUDA runtime and device as megatron-core reaches them, answered on CPU: no-op streams and
events, and every tensor or module asked for on ``cuda`` put on the CPU instead (a torch function
mode). Two stand-ins of :mod:`.standins` (``cuda_runtime``, ``cuda_device``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from nemo_lw_fp8.cpu.megatron.swap import swap_attrs

_CPU = torch.device("cpu")


# --------------------------------------------------------------------------- cuda_runtime


class _NoOpStream:
    """Stands for a CUDA stream: work on CPU is synchronous, so every wait is already satisfied."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NoOpEvent:
        return event if event is not None else _NoOpEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NoOpEvent:
    """Stands for a CUDA event: always complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


_DEFAULT_STREAM = _NoOpStream()


def install_cuda_runtime() -> Callable[[], None]:
    return swap_attrs(
        torch.cuda,
        {
            # The CPU device itself, not 0: ``device=torch.cuda.current_device()`` must land on
            # the CPU also where the device-redirect mode is not active (autograd backward of
            # megatron's custom Functions, e.g. ``_gather_along_first_dim`` in MoE dispatch).
            "current_device": lambda: _CPU,
            "Stream": _NoOpStream,
            "Event": _NoOpEvent,
            "current_stream": lambda device=None: _DEFAULT_STREAM,
            "default_stream": lambda device=None: _DEFAULT_STREAM,
            "stream": lambda stream=None: contextlib.nullcontext(),
            "synchronize": lambda device=None: None,
            "empty_cache": lambda: None,
        },
    )


# --------------------------------------------------------------------------- cuda_device


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int device index means a CUDA ordinal in torch's factory functions.
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device arguments to the CPU and reports CUDA tensor type strings."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def install_cuda_device() -> Callable[[], None]:
    mode = CudaToCpuMode()
    mode.__enter__()

    def undo() -> None:
        mode.__exit__(None, None, None)

    return undo


