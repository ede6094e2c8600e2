"""Guards for single grouped expert weights (#5464, issue 6): what passes, where values come from.

Each rule's rejection (rule name, flag, fix) is in ``tests/rules/test_guards.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nemo_lw_fp8 import rules as guards
from nemo_lw_fp8.rules import ConfigError, Settings
from tests.support.guard_settings import GROUPED_OK, LAYER_WISE_MXFP8_GATHER

LAYER_WISE_MXFP8_PRIMARY = LAYER_WISE_MXFP8_GATHER | GROUPED_OK | dict(
    use_distributed_optimizer=True
)


@pytest.mark.parametrize(
    "changes",
    [
        {},  # MXFP8 primary weights
        {"fp8_param_gather": False, "reuse_grad_buf_for_mxfp8_param_ag": False},  # MXFP8 compute
        {"fp8_recipe": None, "fp8_param_gather": False, "reuse_grad_buf_for_mxfp8_param_ag": False},
        {"optimizer": "adam", "use_layer_wise_distributed_optimizer": False},
        {"fp4_recipe": "nvfp4", "optimizer": "adam", "use_layer_wise_distributed_optimizer": False},
    ],
    ids=["mxfp8-primary", "mxfp8-compute", "bf16", "distopt-adam", "distopt-adam-nvfp4"],
)
def test_supported_single_grouped_settings_pass(changes):
    guards.check(Settings(**{**LAYER_WISE_MXFP8_PRIMARY, **changes}))


def test_rules_are_silent_without_single_grouped_weight():
    settings = Settings(use_megatron_fsdp=True, te_version="1.0", grouped_linear_single_param=False)
    assert guards.violations(settings) == []


def test_te_switch_is_read_from_the_environment(monkeypatch):
    settings = Settings(**{**LAYER_WISE_MXFP8_PRIMARY, "grouped_linear_single_param": None})
    monkeypatch.delenv(guards.SINGLE_GROUPED_WEIGHT_ENV, raising=False)
    with pytest.raises(ConfigError, match="grouped-weight-te-switch"):
        guards.check(settings)
    monkeypatch.setenv(guards.SINGLE_GROUPED_WEIGHT_ENV, "0")
    with pytest.raises(ConfigError, match="grouped-weight-te-switch"):
        guards.check(settings)
    monkeypatch.setenv(guards.SINGLE_GROUPED_WEIGHT_ENV, "1")
    guards.check(settings)


def test_installed_te_version_is_used_when_not_given():
    installed = guards._installed_te_version()
    settings = Settings(**{**LAYER_WISE_MXFP8_PRIMARY, "te_version": None})
    found = [rule for rule, _ in guards.violations(settings)]
    too_old = installed is None or guards._version_tuple(installed) < (2, 14, 0)
    assert ("grouped-weight-te-version" in found) == too_old


@pytest.mark.parametrize(
    "version, ok", [("2.14.0", True), ("2.20.2+cu12", True), ("2.13.9", False), ("1.99", False)]
)
def test_te_version_floor(version, ok):
    settings = Settings(**{**LAYER_WISE_MXFP8_PRIMARY, "te_version": version})
    found = [rule for rule, _ in guards.violations(settings)]
    assert ("grouped-weight-te-version" not in found) == ok


def test_megatron_args_are_read():
    """megatron-training's argparse names reach the grouped-weight rules."""
    args = SimpleNamespace(
        optimizer="muon",
        use_layer_wise_distributed_optimizer=True,
        moe_single_grouped_weight=True,
        use_torch_fsdp2=True,
        te_version="2.20.2",
        grouped_linear_single_param=True,
    )
    with pytest.raises(ConfigError, match="grouped-weight-fsdp") as info:
        guards.check(Settings.from_args(args))
    assert "--use-torch-fsdp2" in str(info.value)
