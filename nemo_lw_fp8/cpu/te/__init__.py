"""CPU emulation of MXFP8 as Transformer Engine 2.20 does it.

* :mod:`~nemo_lw_fp8.cpu.formats.mxfp8`: pure-torch, bit-exact MXFP8 quantise / dequantise, with
  the format (E8M0 scales, scale layouts) in :mod:`~nemo_lw_fp8.cpu.formats.mxfp8_layout` and the
  distributed-optimizer (sharded) cast in :mod:`~nemo_lw_fp8.cpu.formats.mxfp8_sharded_cast`.
  Needs nothing but torch. Blockwise FP8 likewise: :mod:`~nemo_lw_fp8.cpu.formats.blockwise`,
  :mod:`~nemo_lw_fp8.cpu.formats.blockwise_sharded_cast`.
* :mod:`~nemo_lw_fp8.cpu.te.backend`: runs TE's own Python classes (``MXFP8Tensor``,
  ``quantized_model_init``, ``quantize_master_weights``) on CPU by replacing only TE's compiled
  extension (:mod:`~nemo_lw_fp8.cpu.te.tex` and its kernel-family modules).
  Call :func:`activate` before anything imports ``megatron.core``.
* :mod:`~nemo_lw_fp8.cpu.layers.mxfp8_linear`: a linear layer whose GEMM operands go through MXFP8
  the way TE's ``Linear`` does, with bf16 or persistent MXFP8 weights.

Importing this package imports neither Transformer Engine nor megatron-core.
"""

from __future__ import annotations

from nemo_lw_fp8.cpu.te.backend import (
    TEBackendError,
    activate,
    active_backend,
    is_emulated,
    pinned_te_version,
)

__all__ = ["TEBackendError", "activate", "active_backend", "is_emulated", "pinned_te_version"]
