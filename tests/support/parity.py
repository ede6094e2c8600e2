"""Bitwise comparisons of two training runs (the results of :func:`tests.support.training.train`).

:func:`assert_fp8_gather_parity`: FP8 param gather on against off. :func:`assert_same_training`:
two expert-weight presentations (discrete, single grouped, split ownership), compared under
the discrete names. :func:`assert_diverges`: the one way a control (a run expected to differ)
is checked: both runs completed and the comparison fails.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

import torch


def assert_fp8_gather_parity(off: list[dict], on: list[dict]) -> None:
    """Losses, eval losses, forward output, every main_grad, every fp32 master, the weights the
    GEMMs see, and every parameter that is not MXFP8: equal to the last bit on every rank."""
    for rank, (a, b) in enumerate(zip(off, on, strict=True)):
        where = f"rank {rank}"
        assert a["losses"] == b["losses"], f"{where}: losses {a['losses']} != {b['losses']}"
        assert a["eval_losses"] == b["eval_losses"], f"{where}: eval losses differ"
        assert torch.equal(a["probe_output"], b["probe_output"]), f"{where}: forward output"
        for step, (ga, gb) in enumerate(zip(a["main_grads"], b["main_grads"], strict=True)):
            for name, grad in ga.items():
                assert torch.equal(grad, gb[name]), f"{where}: main_grad of {name}, step {step}"
        assert a["masters"].keys() == b["masters"].keys()
        for name, master in a["masters"].items():
            assert torch.equal(master, b["masters"][name]), f"{where}: fp32 master of {name}"
        for name, weight in a["effective_weights"].items():
            assert torch.equal(weight, b["effective_weights"][name]), f"{where}: {name} weight"
        # MXFP8 weights were compared above as the values the GEMMs use; the rest bit for bit.
        mxfp8_weights = {f"{name}.weight" for name in a["effective_weights"]}
        for name, value in a["params"].items():
            if name not in mxfp8_weights:
                assert torch.equal(value, b["params"][name]), f"{where}: param {name}"
    assert len({r["digest"] for r in on}) == 1, "ranks hold different parameters"


def as_discrete(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a single-grouped run's per-parameter tensors to the discrete layout's names."""
    from nemo_lw_fp8.mechanics.grouped_weights import grouped_prefixes, grouped_to_discrete

    shapes = {name: tuple(value.shape) for name, value in named.items()}
    return grouped_to_discrete(named, grouped_prefixes(named, shapes))


def _merged_masters(results: list[dict], key: str = "masters") -> dict[str, torch.Tensor]:
    """Whole-parameter fp32 masters (or, with ``key="momenta"``, Muon momenta) from every rank
    (layer-wise: each is held by its owner; DistOpt: a vector split over shards is joined from
    its pieces in rank order)."""
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        for name, master in as_discrete(result[key]).items():
            if name in merged and merged[name].dim() == master.dim() == 1:
                # A DistributedOptimizer shard boundary falls inside this parameter: its flat
                # pieces are held in rank order (the vectors; layer-wise masters are matrices).
                merged[name] = torch.cat([merged[name], master])
                continue
            assert name not in merged, f"{name} has two owners"
            merged[name] = master
    return merged


def assert_same_losses_and_masters(reference: list[dict], results: list[dict]) -> None:
    """Every loss and every rank's fp32 masters (``"masters"``: name -> tensor), bitwise: the
    comparison of runs whose weights are FP8 on one side and bf16 on the other."""
    assert [r["losses"] for r in reference] == [r["losses"] for r in results]
    for rank, (ref, res) in enumerate(zip(reference, results, strict=True)):
        assert ref["masters"].keys() == res["masters"].keys()
        masters = ref["masters"]
        differ = [k for k in masters if not torch.equal(masters[k], res["masters"][k])]
        assert not differ, f"rank {rank}: masters differ in {differ}"


def assert_same_steps(plain: list[dict], with_eval: list[dict]) -> None:
    """Two runs of one scenario, one with evaluations between its steps: per rank the same
    losses, parameter digest and fp32 masters, bitwise (an evaluation changes no training)."""
    for a, b in zip(plain, with_eval, strict=True):
        assert a["losses"] == b["losses"]
        assert a["digest"] == b["digest"]
        for name, master in a["masters"].items():
            assert torch.equal(master, b["masters"][name])


def assert_same_training(
    discrete: list[dict], single: list[dict], replicas: list[list[int]] | None = None
) -> None:
    """Two runs (either may use single grouped weights): per-step losses, eval losses and every
    parameter on every rank equal to the last bit; with layer-wise runs and snapshots, every
    fp32 master and Muon momentum.

    main_grads and DistOpt master shards are not compared: which rank holds which reduced
    gradient or shard depends on the buffer layout, which the two presentations change.
    """
    for rank, (a, b) in enumerate(zip(discrete, single, strict=True)):
        where = f"rank {rank}"
        assert a["losses"] == b["losses"], f"{where}: losses {a['losses']} != {b['losses']}"
        assert a["eval_losses"] == b["eval_losses"], f"{where}: eval losses differ"
        params_a, params_b = as_discrete(a["params"]), as_discrete(b["params"])
        assert params_a.keys() == params_b.keys(), f"{where}: parameter names differ"
        for name, value in params_a.items():
            assert torch.equal(value, params_b[name]), f"{where}: param {name}"
    if discrete[0].get("layer_wise") and "masters" in discrete[0]:
        # Masters are merged over one model replica's ranks; with expert parallelism the ranks
        # of different EP ranks hold different experts under the same names (``replicas``:
        # the rank lists that together hold one copy of each name, default all ranks).
        for ranks in replicas or [list(range(len(discrete)))]:
            ma = _merged_masters([discrete[r] for r in ranks])
            mb = _merged_masters([single[r] for r in ranks])
            assert ma.keys() == mb.keys(), "fp32 masters differ in what they cover"
            for name, master in ma.items():
                assert torch.equal(master, mb[name]), f"fp32 master of {name}"
            if "momenta" in discrete[0]:
                # Momentum reaches the weights only through a normalised Newton-Schulz update
                # (and FP8 / bf16 weights), so a last-bit difference can hide behind equal
                # masters for steps; a resumed run would inherit it. Compare it directly.
                ma = _merged_masters([discrete[r] for r in ranks], "momenta")
                mb = _merged_masters([single[r] for r in ranks], "momenta")
                assert ma.keys() == mb.keys(), "Muon momenta differ in what they cover"
                for name, momentum in ma.items():
                    assert torch.equal(momentum, mb[name]), f"Muon momentum of {name}"


def _completed(results: object) -> bool:
    return (
        isinstance(results, list)
        and bool(results)
        and all(isinstance(r, dict) and "losses" in r for r in results)
    )


def assert_diverges(
    reference: list[dict],
    results: list[dict],
    compare: Callable[[list[dict], list[dict]], None] = assert_fp8_gather_parity,
    *,
    match: str | None = None,
) -> str:
    """A control: ``reference`` and ``results`` are two runs that completed on every rank, and the
    bitwise ``compare`` of them fails (with a message matching ``match`` when given). Returns
    what differed.

    Call it with the runs' results, never around the runs: a rank that raises fails the test
    with :class:`~tests.support.harness.RankFailure` (not an ``AssertionError``), so a crash
    can never pass for a divergence. Errors other than a failed assertion inside ``compare``
    (missing keys, mismatched rank counts) propagate too.
    """
    for label, run in (("reference", reference), ("results", results)):
        if not _completed(run):
            raise TypeError(
                f"assert_diverges: {label} is not the per-rank results of a completed run "
                f"(got {type(run).__name__})"
            )
    try:
        compare(reference, results)
    except AssertionError as difference:
        what = str(difference) or repr(difference)
        if match is not None and not re.search(match, what):
            raise AssertionError(
                f"the runs differ, but not as the control expects ({match!r}): {what}"
            ) from difference
        return what
    raise AssertionError(
        f"control did not diverge: {getattr(compare, '__name__', compare)} held bit for bit"
    )


# --------------------------------------------------------------------------- order-free norms


def _exact_l2_norm(
    grads_for_norm: list[torch.Tensor] | torch.Tensor,
    norm_type: float = 2,
    grad_stats_parallel_group=None,
) -> torch.Tensor:
    """megatron's ``get_grad_norm_fp32`` (l2), computed so that no summation order shows.

    Each gradient element squared in float64 is exact (an fp32 or bf16 significand squared fits
    float64's), every rank's squares are gathered to every rank, and ``math.fsum`` rounds their
    exact sum once: the result depends on the multiset of gradient values only, not on how
    ownership split them over ranks and tensors, nor on the CPU's reduction kernels.
    """
    import math

    import torch.distributed as dist

    if float(norm_type) != 2.0:
        raise ValueError(f"exact_grad_norm covers the l2 norm only, not norm_type={norm_type}")
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    local = [g.detach().reshape(-1).to(torch.float64) for g in grads_for_norm]
    squares = torch.cat(local).square() if local else torch.zeros(0, dtype=torch.float64)
    everyone: list = [None] * dist.get_world_size(group=grad_stats_parallel_group)
    dist.all_gather_object(everyone, squares.tolist(), group=grad_stats_parallel_group)
    total = math.fsum(value for rank in everyone for value in rank)
    return torch.tensor([math.sqrt(total)], dtype=torch.float32)


@contextlib.contextmanager
def exact_grad_norm() -> Iterator[None]:
    """Inside the ranks: the optimizers' grad norm as :func:`_exact_l2_norm` (the layer-wise
    optimizer's and megatron's chained / mixed-precision call sites). Two runs whose gradients
    hold the same values then clip by the same coefficient by construction."""
    import pytest
    from megatron.core.optimizer import layer_wise_optimizer, optimizer

    with pytest.MonkeyPatch.context() as mp:
        for module in (layer_wise_optimizer, optimizer):
            mp.setattr(module, "get_grad_norm_fp32", _exact_l2_norm)
        yield
