"""Upgrades that cannot fool the plugin (issue 43): each simulated change of what a patch wraps
is refused, naming the changed object, and ``doctor`` shows the verdict ``apply()`` acts on.

Each scenario runs in a fresh interpreter (it changes megatron's or Bridge's code before
``apply()``), side by side (:mod:`tests.support.side_by_side`), with the override variable
removed. Every scenario prints, per patch, ``doctor``'s status and what ``apply([patch])`` did,
so the test compares the two for all 16 patches, not only the changed one. The scenario without
a change is the control: every patch is ``patched`` there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from nemo_lw_fp8.patches import PATCH_MODULES
from tests.support.side_by_side import run_side_by_side

ROOT = Path(__file__).resolve().parents[2]
ALLOW = "NEMO_LW_FP8_ALLOW_UNTESTED_MEGATRON"

#: Prints ``{patch: [doctor's status, doctor's changed objects, apply's outcome]}``.
REPORT = """
    import json
    import nemo_lw_fp8
    from nemo_lw_fp8.cli import doctor
    from nemo_lw_fp8.patches import UntestedMegatronVersion, UpstreamChanged, PATCH_MODULES

    shown = {row["patch"]: row for row in doctor.patch_verdicts(import_bridge=True)}
    outcome = {}
    for name in PATCH_MODULES:
        try:
            outcome[name] = nemo_lw_fp8.apply([name])[name]
        except (UpstreamChanged, UntestedMegatronVersion) as error:
            outcome[name] = "refused: " + str(error)
        nemo_lw_fp8.revert()
    print(json.dumps({n: [shown[n]["status"], shown[n]["changed"], outcome[n]] for n in outcome}))
"""

BRIDGE = """
    from nemo_lw_fp8.cpu.te import backend as te_backend

    te_backend.activate()
    import megatron.bridge.training.config  # Bridge in use: its patches decide now
"""

WRAPS_HOTFIX = """
    import functools
    from megatron.core.distributed import param_and_grad_buffer as pg

    upstream = pg._ParamAndGradBucketGroup.__dict__["start_grad_sync"]

    @functools.wraps(upstream)  # a container's hotfix: every grad sync an all-reduce
    def start_grad_sync(self, force_all_reduce=False):
        return upstream(self, True)

    pg._ParamAndGradBucketGroup.start_grad_sync = start_grad_sync
"""

COMMENT_ONLY = """
    import inspect
    import tempfile
    import textwrap
    from megatron.core.optimizer import layer_wise_optimizer as lw

    cls = lw.LayerWiseDistributedOptimizer
    text = textwrap.dedent(inspect.getsource(cls.__dict__["load_state_dict"]))
    head, _, body = text.partition(":\\n")
    # The same code, one comment more: words the old detector looked for.
    comment = "    # param_sync / _copy_main_params_to_model_params: see the caller\\n"
    text = head + ":\\n" + comment + body
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as handle:
        handle.write(text)
    namespace = dict(vars(lw))
    exec(compile(text, handle.name, "exec"), namespace)
    cls.load_state_dict = namespace["load_state_dict"]
"""

PREDICATE_RENAMED = """
    from megatron.core.optimizer import emerging_optimizers as eo
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate

    for entry in eo._EMERGING_OPTIMIZERS.values():
        renamed = {}
        for key, value in entry.default_param_overrides.items():
            predicate = getattr(key, "predicate", None)
            if getattr(predicate, "name", None) == "nonlinear_or_embedding":
                fields = {f: getattr(key, f) for f in key.__dataclass_fields__}
                fields["predicate"] = ParamPredicate(name="muon_excluded", fn=predicate.fn)
                key = ParamKey(**fields)
            renamed[key] = value
        entry.default_param_overrides = renamed
"""

BRIDGE_FUNCTION_REPLACED = BRIDGE + """
    from megatron.bridge.models import model_provider

    upstream = model_provider._ddp_wrap

    def _ddp_wrap(*args, **kwargs):  # a Bridge fix installed over the release
        return upstream(*args, **kwargs)

    model_provider._ddp_wrap = _ddp_wrap
"""

BRIDGE_OTHER_VERSION = """
    import importlib.metadata as metadata

    released = metadata.version
    metadata.version = lambda name: "0.6.3" if name == "megatron-bridge" else released(name)
""" + BRIDGE

SCENARIOS = {
    "control": BRIDGE,
    "wraps hotfix": BRIDGE + WRAPS_HOTFIX,
    "comment only": BRIDGE + COMMENT_ONLY,
    "predicate renamed": BRIDGE + PREDICATE_RENAMED,
    "bridge function replaced": BRIDGE_FUNCTION_REPLACED,
    "bridge other version": BRIDGE_OTHER_VERSION,
}

#: scenario -> {refused patch: the object its refusal names (None: the version)}
EXPECTED = {
    "control": {},
    "wraps hotfix": {
        "compact_layout": "param_and_grad_buffer._ParamAndGradBucketGroup.start_grad_sync"
    },
    "comment only": {
        "layer_wise_load_rederive": "LayerWiseDistributedOptimizer.load_state_dict"
    },
    "predicate renamed": {"grouped_weight_layerwise": "default_param_overrides"},
    "bridge function replaced": {
        "bridge_layer_wise_wrap": "megatron.bridge.models.model_provider._ddp_wrap"
    },
    "bridge other version": {
        name: None for name in PATCH_MODULES if name.startswith("bridge_")
    },
}


def with_dependents(refused: dict[str, str | None]) -> dict[str, str | None]:
    """``refused`` plus every patch that requires one of them (``apply()`` installs what a patch
    requires first, so the refusal stops it too, and its verdict says so)."""
    from nemo_lw_fp8 import patches
    from nemo_lw_fp8.patches.registry import required_by

    patches.load_all()
    found = dict(refused)
    for name in patches.registry():
        needed = [required for required in required_by(name) if required in refused]
        if needed and name not in found:
            found[name] = refused[needed[0]]
    return found


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict[str, list]]:
    env = {key: value for key, value in os.environ.items() if key != ALLOW}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    commands = {
        name: [sys.executable, "-c", textwrap.dedent(code) + textwrap.dedent(REPORT)]
        for name, code in SCENARIOS.items()
    }
    done = run_side_by_side(commands, tmp_path_factory.mktemp("safety"), env=env, cwd=ROOT)
    parsed = {}
    for name, result in done.items():
        assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
        parsed[name] = json.loads(result.stdout.strip().splitlines()[-1])
    return parsed


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_changed_object_is_refused_by_name_and_doctor_says_what_apply_does(reports, scenario):
    """The changed patch is refused, naming the object (or the version); every other patch is
    patched; ``doctor``'s status equals ``apply()``'s outcome for all 16."""
    report = reports[scenario]
    assert set(report) == set(PATCH_MODULES)
    refused = with_dependents(EXPECTED[scenario])
    for patch, (shown, changed, outcome) in report.items():
        applied = "refused" if outcome.startswith("refused: ") else outcome
        assert shown == applied, f"{scenario}: {patch}: doctor {shown}, apply {outcome}"
        if patch not in refused:
            assert outcome == "patched", f"{scenario}: {patch}: {outcome}"
            continue
        assert outcome.startswith("refused: "), f"{scenario}: {patch} not refused: {outcome}"
        named = refused[patch]
        if named is None:
            assert "not the installed 0.6.3" in outcome and ALLOW in outcome, outcome
        else:
            assert named in outcome and any(named in item for item in changed), outcome
            assert "\n" not in outcome


def test_the_override_names_each_changed_object_in_a_warning_it_shows():
    """With the override, a refused patch applies, and the changed object is named in an
    :class:`UntestedUpstreamWarning`, which the CLI's noise filter never holds back."""
    script = "import nemo_lw_fp8\n" + textwrap.dedent(WRAPS_HOTFIX) + textwrap.dedent("""
        import warnings
        import nemo_lw_fp8
        from nemo_lw_fp8.cli.quiet import held_back

        with held_back() as held:
            status = nemo_lw_fp8.apply(["compact_layout"])["compact_layout"]
        print(status, sum("start_grad_sync" in message for message in held.messages))
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{ALLOW: "1"})
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["patched", "0"], done.stdout
    shown = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    assert any("_ParamAndGradBucketGroup.start_grad_sync" in line for line in shown), shown


def test_held_back_lets_the_plugins_own_warnings_through(capfd):
    """Control of the noise filter: a third-party warning is held, the plugin's is shown."""
    from nemo_lw_fp8.cli.quiet import held_back
    from nemo_lw_fp8.patches.framework import UntestedUpstreamWarning

    with held_back() as held:
        warnings.warn("third-party noise", UserWarning, stacklevel=1)
        warnings.warn("the plugin's own", UntestedUpstreamWarning, stacklevel=1)
    err = capfd.readouterr().err
    assert "warning: the plugin's own" in err and "third-party noise" not in err
    assert len(held.messages) == 1 and "third-party noise" in held.messages[0]


def test_a_stand_in_counts_as_upstream_only_through_the_test_door():
    """A call counter over megatron's method has another fingerprint (refused like any
    wrapper) unless a test declares it with ``record.counted_as``."""
    from megatron.core.distributed import param_and_grad_buffer as pg

    from nemo_lw_fp8.patches import record

    upstream = pg._ParamAndGradBucketGroup.__dict__["start_grad_sync"]

    def counter(self, *args, **kwargs):
        return upstream(self, *args, **kwargs)

    counter.__wrapped__ = upstream  # what used to make the check read through
    released = record.fingerprint(upstream, None)
    assert record.fingerprint(counter, None) != released
    with record.counted_as(counter, upstream):
        assert record.fingerprint(counter, None) == released
    assert record.fingerprint(counter, None) != released


#: The hotfix above, applied the moment megatron's module has executed (as a container's edited
#: file would be), so the CLI's own import order stays as it is.
HOTFIX_ON_IMPORT = """
import functools
import importlib.abc
import sys

_TARGET = "megatron.core.distributed.param_and_grad_buffer"


def _hotfix(module):
    upstream = module._ParamAndGradBucketGroup.__dict__["start_grad_sync"]

    @functools.wraps(upstream)
    def start_grad_sync(self, force_all_reduce=False):
        return upstream(self, True)

    module._ParamAndGradBucketGroup.start_grad_sync = start_grad_sync


class _Loader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _hotfix(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


sys.meta_path.insert(0, _Finder())
"""


def test_cli_refusal_is_one_line_and_exit_2_on_every_rank(tmp_path):
    """``torchrun ... nemo_lw_fp8.cli pretrain`` in a container whose megatron carries a hotfix
    (installed by a ``sitecustomize`` on every rank): each rank ends with one line naming the
    object and exit status 2, no traceback."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HOTFIX_ON_IMPORT)
    env = {key: value for key, value in os.environ.items() if key != ALLOW}
    env["PYTHONPATH"] = os.pathsep.join((str(site), str(ROOT)))
    logs = tmp_path / "logs"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--log-dir", str(logs), "--redirects", "3",
        "-m", "nemo_lw_fp8.cli", "pretrain", "--recipe", "tiny_deepseek_v3", "--cpu", "--dry-run",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=900)  # fmt: skip
    assert done.returncode != 0
    errors = sorted(logs.rglob("stderr.log"))
    assert len(errors) == 2, done.stderr[-3000:]
    for path in errors:
        text = path.read_text()
        lines = [line for line in text.splitlines() if "nemo-lw-fp8 pretrain: error:" in line]
        assert len(lines) == 1 and "start_grad_sync" in lines[0], text[-3000:]
        assert "Traceback" not in text, text[-3000:]
    assert done.stderr.count("exitcode  : 2") + done.stderr.count("exitcode: 2") >= 1, (
        done.stderr[-3000:]
    )
