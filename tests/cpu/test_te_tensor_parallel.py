"""megatron's TE linears at tensor-parallel size 2 on 2 CPU ranks (issue 29, first step): a
``TEColumnParallelLinear`` -> ``TERowParallelLinear`` pair, TE 2.20.2's own modules over the
emulated kernels, with and without sequence parallelism, bf16, MXFP8 and blockwise FP8.

The claim, bitwise on every rank: each rank's outputs and gradients are exactly what TE's plain
``Linear`` computes on that rank's shard of the same full weights, and the two partial sums the
row-parallel layer (forward) and the column-parallel layer (dgrad) reduce over the TP group are
added in bf16, as the collective adds them: column output shard, row output (all-reduced, or
reduce-scattered with sequence parallelism), input gradient, both weight gradients. So TE's TP
paths on CPU move the same bytes as a single-GPU ``Linear`` and add what NCCL adds.

What it took (``docs/testing.md``): the ``gloo_coalescing`` stand-in (TE's quantized gathers of
sequence-parallel activations coalesce on a device; gloo coalesces only without one) and the
exact ``tex.swap_first_dims`` (blockwise gathers reorder columnwise data and rowwise scales).

Controls: the row output against one full-K GEMM (TP 1, rounded once) differs: the comparison
sees the TP reduction; and the blockwise gather with ``swap_first_dims`` not swapping diverges.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import BootOptions, ParallelSpec, run_on_ranks
from tests.support.te_helpers import te_recipe

BOOT = BootOptions(fp8_emulation=True)
TP2 = ParallelSpec(tp=2)
S, B, H, F = 128, 2, 256, 512  # sequence, micro-batch, hidden, ffn (per-rank tokens 128 with SP)


def _full_data() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(29)
    return {
        "w1": (torch.randn(F, H, generator=gen) * 0.05).bfloat16(),
        "w2": (torch.randn(H, F, generator=gen) * 0.05).bfloat16(),
        "x": torch.randn(S, B, H, generator=gen).bfloat16(),
        "dy": torch.randn(S, B, H, generator=gen).bfloat16(),
    }


def tp_pair_run(recipe: str, sequence_parallel: bool, mutation: str | None = None) -> dict:
    """On each rank of a TP-2 group: the megatron TE pair on its shards, and the reference from
    TE's plain ``Linear`` on the same shards (every rank's, since the reductions add them)."""
    import contextlib

    import transformer_engine.pytorch as te
    from megatron.core import parallel_state as ps
    from megatron.core.extensions import transformer_engine as mte
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_lw_fp8.cpu.te import device as te_device
    from nemo_lw_fp8.cpu.te import tex as te_extension

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    fp8_recipe, target = te_recipe(recipe)
    d = _full_data()
    cols = [slice(r * F // tp, (r + 1) * F // tp) for r in range(tp)]
    rows = slice(rank * S // tp, (rank + 1) * S // tp) if sequence_parallel else slice(None)
    autocast = (lambda: te.autocast(enabled=True, recipe=fp8_recipe)) if fp8_recipe else (
        contextlib.nullcontext)  # fmt: skip
    config = TransformerConfig(
        num_layers=1, hidden_size=H, ffn_hidden_size=F, num_attention_heads=4, bf16=True,
        params_dtype=torch.bfloat16, use_cpu_initialization=True, tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel, gradient_accumulation_fusion=False,
        **({"fp8": "e4m3", "fp8_recipe": recipe} if fp8_recipe else {}),
    )  # fmt: skip
    common = dict(config=config, init_method=torch.nn.init.zeros_, bias=False,
                  skip_bias_add=False, is_expert=False)  # fmt: skip
    swap = te_extension.swap_first_dims
    if mutation == "no_swap":  # the gathered blocks left in arrival order, only reshaped
        te_extension.swap_first_dims = lambda t, *, out=None: (
            out.copy_(t.contiguous().reshape(out.shape)) if out is not None
            else t.contiguous().reshape(t.shape[1], t.shape[0], *t.shape[2:]))  # fmt: skip
    try:
        with te_device.target_gpu(target):
            column = mte.TEColumnParallelLinear(H, F, gather_output=False, **common)
            row = mte.TERowParallelLinear(F, H, input_is_parallel=True, **common)
            with torch.no_grad():
                column.weight.copy_(d["w1"][cols[rank]])
                row.weight.copy_(d["w2"][:, cols[rank]])
            x = d["x"][rows].clone().requires_grad_()
            with autocast():
                h, _ = column(x)
                y, _ = row(h)
            y.backward(d["dy"][rows])
            got = {"h": h.detach(), "y": y.detach(), "dx": x.grad, "dw1": column.weight.grad,
                   "dw2": row.weight.grad}  # fmt: skip

            partial_h, partial_y, partial_dx, mine = [], [], [], {}
            for r in range(tp):
                first = te.Linear(H, F // tp, bias=False, params_dtype=torch.bfloat16,
                                  device="cpu")  # fmt: skip
                second = te.Linear(F // tp, H, bias=False, params_dtype=torch.bfloat16,
                                   device="cpu")  # fmt: skip
                with torch.no_grad():
                    first.weight.copy_(d["w1"][cols[r]])
                    second.weight.copy_(d["w2"][:, cols[r]])
                xr = d["x"].clone().requires_grad_()
                with autocast():
                    hr = first(xr)
                    pr = second(hr)
                pr.backward(d["dy"])
                partial_h.append(hr.detach())
                partial_y.append(pr.detach())
                partial_dx.append(xr.grad)
                if r == rank:
                    mine = {"h": hr.detach(), "dw1": first.weight.grad, "dw2": second.weight.grad}
            # The collective adds the ranks' bf16 partials in bf16 (all-reduce without SP,
            # reduce-scatter with it): a bf16 add is the fp32 sum of two bf16 values, rounded.
            want = dict(mine, y=(partial_y[0] + partial_y[1])[rows],
                        dx=(partial_dx[0] + partial_dx[1])[rows])  # fmt: skip
            # Control reference: TP 1, one GEMM over the full K (rounded once).
            whole = te.Linear(F, H, bias=False, params_dtype=torch.bfloat16, device="cpu")
            with torch.no_grad():
                whole.weight.copy_(d["w2"])
            with autocast():
                tp1_y = whole(torch.cat(partial_h, dim=-1)).detach()[rows]
    finally:
        te_extension.swap_first_dims = swap
    return {"got": got, "want": want, "tp1_y": tp1_y}


def _mismatches(result: dict) -> list[str]:
    got, want = result["got"], result["want"]
    return [name for name in ("h", "y", "dx", "dw1", "dw2")
            if not torch.equal(got[name], want[name])]  # fmt: skip


CASES = [("bf16", True), ("mxfp8", True), ("mxfp8", False), ("blockwise", True)]


@pytest.mark.parametrize("recipe, sequence_parallel", CASES,
                         ids=[f"{r}-{'sp' if sp else 'nosp'}" for r, sp in CASES])  # fmt: skip
def test_te_linears_at_tp2_equal_per_shard_linears(recipe, sequence_parallel):
    results = run_on_ranks(tp_pair_run, recipe, sequence_parallel, world_size=2, parallel=TP2,
                           boot=BOOT)  # fmt: skip
    for rank, result in enumerate(results):
        assert _mismatches(result) == [], f"rank {rank}: {_mismatches(result)} differ"
        # Control: a TP-1 product over the full K is rounded once, the TP-2 one twice; the
        # comparison above would see the difference.
        assert not torch.equal(result["got"]["y"], result["tp1_y"]), f"rank {rank}"


def test_control_blockwise_gather_without_the_swap_diverges():
    """The blockwise sequence-parallel gather with ``tex.swap_first_dims`` copying the gathered
    blocks in arrival order: the run completes and its outputs differ."""
    results = run_on_ranks(tp_pair_run, "blockwise", True, "no_swap", world_size=2,
                           parallel=TP2, boot=BOOT)  # fmt: skip
    assert any(_mismatches(result) for result in results)
