"""The plugin's decisions come from where megatron reads its settings (issue 20).

A megatron-core user may build a run the way megatron's own unit-test helpers do: FP8 settings on
the DDP config (where DDP's buffers read them) and in the parameters' quantized types, with an
``OptimizerConfig`` that carries neither ``fp8_recipe`` nor ``reuse_grad_buf_for_mxfp8_param_ag``
(megatron-core 0.19.2 accepts that). Such a run must get the same plugin behaviour as a
megatron-training or Bridge run: FP8 param gather ON = OFF bitwise, for MXFP8 and blockwise FP8,
padded and compact layouts, overlapped gathers or not. A control forces the plugin's MXFP8
staging off (what keying it on the optimizer config did): the run diverges.
"""

from __future__ import annotations

import pytest

from tests.support.fp8_mlp import FP8_BOOT, MUON_FP8_MLP, skip_module_without_te
from tests.support.harness import run_on_ranks
from tests.support.parity import assert_diverges, assert_fp8_gather_parity
from tests.support.scenarios import Scenario, boot_for
from tests.support.training import train

skip_module_without_te("the FP8 emulation needs TE's Python package")

FP8 = FP8_BOOT
DIRECT = MUON_FP8_MLP.with_(fp8_on_optimizer_config=False)


def run(scenario: Scenario) -> list[dict]:
    return run_on_ranks(train, scenario, boot=FP8)


@pytest.mark.parametrize(
    "recipe, distribution, overlap",
    [
        ("mxfp8", "layerwise_padded", True),
        ("mxfp8", "layerwise_compact", False),
        ("blockwise", "layerwise_padded", False),
        ("blockwise", "layerwise_compact", True),
    ],
)
def test_fp8_gather_on_equals_off_without_optimizer_fp8_settings(recipe, distribution, overlap):
    scenario = DIRECT.with_(fp8_recipe=recipe, distribution=distribution, overlap=overlap)
    off = run(scenario)
    on = run(scenario.with_(fp8_param_gather=True))
    assert_fp8_gather_parity(off, on)


def train_with_staging_keyed_on_optimizer_config(scenario: Scenario) -> dict:
    """Control: the plugin decides MXFP8 staging from ``OptimizerConfig`` alone (off here),
    while DDP stages in the grad buffer."""
    from nemo_lw_fp8.mechanics import run_settings

    def optimizer_config_only(optimizer) -> bool:
        return bool(getattr(optimizer.config, "reuse_grad_buf_for_mxfp8_param_ag", False))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(run_settings, "stages_in_grad_buffer", optimizer_config_only)
        return train(scenario)


def test_control_staging_keyed_on_the_optimizer_config_diverges():
    scenario = DIRECT.with_(overlap=True)
    off = run(scenario)
    on = run_on_ranks(
        train_with_staging_keyed_on_optimizer_config,
        scenario.with_(fp8_param_gather=True),
        boot=FP8,
    )
    assert_diverges(off, on)


def guard_message(scenario: Scenario, context_parallel_size: int | None = None) -> str:
    """Build the optimizer; return the plugin's rule message (empty if none fired).
    ``context_parallel_size``: what the model's config says (a megatron-core user building at
    CP 2 hands the optimizer such a config)."""
    from nemo_lw_fp8.errors import ConfigError
    from tests.support.scenarios import build_model
    from tests.support.training import wrap_and_build_optimizer

    module, config = build_model(scenario)
    if context_parallel_size is not None:
        config.context_parallel_size = context_parallel_size
    try:
        wrap_and_build_optimizer(module, config, scenario)
    except ConfigError as error:
        return str(error)
    return ""


def test_a_rule_names_the_fields_it_read():
    """Blockwise FP8 weights with grad-buffer reuse set on the DDP config only: the rule fires
    on what DDP reads, and its message says where each value came from."""
    scenario = DIRECT.with_(fp8_recipe="blockwise", fp8_param_gather=True)
    messages = run_on_ranks(guard_message_with_reuse_on_ddp, scenario, boot=FP8)
    for message in messages:
        assert "blockwise-gather-no-grad-buffer-reuse" in message, message
        assert "fp8_recipe='blockwise' from the parameters' type" in message
        assert (
            "reuse_grad_buf_for_mxfp8_param_ag=True from "
            "DistributedDataParallelConfig.reuse_grad_buf_for_mxfp8_param_ag" in message
        )


def guard_message_with_reuse_on_ddp(scenario: Scenario) -> str:
    from tests.support import training

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(training, "_reuse_grad_buf", lambda scenario: True)
        return guard_message(scenario)


def test_context_parallel_is_refused_where_the_optimizer_is_built():
    """Rule ``layer-wise-context-parallel`` runs at the megatron-core optimizer build, not only
    in megatron-training's and Bridge's argument checks (issue 43). Control: the same build at
    CP 1 passes every rule."""
    scenario = Scenario(optimizer="muon", distribution="layerwise_padded", model="gpt",
                        plugin=True)  # fmt: skip
    boot = boot_for(scenario)
    refused = run_on_ranks(guard_message, scenario, 2, boot=boot)
    for message in refused:
        assert "layer-wise-context-parallel" in message, message
        assert "context_parallel_size=2 from TransformerConfig.context_parallel_size" in message
    assert run_on_ranks(guard_message, scenario, 1, boot=boot) == ["", ""]
