"""Shared fixtures: CPU rank pools (started once per world size) and the GPU marker."""

from __future__ import annotations

import os

import pytest

from tests.support.fork_server import stop_server
from tests.support.harness import shutdown_pools


@pytest.fixture(scope="session")
def bridge_installed() -> None:
    """Megatron-Bridge is importable: ``make test`` (NEMO_LW_FP8_REQUIRE_TE=1) fails without it,
    a bare environment skips with the install hint."""
    import importlib.util

    if importlib.util.find_spec("megatron.bridge") is None:
        if os.environ.get("NEMO_LW_FP8_REQUIRE_TE") == "1":
            pytest.fail("Megatron-Bridge is not installed in this environment (make test needs it)")
        pytest.skip("Megatron-Bridge not installed (pip install 'nemo-lw-fp8[bridge]')")


@pytest.fixture(scope="session", autouse=True)
def _stop_rank_pools():
    """Rank pools and the Bridge runs' launch server live for the whole session (imports paid
    once); stop them at the end."""
    yield
    shutdown_pools()
    stop_server()


def pytest_configure(config):
    """``make test`` sets NEMO_LW_FP8_REQUIRE_TE=1: then TE's Python package (for the MXFP8
    emulation) must be there, so no FP8 test can skip silently."""
    if os.environ.get("NEMO_LW_FP8_REQUIRE_TE") != "1":
        return
    from nemo_lw_fp8.cpu.te import backend as te_backend

    if te_backend.te_package_dirs() is None:
        raise pytest.UsageError(
            "NEMO_LW_FP8_REQUIRE_TE=1 but Transformer Engine's Python package was not found "
            "(make env installs it into .venv/te-emulation; see docs/mxfp8.md)"
        )


def _gpu_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU; none is visible (CPU-only machine or CI)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if reason is None:
        return
    marker = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(marker)
