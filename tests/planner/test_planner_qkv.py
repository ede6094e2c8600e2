"""Q/K/V split ownership in the planner (nemo_lw_fp8.planner.qkv_split, .ownership, .traffic)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from nemo_lw_fp8.cli import plan as plan_cli
from nemo_lw_fp8.layout import packing as lo
from nemo_lw_fp8.planner import rank_plan as planner
from nemo_lw_fp8.planner.owner_sync import bucket_spans
from nemo_lw_fp8.planner.ownership import our_owners
from nemo_lw_fp8.planner.qkv_split import qkv_parts, unit_costs
from nemo_lw_fp8.planner.shapes import SPECS, ParamSpec, param_shapes
from nemo_lw_fp8.planner.traffic import rank_traffic


def _qkv(name: str, groups: int, split: tuple[int, ...], hidden: int) -> ParamSpec:
    rows = groups * sum(split)
    return ParamSpec(name, (rows, hidden), muon=True, quantized=True, qkv_split=split)


@pytest.mark.parametrize("model", ["qwen3-235b-a22b", "qwen3-next-80b-a3b", "deepseek-v3"])
def test_qkv_split_is_megatrons(model):
    """Every GQA ``linear_qkv`` carries megatron's own ``qkv_split_shapes`` (its
    ``_get_qkv_split_shapes`` of the model's config; Q, gate, K, V with an output gate), and its
    parts tile the weight; MLA (DeepSeek-V3) has no ``linear_qkv``, and nothing else splits."""
    from megatron.core.optimizer.emerging_optimizers import _get_qkv_split_shapes

    spec = SPECS[model]
    config = SimpleNamespace(
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        attention_output_gate=spec.attention_output_gate,
    )
    specs = param_shapes(model)
    qkv = [s for s in specs if "linear_qkv.weight" in s.name]
    assert [s for s in specs if s.qkv_split] == qkv
    if spec.multi_latent_attention:
        assert not qkv
        return
    assert qkv
    for s in qkv:
        assert list(s.qkv_split) == _get_qkv_split_shapes(config)
        parts = qkv_parts(s, "split")
        assert parts.groups == spec.num_query_groups and sum(parts.numels) == s.numel
        assert qkv_parts(s, "whole") is None
        # the split is cheaper to orthogonalize than the fused weight (the cost model's fix)
        assert sum(unit_costs(s, "split")) < unit_costs(s, "whole")[0]


def test_whole_qkv_ownership_is_the_model_without_the_split():
    """``qkv_ownership="whole"`` plans exactly as if no weight were tagged for the split (the
    planner before Q/K/V split ownership); "split" plans differently (control)."""
    specs = param_shapes("tiny-moe")
    untagged = [dataclasses.replace(s, qkv_split=None) for s in specs]
    whole = planner.plan(specs, 4, 2, qkv_ownership="whole")
    before = planner.plan(untagged, 4, 2, qkv_ownership="split")
    split = planner.plan(specs, 4, 2)
    assert split["qkv_ownership"] == "split"
    for result in (whole, before, split):
        result.pop("qkv_ownership")
    assert whole == before
    assert (
        split["layouts"]["compact"]["newton_schulz"] != whole["layouts"]["compact"]["newton_schulz"]
    )
    chunk = [s for s in specs if s.name.startswith("decoder.layers.0.")]
    traffic = rank_traffic([chunk], 4, 2, qkv_ownership="whole")
    assert traffic.pop("qkv_ownership") == "whole"
    untagged_traffic = rank_traffic([[dataclasses.replace(s, qkv_split=None) for s in chunk]], 4, 2)
    untagged_traffic.pop("qkv_ownership")
    assert traffic == untagged_traffic
    with pytest.raises(ValueError, match="qkv_ownership"):
        planner.plan(specs, 4, 2, qkv_ownership="parts")


def test_split_qkv_gives_the_idle_rank_work():
    """Three matrices on four ranks: owned whole, one rank owns nothing and sends every
    gradient (wire 4/3 of an exact reduce-scatter); owned as Q, K, V the five matrices cover
    every rank, each rank's masters are its parts' elements, and the idle rank is gone."""
    qkv = _qkv("decoder.layers.0.self_attention.linear_qkv.weight", 2, (64, 16, 16), 64)
    specs = [qkv, *(ParamSpec(f"m{i}", (64, 128), muon=True) for i in range(2))]
    plans = {
        q: planner.plan(specs, 4, fp8_param_gather=False, qkv_ownership=q)
        for q in ("whole", "split")
    }
    masters = {q: p["layouts"]["compact"]["bytes_by_rank"]["masters"] for q, p in plans.items()}
    assert masters["whole"].count(0) == 1
    own = our_owners(specs, 4, 1, "whole", "split")
    owned = [0] * 4
    for i, spec in enumerate(specs):
        for owner, numel in own.pieces(own.dense, i, spec.numel):
            owned[owner] += numel
    assert masters["split"] == [4 * n for n in owned] and all(owned)
    traffic = {
        q: rank_traffic([specs], 4, bucket_size=10**9, fp8_param_gather=False, qkv_ownership=q)
        for q in plans
    }
    owner = {q: t["compact_owner_reduce"]["grad_wire_over_exact"] for q, t in traffic.items()}
    assert owner["whole"] == pytest.approx(4 / 3)
    assert owner["split"] < owner["whole"]


def test_split_qkv_gradient_layout_and_bound():
    """One bucket: a matrix and a split ``linear_qkv`` (2 query groups) on three ranks. Params
    lie in the order of their first element's owner (the qkv's: Q's); the qkv's elements in
    flattened order, group by group Q, K, V, each on its part's owner: 3 x 2 spans when Q, K
    and V have three owners. The Newton-Schulz bound takes the parts as units."""
    hidden = 32
    split = (32, 8, 8)
    qkv = _qkv("decoder.layers.0.self_attention.linear_qkv.weight", 2, split, hidden)
    matrix = ParamSpec("decoder.layers.0.mlp.linear_fc2.weight", (16, 16), muon=True)
    specs = [qkv, matrix]
    own = our_owners(specs, 3, 1, "whole", "split")
    q_owner, k_owner, v_owner = (owner for owner, _ in own.dense[0])
    assert len({q_owner, k_owner, v_owner}) == 3  # three parts, three ranks
    m_owner = own.dense[1][0][0]
    bucket = [(1, matrix.numel), (0, qkv.numel)]  # backprop order
    runs = [(q_owner, 32 * hidden), (k_owner, 8 * hidden), (v_owner, 8 * hidden)] * 2
    params = sorted([(m_owner, 0, [(m_owner, matrix.numel)]), (q_owner, 1, runs)])
    expected = lo_spans([run for _, _, param_runs in params for run in param_runs])
    assert bucket_spans(bucket, own.dense, own) == expected
    assert len(bucket_spans([(0, qkv.numel)], own.dense, own)) == 3 * 2
    result = rank_traffic([specs], 3, bucket_size=10**9)
    assert result["compact_owner_reduce"]["grad_reduces"] == len(expected)
    costs = [lo.newton_schulz_cost((2 * rows, hidden)) for rows in split]
    total = sum(costs) + lo.newton_schulz_cost(matrix.shape)
    bound = result["compact_owner_reduce"]["newton_schulz"]["lower_bound"]
    assert bound == pytest.approx(max(*costs, lo.newton_schulz_cost(matrix.shape)) * 3 / total)


def lo_spans(pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Runs of one owner merged, written out here (not the mechanism's function)."""
    spans: list[tuple[int, int]] = []
    for owner, numel in pieces:
        if spans and spans[-1][0] == owner:
            spans[-1] = (owner, spans[-1][1] + numel)
        else:
            spans.append((owner, numel))
    return spans


def test_plan_cli_qkv_ownership(capsys):
    """``plan --qkv-ownership whole`` reaches the plan and the traffic rows; split is the
    default."""
    assert plan_cli.main(["tiny-moe", "--dp", "4", "--ep", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["qkv_ownership"] == "split"
    argv = ["--recipe", "tiny_qwen3_30b_a3b", "--qkv-ownership", "whole", "--json"]
    assert plan_cli.main(argv) == 0
    parsed = json.loads(capsys.readouterr().out)
    assert parsed["qkv_ownership"] == "whole"
    assert {row["qkv_ownership"] for row in parsed["traffic"]} == {"whole"}


def test_recipe_plans_resolve_auto_as_the_run_does():
    """``plan --recipe``: the default ``auto`` plans Q / K / V parts on MXFP8 recipes and whole
    weights on blockwise (Hopper) ones, as the compact layout owns them; an explicit ``split``
    on a blockwise recipe is one line naming the flag and the fix (the run refuses it too)."""
    from nemo_lw_fp8.errors import UsageError
    from nemo_lw_fp8.planner import recipe_plan

    mxfp8 = recipe_plan.recipe_setup("qwen3_235b_a22b_mxfp8", [])
    hopper = recipe_plan.recipe_setup("qwen3_235b_a22b_hopper", [])
    assert mxfp8.qkv_ownership == hopper.qkv_ownership == "auto"
    assert recipe_plan.planned_qkv_ownership(mxfp8) == "split"
    assert recipe_plan.planned_qkv_ownership(hopper) == "whole"
    explicit = recipe_plan.recipe_setup("qwen3_235b_a22b_hopper", ["optimizer.qkv_ownership=split"])
    with pytest.raises(UsageError) as caught:
        recipe_plan.planned_qkv_ownership(explicit)
    assert "optimizer.qkv_ownership=split" in caught.value.problem
    assert "optimizer.qkv_ownership=auto" in caught.value.fix
