"""``python -m nemo_lw_fp8.cli``: the ``nemo-lw-fp8`` command (torchrun launches it this way)."""

import sys

from nemo_lw_fp8.cli import main

sys.exit(main())
