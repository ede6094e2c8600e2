"""TE 2.20.2's version, workspace and backend queries for the ``transformer_engine_torch``
stand-in.

Why: TE's Python asks its extension what the machine offers before it picks a path:
``quantization._compute_fp8_support`` and ``GroupedLinear``'s grouped-tensor path
(``module/grouped_linear.py``, ``ops/basic/grouped_linear.py``: cuBLASLt >= 13.3) read
``get_cublasLt_version``; attention reads ``get_cudnn_version`` and ``get_fused_attn_backend``
(``attention/dot_product_attention/utils.py``, ``get_attention_backend``); the grouped GEMMs
size their workspaces with ``get_num_cublas_streams`` and
``get_grouped_gemm_setup_workspace_size`` (``cpp_extensions/gemm.py``).

The versions are the target GPU's (:func:`nemo_lw_fp8.cpu.te.device.active_target`), so TE takes
the branch it takes on that GPU; outside a ``target_gpu`` scope they refuse by name.
``get_fused_attn_backend`` always answers ``NVTE_No_Backend``: there is no cuDNN on CPU, and that
answer makes TE choose ``UnfusedDotProductAttention`` (whose softmax kernels are emulated)."""

from __future__ import annotations

from typing import Any

from nemo_lw_fp8.cpu.te.tex.common import NVTE_Fused_Attn_Backend

__all__ = [
    "get_cublasLt_version",
    "get_cudnn_version",
    "get_fused_attn_backend",
    "get_grouped_gemm_setup_workspace_size",
    "get_num_cublas_streams",
]
TEX_KERNELS = tuple(__all__)
"""The ``transformer_engine_torch`` names this module provides."""

NUM_CUBLAS_STREAMS = 4
"""TE's default number of compute streams (``nvte_get_num_compute_streams``)."""


def _target(what: str) -> Any:
    from nemo_lw_fp8.cpu.te.device import require_target

    return require_target(f"tex.{what}")


def get_cublasLt_version() -> int:  # noqa: N802 - TE's name
    """The target GPU's cuBLASLt version (``13.3.0`` -> ``130300``)."""
    return _target("get_cublasLt_version").cublaslt_version


def get_cudnn_version() -> int:
    """The target GPU's cuDNN version (``9.13.0`` -> ``91300``)."""
    return _target("get_cudnn_version").cudnn_version


def get_fused_attn_backend(params: Any) -> tuple[NVTE_Fused_Attn_Backend, str]:
    """``(NVTE_No_Backend, reason)`` for any ``FusedAttentionParams`` (2.20.2's call site
    ``_get_fused_attn_backend`` in ``attention/dot_product_attention/utils.py`` unpacks a pair):
    no cuDNN on CPU, so TE runs ``UnfusedDotProductAttention``."""
    return (
        NVTE_Fused_Attn_Backend.NVTE_No_Backend,
        "no cuDNN fused attention in the CPU emulation of transformer_engine_torch",
    )


def get_num_cublas_streams() -> int:
    """TE's number of cuBLAS streams for grouped GEMMs (one workspace each)."""
    return NUM_CUBLAS_STREAMS


def get_grouped_gemm_setup_workspace_size(num_tensors: int) -> int:
    """Bytes of the grouped GEMM's setup workspace: room for one pointer and shape record per
    tensor (the emulated GEMM reads no workspace; the size only has to be a valid allocation)."""
    return max(1, int(num_tensors)) * 256
