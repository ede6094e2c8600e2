"""Detectors of what upstream landed (by the symbols megatron defines), checked on both answers,
and the doctor report. Whether a patch applies is not a detector's answer but the record's
verdict (tests/patches/test_upgrade_safety_net.py)."""

from __future__ import annotations

import dataclasses
import json
import re

from nemo_lw_fp8.cli import doctor
from nemo_lw_fp8.patches.upstream import megatron_core_changes

#: The tracked changes with a detector (a change without a patch, or the upstream part of one
#: the plugin extends) and its answer on 0.19.2; #4987 has none (the patch is the whole change).
NATIVE_IN_0_19_2 = {3524: True, 4994: True, 5464: True, 5388: False}
TRACKED = (3524, 4987, 4994, 5388, 5464)


def detect(pr: int) -> tuple[bool, str]:
    detector = megatron_core_changes()[pr][1]
    assert detector is not None, f"#{pr} has no upstream detector"
    return detector()


def test_every_tracked_change_with_a_detector_is_checked():
    with_detector = {pr for pr, (_, det, _) in megatron_core_changes().items() if det is not None}
    assert with_detector == set(NATIVE_IN_0_19_2)
    assert set(megatron_core_changes()) == set(TRACKED)


def test_detectors_on_megatron_core_0_19_2():
    for pr, expected in NATIVE_IN_0_19_2.items():
        native, reason = detect(pr)
        assert native is expected, f"#{pr}: {reason}"
        assert reason


def test_detectors_flip_when_the_symbols_change(monkeypatch):
    from megatron.core import fp8_utils
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.distributed.distributed_data_parallel_config import (
        DistributedDataParallelConfig,
    )
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    monkeypatch.delattr(param_and_grad_buffer, "_LayerwiseAllGatherHandle")
    monkeypatch.delattr(DistributedOptimizer, "prepare_model_params_for_param_sync")
    monkeypatch.delattr(fp8_utils, "is_grouped_mxfp8tensor")

    fields = dict(DistributedDataParallelConfig.__dataclass_fields__)
    fields["use_layer_wise_param_layout"] = dataclasses.field(default=True)
    monkeypatch.setattr(DistributedDataParallelConfig, "__dataclass_fields__", fields)

    for pr, expected in NATIVE_IN_0_19_2.items():
        native, reason = detect(pr)
        assert native is (not expected), f"#{pr} did not flip: {reason}"


def test_doctor_reports_upstream_status():
    report = doctor.collect()
    statuses = {row["pr"]: row["status"] for row in report["upstream"]}
    # Not applied in this process: what megatron has, and what the plugin can bring.
    assert statuses == {
        3524: "native",
        4987: "patchable",
        4994: "native (extendable)",
        5464: "native (extendable)",
        5388: "patchable",
    }
    assert report["versions"]["megatron-core"] == "0.19.2"
    assert report["accelerator"]["kind"] in ("cpu", "cuda")


def test_doctor_after_apply_reports_patched_and_extended():
    import nemo_lw_fp8

    nemo_lw_fp8.apply()
    try:
        statuses = {row.pr: row.status for row in doctor.upstream_status()}
        assert statuses[4987] == "patched"
        assert statuses[4994] == "native (extended)"
        assert statuses[5388] == "patched"
        assert statuses[5464] == "native (extended)"
        # Our own overrides never make a detector claim that upstream has the change.
        assert detect(5388)[0] is False
    finally:
        nemo_lw_fp8.revert()
    assert {row.pr: row.status for row in doctor.upstream_status()}[4987] == "patchable"


def test_doctor_cli_json_and_table():
    """The command (its own process: it imports Bridge over the CPU emulation of TE) lists
    every tracked change and every patch, Bridge's with their verdicts, not ``pending``."""
    import subprocess
    import sys

    from nemo_lw_fp8.patches import PATCH_MODULES

    command = [sys.executable, "-m", "nemo_lw_fp8.cli", "doctor"]
    done = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout)
    assert {row["pr"] for row in parsed["upstream"]} == set(TRACKED)
    assert [row["patch"] for row in parsed["patches"]] == list(PATCH_MODULES)
    assert {row["status"] for row in parsed["patches"]} == {"patched"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for pr in TRACKED:
        assert f"#{pr}" in done.stdout
    for patch in PATCH_MODULES:
        assert f"  {patch} " in done.stdout
    assert "fp8 backend" in done.stdout


def test_doctor_as_a_library_leaves_the_process_as_it_was():
    """``doctor.collect()`` in a caller's process (this one) imports no Bridge and activates
    no CPU emulation of TE: Bridge's patches read ``pending``, and ``sys.path`` and the TE
    backend are unchanged (the suite's rank pools are spawned with this process's path)."""
    import sys

    from nemo_lw_fp8.cpu.te import backend as te_backend

    path, backend = list(sys.path), te_backend.active_backend()
    report = doctor.collect()
    assert list(sys.path) == path and te_backend.active_backend() == backend
    bridge = [row for row in report["patches"] if row["target"] == "megatron-bridge"]
    assert bridge and all(row["status"] == "pending" for row in bridge), bridge
    assert all(row["reason"] == doctor.BRIDGE_NOT_ASKED for row in bridge)


def test_detectors_read_the_same_answer_from_source():
    """Every detector answers the same from megatron's source text (what a fresh ``doctor``
    process reads) as from the imported modules."""
    import importlib

    from nemo_lw_fp8.patches import symbols

    for name in (
        "megatron.core.distributed.param_and_grad_buffer",
        "megatron.core.distributed.distributed_data_parallel",
        "megatron.core.distributed.distributed_data_parallel_config",
        "megatron.core.optimizer.distrib_optimizer",
        "megatron.core.optimizer.layer_wise_optimizer",
        "megatron.core.optimizer.emerging_optimizers",
        "megatron.core.fp8_utils",
        "megatron.training.training",
    ):
        importlib.import_module(name)
    for pr, (_, detector, _) in megatron_core_changes().items():
        if detector is None:
            continue
        live = detector()
        with symbols.from_source():
            assert detector() == live, f"#{pr}"


def test_doctor_prints_only_its_own_output():
    """A fresh ``nemo-lw-fp8 doctor``: nothing on stderr, no third-party warning text in the
    report, what it held back summarised in one line (in full with --verbose)."""
    import subprocess
    import sys

    probe = "from nemo_lw_fp8 import cli; cli.main(['doctor', '--json'])"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    hidden = json.loads(done.stdout)["hidden_warnings"]

    command = [sys.executable, "-m", "nemo_lw_fp8.cli", "doctor"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    summary = [line for line in lines if "third-party warnings hidden" in line]
    assert len(summary) == (1 if hidden else 0), done.stdout
    report = "\n".join(line for line in lines if line not in summary)
    for noise in ("Warning", "warnings.warn", "Apex", "Triton", "0.0.0", "torch.jit", "W11"):
        assert noise not in report, noise
    verbose = subprocess.run([*command, "--verbose"], capture_output=True, text=True, timeout=300)
    assert verbose.returncode == 0 and verbose.stderr == ""
    # torch's glog lines carry a time stamp and a process id: compare what follows them.
    stamp = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ ", re.M)
    shown = stamp.sub("", verbose.stdout)
    for message in hidden:
        assert stamp.sub("", message) in shown, message
