"""CPU emulation of MXFP8 as Transformer Engine 2.20 does it.

* :mod:`~nemo_lw_fp8.emulation.mxfp8`: pure-torch, bit-exact MXFP8 quantise / dequantise, the
  scale layouts and the distributed-optimizer (sharded) cast. Needs nothing but torch.
* :mod:`~nemo_lw_fp8.emulation.te_backend`: runs TE's own Python classes (``MXFP8Tensor``,
  ``quantized_model_init``, ``quantize_master_weights``) on CPU by replacing only TE's compiled
  extension (:mod:`~nemo_lw_fp8.emulation.te_extension`). Call :func:`activate` before anything
  imports ``megatron.core``.
* :mod:`~nemo_lw_fp8.emulation.fp8_linear`: a linear layer whose GEMM operands go through MXFP8
  the way TE's ``Linear`` does, with bf16 or persistent MXFP8 weights.

Importing this package imports neither Transformer Engine nor megatron-core.
"""

from __future__ import annotations

from .te_backend import TEBackendError, activate, active_backend, is_emulated, pinned_te_version

__all__ = ["TEBackendError", "activate", "active_backend", "is_emulated", "pinned_te_version"]
