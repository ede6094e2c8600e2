"""Regenerate the example sbatch scripts in this folder from nemo_lw_fp8.cli.slurm.sbatch.

    python recipes/slurm/generate.py          # rewrite every example
    python recipes/slurm/generate.py --check  # exit 1 if any example differs (tests run this)

Each full-size example takes its node count and GPUs per node from the recipe's own
parallelism (:func:`nemo_lw_fp8.planner.parallelism`, from Megatron-Bridge 0.6.2's perf
recipes: DeepSeek-V3 GB200 256 GPUs = 64 x 4, DeepSeek-V3 H100 1024 = 128 x 8, Qwen3-235B-A22B
H100 256 = 32 x 8), so the scripts follow the recipes. Recipe names are those of
:mod:`nemo_lw_fp8.recipes` (``<model>_mxfp8`` and ``<model>_nvfp4`` for Blackwell,
``<model>_hopper`` for Hopper).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from nemo_lw_fp8.cli.slurm.sbatch import write_sbatch
from nemo_lw_fp8.planner import parallelism

HERE = Path(__file__).resolve().parent
#: An enroot squashfs of the NeMo container with `pip install 'nemo-lw-fp8[bridge]'` added
#: (docs/slurm.md, "Container"); relative to the folder sbatch is run from.
IMAGE = "./nemo-lw-fp8.sqsh"


def _full(model: str, variant: str) -> dict[str, Any]:
    gpu = {"mxfp8": "gb200", "hopper": "h100", "nvfp4": "gb200"}[variant]
    par = parallelism(model, gpu)
    return dict(
        recipe=f"{model.replace('-', '_')}_{variant}",
        nodes=par.nodes,
        gpus_per_node=par.gpus_per_node,
        gpu_arch="hopper" if variant == "hopper" else "blackwell",
        container_image=IMAGE,
    )


EXAMPLES: dict[str, dict[str, Any]] = {
    "deepseek_v3_mxfp8_gb200.sbatch": _full("deepseek-v3", "mxfp8"),
    "deepseek_v3_hopper_h100.sbatch": _full("deepseek-v3", "hopper"),
    "qwen3_235b_a22b_hopper_h100.sbatch": _full("qwen3-235b-a22b", "hopper"),
    "deepseek_v3_nvfp4_gb200.sbatch": _full("deepseek-v3", "nvfp4"),
    # Plumbing check on any Slurm cluster, no GPU: 2 gloo ranks on 1 node, 2 steps.
    "tiny_deepseek_v3_cpu_smoke.sbatch": dict(
        recipe="tiny_deepseek_v3",
        nodes=1,
        gpus_per_node=2,
        cpu=True,
        time="00:30:00",
        overrides=["train.train_iters=2"],
    ),
}


def render(name: str) -> str:
    """The text ``name`` must have."""
    return write_sbatch(**EXAMPLES[name])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a drift")
    args = parser.parse_args(argv)
    stale = []
    for name in EXAMPLES:
        path = HERE / name
        text = render(name)
        if path.exists() and path.read_text() == text:
            continue
        stale.append(name)
        if not args.check:
            path.write_text(text)
            path.chmod(0o755)
    if args.check and stale:
        print(f"stale: {', '.join(stale)}; run python {Path(__file__).name}", file=sys.stderr)
        return 1
    for name in stale:
        print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
