"""Regenerate the example sbatch scripts in this folder from nemo_lw_fp8.launch.slurm.

    python recipes/slurm/generate.py          # rewrite every example
    python recipes/slurm/generate.py --check  # exit 1 if any example differs (tests run this)

Node counts come from the published configurations (docs/slurm.md, "Examples"):
DeepSeek-V3 on GB200 TP1/PP4/VP4/EP64 (Megatron-Bridge perf row, >= 256 GPUs = 64 nodes x 4),
DeepSeek-V3 on H100 Bridge's ``deepseek_v3_pretrain_1024gpu_h100_bf16_config`` (TP2/PP16/EP64,
1024 GPUs = 128 nodes x 8), Qwen3-235B-A22B on H100 Bridge's
``qwen3_235b_a22b_pretrain_256gpu_h100_bf16_config`` and perf row TP2/PP8/VP4/EP32 (256 GPUs =
32 nodes x 8).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from nemo_lw_fp8.launch.slurm import write_sbatch

HERE = Path(__file__).resolve().parent
#: An enroot squashfs of the NeMo container with `pip install 'nemo-lw-fp8[bridge]'` added
#: (docs/slurm.md, "Container"); relative to the folder sbatch is run from.
IMAGE = "./nemo-lw-fp8.sqsh"

EXAMPLES: dict[str, dict[str, Any]] = {
    "deepseek_v3_mxfp8_gb200.sbatch": dict(
        recipe="deepseek_v3",
        nodes=64,
        gpus_per_node=4,
        gpu_arch="blackwell",
        container_image=IMAGE,
        overrides=["mixed_precision=bf16_with_mxfp8_mixed"],
    ),
    "deepseek_v3_fp8_h100.sbatch": dict(
        recipe="deepseek_v3",
        nodes=128,
        gpus_per_node=8,
        gpu_arch="hopper",
        container_image=IMAGE,
        overrides=["mixed_precision=bf16_with_fp8_subchannel_scaling_mixed"],
    ),
    "qwen3_235b_a22b_hopper_h100.sbatch": dict(
        recipe="qwen3_235b_a22b",
        nodes=32,
        gpus_per_node=8,
        gpu_arch="hopper",
        container_image=IMAGE,
        overrides=["mixed_precision=bf16_with_fp8_subchannel_scaling_mixed"],
    ),
    # Plumbing check on any Slurm cluster, no GPU: 2 gloo ranks on 1 node, 2 steps.
    "tiny_deepseek_v3_cpu_smoke.sbatch": dict(
        recipe="tiny_deepseek_v3",
        nodes=1,
        gpus_per_node=2,
        cpu=True,
        time="00:20:00",
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
