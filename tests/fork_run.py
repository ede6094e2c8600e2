"""A rank launcher for the Bridge test matrix: ``python tests/fork_run.py NPROC PORT ARGS...``
runs ``nemo-lw-fp8 pretrain`` (through tests/bridge_run.py, so its mutations apply) in NPROC
ranks, as ``torchrun --nproc-per-node NPROC`` would, but forks the ranks from one process that
has already imported the stack.

Why: a rank of a CPU twin spends about two thirds of its CPU time importing Megatron-Bridge,
megatron-core, ModelOpt, transformers and the TE emulation (about 20 s per rank on an idle
2-core machine), and the twin matrix launches about 90 ranks. Each forked rank still runs the
whole entry point (``cli.main`` with the same words), with the environment torchrun gives a rank
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT``, ...); only the
imports (done in the same order: the TE backend first, then megatron) are shared. The launches
users make (torchrun, ``nemo llm pretrain``) are tested as such in test_bridge_checkpointing.py,
test_bridge_training.py and the flagship twin's resume test, whose uninterrupted run is
launched by torchrun and must equal the resumed one launched here.

A rank that fails ends the others (as torchrun does) and the launcher exits with its status.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def _warm_up() -> None:
    """Import what every rank imports, in the order the entry point does."""
    from nemo_lw_fp8.emulation import te_backend

    te_backend.activate()
    import megatron.bridge.training.gpt_step  # noqa: F401
    import megatron.bridge.training.pretrain  # noqa: F401
    import megatron.bridge.training.utils.omegaconf_utils  # noqa: F401

    import nemo_lw_fp8.cpu.bridge  # noqa: F401
    import nemo_lw_fp8.launch.pretrain  # noqa: F401
    import nemo_lw_fp8.recipes  # noqa: F401


def _rank_environment(rank: int, nproc: int, port: str) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
    }


def main(argv: list[str]) -> int:
    nproc, port, words = int(argv[0]), argv[1], argv[2:]
    import bridge_run  # the mutations (env NEMO_LW_FP8_TEST_MUTATION), before anything else

    _warm_up()
    sys.stdout.flush()
    sys.stderr.flush()
    children: dict[int, int] = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                os.environ.update(_rank_environment(rank, nproc, port))
                status = bridge_run.cli.main(list(words)) or 0
            except SystemExit as done:
                status = done.code if isinstance(done.code, int) else 1
            except BaseException:  # noqa: BLE001 - report and exit like a failed rank
                import traceback

                traceback.print_exc()
            finally:
                # The exit handlers a rank's interpreter would run (multiprocessing shuts down
                # the manager a checkpoint save started, which holds the output pipes).
                import atexit

                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        children[pid] = rank
    failed = 0
    while children:
        pid, wait_status = os.wait()
        children.pop(pid, None)
        code = os.waitstatus_to_exitcode(wait_status)
        if code != 0 and not failed:
            failed = code if code > 0 else 1
            print(f"fork_run: a rank exited with {code}; ending the others", file=sys.stderr)
            for other in children:
                os.kill(other, signal.SIGTERM)
            time.sleep(1)
    return failed


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
