"""Run Transformer Engine 2.20.2's own MXFP8 classes on CPU.

Why
    megatron-core's MXFP8 parameter path (``fp8_param_gather``, the distributed optimizer's
    ``quantize_master_weights``, ``is_mxfp8tensor`` checks) only switches on when TE's
    ``MXFP8Tensor`` class is importable. TE's Python package imports only with its compiled
    extension ``transformer_engine_torch``, which needs CUDA, and its MXFP8 kernels need a
    Blackwell GPU (compute capability 10.x). To test and develop the plugin on CPU we keep TE's
    real Python classes and replace the kernels underneath with a bit-exact emulation.

What :func:`activate` replaces (and nothing else)
    1. ``sys.modules["transformer_engine_torch"]`` becomes
       :mod:`nemo_lw_fp8.cpu.te.tex` (MXFP8 quantize/dequantize, multi-tensor
       norm/scale, the MXFP8 distributed-optimizer cast; strict dummies for the rest).
    2. The package ``__init__`` of ``transformer_engine.common`` loads cuDNN, NVRTC, cuRAND and
       ``libtransformer_engine.so`` unless ``NVTE_PROJECT_BUILDING`` is set: it is set (and
       ``NVTE_RELEASE_BUILD`` cleared) only while TE is being imported, then restored.
    3. ``transformer_engine.common.load_framework_extension`` (which would load the missing
       ``transformer_engine_torch*.so``) is replaced by a no-op right after that module has
       run, through a one-shot import hook, before ``transformer_engine.pytorch`` imports it.
    4. ``_FromMXFP8Func.forward`` (``tensor/storage/mxfp8_tensor_storage.py``) copies CPU
       tensors to CUDA before calling ``tex.dequantize``; it is replaced by a version that
       dequantises on the tensor's own device.

TE internals this relies on (hence the version pin :data:`pinned_te_version`)
    the module name ``transformer_engine_torch`` and the argument conventions of the kernels
    listed above; the names TE reads from it at import time; ``NVTE_PROJECT_BUILDING``;
    ``transformer_engine.common.load_framework_extension``; the private ``_FromMXFP8Func`` and
    the ``MXFP8TensorStorage`` attribute names (``_rowwise_data``, ``_rowwise_scale_inv``,
    ``_columnwise_data``, ``_columnwise_scale_inv``, ``_fp8_dtype``,
    ``_with_gemm_swizzled_scales``).

Never shadowing a working TE
    When TE's compiled extension is installed and a CUDA device is visible, :func:`activate`
    imports TE normally and returns ``"transformer_engine"`` without changing anything. Only if
    that import fails does it fall back to the emulation (with a warning).

Order
    megatron-core records at import time whether TE and its ``MXFP8Tensor`` class exist
    (``megatron.core.fp8_utils.HAVE_TE_MXFP8TENSOR`` and friends). Call :func:`activate`
    before anything imports ``megatron.core``; if megatron was imported first with TE flagged
    absent, :func:`activate` raises :class:`TEBackendError` instead of half-working.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import sysconfig
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "TEBackendError",
    "activate",
    "active_backend",
    "is_emulated",
    "pinned_te_version",
]

pinned_te_version = "2.20.2"
"""The only Transformer Engine version whose Python package the emulation is tested with."""

BACKEND_TE = "transformer_engine"
BACKEND_EMULATED = "emulated"

_EXTENSION = "transformer_engine_torch"
# megatron-core flags that, once False, stay False for the life of the process.
_MEGATRON_TE_FLAGS = ("HAVE_TE", "HAVE_TE_MXFP8TENSOR", "HAVE_TE_FP8_TENSOR_CLASS")
_lock = threading.RLock()


class TEBackendError(RuntimeError):
    """Transformer Engine cannot be made usable (missing, wrong version, or imported too late)."""


# --------------------------------------------------------------------------------------------
# Queries
# --------------------------------------------------------------------------------------------


def _emulated_extension_loaded() -> bool:
    return getattr(sys.modules.get(_EXTENSION), "EMULATED", False) is True


def active_backend() -> str | None:
    """``"emulated"``, ``"transformer_engine"`` (TE imported with its real extension) or None."""
    if "transformer_engine.pytorch" not in sys.modules:
        return None
    return BACKEND_EMULATED if _emulated_extension_loaded() else BACKEND_TE


def is_emulated() -> bool:
    """Whether TE's compiled extension is the CPU emulation in this process."""
    return active_backend() == BACKEND_EMULATED


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


#: Extra folders (``os.pathsep``-separated) that may hold TE's pure-Python package for the
#: emulation; ``make env`` installs it into ``<venv>/te-emulation``, which is searched too.
TE_PATH_ENV = "NEMO_LW_FP8_TE_PATH"


def te_side_paths() -> list[str]:
    """Folders outside site-packages where the emulation looks for TE's Python package.

    TE's pure-Python wheel is kept off the default import path on purpose: once importable,
    ``import megatron.core`` fails without a compiled TE ("empty transformer-engine meta
    package"), so only processes that activate the emulation should see it.
    """
    paths = [p for p in os.environ.get(TE_PATH_ENV, "").split(os.pathsep) if p]
    default = os.path.join(sys.prefix, "te-emulation")
    if os.path.isdir(default):
        paths.append(default)
    return paths


def te_package_dirs() -> list[str] | None:
    """Import-path folders that make TE's Python package importable, ``[]`` if it already is,
    ``None`` if it cannot be found (never imports TE)."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return []
    found = [
        p
        for p in te_side_paths()
        if os.path.isfile(os.path.join(p, "transformer_engine", "__init__.py"))
    ]
    return found[:1] or None


def _add_side_paths() -> list[str]:
    """Put the side folders on ``sys.path`` when TE is not importable from it already."""
    added = []
    for path in te_package_dirs() or []:
        if path not in sys.path:
            sys.path.append(path)
            added.append(path)
    if added:
        importlib.invalidate_caches()
    return added


def installed_te_version() -> str:
    """Version of the installed ``transformer_engine`` Python package; errors if absent."""
    if importlib.util.find_spec("transformer_engine") is None:
        raise TEBackendError(
            "Transformer Engine's Python package is not installed: "
            f"`pip install --no-deps transformer-engine=={pinned_te_version}` (the pure-Python "
            "wheel; add einops, pydantic and onnxscript, which it imports) for the CPU "
            "emulation, or `pip install transformer-engine[pytorch]` on a GPU machine"
        )
    for name in ("transformer_engine", "transformer-engine"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    raise TEBackendError(
        "transformer_engine is importable but has no package metadata, so its version cannot "
        f"be checked against the pinned {pinned_te_version}"
    )


def _megatron_flags_absent() -> list[str]:
    absent = []
    for name, module in list(sys.modules.items()):
        if not (name == "megatron.core" or name.startswith("megatron.core.")) or module is None:
            continue
        values = getattr(module, "__dict__", {})
        for flag in _MEGATRON_TE_FLAGS:
            if values.get(flag) is False:
                absent.append(f"{name}.{flag}")
    return sorted(absent)


def _check_megatron_order() -> None:
    absent = _megatron_flags_absent()
    if absent:
        raise TEBackendError(
            "megatron.core was imported before nemo_lw_fp8.cpu.te.activate() and recorded "
            f"Transformer Engine as absent ({', '.join(absent)}). megatron-core fixes these "
            "flags at import time, so MXFP8 parameters would not be recognised. Call "
            "activate() before anything imports megatron.core (first thing in the entry point, "
            "or in conftest.py)."
        )


def _extension_file_present() -> bool:
    """Whether TE's compiled torch extension exists where TE itself would look for it."""
    for dist in ("transformer_engine_torch", "transformer-engine-torch"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            importlib.metadata.distribution(dist)
            return True
    spec = importlib.util.find_spec("transformer_engine")
    roots = []
    if spec is not None and spec.origin:
        roots.append(Path(spec.origin).parent.parent)
    roots.append(Path(sysconfig.get_paths()["purelib"]))
    for root in roots:
        for folder in (
            root,
            root / "transformer_engine",
            root / "transformer_engine" / "wheel_lib",
        ):
            if folder.is_dir() and any(folder.glob(f"{_EXTENSION}*.so")):
                return True
    return False


def _real_te_possible() -> bool:
    """Real TE can only work with its compiled extension and a visible CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available()) and _extension_file_present()


def _purge_te_modules() -> None:
    for name in list(sys.modules):
        if name in (_EXTENSION, f"{_EXTENSION}_nv", "transformer_engine") or name.startswith(
            "transformer_engine."
        ):
            del sys.modules[name]


# --------------------------------------------------------------------------------------------
# Installing the emulation
# --------------------------------------------------------------------------------------------


def _skip_framework_extension(framework: str) -> None:
    """Replaces ``load_framework_extension``: the extension module is already in sys.modules."""
    if framework == "torch" and not _emulated_extension_loaded():
        raise TEBackendError("the emulated transformer_engine_torch is not registered")


def _patch_common(module: ModuleType) -> None:
    module.load_framework_extension = _skip_framework_extension


class _CommonHook(importlib.abc.MetaPathFinder):
    """One-shot import hook: patch ``transformer_engine.common`` right after it has run."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "transformer_engine.common":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            _patch_common(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


@contextlib.contextmanager
def _bypass_shared_library_loading() -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in ("NVTE_PROJECT_BUILDING", "NVTE_RELEASE_BUILD")}
    os.environ["NVTE_PROJECT_BUILDING"] = "1"
    os.environ.pop("NVTE_RELEASE_BUILD", None)
    hook = None
    common = sys.modules.get("transformer_engine.common")
    if common is not None:
        _patch_common(common)
    else:
        hook = _CommonHook()
        sys.meta_path.insert(0, hook)
    try:
        yield
    finally:
        if hook is not None:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(hook)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _cpu_from_mxfp8_forward(_ctx: Any, tensor: Any, dtype: Any) -> Any:
    """``_FromMXFP8Func.forward`` without the detour through CUDA (dequantise in place)."""
    import torch
    from transformer_engine.pytorch.constants import TE_DType

    from nemo_lw_fp8.cpu.te import tex as te_extension

    for data in (tensor._rowwise_data, tensor._columnwise_data):
        if data is not None and data.numel() == 0:
            return torch.empty(tensor.size(), dtype=dtype, device=tensor.device)
    if tensor._rowwise_data is None and tensor._columnwise_data is None:
        raise ValueError("Cannot dequantize an MXFP8 tensor that holds no data")
    return te_extension.dequantize(tensor, TE_DType[dtype])


def _cpu_from_nvfp4_forward(_ctx: Any, tensor: Any, dtype: Any) -> Any:
    """``_FromNVFP4Func.forward`` without its detour through CUDA (``tensor.to("cuda")`` for a
    CPU tensor): the same checks, then the emulated ``tex.dequantize``."""
    import torch
    from transformer_engine.pytorch.constants import TE_DType

    from nemo_lw_fp8.cpu.te import tex as te_extension

    for data in (tensor._rowwise_data, tensor._columnwise_data):
        if data is not None and data.numel() == 0:
            return torch.empty(tensor.size(), dtype=dtype, device=tensor.device)
    if tensor._rowwise_data is None and tensor._columnwise_data is None:
        raise ValueError("Attempted to dequantize NVFP4 tensor with no data")
    if tensor._rowwise_data is None:
        raise NotImplementedError("Dequantizing column-wise NVFP4 data is not implemented yet!")
    return te_extension.dequantize(tensor, TE_DType[dtype])


def _replace_forward(autograd_function: Any, replacement: Any) -> bool:
    """Put ``replacement`` in place of a TE autograd function's ``forward``, once; False when it
    already is."""
    if getattr(autograd_function.forward, "__wrapped_by_nemo_lw_fp8__", False):
        return False
    forward = functools.wraps(replacement)(replacement)
    forward.__wrapped_by_nemo_lw_fp8__ = True  # type: ignore[attr-defined]
    autograd_function.forward = staticmethod(forward)
    return True


def _cpu_dummy_wgrad(shape: list, dtype: Any, zero: bool = False) -> Any:
    """TE's ``get_dummy_wgrad`` with its buffer on the CPU.

    With wgrad accumulated into ``main_grad`` (megatron's ``gradient_accumulation_fusion``)
    TE's linears, its op-fuser linears and megatron's own output layer return a shared dummy
    tensor as the weight's ``.grad``; TE allocates it with ``device="cuda"`` inside the backward,
    where no device-redirect mode is active. Same cache (``module.base._dummy_wgrads``), same
    zeroing; only the device differs."""
    import torch
    from transformer_engine.pytorch.module import base

    key = (*shape, dtype)
    if key not in base._dummy_wgrads:
        base._dummy_wgrads[key] = torch.empty(shape, dtype=dtype, requires_grad=False)
    if zero:
        base._dummy_wgrads[key].fill_(0)
    return base._dummy_wgrads[key].detach()


def _swap_dummy_wgrad() -> None:
    """Put :func:`_cpu_dummy_wgrad` wherever TE's modules bound ``get_dummy_wgrad`` (megatron,
    imported after TE, then binds the replacement from ``module.base``)."""
    from transformer_engine.pytorch.module import base

    original = base.get_dummy_wgrad
    if original is _cpu_dummy_wgrad:
        return
    for name, module in list(sys.modules.items()):
        bound = getattr(module, "get_dummy_wgrad", None) if module is not None else None
        if name.startswith("transformer_engine.") and bound is original:
            module.get_dummy_wgrad = _cpu_dummy_wgrad  # type: ignore[attr-defined]


def _patch_te_python() -> None:
    from transformer_engine.pytorch.tensor.storage import (
        mxfp8_tensor_storage,
        nvfp4_tensor_storage,
    )

    _swap_dummy_wgrad()
    _replace_forward(nvfp4_tensor_storage._FromNVFP4Func, _cpu_from_nvfp4_forward)
    if not _replace_forward(mxfp8_tensor_storage._FromMXFP8Func, _cpu_from_mxfp8_forward):
        return
    # TE's Triton MoE permutation launchers (moe_permute_fusion) cannot launch on CPU
    from nemo_lw_fp8.cpu.te import triton_permutation as te_triton_permutation

    te_triton_permutation.install()


def _install_emulation(version: str) -> None:
    if version != pinned_te_version:
        raise TEBackendError(
            f"Transformer Engine {version} is installed, but the CPU emulation relies on TE "
            f"internals and supports exactly {pinned_te_version}: "
            f"`pip install --no-deps transformer-engine=={pinned_te_version}`"
        )
    from nemo_lw_fp8.cpu.te import tex as te_extension

    if "transformer_engine.pytorch" in sys.modules:
        raise TEBackendError("transformer_engine.pytorch is already imported without emulation")
    _purge_te_modules()  # drop leftovers of an earlier failed import
    sys.modules[_EXTENSION] = te_extension
    try:
        with _bypass_shared_library_loading():
            importlib.import_module("transformer_engine.pytorch")
        _patch_te_python()
    except BaseException as exc:
        _purge_te_modules()
        if isinstance(exc, TEBackendError):
            raise
        raise TEBackendError(
            f"importing Transformer Engine {version} over the CPU emulation failed: {exc!r}"
        ) from exc


def activate() -> str:
    """Make TE's MXFP8 tensor classes usable in this process; returns the backend in use.

    ``"transformer_engine"``: TE was already imported with its real extension, or it imports
    and works here (compiled extension plus a CUDA device) -- nothing is changed.
    ``"emulated"``: TE 2.20.2's Python package now runs over the CPU emulation.
    Raises :class:`TEBackendError` if TE's Python package is missing, has another version
    than :data:`pinned_te_version` (emulation only), or megatron-core was imported first with
    TE flagged absent. Idempotent and thread-safe.
    """
    with _lock:
        current = active_backend()
        if current == BACKEND_EMULATED:
            _patch_te_python()
            return current
        if current == BACKEND_TE:
            return current
        added = _add_side_paths()
        try:
            version = installed_te_version()
            _check_megatron_order()
            if _real_te_possible():
                try:
                    importlib.import_module("transformer_engine.pytorch")
                    return BACKEND_TE
                except Exception as exc:  # noqa: BLE001 - any failure means: not a working TE
                    _purge_te_modules()
                    warnings.warn(
                        f"Transformer Engine {version} did not import with its compiled extension "
                        f"({exc!r}); using the nemo_lw_fp8 CPU emulation instead",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            _install_emulation(version)
            return BACKEND_EMULATED
        except BaseException:
            # A failed activation leaves the import path as it was: with TE visible, a later
            # plain ``import megatron.core`` would fail.
            for path in added:
                sys.path.remove(path)
            raise
