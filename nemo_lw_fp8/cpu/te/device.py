"""Scoped device answers that let Transformer Engine 2.20.2's own modules run on CPU.

Why
    TE's modules ask the device before they compute: ``TransformerEngineBaseModule.__init__``
    refuses without ``torch.cuda.is_available()``, ``prepare_forward`` refuses an input without
    ``inp.is_cuda``, the attention backend selection and the grouped GEMM check ``is_cuda`` of
    their tensors, and the recipe checks, GEMM workspace and backend choices read the compute
    capability, SM count and library versions. With the kernels emulated
    (:mod:`nemo_lw_fp8.cpu.te.tex`), these are the only things between TE's Python
    and the CPU. :func:`target_gpu` answers them *as the recipe's target GPU would*, so TE takes
    the branch it takes on that GPU, and refuses what that GPU refuses (MXFP8 on SM 9.0 raises
    TE's own "Device compute capability 10.0 or higher required for MXFP8 execution").

Scope (never process-wide)
    A process-wide ``torch.cuda.is_available() = True`` breaks dynamo and every library that
    then tries to initialise CUDA. Here each answer is given only inside the ``with`` block, and
    the CUDA questions (``is_available``, ``Tensor.is_cuda``) are answered "yes" only when the
    asking frame belongs to TE's module, attention, op-fuser or GEMM-wrapper code
    (:data:`TE_CALLERS`); every other caller gets the truth. TE's own helpers (compute
    capability, SM count, cuBLAS workspace size, ``_empty_tensor``) are replaced in TE's
    modules, including the copies imported by name, and restored on exit.

The kernels' version and backend queries (``get_cublasLt_version``, ``get_cudnn_version``,
``get_fused_attn_backend``, ...) read :func:`active_target`; outside a scope they refuse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "BLACKWELL",
    "HOPPER",
    "TE_CALLERS",
    "TargetGPU",
    "active_target",
    "target_for_recipe",
    "target_gpu",
]


@dataclasses.dataclass(frozen=True)
class TargetGPU:
    """What a GPU answers to TE's device questions."""

    name: str
    compute_capability: tuple[int, int]
    cublaslt_version: int
    cudnn_version: int
    sm_count: int


BLACKWELL = TargetGPU("B200", (10, 0), 130300, 91300, 148)
"""The MXFP8 recipes' target: SM 10.0 and CUDA 13's cuBLASLt (>= 13.3, which TE's grouped-tensor
GEMM path requires)."""

HOPPER = TargetGPU("H100", (9, 0), 120900, 91000, 132)
"""The blockwise (Hopper) recipes' target: SM 9.0, CUDA 12.9's cuBLASLt."""

TE_CALLERS = (
    "transformer_engine.pytorch.module.",
    "transformer_engine.pytorch.attention.",
    "transformer_engine.pytorch.ops.",
    "transformer_engine.pytorch.cpp_extensions.",
    "transformer_engine.pytorch.permutation",
)
"""Module-name prefixes of the TE code whose CUDA questions get the target's answer."""

_state = threading.local()
_lock = threading.RLock()


def active_target() -> TargetGPU | None:
    """The GPU the innermost :func:`target_gpu` scope answers as, or None outside any."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


def require_target(what: str) -> TargetGPU:
    """The active target, or a refusal naming the TE query that needs one."""
    target = active_target()
    if target is None:
        raise RuntimeError(
            f"{what} asks the GPU; on CPU it is answered only inside "
            "nemo_lw_fp8.cpu.te.device.target_gpu(...)"
        )
    return target


def target_for_recipe(recipe: Any) -> TargetGPU:
    """The GPU a recipe is meant for: MXFP8 -> :data:`BLACKWELL`, blockwise FP8 ->
    :data:`HOPPER`, none (bf16) -> :data:`BLACKWELL`; other recipes are refused by name."""
    if recipe is None:
        return BLACKWELL
    kind = type(recipe).__name__
    if kind == "MXFP8BlockScaling":
        return BLACKWELL
    if kind == "Float8BlockScaling":
        return HOPPER
    raise NotImplementedError(f"no CPU target GPU for recipe {kind} (only MXFP8 and blockwise)")


def _asked_by_te(depth: int = 2) -> bool:
    """Whether the frame ``depth`` levels up belongs to TE code listed in :data:`TE_CALLERS`.

    A quantized tensor's own ``is_cuda`` property (TE's ``tensor/`` classes ask their data
    buffers) passes the question on: then its caller decides."""
    try:
        frame = sys._getframe(depth)
        name = frame.f_globals.get("__name__", "")
        if frame.f_code.co_name == "is_cuda" and name.startswith(_TE_TENSORS) and frame.f_back:
            name = frame.f_back.f_globals.get("__name__", "")
    except ValueError:
        return False
    return name.startswith(TE_CALLERS)


_TE_TENSORS = "transformer_engine.pytorch.tensor."


_REAL_IS_CUDA = torch.Tensor.is_cuda
_REAL_IS_AVAILABLE = torch.cuda.is_available
_REAL_IS_CAPTURING = torch.cuda.is_current_stream_capturing
_REAL_CAPABILITY = torch.cuda.get_device_capability
_NVFP4_TENSOR = "transformer_engine.pytorch.tensor.nvfp4_tensor"


def _is_cuda(self: torch.Tensor) -> bool:
    """``Tensor.is_cuda`` for TE's callers: ``prepare_forward`` (``module/base.py``, "needs
    CUDA"), ``DotProductAttention.forward`` and the backends' ``q.is_cuda`` checks
    (``attention/dot_product_attention/``), ``general_grouped_gemm_for_grouped_tensor``'s
    ``alpha.is_cuda`` (``cpp_extensions/gemm.py``). A CPU tensor is "on the GPU" for them."""
    real = _REAL_IS_CUDA.__get__(self)
    if real or self.device.type != "cpu":
        return real
    return _asked_by_te()


def _is_available() -> bool:
    """``torch.cuda.is_available`` for TE's callers: ``TransformerEngineBaseModule.__init__``
    ("TransformerEngine needs CUDA") and the attention backends' capability checks
    (``attention/dot_product_attention/backends.py``); everyone else gets the truth."""
    return True if _asked_by_te() else _REAL_IS_AVAILABLE()


def _is_current_stream_capturing() -> bool:
    """``torch.cuda.is_current_stream_capturing`` for TE's callers
    (``FP8GlobalStateManager.fp8_graph_capturing`` in ``quantization.py``, asked by every TE
    module's forward; ``GroupedTensorStorage``): no CUDA graph is being captured on CPU. Other
    callers get torch's own answer."""
    try:
        name = sys._getframe(1).f_globals.get("__name__", "")
    except ValueError:
        name = ""
    if name.startswith("transformer_engine."):
        return False
    return _REAL_IS_CAPTURING()


def _current_device_answer(previous: Callable[[], Any]) -> Callable[[], Any]:
    """``torch.cuda.current_device`` for ``NVFP4Quantizer.__init__`` (``tensor/nvfp4_tensor.py``),
    which asks it for the device of the random-Hadamard sign mask and matrix it builds
    (``get_random_sign_mask_for_rht``, ``get_rht_matrix``). On the GPU the answer is its index
    and those tensors live beside the data; here the data live on the CPU, so the answer is the
    CPU. Every other caller gets ``previous`` (torch's, or the CPU stand-ins' in rank workers)."""

    def current_device() -> Any:
        try:
            name = sys._getframe(1).f_globals.get("__name__", "")
        except ValueError:
            name = ""
        if name == _NVFP4_TENSOR and not _REAL_IS_AVAILABLE():
            return torch.device("cpu")
        return previous()

    return current_device


def _device_capability_answer(target: TargetGPU) -> Callable[..., tuple[int, int]]:
    """``torch.cuda.get_device_capability`` for TE's callers: ``general_grouped_gemm_for_grouped_
    tensor`` (``cpp_extensions/gemm.py``) picks one alpha / beta per group from SM 10.0, one
    shared before. They get the target's capability; everyone else torch's own answer."""

    def get_device_capability(device: Any = None) -> tuple[int, int]:
        if _asked_by_te():
            return target.compute_capability
        return _REAL_CAPABILITY(device)

    return get_device_capability


def _te_modules() -> list[Any]:
    return [
        module
        for name, module in list(sys.modules.items())
        if module is not None
        and (name == "transformer_engine" or name.startswith("transformer_engine."))
    ]


def _replace_everywhere(originals: list[Any], replacement: Any, name: str) -> list[Callable]:
    """Replace TE's helper ``name`` in every TE module whose global is one of ``originals``
    (TE imports its helpers by name, so each copy must be replaced)."""
    undo: list[Callable[[], None]] = []
    for module in _te_modules():
        current = module.__dict__.get(name)
        if current is not None and any(current is original for original in originals):
            module.__dict__[name] = replacement
            undo.append(lambda m=module, v=current: m.__dict__.__setitem__(name, v))
    return undo


def _helper_answers(target: TargetGPU) -> dict[str, Callable[..., Any]]:
    def get_device_compute_capability() -> tuple[int, int]:
        """TE's ``utils.get_device_compute_capability`` (recipe checks in ``quantization.py``,
        ``GroupedLinear``'s grouped-tensor path, attention backend selection)."""
        return target.compute_capability

    def _get_device_compute_capability(device: Any = None) -> tuple[int, int]:
        """TE's cached ``utils._get_device_compute_capability``
        (``torch.cuda.get_device_properties``)."""
        return target.compute_capability

    def get_sm_count() -> int:
        """TE's ``utils.get_sm_count`` (``multi_processor_count``: GEMM SM margins)."""
        return target.sm_count

    def get_cublas_workspace_size_bytes() -> int:
        """``cpp_extensions/gemm.py``'s workspace size, by TE's own rule for the target (32 MiB
        + 1 KiB from Hopper on, else 4 MiB), without ``torch.cuda.get_device_properties``."""
        return 32 * 1024 * 1024 + 1024 if target.compute_capability[0] >= 9 else 4_194_304

    def _empty_tensor() -> torch.Tensor:
        """TE's ``utils._empty_tensor`` (``torch.Tensor().cuda()``, used by
        ``clear_tensor_data`` in backward): an empty tensor on the CPU."""
        return torch.Tensor()

    return {
        "get_device_compute_capability": get_device_compute_capability,
        "_get_device_compute_capability": _get_device_compute_capability,
        "get_sm_count": get_sm_count,
        "get_cublas_workspace_size_bytes": get_cublas_workspace_size_bytes,
        "_empty_tensor": _empty_tensor,
    }


_SUPPORT_CACHES = ("_FP8_SUPPORT", "_MXFP8_SUPPORT", "_NVFP4_SUPPORT", "_FP8_BLOCK_SCALING_SUPPORT")


def _reset_support_caches() -> None:
    """TE caches its recipe-support answers (``quantization.py``): computed per scope."""
    quantization = sys.modules.get("transformer_engine.pytorch.quantization")
    if quantization is not None:
        for cache in _SUPPORT_CACHES:
            if cache in quantization.__dict__:
                quantization.__dict__[cache] = None


def _install(target: TargetGPU) -> list[Callable[[], None]]:
    if "transformer_engine.pytorch" not in sys.modules:
        raise RuntimeError("target_gpu() needs Transformer Engine imported (emulation active)")
    utils = sys.modules["transformer_engine.pytorch.utils"]
    gemm = sys.modules["transformer_engine.pytorch.cpp_extensions.gemm"]
    originals = {
        "get_device_compute_capability": utils.get_device_compute_capability,
        "_get_device_compute_capability": utils._get_device_compute_capability,
        "get_sm_count": utils.get_sm_count,
        "get_cublas_workspace_size_bytes": gemm.get_cublas_workspace_size_bytes,
        "_empty_tensor": utils._empty_tensor,
    }
    undo: list[Callable[[], None]] = []
    for name, answer in _helper_answers(target).items():
        original = originals[name]
        wrapped = getattr(original, "__wrapped__", None)
        undo += _replace_everywhere([original, *([wrapped] if wrapped else [])], answer, name)
    gemm.get_cublas_workspace.cache_clear()
    own = torch.Tensor.__dict__.get("is_cuda")  # None: inherited from the C base class
    torch.Tensor.is_cuda = property(_is_cuda)  # type: ignore[assignment,method-assign]
    if own is None:
        undo.append(lambda: delattr(torch.Tensor, "is_cuda"))
    else:
        undo.append(lambda: setattr(torch.Tensor, "is_cuda", own))
    torch.cuda.is_available = _is_available
    undo.append(lambda: setattr(torch.cuda, "is_available", _REAL_IS_AVAILABLE))
    torch.cuda.is_current_stream_capturing = _is_current_stream_capturing
    undo.append(lambda: setattr(torch.cuda, "is_current_stream_capturing", _REAL_IS_CAPTURING))
    torch.cuda.get_device_capability = _device_capability_answer(target)
    undo.append(lambda: setattr(torch.cuda, "get_device_capability", _REAL_CAPABILITY))
    current_device = torch.cuda.current_device
    torch.cuda.current_device = _current_device_answer(current_device)
    undo.append(lambda: setattr(torch.cuda, "current_device", current_device))
    _reset_support_caches()
    undo.append(_reset_support_caches)
    undo.append(gemm.get_cublas_workspace.cache_clear)
    return undo


@contextlib.contextmanager
def target_gpu(target: TargetGPU = BLACKWELL) -> Iterator[TargetGPU]:
    """Inside: TE's device questions get ``target``'s answers (see module doc). Nestable on one
    thread only with the same target; the patches are process state, so one thread at a time."""
    with _lock:
        stack = getattr(_state, "stack", None)
        if stack is None:
            stack = _state.stack = []
        if stack and stack[-1] != target:
            raise RuntimeError(f"target_gpu({target.name}) inside target_gpu({stack[-1].name})")
        undo = _install(target) if not stack else []
        stack.append(target)
        try:
            yield target
        finally:
            stack.pop()
            for step in reversed(undo):
                step()
