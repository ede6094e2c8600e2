"""The layers each recipe's Bridge provider asks megatron to build on the GPU (TE's spec): the
architecture's attention kind and its dense / MoE layer pattern, layer by layer.

Bridge's ``GPTModelProvider`` defaults to one TE layer spec repeated over every layer: softmax
attention with a fused ``linear_qkv`` and, with experts, MoE everywhere. Bridge's own DeepSeek
bridges replace it with megatron's decoder block spec (MLA, leading dense layers) and its
Qwen3-Next / Qwen3.5 bridges with the hybrid block spec (Gated DeltaNet); the plugin's recipes
must do the same, or a DeepSeek recipe trains another model than DeepSeek.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from nemo_lw_fp8 import recipes
from tests.support import fork_server

#: One recipe per architecture (its tiny twin: the same provider code, PP 1 on 2 ranks).
NAMES = tuple(sorted(name for name in recipes.RECIPES if name.startswith("tiny_")
                     and not name.endswith(("_hopper", "_nvfp4"))))  # fmt: skip

_SCRIPT = """
import inspect, json, os
import torch.distributed as dist
from nemo_lw_fp8.cpu.te import backend as te_backend
te_backend.activate()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.bridge.models.gpt_provider import default_layer_spec
from megatron.core import parallel_state
from megatron.core.transformer.spec_utils import ModuleSpec
from nemo_lw_fp8 import recipes
parallel_state.initialize_model_parallel()

def kind(entry):
    # a ModuleSpec, a class, or a partial of either
    while hasattr(entry, "func"):
        entry = entry.func
    entry = getattr(entry, "module", entry)
    while hasattr(entry, "func"):
        entry = entry.func
    return entry.__name__

def layers(spec, n):
    if isinstance(spec, ModuleSpec):  # one layer spec, repeated by the block
        spec = [spec] * n
    else:
        spec = spec.layer_specs
    out = []
    for layer in spec:
        sub = layer.submodules
        attention = kind(sub.self_attention)
        mlp = kind(sub.mlp)
        out.append([attention, "moe" if mlp == "MoELayer" else "dense"])
    return out

def provided(model):
    spec = model.transformer_layer_spec
    if isinstance(spec, ModuleSpec):
        return spec
    if "vp_stage" in inspect.signature(spec).parameters:
        return spec(model, vp_stage=None)
    return spec(model)

result = {}
for name in NAMES:
    model = recipes.get_recipe(name)().model
    result[name] = {
        "provider": layers(provided(model), model.num_layers),
        "bridge_default": layers(default_layer_spec(model), model.num_layers),
    }
print("RESULT" + json.dumps(result))
"""


@pytest.fixture(scope="module")
def built_layers() -> dict[str, dict[str, list]]:
    """Per tiny recipe: ``[attention class, "moe" | "dense"]`` per decoder layer, from the
    recipe's provider and from Bridge's default spec (the control's). A process of its own (TE
    over the emulation and a process group, kept out of this one), forked from the session's
    launch server."""
    script = f"NAMES = {NAMES!r}\n" + textwrap.dedent(_SCRIPT)
    proc = fork_server.run_script(script, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[0][6:])


def _expected(name: str) -> list[list[str]]:
    arch = recipes.tiny_architecture_of(name)
    assert arch is not None, name
    moe = arch.moe_layer_pattern()
    linear = arch.linear_attention_pattern() if arch.experimental_attention_variant else None
    out = []
    for i, is_moe in enumerate(moe):
        if linear is not None and linear[i]:
            attention = "GatedDeltaNet"
        elif arch.multi_latent_attention:
            attention = "MLASelfAttention"
        else:
            attention = "SelfAttention"
        out.append([attention, "moe" if is_moe else "dense"])
    return out


@pytest.mark.parametrize("name", NAMES)
def test_recipe_provider_builds_the_architectures_layers(built_layers, name):
    assert built_layers[name]["provider"] == _expected(name)


def test_control_bridge_default_spec_builds_other_layers(built_layers):
    """Control: Bridge's default spec (what the DeepSeek recipes asked for before) builds
    softmax attention and MoE in every layer: every MLA architecture's layers differ, and so do
    the hybrids'; the Qwen3 MoE recipes (GQA, MoE everywhere) are built the same."""
    for name in NAMES:
        arch = recipes.tiny_architecture_of(name)
        differs = built_layers[name]["bridge_default"] != _expected(name)
        assert differs == bool(arch.multi_latent_attention or arch.experimental_attention_variant)
