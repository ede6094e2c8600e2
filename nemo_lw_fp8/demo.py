"""``make demo``: real training runs on two CPU ranks with megatron-core and layer-wise Muon.

1. A tiny GPT (megatron-core's local layer spec) wrapped in megatron-core DDP with the plugin's
   compact layer-wise layout (no padding, cost-balanced ownership, one gather per bucket group),
   trained by ``LayerWiseDistributedOptimizer`` (Muon for the matrices, a sibling
   DistributedOptimizer running Adam for embeddings, norms and biases), with overlapped gradient
   reduce and parameter gather.
2. MXFP8: a small model whose linear layers compute in MXFP8 (TE 2.20.2's own MXFP8 classes over
   the exact CPU emulation), trained twice with layer-wise Muon: FP8 param gather off (bf16
   weights, quantized on the fly) and on (persistent MXFP8 weights, bf16 masters staged in the
   grad buffer and all-gathered). The plugin makes the two bitwise identical; the demo prints both
   loss curves and the verdict.

Everything is embedded: nothing is downloaded.
"""

from __future__ import annotations

import time

from .testing.harness import BootOptions, run_on_ranks, shutdown_pools
from .testing.parity import assert_fp8_gather_parity
from .testing.training import GPT_SEQ, Scenario, train

GPT_SCENARIO = Scenario(
    optimizer="muon",
    distribution="layerwise_compact",
    overlap=True,
    model="gpt",
    steps=30,
    lr=2e-2,
    micro_batch=8,
    data="pattern",
    plugin=True,
)

MXFP8_SCENARIO = Scenario(
    optimizer="muon",
    distribution="layerwise_compact",
    overlap=True,
    model="fp8mlp",
    fp8=True,
    micro_batch=32,
    steps=12,
    eval_after=(5,),
    snapshots=True,
    plugin=True,
)


def _gpt_run(steps: int, world_size: int) -> bool:
    scenario = GPT_SCENARIO.with_(steps=steps)
    print(
        f"[1/2] tiny GPT, {world_size} CPU ranks (gloo), megatron-core DDP, layer-wise Muon, "
        f"compact layout, overlapped gathers, {scenario.steps} steps",
        flush=True,
    )
    results = run_on_ranks(train, scenario, progress=True, world_size=world_size, timeout=600)
    train_seconds = max(r["seconds"] for r in results)
    tokens = scenario.steps * scenario.micro_batch * GPT_SEQ * world_size
    identical = len({r["digest"] for r in results}) == 1
    losses = results[0]["losses"]
    print(f"  optimizer           {results[0]['optimizer']} (Muon layer-wise + Adam DistOpt)")
    print(
        f"  tokens/s            {tokens / train_seconds:,.0f} (training loop, {world_size} ranks)"
    )
    print(f"  loss first -> final {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"  ranks identical     {'yes' if identical else 'NO'} (sha256 of every parameter)")
    return identical


def _mxfp8_run(world_size: int) -> bool:
    print(
        f"\n[2/2] MXFP8 linear layers (TE classes over the CPU emulation), layer-wise Muon, "
        f"compact layout, {world_size} ranks, overlapped gathers, an eval after step "
        f"{MXFP8_SCENARIO.eval_after[0] + 1}: FP8 param gather OFF vs ON",
        flush=True,
    )
    boot = BootOptions(fp8_emulation=True)
    off = run_on_ranks(train, MXFP8_SCENARIO, world_size=world_size, boot=boot, timeout=600)
    on = run_on_ranks(
        train,
        MXFP8_SCENARIO.with_(fp8_param_gather=True),
        world_size=world_size,
        boot=boot,
        timeout=600,
    )
    print(f"  {'step':>4}  {'loss, gather OFF':>18}  {'loss, gather ON':>18}")
    for step, (a, b) in enumerate(zip(off[0]["losses"], on[0]["losses"], strict=True)):
        print(f"  {step + 1:>4}  {a:>18.10f}  {b:>18.10f}  {'=' if a == b else '!='}")
    weights = sum(len(r["effective_weights"]) for r in on)
    masters = sum(len(r["masters"]) for r in on)
    try:
        assert_fp8_gather_parity(off, on)
    except AssertionError as difference:
        print(f"  parity              DIFFERENT: {difference}")
        return False
    print(
        f"  parity              bitwise identical: losses, eval loss, forward output, every "
        f"main_grad, {weights} MXFP8 weights and {masters} fp32 masters across {world_size} ranks"
    )
    return True


def run(steps: int = GPT_SCENARIO.steps, world_size: int = 2) -> int:
    started = time.perf_counter()
    try:
        gpt_ok = _gpt_run(steps, world_size)
        mxfp8_ok = _mxfp8_run(world_size)
    finally:
        shutdown_pools()
    print(f"\nwall time {time.perf_counter() - started:.1f}s including process start-up")
    if not (gpt_ok and mxfp8_ok):
        print("error: the demo's checks failed (see above)")
        return 1
    return 0
