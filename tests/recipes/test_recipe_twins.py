"""Recipe-faithful twins (nemo_lw_fp8/recipes/twins.py) trained by ``nemo-lw-fp8 pretrain --cpu``
(ranks forked from one warmed-up process, tests/support/fork_run.py; the flagship resume test
launches with torchrun too): each full recipe's parallelism structure (PP 2 with its
layout or accounting, VPP 2, EP over TP x DP 2; TP and sequence parallelism as shipped: TP 2 + SP
and EP 4 on 8 ranks for DeepSeek-V3 and Qwen3-235B on H100), FP8 recipe, single grouped weights,
MTP, gradient clipping, dropout and auxiliary loss as shipped.

FP8 param gather ON = OFF bitwise: every iteration's reduced loss and global grad norm (the
clipping input), every evaluation, and every rank's fp32 masters and optimizer state at the end.
The flagship twins resume bitwise in fresh processes (the DeepSeek-V3 MXFP8 twin from a run of
its own, the Hopper and Qwen3-235B MXFP8 twins from their parity ON run), and the DeepSeek-V2-Lite
Hopper and Qwen3-235B MXFP8 twins at twice the data-parallel size from the ON run's checkpoint
(the DeepSeek-V3 MXFP8 twin's resharding with its control: tests/recipes/test_twin_resharding.py).
The DeepSeek-V3 Hopper twin runs TP 2 on 8 ranks: its DP-4 resume would take 16 ranks, and the
project's CPU layers run TP 1 only, so those two checks of a Hopper twin run on the
DeepSeek-V2-Lite one (MLA, blockwise FP8, discrete experts, TP 1).
"""

from __future__ import annotations

import math

import pytest

from nemo_lw_fp8 import recipes
from nemo_lw_fp8.recipes import twins
from tests.support import bridge_runs as br

pytestmark = pytest.mark.usefixtures("bridge_installed")

#: Every full recipe's twin. Two iterations with an evaluation after each: the second step's
#: forward and backward and the evals read the weights the plugin's FP8 gather delivered.
#: Without warm-up: with the recipes' ``lr_warmup_iters`` (1 for two iterations) Bridge's
#: scheduler starts at ``lr_warmup_init`` = 0, so the first step changed no weight and no
#: backward ever read a gathered weight that differs from its initial value (why a stale
#: columnwise copy once left the Hopper twins unchanged).
#: The NVFP4 twins run in tests/recipes/test_nvfp4_recipes.py (FP4 param gather, its own controls).
TWINS = tuple(
    name for name in sorted(recipes.RECIPES)
    if not name.startswith(("tiny_", "twin_")) and not name.endswith("_nvfp4")
)  # fmt: skip
NO_WARMUP = "scheduler.lr_warmup_iters=0"
SHORT = ("train.train_iters=2", "validation.eval_interval=1", "validation.eval_iters=1", NO_WARMUP)


#: The twins whose runs are in the gate (``make test``): the flagship MXFP8 twin (PP 2 x VPP 2 x
#: EP 2, MTP, single grouped weights), the flagship Hopper twin (blockwise FP8, discrete
#: experts, MLA at TP 2 + SP: PP 2 x VPP 2 x TP 2 x DP 2, EP 4, 8 ranks) and the hybrid Qwen3.5
#: twin (Gated DeltaNet). The other nine (but every MXFP8 twin's stale-columnwise control), the
#: DP-4 resumes, the owner-reduce twin comparison and the torchrun resume are the extended tier
#: (``make test-all``; docs/testing.md, "Two tiers").
GATE = ("deepseek_v3_mxfp8", "deepseek_v3_hopper", "qwen3_5_35b_a3b_mxfp8")


def _tiered(recipes_: tuple[str, ...], gate: tuple[str, ...] = GATE) -> list:
    return [r if r in gate else pytest.param(r, marks=pytest.mark.extended) for r in recipes_]


def _blockwise(recipe: str) -> bool:
    return recipe.endswith("_hopper")


#: Flagship twins whose parity ON run also saves at iteration 1, and which fresh processes
#: resume from there (the DeepSeek-V3 MXFP8 twin has a resume test of its own, below).
RESUMED = ("deepseek_v3_hopper", "qwen3_235b_a22b_mxfp8", "qwen3_5_35b_a3b_mxfp8")
#: Of those, the gate resumes the hybrid Qwen3.5 twin (Gated DeltaNet's split checkpoint); the
#: Hopper twin's resume (8 ranks at TP 2, about 100 s more) is extended, as docs/testing.md
#: tiers it (resume at TP 2 through Bridge: tests/bridge/test_tp_bridge_training.py).
RESUMED_IN_GATE = ("qwen3_5_35b_a3b_mxfp8",)


@pytest.fixture(scope="module")
def twin_run(tmp_path_factory):
    """``twin_run(recipe, tag, *overrides, mutation="", save=False)``: one short run of a twin,
    kept for the module (the control reuses a parity test's reference run, the resume test a
    parity test's ON run). ``save``: a checkpoint after each iteration, its directory in the
    record's ``checkpoint``."""
    done: dict[tuple, dict] = {}

    def run(
        recipe: str, tag: str, *overrides: str, mutation: str = "", save: bool = False,
        cpu_modules: str = "te",
    ):  # fmt: skip
        key = (recipe, tag, overrides, mutation, save, cpu_modules)
        if key not in done:
            tmp = tmp_path_factory.mktemp(f"{recipe}-{tag}")
            nproc = twins.twin_world_size(recipe)
            saving = (f"checkpoint.save={tmp / 'ckpt'}", "checkpoint.save_interval=1")
            saving = saving if save else ()
            done[key] = br.pretrain(
                tmp, tag, f"twin_{recipe}", *SHORT, *overrides, *saving, nproc=nproc,
                mutation=mutation, probe=True, cpu_modules=cpu_modules,
            )  # fmt: skip
            done[key]["checkpoint"] = str(tmp / "ckpt") if save else None
        return done[key]

    return run


@pytest.mark.parametrize("recipe", _tiered(TWINS))
def test_twin_fp8_gather_on_equals_off(twin_run, recipe):
    on = twin_run(recipe, "on", save=recipe in RESUMED)
    off = twin_run(recipe, "off", *br.GATHER_OFF)
    assert len(br.losses(on)) == 2 and len(br.eval_losses(on)) == 3, on
    # Q / K / V parts owned apart (qkv_ownership="split") wherever a fused linear_qkv is not
    # blockwise FP8 (DeepSeek's MLA has none); the same pieces with the gather off.
    splits = not _blockwise(recipe) and not recipe.startswith("deepseek")
    assert (on["qkv_parts"] > 0) == splits and on["qkv_parts"] == off["qkv_parts"], on
    assert br.losses(on) == br.losses(off)  # exact float equality
    assert br.grad_norms(on) == br.grad_norms(off)
    assert br.eval_losses(on) == br.eval_losses(off)
    assert on["ranks"] == off["ranks"]
    # Ranks hold different pieces of the model: the digests say something.
    assert len(set(on["ranks"])) == twins.twin_world_size(recipe)
    # What the ranks did, not what was configured: the model is TE's modules (megatron's TE
    # spec, as on the GPU); ON holds persistent FP8 weights on every rank (only the FP8 param
    # gather updates them), OFF none (nothing FP8 was gathered).
    for rank in on["probe"] + off["probe"]:
        assert rank["te_modules"] > 0 and rank["project_layers"] == 0, rank
    # The recipe's TP and sequence parallelism, EP over a stage's TP x DP ranks, on every rank
    # (Qwen3-235B on H100: TP 2 with SP, EP 4).
    shape = twins.twin_defaults(recipe)
    for rank in on["probe"] + off["probe"]:
        ran = (rank["tp"], rank["ep"], rank["sequence_parallel"])
        assert ran == (shape.tp, shape.ep, shape.sequence_parallel), rank
    assert all(rank["fp8_weights"] > 0 for rank in on["probe"]), on["probe"]
    assert all(rank["fp8_weights"] == 0 for rank in off["probe"]), off["probe"]
    if _blockwise(recipe):
        # ON gathers persistent Float8BlockwiseQTensor weights as FP8 codes + scales through
        # the plugin's blockwise gather plans; OFF has neither.
        assert all(r["blockwise_weights"] > 0 and r["blockwise_groups"] > 0 for r in on["probe"])
        assert all(r["blockwise_weights"] == 0 == r["blockwise_groups"] for r in off["probe"])


#: The project's CPU layers (``--cpu-modules project``: cpu/layers/specs.py, the earlier CPU path,
#: kept as a cross-check of TE's modules) under the same parity, extended tier. The project's layers
#: run TP 1 only: the Hopper check uses the DeepSeek-V2-Lite twin (MLA, blockwise, discrete
#: experts), the DeepSeek-V3 Hopper twin ships TP 2.
PROJECT_TWINS = ("deepseek_v3_mxfp8", "deepseek_v2_lite_hopper")


@pytest.mark.extended
@pytest.mark.parametrize("recipe", PROJECT_TWINS)
def test_twin_on_project_layers_fp8_gather_on_equals_off(twin_run, recipe):
    """The twin on the project's CPU layers (megatron's local spec, the emulated FP8 linears,
    the project's grouped experts): ON = OFF bitwise, as on TE's modules. Control on the same
    layers: masters built from the dequantized FP8 weights (MXFP8 twin), or receivers keeping
    stale blockwise columnwise copies (Hopper twin), end in other state."""
    on = twin_run(recipe, "project-on", cpu_modules="project")
    off = twin_run(recipe, "project-off", *br.GATHER_OFF, cpu_modules="project")
    for rank in on["probe"] + off["probe"]:
        assert rank["project_layers"] > 0, rank
    if _blockwise(recipe):
        for rank in on["probe"] + off["probe"]:
            assert rank["linears"].get("BlockwiseColumnParallelLinear", 0) > 0, rank
    assert all(rank["fp8_weights"] > 0 for rank in on["probe"]), on["probe"]
    assert all(rank["fp8_weights"] == 0 for rank in off["probe"]), off["probe"]
    assert br.losses(on) == br.losses(off)
    assert br.grad_norms(on) == br.grad_norms(off)
    assert br.eval_losses(on) == br.eval_losses(off)
    assert on["ranks"] == off["ranks"]
    mutation = "blockwise_columnwise" if _blockwise(recipe) else "masters_from_fp8"
    broken = twin_run(recipe, "project-broken", mutation=mutation, cpu_modules="project")
    assert broken["ranks"] != off["ranks"]


@pytest.mark.extended
def test_flagship_twin_owner_reduce_equals_all_reduce(twin_run):
    """PP 2 x VPP 2 x EP 2 on DP 2, single grouped MXFP8 experts, MTP, clipping, as shipped: the
    default gradient sync (each Muon gradient reduced to its owner) trains as the all-reduce
    one, bit for bit: every loss, grad norm (the clipping input), eval, and every rank's fp32
    masters and optimizer state."""
    owner = twin_run("deepseek_v3_mxfp8", "on")
    reduced = twin_run(
        "deepseek_v3_mxfp8", "all-reduce", "optimizer.layer_wise_grad_sync=all_reduce"
    )
    assert owner["layer_wise_grad_sync"] == "reduce_to_owner"
    assert reduced["layer_wise_grad_sync"] == "all_reduce"
    # What the ranks issued: reduces to owners in one run, none in the other.
    assert all(rank["reduces"] > 0 for rank in owner["probe"]), owner["probe"]
    assert all(rank["reduces"] == 0 for rank in reduced["probe"]), reduced["probe"]
    assert br.losses(owner) == br.losses(reduced)
    assert br.grad_norms(owner) == br.grad_norms(reduced)
    assert br.eval_losses(owner) == br.eval_losses(reduced)
    assert owner["ranks"] == reduced["ranks"]
    # Control: gradients reduced to the wrong owners (each owner steps on its own unreduced
    # gradient) part from the all-reduce run.
    wrong = twin_run("deepseek_v3_mxfp8", "wrong-owner", mutation="reduce_to_wrong_owner")
    assert all(rank["reduces"] > 0 for rank in wrong["probe"])
    assert br.losses(wrong)[0] == br.losses(reduced)[0]  # the first forward precedes any sync
    assert wrong["ranks"] != reduced["ranks"]


@pytest.mark.parametrize("recipe", _tiered(RESUMED, RESUMED_IN_GATE))
def test_flagship_twin_resumes_from_the_parity_run(twin_run, tmp_path, recipe):
    """The Hopper (blockwise FP8, PP 2 x EP 2), Qwen3-235B MXFP8 (PP 2 x VPP 2 x EP 2) and hybrid
    Qwen3.5 MXFP8 twins (Gated DeltaNet layers, whose checkpoint megatron splits by name:
    in_proj into query / key / value / z / beta / alpha, conv1d into query / key / value): fresh
    processes load the parity ON run's iteration-1 checkpoint and train iteration 2; its
    loss, grad norm, the evaluations (iteration 2, final) and every rank's masters and
    optimizer state equal the ON run's, bit for bit."""
    on = twin_run(recipe, "on", save=True)
    resumed = br.pretrain(tmp_path, "resumed", f"twin_{recipe}", *SHORT,
                          f"checkpoint.load={on['checkpoint']}", "checkpoint.ckpt_step=1",
                          nproc=twins.twin_world_size(recipe))  # fmt: skip
    assert len(br.losses(resumed)) == 1 and br.losses(resumed) == br.losses(on)[1:]
    assert br.grad_norms(resumed) == br.grad_norms(on)[1:]
    assert len(br.eval_losses(resumed)) == 2 and br.eval_losses(resumed) == br.eval_losses(on)[1:]
    assert resumed["ranks"] == on["ranks"]
    assert resumed["state"]["end"] == on["state"]["end"]


@pytest.mark.parametrize("recipe", _tiered(RESUMED, RESUMED_IN_GATE))
def test_control_resume_from_the_parity_run_with_a_master_one_ulp_off(twin_run, tmp_path, recipe):
    """Control of ``test_flagship_twin_resumes_from_the_parity_run``: the same resume from the
    same checkpoint with each rank's first layer-wise fp32 master one ulp up right after the
    load (mutation ``nudge_loaded_master``, tests/support/bridge_run.py) completes, and every rank's
    state at the end differs from the ON run's."""
    on = twin_run(recipe, "on", save=True)
    nudged = br.pretrain(tmp_path, "nudged", f"twin_{recipe}", *SHORT,
                         f"checkpoint.load={on['checkpoint']}", "checkpoint.ckpt_step=1",
                         nproc=twins.twin_world_size(recipe),
                         mutation="nudge_loaded_master")  # fmt: skip
    assert len(br.losses(nudged)) == 1 and len(br.eval_losses(nudged)) == 2
    assert nudged["ranks"] != on["ranks"]
    assert nudged["state"]["end"] != on["state"]["end"]


#: Twins whose parity ON run's iteration-2 checkpoint (written as Bridge writes it by default:
#: the sibling Adam ``dp_reshardable``) is loaded at DP 4, and the grouped-weight ownership
#: there: the Qwen3-235B MXFP8 twin splits each single grouped weight's experts over two owners;
#: the Hopper twins keep megatron's discrete expert weights (rule
#: ``grouped-weight-blockwise-gather``), which have no grouped weight to split. The Hopper one is
#: DeepSeek-V2-Lite's (TP 1, 2 ranks -> 4): the DeepSeek-V3 Hopper twin's TP 2 x PP 2 would need
#: 16 ranks at DP 4, too many for 2 CPU cores.
RESHARDED = {"deepseek_v2_lite_hopper": "whole", "qwen3_235b_a22b_mxfp8": "expert"}


@pytest.mark.extended
@pytest.mark.parametrize("recipe", sorted(RESHARDED))
def test_flagship_twin_resumes_at_dp4(twin_run, tmp_path, recipe):
    """The DeepSeek-V2-Lite Hopper (blockwise FP8, MLA, EP 2) and Qwen3-235B MXFP8 (PP 2 x VPP 2
    x EP 2) twins' parity ON run (DP 2, expert-data-parallel size 1, each grouped weight owned
    whole) saved at iteration 2; twice the ranks (DP 4, expert-data-parallel size 2: the Muon
    matrices, dense and expert, over twice the owners; Qwen3: each grouped weight's experts
    split over two) load it and train iteration 3 (no evaluation). Right after the load, the
    fp32 masters, Muon momentum and Adam moments, per parameter and expert, equal the ON run's
    end state, bit for bit (the comparison's control: tests/recipes/test_twin_resharding.py)."""
    on = twin_run(recipe, "on", save=True)
    ownership = RESHARDED[recipe]
    grown = br.pretrain(tmp_path, "dp4", f"twin_{recipe}", "train.train_iters=3", NO_WARMUP,
                        "validation.eval_interval=100", "validation.eval_iters=0",
                        f"checkpoint.load={on['checkpoint']}", "checkpoint.ckpt_step=2",
                        f"optimizer.grouped_weight_ownership={ownership}",
                        nproc=2 * twins.twin_world_size(recipe), timeout=1500)  # fmt: skip
    saved = on["state"]["end"]
    kinds = {kind for entry in saved.values() for kind in entry}
    assert {"master", "momentum_buffer", "exp_avg", "exp_avg_sq"} <= kinds, kinds
    assert on["expert_slices"] == 0  # whole grouped weights (or none) at DP 2
    assert grown["grouped_weight_ownership"] == ownership
    assert (grown["expert_slices"] > 0) == (ownership == "expert"), grown["expert_slices"]
    moved = sorted(k for k in set(saved) | set(grown["state"]["start"])
                   if saved.get(k) != grown["state"]["start"].get(k))  # fmt: skip
    assert moved == []
    assert len(br.losses(grown)) == 1 and all(math.isfinite(x) for x in br.losses(grown))
    assert grown["state"]["end"] != grown["state"]["start"]  # it trained


def test_twin_controls_catch_each_broken_fix(twin_run):
    """The comparison above can fail, on the flagship twin (PP 2 x VPP 2 x EP 2, MTP, single
    grouped MXFP8 experts), once per fix:

    * with masters built from the dequantized FP8 weights instead of TE's init values, the
      masters, the state and the evals part from gather off;
    * without staging before the gathers of an eval run with the pre-hooks on, evals read stale
      Adam params while training (its loop stages before every forward) stays equal.
    """
    off = twin_run("deepseek_v3_mxfp8", "off", *br.GATHER_OFF)
    broken = twin_run("deepseek_v3_mxfp8", "broken", mutation="masters_from_fp8")
    assert broken["ranks"] != off["ranks"]
    assert br.eval_losses(broken) != br.eval_losses(off)
    stale = twin_run("deepseek_v3_mxfp8", "stale", mutation="stage_before_hook_gather")
    assert br.losses(stale) == br.losses(off)
    assert br.eval_losses(stale) != br.eval_losses(off)


HOPPER = tuple(recipe for recipe in TWINS if _blockwise(recipe))


@pytest.mark.parametrize("recipe", _tiered(HOPPER))
def test_hopper_twin_control_stale_columnwise_copy(twin_run, recipe):
    """Receivers that keep the columnwise copy of gathered blockwise weights stale (TE's dgrad
    GEMM reads that copy) part from gather off: the second step's backward reads the first
    step's update through stale copies, so its grad norm and the ranks' state differ."""
    off = twin_run(recipe, "off", *br.GATHER_OFF)
    stale = twin_run(recipe, "stale", mutation="blockwise_columnwise")
    # Receivers existed: gathered weights whose columnwise copy the mutation left stale.
    assert all(rank["columnwise_derived"] > 0 for rank in stale["probe"]), stale["probe"]
    assert br.losses(stale)[0] == br.losses(off)[0]  # the first step reads no gathered weight
    assert br.grad_norms(stale)[1] != br.grad_norms(off)[1]
    assert stale["ranks"] != off["ranks"]


MXFP8 = tuple(recipe for recipe in TWINS if recipe.endswith("_mxfp8"))


#: Every MXFP8 twin's control is in the gate, not tiered (issue 45): the four whose parity is
#: extended included, where the control makes the OFF run itself (two runs instead of one).
@pytest.mark.parametrize("recipe", MXFP8)
def test_mxfp8_twin_control_stale_columnwise_copy(twin_run, recipe):
    """Receivers whose persistent MXFP8 weights get only their rowwise copy refreshed by the
    gathers' re-quantization (mutation ``te_stale_columnwise``: TE's weights and grouped members
    alike; TE's dgrad GEMM reads the columnwise copy) part from gather off within the twins' two
    steps: the first step's update reaches the second step's backward through stale copies, so
    its grad norm and the ranks' state differ. The parity's OFF run is reused; one run more."""
    off = twin_run(recipe, "off", *br.GATHER_OFF)
    stale = twin_run(recipe, "stale-columnwise", mutation="te_stale_columnwise")
    # Receivers existed: re-quantized MXFP8 weights whose columnwise copy the mutation kept.
    assert all(rank["mxfp8_requantized"] > 0 for rank in stale["probe"]), stale["probe"]
    assert br.losses(stale)[0] == br.losses(off)[0]  # the first step reads no gathered weight
    # The evaluation after step 1 is a forward (rowwise copies only): the difference is the
    # backward's.
    assert br.eval_losses(stale)[0] == br.eval_losses(off)[0]
    assert br.grad_norms(stale)[1] != br.grad_norms(off)[1]
    assert stale["ranks"] != off["ranks"]


FLAGSHIP = "twin_deepseek_v3_mxfp8"
FLAGSHIP_COMMON = ("train.train_iters=4", "validation.eval_interval=3", "validation.eval_iters=1")


@pytest.fixture(scope="module")
def flagship_full(tmp_path_factory):
    """The DeepSeek-V3 MXFP8 twin's uninterrupted 4-iteration run, saving at iteration 2,
    launched by torchrun as users launch it; kept for the module (the resume test and its
    control resume from its checkpoint). Its record's ``checkpoint``: the directory."""
    tmp = tmp_path_factory.mktemp("flagship-full")
    ckpt = tmp / "ckpt"
    full = br.pretrain(tmp, "full", FLAGSHIP, *FLAGSHIP_COMMON, f"checkpoint.save={ckpt}",
                       "checkpoint.save_interval=2", nproc=twins.twin_world_size(FLAGSHIP),
                       launcher="torchrun")  # fmt: skip
    full["checkpoint"] = str(ckpt)
    return full


def _flagship_resume(tmp_path, full: dict, mutation: str = "") -> dict:
    return br.pretrain(tmp_path, "resumed", FLAGSHIP, *FLAGSHIP_COMMON,
                       f"checkpoint.load={full['checkpoint']}", "checkpoint.ckpt_step=2",
                       nproc=twins.twin_world_size(FLAGSHIP), mutation=mutation)  # fmt: skip


@pytest.mark.extended
def test_flagship_twin_resumes_bitwise(flagship_full, tmp_path):
    """The DeepSeek-V3 MXFP8 twin as shipped (PP 2 x VPP 2 x EP 2, MTP, single grouped MXFP8
    experts, clipping, dropout) saves a torch_dist checkpoint at iteration 2 and goes on to 4;
    fresh processes load it and train 3-4: losses, grad norms, evals and every rank's masters
    and optimizer state equal the run that went on, bit for bit."""
    # The run that goes on is launched by torchrun, as users launch it; the resumed one by the
    # forking launcher of the matrix (tests/support/fork_run.py): equal bits also say the launcher
    # changes nothing.
    full = flagship_full
    resumed = _flagship_resume(tmp_path, full)
    assert len(br.losses(full)) == 4 and len(br.losses(resumed)) == 2
    assert br.losses(resumed) == br.losses(full)[2:]
    assert br.grad_norms(resumed) == br.grad_norms(full)[2:]
    assert len(br.eval_losses(full)) == 2 and br.eval_losses(resumed) == br.eval_losses(full)
    assert resumed["ranks"] == full["ranks"]


@pytest.mark.extended
def test_control_flagship_twin_resume_with_a_master_one_ulp_off(flagship_full, tmp_path):
    """Control of ``test_flagship_twin_resumes_bitwise``: the same resume with each rank's first
    layer-wise fp32 master one ulp up right after the load (mutation ``nudge_loaded_master``)
    completes, and every rank's state at the end differs from the run that went on."""
    nudged = _flagship_resume(tmp_path, flagship_full, mutation="nudge_loaded_master")
    assert len(br.losses(nudged)) == 2
    assert nudged["ranks"] != flagship_full["ranks"]
