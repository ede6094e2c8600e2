"""Third-party noise held back while the CLI imports megatron-core, Bridge and TE.

Importing megatron-core on a machine without Apex or a CUDA TE prints a dozen warnings (Apex
missing, "TE version 0.0.0", fla/Triton on CPU, ``torch.jit.script`` deprecated, torch's "No CUDA
runtime") before a command says anything. :func:`held_back` records Python warnings and whatever
reaches file descriptor 2 (logging handlers, C extensions) while its block runs, so a command
can print its own output first and the noise as one summary line (or in full on request).
The plugin's own warnings (a category defined in ``nemo_lw_fp8``, e.g. a patch applied over
untested code under the override) are never held back: they go to stderr as the block ends.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class Held:
    """What a block printed or warned: one entry per message, and who it came from."""

    messages: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: how many, from which packages (``""`` when nothing was held back)."""
        if not self.messages:
            return ""
        counts = collections.Counter(self.sources)
        parts = ", ".join(f"{name} {n}" for name, n in counts.most_common())
        return f"{len(self.messages)} third-party warnings hidden ({parts}); --verbose shows them"


def _package_of(path: str) -> str:
    match = re.search(r"site-packages/([A-Za-z0-9_]+)", path)
    return match.group(1) if match else os.path.basename(path).removesuffix(".py")


@contextlib.contextmanager
def held_back() -> Iterator[Held]:
    """Record warnings and file-descriptor-2 output of the block into the yielded :class:`Held`
    (filled when the block ends, also when it raises)."""
    held = Held()
    shown: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    yield held
                finally:
                    seen = set()
                    for item in caught:
                        text = f"{item.category.__name__}: {item.message}"
                        if (item.filename, item.lineno, text) in seen:
                            continue
                        seen.add((item.filename, item.lineno, text))
                        if item.category.__module__.startswith("nemo_lw_fp8"):
                            shown.append(f"warning: {item.message}")  # the plugin's own
                            continue
                        held.messages.append(f"{item.filename}:{item.lineno}: {text}")
                        held.sources.append(_package_of(item.filename))
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            for line in shown:
                sys.stderr.write(line + "\n")
            sink.seek(0)
            for line in sink.read().decode(errors="replace").splitlines():
                if line.strip():
                    held.messages.append(line)
                    found = re.search(r"(\w+)/[\w/]+\.py:\d+\]", line)
                    held.sources.append(found.group(1) if found else "stderr")
