"""``torchrun`` target for tests/test_bridge_training.py: ``nemo-lw-fp8 pretrain`` with an
optional mutation (env ``NEMO_LW_FP8_TEST_MUTATION``) switching one plugin fix off, so the test
shows its parity check fails without that fix (also the target of
tests/test_bridge_checkpointing.py)."""

from __future__ import annotations

import os
import sys

MUTATION = os.environ.get("NEMO_LW_FP8_TEST_MUTATION", "")

if MUTATION == "init_value_table":
    # TE's init values only as the tensor attribute (dropped by Module._apply): stock behaviour.
    import nemo_lw_fp8.mechanics.masters as masters

    def attribute_only(param):
        getter = getattr(param, "get_high_precision_init_val", None)
        return getter() if getter is not None else None

    masters.preserved_init_value = attribute_only
elif MUTATION == "stage_before_hook_gather":
    # No staging before the gathers of an eval run with the pre-hooks on (stock behaviour).
    import nemo_lw_fp8.mechanics.staging as staging

    staging.stage_if_unstaged = lambda chunk: None
elif MUTATION == "save_param_sync":
    # No forced param gather before a save of a layer-wise run (Bridge 0.6.2's behaviour).
    import nemo_lw_fp8.mechanics.checkpointing as checkpointing

    checkpointing.save_needs_param_sync = lambda cfg: False
elif MUTATION:
    raise SystemExit(f"unknown mutation {MUTATION!r}")

from nemo_lw_fp8 import cli  # noqa: E402

# Guarded: a checkpoint save starts a multiprocessing manager with the "spawn" method, whose
# child imports this file as __main__ again (unguarded, it re-ran the whole pretrain and hung).
if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
