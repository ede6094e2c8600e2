"""A rank launcher for the Bridge test matrix: ``python tests/support/fork_run.py NPROC PORT
ARGS...`` runs ``nemo-lw-fp8 pretrain`` (through tests/support/bridge_run.py, so its mutations
apply) in NPROC ranks, as ``torchrun --nproc-per-node NPROC`` would, but forks the ranks from one
process that has already imported the stack.

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

``python tests/support/fork_run.py --serve`` is the suite's launch server (:func:`serve`): the
imports are done once per test session and each run is forked from there.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def _warm_up() -> None:
    """Import what every rank imports, in the order the entry point does."""
    from nemo_lw_fp8.cpu.te import backend as te_backend

    te_backend.activate()
    import megatron.bridge.training.gpt_step  # noqa: F401
    import megatron.bridge.training.pretrain  # noqa: F401
    import megatron.bridge.training.utils.omegaconf_utils  # noqa: F401

    import nemo_lw_fp8.cli.pretrain  # noqa: F401
    import nemo_lw_fp8.cpu.megatron.bridge_pretrain  # noqa: F401
    import nemo_lw_fp8.recipes  # noqa: F401

    gc.freeze()  # the imported stack: never collected, never copied by the ranks' collections


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


def _one_thread_per_rank_as_torchrun(nproc: int) -> None:
    """torchrun sets ``OMP_NUM_THREADS=1`` for its ranks when it starts several and the variable
    is unset; torch read the variable when the server imported it, so say it to torch too."""
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
    if "OMP_NUM_THREADS" in os.environ:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def run_ranks(nproc: int, port: str, words: list[str]) -> int:
    """Fork ``nproc`` ranks that each run the entry point with ``words``; wait for them. A rank
    that fails ends the others (as torchrun does); returns the first failure's status."""
    import bridge_run

    sys.stdout.flush()
    sys.stderr.flush()
    children: dict[int, int] = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                os.environ.update(_rank_environment(rank, nproc, port))
                _one_thread_per_rank_as_torchrun(nproc)
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


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        return serve()
    nproc, port, words = int(argv[0]), argv[1], argv[2:]
    import bridge_run  # noqa: F401 - the mutations (env NEMO_LW_FP8_TEST_MUTATION) come first

    _warm_up()
    return run_ranks(nproc, port, words)


# --------------------------------------------------------------------------- launch server


def serve() -> int:
    """``fork_run.py --serve``: import the stack once, then launch one run per request.

    Requests come on stdin, one JSON line each: ``{"nproc", "port", "words", "env", "cwd",
    "stdout", "stderr"}``. For each, a launcher process is forked from this warmed-up one: it
    takes the request's environment and working directory, writes its output (and its ranks')
    to the two files, installs the request's mutation and probe (tests/support/bridge_run.py) and
    runs :func:`run_ranks`. A request with ``"script"``, ``"argv"`` (and ``"file"``, if the source
    is a file's) in place of ``"nproc"``, ``"port"`` and ``"words"`` runs that source as
    ``python -c SOURCE ARGV...`` would (:func:`_run_script`), for the tests that inspect the
    stack in a process of their own. The server answers on stdout with ``{"pid": ...}`` (the
    launcher leads a process group of its own: the client ends a run that passes its deadline
    by killing that group), then ``{"code": ...}`` when the launcher has exited. Anything else
    the server or an import prints goes to stderr. End of stdin ends the server.

    Each run starts from the same freshly imported state (a fork, never a process that ran
    something), as with one ``fork_run.py`` per run: only the import time is saved, ~20 s of
    CPU per run. Environment variables a module reads at import time are the server's; the
    tests vary only the two that tests/support/bridge_run.py reads, and those it reads per request.
    """
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints must not reach the protocol
    import bridge_run

    _warm_up()
    answers.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                answers.close()
                code = _launch(request, bridge_run)
            finally:
                os._exit(code)
        answers.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
    return 0


def _launch(request: dict, bridge_run) -> int:  # noqa: ANN001 - the module
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    try:
        if "script" in request:
            return _run_script(request["script"], request["argv"], request.get("file"))
        bridge_run.install_mutation(os.environ.get("NEMO_LW_FP8_TEST_MUTATION", ""))
        bridge_run.install_probe(os.environ.get("NEMO_LW_FP8_TEST_PROBE", ""))
        bridge_run.install_state_tensors(os.environ.get("NEMO_LW_FP8_TEST_STATE_TENSORS", ""))
        return run_ranks(int(request["nproc"]), str(request["port"]), list(request["words"]))
    except BaseException:  # noqa: BLE001 - reported in the run's output
        import traceback

        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _run_script(source: str, argv: list[str], file: str | None) -> int:
    """Run ``source`` as the main module of this (forked, warmed-up) process, as
    ``python -c source *argv`` (or ``python FILE *argv``) runs it: the same ``sys.argv``,
    ``sys.path[0]`` and ``__file__``, and its exit status is the script's. Only the imports the
    server made are shared; what the script imports and initialises (process groups,
    stand-ins) happens here, in a process of its own."""
    namespace = {"__name__": "__main__"}
    if file is None:
        sys.argv = ["-c", *argv]
        sys.path.insert(0, "")
    else:
        sys.argv = [file, *argv]
        sys.path.insert(0, os.path.dirname(os.path.abspath(file)))
        namespace["__file__"] = file
    code = 0
    try:
        exec(compile(source, file or "<string>", "exec"), namespace)  # noqa: S102
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        import atexit

        atexit._run_exitfuncs()
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
