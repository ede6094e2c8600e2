"""Fingerprints of the upstream objects the patches wrap, per tested version.

A version number says which release is installed, not what its code does: a source install, a
container's cherry-picked fix or an upgrade that keeps the number can change a method a patch
wraps. Each patch therefore also checks, before it installs anything, that every object it
replaces is the one it was tested over: a hash of that object's source text, recorded per
tested megatron-core (or Megatron-Bridge) version in
:mod:`nemo_lw_fp8.patches.upstream_fingerprints`. A different hash refuses the patch with one
line naming the object, the version and the override (:class:`UpstreamChanged`), instead of
wrapping code it was never run on.

Regenerate the record after a deliberate upgrade (then run the suite on it)::

    python -m nemo_lw_fp8.patches.fingerprints --write
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from nemo_lw_fp8.patches.record import fingerprint, target_name


def current() -> dict[str, dict[str, dict[str, str]]]:
    """Every registered plugin patch's targets as installed now, keyed like the record.

    Builds each patch's overrides without applying them; the Bridge patches need Megatron-Bridge
    imported (done here, over the CPU emulation when no GPU stack is present).
    """
    from nemo_lw_fp8.cpu.te import backend as te_backend

    te_backend.activate()
    import megatron.bridge.training.config  # noqa: F401

    from nemo_lw_fp8.patches import PATCH_MODULES, framework, load_all

    load_all()
    table: dict[str, dict[str, dict[str, str]]] = {}
    for name in PATCH_MODULES:
        patch = framework.registry()[name]
        key = framework.version_key(patch)
        targets = {}
        patch.detect_native()  # a Bridge patch's detector imports the modules it patches
        for override in patch.build_overrides():
            upstream = framework.unpatched_own_attr(override.owner, override.attr)
            targets[target_name(override.owner, override.attr)] = fingerprint(
                upstream, framework.MISSING
            )
        table.setdefault(key, {})[name] = dict(sorted(targets.items()))
    return table


def _shared_name(version: str) -> str:
    """The module-level name of a table several versions share, after the first of them."""
    return "_" + re.sub(r"[^0-9A-Za-z]+", "_", version).upper()


def _patch_lines(patches: dict[str, dict[str, str]], indent: str) -> list[str]:
    """One version's per-patch entries, each line starting with ``indent``."""
    lines = []
    for patch in sorted(patches):
        lines.append(f"{indent}{patch!r}: {{")
        for target, value in patches[patch].items():
            lines.append(f"{indent}    {target!r}:")
            lines.append(f"{indent}        {value!r},")
        lines.append(f"{indent}}},")
    return lines


def render(table: dict[str, dict[str, dict[str, str]]]) -> str:
    """The source of :mod:`nemo_lw_fp8.patches.upstream_fingerprints` for ``table``.

    Versions whose tables are equal (a patch release that left every wrapped object alone) are
    written once, as a module-level dict that each of them refers to: the record then shows at a
    glance which releases differ, and a table is never kept twice by hand.
    """
    versions = sorted(table)
    shared: dict[str, str] = {}  # version -> name of the dict it shares with others
    lines = [
        '"""Recorded by ``python -m nemo_lw_fp8.patches.fingerprints --write`` (do not edit):',
        "per tested version, per patch, each wrapped upstream object's source fingerprint.",
        "tests/patches/test_patch_framework.py checks this record against the installed stack.",
        '"""',
        "",
    ]
    for version in versions:
        if version in shared:
            continue
        same = [other for other in versions if table[other] == table[version]]
        if len(same) < 2:
            continue
        name = _shared_name(version)
        shared.update(dict.fromkeys(same, name))
        lines.append(f"#: {', '.join(same)}: the same record.")
        lines.append(f"{name}: dict[str, dict[str, str]] = {{")
        lines += _patch_lines(table[version], "    ")
        lines += ["}", ""]
    lines.append("FINGERPRINTS: dict[str, dict[str, dict[str, str]]] = {")
    for version in versions:
        if version in shared:
            lines.append(f"    {version!r}: {shared[version]},")
            continue
        lines.append(f"    {version!r}: {{")
        lines += _patch_lines(table[version], "        ")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    from nemo_lw_fp8.patches.upstream_fingerprints import FINGERPRINTS

    # Versions recorded on other installs stay; this install's versions are recorded afresh.
    text = render({**FINGERPRINTS, **current()})
    path = Path(__file__).with_name("upstream_fingerprints.py")
    if "--write" in argv:
        path.write_text(text)
        print(f"wrote {path}")
        return 0
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
