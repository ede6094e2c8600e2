"""The NVFP4 recipes (``deepseek_v3_nvfp4``, ``qwen3_235b_a22b_nvfp4``; docs/nvfp4.md, "NVFP4
recipes"): what they ship, what the planner counts for them, and their twins trained by
``nemo-lw-fp8 pretrain --cpu`` on TE's own modules with the devices answered as a B200 would
(ranks forked from one warmed-up process, tests/support/fork_run.py).

A twin keeps its recipe's parallelism structure (PP 2 x VPP 2 x EP 2 on 4 ranks, MTP and MLA for
DeepSeek-V3), Bridge's NVFP4 preset (NVFP4 compute, NVFP4 primary weights, FP4 param gather),
discrete expert weights (TE's ``GroupedLinear``); the CPU backend turns TE's stochastic
rounding off for them (a GPU keeps it on; docs/nvfp4.md, "Stochastic rounding").

FP4 param gather ON = OFF bitwise: every iteration's reduced loss and grad norm, every
evaluation, every rank's fp32 masters and optimizer state. ON holds persistent ``NVFP4Tensor``
weights on every rank and rebuilds gathered ones from FP4 bytes; OFF holds none (NVFP4 compute
on bf16 weights). Controls: receivers that keep a stale columnwise copy or a stale global amax
after the gather diverge. Resume: fresh processes load the ON run's iteration-1 checkpoint and
train iteration 2 as it did (control: a loaded master one ulp off).
"""

from __future__ import annotations

import pytest

from nemo_lw_fp8 import recipes
from nemo_lw_fp8.recipes import twins
from tests.support import bridge_runs as br

NVFP4 = ("deepseek_v3_nvfp4", "qwen3_235b_a22b_nvfp4")
#: The twin whose parity and control are in the gate (MLA, MTP, PP 2 x VPP 2 x EP 2).
GATE = "deepseek_v3_nvfp4"
#: FP4 param gather off (Bridge keeps ``fp4_param`` equal to it): NVFP4 compute on bf16 weights.
FP4_GATHER_OFF = ("mixed_precision.fp4_param_gather=false",)
NO_WARMUP = "scheduler.lr_warmup_iters=0"
#: Two iterations with an evaluation after each, without warm-up: the second step's forward and
#: backward and the evaluations read the weights the FP4 gather delivered.
SHORT = ("train.train_iters=2", "validation.eval_interval=1", "validation.eval_iters=1", NO_WARMUP)


def _tiered(names: tuple[str, ...]) -> list:
    return [n if n == GATE else pytest.param(n, marks=pytest.mark.extended) for n in names]


# --------------------------------------------------------------------------- what is shipped


def test_nvfp4_recipes_are_the_two_models_with_tiny_and_twin():
    """Two models only, each with its tiny variant and twin; the twins keep the MXFP8 twins'
    structure (GB200 parallelism at CPU size: 4 ranks)."""
    names = sorted(n for n in recipes.RECIPES if n.endswith("_nvfp4"))
    assert names == sorted(
        [*NVFP4, "tiny_deepseek_v3_nvfp4", "tiny_qwen3_235b_a22b_nvfp4",
         "twin_deepseek_v3_nvfp4", "twin_qwen3_235b_a22b_nvfp4"]
    )  # fmt: skip
    for name in NVFP4:
        mxfp8 = name.replace("_nvfp4", "_mxfp8")
        assert twins.twin_defaults(name) == twins.twin_defaults(mxfp8)
        assert twins.twin_world_size(name) == 4


#: Decoder layers each recipe keeps in bf16 at the end (the rounded 15%, Bridge's NVFP4 presets).
BF16_AT_END = {"deepseek_v3_nvfp4": (9, 61), "qwen3_235b_a22b_nvfp4": (14, 94)}


@pytest.mark.parametrize("name", NVFP4)
def test_planner_counts_persistent_nvfp4_weights(name):
    """``plan --recipe``: the busiest rank's parameter bytes are its TE linear weights as TE
    allocates NVFP4 ones (``nvfp4_weight_bytes``: both usages' codes, padded scales, amaxes),
    except in the last decoder layers the recipe keeps in bf16, plus 2 bytes per other
    parameter, counted here from the rank's own shapes; fewer than with bf16 weights, and the
    recipe plans discrete experts. (Qwen3-235B's busiest rank holds bf16-kept layers.)"""
    import re

    from nemo_lw_fp8.planner import pipeline, plan_parts, recipe_plan, weight_bytes

    setup = recipe_plan.recipe_setup(name)
    planned = (setup.weight_format, setup.single_grouped_weight, setup.gpu)
    assert planned == ("nvfp4", False, "gb200")
    kept, layers = BF16_AT_END[name]
    assert (setup.bf16_layers_at_end, setup.arch.num_layers) == (kept, layers)
    result = recipe_plan.plan_recipe(setup)
    par = setup.par
    specs = plan_parts.local_specs(
        pipeline.stage_param_specs(setup.arch, par, result["pp_rank"]), par.ep, par.tp, par.etp
    )

    def in_bf16_layer(spec) -> bool:
        found = re.match(r"decoder\.layers\.(\d+)\.", spec.name)
        return found is not None and int(found.group(1)) >= layers - kept

    assert any(spec.quantized for spec in specs)
    assert any(s.quantized and in_bf16_layer(s) for s in specs) == (name == "qwen3_235b_a22b_nvfp4")
    expected = sum(
        weight_bytes.nvfp4_weight_bytes(s.shape) if s.quantized and not in_bf16_layer(s)
        else 2 * s.numel
        for s in specs
    )  # fmt: skip
    assert result["layouts"]["compact"]["bytes_per_rank"]["params"] == expected
    bf16 = recipe_plan.plan_recipe(
        recipe_plan.recipe_setup(name, ["mixed_precision.fp4_param_gather=false"])
    )
    assert bf16["layouts"]["compact"]["bytes_per_rank"]["params"] == sum(2 * s.numel for s in specs)
    assert expected < sum(2 * s.numel for s in specs)
    assert result["verdict"]["fits"]


# --------------------------------------------------------------------------- twins (Bridge)


@pytest.fixture(scope="module")
def twin_run(tmp_path_factory, bridge_installed):
    """``twin_run(recipe, tag, *overrides, mutation="", save=False)``: one short run of an NVFP4
    twin with the probe, kept for the module (controls reuse the OFF run, the resume the ON
    run). ``save``: a checkpoint after each iteration, its directory in ``checkpoint``."""
    done: dict[tuple, dict] = {}

    def run(recipe: str, tag: str, *overrides: str, mutation: str = "", save: bool = False):
        key = (recipe, tag, overrides, mutation, save)
        if key not in done:
            tmp = tmp_path_factory.mktemp(f"{recipe}-{tag}")
            saving = (f"checkpoint.save={tmp / 'ckpt'}", "checkpoint.save_interval=1")
            done[key] = br.pretrain(
                tmp, tag, f"twin_{recipe}", *SHORT, *overrides, *(saving if save else ()),
                nproc=twins.twin_world_size(recipe), mutation=mutation, probe=True,
            )  # fmt: skip
            done[key]["checkpoint"] = str(tmp / "ckpt") if save else None
        return done[key]

    return run


@pytest.mark.parametrize("recipe", _tiered(NVFP4))
def test_nvfp4_twin_fp4_gather_on_equals_off(twin_run, recipe):
    """FP4 param gather ON = OFF bitwise through Bridge (losses, grad norms, evaluations, every
    rank's masters and optimizer state); both on TE's modules at the recipe's EP; both computed
    in NVFP4 (TE's GEMMs took NVFP4 operands); ON held persistent NVFP4 weights on every rank and
    rebuilt gathered ones from FP4 bytes, OFF held none."""
    on = twin_run(recipe, "on", save=True)
    off = twin_run(recipe, "off", *FP4_GATHER_OFF)
    # The recipes own fused QKV weights whole (an NVFP4 weight's owner needs the whole matrix's
    # amax), with the gather on and off alike: the same pieces, the same grad-norm sum order.
    assert on["qkv_parts"] == off["qkv_parts"] == 0
    br.assert_gather_on_equals_off(on, off, steps=2)
    assert len(br.eval_losses(on)) == 3
    assert len(set(on["ranks"])) == twins.twin_world_size(recipe)  # ranks hold different pieces
    shape = twins.twin_defaults(recipe)
    for rank in on["probe"] + off["probe"]:
        assert (rank["tp"], rank["ep"]) == (shape.tp, shape.ep), rank
        assert 0 < rank["nvfp4_gemms"] <= rank["gemms"], rank
    assert all(rank["nvfp4_weights"] == rank["fp8_weights"] > 0 for rank in on["probe"])
    assert all(rank["nvfp4_unpacked"] > 0 for rank in on["probe"]), on["probe"]
    assert all(rank["nvfp4_weights"] == 0 == rank["nvfp4_unpacked"] for rank in off["probe"])
    # The recipe's last decoder layer (the twin's 15%) is kept in bf16: TE weights held as plain
    # tensors on the ranks of the stage that holds it (PP rank 1: its second virtual stage),
    # none on the others (ranks 0-1: PP rank 0).
    kept = [rank["te_bf16_matrices"] for rank in on["probe"]]
    assert kept[:2] == [0, 0] and all(k > 0 for k in kept[2:]), kept


#: mutation of tests/support/bridge_run.py -> what it leaves stale on receivers after each FP4
#: gather.
CONTROLS = {
    "nvfp4_stale_columnwise": "the columnwise copy (dgrad and wgrad read it)",
    "nvfp4_stale_amax": "the per-tensor amax (the GEMMs' global scale)",
}


@pytest.mark.parametrize(
    "mutation",
    ["nvfp4_stale_columnwise", pytest.param("nvfp4_stale_amax", marks=pytest.mark.extended)],
)
def test_nvfp4_twin_control_stale_after_gather(twin_run, mutation):
    """Control of the parity: receivers that keep a stale columnwise copy, or a stale amax,
    after the gather part from gather off. The first step reads no gathered weight (equal
    loss); the second step's backward (columnwise) or forward and backward (amax) read the
    first step's update through stale bytes, so its grad norm and every rank's state differ."""
    off = twin_run(GATE, "off", *FP4_GATHER_OFF)
    broken = twin_run(GATE, mutation, mutation=mutation)
    assert all(rank["nvfp4_unpacked"] > 0 for rank in broken["probe"]), broken["probe"]
    assert br.losses(broken)[0] == br.losses(off)[0]
    assert br.grad_norms(broken)[1] != br.grad_norms(off)[1]
    assert broken["ranks"] != off["ranks"]


@pytest.mark.extended
@pytest.mark.parametrize("recipe", NVFP4)
def test_nvfp4_twin_resumes_from_the_parity_run(twin_run, tmp_path, recipe):
    """Fresh processes load the parity ON run's iteration-1 checkpoint (NVFP4 weights, fp32
    masters) and train iteration 2: its loss, grad norm, evaluations and every rank's masters
    and optimizer state equal the ON run's, bit for bit. Control: the same resume with each
    rank's first layer-wise master one ulp up after the load ends in other state."""
    on = twin_run(recipe, "on", save=True)
    loading = (f"checkpoint.load={on['checkpoint']}", "checkpoint.ckpt_step=1")
    nproc = twins.twin_world_size(recipe)
    resumed = br.pretrain(tmp_path, "resumed", f"twin_{recipe}", *SHORT, *loading, nproc=nproc)
    assert len(br.losses(resumed)) == 1
    br.assert_resumed_goes_on(on, resumed, saved_at=1)
    assert resumed["state"]["end"] == on["state"]["end"]
    nudged = br.pretrain(tmp_path, "nudged", f"twin_{recipe}", *SHORT, *loading, nproc=nproc,
                         mutation="nudge_loaded_master")  # fmt: skip
    assert len(br.losses(nudged)) == 1
    assert nudged["ranks"] != on["ranks"]
