"""Writes the record (:mod:`.upstream_fingerprints`): per tested version, per patch, its verdict
and the fingerprint (:func:`.record.fingerprint`) of every object it wraps.

A version is recorded after the suite passed on it (docs/install.md, "How support is decided"):
its entries are what that install holds. A verdict already in the record stays; a new version's
patches are recorded ``patched`` unless ``--native=PATCH=REASON`` says upstream does it there
(then ``apply()`` installs nothing for that patch on that exact code)::

    python -m nemo_lw_fp8.patches.fingerprints --write [--native=PATCH=REASON ...]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from nemo_lw_fp8.patches.record import NATIVE, PATCHED, fingerprint


def current(verdicts: dict[str, dict[str, dict[str, object]]] | None = None) -> dict[
    str, dict[str, dict[str, object]]
]:
    """Every registered plugin patch's targets as installed now, keyed like the record.

    Builds each patch's overrides without applying them; the Bridge patches need Megatron-Bridge
    imported (done here, over the CPU emulation when no GPU stack is present). ``verdicts``:
    the record so far, whose verdicts stay.
    """
    from nemo_lw_fp8.cpu.te import backend as te_backend

    te_backend.activate()
    import megatron.bridge.training.config  # noqa: F401

    from nemo_lw_fp8.patches import PATCH_MODULES, framework, load_all

    load_all()
    table: dict[str, dict[str, dict[str, object]]] = {}
    for name in PATCH_MODULES:
        patch = framework.registry()[name]
        key = framework.version_key(patch)
        targets = {}
        for override in patch.build_overrides():
            upstream = framework.unpatched_own_attr(override.owner, override.attr)
            targets[override.target] = fingerprint(
                upstream, framework.MISSING
            )
        before = (verdicts or {}).get(key, {}).get(name, {})
        entry: dict[str, object] = {"verdict": before.get("verdict", PATCHED)}
        if before.get("reason"):
            entry["reason"] = before["reason"]
        entry["targets"] = dict(sorted(targets.items()))
        table.setdefault(key, {})[name] = entry
    return table


def _shared_name(version: str) -> str:
    """The module-level name of a table several versions share, after the first of them."""
    return "_" + re.sub(r"[^0-9A-Za-z]+", "_", version).upper()


def _patch_lines(patches: dict[str, dict[str, object]], indent: str) -> list[str]:
    """One version's per-patch entries, each line starting with ``indent``."""
    lines = []
    for patch in sorted(patches):
        entry = patches[patch]
        lines.append(f"{indent}{patch!r}: {{")
        lines.append(f"{indent}    'verdict': {entry['verdict']!r},")
        if entry.get("reason"):
            lines.append(f"{indent}    'reason': {entry['reason']!r},")
        lines.append(f"{indent}    'targets': {{")
        for target, value in entry["targets"].items():
            lines.append(f"{indent}        {target!r}:")
            lines.append(f"{indent}            {value!r},")
        lines.append(f"{indent}    }},")
        lines.append(f"{indent}}},")
    return lines


def render(table: dict[str, dict[str, dict[str, object]]]) -> str:
    """The source of :mod:`nemo_lw_fp8.patches.upstream_fingerprints` for ``table``.

    Versions whose tables are equal (a patch release that left every wrapped object alone) are
    written once, as a module-level dict that each of them refers to: the record then shows at a
    glance which releases differ, and a table is never kept twice by hand.
    """
    versions = sorted(table)
    shared: dict[str, str] = {}  # version -> name of the dict it shares with others
    lines = [
        '"""Recorded by ``python -m nemo_lw_fp8.patches.fingerprints --write`` (do not edit):',
        "per tested version, per patch, its verdict and each wrapped object's fingerprint",
        "(nemo_lw_fp8/patches/record.py). tests/patches/test_upstream_fingerprints.py checks",
        "this record against the installed stack.",
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
        lines.append(f"{name}: dict[str, dict[str, object]] = {{")
        lines += _patch_lines(table[version], "    ")
        lines += ["}", ""]
    lines.append("FINGERPRINTS: dict[str, dict[str, dict[str, object]]] = {")
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
    fresh = current(FINGERPRINTS)
    for word in argv:
        if word.startswith("--native="):
            name, _, reason = word.removeprefix("--native=").partition("=")
            for patches in fresh.values():
                if name in patches:
                    patches[name] = {"verdict": NATIVE, "reason": reason, **patches[name]}
                    patches[name]["verdict"] = NATIVE
    text = render({**FINGERPRINTS, **fresh})
    path = Path(__file__).with_name("upstream_fingerprints.py")
    if "--write" in argv:
        path.write_text(text)
        print(f"wrote {path}")
        return 0
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
