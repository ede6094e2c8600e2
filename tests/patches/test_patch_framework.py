"""The patch framework on real megatron-core objects: idempotent apply, exact revert, refusals."""

from __future__ import annotations

import warnings
from collections.abc import Callable

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


def make_patch(tested: tuple[str, ...] | None = None) -> Patch:
    tested = (framework.megatron_core_version(),) if tested is None else tested
    return Patch(
        name=TEST_FEATURE,
        upstream_pr=0,
        summary="framework self-test",
        build_overrides=_build_overrides,
        tested_versions=tested,
    )


def _record(monkeypatch, patch: Patch, verdict: str, **changes: str) -> None:
    """File ``patch`` in the record at the installed version with ``verdict`` and the
    fingerprints its targets have now (``changes``: target name -> another fingerprint)."""
    from nemo_lw_fp8.patches import upstream_fingerprints
    from nemo_lw_fp8.patches.record import fingerprint

    targets = {
        o.target: fingerprint(
            framework.unpatched_own_attr(o.owner, o.attr), framework.MISSING
        )
        for o in patch.build_overrides()
    }
    for name, value in changes.items():
        targets[name] = value
    key = framework.version_key(patch)
    table = {k: dict(v) for k, v in upstream_fingerprints.FINGERPRINTS.items()}
    table.setdefault(key, {})[patch.name] = {
        "verdict": verdict, "reason": "self-test record", "targets": targets
    }
    monkeypatch.setattr(upstream_fingerprints, "FINGERPRINTS", table)


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


def _put_back(before: dict) -> None:
    """Undo whatever a control left on megatron's objects (they are shared by every test of
    this process): the snapshot's objects go back, the marker goes away."""
    module, cls = _targets()
    cls.start_param_sync_for_bucket_group_subset = before["method"]
    cls._shard_divisor = before["static"]
    module.is_managed_by_layer_wise_optimizer = before["function"]
    if "_nemo_lw_fp8_selftest_marker" in cls.__dict__:
        del cls._nemo_lw_fp8_selftest_marker


def _apply_twice_then_revert(patch: Patch, between: Callable[[], None] = lambda: None) -> list[str]:
    """Apply the self-test patch, apply it again (``between`` runs before the second apply),
    revert: the names of the checks that failed (empty: apply twice = once, and revert gives
    back the very objects, a staticmethod included, and removes the added attribute)."""
    failed: list[str] = []
    before = _snapshot()
    _, cls = _targets()
    if nemo_lw_fp8.apply([TEST_FEATURE]) != {TEST_FEATURE: "patched"}:
        failed.append("first apply")
    once = _snapshot()
    if once["method"] is not _replacement_sync or once["marker"] is not True:
        failed.append("patched objects")
    # The original stays reachable while patched.
    if framework.original(cls, "start_param_sync_for_bucket_group_subset") is not before["method"]:
        failed.append("original while patched")
    between()
    if nemo_lw_fp8.apply([TEST_FEATURE]) != {TEST_FEATURE: "patched"}:
        failed.append("second apply")
    if _snapshot() != once:
        failed.append("second apply changed the patched objects")
    if len(patch._saved) != 4 or nemo_lw_fp8.applied() != [TEST_FEATURE]:
        failed.append("saved objects")
    nemo_lw_fp8.revert([TEST_FEATURE])
    after = _snapshot()
    for key in ("method", "static", "function"):
        if after[key] is not before[key]:
            failed.append(f"revert: {key}")
    if after["marker"] is not False:
        failed.append("revert: marker")
    if nemo_lw_fp8.applied() != []:
        failed.append("revert: applied")
    return failed


def test_apply_twice_equals_once_and_revert_restores_identity(selftest_patch):
    assert _apply_twice_then_revert(selftest_patch) == []


@pytest.mark.parametrize("mutation", ["revert_skips_the_staticmethod", "apply_forgets_it_applied"])
def test_control_apply_twice_and_revert_catch_a_broken_framework(
    selftest_patch: Patch, mutation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control of ``test_apply_twice_equals_once_and_revert_restores_identity``: the same
    checks fail on a revert that leaves one replaced attribute (the staticmethod) behind, and
    on an apply that does not know it already applied (the second apply saves the
    replacements as the originals, so revert puts the replacements back)."""
    before = _snapshot()
    between: Callable[[], None] = lambda: None  # noqa: E731
    if mutation == "revert_skips_the_staticmethod":
        restore = framework._restore

        def skip_static(saved: list) -> None:
            restore([entry for entry in saved if entry[1] != "_shard_divisor"])

        monkeypatch.setattr(framework, "_restore", skip_static)
        expected = ["revert: static"]
    else:

        def forget() -> None:
            selftest_patch.applied = False

        between = forget
        expected = [
            # the re-built overrides are new objects (the staticmethod and function lambdas)
            "second apply changed the patched objects",
            "revert: method",
            "revert: static",
            "revert: function",
            "revert: marker",
        ]
    try:
        assert _apply_twice_then_revert(selftest_patch, between) == expected
    finally:
        _put_back(before)
    assert _snapshot() == before


def test_native_only_where_the_record_says_so(monkeypatch):
    """The record's ``native`` verdict for this exact code skips the patch; the same record
    with one target's fingerprint changed refuses it, naming that object (the record decides
    before anything else)."""
    from nemo_lw_fp8.patches.record import UpstreamChanged

    patch = framework.register(make_patch())
    try:
        before = _snapshot()
        _record(monkeypatch, patch, "native")
        assert nemo_lw_fp8.apply([TEST_FEATURE]) == {TEST_FEATURE: "native"}
        assert framework.verdicts([TEST_FEATURE])[TEST_FEATURE].reason == "self-test record"
        assert _snapshot() == before
        changed = "megatron.core.optimizer.layer_wise_optimizer.is_managed_by_layer_wise_optimizer"
        _record(monkeypatch, patch, "native", **{changed: "0000000000000000"})
        with pytest.raises(UpstreamChanged, match=changed):
            nemo_lw_fp8.apply([TEST_FEATURE])
        assert _snapshot() == before
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
        warning = framework.UntestedUpstreamWarning
        with pytest.warns(warning, match=f"not megatron-core {installed}"):
            assert nemo_lw_fp8.apply([TEST_FEATURE]) == {TEST_FEATURE: "patched"}
    finally:
        framework.unregister(TEST_FEATURE)
    assert _snapshot() == before


def test_unknown_feature_is_refused():
    with pytest.raises(KeyError, match="unknown nemo_lw_fp8 feature"):
        nemo_lw_fp8.apply(["no_such_feature"])


def _apply_a_patch_that_fails_part_way() -> Patch:
    """Register a patch whose third override cannot be installed (a ``__slots__`` object takes
    no new attribute), apply it and expect that ``AttributeError``; the patch is returned."""

    class Frozen:
        __slots__ = ()

    def broken() -> list[Override]:
        return [*_build_overrides()[:2], Override(Frozen(), "anything", 1)]

    patch = framework.register(Patch(TEST_FEATURE, 0, "broken", broken))
    try:
        with pytest.raises(AttributeError, match="anything"):
            nemo_lw_fp8.apply([TEST_FEATURE])
    finally:
        framework.unregister(TEST_FEATURE)
    return patch


def test_failed_override_leaves_nothing_behind():
    before = _snapshot()
    patch = _apply_a_patch_that_fails_part_way()
    assert _snapshot() == before
    assert not patch.applied


def test_control_failed_override_without_the_restore_leaves_a_replacement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Control of ``test_failed_override_leaves_nothing_behind``: when the restore after a
    part-way failure is skipped, the same snapshot comparison shows the two overrides that
    were installed before the failure (the method and the staticmethod)."""
    before = _snapshot()
    try:
        with monkeypatch.context() as m:
            m.setattr(framework, "_restore", lambda saved: None)
            _apply_a_patch_that_fails_part_way()
        after = _snapshot()
    finally:
        _put_back(before)
    assert after != before
    assert {key for key in before if after[key] is not before[key]} == {"method", "static"}
    assert _snapshot() == before


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
