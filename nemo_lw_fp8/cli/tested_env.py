"""The tested environment: exact versions ``make`` installs, and how far this one drifts from it.

Why a recorded set: pyproject.toml states ranges (what the plugin accepts, so ``pip install``
into a container that already holds megatron-core and torch changes neither), but a range lets
two fresh machines resolve to different releases of torch or of Bridge's hundred-odd imports.
``tested-constraints.txt`` (next to this module, so it ships with the package) pins every
package of the environment the suite last passed in; the Makefile passes it to each
``pip install`` as ``-c``. ``nemo-lw-fp8 doctor`` lists each installed package whose version
differs from it, so a failure on another machine starts from the difference, not a guess.

Regenerate it from a passing environment with ``python -m nemo_lw_fp8.cli.tested_env --write``
(the same set ``pip freeze --exclude-editable`` prints, plus Transformer Engine's Python package
in ``<venv>/te-emulation``, which ``pip freeze`` cannot see).
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import sys
from dataclasses import dataclass
from pathlib import Path

#: Shipped at the package root (pyproject.toml package-data); the Makefile installs with it.
CONSTRAINTS = Path(__file__).parent.parent / "tested-constraints.txt"
"""The recorded versions (package data; the Makefile installs with ``-c`` this file)."""

#: Packages whose absence doctor names too: the plugin's own dependencies and the optional
#: integrations it is tested with. Any other pinned package is reported only if installed at
#: another version (a container without Bridge is not drift, a different numpy is).
CORE = (
    "torch",
    "megatron-core",
    "emerging-optimizers",
    "numpy",
    "transformer-engine",
    "megatron-bridge",
    "nemo-run",
)

#: Installer tooling that pip freeze leaves out too: its version says nothing about the tests.
_TOOLING = {"pip", "setuptools", "wheel", "nemo-lw-fp8"}

_LINE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)")


def normalize(name: str) -> str:
    """PEP 503 name: pip freeze writes ``nemo_run``, metadata may say ``nemo-run``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse(text: str) -> dict[str, str]:
    """``name==version`` lines of a constraints file (comments and blank lines skipped)."""
    pins = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if match:
            pins[normalize(match.group(1))] = match.group(2)
    return pins


def pinned(path: Path | None = None) -> dict[str, str]:
    """The recorded versions, by normalized name (default: :data:`CONSTRAINTS`, looked up at
    call time)."""
    return parse((CONSTRAINTS if path is None else path).read_text())


def _side_path_versions() -> dict[str, str]:
    """Transformer Engine's Python package where the MXFP8 emulation finds it (off the import
    path, so ordinary metadata lookups miss it)."""
    from nemo_lw_fp8.cpu.te.backend import te_side_paths

    found: dict[str, str] = {}
    for dist in metadata.distributions(path=te_side_paths()):
        found.setdefault(normalize(dist.metadata["Name"]), dist.version)
    return found


def installed_versions() -> dict[str, str]:
    """Every installed distribution by normalized name (site-packages first, then TE's side
    folder for packages site-packages lacks)."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(normalize(name), dist.version)
    for name, ver in _side_path_versions().items():
        found.setdefault(name, ver)
    return found


@dataclass(frozen=True)
class Drift:
    """One package whose installed version is not the tested one (``installed`` None: absent)."""

    package: str
    tested: str
    installed: str | None


def drift(
    pins: dict[str, str] | None = None, installed: dict[str, str] | None = None
) -> list[Drift]:
    """Packages that differ from the recorded environment: every pinned package installed at
    another version, and the :data:`CORE` ones that are missing."""
    pins = pinned() if pins is None else pins
    installed = installed_versions() if installed is None else installed
    rows = []
    for name, tested in sorted(pins.items()):
        have = installed.get(name)
        if have == tested or (have is None and name not in CORE):
            continue
        rows.append(Drift(name, tested, have))
    return rows


def record(installed: dict[str, str] | None = None) -> str:
    """The constraints file's text for this environment."""
    installed = installed_versions() if installed is None else installed
    header = (
        "# The environment the test suite passed in, exact versions "
        "(nemo_lw_fp8/cli/tested_env.py).\n"
        "# The Makefile installs with `-c` this file; `nemo-lw-fp8 doctor` names drift from it.\n"
        "# Regenerate from a passing .venv: "
        ".venv/bin/python -m nemo_lw_fp8.cli.tested_env --write\n"
    )
    body = "".join(
        f"{name}=={ver}\n" for name, ver in sorted(installed.items()) if name not in _TOOLING
    )
    return header + body


def main(argv: list[str] | None = None) -> int:
    """``--write``: record this environment; otherwise print the drift, exit 1 if any."""
    parser = argparse.ArgumentParser(prog="python -m nemo_lw_fp8.cli.tested_env")
    parser.add_argument("--write", action="store_true", help=f"rewrite {CONSTRAINTS.name}")
    args = parser.parse_args(argv)
    if args.write:
        CONSTRAINTS.write_text(record())
        print(f"wrote {CONSTRAINTS}")
        return 0
    rows = drift()
    for row in rows:
        print(f"{row.package}: tested {row.tested}, installed {row.installed or 'none'}")
    return 1 if rows else 0


if __name__ == "__main__":
    sys.exit(main())
