"""The owner reduce's NCCL branch (``owner_reduce._coalesced``) on real GPUs, against gloo and
the rank-order sum: the rank function of ``tests/mechanics/test_owner_reduce_nccl.py``.

Each rank fills one fp32 buffer from its own seed (values over 2^-12 .. 2^12, some zero), cuts
it into spans owned by alternating ranks (one empty, one a single element), and reduces the
spans to their owners with ``owner_reduce.reduce_spans`` three ways from the same values: over
NCCL on its GPU (the coalesced branch, synchronous and ``async_op``, the handle waited as
megatron's ``finish_grad_sync`` waits), over gloo on the CPU (the branch every CPU test runs),
and as the rank-order sum of the gathered buffers. At two ranks a sum has one addition, which
commutes, so all three must agree bit for bit on every span's owner.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

#: (owner, start, end) of each span of the test buffer; rank 0 and 1 alternate.
SPANS = ((0, 0, 1000), (1, 1000, 1000), (1, 1000, 4097), (0, 4097, 4098), (1, 4098, 6000),
         (0, 6000, 9000))  # fmt: skip


def _values(rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(4501 + rank)
    numel = SPANS[-1][2]
    scale = torch.exp2(torch.randint(-12, 13, (numel,), generator=generator).float())
    values = torch.randn(numel, generator=generator) * scale
    values[::97] = 0.0
    return values


def compare_branches(main: object, device: str, gloo: object) -> dict:
    """On this rank: the spans reduced over ``main`` (tensors on ``device``) and over ``gloo``
    (CPU), synchronous and ``async_op``, each equal bit for bit to the rank-order sum on the
    span's owner (raises otherwise). Returns the coalesced launches (the process groups
    ``owner_reduce._coalesced`` was called with) and the elements compared."""
    import torch.distributed as dist

    from nemo_lw_fp8.mechanics import owner_reduce

    rank, world = gloo.rank(), gloo.size()
    values = _values(rank)
    parts = [torch.empty_like(values) for _ in range(world)]
    dist.all_gather(parts, values, group=gloo)
    ordered = parts[0].clone()
    for part in parts[1:]:
        ordered += part

    coalesced = []
    real = owner_reduce._coalesced

    def counted(*args, **kwargs):
        coalesced.append(args[0])
        return real(*args, **kwargs)

    owner_reduce._coalesced = counted
    try:
        results = {}
        for async_op in (False, True):
            for name, group, where in (("main", main, device), ("gloo", gloo, "cpu")):
                data = values.to(where, copy=True)
                spans = [(owner, data[start:end]) for owner, start, end in SPANS]
                works = owner_reduce.reduce_spans(spans, dist.ReduceOp.SUM, group, async_op)
                assert bool(works) == async_op, (name, async_op, works)
                owner_reduce.ReduceWork(works).wait()
                if where == "cuda":
                    torch.cuda.synchronize()
                results[f"{name} async={async_op}"] = data.cpu()
    finally:
        owner_reduce._coalesced = real
    compared = 0
    for owner, start, end in SPANS:
        if owner != rank:
            continue
        for label, result in results.items():
            same = torch.equal(result[start:end], ordered[start:end])
            assert same, f"rank {rank}: {label} differs from the rank-order sum in {start}:{end}"
        compared += end - start
    return {
        "compared": compared,
        "coalesced_main": sum(group is main for group in coalesced),
        "coalesced_gloo": sum(group is gloo for group in coalesced),
    }


def on_cpu_ranks() -> dict:
    """:func:`compare_branches` on the harness's gloo ranks, a second gloo group standing for
    NCCL: everything of the GPU test but NCCL itself runs in the CPU suite."""
    import torch.distributed as dist

    ranks = list(range(dist.get_world_size()))
    return compare_branches(dist.new_group(ranks), "cpu", dist.new_group(ranks, backend="gloo"))


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank on its GPU (``torch.multiprocessing.spawn``): :func:`compare_branches` over
    NCCL; writes what it found to ``out_dir/rank<r>.json``."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank)
    )
    try:
        ranks = list(range(world))
        nccl = dist.new_group(ranks, backend="nccl")
        found = compare_branches(nccl, "cuda", dist.new_group(ranks, backend="gloo"))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()
