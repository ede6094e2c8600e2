"""TE's NVFP4 stochastic rounding: on a GPU the recipes keep TE's default (on); the CPU backend,
whose emulation cannot reproduce the random bits, turns it off for its own runs only, and leaves
an explicit user setting alone (docs/nvfp4.md, "Stochastic rounding")."""

from __future__ import annotations

from tests.support.te_test_support import needs_te, te_script_results

SCRIPT = r"""
import json, os
os.environ.pop("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", None)
from nemo_lw_fp8.cpu.te import activate
R = {"backend": activate()}
from types import SimpleNamespace
from megatron.core import fp4_utils
from nemo_lw_fp8.cpu.megatron import bridge_pretrain

config = SimpleNamespace(fp4_recipe="nvfp4", fp8_dot_product_attention=False)
R["te_default"] = fp4_utils.get_fp4_recipe(config).disable_stochastic_rounding
bridge_pretrain._install_nvfp4_without_stochastic_rounding()
R["cpu_backend"] = fp4_utils.get_fp4_recipe(config).disable_stochastic_rounding
os.environ["NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"] = "0"
R["user_set_on"] = fp4_utils.get_fp4_recipe(config).disable_stochastic_rounding
bridge_pretrain.uninstall()
os.environ.pop("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING")
R["uninstalled"] = fp4_utils.get_fp4_recipe(config).disable_stochastic_rounding
print("RESULT " + json.dumps(R))
"""


@needs_te
def test_cpu_backend_turns_stochastic_rounding_off_for_itself_only():
    """megatron's NVFP4 recipe has TE's default (stochastic rounding on) without the CPU
    backend; with it, off; with the user's explicit ``=0``, on (the emulation then refuses it by
    name); and on again once the backend is uninstalled."""
    r = te_script_results(SCRIPT)
    assert r["backend"] == "emulated"
    assert (r["te_default"], r["cpu_backend"]) == (False, True)
    assert (r["user_set_on"], r["uninstalled"]) == (False, False)
