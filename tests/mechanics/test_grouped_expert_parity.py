"""Single grouped expert weights train exactly like discrete expert weights (#5464, CPU ranks).

The model a GPU builds (``tests/support/scenarios.py``, model ``moe_grouped``): a 2-layer MoE
GPT from megatron's Transformer Engine spec (4 SwiGLU experts, top-2, megatron's real router
and allgather dispatcher) whose experts are ``TEGroupedMLP`` through TE 2.20.2's op fuser
(``ops.GroupedLinear``, ``ScaledSwiGLU``), over the emulated ``transformer_engine_torch``. TE's
``GroupedLinear`` holds each expert linear's weights as ONE ``GroupedTensor`` ``(E, out, in)``
(single grouped) or as ``weight0..weight3`` (discrete). Every comparison is atol = rtol = 0:
per-step losses, eval losses, every parameter, every main_grad and every fp32 master, with the
single run's tensors split per expert.
"""

from __future__ import annotations

import pytest

from nemo_lw_fp8.cpu.te import backend as te_backend
from tests.support.harness import BootOptions, run_on_ranks
from tests.support.parity import assert_diverges, assert_same_training
from tests.support.scenarios import Scenario
from tests.support.training import train

if te_backend.te_package_dirs() is None:  # find, never import, TE in this process
    pytest.skip("TE's GroupedTensor needs TE's Python package", allow_module_level=True)

FP8 = BootOptions(fp8_emulation=True)
BASE = Scenario(model="moe_grouped", steps=3, plugin=True, snapshots=True)
PRECISIONS = {
    "bf16": {},
    "mxfp8-compute": {"fp8": True},
    "mxfp8-primary": {"fp8": True, "fp8_param_gather": True},
}
OPTIMIZERS = {
    "layerwise-muon": {"optimizer": "muon", "distribution": "layerwise_padded"},
    "distopt-adam": {"optimizer": "adam", "distribution": "distopt"},
}
GROUPED = "decoder.layers.0.mlp.experts.linear_fc1.weight"


def run(scenario: Scenario) -> list[dict]:
    return run_on_ranks(train, scenario, world_size=2, boot=FP8)


def pair(scenario: Scenario) -> tuple[list[dict], list[dict]]:
    discrete = run(scenario)
    single = run(scenario.with_(single_grouped_weight=True))
    # The two runs really differ in how the experts are presented.
    # fc1 of 4 SwiGLU experts: (E, 2 * ffn, hidden).
    assert tuple(single[0]["params"][GROUPED].shape) == (4, 256, 128)
    assert GROUPED + "0" in discrete[0]["params"] and GROUPED not in discrete[0]["params"]
    return discrete, single


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("fusion", [False, True], ids=["no-fusion", "grad-accum-fusion"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_single_grouped_equals_discrete(precision, fusion, optimizer):
    scenario = BASE.with_(
        **PRECISIONS[precision], **OPTIMIZERS[optimizer], grad_accum_fusion=fusion
    )
    discrete, single = pair(scenario)
    if precision == "mxfp8-primary":
        # The grouped weight's storage is MXFP8 and sits in a quantized bucket.
        assert any(":fp8" in kind for group in single[0]["bucket_groups"] for kind in group)
    if optimizer == "layerwise-muon":
        assert single[0]["layer_wise"] and discrete[0]["layer_wise"]
        # Each rank holds the masters of what it owns; the two ranks split the experts.
        assert any(GROUPED in r["masters"] for r in single)
    assert_same_training(discrete, single)


def test_control_distopt_adam_experts_paired_with_the_wrong_weights_differ():
    """Control of ``test_single_grouped_equals_discrete`` for DistOpt Adam (bf16, no fusion):
    the discrete run whose first two experts start with each other's fc1 weights
    (tests/support/expert_controls.py) completes and fails the same comparison with the single
    grouped run."""
    from tests.support.expert_controls import train_with_two_experts_swapped

    scenario = BASE.with_(**OPTIMIZERS["distopt-adam"])
    single = run(scenario.with_(single_grouped_weight=True))
    swapped = run_on_ranks(train_with_two_experts_swapped, scenario, world_size=2, boot=FP8)
    assert_diverges(swapped, single, assert_same_training)


def test_grad_accum_fusion_changes_the_arithmetic():
    """Control for the fusion axis: it is really on (fp32 accumulation, other last bits)."""
    plain = run(BASE.with_(**OPTIMIZERS["layerwise-muon"], single_grouped_weight=True))
    fused = run(
        BASE.with_(
            **OPTIMIZERS["layerwise-muon"], single_grouped_weight=True, grad_accum_fusion=True
        )
    )
    assert plain[0]["losses"] != fused[0]["losses"]


# --------------------------------------------------------------------------- controls


def _stacked_orthogonalize():
    """Muon on the stacked ``(E*out, in)`` matrix: what per-expert orthogonalisation fixes."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from nemo_lw_fp8.patches import original

    stock = original(TensorParallelMuon, "orthogonalize")

    def orthogonalize(self, p, grad, **kwargs):
        if grad.dim() == 3:
            return stock(self, p, grad.reshape(-1, grad.shape[-1]), **kwargs).view(grad.shape)
        return stock(self, p, grad, **kwargs)

    return TensorParallelMuon, orthogonalize


def train_with_stacked_muon(scenario: Scenario) -> dict:
    import nemo_lw_fp8

    nemo_lw_fp8.apply()
    owner, replacement = _stacked_orthogonalize()
    saved = owner.__dict__["orthogonalize"]
    owner.orthogonalize = replacement
    try:
        return train(scenario)
    finally:
        owner.orthogonalize = saved


def test_control_stacked_newton_schulz_differs():
    scenario = BASE.with_(**OPTIMIZERS["layerwise-muon"])
    discrete = run(scenario)
    stacked = run_on_ranks(
        train_with_stacked_muon, scenario.with_(single_grouped_weight=True), world_size=2, boot=FP8
    )
    assert_diverges(discrete, stacked, assert_same_training)


def test_control_stock_routing_sends_grouped_weights_to_adam():
    """Without the plugin, megatron 0.19.2 routes the 3-D grouped weight to Adam (its
    ``len(param.shape) != 2`` rule). At EP 1 megatron's TE spec marks expert weights for the
    dense data-parallel group (``_set_expert_parameter_attributes``: expert groups only with
    EP > 1 or ETP != TP), so Adam is the sibling DistributedOptimizer's, whose masters are flat
    shards: the run completes and trains other numbers than Muon on each discrete expert."""
    scenario = BASE.with_(**OPTIMIZERS["layerwise-muon"])
    discrete = run(scenario)
    stock = run(scenario.with_(plugin=False, single_grouped_weight=True))
    for result in stock:  # no layer-wise (3-D) master for the grouped weight on any rank
        assert GROUPED not in result["masters"] or result["masters"][GROUPED].dim() == 1
    assert any(GROUPED in r["masters"] for r in stock)  # the DistOpt shards hold it
    assert_diverges(discrete, stock, assert_same_training)


# --------------------------------------------------------------------------- train -> eval -> train

EVAL = BASE.with_(
    **OPTIMIZERS["layerwise-muon"],
    **PRECISIONS["mxfp8-primary"],
    overlap=True,
    single_grouped_weight=True,
    steps=4,
)


def _no_eval_losses(results: list[dict]) -> list[dict]:
    return [{**r, "eval_losses": []} for r in results]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_train_eval_train_equals_train_only(optimizer):
    """With grad-buffer reuse an eval's forced param sync must not leave the next step's
    gradients on a dirty buffer (the grad-norm spike after eval of #5464)."""
    scenario = EVAL.with_(**OPTIMIZERS[optimizer])
    train_only = run(scenario)
    with_eval = run(scenario.with_(eval_after=(1,)))
    assert len(with_eval[0]["eval_losses"]) == 1
    assert_same_training(train_only, _no_eval_losses(with_eval))
    discrete = run(scenario.with_(eval_after=(1,), single_grouped_weight=False))
    assert_same_training(discrete, with_eval)


def train_without_restage(scenario: Scenario) -> dict:
    from nemo_lw_fp8.mechanics import staging

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(staging, "restage_after_zero", lambda *a, **k: None)
        return train(scenario)


def test_control_train_eval_train_needs_the_restage():
    train_only = run(EVAL)
    broken = run_on_ranks(
        train_without_restage, EVAL.with_(eval_after=(1,)), world_size=2, boot=FP8
    )
    assert_diverges(train_only, _no_eval_losses(broken), assert_same_training)


def test_control_momentum_differing_in_the_last_bit_is_caught():
    """Control of the momentum comparison in ``assert_same_training``: two otherwise equal
    layer-wise results whose Muon momentum differs in one element's last bit must diverge
    (losses, params and masters stay equal, as after a step whose normalised update hid it)."""
    import torch

    def result(momentum: torch.Tensor) -> dict:
        weight = torch.linspace(-1, 1, 12).reshape(3, 4)
        return {"losses": [1.0], "eval_losses": [], "params": {"w": weight}, "layer_wise": True,
                "masters": {"w": weight.float()}, "momenta": {"w": momentum}}  # fmt: skip

    momentum = torch.linspace(-0.5, 0.5, 12).reshape(3, 4)
    nudged = momentum.clone()
    nudged[1, 2] = torch.nextafter(nudged[1, 2], torch.tensor(1.0))
    assert_same_training([result(momentum)], [result(momentum.clone())])
    assert_diverges([result(momentum)], [result(nudged)], assert_same_training, match="momentum")


def test_grouped_tensor_survives_training():
    """The trained single run still holds TE GroupedTensor parameters (nothing unwrapped them)."""
    results = run_on_ranks(_grouped_param_types, EVAL, world_size=2, boot=FP8)
    for kinds in results:
        assert kinds and all(kind == "GroupedTensor" for kind in kinds), kinds


def _grouped_param_types(scenario: Scenario) -> list[str]:
    from tests.support.scenarios import build_model
    from tests.support.training import wrap_and_build_optimizer

    module, config = build_model(scenario)
    wrap_and_build_optimizer(module, config, scenario)
    return [
        type(p).__name__
        for n, p in module.named_parameters()
        if n.endswith("experts.linear_fc1.weight")
    ]


# ------------------------------------------------------------------ checkpoint across layouts

RESUME = BASE.with_(**OPTIMIZERS["layerwise-muon"], named_checkpoint=True, steps=6)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8-compute", "mxfp8-primary"])
@pytest.mark.parametrize("save_single", [True, False], ids=["save-single", "save-discrete"])
def test_checkpoint_across_layouts_continues_bitwise(tmp_path, precision, save_single):
    """Save after 3 steps in one presentation, load into the other, train 3 more: equal to 6
    uninterrupted steps in the loading presentation (losses of steps 3-5, every parameter)."""
    scenario = RESUME.with_(**PRECISIONS[precision])
    load_single = not save_single
    uninterrupted = run(scenario.with_(single_grouped_weight=load_single))
    directory = str(tmp_path / "ckpt")
    run(scenario.with_(single_grouped_weight=save_single, steps=3, save_dir=directory))
    resumed = run(
        scenario.with_(single_grouped_weight=load_single, first_step=3, load_dir=directory)
    )
    for a, b in zip(uninterrupted, resumed, strict=True):
        assert a["losses"][3:] == b["losses"]
    assert_same_training(
        [{**r, "losses": r["losses"][3:], "masters": r["masters"]} for r in uninterrupted], resumed
    )


def test_control_checkpoint_without_momentum_differs(tmp_path):
    """Control: dropping Muon's momentum from the converted state breaks the continuation."""
    scenario = RESUME.with_(single_grouped_weight=False)
    uninterrupted = run(scenario)
    directory = str(tmp_path / "ckpt")
    run(scenario.with_(single_grouped_weight=True, steps=3, save_dir=directory))
    resumed = run_on_ranks(
        train_loading_masters_only,
        scenario.with_(first_step=3, load_dir=directory),
        world_size=2,
        boot=FP8,
    )
    uninterrupted = [{**r, "losses": r["losses"][3:]} for r in uninterrupted]
    assert_diverges(uninterrupted, resumed, assert_same_training)


def train_loading_masters_only(scenario: Scenario) -> dict:
    import torch

    original = torch.load

    def without_momentum(*args, **kwargs):
        state = original(*args, **kwargs)
        if isinstance(state, dict) and "layer_wise" in state:
            state["layer_wise"] = {"master": state["layer_wise"]["master"]}
        return state

    torch.load = without_momentum
    try:
        return train(scenario)
    finally:
        torch.load = original
