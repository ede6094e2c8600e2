"""nemo_lw_fp8.layout.packing: Newton-Schulz cost, ownership, compact packing, stock reference."""

from __future__ import annotations

import math
import random

import pytest
import torch

from nemo_lw_fp8.layout import packing as lo
from nemo_lw_fp8.planner import param_shapes

# ----------------------------------------------------------------------------- cost


def test_newton_schulz_cost_matrices_and_expert_stacks():
    assert lo.newton_schulz_cost((64, 128)) == 64 * 128 * 64
    assert lo.newton_schulz_cost((7168, 2048)) == 7168 * 2048 * 2048
    # (E, m, n) is orthogonalised per expert: E times one expert's cost
    assert lo.newton_schulz_cost((8, 4096, 7168)) == 8 * lo.newton_schulz_cost((4096, 7168))
    with pytest.raises(ValueError):
        lo.newton_schulz_cost((4096,))
    with pytest.raises(ValueError):
        lo.newton_schulz_cost((2, 3, 4, 5))


# ----------------------------------------------------------------------------- ownership


def _random_matrices(seed: int, n: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    dims = [256, 512, 1024, 1536, 2048, 4096, 7168]
    return [(rng.choice(dims), rng.choice(dims)) for _ in range(n)]


def test_assign_owners_is_deterministic():
    shapes = _random_matrices(0, 300)
    costs = [lo.newton_schulz_cost(s) for s in shapes]
    sizes = [math.prod(s) for s in shapes]
    first = lo.assign_owners(costs, 16, sizes)
    assert lo.assign_owners(list(costs), 16, list(sizes)) == first
    assert lo.assign_owners(tuple(costs), 16, tuple(sizes)) == first
    assert all(0 <= o < 16 for o in first)


def test_assign_owners_tie_breaks():
    # equal costs: lowest rank id first
    assert lo.assign_owners([1, 1, 1], 4) == [0, 1, 2]
    # equal costs: the larger size goes first (to rank 0), then by index
    assert lo.assign_owners([5, 5], 2, sizes=[1, 2]) == [1, 0]
    assert lo.assign_owners([5, 5], 2, sizes=[2, 2]) == [0, 1]
    # initial loads steer the first (largest) item away from a busy rank
    assert lo.assign_owners([10, 1], 2, initial_loads=[7, 0]) == [1, 0]


def test_assign_owners_permutation_invariance():
    rng = random.Random(1)
    # distinct (cost, size) pairs: permuting the inputs permutes the owners
    costs = rng.sample(range(1, 10_000), 200)
    sizes = rng.sample(range(1, 10_000), 200)
    owners = lo.assign_owners(costs, 7, sizes)
    perm = list(range(200))
    rng.shuffle(perm)
    permuted = lo.assign_owners([costs[i] for i in perm], 7, [sizes[i] for i in perm])
    assert permuted == [owners[i] for i in perm]
    # repeated pairs: per-rank cost and size loads do not depend on the order
    shapes = _random_matrices(2, 250)  # many identical shapes
    costs = [lo.newton_schulz_cost(s) for s in shapes]
    sizes = [math.prod(s) for s in shapes]
    owners = lo.assign_owners(costs, 9, sizes)
    rng.shuffle(perm := list(range(250)))
    p_owners = lo.assign_owners([costs[i] for i in perm], 9, [sizes[i] for i in perm])
    p_costs, p_sizes = [costs[i] for i in perm], [sizes[i] for i in perm]
    assert lo.rank_loads(p_costs, p_owners, 9) == lo.rank_loads(costs, owners, 9)
    assert lo.rank_loads(p_sizes, p_owners, 9) == lo.rank_loads(sizes, owners, 9)


def test_assign_owners_meets_its_documented_bound():
    rng = random.Random(3)
    for world in (1, 3, 8, 64):
        costs = [rng.randint(0, 10**6) for _ in range(rng.randint(0, 400))]
        initial = [rng.randint(0, 10**6) for _ in range(world)]
        owners = lo.assign_owners(costs, world, initial_loads=initial)
        loads = [a + b for a, b in zip(initial, lo.rank_loads(costs, owners, world), strict=True)]
        mean = (sum(initial) + sum(costs)) / world
        c_max = max(costs, default=0)
        assert max(loads) <= max(max(initial), mean + c_max * (1 - 1 / world)) + 1e-9


def _stock_and_ours_ns(dp: int, ep: int) -> tuple[float, float]:
    """Per-rank Newton-Schulz totals over data-parallel ranks (rank r = member r // ep of
    expert-data-parallel group r % ep) for megatron's padded layout (bf16 buffers: dense Muon
    over dp, expert Muon over dp / ep) and for the joint cost-balanced assignment."""
    specs = [s.local(ep) for s in param_shapes("deepseek-v3")]
    muon = [s for s in specs if s is not None and s.trainable and s.muon]
    dense = [s for s in muon if not s.expert_parallel]
    expert = [s for s in muon if s.expert_parallel]
    bucket = max(40_000_000, 1_000_000 * dp)
    stock_dense = lo.stock_padded_layout([s.shape for s in dense], dp, bucket)
    stock_expert = lo.stock_padded_layout([s.shape for s in expert], dp // ep, bucket)
    stock = [stock_dense.rank_cost[r] + stock_expert.rank_cost[r // ep] for r in range(dp)]

    joint = lo.assign_owners_joint(
        [lo.newton_schulz_cost(s.shape) for s in dense],
        [lo.newton_schulz_cost(s.shape) for s in expert],
        dp,
        lo.default_expert_groups(dp, ep),
        [s.numel for s in dense],
        [s.numel for s in expert],
    )
    assert all(0 <= o < dp for o in joint.dense)
    assert len(joint.expert) == ep and all(0 <= o < dp // ep for g in joint.expert for o in g)
    assert sum(joint.rank_cost) == sum(stock)  # same matrices, only the owners differ
    return lo.imbalance(stock), lo.imbalance(joint.rank_cost)


@pytest.mark.parametrize(("dp", "ep"), [(64, 8), (256, 8)])
def test_deepseek_v3_newton_schulz_balance(dp, ep):
    stock, ours = _stock_and_ours_ns(dp, ep)
    assert ours <= 1.05
    assert ours < stock


def test_default_expert_groups():
    assert lo.default_expert_groups(8, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lo.default_expert_groups(4, 4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError):
        lo.default_expert_groups(6, 4)
    with pytest.raises(ValueError):
        lo.assign_owners_joint([1], [1], 4, [[0, 1], [1, 2]])


def test_random_matrices_newton_schulz_balance():
    shapes = _random_matrices(4, 600)
    world = 16
    costs = [lo.newton_schulz_cost(s) for s in shapes]
    ours = lo.rank_loads(
        costs, lo.assign_owners(costs, world, [math.prod(s) for s in shapes]), world
    )
    stock = lo.stock_padded_layout(shapes, world, 40_000_000).rank_cost
    assert lo.imbalance(ours) <= 1.05
    assert lo.imbalance(ours) < lo.imbalance(stock)


# ----------------------------------------------------------------------------- compact


def test_compact_offsets_have_no_padding_and_are_consistent():
    shapes = _random_matrices(5, 120)
    sizes = [math.prod(s) for s in shapes]
    world = 6
    owners = lo.assign_owners([lo.newton_schulz_cost(s) for s in shapes], world, sizes)
    c = lo.compact_offsets(sizes, owners, world)
    assert c.padding == 0
    assert c.numel == sum(sizes) == sum(c.rank_sizes)
    # segments in rank order, back to back
    assert c.rank_starts == [sum(c.rank_sizes[:r]) for r in range(world)]
    # every parameter inside its owner's segment; together they tile [0, numel) exactly
    spans = []
    for i, (owner, off) in enumerate(c.offsets):
        assert owner == owners[i]
        assert off >= 0 and off + sizes[i] <= c.rank_sizes[owner]
        assert c.buffer_offsets[i] == c.rank_starts[owner] + off
        spans.append((c.buffer_offsets[i], c.buffer_offsets[i] + sizes[i]))
    spans.sort()
    assert spans[0][0] == 0 and spans[-1][1] == c.numel
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    # input order kept inside a segment
    for r in range(world):
        mine = [i for i in range(len(sizes)) if owners[i] == r]
        assert [c.offsets[i][1] for i in mine] == sorted(c.offsets[i][1] for i in mine)


def test_even_all_gather_plan_reproduces_every_rank_buffer():
    """Simulate the protocol: each rank sends its compact segment as a max-segment chunk, one
    all_gather_into_tensor, copy out: every rank ends with the owners' values everywhere."""
    rng = random.Random(6)
    sizes = [rng.randint(1, 50) for _ in range(40)]
    world = 5
    owners = lo.assign_owners(sizes, world, sizes)
    plan = lo.pack_for_even_all_gather(sizes, owners, world)
    c = plan.layout
    assert plan.segment == max(c.rank_sizes)
    assert plan.gather_numel == world * plan.segment
    assert plan.transient_padding == plan.gather_numel - sum(sizes)
    truth = torch.arange(c.numel, dtype=torch.float32) + 1
    # before the gather a rank has only its own segment right
    buffers = []
    for r in range(world):
        b = torch.zeros(c.numel)
        s = slice(c.rank_starts[r], c.rank_starts[r] + c.rank_sizes[r])
        b[s] = truth[s]
        buffers.append(b)
    chunks = []
    for r in range(world):
        send = torch.full((plan.segment,), float("nan"))  # the tail is don't-care
        send[: c.rank_sizes[r]] = buffers[r][c.rank_starts[r] : c.rank_starts[r] + c.rank_sizes[r]]
        chunks.append(send)
    gathered = torch.cat(chunks)  # all_gather_into_tensor
    for r in range(world):
        for q in range(world):
            n = c.rank_sizes[q]
            buffers[r][c.rank_starts[q] : c.rank_starts[q] + n] = gathered[
                q * plan.segment : q * plan.segment + n
            ]
        assert torch.equal(buffers[r], truth)
    for i, off in enumerate(plan.gather_offsets):
        start = c.buffer_offsets[i]
        assert torch.equal(gathered[off : off + sizes[i]], truth[start : start + sizes[i]])
    assert plan.fits_in(plan.gather_numel * 2) and not plan.fits_in(plan.gather_numel * 2 - 1)


def test_even_gather_fits_bounds_the_padding():
    # segments 100 and 90: an even gather pads 10, 5.3% of 190
    assert lo.even_gather_fits([100, 90], 0.1)
    assert not lo.even_gather_fits([100, 90], 0.05)
    assert lo.even_gather_fits([0, 0], 0.0)
    assert not lo.even_gather_fits([8192, 4096], 0.1) and lo.even_gather_fits(
        [8192, 4096], math.inf
    )


# ----------------------------------------------------------------------------- stock


def test_stock_padded_layout_by_hand():
    """Two matrices over 2 ranks: LPT puts 8192 on shard 0 and 4096 on shard 1; every shard is
    padded to the largest (8192), so the bucket holds 2 x 8192 with 4096 padding."""
    s = lo.stock_padded_layout([(64, 128), (64, 64)], 2, None)
    assert s.owners == [0, 1]
    assert s.numel == 16384 and s.padding_numel == 4096
    assert s.buckets == [(0, 16384, 12288)]
    assert s.rank_numel == [8192, 4096]
    assert s.rank_cost == [64 * 128 * 64, 64 * 64 * 64]


def test_stock_padded_layout_pads_every_shard_to_the_largest():
    shapes = [(s.shape) for s in param_shapes("tiny-moe") if s.muon and not s.expert_parallel]
    s = lo.stock_padded_layout(shapes, 2, 10_000)
    for start, end, _ in s.buckets:
        assert (end - start) % 2 == 0
    assert s.numel - s.padding_numel == sum(math.prod(x) for x in shapes)
    assert sorted(i for b in s.bucket_params for i in b) == list(range(len(shapes)))
    assert len(s.buckets) > 1


def test_stock_distopt_layout_by_hand():
    # backprop order: (64,) at 0, (64, 64) at 64, end 4160 -> padded to lcm(2, 128) = 4224
    s = lo.stock_distopt_layout([(64, 64), (64,)], 2, None)
    assert s.numel == 4224 and s.padding_numel == 64
    assert s.rank_numel == [2112, 4160 - 2112]
    flat = lo.default_buckets([(64, 64), (64,)], None)
    assert flat.numel == 4160 and flat.padding_numel == 0 and flat.bucket_params == [[1, 0]]


def test_split_modules_import_neither_layout_nor_each_other_circularly():
    """layout/packing.py re-exports the cost (layout/ns_cost.py) and megatron's own layouts
    (layout/stock.py); those two never import packing (no import circle; this reads their import
    statements, absolute or relative), and the re-exported names are the same objects."""
    import ast
    from pathlib import Path

    from nemo_lw_fp8.layout import ns_cost
    from nemo_lw_fp8.layout import stock as stock_layout

    allowed = {"ns_cost": set(), "stock": {"ns_cost"}}
    for module in (ns_cost, stock_layout):
        tree = ast.parse(Path(module.__file__).read_text())
        plugin = {
            (node.module or "").split(".")[-1]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            and (node.level > 0 or (node.module or "").startswith("nemo_lw_fp8"))
        } | {
            alias.name.split(".")[-1]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
            if alias.name.startswith("nemo_lw_fp8")
        }
        short = module.__name__.split(".")[-1]
        assert plugin <= allowed[short], (short, plugin)
    assert lo.newton_schulz_cost is ns_cost.newton_schulz_cost
    assert lo.rank_loads is ns_cost.rank_loads
    for name in ("StockLayout", "stock_padded_layout", "stock_distopt_layout", "default_buckets"):
        assert getattr(lo, name) is getattr(stock_layout, name)
