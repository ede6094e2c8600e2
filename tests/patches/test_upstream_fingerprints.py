"""Upgrades never switch a feature off silently: every object a patch wraps is the one it was
tested over (:mod:`nemo_lw_fp8.patches.fingerprints`), a megatron with a compact layout of its
own keeps the plugin's, and Bridge patches asked for before Bridge is imported apply when it is.

Each scenario runs in a fresh interpreter (it changes megatron's classes before ``apply()``);
the module's interpreters run side by side (:mod:`tests.support.side_by_side`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nemo_lw_fp8.patches import PATCH_MODULES
from nemo_lw_fp8.patches.upstream_fingerprints import FINGERPRINTS
from tests.support.side_by_side import run_side_by_side

ROOT = Path(__file__).resolve().parents[2]


def _pythonpath() -> str:
    """This checkout first, then whatever the caller put on the path (``make
    test-mcore-0.19.0`` puts another megatron-core there)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def _lines(done: subprocess.CompletedProcess) -> list[str]:
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()


def test_record_is_current_for_the_installed_stack(interpreters):
    """The record's entries for the installed megatron-core and Bridge are what those installs
    hold now, for every shipped patch (``python -m nemo_lw_fp8.patches.fingerprints --write``
    rewrites it)."""
    done = interpreters["record"]
    assert done.returncode == 0, done.stderr[-3000:]
    path = ROOT / "nemo_lw_fp8" / "patches" / "upstream_fingerprints.py"
    assert done.stdout == path.read_text(), "stale record: run the command above"
    recorded = {patch for patches in FINGERPRINTS.values() for patch in patches}
    assert recorded == set(PATCH_MODULES)


UPGRADE = """
    import nemo_lw_fp8
    from megatron.core.distributed import param_and_grad_buffer as pg
    from nemo_lw_fp8.patches import UpstreamChanged

    # Control first: the released method is patched (then reverted).
    print(nemo_lw_fp8.apply(["compact_layout"])["compact_layout"])
    nemo_lw_fp8.revert()
    upstream = pg._ParamAndGradBucketGroup.__dict__["start_grad_sync"]
    def start_grad_sync(self, force_all_reduce=False):  # an upstream fix, same version number
        return upstream(self, force_all_reduce)
    pg._ParamAndGradBucketGroup.start_grad_sync = start_grad_sync
    try:
        print(nemo_lw_fp8.apply(["compact_layout"])["compact_layout"])
    except UpstreamChanged as error:
        print("refused:", error)
    print(pg._ParamAndGradBucketGroup.start_grad_sync is start_grad_sync)
"""


def test_a_changed_upstream_method_is_refused(interpreters):
    """megatron's ``_ParamAndGradBucketGroup.start_grad_sync`` replaced by another function
    before ``apply()`` (what a patched container or a source install can hold at the same
    version): the compact layout, which wraps it for the owner reduce, refuses with one line
    naming the method and the way out, and leaves it alone. Control: the released method is
    patched."""
    control, line, untouched = _lines(interpreters["upgrade"])[-3:]
    assert control == "patched"
    assert line.startswith("refused: nemo_lw_fp8 patch 'compact_layout' wraps "), line
    assert "_ParamAndGradBucketGroup.start_grad_sync" in line
    from nemo_lw_fp8.patches.framework import megatron_core_version

    installed = f"megatron-core=={megatron_core_version()}"
    assert installed in line and "NEMO_LW_FP8_ALLOW_UNTESTED_MEGATRON=1" in line
    assert untouched == "True"


COMPACT_UPSTREAM = """
    import dataclasses
    import nemo_lw_fp8
    from megatron.core.distributed.distributed_data_parallel_config import (
        DistributedDataParallelConfig as Config,
    )
    from megatron.core.distributed import param_and_grad_buffer as pg
    from nemo_lw_fp8.patches.upstream import megatron_core_changes

    fields = dict(Config.__dataclass_fields__)
    fields["use_layer_wise_param_layout"] = dataclasses.field(default=False)
    Config.__dataclass_fields__ = fields  # upstream's own compact layout setting (#5388 / #5479)
    status = nemo_lw_fp8.apply(["compact_layout"])["compact_layout"]
    wrapped = pg._ParamAndGradBucketGroup.start_grad_sync.__module__
    print(megatron_core_changes()[5388][1]()[0], status, wrapped)
"""


def test_upstream_compact_setting_keeps_the_plugin_layout(interpreters):
    """A megatron whose DDP config gains ``use_layer_wise_param_layout`` (upstream's compact
    layout) is detected as having it, and the plugin's compact layout (the owner reduce wraps
    ``start_grad_sync``) still applies instead of stepping aside."""
    line = _lines(interpreters["compact upstream"])[-1]
    assert line == "True patched nemo_lw_fp8.patches.compact_layout", line


BRIDGE_LATER = """
    import sys
    import nemo_lw_fp8
    from nemo_lw_fp8.cpu.te import backend as te_backend

    te_backend.activate()
    status = nemo_lw_fp8.apply()
    assert "megatron.bridge.training.config" not in sys.modules
    bridge = sorted(name for name in status if name.startswith("bridge_"))
    before = {status[name] for name in bridge}
    import megatron.bridge.training.pretrain  # noqa: F401
    from megatron.bridge.training import checkpointing, config
    from nemo_lw_fp8.patches import applied

    after = {name in applied() for name in bridge}
    print(len(bridge), before, after, config.ConfigContainer.validate.__module__,
          checkpointing._build_sharded_state_dict_metadata.__module__.split(".")[-1])
"""


def test_bridge_patches_asked_for_before_bridge_is_imported_apply_on_import(interpreters):
    """``apply()`` before Megatron-Bridge is imported reports its patches ``pending`` (not
    "native") and they are in place once Bridge is imported."""
    line = _lines(interpreters["bridge later"])[-1]
    assert line == (
        "6 {'pending'} {True} nemo_lw_fp8.patches.bridge_config_guards bridge_checkpoint_sharding"
    ), line


@pytest.fixture(scope="module")
def interpreters(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every scenario of this module, each in its own fresh interpreter, run side by side:
    the record's command, then each script above with ``NEMO_LW_FP8_ALLOW_UNTESTED_MEGATRON``
    removed (the refusal must not be waived)."""
    env = dict(os.environ, PYTHONPATH=_pythonpath())
    strict = {key: value for key, value in env.items()
              if key != "NEMO_LW_FP8_ALLOW_UNTESTED_MEGATRON"}  # fmt: skip
    scripts = {"upgrade": UPGRADE, "compact upstream": COMPACT_UPSTREAM,
               "bridge later": BRIDGE_LATER}  # fmt: skip
    commands = {"record": [sys.executable, "-m", "nemo_lw_fp8.patches.fingerprints"]}
    commands |= {name: [sys.executable, "-c", textwrap.dedent(code)]
                 for name, code in scripts.items()}  # fmt: skip
    return run_side_by_side(commands, tmp_path_factory.mktemp("fingerprints"), env=strict,
                            cwd=ROOT, envs={"record": env})  # fmt: skip
