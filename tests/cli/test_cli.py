"""``nemo-lw-fp8`` on bad input: one or two lines naming the problem and the fix, exit status 2,
no traceback (``--debug`` shows it); and the progress line of long runs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from nemo_lw_fp8 import cli
from tests.support import fork_server


def _error_lines(text: str) -> list[str]:
    lines = [line for line in text.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 2, text
    assert "Traceback" not in text, text
    return lines


@pytest.mark.parametrize(
    ("argv", "problem", "fix"),
    [
        (["pretrain", "--recipe", "nonexistent"], "unknown recipe 'nonexistent'", "recipes"),
        (["pretrain", "--recipe", "deepseek_v3_mxfp"], "did you mean deepseek_v3_mxfp8", ""),
        (["pretrain", "--recipe", "tiny_deepseek_v3", "lr"], "'lr' is not key=value", "=value"),
        (
            ["pretrain", "--recipe", "tiny_deepseek_v3", "--config-file", "/no/such.yaml"],
            "does not exist",
            "YAML",
        ),
        (
            ["pretrain", "--recipe", "tiny_deepseek_v3", "--cpu-modules", "project"],
            "--cpu-modules project chooses the model path of CPU ranks only",
            "add --cpu",
        ),
    ],
)
def test_bad_command_lines_in_process(capsys, argv, problem, fix):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = _error_lines(captured.err)
    assert problem in lines[0], lines
    assert fix in captured.err


def test_missing_bridge(capsys, monkeypatch):
    # sys.modules[name] = None is how Python spells "not installed" (find_spec returns None).
    monkeypatch.setitem(sys.modules, "megatron.bridge", None)
    assert cli.main(["pretrain", "--recipe", "tiny_deepseek_v3", "--dry-run"]) == 2
    lines = _error_lines(capsys.readouterr().err)
    assert "Megatron-Bridge is not installed" in lines[0] and "make env" in lines[1]


def test_debug_shows_the_traceback(monkeypatch):
    monkeypatch.setenv(cli.DEBUG_ENV, "0")
    with pytest.raises(cli.UsageError, match="unknown recipe"):
        cli.main(["pretrain", "--debug", "--recipe", "nonexistent"])


def test_console_script_exit_status_and_stderr():
    """The real command, as a user runs it: exit 2, two lines on stderr, nothing on stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "nemo_lw_fp8.cli", "pretrain", "--recipe", "nonexistent"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert "unknown recipe" in _error_lines(done.stderr)[0]


#: Cases that need the recipe built (Megatron-Bridge, TE booted): one process of their own runs
#: all, forked from the session's launch server.
BRIDGE_CASES = {
    "bad key": (["optimizer.lrr=1e-4"], "unknown key 'optimizer.lrr'", "optimizer.lr"),
    "bad section": (["trian.train_iters=3"], "has no field 'trian'", "train"),
    "bad type": (["optimizer.lr=abc"], "expected float or None, got str", "optimizer.lr=3e-4"),
    "int for bool": (["ddp.overlap_param_gather=3"], "expected bool", "=true"),
    "bad range": (["train.train_iters=-5"], "train.train_iters=-5 is out of range", "> 0"),
    "negative lr": (["optimizer.lr=-1e-3"], "optimizer.lr=-0.001 is out of range", ">= 0"),
    "rule": (["optimizer.layer_wise_layout=diagonal"], "layer-wise-layout-name", ""),
}

_BRIDGE_SCRIPT = textwrap.dedent(
    """
    import contextlib, io, json, os, sys, tempfile
    from nemo_lw_fp8 import cli
    cases = json.loads(sys.argv[1])
    out = {}
    for name, overrides in cases.items():
        # What reaches file descriptor 2, as a terminal would show it.
        with tempfile.TemporaryFile("w+") as sink:
            saved = os.dup(2)
            os.dup2(sink.fileno(), 2)
            try:
                code = cli.main(
                    ["pretrain", "--recipe", "tiny_deepseek_v3", "--dry-run", *overrides])
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
            sink.seek(0)
            out[name] = [code, sink.read()]
    good = io.StringIO()
    with contextlib.redirect_stdout(good):
        code = cli.main(
            ["pretrain", "--recipe", "tiny_deepseek_v3", "--dry-run", "optimizer.lr=2e-3",
             "train.train_iters=7", "ddp.overlap_param_gather=true"])
    out["good"] = [code, good.getvalue()]
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def bridge_cases(bridge_installed) -> dict:
    cases = {name: overrides for name, (overrides, _, _) in BRIDGE_CASES.items()}
    done = fork_server.run_script(_BRIDGE_SCRIPT, json.dumps(cases), timeout=900)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT")]
    assert lines, done.stderr[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    return json.loads(lines[0][len("RESULT") :])


@pytest.mark.parametrize("case", sorted(BRIDGE_CASES))
def test_bad_overrides_fail_before_anything_is_built(bridge_cases, case):
    _, problem, fix = BRIDGE_CASES[case]
    code, err = bridge_cases[case]
    assert code == 2, (case, err)
    lines = _error_lines(err)
    assert problem in lines[0], lines
    assert fix in err, err


def test_good_overrides_pass(bridge_cases):
    code, out = bridge_cases["good"]
    assert code == 0, out
    assert "train_iters: 7" in out


# ----------------------------------------------------------------------------- progress


def test_progress_line_and_eta():
    from nemo_lw_fp8.cli.pretrain import Progress

    progress = Progress(total=10, every=2)
    progress.start = 0.0
    assert progress.line(1, 5.0, now=4.0) is None  # odd iterations are not reported
    line = progress.line(2, 4.5, now=6.0)  # 2 s since the first iteration
    assert line == (
        "progress: iteration 2/10, lm loss 4.500000, elapsed 0:00:06, 2.00 s/it, ETA 0:00:16"
    )
    assert progress.line(10, 3.0, now=22.0).endswith("ETA 0:00:00")
    assert Progress(total=1000).every == 20
