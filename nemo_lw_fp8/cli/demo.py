"""``make demo``: the tiny DeepSeek-V3 recipe trained on two CPU ranks through Megatron-Bridge.

The recipe ``tiny_deepseek_v3`` is DeepSeek-V3's architecture at toy width (multi-latent
attention with q LoRA, a leading dense layer, 8 routed experts as ONE grouped weight per expert
linear plus a shared expert, sigmoid router with expert bias, one multi-token-prediction layer),
built from explicit hyper-parameters. It is trained twice by Megatron-Bridge's own ``pretrain``
loop (``torchrun``, 2 gloo ranks, ``nemo-lw-fp8 pretrain --cpu``) with every plugin feature on:
layer-wise Muon, compact layout, overlapped param gather, MXFP8 compute, evaluation mid-run, on
Transformer Engine's own modules as a GB200 builds them (``--cpu-modules te``: megatron's TE spec,
the op fuser's grouped MLP, TE's fused permutation; only TE's kernels emulated); the two runs
differ only in the FP8 parameter all-gather: ON (persistent MXFP8 weights, bf16 masters staged
in the grad buffer) and OFF (bf16 weights quantized on the fly). The plugin makes training and
evaluation bitwise identical; the demo prints both loss curves step by step and the evaluation
losses with the verdict, writes ``losses.json`` and ``loss.png``.

Everything is embedded: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

RECIPE = "tiny_deepseek_v3"
OFF_OVERRIDES = (
    "mixed_precision.fp8_param_gather=false",
    "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag=false",
)


_PORT_OFFSET = {"on": 0, "off": 1, "resumed": 2}


def _train(out: Path, tag: str, steps: int, world_size: int, extra: tuple[str, ...]) -> dict:
    losses = out / f"losses-{tag}.json"
    log = out / f"train-{tag}.log"
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world_size}",
        "--master-port", str(29500 + os.getpid() % 1000 + _PORT_OFFSET[tag]),
        "-m", "nemo_lw_fp8.cli", "pretrain", "--recipe", RECIPE, "--cpu",
        "--losses-json", str(losses),
        f"train.train_iters={steps}",
        f"train.global_batch_size={2 * world_size}",
        f"validation.eval_interval={max(1, steps // 2)}",
        *extra,
    ]  # fmt: skip
    start = time.time()
    with open(log, "w") as handle:
        # Every line goes to the log; rank 0's progress lines (iteration, loss, ETA) also here.
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            handle.write(line)
            if line.startswith("progress: "):
                print(f"    [{tag}] {line[len('progress: ') :].rstrip()}", flush=True)
        proc.wait()
    done = proc
    if done.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"training ({tag}) failed, see {log}:\n{tail}")
    print(f"  {tag:>7s}: {steps} steps in {time.time() - start:.0f} s")
    return json.loads(losses.read_text())


def _plot(on: list[float], off: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(on) + 1)
    ax.plot(steps, off, "o-", label="FP8 param gather OFF (bf16 weights)", linewidth=3, alpha=0.5)
    ax.plot(steps, on, "x--", label="FP8 param gather ON (MXFP8 weights)", color="black")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title(f"{RECIPE}: Megatron-Bridge pretrain, layer-wise Muon, 2 CPU ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(steps: int = 12, world_size: int = 2, out: str = "demo-output") -> int:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    print(f"nemo_lw_fp8 demo: {RECIPE}, Megatron-Bridge's pretrain on {world_size} CPU ranks")
    print("  every feature on: layer-wise Muon, compact layout, overlapped param gather, MXFP8,")
    print("  single grouped expert weights, MLA + MoE + MTP; eval every", max(1, steps // 2))
    half = max(1, steps // 2)
    checkpoint = (folder / "checkpoint").resolve()
    shutil.rmtree(checkpoint, ignore_errors=True)  # a new run, not one resumed from an old demo
    saving = (f"checkpoint.save={checkpoint}", f"checkpoint.save_interval={half}")
    on = _train(folder, "on", steps, world_size, saving)
    off = _train(folder, "off", steps, world_size, OFF_OVERRIDES)
    on_loss = [row["lm loss"] for row in on["train"]]
    off_loss = [row["lm loss"] for row in off["train"]]
    print(f"\n  {'iter':>4}  {'loss, gather ON':>18}  {'loss, gather OFF':>18}  bitwise")
    for step, (a, b) in enumerate(zip(on_loss, off_loss, strict=True), start=1):
        print(f"  {step:>4}  {a:>18.10f}  {b:>18.10f}  {'yes' if a == b else 'NO'}")
    on_eval = [row["lm loss"] for row in on["eval"]]
    off_eval = [row["lm loss"] for row in off["eval"]]
    print(f"  eval  {on_eval}  vs  {off_eval}")
    same = on_loss == off_loss and len(on_loss) == steps and on_eval == off_eval

    print(f"\n  resume: the ON run saved at iteration {half}; fresh processes load it and go on")
    loading = (f"checkpoint.load={checkpoint}", f"checkpoint.ckpt_step={half}")
    resumed = _train(folder, "resumed", steps, world_size, loading)
    resumed_loss = [row["lm loss"] for row in resumed["train"]]
    print(f"\n  {'iter':>4}  {'loss, uninterrupted':>20}  {'loss, resumed':>18}  bitwise")
    for step, (a, b) in enumerate(zip(on_loss[half:], resumed_loss, strict=False), start=half + 1):
        print(f"  {step:>4}  {a:>20.10f}  {b:>18.10f}  {'yes' if a == b else 'NO'}")
    resumed_eval = [row["lm loss"] for row in resumed["eval"]]
    later_evals = on_eval[len(on_eval) - len(resumed_eval) :] if resumed_eval else []
    print(f"  eval  {later_evals}  vs  {resumed_eval}")
    resumes = (
        len(resumed_loss) == steps - half
        and resumed_loss == on_loss[half:]
        and bool(resumed_eval)
        and resumed_eval == later_evals
    )

    record = {"on": on, "off": off, "resumed": resumed}
    (folder / "losses.json").write_text(json.dumps(record, indent=1))
    _plot(on_loss, off_loss, folder / "loss.png")
    print(f"\n  wrote {folder / 'losses.json'} and {folder / 'loss.png'}")
    if same:
        print("  ON == OFF, bitwise: every training iteration and every evaluation.")
    else:
        print("  ON != OFF: the FP8 param gather changed training or evaluation (docs/recipes.md).")
    if resumes:
        print(f"  resumed == uninterrupted, bitwise: iterations {half + 1}-{steps}, their evals.")
    else:
        print("  resumed != uninterrupted: the checkpoint did not restore the run")
        print("  (docs/checkpointing.md).")
    return 0 if same and resumes else 1
