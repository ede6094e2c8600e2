"""``make gpu-check``: does what the CPU suite proves hold on your GPUs? About ten minutes.

For a GPU owner (1 to 8 NVIDIA GPUs; Transformer Engine with CUDA, megatron-core, Megatron-Bridge
and this plugin installed in the Python that runs it, ``GPU_PYTHON``). Nobody has run it on a GPU
yet (docs/testing.md, "On a GPU"): its first run is the first time these checks meet a GPU.

Steps (``--plan`` prints them without running anything):

1. every ``gpu``-marked test of the suite (TE's kernels against the CPU emulation, byte for byte;
   the owner reduce's NCCL branch), one line per test file;
2. the tiny recipe of this machine's generation through Bridge's ``pretrain`` on 2 GPUs over
   NCCL (``tiny_deepseek_v3``, MXFP8, on SM 10.x; ``tiny_qwen3_30b_a3b_hopper``, blockwise FP8,
   on SM 9.x): FP8 param gather ON (saving a checkpoint half-way) and OFF;
3. ON = OFF bitwise: every training and evaluation loss, and each rank's optimizer state digest;
4. a resume from the half-way checkpoint in fresh processes, bitwise equal to the uninterrupted
   run from there on;
5. a table of step time (median, first steps left out) and peak CUDA memory, ON against OFF.

Each check prints one line (``PASS`` / ``FAIL`` / ``NOT RUN``); a failure names the files to send
back. Without a usable GPU it prints one line saying so and exits 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: SM major version -> the tiny recipe that generation trains (docs/recipes.md).
RECIPE_BY_SM = {10: "tiny_deepseek_v3", 9: "tiny_qwen3_30b_a3b_hopper"}
OFF_OVERRIDES = (
    "mixed_precision.fp8_param_gather=false",
    "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=false",
)
STEPS, SAVED_AT = 8, 4
SEND_BACK = "send back: {logs} and the output of `nemo-lw-fp8 doctor --json`"


@dataclass(frozen=True)
class Step:
    name: str
    what: str


def gpu_test_files() -> list[str]:
    """The suite's files holding a ``gpu``-marked test (read from the files, nothing imported)."""
    found = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if "pytest.mark.gpu" in path.read_text():
            found.append(str(path.relative_to(ROOT)))
    return found


def plan(sm_major: int, gpus: int) -> list[Step]:
    """Every step, in order, for a machine of SM ``sm_major`` with ``gpus`` GPUs."""
    steps = [Step(f"gpu-tests {name}", f"pytest -m gpu {name}") for name in gpu_test_files()]
    recipe = RECIPE_BY_SM.get(sm_major)
    if recipe is None or gpus < 2:
        why = f"no tiny recipe for SM {sm_major}.x" if recipe is None else "needs 2 GPUs"
        return [*steps, Step("recipe", f"not run: {why}")]
    return [
        *steps,
        Step("train on", f"{recipe}, 2 GPUs, NCCL, FP8 param gather ON, {STEPS} steps, "
             f"saving at {SAVED_AT}"),  # fmt: skip
        Step("train off", f"{recipe}, 2 GPUs, NCCL, FP8 param gather OFF, {STEPS} steps"),
        Step("on = off", "training and evaluation losses and each rank's optimizer state, bitwise"),
        Step("resume", f"from iteration {SAVED_AT} in fresh processes, bitwise to the ON run"),
        Step("table", "step time and peak CUDA memory, ON against OFF"),
    ]


def _machine() -> tuple[int, int] | str:
    """(SM major, GPU count), or why this machine cannot run the check (one line)."""
    try:
        with warnings.catch_warnings():  # torch's pynvml notice: not this command's output
            warnings.simplefilter("ignore")
            import torch
    except ImportError as error:
        return f"torch is not importable by {sys.executable} ({error}); set GPU_PYTHON"
    if not torch.cuda.is_available():
        return (
            f"no CUDA GPU here ({sys.executable}: torch.cuda.is_available() is False); run it "
            "on a machine with 1 to 8 NVIDIA GPUs and TE with CUDA (GPU_PYTHON=...)"
        )
    return torch.cuda.get_device_capability(0)[0], torch.cuda.device_count()


def _line(status: str, name: str, detail: str) -> None:
    print(f"{status:<7} {name:<28} {detail}", flush=True)


def _pretrain(out: Path, tag: str, recipe: str, extra: tuple[str, ...]) -> tuple[dict, Path]:
    losses = out / f"losses-{tag}.json"
    log = out / f"train-{tag}.log"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
        "-m", "nemo_lw_fp8.cli", "pretrain", "--recipe", recipe, "--losses-json", str(losses),
        f"train.train_iters={STEPS}", "train.global_batch_size=4",
        f"validation.eval_interval={SAVED_AT}", *extra,
    ]  # fmt: skip
    with open(log, "w") as handle:
        done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode != 0 or not losses.exists():
        raise RuntimeError(f"exit {done.returncode}; {SEND_BACK.format(logs=log)}")
    report = json.loads(losses.read_text())
    report["ranks"] = [
        json.loads(Path(f"{losses}.rank{rank}").read_text())["optimizer_state"]
        for rank in range(2)
    ]
    return report, log


def _losses(report: dict, key: str) -> list[float]:
    return [row["lm loss"] for row in report[key]]


def _median_step(report: dict) -> float:
    times = report.get("step_seconds") or []
    return statistics.median(times[2:] or times or [float("nan")])


def run(out: Path) -> int:
    machine = _machine()
    if isinstance(machine, str):
        print(f"gpu-check: {machine}")
        return 1
    sm_major, gpus = machine
    steps = plan(sm_major, gpus)
    failed = 0
    for step in steps:
        if not step.name.startswith("gpu-tests "):
            continue
        name = step.name.removeprefix("gpu-tests ")
        log = out / (Path(name).stem + ".log")
        with open(log, "w") as handle:
            done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-rs", name],
                                  stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT)  # fmt: skip
        text = log.read_text()
        summary = text.strip().splitlines()[-1] if text.strip() else "no output"
        if done.returncode == 0:
            _line("PASS" if " passed" in summary else "NOT RUN", step.name, summary)
        else:
            failed += 1
            _line("FAIL", step.name, f"{summary}; {SEND_BACK.format(logs=log)}")
    recipe = RECIPE_BY_SM.get(sm_major)
    if recipe is None or gpus < 2:
        _line("NOT RUN", "recipe", steps[-1].what.removeprefix("not run: "))
        return 1 if failed else 0
    checkpoint = out / "checkpoint"
    saving = (f"checkpoint.save={checkpoint}", f"checkpoint.save_interval={SAVED_AT}")
    try:
        on, on_log = _pretrain(out, "on", recipe, saving)
        _line("PASS", "train on", f"{recipe}: {len(on['train'])} steps")
        off, off_log = _pretrain(out, "off", recipe, OFF_OVERRIDES)
        _line("PASS", "train off", f"{recipe}: {len(off['train'])} steps")
    except RuntimeError as error:
        _line("FAIL", "train", str(error))
        return 1
    same = all(
        (_losses(on, "train") == _losses(off, "train"),
         _losses(on, "eval") == _losses(off, "eval"), on["ranks"] == off["ranks"])
    )  # fmt: skip
    _line("PASS" if same else "FAIL", "on = off",
          "bitwise" if same else SEND_BACK.format(logs=f"{on_log} {off_log}"))  # fmt: skip
    failed += not same
    loading = (f"checkpoint.load={checkpoint}", f"checkpoint.ckpt_step={SAVED_AT}")
    try:
        resumed, resumed_log = _pretrain(out, "resumed", recipe, loading)
        again = (_losses(resumed, "train") == _losses(on, "train")[SAVED_AT:]
                 and resumed["ranks"] == on["ranks"])  # fmt: skip
        _line("PASS" if again else "FAIL", "resume",
              "bitwise" if again else SEND_BACK.format(logs=f"{on_log} {resumed_log}"))  # fmt: skip
        failed += not again
    except RuntimeError as error:
        _line("FAIL", "resume", str(error))
        failed += 1
    step_on, step_off = _median_step(on), _median_step(off)
    memory_on, memory_off = on.get("peak_memory_bytes") or 0, off.get("peak_memory_bytes") or 0
    _line("PASS", "table", f"step {step_on:.3f} s ON / {step_off:.3f} s OFF "
          f"({step_on / step_off:.2f}x); peak memory {memory_on / 2**30:.2f} GiB ON / "
          f"{memory_off / 2**30:.2f} GiB OFF")  # fmt: skip
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", action="store_true", help="print the steps, run nothing")
    parser.add_argument("--sm", type=int, default=10, help="with --plan: the SM major version")
    parser.add_argument("--gpus", type=int, default=2, help="with --plan: the GPU count")
    parser.add_argument("--out", default="gpu-check-output", help="folder for logs and runs")
    args = parser.parse_args(argv)
    if args.plan:
        for step in plan(args.sm, args.gpus):
            print(f"{step.name:<28} {step.what}")
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    return run(out)


if __name__ == "__main__":
    raise SystemExit(main())
