"""``make demo``: a real training run on two CPU ranks with megatron-core and layer-wise Muon.

A tiny GPT (megatron-core's local layer spec) is wrapped in megatron-core DDP with the
shard-aligned layer-wise layout and trained by ``LayerWiseDistributedOptimizer`` (Muon for the
matrices, a sibling DistributedOptimizer running Adam for embeddings, norms and biases), with
overlapped gradient reduce and parameter gather. The model and data are embedded: nothing is
downloaded. Later features of the plugin are switched on here as they land.
"""

from __future__ import annotations

import time

from .testing.harness import run_on_ranks, shutdown_pools
from .testing.training import GPT_SEQ, Scenario, train

DEFAULT_SCENARIO = Scenario(
    optimizer="muon",
    distribution="layerwise_padded",
    overlap=True,
    model="gpt",
    steps=30,
    lr=2e-2,
    micro_batch=8,
    data="pattern",
)


def run(steps: int = DEFAULT_SCENARIO.steps, world_size: int = 2) -> int:
    scenario = DEFAULT_SCENARIO.with_(steps=steps)
    print(
        f"nemo_lw_fp8 demo: tiny GPT, {world_size} CPU ranks (gloo), megatron-core DDP, "
        f"layer-wise Muon ({scenario.distribution}, overlap={scenario.overlap}), "
        f"{scenario.steps} steps",
        flush=True,
    )
    started = time.perf_counter()
    try:
        results = run_on_ranks(train, scenario, progress=True, world_size=world_size, timeout=600)
    finally:
        shutdown_pools()
    wall = time.perf_counter() - started
    train_seconds = max(r["seconds"] for r in results)
    tokens = scenario.steps * scenario.micro_batch * GPT_SEQ * world_size
    identical = len({r["digest"] for r in results}) == 1
    losses = results[0]["losses"]
    print()
    print("summary")
    print(f"  steps               {scenario.steps}")
    print(f"  optimizer           {results[0]['optimizer']} (Muon layer-wise + Adam DistOpt)")
    rate = tokens / train_seconds
    print(f"  tokens/s            {rate:,.0f} (training loop, {world_size} ranks)")
    print(f"  loss first -> final {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"  ranks identical     {'yes' if identical else 'NO'} (sha256 of every parameter)")
    print(f"  wall time           {wall:.1f}s including process start-up")
    if not identical:
        print("error: ranks ended with different weights")
        return 1
    return 0
