"""Muon's Newton-Schulz mode at tensor-parallel size 2 under the plugin's layer-wise Muon (issue
29): does the same full gradient give the same update at TP 2 as at TP 1?

One optimizer step of the tiny GPT (megatron's TE spec, TE's modules over the emulated
extension; distribution ``layerwise_compact``, Q/K/V parts owned apart) from the same weights
with the same FULL gradient: every parameter's ``main_grad`` is set to a gradient drawn from the
parameter's name and full (TP 1) shape, sliced to this rank's TP shard along ``partition_dim``.
There is no forward/backward. The DDP grad sync does run (it is part of the step the layout
owns): every data-parallel rank writes the same gradient, DDP scales it by ``1 / DP`` and the
owner reduce (or the sibling DistributedOptimizer's reduce-scatter) adds the DP copies back,
``G / 2 + G / 2 = G`` exactly in fp32 (where DP is over 2 ranks, probed: the Muon gradients'
copies were added by reduces to their planned owners, none all-reduced;
``tests/support/owner_reduce_probe.py``). Each rank then returns every parameter's full weights
(TP shards gathered along ``partition_dim``) before and after the step.

The reference is TP 1 (2 ranks, DP 2). Findings, bitwise on bf16 weights:

* the weights start equal at TP 1 and TP 2 (``use_cpu_initialization`` draws the full master
  weight from the seed and scatters it; checked here, not assumed);
* ``muon_tp_mode="duplicated"``: every parameter, Muon matrices (``linear_qkv`` with its Q, K,
  V parts, ``linear_proj``, ``linear_fc1``, ``linear_fc2``) and Adam's vectors and embeddings,
  equals TP 1's after the step, at TP 2 x DP 1 and at TP 2 x DP 2 (TP peers own the same
  matrices: the compact layout balances ownership over DP from the shards' shapes, which are
  the same on every TP rank, so the all-gather inside Newton-Schulz pairs the same matrix);
* control ``"blockwise"`` (megatron's default): every TP-sharded Muon matrix differs, the
  rest is equal;
* ``"distributed"`` runs, but is TP-invariant only up to summation order: the sharded
  Newton-Schulz matmuls add TP partial products in another order, so some TP-sharded Muon
  matrices differ from TP 1 in the last bits (:data:`DISTRIBUTED_TOLERANCE` bounds the measured
  difference of the update); everything not TP-sharded is equal;
* extended: the MoE GPT's experts (megatron's ``SequentialMLP`` of TE linears, expert TP 2)
  follow the same rule under "duplicated" (bitwise) and "blockwise" (differ).
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import pytest
import torch

from tests.support import owner_reduce_probe as probe
from tests.support.harness import ParallelSpec, run_on_ranks
from tests.support.scenarios import Scenario, boot_for

BASE = Scenario(
    optimizer="muon", model="gpt", distribution="layerwise_compact", plugin=True, steps=1
)
TP1 = ParallelSpec(tp=1)
TP2 = ParallelSpec(tp=2)

#: Largest |update difference| / max |update| measured for "distributed" against TP 1.
DISTRIBUTED_TOLERANCE = 1e-2


def full_gradient(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The gradient every run writes for parameter ``name`` of full (TP 1) ``shape``."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * 0.01


def _full_shape(param: torch.Tensor, tp: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp
    return tuple(shape)


def _tp_shard(full: torch.Tensor, param: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return full
    return full.chunk(tp, dim=param.partition_dim)[rank]


def _gather_full(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value (fp32 of the bf16 bytes): TP shards gathered."""
    from megatron.core import parallel_state as ps

    tp, group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    out = {}
    for name, param in module.named_parameters():
        value = param.detach().float().contiguous()
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            shards = [torch.empty_like(value) for _ in range(tp)]
            torch.distributed.all_gather(shards, value, group=group)
            value = torch.cat(shards, dim=param.partition_dim)
        out[name] = value
    return out


def _redraw_weights(module: torch.nn.Module, tp: int, tp_rank: int) -> None:
    """Every parameter set to its TP shard of a full value drawn from its name, so TP 1 and TP 2
    start equal where TE initialises each rank's shard itself (megatron's ``TEGroupedLinear``
    has no CPU master-weight initialisation: ``use_cpu_initialization`` leaves it empty)."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            generator = torch.Generator().manual_seed(zlib.crc32(b"weight:" + name.encode()))
            full = torch.randn(_full_shape(param, tp), generator=generator) * 0.02
            param.copy_(_tp_shard(full, param, tp, tp_rank).to(param.dtype))


def one_step_from_full_gradient(scenario: Scenario, redraw: bool = False, **overrides: Any) -> dict:
    """On this rank: build (``overrides``: the "moe_grouped" model's config; ``redraw``: weights
    from :func:`_redraw_weights`), write the full gradient's TP shard into every ``main_grad``,
    run the DDP grad sync and one optimizer step; return full weights before and after."""
    from megatron.core import parallel_state as ps

    from tests.support.training import build_model, wrap_and_build_optimizer

    start = time.perf_counter()
    module, config = build_model(scenario, **overrides)
    if redraw:
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        _redraw_weights(module, tp, rank)
    model, optimizer = wrap_and_build_optimizer(module, config, scenario)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    inner = model[0].module
    before = _gather_full(inner)
    model[0].zero_grad_buffer()
    optimizer.zero_grad()
    muon, sharded = [], []
    with torch.no_grad():
        for name, param in inner.named_parameters():
            full = full_gradient(name, _full_shape(param, tp))
            param.main_grad.copy_(_tp_shard(full, param, tp, tp_rank))
            if getattr(param, "is_managed_by_layer_wise_optimizer", False):
                muon.append(name)
            if getattr(param, "tensor_model_parallel", False):
                sharded.append(name)
    model[0].finish_grad_sync()
    ok, _, _ = optimizer.step()
    assert ok, "the optimizer step was skipped"
    return {
        "before": before,
        "after": _gather_full(inner),
        "muon": muon,
        "sharded": sharded,
        "seconds": time.perf_counter() - start,
    }


def _run(mode: str, parallel: ParallelSpec, world_size: int = 2) -> list[dict]:
    """:func:`one_step_from_full_gradient` with ``mode`` on the ranks; with more than one
    data-parallel rank probed: the step's grad sync was an owner reduce."""
    scenario = BASE.with_(muon_tp_mode=mode)
    dp = world_size // parallel.tp
    fn, args = one_step_from_full_gradient, (scenario,)
    if dp > 1:
        fn, args = probe.train_probed, (scenario, one_step_from_full_gradient)
    results = run_on_ranks(
        fn, *args, world_size=world_size, parallel=parallel, boot=boot_for(scenario),
        timeout=600.0,
    )  # fmt: skip
    if dp > 1:
        probe.assert_reduced_to_owners(results, f"{mode}, TP {parallel.tp} x DP {dp}")
    return results


@pytest.fixture(scope="module")
def reference() -> dict:
    """TP 1 x DP 2 ("duplicated": at TP 1 the gather is over one rank, Newton-Schulz the plain
    one)."""
    results = _run("duplicated", TP1)
    _assert_equal(results[0]["after"], results[1]["after"], "TP 1, rank 1 vs rank 0")
    return results[0]


def _assert_equal(a: dict, b: dict, what: str, names=None) -> None:
    names = sorted(a) if names is None else names
    differ = [n for n in names if not torch.equal(a[n], b[n])]
    assert not differ, f"{what}: {differ} differ"


def _check_start_and_agreement(ref: dict, results: list[dict]) -> dict:
    for rank, result in enumerate(results):
        assert sorted(result["before"]) == sorted(ref["before"])
        _assert_equal(ref["before"], result["before"], f"rank {rank}: initial weights vs TP 1")
        _assert_equal(results[0]["after"], result["after"], f"rank {rank} vs rank 0")
    return results[0]


def _muon_kinds(names: list[str]) -> set[str]:
    return {n.split(".")[-2] for n in names}


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_duplicated_is_tp_invariant_bitwise(reference, world_size):
    """TP 2 x DP 1 (and, extended, TP 2 x DP 2) with "duplicated": every parameter equals
    TP 1's."""
    results = _run("duplicated", TP2, world_size)
    got = _check_start_and_agreement(reference, results)
    assert _muon_kinds(got["muon"]) >= {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}
    assert set(got["muon"]) <= set(got["sharded"])
    _assert_equal(reference["after"], got["after"], f"duplicated, {world_size} ranks")
    changed = [n for n in got["muon"] if torch.equal(got["before"][n], got["after"][n])]
    assert not changed, f"{changed} did not move"


def test_blockwise_differs_on_sharded_matrices(reference):
    """Control: "blockwise" orthogonalizes each shard alone; every TP-sharded Muon matrix
    differs from TP 1, everything else is equal."""
    got = _check_start_and_agreement(reference, _run("blockwise", TP2))
    same = [n for n in got["muon"] if torch.equal(reference["after"][n], got["after"][n])]
    assert not same, f"blockwise left {same} as TP 1's"
    rest = [n for n in got["after"] if n not in got["muon"]]
    _assert_equal(reference["after"], got["after"], "blockwise, non-Muon", rest)


def test_distributed_is_tp_invariant_up_to_summation_order(reference):
    """The "distributed" mode runs at TP 2; its Muon updates equal TP 1's only up to the
    summation order of the sharded Newton-Schulz matmuls (measured here); everything else is
    equal."""
    got = _check_start_and_agreement(reference, _run("distributed", TP2))
    rest = [n for n in got["after"] if n not in got["muon"]]
    _assert_equal(reference["after"], got["after"], "distributed, non-Muon", rest)
    worst, differ = 0.0, []
    for name in got["muon"]:
        ref_update = reference["after"][name] - reference["before"][name]
        update = got["after"][name] - got["before"][name]
        if not torch.equal(ref_update, update):
            differ.append(name)
        worst = max(worst, float((update - ref_update).abs().max() / ref_update.abs().max()))
    print(f"distributed: {len(differ)} of {len(got['muon'])} Muon matrices differ; "
          f"largest |update difference| / max |update| = {worst:.3g}")  # fmt: skip
    assert differ, "distributed equals TP 1 bitwise: update the docs"
    assert worst < DISTRIBUTED_TOLERANCE


#: The grouped-expert MoE (megatron's TEGroupedMLP) as it runs at expert TP > 1: TE's
#: ``GroupedLinear`` with discrete weights (megatron fuses through TE's op fuser only at ETP 1),
#: every weight redrawn as the TP shard of a full value so TP 1 and TP 2 start equal.
GROUPED_AT_ETP = dict(redraw=True, use_transformer_engine_op_fuser=False)


@pytest.mark.extended
@pytest.mark.parametrize("model", ["moe_gpt", "moe_grouped"])
def test_duplicated_experts_tp_invariant_bitwise(model):
    """The MoE GPT (4 experts, expert TP = TP) with experts as megatron's SequentialMLP of TE
    linears (``moe_gpt``) or as TEGroupedMLP, TE's ``GroupedLinear`` with discrete weights
    (``moe_grouped``): with "duplicated" every parameter at TP 2 x DP 1 equals TP 1's, experts'
    matrices included (they gather over the expert-TP group); "blockwise" differs on the
    experts' matrices."""
    moe = BASE.with_(model=model)
    overrides = GROUPED_AT_ETP if model == "moe_grouped" else {}

    def run(mode: str, parallel: ParallelSpec) -> list[dict]:
        return run_on_ranks(
            one_step_from_full_gradient, moe.with_(muon_tp_mode=mode), **overrides,
            world_size=2, parallel=parallel, boot=boot_for(moe), timeout=600.0,
        )  # fmt: skip

    ref = run("duplicated", TP1)[0]
    got = _check_start_and_agreement(ref, run("duplicated", TP2))
    experts = [n for n in got["muon"] if ".experts." in n and n in got["sharded"]]
    assert experts, "no TP-sharded expert matrix is a Muon matrix"
    _assert_equal(ref["after"], got["after"], "duplicated, MoE")
    control = _check_start_and_agreement(ref, run("blockwise", TP2))
    same = [n for n in experts if torch.equal(ref["after"][n], control["after"][n])]
    assert not same, f"blockwise left {same} as TP 1's"
