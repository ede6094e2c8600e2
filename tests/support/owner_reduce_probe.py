"""What the ranks issue in the compact layout's gradient sync, read off the process group.

:func:`issued_grad_syncs` records, on one rank, every ``torch.distributed.reduce`` (with its
destination) and every all-reduce or reduce-scatter of a compact bucket's grad buffer (the
Muon-managed gradients). :meth:`GradSyncLog.verdict` then places each reduce in its bucket and
checks it against the plugin's ownership table (each compact bucket group's
``CompactGroup.segments``: rank -> the pieces it owns, built from the optimizer's ``owner_of``),
through where each piece's gradient really lies (its parameter's ``main_grad`` view in the
buffer), not through the owner reduce's own spans.

:func:`compared_with_rank_order` compares each owner reduce gloo really ran with the sum the
ordered runs compute (the same addends added in rank order, ``ordered_grad_sync`` of
``tests/mechanics/test_compact_grad_sync.py``) under the rounding bound of the arithmetic:
both are sums of the same ``n`` floating-point addends, each addition rounded once. Any order of
summing ``n`` terms in a format of unit roundoff ``u`` (``eps / 2``) is within
``gamma(n - 1) * sum |x_i|`` of the exact sum, ``gamma(k) = k u / (1 - k u)`` (Higham, Accuracy
and Stability of Numerical Algorithms, 2nd ed., section 4.2; a summation tree of height ``h``
gives ``gamma(h)``, and ``h <= n - 1``; an addition that underflows is exact, so no absolute term).
Two orders therefore differ by at most ``2 gamma(n - 1) sum |x_i|``, per element: at DP 4 in fp32
``6u / (1 - 3u) = 3 eps / (1 - 3u)``, about ``3.6e-7 * sum |x_i|``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

# --------------------------------------------------------------------------- what is issued


def _extent(tensor: torch.Tensor) -> tuple[int, int, int]:
    return tensor.data_ptr(), tensor.numel(), tensor.element_size()


def _piece_ranges(piece: Any, parent: torch.Tensor) -> list[tuple[int, int]]:
    """Where ``piece`` lies in its parameter, flattened: a QKV part one run per query group, an
    expert slice its experts, a whole parameter all of it."""
    from nemo_lw_fp8.mechanics import expert_slices, qkv_parts

    if qkv_parts.is_part(piece):
        return list(piece.flat_ranges)
    if expert_slices.is_slice(piece):
        return [piece.flat_range]
    return [(0, parent.numel())]


def owner_map(group: Any, bucket: Any) -> torch.Tensor:
    """Per element of ``bucket``'s grad buffer, the group rank that owns the gradient there by
    the ownership table (-1: owned by nobody, -2: by two ranks)."""
    from nemo_lw_fp8.mechanics import expert_slices
    from nemo_lw_fp8.state import group_state

    grad = bucket.grad_data
    owners = torch.full((grad.numel(),), -1, dtype=torch.int64)
    base, size = grad.data_ptr(), grad.element_size()
    for rank, pieces in enumerate(group_state(group).compact.segments):
        for piece in pieces:
            parent = expert_slices.parent_of(piece)
            view = getattr(parent, "main_grad_copy_in_grad_buffer", None)
            view = parent.main_grad if view is None else view
            start = (view.data_ptr() - base) // size
            if not 0 <= start < grad.numel():
                continue  # another bucket of the group
            for lo, hi in _piece_ranges(piece, parent):
                slot = owners[start + lo : start + hi]
                slot.copy_(torch.where(slot == -1, rank, -2))
    return owners


class GradSyncLog:
    """One rank's grad-sync collectives, as issued (see :func:`issued_grad_syncs`)."""

    def __init__(self, chunks: list[Any]):
        self.chunks = chunks
        #: ((pointer, elements, element size), group_dst) per reduce.
        self.reduces: list[tuple[tuple[int, int, int], Any]] = []
        #: (pointer, elements, element size) per all-reduce or reduce-scatter input.
        self.others: list[tuple[int, int, int]] = []

    def _buckets(self) -> list[tuple[Any, Any]]:
        """The compact buckets with an ownership table (the owner reduce's and the all-reduce
        path's alike; none in a run without the compact layout)."""
        from nemo_lw_fp8.mechanics import compact
        from nemo_lw_fp8.state import peek

        return [
            (group, bucket)
            for chunk in self.chunks
            for group in compact.compact_groups(chunk)
            if getattr(peek(group), "compact", None) is not None
            for bucket in group.buckets
        ]

    def verdict(self, syncs: int) -> dict:
        """Reduces into compact buckets (and anywhere else), those whose destination is not the
        owner of every element they cover, all-reduces / reduce-scatters of Muon gradients,
        elements the table leaves unowned or owns twice, and whether every element of every
        compact bucket was reduced exactly ``syncs`` times (once per grad sync)."""
        places = []
        for group, bucket in self._buckets():
            grad = bucket.grad_data
            places.append((grad.data_ptr(), grad.numel(), owner_map(group, bucket)))
        covered = [torch.zeros(n, dtype=torch.int64) for _, n, _ in places]
        found = {"reduces": 0, "elsewhere": 0, "misdirected": [], "muon_all_reduces": 0}
        for (pointer, numel, size), dst in self.reduces:
            for (base, n, owners), cover in zip(places, covered, strict=True):
                start = (pointer - base) // size
                if pointer >= base and start + numel <= n:
                    found["reduces"] += 1
                    cover[start : start + numel] += 1
                    span = owners[start : start + numel]
                    if dst is None or not bool((span == dst).all()):
                        found["misdirected"].append((start, numel, dst, span.unique().tolist()))
                    break
            else:
                found["elsewhere"] += 1
        for pointer, numel, size in self.others:
            end = pointer + numel * size
            found["muon_all_reduces"] += any(
                pointer < base + n * size and base < end for base, n, _ in places
            )
        found["buckets"] = len(places)
        found["unowned"] = sum(int((owners < 0).sum()) for _, _, owners in places)
        found["coverage"] = sorted({int(c) for cover in covered for c in cover.unique()})
        found["syncs"] = syncs
        return found


@contextlib.contextmanager
def issued_grad_syncs(chunks: list[Any]):
    """While open, every reduce, all-reduce and megatron reduce-scatter this rank issues is
    recorded (then passed on to whatever stood there: gloo, or a test's stand-in) in the
    :class:`GradSyncLog` it yields. Open it after the model and optimizer are built (the compact
    groups exist) and inside any stand-in whose calls should be seen."""
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as pgb

    log = GradSyncLog(chunks)
    reduce, all_reduce, reduce_scatter = dist.reduce, dist.all_reduce, pgb.dist_reduce_scatter_func

    def recorded_reduce(tensor, *args, **kwargs):
        log.reduces.append((_extent(tensor), kwargs.get("group_dst")))
        return reduce(tensor, *args, **kwargs)

    def recorded_all_reduce(tensor, *args, **kwargs):
        log.others.append(_extent(tensor))
        return all_reduce(tensor, *args, **kwargs)

    def recorded_reduce_scatter(output, tensor, *args, **kwargs):
        log.others.append(_extent(tensor))
        return reduce_scatter(output, tensor, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dist, "reduce", recorded_reduce)
        mp.setattr(dist, "all_reduce", recorded_all_reduce)
        mp.setattr(pgb, "dist_reduce_scatter_func", recorded_reduce_scatter)
        yield log


def assert_reduced_to_owners(results: list[dict], label: str = "") -> None:
    """Every rank's grad syncs (``result["grad_sync"]``, a :meth:`GradSyncLog.verdict`) were
    owner reduces: reduces issued, each to the owner of every element it covers, each element of
    every Muon bucket reduced once per sync, no all-reduce or reduce-scatter of a Muon gradient."""
    for rank, result in enumerate(results):
        seen = result["grad_sync"]
        where = f"{label} rank {rank}: {seen}"
        assert seen["buckets"] > 0 and seen["syncs"] > 0, where
        assert seen["reduces"] > 0 and seen["misdirected"] == [], where
        assert seen["unowned"] == 0 and seen["coverage"] == [seen["syncs"]], where
        assert seen["muon_all_reduces"] == 0 and seen["elsewhere"] == 0, where


def assert_all_reduced(results: list[dict], label: str = "") -> None:
    """The probe's control: a ``grad_sync="all_reduce"`` run issued no reduce and all-reduced
    Muon gradients (what :func:`assert_reduced_to_owners` would see after a fallback)."""
    for rank, result in enumerate(results):
        seen = result["grad_sync"]
        where = f"{label} rank {rank}: {seen}"
        assert seen["buckets"] > 0 and seen["reduces"] == 0, where
        assert seen["muon_all_reduces"] >= seen["syncs"] > 0, where


def assert_no_reduce(results: list[dict], label: str = "") -> None:
    """A reference the owner-reduced runs are compared with that has no compact bucket (plain
    Muon, megatron's padded layer-wise layout) issued no reduce at all in its grad syncs."""
    for rank, result in enumerate(results):
        seen = result["grad_sync"]
        where = f"{label} rank {rank}: {seen}"
        assert seen["syncs"] > 0 and seen["buckets"] == 0, where
        assert seen["reduces"] == 0 and seen["elsewhere"] == 0, where


# --------------------------------------------------------------------------- on a test's run


def owner_reduced(scenario: Any) -> bool:
    """Whether a ``tests.support.scenarios.Scenario`` syncs its Muon gradients by the owner
    reduce: the compact layout, ``grad_sync`` left at its default or set to it."""
    return scenario.distribution == "layerwise_compact" and scenario.grad_sync in (
        None, "reduce_to_owner")  # fmt: skip


def train_probed(scenario: Any, run: Any = None, *args: Any) -> dict:
    """``run(scenario, *args)`` (``tests.support.training.train``, or a test's variant of it
    that builds through ``training.wrap_and_build_optimizer``) with what this rank's grad syncs
    issued in ``result["grad_sync"]`` (:meth:`GradSyncLog.verdict`, one sync per optimizer
    step): the probe on a run a test makes anyway. The probe opens when the optimizer is built
    and closes after ``run`` returns: a stand-in for ``torch.distributed``'s reduce, all-reduce
    or megatron's reduce-scatter that should be seen must be opened around this call, not
    inside ``run`` (closed first, it would be put back by the probe's own undo)."""
    from tests.support import training

    build = training.wrap_and_build_optimizer
    found: dict = {}
    steps: list[int] = []

    with contextlib.ExitStack() as stack:

        def probed(module, config, built_scenario):
            model, optimizer = build(module, config, built_scenario)
            found["log"] = stack.enter_context(issued_grad_syncs(model))
            step = optimizer.step

            def counted_step(*step_args, **step_kwargs):
                steps.append(1)
                return step(*step_args, **step_kwargs)

            optimizer.step = counted_step
            return model, optimizer

        mp = stack.enter_context(pytest.MonkeyPatch.context())
        mp.setattr(training, "wrap_and_build_optimizer", probed)
        result = (run or training.train)(scenario, *args)
    if "log" not in found:
        raise RuntimeError("train_probed: the run built no optimizer through the probe")
    result["grad_sync"] = found["log"].verdict(syncs=len(steps))
    return result


def run_probed(run: Any, *args: Any, **kwargs: Any) -> dict:
    """``run(*args, **kwargs)``, probed as :func:`train_probed` probes it: for a test's own
    training function of any signature (not scenario first, keyword arguments) that builds one
    model and optimizer through ``training.wrap_and_build_optimizer`` and steps that
    optimizer. Pass it to ``run_on_ranks`` as the function, ``run`` as its first argument."""
    return train_probed(None, lambda _, *rest: run(*rest, **kwargs), *args)


def run_probed_per_build(run: Any, *args: Any, **kwargs: Any) -> dict:
    """``run(*args, **kwargs)``, a test's function that builds several models and optimizers
    one after the other through ``training.wrap_and_build_optimizer`` (a checkpoint round trip:
    the run saved, the build it is loaded into), with one :meth:`GradSyncLog.verdict` per build,
    in build order, in ``result["grad_syncs"]``: each build's probe opens when it is built and
    closes when the next one is (so each log holds its own model's syncs only; a build must be
    done stepping when the next starts), the last one after ``run`` returns. Read it with
    :func:`assert_each_build_reduced_to_owners`."""
    from tests.support import training

    build = training.wrap_and_build_optimizer
    builds: list[tuple[contextlib.ExitStack, GradSyncLog, list[int]]] = []

    def probed(module, config, built_scenario):
        model, optimizer = build(module, config, built_scenario)
        if builds:
            builds[-1][0].close()
        stack = contextlib.ExitStack()
        log, steps = stack.enter_context(issued_grad_syncs(model)), []
        builds.append((stack, log, steps))
        step = optimizer.step

        def counted_step(*step_args, **step_kwargs):
            steps.append(1)
            return step(*step_args, **step_kwargs)

        optimizer.step = counted_step
        return model, optimizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(training, "wrap_and_build_optimizer", probed)
        try:
            result = run(*args, **kwargs)
        finally:
            if builds:
                builds[-1][0].close()
    if not builds:
        raise RuntimeError("run_probed_per_build: the run built no optimizer through the probe")
    result["grad_syncs"] = [log.verdict(syncs=len(steps)) for _, log, steps in builds]
    return result


def assert_each_build_reduced_to_owners(results: list[dict], label: str = "") -> None:
    """:func:`assert_reduced_to_owners` for every build of a :func:`run_probed_per_build` run,
    and every rank made as many builds."""
    builds = {len(result["grad_syncs"]) for result in results}
    assert len(builds) == 1, f"{label}: builds per rank {builds}"
    for index in range(builds.pop()):
        per_rank = [{"grad_sync": result["grad_syncs"][index]} for result in results]
        assert_reduced_to_owners(per_rank, f"{label} build {index}")


# --------------------------------------------------------------------------- gloo vs rank order


def rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts[0] + parts[1] + ...`` in that order, in their dtype (``ordered_grad_sync``'s)."""
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def sum_order_bound(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per element, the most two summation orders of ``parts`` can differ by (module doc):
    ``2 gamma(n - 1) sum |x_i|``, in float64."""
    n = len(parts)
    u = torch.finfo(parts[0].dtype).eps / 2
    gamma = (n - 1) * u / (1 - (n - 1) * u)
    return 2 * gamma * torch.stack(parts).double().abs().sum(0)


class _Compared:
    """Stands for the reduces' works: waits for them, then compares."""

    def __init__(self, works: list[Any], compare):
        self.works, self.compare = works, compare

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []
        if self.compare is not None:
            self.compare()
            self.compare = None


def order_free(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per element, whether every order of summing ``parts`` gives the same bits: every partial
    sum of every order is a sum of a subset of the addends, so when each subset's exact sum is
    representable in the addends' dtype, every addition is exact and any order yields the exact
    sum. The subset sums are formed in float64, exact when the nonzero addends' exponents span
    at most ``53 - p - 2`` (``p``: the dtype's significand bits; fp32: 27), checked too."""
    stacked = torch.stack(parts).double()
    dtype = parts[0].dtype
    bits = int(round(-torch.log2(torch.tensor(torch.finfo(dtype).eps)).item())) + 1
    exponents = torch.frexp(stacked).exponent
    nonzero = stacked != 0
    top = torch.where(nonzero, exponents, torch.iinfo(exponents.dtype).min).amax(0)
    low = torch.where(nonzero, exponents, torch.iinfo(exponents.dtype).max).amin(0)
    free = ~nonzero.any(0) | (top - low <= 53 - bits - 2)
    for subset in range(1, 2 ** len(parts)):
        chosen = [i for i in range(len(parts)) if subset >> i & 1]
        total = stacked[chosen].sum(0)
        free &= total.to(dtype).double() == total
    return free


def _compare(result: torch.Tensor, parts: list[torch.Tensor], stats: dict) -> None:
    ordered = rank_order_sum(parts)
    bound = sum_order_bound(parts)
    gap = (result.double() - ordered.double()).abs()
    free = order_free(parts)
    stats["elements"] += result.numel()
    stats["order_free"] += int(free.sum())
    # Order-free elements bit for bit (any order gives the exact sum), the others in the bound.
    stats["over"] += int(((result != ordered) & free).sum() + (gap > bound)[~free].sum())
    stats["differing"] += int((result != ordered).sum())
    positive = bound > 0
    if bool(positive.any()):
        stats["worst"] = max(stats["worst"], float((gap[positive] / bound[positive]).max()))
    # The bound's control: the rank-order sum without the last rank's addend leaves it.
    short = rank_order_sum(parts[:-1])
    counted = parts[-1] != 0
    stats["dropped"] += int(counted.sum())
    stats["dropped_within"] += int(((short.double() - ordered.double()).abs() <= bound)[counted]
                                   .sum())  # fmt: skip


@contextlib.contextmanager
def compared_with_rank_order():
    """While open, every call of the owner reduce (``owner_reduce.reduce_spans``) first gathers
    each rank's addends (the process group's own ``allgather``, which no ``torch.distributed``
    wrapper sees), lets the real reduces run, and on each span's owner, once they are done
    (synchronous, or at the wait of an overlapped sync), compares the reduced values with the
    rank-order sum of the addends: bit for bit where no order can change the sum
    (:func:`order_free`), elsewhere within :func:`sum_order_bound`. Yields the tallies: syncs,
    elements, ``order_free``, ``over`` (elements failing their comparison), ``differing``
    (bitwise, any element), ``worst`` (largest gap / bound), ``dropped`` / ``dropped_within``
    (the bound's control: elements with a nonzero last addend, and those where leaving it out
    stays within the bound)."""
    from torch.distributed import ReduceOp

    from nemo_lw_fp8.mechanics import owner_reduce

    stats = dict(syncs=0, elements=0, order_free=0, over=0, differing=0, worst=0.0, dropped=0,
                 dropped_within=0)  # fmt: skip
    real = owner_reduce.reduce_spans

    def checked(spans, op, process_group, async_op):
        spans = [(owner, span) for owner, span in spans if span.numel()]
        if not spans:
            return real(spans, op, process_group, async_op)
        if op not in (None, ReduceOp.SUM):
            raise RuntimeError(f"the rank-order comparison sums; the owner reduce asked {op}")
        flat = torch.cat([span.reshape(-1) for _, span in spans])
        parts = [torch.empty_like(flat) for _ in range(process_group.size())]
        process_group.allgather([parts], [flat]).wait()
        works = real(spans, op, process_group, async_op)
        stats["syncs"] += 1

        def compare():
            offset, rank = 0, process_group.rank()
            for owner, span in spans:
                numel = span.numel()
                if owner == rank:
                    addends = [part[offset : offset + numel] for part in parts]
                    _compare(span.reshape(-1), addends, stats)
                offset += numel

        if async_op:
            return [_Compared(works, compare)]
        for work in works:
            work.wait()
        compare()
        return []

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(owner_reduce, "reduce_spans", checked)
        yield stats


def gloo_reduce_against_rank_order(numel: int = 20000) -> dict:
    """On the harness's ranks: ``owner_reduce.reduce_spans`` over gloo (synchronous, then
    overlapped) on fp32 values over 2^-12 .. 2^12 (some zero, some of bf16 precision), in spans
    owned by every rank in turn, compared by :func:`compared_with_rank_order`. Unlike training
    gradients (mostly sums no order changes), most of these sums depend on the order."""
    import torch.distributed as dist

    from nemo_lw_fp8.mechanics import owner_reduce

    group = dist.new_group(list(range(dist.get_world_size())))
    generator = torch.Generator().manual_seed(4502 + group.rank())
    scale = torch.exp2(torch.randint(-12, 13, (numel,), generator=generator).float())
    values = torch.randn(numel, generator=generator) * scale
    values[::97] = 0.0
    values[1::5] = values[1::5].bfloat16().float()
    cuts = torch.linspace(0, numel, 2 * group.size() + 2).long().tolist()
    with compared_with_rank_order() as stats:
        for async_op in (False, True):
            data = values.clone()
            spans = [
                (i % group.size(), data[start:end])
                for i, (start, end) in enumerate(zip(cuts, cuts[1:], strict=False))
            ]
            works = owner_reduce.reduce_spans(spans, dist.ReduceOp.SUM, group, async_op)
            owner_reduce.ReduceWork(works).wait()
    return dict(stats)
