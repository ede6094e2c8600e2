"""tests/next_release/ runs only under ``make test-next-release``, which installs the next
upstream pair (megatron-core 0.20.0-dev, Megatron-Bridge 0.7.0-dev) first on ``PYTHONPATH`` and
sets ``NEMO_LW_FP8_NEXT_RELEASE=1``. Anywhere else (``make test``, a bare ``pytest``) the folder
is not collected at all, so a run on the tested 0.19.2 stack neither fails nor skips its tests
(docs/install.md, "The next release")."""

from __future__ import annotations

import os

#: The variable the make target sets.
NEXT_RELEASE_ENV = "NEMO_LW_FP8_NEXT_RELEASE"

if os.environ.get(NEXT_RELEASE_ENV) != "1":
    collect_ignore_glob = ["*"]
