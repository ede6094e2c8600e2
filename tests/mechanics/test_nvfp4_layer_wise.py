"""NVFP4 compute under layer-wise Muon on TE's own modules (issue 30): a GPT from megatron's TE
spec with ``fp4="e2m1"`` (megatron's ``get_fp4_context``: TE's ``NVFP4BlockScaling`` around
each layer; the RHT on inputs and gradients, 16x16-block weights), bf16 weights (FP4 primary
weights and their gather: ``tests/mechanics/test_nvfp4_param_gather.py``), dense and with MoE
layers of discrete experts (``SequentialMLP`` of TE linears), on two data-parallel ranks, with
the devices answered as a B200 would. Stochastic rounding is off (megatron's ``get_fp4_recipe``
result with ``disable_stochastic_rounding=True``; TE reads
``NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING`` only when it is imported): the emulation refuses it
by name (docs/nvfp4.md).

Claims, bitwise in losses, every rank's fp32 masters and Muon momenta:
* the plugin's compact layout with its owner reduce and overlapped gathers equals megatron's own
  layer-wise layout without overlap (what the plugin changes is where bytes sit and when they
  move, not the arithmetic), with an eval forward between the steps on both sides;
* save (``torch_dist``) after two steps, load into a model built from another seed, two more
  steps: equal to four uninterrupted steps. Control: the same resume with one loaded master one
  ulp off diverges.
The runs really computed in NVFP4: the same model in bf16 gives other losses. The compact runs
synced their Muon gradients by the owner reduce and megatron's layout issued no reduce, as the
ranks issued them (``tests/support/owner_reduce_probe.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nemo_lw_fp8.cpu.te import backend as te_backend
from tests.support import owner_reduce_probe as probe
from tests.support.harness import BootOptions, run_on_ranks
from tests.support.parity import assert_diverges
from tests.support.resumable import assert_same_run

if te_backend.te_package_dirs() is None:  # find, never import, TE in this process
    pytest.skip("TE's own modules need TE's Python package", allow_module_level=True)

BOOT = BootOptions(fp8_emulation=True)
#: NVFP4 needs both GEMM dims in multiples of 16; the tokens per rank are micro_batch x 16.
HIDDEN, FFN = 128, 256


#: MoE layers with discrete experts (megatron's ``SequentialMLP`` of TE linears, each padding its
#: tokens to megatron's FP4 alignment, 128 rows).
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128,
           moe_token_dispatcher_type="allgather", moe_router_dtype="fp64")  # fmt: skip


def build_nvfp4_gpt(fp4: bool, seed: int, moe: bool = False):
    """A 2-layer GPT (SwiGLU, RMSNorm; MoE with ``moe``) from megatron's TE spec; NVFP4 compute
    with ``fp4``."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.support.scenarios import build_gpt, seed_all, transformer_config

    seed_all(seed)
    model_parallel_cuda_manual_seed(seed)
    precision: dict[str, Any] = {"fp4": "e2m1", "fp4_recipe": "nvfp4"} if fp4 else {}
    config = transformer_config(
        hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=4, add_bias_linear=False,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", use_cpu_initialization=False, **precision,
        **(MOE if moe else {}),
    )  # fmt: skip
    return build_gpt(config), config


def nvfp4_run(
    layout: str,
    fp4: bool = True,
    steps: tuple[int, int] = (0, 3),
    save_dir: str | None = None,
    load_dir: str | None = None,
    nudge_loaded_master: bool = False,
    moe: bool = False,
) -> dict[str, Any]:
    """Steps ``steps[0]..steps[1]-1`` of layer-wise Muon with ``layout`` "compact" (the plugin's
    layout, owner reduce, overlapped gathers) or "stock" (megatron's padded layer-wise layout,
    no overlap), an eval forward after the first step; a ``torch_dist`` load before and save
    after. Returns losses, eval losses, this rank's masters and momenta, and how many of TE's
    GEMMs ran and took NVFP4 operands."""

    from tests.support import nvfp4_runs
    from tests.support.scenarios import Scenario

    compact = layout == "compact"
    scenario = Scenario(
        model="gpt", optimizer="muon", plugin=True, seed=5, micro_batch=4,
        distribution="layerwise_compact" if compact else "layerwise_padded", overlap=compact,
    )  # fmt: skip
    gemms: list[str] = []
    with nvfp4_runs.nvfp4_on_blackwell() as mp:
        nvfp4_runs.record_gemm_operands(mp, gemms)
        module, config = build_nvfp4_gpt(fp4, seed=5 if load_dir is None else 17, moe=moe)
        report, _ = nvfp4_runs.train_and_report(
            scenario, module, config, steps, load_dir=load_dir, save_dir=save_dir,
            nudge_loaded_master=nudge_loaded_master,
        )  # fmt: skip
        return {**report, **nvfp4_runs.gemm_counts(gemms)}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_nvfp4_compact_layout_equals_stock_layer_wise(moe):
    """NVFP4 compute, layer-wise Muon: the plugin's compact layout (owner reduce, overlapped
    gathers) = megatron's layer-wise layout without overlap, bitwise (an eval between steps);
    every TE GEMM took NVFP4 operands, and bf16 compute gives other losses."""
    compact, stock = (
        run_on_ranks(probe.run_probed, nvfp4_run, layout, moe=moe, world_size=2, boot=BOOT)
        for layout in ("compact", "stock")
    )
    probe.assert_reduced_to_owners(compact, "compact")
    probe.assert_no_reduce(stock, "stock")
    # every TE GEMM (fprop, dgrad, wgrad of the 8 TE linears) took NVFP4 operands
    assert all(r["nvfp4_gemms"] == r["gemms"] > 0 for r in compact + stock), compact
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in compact)
    assert_same_run(stock, compact)
    bf16 = run_on_ranks(nvfp4_run, "compact", False, moe=moe, world_size=2, boot=BOOT)
    assert all(r["nvfp4_gemms"] == 0 < r["gemms"] for r in bf16)
    assert all(a["losses"][0] != b["losses"][0] for a, b in zip(bf16, compact, strict=True))


def test_nvfp4_layer_wise_resumes_bitwise(tmp_path):
    """Save after two steps (``torch_dist``), load into a build from another seed, two more
    steps: the losses, masters and momenta of four uninterrupted steps, bitwise. Control: one
    loaded master one ulp off diverges."""
    (tmp_path / "step2").mkdir()
    saved = str(tmp_path / "step2")
    whole = run_on_ranks(
        probe.run_probed, nvfp4_run, "compact", True, (0, 4), world_size=2, boot=BOOT
    )
    first = run_on_ranks(nvfp4_run, "compact", True, (0, 2), saved, world_size=2, boot=BOOT)
    resumed = run_on_ranks(
        probe.run_probed, nvfp4_run, "compact", True, (2, 4), None, saved, world_size=2,
        boot=BOOT,
    )  # fmt: skip
    # The uninterrupted steps and the resumed ones synced by the owner reduce.
    probe.assert_reduced_to_owners(whole, "uninterrupted")
    probe.assert_reduced_to_owners(resumed, "resumed")
    for rank in range(2):
        assert first[rank]["losses"] + resumed[rank]["losses"] == whole[rank]["losses"]
    no_evals = [{**r, "losses": [], "eval_losses": []} for r in whole]
    assert_same_run(no_evals, [{**r, "losses": [], "eval_losses": []} for r in resumed])
    nudged = run_on_ranks(
        nvfp4_run, "compact", True, (2, 4), None, saved, True, world_size=2, boot=BOOT
    )
    assert_diverges(
        no_evals, [{**r, "losses": [], "eval_losses": []} for r in nudged], assert_same_run
    )
