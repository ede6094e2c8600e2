"""The patch framework on real megatron-core objects: idempotent apply, exact revert, refusals."""

from __future__ import annotations

import warnings

import pytest

import nemo_lw_fp8
from nemo_lw_fp8.patches import framework
from nemo_lw_fp8.patches.framework import (
    ALLOW_UNTESTED_ENV,
    LateApplyWarning,
    Override,
    Patch,
    UntestedMegatronVersion,
)
from tests.support.harness import run_on_ranks

TEST_FEATURE = "framework_selftest"


def _targets():
    from megatron.core.optimizer import layer_wise_optimizer as lw

    return lw, lw.LayerWiseDistributedOptimizer


def _replacement_sync(self):
    return "replaced"


def _build_overrides() -> list[Override]:
    module, cls = _targets()
    return [
        # A plain method, a staticmethod (must come back as the same staticmethod object),
        # a module function, and an attribute that did not exist before.
        Override(cls, "start_param_sync_for_bucket_group_subset", _replacement_sync),
        Override(cls, "_shard_divisor", staticmethod(lambda dp, cfg: 1)),
        Override(module, "is_managed_by_layer_wise_optimizer", lambda param: False),
        Override(cls, "_nemo_lw_fp8_selftest_marker", True),
    ]


def make_patch(native: bool = False, tested: tuple[str, ...] | None = None) -> Patch:
    tested = (framework.megatron_core_version(),) if tested is None else tested
    return Patch(
        name=TEST_FEATURE,
        upstream_pr=0,
        summary="framework self-test",
        detect_native=lambda: (native, "self-test detector"),
        build_overrides=_build_overrides,
        tested_versions=tested,
    )


@pytest.fixture
def selftest_patch():
    patch = framework.register(make_patch())
    yield patch
    framework.unregister(TEST_FEATURE)


def _snapshot():
    module, cls = _targets()
    return {
        "method": cls.__dict__["start_param_sync_for_bucket_group_subset"],
        "static": cls.__dict__["_shard_divisor"],
        "function": module.is_managed_by_layer_wise_optimizer,
        "marker": "_nemo_lw_fp8_selftest_marker" in cls.__dict__,
    }


def test_apply_twice_equals_once_and_revert_restores_identity(selftest_patch):
    before = _snapshot()
    assert nemo_lw_fp8.apply([TEST_FEATURE]) == {TEST_FEATURE: "patched"}
    once = _snapshot()
    assert nemo_lw_fp8.apply([TEST_FEATURE]) == {TEST_FEATURE: "patched"}
    assert _snapshot() == once, "a second apply changed the patched objects"
    assert len(selftest_patch._saved) == 4
    assert nemo_lw_fp8.applied() == [TEST_FEATURE]

    module, cls = _targets()
    assert once["method"] is _replacement_sync
    assert once["marker"] is True
    # The original stays reachable while patched.
    assert framework.original(cls, "start_param_sync_for_bucket_group_subset") is before["method"]

    nemo_lw_fp8.revert([TEST_FEATURE])
    after = _snapshot()
    assert after["method"] is before["method"]
    assert after["static"] is before["static"]
    assert after["function"] is before["function"]
    assert after["marker"] is False
    assert nemo_lw_fp8.applied() == []


def test_native_detection_skips_the_patch():
    patch = framework.register(make_patch(native=True))
    try:
        before = _snapshot()
        assert nemo_lw_fp8.apply([TEST_FEATURE]) == {TEST_FEATURE: "native"}
        assert _snapshot() == before
        assert patch.native_reason == "self-test detector"
    finally:
        framework.unregister(TEST_FEATURE)


def test_untested_megatron_version_is_refused(monkeypatch):
    framework.register(make_patch(tested=("0.0.1",)))
    try:
        monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
        before = _snapshot()
        with pytest.raises(UntestedMegatronVersion) as info:
            nemo_lw_fp8.apply([TEST_FEATURE])
        message = str(info.value)
        installed = framework.megatron_core_version()
        assert installed in message and "0.0.1" in message and ALLOW_UNTESTED_ENV in message
        assert _snapshot() == before
        monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
        with pytest.warns(UserWarning, match=f"not {installed}"):
            assert nemo_lw_fp8.apply([TEST_FEATURE]) == {TEST_FEATURE: "patched"}
    finally:
        framework.unregister(TEST_FEATURE)
    assert _snapshot() == before


def test_unknown_feature_is_refused():
    with pytest.raises(KeyError, match="unknown nemo_lw_fp8 feature"):
        nemo_lw_fp8.apply(["no_such_feature"])


def test_failed_override_leaves_nothing_behind():
    class Frozen:
        __slots__ = ()

    def broken() -> list[Override]:
        return [*_build_overrides()[:2], Override(Frozen(), "anything", 1)]

    patch = framework.register(Patch(TEST_FEATURE, 0, "broken", lambda: (False, ""), broken))
    try:
        before = _snapshot()
        with pytest.raises(AttributeError):
            nemo_lw_fp8.apply([TEST_FEATURE])
        assert _snapshot() == before
        assert not patch.applied
    finally:
        framework.unregister(TEST_FEATURE)


def _apply_after_building_a_model():
    from tests.support.scenarios import Scenario, build_model
    from tests.support.training import wrap_and_build_optimizer

    scenario = Scenario(optimizer="adam", distribution="distopt")
    module, config = build_model(scenario)
    model, optimizer = wrap_and_build_optimizer(module, config, scenario)
    framework.register(make_patch())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            nemo_lw_fp8.apply([TEST_FEATURE])
        return [str(w.message) for w in caught if issubclass(w.category, LateApplyWarning)]
    finally:
        framework.unregister(TEST_FEATURE)
        del model, optimizer


def test_apply_after_models_exist_says_so():
    messages = run_on_ranks(_apply_after_building_a_model, world_size=2)[0]
    assert messages, "no LateApplyWarning"
    assert "before building models and optimizers" in messages[0]


def _apply_again_after_building_a_model():
    from tests.support.scenarios import Scenario, build_model
    from tests.support.training import wrap_and_build_optimizer

    nemo_lw_fp8.apply()
    scenario = Scenario(optimizer="adam", distribution="distopt")
    module, config = build_model(scenario)
    model, optimizer = wrap_and_build_optimizer(module, config, scenario)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            nemo_lw_fp8.apply()  # everything applied or native: nothing comes late
        return [str(w.message) for w in caught if issubclass(w.category, LateApplyWarning)]
    finally:
        del model, optimizer


def test_apply_again_after_models_exist_is_quiet():
    """Native patches (the stack has the change, or Bridge is not in use) install nothing, so a
    second apply() after models exist has nothing to warn about."""
    assert run_on_ranks(_apply_again_after_building_a_model, world_size=2) == [[], []]
