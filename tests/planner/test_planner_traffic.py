"""The planner's traffic model (issue 19), nemo_lw_fp8.planner.traffic: compact buckets against
megatron's, owner-reduce gradient traffic by hand, virtual pipeline chunks, owner assignment,
and the rows ``nemo-lw-fp8 plan`` prints."""

from __future__ import annotations

import json
import math

import pytest

from nemo_lw_fp8.cli import plan as plan_cli
from nemo_lw_fp8.planner import rank_plan as planner
from nemo_lw_fp8.planner.shapes import ParamSpec, param_shapes

# ----------------------------------------------------------------------------- traffic (issue 19)


def _matrices(shapes):
    return [ParamSpec(f"decoder.layers.0.m{i}.weight", shape, muon=True) for i, shape in
            enumerate(shapes)]  # fmt: skip


@pytest.mark.parametrize("dp", [2, 8, 64])
def test_compact_buckets_end_where_megatron_padded_buckets_end(dp):
    """No cap: the compact buckets hold the same parameters as megatron's padded buckets (its
    own layout code), so the compact layout has as many bucket groups; cap 0: megatron's plain
    DDP buckets."""
    from nemo_lw_fp8.layout import packing as lo

    shapes = [(4096, 9216), (8192, 4096), (128, 4096), (1536, 4096), (4096, 1536)] * 6
    numels = [math.prod(s) for s in shapes][::-1]
    padded = lo.stock_padded_layout(shapes, dp, 40_000_000)
    counts = lo.compact_bucket_counts(numels, 40_000_000, dp)
    assert counts == [len(b) for b in padded.bucket_params]
    plain = lo.default_buckets(shapes, 40_000_000)
    assert lo.compact_bucket_counts(numels, 40_000_000, dp, cap=0) == [
        len(b) for b in plain.bucket_params
    ]
    capped = lo.compact_bucket_counts(numels, 40_000_000, dp, cap=100_000_000)
    assert len(capped) >= len(counts)
    assert lo.compact_bucket_counts(numels, None, dp) == [len(numels)]


def test_owner_reduce_traffic_by_hand():
    """Four equal matrices on four ranks: each owns one, sends the other three once (3/4 of the
    group, an exact reduce-scatter) in one reduce per owner, in place; the all-reduce path sends
    twice that. One matrix four
    times larger: the padded layout pads every shard to it, the owner-reduce path does not."""
    from nemo_lw_fp8.planner.traffic import rank_traffic

    even = rank_traffic([_matrices([(64, 64)] * 4)], 4, bucket_size=10**9)
    assert even["compact_owner_reduce"]["grad_wire_over_exact"] == 1.0
    assert even["compact_all_reduce"]["grad_wire_over_exact"] == 2.0
    # In place: the only transient is the gather's bf16 receive buffer, as without owner reduce.
    assert even["compact_owner_reduce"]["transient_peak_bytes"] == 4 * 64 * 64 * 2
    assert even["compact_owner_reduce"]["grad_reduces"] == 4
    # Eight matrices, two per rank: still one reduce per owner (owner order in the bucket).
    eight = rank_traffic([_matrices([(64, 64)] * 8)], 4, bucket_size=10**9)
    assert eight["compact_owner_reduce"]["grad_reduces"] == 4
    uneven = rank_traffic([_matrices([(128, 128)] + [(64, 64)] * 4)], 4, bucket_size=10**9)
    owner = uneven["compact_owner_reduce"]
    n = 128 * 128 + 4 * 64 * 64
    # The worst rank owns one small matrix: it sends everything else once.
    assert owner["grad_wire_bytes"] == (n - 64 * 64) * 4
    assert owner["exact_reduce_scatter_bytes"] == n * 3 // 4 * 4
    stock = uneven["stock_padded"]
    assert stock["padding_numel"] > 0 and stock["grad_wire_over_exact"] > 1.5
    assert owner["padding_numel"] == 0
    assert owner["gather_collectives"] == stock["gather_collectives"] == 1
    assert owner["newton_schulz"]["lower_bound"] == pytest.approx(128**3 * 4 / (128**3 + 4 * 64**3))


def test_traffic_lays_out_each_virtual_pipeline_chunk_on_its_own():
    """megatron buckets only chunk 0 of pipeline rank 0 and gives every later chunk one bucket
    group; the padded layout pads each chunk's buffer on its own, so two chunks of one matrix
    each pad twice where one merged buffer would pad once. Ownership spans both chunks."""
    from nemo_lw_fp8.planner.traffic import rank_traffic

    chunk = _matrices([(256, 256)])
    two = rank_traffic([chunk, chunk], 4, pp_rank=1)
    one = rank_traffic([chunk + chunk], 4, pp_rank=1)
    assert two["stock_padded"]["padding_numel"] == 2 * 3 * 256 * 256
    assert one["stock_padded"]["padding_numel"] < two["stock_padded"]["padding_numel"]
    assert two["compact_owner_reduce"]["grad_collectives"] == 2
    assert one["compact_owner_reduce"]["grad_collectives"] == 1
    # One layer-wise optimizer over both chunks: the two matrices go to two different ranks.
    assert two["compact_owner_reduce"]["newton_schulz"]["max_over_mean"] == 2.0


def test_refine_owners_beats_lpt_where_lpt_is_not_optimal():
    """LPT puts 3, 2, 2 on one rank (7) where 3 + 3 | 2 + 2 + 2 gives 6; the local search after
    it finds 6. Deterministic, and never worse than LPT."""
    from nemo_lw_fp8.layout import packing as lo

    costs = [3, 3, 2, 2, 2]
    lpt = lo.assign_owners(costs, 2)
    assert max(lo.rank_loads(costs, lpt, 2)) == 7  # control: LPT alone
    refined = lo.refine_owners(costs, lpt, 2)
    assert max(lo.rank_loads(costs, refined, 2)) == 6
    assert refined == lo.refine_owners(costs, lpt, 2)
    assert [p.owner for p in lo.choose_pieces(costs, [1] * 5, 2, ownership="whole")] == refined


def test_expert_owners_start_from_each_members_dense_work():
    """A rank that drew the big dense matrix gets fewer experts: the busiest total is lower than
    balancing each kind on its own. Expert groups outside the data-parallel group fall back."""
    from nemo_lw_fp8.layout import packing as lo

    dense = [8, 1, 1, 1]
    experts = [2] * 8
    own_dense = lo.choose_pieces(dense, [1] * 4, 4, ownership="whole")
    loads = lo.piece_loads(dense, [1] * 4, own_dense, 4)
    initial = lo.expert_initial_loads(loads, [10, 11, 12, 13], [10, 12])
    assert initial == [loads[0], loads[2]]
    joint = lo.piece_loads(experts, [1] * 8, lo.choose_pieces(experts, [1] * 8, 2, None, "whole",
                                                               initial), 2)  # fmt: skip
    alone = lo.piece_loads(experts, [1] * 8, lo.choose_pieces(experts, [1] * 8, 2), 2)
    assert max(a + b for a, b in zip(joint, initial, strict=True)) < max(
        a + b for a, b in zip(alone, initial, strict=True)
    )
    assert lo.expert_initial_loads(loads, [10, 11], [10, 99]) is None


@pytest.mark.parametrize(
    "argv",
    [["--recipe", "tiny_deepseek_v3"], ["tiny-deepseek-v3", "--dp", "2", "--pp", "3", "--ep", "2"]],
    ids=["recipe", "model-form"],
)
def test_plan_cli_prints_the_traffic_model(capsys, argv):
    """``nemo-lw-fp8 plan`` prints, for the configuration asked, the per-chunk traffic rows of
    :func:`nemo_lw_fp8.planner.traffic.rank_traffic` (every pipeline rank; the numbers
    benchmarks/layout.py prints), in JSON and as text."""
    from nemo_lw_fp8.planner import traffic
    from nemo_lw_fp8.planner.pipeline import chunk_param_specs
    from nemo_lw_fp8.planner.recipe_plan import group_experts, model_setup, recipe_setup

    if argv[0] == "--recipe":
        setup = recipe_setup(argv[1])
    else:
        setup = model_setup(
            argv[0], tp=1, pp=3, vpp=None, ep=2, etp=1, cp=1, dp=2, gpu="h100",
            single_grouped_weight=False,
        )  # fmt: skip
    par = setup.par
    expected = []
    for rank in range(par.pp):
        chunks = chunk_param_specs(setup.arch, par, rank)
        if setup.single_grouped_weight:
            chunks = [group_experts(c) for c in chunks]
        row = traffic.rank_traffic(
            chunks, par.data_parallel_size, par.ep, pp_rank=rank, ownership=setup.ownership
        )
        expected.append({"config": f"{argv[0] if argv[0] != '--recipe' else argv[1]} PP{par.pp} "
                         f"VP1 EP{par.ep} DP{par.data_parallel_size} rank {rank}",
                         "key": None, **row})  # fmt: skip
    assert plan_cli.main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["traffic"]
    assert rows == json.loads(json.dumps(expected)) and len(rows) == par.pp
    assert plan_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "\n".join(traffic.format_rows(expected)) in out


@pytest.mark.parametrize("dp, ep", [(4, 1), (4, 2), (8, 4)])
def test_main_table_grad_sync_is_the_owner_reduce_of_the_traffic_rows(dp, ep):
    """The compact column plans the default gradient sync: its wire bytes are the traffic
    model's owner-reduce rows for the same parameters (one chunk), not the all-reduce ones."""
    from nemo_lw_fp8.planner import traffic

    specs = param_shapes("tiny-moe")
    compact = planner.plan("tiny-moe", dp, ep)["layouts"]["compact"]["grad_sync"]
    rows = traffic.rank_traffic([specs], dp, ep)
    assert compact["wire_bytes_per_rank"] == rows["compact_owner_reduce"]["grad_wire_bytes"]
    assert compact["wire_bytes_per_rank"] != rows["compact_all_reduce"]["grad_wire_bytes"]
    upstream = planner.plan("tiny-moe", dp, ep, grad_sync="all_reduce")["layouts"]["compact"]
    assert (
        upstream["grad_sync"]["wire_bytes_per_rank"]
        == (rows["compact_all_reduce"]["grad_wire_bytes"])
    )
