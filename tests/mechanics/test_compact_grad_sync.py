"""The compact layout's gradient sync: each Muon gradient reduced to its owner only.

Bitwise the same training as the all-reduce compact path and as plain Muon (masters, Muon
momentum, losses, parameters, with clipping on so the global grad norm is read), the wire
traffic the plan predicts counted through the process group, a control that breaks the routing,
and a checkpoint resume on the new path.

Gloo sums in an order that depends on where an element sits in the buffer (its ring
reduce-scatter splits the buffer into one chunk per rank; each chunk's sum starts at a different
rank), and the owner layout moves elements. Two addends commute, so DP 2 is bitwise on gloo as it
runs. For DP 4 both runs of a comparison sum the grad sync's collectives in rank order
(:func:`ordered_grad_sync`), so what is compared is which values reach whom, scaled how, not
gloo's chunking; ``test_wire_traffic_equals_the_plan`` compares gloo's own owner reduces at DP 4
with that rank-order sum (bit for bit where no order can change a sum, else within the rounding
bound of two orders: ``tests/support/owner_reduce_probe.py``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from nemo_lw_fp8.cpu.te import backend as te_backend
from nemo_lw_fp8.patches import record
from tests.support import owner_reduce_probe as probe
from tests.support.harness import BootOptions, run_on_ranks
from tests.support.parity import assert_diverges
from tests.support.resumable import resume_mismatches
from tests.support.scenarios import Scenario
from tests.support.training import train

FP8 = BootOptions(fp8_emulation=True)
#: Clipping on: the global grad norm reads the owners' reduced gradients.
COMPACT = Scenario(
    optimizer="muon",
    distribution="layerwise_compact",
    plugin=True,
    clip_grad=0.05,
    snapshots=True,
    bucket_size=2000,
)
needs_te = pytest.mark.skipif(
    te_backend.te_package_dirs() is None, reason="the MXFP8 emulation needs TE's Python package"
)


# --------------------------------------------------------------------------- rank functions


@contextlib.contextmanager
def ordered_grad_sync():
    """Inside every bucket group's ``start_grad_sync``: all_reduce, reduce and reduce-scatter
    sum the ranks' tensors in rank order (gathered, then added 0, 1, 2, ...), the same order
    for every element wherever it sits in the buffer. Elsewhere (grad norm, ...) gloo's own."""
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as pgb

    from nemo_lw_fp8.mechanics import owner_reduce

    group_cls = pgb._ParamAndGradBucketGroup
    originals = {
        "all_reduce": dist.all_reduce,
        "reduce": dist.reduce,
        "reduce_scatter": pgb.dist_reduce_scatter_func,
        "start": group_cls.start_grad_sync,
        "owner_start": owner_reduce.start_grad_sync,
    }
    #: ``n``: inside a grad sync; ``ordered``: collectives summed in rank order so far.
    depth = {"n": 0, "ordered": 0}

    def summed(tensor, group):
        parts = [torch.empty_like(tensor) for _ in range(group.size())]
        group.allgather([parts], [tensor.contiguous()]).wait()
        return probe.rank_order_sum(parts)

    def all_reduce(tensor, *args, **kwargs):
        if not depth["n"]:
            return originals["all_reduce"](tensor, *args, **kwargs)
        depth["ordered"] += 1
        tensor.copy_(summed(tensor, kwargs["group"]))

    def reduce(tensor, *args, **kwargs):
        if not depth["n"]:
            return originals["reduce"](tensor, *args, **kwargs)
        group = kwargs["group"]
        depth["ordered"] += 1
        total = summed(tensor, group)
        if group.rank() == kwargs["group_dst"]:
            tensor.copy_(total)

    def reduce_scatter(output, input, *args, **kwargs):
        if not depth["n"]:
            return originals["reduce_scatter"](output, input, *args, **kwargs)
        group = kwargs["group"]
        depth["ordered"] += 1
        output.copy_(summed(input, group).view(group.size(), -1)[group.rank()])

    def start_grad_sync(self, *args, **kwargs):
        depth["n"] += 1
        try:
            return originals["start"](self, *args, **kwargs)
        finally:
            depth["n"] -= 1


    def owner_start_grad_sync(*args, **kwargs):
        # Reached from the plugin's own start_grad_sync, which a later ``nemo_lw_fp8.apply()``
        # (every plugin scenario's build calls it) may have put back over the class attribute.
        depth["n"] += 1
        try:
            return originals["owner_start"](*args, **kwargs)
        finally:
            depth["n"] -= 1

    # It runs megatron's method: the test-only door lets the fingerprint check count it as that
    # method (the product never opens it, so any other wrapper is refused).
    with record.counted_as(start_grad_sync, originals["start"]), pytest.MonkeyPatch.context() as mp:
        mp.setattr(dist, "all_reduce", all_reduce)
        mp.setattr(dist, "reduce", reduce)
        mp.setattr(pgb, "dist_reduce_scatter_func", reduce_scatter)
        mp.setattr(group_cls, "start_grad_sync", start_grad_sync)
        mp.setattr(owner_reduce, "start_grad_sync", owner_start_grad_sync)
        yield depth


def train_recorded(scenario: Scenario, ordered: bool = False) -> dict:
    """:func:`train`, plus every optimizer state tensor (Muon momentum) of this rank and what
    its grad syncs issued (``grad_sync``: :meth:`probe.GradSyncLog.verdict`, read with
    :func:`probe.assert_reduced_to_owners`); with ``ordered``, grad syncs sum in rank order
    (:func:`ordered_grad_sync`)."""
    from tests.support import training
    from tests.support.dist_checkpoints import optimizer_snapshot

    seen: dict = {}
    build = training.wrap_and_build_optimizer

    norms: list[float] = []
    stack = contextlib.ExitStack()

    def keep(module, config, scenario):
        model, optimizer = build(module, config, scenario)
        seen.update(optimizer=optimizer, module=module)
        # Opened inside the ordering's stand-ins, so what they are asked is recorded.
        seen["log"] = stack.enter_context(probe.issued_grad_syncs(model))
        step = optimizer.step

        def recorded_step(*args, **kwargs):
            result = step(*args, **kwargs)
            norms.append(float(result[1]) if result[1] is not None else None)
            return result

        optimizer.step = recorded_step
        return model, optimizer

    with stack:
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        mp.setattr(training, "wrap_and_build_optimizer", keep)
        counts = stack.enter_context(ordered_grad_sync()) if ordered else None
        result = train(scenario)
    result["grad_sync"] = seen["log"].verdict(syncs=len(norms))
    if counts is not None and not counts["ordered"]:
        raise RuntimeError("ordered_grad_sync summed no grad sync in rank order")
    state = optimizer_snapshot(seen["optimizer"], seen["module"])
    result["state"] = {k: v for k, v in state.items() if k.startswith("layerwise:")}
    result["state_by_part"] = training.state_by_part(seen["optimizer"], seen["module"])
    result["grad_norms"] = norms
    return result


def train_to_wrong_owner(scenario: Scenario) -> dict:
    """Mutation: each span is reduced to the next rank instead of its owner (the owner then
    reads its local, unreduced gradients). Made in the owner reduce's spans, beneath the probe
    of :func:`train_recorded`, which sees the shifted destinations."""
    from nemo_lw_fp8.mechanics import owner_reduce

    reduce_spans = owner_reduce.reduce_spans

    def shifted(spans, op, process_group, async_op):
        size = process_group.size()
        spans = [((owner + 1) % size, span) for owner, span in spans]
        return reduce_spans(spans, op, process_group, async_op)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(owner_reduce, "reduce_spans", shifted)
        return train_recorded(scenario)


_ALL_REDUCE_RUNS: dict = {}


def all_reduce_run(scenario: Scenario, world_size: int = 2, ordered: bool = False,
                   boot: BootOptions = BootOptions()) -> list[dict]:  # fmt: skip
    """The ``grad_sync="all_reduce"`` run of ``scenario`` (a parity's reference, and its
    control's), made once per session; checked to have all-reduced its Muon gradients."""
    key = (scenario, world_size, ordered, boot)
    if key not in _ALL_REDUCE_RUNS:
        runs = run_on_ranks(
            train_recorded, scenario.with_(grad_sync="all_reduce"), ordered,
            world_size=world_size, boot=boot,
        )  # fmt: skip
        probe.assert_all_reduced(runs, "all-reduce path")
        _ALL_REDUCE_RUNS[key] = runs
    return _ALL_REDUCE_RUNS[key]


def fp8_scenario(recipe: str) -> Scenario:
    """FP8 param gather on (MXFP8, or blockwise FP8 codes + scales), overlap on, clipping on."""
    return COMPACT.with_(
        model="fp8mlp",
        fp8=True,
        fp8_recipe=recipe,
        fp8_param_gather=True,
        micro_batch=32,
        overlap=True,
        bucket_size=None,
    )


# --------------------------------------------------------------------------- comparisons


def _equal(a, b) -> bool:
    """Tensors bit for bit, anything else (the param groups' step counts) by ``==``."""
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def _same_training(reference: list[dict], candidate: list[dict]) -> None:
    """Losses and every parameter on every rank, bit for bit."""
    for rank, (a, b) in enumerate(zip(reference, candidate, strict=True)):
        assert a["losses"] == b["losses"], f"rank {rank}: losses {a['losses']} != {b['losses']}"
        for name, value in a["params"].items():
            assert torch.equal(value, b["params"][name]), f"rank {rank}: param {name}"


def _same_masters_and_momentum(reference: list[dict], candidate: list[dict]) -> None:
    """Two compact runs (same owners): every rank's fp32 masters and Muon state, and the global
    grad norm of every step (clipping's input), bit for bit."""
    _same_training(reference, candidate)
    for rank, (a, b) in enumerate(zip(reference, candidate, strict=True)):
        assert a["grad_norms"] == b["grad_norms"], f"rank {rank}: grad norms"
    for rank, (a, b) in enumerate(zip(reference, candidate, strict=True)):
        assert a["masters"].keys() == b["masters"].keys()
        for name, master in a["masters"].items():
            assert torch.equal(master, b["masters"][name]), f"rank {rank}: master of {name}"
        assert a["state"].keys() == b["state"].keys() and a["state"]
        for key, value in a["state"].items():
            assert _equal(value, b["state"][key]), f"rank {rank}: {key}"


def _same_as_plain_muon(plain: list[dict], compact: list[dict]) -> None:
    """Plain (DDP) Muon holds every master on every rank; each compact Muon master (a matrix,
    held by its owner) equals it, and together the owners hold all of them."""
    _same_training(plain, compact)
    owned = set()
    for rank, (a, b) in enumerate(zip(plain, compact, strict=True)):
        for name, master in b["masters"].items():
            if master.dim() >= 2:
                assert torch.equal(master, a["masters"][name]), f"rank {rank}: master of {name}"
                owned.add(name)
    assert owned == {n for n, m in plain[0]["masters"].items() if m.dim() >= 2}


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("world_size", [2, 4])
def test_owner_reduce_equals_all_reduce_and_plain_muon(world_size):
    """Against the all-reduce path with clipping on (the same owners sum the global grad norm
    in the same order: it must be the same bits), overlap on; against plain Muon, overlap off,
    clipping off (plain Muon sums the norm over other groupings, so clipping would part them in
    the last bits for reasons unrelated to the sync). DP 4 sums in rank order (module doc).
    Every owner-reduce run issued reduces, each to the owner of what it covers by the ownership
    table, and no all-reduce of a Muon gradient; the all-reduce run no reduce."""
    ordered = world_size > 2

    def run(scenario):
        results = run_on_ranks(train_recorded, scenario, ordered, world_size=world_size)
        probe.assert_reduced_to_owners(results, f"{scenario.overlap=} {scenario.clip_grad=}")
        return results

    clipped = COMPACT.with_(overlap=True)
    all_reduce = all_reduce_run(clipped, world_size, ordered)
    owner = run(clipped)
    # Clipping acts: every step's norm is above the threshold.
    assert all(min(r["grad_norms"]) > clipped.clip_grad for r in owner), owner[0]["grad_norms"]
    _same_masters_and_momentum(all_reduce, owner)
    plain = run_on_ranks(
        train_recorded, Scenario(optimizer="muon", snapshots=True), ordered, world_size=world_size
    )
    _same_as_plain_muon(plain, run(COMPACT.with_(clip_grad=0.0)))


@needs_te
@pytest.mark.parametrize("recipe", ["mxfp8", "blockwise"])
def test_owner_reduce_with_fp8_param_gather_equals_all_reduce(recipe):
    """FP8 param gather on (MXFP8, or blockwise FP8 codes + scales), overlap on, clipping on;
    the FP8 run's grad syncs were owner reduces (issued, each to its span's owner by the
    ownership table, no all-reduce of a Muon gradient), the all-reduce run's were not."""
    base = fp8_scenario(recipe)
    all_reduce = all_reduce_run(base, boot=FP8)
    owner = run_on_ranks(train_recorded, base, boot=FP8)
    probe.assert_reduced_to_owners(owner, recipe)
    _same_masters_and_momentum(all_reduce, owner)


@pytest.mark.parametrize(
    "fp8", [pytest.param(None, id="bf16"), pytest.param("mxfp8", id="mxfp8", marks=needs_te)]
)
def test_reduce_to_the_wrong_rank_diverges(fp8):
    """Control of both parities above: with each span reduced to the next rank, the comparison
    with the all-reduce run fails (by the numbers: every run completes), and the probe the
    parities assert through sees every such reduce sent past its owner."""
    scenario = COMPACT.with_(overlap=True) if fp8 is None else fp8_scenario(fp8)
    boot = BootOptions() if fp8 is None else FP8
    reference = all_reduce_run(scenario, boot=boot)
    broken = run_on_ranks(train_to_wrong_owner, scenario, boot=boot)
    assert_diverges(reference, broken, compare=_same_masters_and_momentum)
    for rank, result in enumerate(broken):
        seen = result["grad_sync"]
        assert len(seen["misdirected"]) == seen["reduces"] > 0, (rank, seen)
    with pytest.raises(AssertionError, match="rank 0"):
        probe.assert_reduced_to_owners(broken)


# --------------------------------------------------------------------------- the wire


def count_grad_sync(scenario: Scenario) -> dict:
    """Per rank, during steps 1 and 2: the grad-sync collectives the compact bucket groups
    issue (elements this rank sends under the ring model, reduce / all-reduce calls, groups that
    issued any, reduces not done in place in a bucket's grad buffer), with the plan's numbers;
    and each owner reduce gloo ran compared with the rank-order sum of its addends
    (``rank_order``: :func:`probe.compared_with_rank_order`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from nemo_lw_fp8.mechanics import compact, owner_reduce
    from tests.support.scenarios import build_model
    from tests.support.training import train_step, wrap_and_build_optimizer

    module, config = build_model(scenario)
    model, optimizer = wrap_and_build_optimizer(module, config, scenario)
    groups = compact.compact_groups(model[0])
    plans = [compact.group_state(g).compact for g in groups]
    process_group = groups[0].data_parallel_group
    rank, world = process_group.rank(), process_group.size()
    dp_rank = parallel_state.get_data_parallel_rank()
    train_step(scenario, model, optimizer, 0, dp_rank)
    grad_buffers = [
        (b.grad_data.data_ptr(), b.grad_data.numel()) for g in groups for b in g.buckets
    ]
    size = groups[0].buckets[0].grad_data.element_size()

    def in_a_grad_buffer(tensor) -> bool:
        start = tensor.data_ptr()
        end = start + tensor.numel() * size
        return any(p <= start and end <= p + n * size for p, n in grad_buffers)

    # Reduces one per run of one owner's params in megatron's own (backprop) order, as before
    # the owner layout: more than in owner order when an owner's params are not adjacent.
    owner_of = {id(piece): r for p in plans for r, seg in enumerate(p.segments) for piece in seg}
    backprop_runs = sum(
        len(owner_reduce.owner_spans([(owner_of.get(id(p), -1), 1) for p in b.params_list]))
        for g in groups
        for b in g.buckets
    )
    counts = {"sent": 0.0, "reduces": 0, "all_reduces": 0, "launching_groups": 0, "copied": 0}
    active: dict = {"group": None, "issued": False}
    reduce, all_reduce = dist.reduce, dist.all_reduce

    def counted_reduce(tensor, *args, group=None, group_dst=None, **kwargs):
        if active["group"] is not None:
            counts["reduces"] += 1
            counts["sent"] += tensor.numel() if group_dst != rank else 0
            counts["copied"] += int(not in_a_grad_buffer(tensor))
            active["issued"] = True
        return reduce(tensor, *args, group=group, group_dst=group_dst, **kwargs)

    def counted_all_reduce(tensor, *args, **kwargs):
        if active["group"] is not None:
            counts["all_reduces"] += 1
            counts["sent"] += owner_reduce.all_reduce_sent(tensor.numel(), world)
            active["issued"] = True
        return all_reduce(tensor, *args, **kwargs)

    def marked(group, method):
        def start_grad_sync(*args, **kwargs):
            active.update(group=group, issued=False)
            try:
                return method(*args, **kwargs)
            finally:
                counts["launching_groups"] += int(active["issued"])
                active["group"] = None

        return start_grad_sync

    with pytest.MonkeyPatch.context() as mp, probe.compared_with_rank_order() as compared:
        mp.setattr(dist, "reduce", counted_reduce)
        mp.setattr(dist, "all_reduce", counted_all_reduce)
        for group in groups:
            mp.setattr(group, "start_grad_sync", marked(group, group.start_grad_sync))
        for step in (1, 2):
            train_step(scenario, model, optimizer, step, dp_rank)
    planned = [
        owner_reduce.owner_reduce_traffic(
            [(owner, end - start) for spans in p.grad_spans for owner, start, end in spans],
            rank,
            world,
        )
        for p in plans
    ]
    return {
        **counts,
        "rank_order": compared,
        "steps": 2,
        "world": world,
        "groups": len(groups),
        "total": sum(sum(p.segment_numel) for p in plans),
        "owners_per_bucket": sum(
            len({o for o, _, _ in spans}) for p in plans for spans in p.grad_spans
        ),
        "backprop_runs": backprop_runs,
        "planned_sent": sum(t.sent for t in planned),
        "planned_reduces": sum(t.reduces for t in planned),
        "planned_launches": sum(t.launches for t in planned),
    }


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_wire_traffic_equals_the_plan(overlap):
    """Per rank and step: elements sent, reduce calls and launches (one per bucket group) as
    planned, every reduce in place in a bucket's grad buffer (no transient buffer); control: the
    all-reduce path sends twice an exact reduce-scatter, and over all ranks exactly twice the
    owner reduce.

    The same real gloo reduces at DP 4 (synchronous, and overlapped: compared at megatron's
    wait), on each span's owner, against the rank-order sum of the same four fp32 addends, the
    sum every DP 4 parity compares with (:func:`ordered_grad_sync`): bit for bit where no order
    can change the sum, else within ``2 gamma(3) sum |x_i|`` (``gamma(3) = 3u / (1 - 3u)``,
    ``u = 2^-24``: about ``3.6e-7`` of the addends' magnitude), how far two orders of summing
    four terms can part (:mod:`probe`; gradients of bf16 precision mostly sum order-free in
    fp32: ``test_owner_reduce_spans.py`` shows the bound on sums that are not). Control
    of the comparison: leaving out the last rank's addend fails it on 9 elements in 10 at
    least."""
    # The default buckets: one group of 5 params over 4 owners, one owner's two params not
    # adjacent in megatron's order.
    scenario = COMPACT.with_(overlap=overlap, snapshots=False)
    owner = run_on_ranks(count_grad_sync, scenario, world_size=4)
    for counts in owner:
        compared = counts["rank_order"]
        # One owner reduce per group and sync; every rank owns a span (4 owners, one group).
        assert compared["syncs"] == counts["groups"] * counts["steps"], compared
        assert compared["elements"] > 0 and compared["over"] == 0, compared
        assert compared["dropped_within"] * 10 <= compared["dropped"], compared
        steps = counts["steps"]
        assert counts["groups"] >= 1 and counts["all_reduces"] == 0, counts
        assert counts["sent"] == counts["planned_sent"] * steps, counts
        assert counts["reduces"] == counts["planned_reduces"] * steps, counts
        assert counts["copied"] == 0, counts
        assert (
            counts["launching_groups"]
            == counts["planned_launches"] * steps
            == (counts["groups"] * steps)
        ), counts
    # Owner order: one reduce per owner present in a bucket (whole ownership), fewer than in
    # megatron's order.
    assert owner[0]["planned_reduces"] == owner[0]["owners_per_bucket"], owner[0]
    assert owner[0]["planned_reduces"] < owner[0]["backprop_runs"], owner[0]
    world, total = owner[0]["world"], owner[0]["total"]
    # Every rank sends what is not its own: (world - 1) x total over the ranks, the exact
    # reduce-scatter's total.
    assert sum(c["planned_sent"] for c in owner) == (world - 1) * total
    reduced = run_on_ranks(count_grad_sync, scenario.with_(grad_sync="all_reduce"), world_size=4)
    for counts in reduced:
        assert counts["reduces"] == 0, counts
        assert counts["sent"] == 2 * (world - 1) / world * total * counts["steps"], counts
    assert sum(c["sent"] for c in reduced) == 2 * sum(c["sent"] for c in owner)


# --------------------------------------------------------------------------- checkpoint


_RESUME_RUNS: list[tuple[list[dict], str]] = []


def _resume_runs(directory: str) -> tuple[list[dict], str]:
    """5 uninterrupted steps and the checkpoint of the first 3 (owner reduce, overlap), made
    once per session for the resume test and its control."""
    if not _RESUME_RUNS:
        scenario = COMPACT.with_(overlap=True, steps=5)
        uninterrupted = run_on_ranks(train_recorded, scenario)
        run_on_ranks(train_recorded, scenario.with_(steps=3, save_dir=directory))
        _RESUME_RUNS.append((uninterrupted, directory))
    return _RESUME_RUNS[0]


def _resume_mismatches(uninterrupted: list[dict], resumed: list[dict]) -> list[str]:
    """What of the resumed steps 3-4 differs from the run that never stopped (losses, digest,
    fp32 masters and Muon state by name), per rank; empty when nothing does."""
    before = [full["losses"][:3] for full in uninterrupted]
    named = {"masters": "master", "state": "state"}
    return resume_mismatches(uninterrupted, before, resumed, named)


def test_checkpoint_resume_is_bitwise(tmp_path):
    """Save after 3 steps on the owner-reduce path, load in fresh processes, run steps 3-4:
    the same losses, parameters, masters and Muon momentum as 5 uninterrupted steps."""
    from tests.support.harness import get_pool

    scenario = COMPACT.with_(overlap=True, steps=5)
    uninterrupted, directory = _resume_runs(str(tmp_path))
    get_pool(2, BootOptions()).shutdown()
    resumed = run_on_ranks(train_recorded, scenario.with_(first_step=3, load_dir=directory))
    assert _resume_mismatches(uninterrupted, resumed) == []


def train_recorded_with_a_nudged_loaded_master(scenario: Scenario) -> dict:
    """Mutation: :func:`train_recorded` with the first layer-wise master one ulp up after the
    load (:mod:`tests.support.resume_controls`)."""
    from tests.support.resume_controls import nudged_loaded_master

    with nudged_loaded_master():
        return train_recorded(scenario)


def test_control_resume_with_a_master_one_ulp_off_differs(tmp_path):
    """Control of ``test_checkpoint_resume_is_bitwise``: the resumed run with each rank's first
    layer-wise master moved up by one ulp after the load completes and fails the same
    comparison with the same uninterrupted run (the test's own, when it ran first in this
    session), in the masters."""
    uninterrupted, directory = _resume_runs(str(tmp_path))
    scenario = COMPACT.with_(overlap=True, steps=5, first_step=3, load_dir=directory)
    nudged = run_on_ranks(train_recorded_with_a_nudged_loaded_master, scenario)
    bad = _resume_mismatches(uninterrupted, nudged)
    assert any(" master " in item for item in bad), bad


# --------------------------------------------------------------------------- the owner layout


def test_owner_layout_moves_gradients_with_their_params():
    """One bucket re-laid in owner order inside its own grad buffer: each param's gradient view
    (``main_grad``, or ``main_grad_copy_in_grad_buffer`` beside a separate fp32 ``main_grad``)
    moves with the values it held, the bucket's and buffer's indices follow, and a grouped
    weight owned in runs of experts by two ranks gives one span per run."""
    from types import SimpleNamespace

    from nemo_lw_fp8.mechanics import compact_grads, expert_slices

    def param(*shape):
        return torch.nn.Parameter(torch.zeros(shape))

    a, b, grouped, d = param(4, 3), param(2, 2), param(4, 2, 2), param(2, 3)
    first = expert_slices.ExpertSlice(grouped, 0, 2)
    second = expert_slices.ExpertSlice(grouped, 2, 4)
    order = [a, b, grouped, d]  # megatron's (backprop) order in the bucket
    grad = torch.arange(38, dtype=torch.float32)
    grad_data = torch.zeros(40)[2:]  # the bucket is a view of its buffer, from offset 2
    grad_data.copy_(grad)
    to_index, index_map, start = {}, {}, 0
    for p in order:
        slot = grad_data[start : start + p.numel()].view(p.shape)
        if p is d:
            p.main_grad_copy_in_grad_buffer, p.main_grad = slot, torch.full(p.shape, -1.0)
        else:
            p.main_grad = slot
        to_index[p] = (start, start + p.numel())
        index_map[p] = (2 + start, 2 + start + p.numel(), 0)
        start += p.numel()
    before = {id(p): grad[s:e].clone() for p, (s, e) in to_index.items()}
    record = SimpleNamespace(
        pieces={a: [a], b: [b], grouped: [second, first], d: [d]},
        owner_of={a: 1, b: 0, first: 1, second: 0, d: 1},
    )
    bucket = SimpleNamespace(
        params_list=order, grad_data=grad_data, param_to_index=to_index, offset=2
    )
    spans = compact_grads.lay_out_grads_by_owner(bucket, record, [index_map])
    # b (owner 0) first, then a, the grouped weight's first run and d (owner 1), then its
    # second run (owner 0).
    assert spans == [(0, 0, 4), (1, 4, 24), (0, 24, 32), (1, 32, 38)]
    assert to_index == {b: (0, 4), a: (4, 16), grouped: (16, 32), d: (32, 38)}
    for p in order:
        s, e = to_index[p]
        assert index_map[p] == (2 + s, 2 + e, 0)
        slot = d.main_grad_copy_in_grad_buffer if p is d else p.main_grad
        assert slot.data_ptr() == grad_data[s:].data_ptr() and slot.shape == p.shape
        assert torch.equal(slot.reshape(-1), before[id(p)]), p.shape
    assert torch.equal(d.main_grad, torch.full(d.shape, -1.0))  # the fp32 copy is left alone
    assert torch.equal(first.main_grad.reshape(-1), before[id(grouped)][:8])
