"""The FP8 MLP that the CPU FP8 parity tests train, and the pool boot they train it on.

Every such test module starts the same way: skip when TE's Python package cannot be found (the
FP8 emulation is built on TE's own classes), boot the ranks with the emulation, and derive its
scenarios from one FP8 MLP. Keeping that start here means a change to the shared model or boot
reaches every parity test at once instead of drifting between copies.
"""

from __future__ import annotations

import pytest

from nemo_lw_fp8.cpu.te import backend as te_backend
from tests.support.harness import BootOptions
from tests.support.scenarios import Scenario

#: Ranks booted with the FP8 emulation (TE's own FP8 classes over the exact CPU kernels).
FP8_BOOT = BootOptions(fp8_emulation=True)

#: The small FP8 MLP with batches large enough for whole MXFP8 blocks.
FP8_MLP = Scenario(model="fp8mlp", fp8=True, micro_batch=32)

#: Layer-wise Muon with the plugin on megatron's padded layout, snapshots kept for comparison.
MUON_FP8_MLP = FP8_MLP.with_(
    optimizer="muon", distribution="layerwise_padded", snapshots=True, plugin=True
)


def skip_module_without_te(reason: str) -> None:
    """At a test module's top: skip the whole module with ``reason`` when TE's Python package
    is not found. It is only looked for, never imported: importing TE in the pytest process
    would change what the forked ranks inherit."""
    if te_backend.te_package_dirs() is None:
        pytest.skip(reason, allow_module_level=True)
