"""Multi-latent attention at tensor parallel 2 with FP8 param gather under layer-wise Muon, through
Megatron-Bridge's own ``pretrain`` (issue 29): ``nemo-lw-fp8 pretrain --cpu`` on 4 CPU ranks
(TP 2 x DP 2, sequence parallel) builds the DeepSeek-V3 tiny recipes as the GPU would, on TE's
own modules: MLA's q / kv down projections are TE linears in ``duplicated`` mode (whole on every
TP rank, their gradients all-reduced over TP by megatron under sequence parallelism), next to
the column-parallel up projections and the row-parallel ``linear_proj``.

The claim, for ``tiny_deepseek_v3`` (MXFP8, single grouped experts) and
``tiny_deepseek_v3_hopper`` (blockwise FP8): FP8 param gather ON = OFF bitwise in the training
and evaluation losses, the grad norms and every rank's fp32 masters and optimizer state; the
per-parameter record (``state_by_name``) names each duplicated down projection once for both TP
ranks, so their masters and momenta must agree across TP (a disagreement fails the run's
record). The Hopper recipe runs with 8 heads and shared experts of 256: its tiny widths (4 heads
of 32: ``linear_proj`` 64 columns per shard; shared experts 64 rows per shard) are refused at
TP 2 by ``fp8-gather-tp-block-boundary`` (blockwise tiles are 128 wide).

Found: upstream, Muon gathered each down projection's two identical TP copies and
orthogonalized the stack (TE tags every linear weight ``partition_dim=0``; megatron clears only
``tensor_model_parallel`` on a duplicated one). ON and OFF did it alike, so ON = OFF could not
see it; the harness step below does: one layer-wise Muon step of a tiny MLA GPT from the same
full gradient gives TP 2 = TP 1 bitwise, every parameter, now that the optimizer build clears
those masters' partition dimension (``nemo_lw_fp8/mechanics/tp_duplicated.py``); control:
without the clearing exactly the down projections differ. The Bridge runs' probe counts the
cleared masters (2 per MLA layer, 4 MLA layers with MTP, owned once per TP slice).

Controls: each gathered weight's columnwise copy left stale diverges (MXFP8: TE's quantizer
refreshes the rowwise copy only; blockwise: receivers skip the columnwise derivation). Resume at
TP 2 (MXFP8): the ON run saves at iteration 2, fresh processes load it and train iteration 3 =
the run that went on, bitwise; control: each rank's first loaded master one ulp up diverges.

Gate: the MXFP8 ON = OFF and the harness step with its control; the rest is ``extended``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.mechanics.test_muon_tp_mode import one_step_from_full_gradient
from tests.support import bridge_runs as br
from tests.support.harness import ParallelSpec, run_on_ranks
from tests.support.scenarios import Scenario, boot_for

pytestmark = pytest.mark.usefixtures("bridge_installed")

MXFP8 = "tiny_deepseek_v3"
HOPPER = "tiny_deepseek_v3_hopper"
TP2_SP = ("model.tensor_model_parallel_size=2", "model.sequence_parallel=true")
#: Blockwise widths whose TP-2 shards are whole 128-wide tiles: q / kv up projections 512 rows,
#: linear_proj 256 columns, shared experts 256 (each half per TP rank).
HOPPER_WIDTHS = ("model.num_attention_heads=8", "model.moe_shared_expert_intermediate_size=256")
SAVED_AT = 2
_runs: dict[str, dict] = {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp-mla")


def _run(tmp: Path, recipe: str, tag: str, *extra: str, mutation: str = "") -> dict:
    key = f"{recipe}-{tag}"
    if key not in _runs:
        widths = HOPPER_WIDTHS if recipe == HOPPER else ()
        _runs[key] = br.pretrain(
            tmp, key, recipe, *TP2_SP, *widths, "train.train_iters=3",
            "validation.eval_interval=2", "train.global_batch_size=4", *extra, nproc=4,
            mutation=mutation, probe=True,
        )  # fmt: skip
    return _runs[key]


def _on(tmp: Path, recipe: str) -> dict:
    """The ON run; the MXFP8 one also saves at iteration 2 (a save must not change what it
    trains)."""
    saving = br.saving_at(tmp, SAVED_AT) if recipe == MXFP8 else ()
    return _run(tmp, recipe, "on", *saving)


def _off(tmp: Path, recipe: str) -> dict:
    return _run(tmp, recipe, "off", *br.GATHER_OFF)


def _resumed(tmp: Path, mutation: str = "") -> dict:
    """Fresh TP-2 processes load the MXFP8 ON run's iteration-2 checkpoint, train iteration 3."""
    _on(tmp, MXFP8)
    loading = br.loading_at(tmp, SAVED_AT)
    return _run(tmp, MXFP8, f"resumed{mutation and '-' + mutation}", *loading, mutation=mutation)


def _duplicated_down_projections(run: dict) -> list[str]:
    """The per-parameter entries of MLA's down projections: not TP-sharded, so one entry each
    for both TP ranks (a TP-sharded parameter is named per TP rank)."""
    names = [name for name in run["state"]["end"] if "_down_proj" in name]
    assert names and not any("/tp" in name for name in names), names
    return names


#: Layer-wise masters of MLA's down projections over the 4 ranks: 2 per MLA layer (3 layers +
#: the MTP layer), each owned by one DP rank in each of the 2 TP slices.
DUPLICATED_MASTERS = 2 * 4 * 2


def _duplicated_masters(run: dict, key: str) -> int:
    return sum(rank[key] for rank in run["probe"])


def _orthogonalized_whole(run: dict) -> None:
    """The layer-wise masters of the duplicated down projections lost TE's partition dimension
    on every rank: Muon orthogonalizes each whole, as at TP 1."""
    assert _duplicated_masters(run, "tp_duplicated") == DUPLICATED_MASTERS, run["probe"]
    assert _duplicated_masters(run, "tp_duplicated_partitioned") == 0, run["probe"]


def test_mla_tp2_mxfp8_gather_on_equals_off_through_bridge(runs):
    on, off = _on(runs, MXFP8), _off(runs, MXFP8)
    br.assert_gather_on_equals_off(on, off, 3)
    assert on["state"]["end"] == off["state"]["end"]
    _duplicated_down_projections(on)
    _orthogonalized_whole(on)
    _orthogonalized_whole(off)


@pytest.mark.extended
def test_control_mla_tp2_duplicated_weights_gathered_over_tp_diverge(runs):
    """Without :mod:`nemo_lw_fp8.mechanics.tp_duplicated`, Muon all-gathers the two identical
    copies of each down projection over TP and orthogonalizes the stack: the first step's loss
    and grad norm (before any update) are the same, the later ones and every rank's state not.
    (The gate's control of the clearing is the harness step's below.)"""
    on = _on(runs, MXFP8)
    stacked = _run(runs, MXFP8, "partitioned", mutation="tp_duplicated_partitioned")
    assert _duplicated_masters(stacked, "tp_duplicated_partitioned") == DUPLICATED_MASTERS
    assert br.losses(stacked)[0] == br.losses(on)[0]
    assert br.grad_norms(stacked)[0] == br.grad_norms(on)[0]
    assert br.grad_norms(stacked)[1:] != br.grad_norms(on)[1:]
    assert stacked["ranks"] != on["ranks"]


@pytest.mark.extended
def test_control_mla_tp2_mxfp8_stale_columnwise_diverges(runs):
    off = _off(runs, MXFP8)
    stale = _run(runs, MXFP8, "stale", mutation="te_stale_columnwise")
    br.assert_stale_columnwise_diverges(off, stale)


@pytest.mark.extended
def test_mla_tp2_hopper_gather_on_equals_off_through_bridge(runs):
    on, off = _on(runs, HOPPER), _off(runs, HOPPER)
    for rank in on["probe"]:  # ON gathered blockwise codes + scales
        assert rank["blockwise_weights"] > 0 and rank["blockwise_groups"] > 0, rank
    for rank in off["probe"]:
        assert rank["blockwise_weights"] == 0 and rank["blockwise_groups"] == 0, rank
    br.assert_gather_on_equals_off(on, off, 3)
    assert on["state"]["end"] == off["state"]["end"]
    _duplicated_down_projections(on)
    _orthogonalized_whole(on)


@pytest.mark.extended
def test_control_mla_tp2_hopper_stale_columnwise_diverges(runs):
    off = _off(runs, HOPPER)
    stale = _run(runs, HOPPER, "stale", mutation="blockwise_columnwise")
    assert all(rank["blockwise_groups"] > 0 for rank in stale["probe"]), stale["probe"]
    br.assert_stale_columnwise_diverges(off, stale)


@pytest.mark.extended
def test_mla_tp2_resume_in_fresh_processes_is_bitwise(runs):
    on, resumed = _on(runs, MXFP8), _resumed(runs)
    br.assert_resumed_goes_on(on, resumed, SAVED_AT)


@pytest.mark.extended
def test_control_mla_tp2_loaded_master_one_ulp_off_diverges(runs):
    on, nudged = _on(runs, MXFP8), _resumed(runs, mutation="nudge_loaded_master")
    assert nudged["ranks"] != on["ranks"]


# --------------------------------------------------------------------------- Muon's update at TP 2

#: One layer-wise Muon step of a tiny MLA GPT from the same full gradient (test_muon_tp_mode.py's
#: method: no forward, every ``main_grad`` the TP shard of a gradient drawn from the parameter's
#: name and full shape), with megatron's TP-invariant Newton-Schulz mode.
MLA_STEP = Scenario(
    optimizer="muon", model="mla_gpt", distribution="layerwise_compact", plugin=True, steps=1,
    muon_tp_mode="duplicated",
)  # fmt: skip


def _step_keeping_partition_dims(scenario: Scenario) -> dict:
    """:func:`one_step_from_full_gradient` with the duplicated weights' masters left as TE
    tagged them (megatron-core 0.19.2's behaviour); the pool's module is restored after."""
    import nemo_lw_fp8.mechanics.tp_duplicated as tp_duplicated

    fixed = tp_duplicated.unpartition_duplicated_masters
    tp_duplicated.unpartition_duplicated_masters = lambda optimizer: []
    try:
        return one_step_from_full_gradient(scenario)
    finally:
        tp_duplicated.unpartition_duplicated_masters = fixed


def _mla_step(tp: int, keep_partition_dims: bool = False) -> dict:
    step = _step_keeping_partition_dims if keep_partition_dims else one_step_from_full_gradient
    results = run_on_ranks(
        step, MLA_STEP, world_size=2, parallel=ParallelSpec(tp=tp), boot=boot_for(MLA_STEP),
        timeout=600.0,
    )  # fmt: skip
    return results[0]


def _differing(a: dict, b: dict) -> list[str]:
    return sorted(name for name in a if not torch.equal(a[name], b[name]))


@pytest.fixture(scope="module")
def mla_step_tp1() -> dict:
    return _mla_step(tp=1)


def test_mla_muon_update_at_tp2_equals_tp1_bitwise(mla_step_tp1):
    """At TP 2 x DP 1 every parameter after the step (the TP-sharded up projections and
    ``linear_proj`` gathered) equals TP 1 x DP 2's, the duplicated down projections included."""
    tp2 = _mla_step(tp=2)
    assert _differing(mla_step_tp1["before"], tp2["before"]) == []
    assert any("down_proj" in name for name in tp2["muon"]), tp2["muon"]
    assert _differing(mla_step_tp1["after"], tp2["after"]) == []


def test_control_mla_down_projections_gathered_over_tp_differ(mla_step_tp1):
    """Masters keeping TE's partition dimension: Muon stacks the two TP copies of each down
    projection, whose update then differs from TP 1's; every other parameter is still equal."""
    stacked = _mla_step(tp=2, keep_partition_dims=True)
    differing = _differing(mla_step_tp1["after"], stacked["after"])
    down = sorted(name for name in stacked["muon"] if "_down_proj" in name)
    assert down and differing == down, (differing, down)
