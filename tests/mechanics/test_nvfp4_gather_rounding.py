"""The FP4 param gather's bytes do not depend on TE's stochastic rounding: in TE 2.20.2's
``NVFP4BlockScaling`` (``transformer_engine/common/recipe/__init__.py``) only the backward
gradient quantizer (``fp4_quant_bwd_grad``) rounds stochastically; the weight quantizer
(``fp4_quant_fwd_weight``) never does, and the owner packs its weight through that quantizer
(:func:`nemo_lw_fp8.mechanics.nvfp4_gather.pack_param`). So on a GPU, where the recipes keep
stochastic rounding on, the gather moves the same bytes as in the CPU proof (docs/nvfp4.md,
"Stochastic rounding")."""

from __future__ import annotations

from tests.support.te_test_support import blackwell_script, needs_te, te_script_results

SCRIPT = blackwell_script(
    r"""
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import NVFP4BlockScaling
from nemo_lw_fp8.mechanics import nvfp4_gather

master = torch.randn(256, 128, generator=torch.Generator().manual_seed(5))
packed = {}
for rounding in ("stochastic", "nearest"):
    recipe = NVFP4BlockScaling(disable_stochastic_rounding=rounding == "nearest")
    R[f"grad_quantizer_stochastic_{rounding}"] = recipe.fp4_quant_bwd_grad.stochastic_rounding
    with te.quantized_model_init(enabled=True, recipe=recipe):
        layer = te.Linear(128, 256, bias=False, params_dtype=torch.bfloat16, device="cpu")
    weight = layer.weight
    R[f"weight_quantizer_stochastic_{rounding}"] = bool(weight._quantizer.stochastic_rounding)
    out = torch.empty(nvfp4_gather.param_wire_bytes(weight), dtype=torch.uint8)
    nvfp4_gather.pack_param(weight, master, out)
    packed[rounding] = out
R["same_bytes"] = torch.equal(packed["stochastic"], packed["nearest"])
R["bytes"] = int(packed["nearest"].numel())
R["codes_nonzero"] = bool(packed["nearest"].any())
print("RESULT " + json.dumps(R))
"""
)


@needs_te
def test_fp4_gather_bytes_do_not_depend_on_stochastic_rounding():
    """Under TE's recipe with stochastic rounding on (its default) and off, the gradient
    quantizer differs, the weight quantizer does not, and the owner's packed bytes of the same
    master are equal."""
    r = te_script_results(SCRIPT)
    assert r["backend"] == "emulated"
    assert r["grad_quantizer_stochastic_stochastic"] is True
    assert r["grad_quantizer_stochastic_nearest"] is False
    assert r["weight_quantizer_stochastic_stochastic"] is False
    assert r["weight_quantizer_stochastic_nearest"] is False
    assert r["same_bytes"] and r["codes_nonzero"] and r["bytes"] > 256 * 128 // 2
