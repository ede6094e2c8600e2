"""Installing the plugin (docs/install.md): the declared ranges, the recorded tested environment
the Makefile installs from, doctor's drift report, and what ``pip install`` changes in an
environment that already holds megatron-core and torch."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from nemo_lw_fp8.cli import doctor, tested_env

ROOT = Path(__file__).resolve().parents[2]


def _dependencies() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {tested_env.normalize(r.name): r for r in map(Requirement, project["dependencies"])}


def _makefile_var(name: str) -> str:
    match = re.search(rf"^{name}\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert match, f"Makefile has no {name}"
    return match.group(1)


def test_recorded_versions_fall_in_the_declared_ranges():
    pins = tested_env.pinned()
    deps = _dependencies()
    for name in ("megatron-core", "torch", "emerging-optimizers", "numpy"):
        assert deps[name].specifier.contains(pins[name]), (name, str(deps[name]), pins[name])
    # The ranges the issue asks for: both megatron-core releases, and more than one torch.
    assert deps["megatron-core"].specifier.contains("0.19.0")
    assert deps["megatron-core"].specifier.contains("0.19.2")
    assert not deps["megatron-core"].specifier.contains("0.18.0")
    assert deps["torch"].specifier.contains("2.15.0")
    assert not deps["torch"].specifier.contains("2.13.0")


def test_makefile_installs_the_recorded_versions():
    pins = tested_env.pinned()
    for var, package in (
        ("BRIDGE_VERSION", "megatron-bridge"),
        ("NEMO_RUN_VERSION", "nemo-run"),
        ("TE_VERSION", "transformer-engine"),
    ):
        assert _makefile_var(var) == pins[package], var
    assert ROOT / _makefile_var("CONSTRAINTS") == tested_env.CONSTRAINTS
    makefile = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    installs = [
        line for line in makefile.splitlines() if "pip install" in line and line.startswith("\t")
    ]
    assert installs
    for line in installs:
        for command in line.split("&&"):
            if "pip install" not in command or "--upgrade pip" in command:
                continue
            if "$(MCORE_0190_DIR)" in command:
                # A release outside the record (it pins 0.19.2): exact, and off the venv.
                assert "--target $(MCORE_0190_DIR) megatron-core==0.19.0" in command, command
                continue
            if "$(NEXT_RELEASE_DIR)" in command:
                # The next release's wheels, checked against their SHA256SUMS: off the venv,
                # without dependencies (nothing else moves).
                assert "--no-deps --target $(NEXT_RELEASE_DIR) $$wheels" in command, command
                continue
            assert "-c $(CONSTRAINTS)" in command, command


def test_this_environment_has_no_drift():
    """The environment the suite runs in is the recorded one (``make`` builds it so; a change
    of either shows here first)."""
    assert tested_env.drift() == []


def test_drift_names_other_versions_and_missing_core_packages():
    pins = {"torch": "2.14.1", "megatron-core": "0.19.2", "rich": "14.0.0", "six": "1.17.0"}
    installed = {"torch": "2.15.0", "rich": "14.0.0"}
    rows = tested_env.drift(pins, installed)
    assert rows == [
        tested_env.Drift("megatron-core", "0.19.2", None),  # core: missing is drift
        tested_env.Drift("torch", "2.14.1", "2.15.0"),
    ]  # six: not core, absent is no drift


def test_record_round_trips_and_leaves_out_tooling():
    text = tested_env.record({"nemo-run": "0.11.1", "pip": "26.3", "nemo-lw-fp8": "0.1.0"})
    assert tested_env.parse(text) == {"nemo-run": "0.11.1"}
    assert tested_env.parse("nemo_run==0.11.1  # x\n# c\n\nTorch==2.14.1\n") == {
        "nemo-run": "0.11.1",
        "torch": "2.14.1",
    }


def test_doctor_names_the_drift(tmp_path, monkeypatch, capsys):
    from nemo_lw_fp8 import cli

    recorded = tested_env.pinned()
    recorded["torch"] = "2.0.0"
    path = tmp_path / "tested-constraints.txt"
    path.write_text("".join(f"{k}=={v}\n" for k, v in recorded.items()))
    monkeypatch.setattr(tested_env, "CONSTRAINTS", path)
    report = doctor.collect()
    assert report["drift"] == [
        {"package": "torch", "tested": "2.0.0", "installed": report["versions"]["torch"]}
    ]
    assert cli.main(["doctor"]) == 0
    table = capsys.readouterr().out
    assert "1 package(s) differ" in table
    installed = re.escape(report["versions"]["torch"])
    assert re.search(rf"torch\s+tested 2\.0\.0\s+installed {installed}", table)


def test_doctor_names_nvfp4_support():
    """``doctor`` says what NVFP4 can do here: TE's kernels only on SM 10.0+, otherwise the CPU
    emulation's share, with the refusals and layer-wise Muon's standing."""
    from nemo_lw_fp8.cpu.te.tex import cast_nvfp4 as te_extension_nvfp4

    assert doctor.nvfp4_support({"kind": "cuda", "compute_capability": "10.0"})["gpu_kernels"]
    assert not doctor.nvfp4_support({"kind": "cuda", "compute_capability": "9.0"})["gpu_kernels"]
    report = doctor.collect()
    assert report["nvfp4"]["gpu_kernels"] is False  # no GPU on the test machines
    table = doctor.render(report)
    assert "TE's GPU kernels here: no (needs SM 10.0+)" in table
    for item in te_extension_nvfp4.EMULATED + te_extension_nvfp4.REFUSED:
        assert item in table
    assert "grouped-weight-nvfp4-layer-wise" in table
    assert "fp4-primary-weights-layer-wise" in table


# --- pip install into an environment that already satisfies the requirements -----------------

# An environment as a container has it: the packages' metadata (what pip's resolver reads), each
# with the requirements the real release declares, so the environment is consistent.
_HELD = {
    "torch": ("2.15.0", []),
    "numpy": ("2.3.5", []),
    "packaging": ("25.0", []),
    "absl-py": ("2.3.1", []),
    "emerging-optimizers": ("0.3.0", ["torch", "absl-py"]),
}


def _environment(where: Path, held: dict[str, tuple[str, list[str]]]) -> Path:
    venv.EnvBuilder(with_pip=False).create(where)
    site = next(where.glob("lib/python3*/site-packages"))
    for name, (ver, requires) in held.items():
        info = site / f"{name.replace('-', '_')}-{ver}.dist-info"
        info.mkdir()
        lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {ver}"]
        lines += [f"Requires-Dist: {r}" for r in requires]
        (info / "METADATA").write_text("\n".join(lines) + "\n")
        (info / "INSTALLER").write_text("pip\n")
        (info / "RECORD").write_text("")
    return where / "bin" / "python"


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory) -> Path:
    """This checkout built as a wheel (offline, with this environment's setuptools), from a copy
    so the build leaves nothing in the work tree."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "nemo_lw_fp8", source / "nemo_lw_fp8",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--wheel-dir", str(out), str(source)],
        check=True, capture_output=True, text=True, env=_pip_env(),
    )  # fmt: skip
    return out


def _pip_env() -> dict[str, str]:
    # No pip configuration (this machine's global pip.conf caps torch, an installer's may not),
    # no extra wheel folders, and no PYTHONPATH that could show the checkout as installed.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    return {**env, "PIP_CONFIG_FILE": os.devnull}


def _dry_run(python: Path, wheels: Path, report: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run",
         "--no-index", "--find-links", str(wheels), "--report", str(report), "nemo-lw-fp8"],
        capture_output=True, text=True, env=_pip_env(),
    )  # fmt: skip


@pytest.mark.parametrize("megatron_core", ["0.19.0", "0.19.2"])
def test_pip_install_changes_neither_megatron_core_nor_torch(tmp_path, wheel_dir, megatron_core):
    held = {**_HELD, "megatron-core": (megatron_core, ["torch>=2.6.0", "numpy", "packaging"])}
    python = _environment(tmp_path / "env", held)
    result = _dry_run(python, wheel_dir, tmp_path / "report.json")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    would_install = {tested_env.normalize(item["metadata"]["name"]) for item in report["install"]}
    assert would_install == {"nemo-lw-fp8"}


@pytest.mark.parametrize(
    "package, held_version", [("megatron-core", "0.18.0"), ("torch", "2.13.0")]
)
def test_pip_install_refuses_releases_outside_the_ranges(
    tmp_path, wheel_dir, package, held_version
):
    """The same dry run fails when the environment holds an untested release (no index to
    replace it from), so the test above can tell."""
    held = {**_HELD, "megatron-core": ("0.19.2", ["torch>=2.6.0", "numpy", "packaging"])}
    held[package] = (held_version, held[package][1])
    python = _environment(tmp_path / "env", held)
    result = _dry_run(python, wheel_dir, tmp_path / "report.json")
    assert result.returncode != 0
    assert package in result.stderr
