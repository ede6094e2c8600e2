"""The plugin on the next upstream pair, megatron-core 0.20.0-dev + Megatron-Bridge 0.7.0-dev
(``make test-next-release``; docs/install.md, "The next release"): the wheels are the ones
imported, Muon's renamed routing predicate still sends single grouped expert weights to Muon,
and tiny DeepSeek-V3 through Bridge's own ``pretrain --cpu`` on 2 ranks (TE's modules, single
grouped MXFP8 expert weights, MLA, MTP, compact layout, owner reduce) trains with FP8 param
gather ON = OFF bitwise and resumes bitwise in fresh processes; tiny Qwen3-30B-A3B Hopper
runs the blockwise FP8 gather ON = OFF. Each claim has its control.

The DeepSeek-V3 runs own each grouped weight's experts in runs on both ranks
(``grouped_weight_ownership=expert``): the compact gather then assembles every grouped MXFP8
weight from both ranks' segments and quantizes it once (``compact_gather.unpack``, the code 0.20
broke by no longer re-exporting ``copy_tensor_to_quantized_param`` from
``param_and_grad_buffer``).
"""

from __future__ import annotations

import json
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from tests.support import bridge_runs as br
from tests.support import fork_server

pytestmark = pytest.mark.usefixtures("bridge_installed")

MEGATRON_CORE, BRIDGE = "0.20.0", "0.7.0"
RECIPE = "tiny_deepseek_v3"
STEPS = 3
SAVED_AT = 2
EXPERT = "optimizer.grouped_weight_ownership=expert"
RUNS = br.SavingRuns(
    "next", RECIPE, f"train.train_iters={STEPS}", "validation.eval_interval=2",
    "train.global_batch_size=4", EXPERT, saved_at=SAVED_AT, probe=True, cpu_modules="te",
)  # fmt: skip
_run, _on, _resumed = RUNS.run, RUNS.on, RUNS.resumed


def _script_result(script: str) -> dict:
    """Run ``script`` in a process forked from the launch server (the process every run below
    forks from: TE over the emulation, then megatron-core and Bridge imported); its ``RESULT``
    line."""
    done = fork_server.run_script(textwrap.dedent(script), timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, (done.stdout + done.stderr)[-4000:]
    return json.loads(lines[-1][len("RESULT") :])


_IMPORTED = """
import json
from importlib import metadata

import megatron.bridge
import megatron.core
from megatron.core import package_info

result = {}
for dist, module in (("megatron-core", megatron.core), ("megatron-bridge", megatron.bridge)):
    found = metadata.distribution(dist)
    result[dist] = {
        "version": found.version,
        "file": module.__file__,
        "dist_file": str(found.locate_file(module.__name__.replace(".", "/") + "/__init__.py")),
    }
result["package_info"] = [package_info.MAJOR, package_info.MINOR, package_info.PATCH]
print("RESULT" + json.dumps(result))
"""


def test_the_next_release_is_what_is_imported():
    """This process and the launch server both resolve megatron-core 0.20.0 and Bridge 0.7.0,
    and the modules the runs import are those distributions' files (not the tested 0.19.2 /
    0.6.2 beneath them on the path)."""
    assert metadata.version("megatron-core") == MEGATRON_CORE
    assert metadata.version("megatron-bridge") == BRIDGE
    found = _script_result(_IMPORTED)
    assert found["package_info"] == [int(x) for x in MEGATRON_CORE.split(".")]
    for dist, version in (("megatron-core", MEGATRON_CORE), ("megatron-bridge", BRIDGE)):
        assert found[dist]["version"] == version, found
        assert Path(found[dist]["file"]).resolve() == Path(found[dist]["dist_file"]).resolve()


_VERDICTS = """
import json
import os

from nemo_lw_fp8.cli import doctor
from nemo_lw_fp8.patches import PATCH_MODULES

os.environ.pop("NEMO_LW_FP8_ALLOW_UNTESTED_MEGATRON", None)
rows = doctor.patch_verdicts(import_bridge=True)
print("RESULT" + json.dumps({"rows": rows, "modules": list(PATCH_MODULES)}))
"""


def test_every_patch_is_recorded_for_the_next_release():
    """Supported the way a release is: every patch has this pair's record (its fingerprints,
    not the version number, admit it), so ``doctor`` (the verdict ``apply()`` acts on) says
    ``patched ... recorded over`` the pair for all 16, with no override and no changed
    object."""
    found = _script_result(_VERDICTS)
    assert [row["patch"] for row in found["rows"]] == found["modules"]
    for row in found["rows"]:
        key = f"megatron-bridge {BRIDGE}" if row["target"] == "megatron-bridge" else (
            f"megatron-core {MEGATRON_CORE}"
        )
        assert row["status"] == "patched" and row["reason"] == f"recorded over {key}", row
        assert row["changed"] == [], row


_ROUTING = """
import json
import os

import torch
import transformer_engine.pytorch as te
from megatron.core.optimizer import emerging_optimizers as eo

import nemo_lw_fp8

os.environ["NVTE_GROUPED_LINEAR_SINGLE_PARAM"] = "1"  # TE's single grouped weight
op = te.ops.GroupedLinear(4, 32, 16, bias=False, device="cpu", dtype=torch.bfloat16,
                          single_grouped_weight=True)
untagged = torch.nn.Parameter(torch.zeros(16, 32, dtype=torch.bfloat16))
untagged.use_muon = False  # 0.20's own exclusion (Mamba's in_proj)
bias = torch.nn.Parameter(torch.zeros(16, dtype=torch.bfloat16))
params = {"grouped": op.weight, "use_muon_false": untagged, "bias": bias}


def predicates():
    out = {}
    for name in ("muon", "adaptive_muon"):
        keys = list(eo._EMERGING_OPTIMIZERS[name].default_param_overrides)
        out[name] = [
            {"name": key.predicate.name, "upstream": key.predicate.fn is eo._is_muon_excluded,
             "excluded": {p: bool(key.predicate(param)) for p, param in params.items()}}
            for key in keys
        ]
    return out


result = {"dim": op.weight.dim(), "before": predicates()}
result["verdicts"] = nemo_lw_fp8.apply(["grouped_weight_layerwise"])
result["patched"] = predicates()
nemo_lw_fp8.revert()
result["reverted"] = predicates()
print("RESULT" + json.dumps(result))
"""


def test_muon_routes_single_grouped_weights_under_the_renamed_predicate():
    """0.20 renamed Muon's exclusion predicate ``nonlinear_or_embedding`` -> ``muon_excluded``
    (and widened it to params tagged ``use_muon=False``). Applied, the plugin replaces it under
    its 0.20 name: TE's single grouped weight (a 3-D ``GroupedTensor``) goes to Muon, while a
    ``use_muon=False`` matrix and a bias still go to the scalar optimizer. Control: megatron's
    own predicate, before the patch and after ``revert()``, sends the grouped weight to Adam."""
    found = _script_result(_ROUTING)
    assert found["dim"] == 3
    assert found["verdicts"] == {"grouped_weight_layerwise": "patched"}, found["verdicts"]
    upstream = {"grouped": True, "use_muon_false": True, "bias": True}
    plugin = {"grouped": False, "use_muon_false": True, "bias": True}
    for when, upstream_fn, excluded in (
        ("before", True, upstream), ("patched", False, plugin), ("reverted", True, upstream)
    ):  # fmt: skip
        for name in ("muon", "adaptive_muon"):
            (predicate,) = found[when][name]
            assert predicate == {
                "name": "muon_excluded", "upstream": upstream_fn, "excluded": excluded
            }, (when, name, predicate)  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for the module's runs (the resumes load the ON run's checkpoint)."""
    return tmp_path_factory.mktemp("next-release")


def _off(tmp: Path) -> dict:
    return _run(tmp, "next-off", *br.GATHER_OFF)


def _grouped_expert_entries(run: dict) -> dict[str, list[str]]:
    """The per-expert state entries of the single grouped expert weights, and their kinds."""
    return {
        name: sorted(kinds)
        for name, kinds in run["state"]["end"].items()
        if ".mlp.experts.linear_fc" in name and "/expert" in name
    }


def test_fp8_gather_on_equals_off_on_the_next_release(runs):
    """ON = OFF bitwise: losses, evaluations, grad norms, every rank's masters and optimizer
    state; ON held persistent MXFP8 weights, OFF none, both on TE's modules. Through Bridge
    0.7's wrap the plugin's compact layout was in place (expert runs owned apart, each rank
    issued owner reduces), and every grouped expert weight was stepped by Muon (momentum, no
    Adam moments)."""
    on, off = _on(runs), _off(runs)
    br.assert_gather_on_equals_off(on, off, STEPS)
    for run in (on, off):
        assert run["grouped_weight_ownership"] == "expert"
        assert run["expert_slices"] > 0, run["expert_slices"]
        assert all(rank["reduces"] > 0 for rank in run["probe"]), run["probe"]
    experts = _grouped_expert_entries(on)
    assert len(experts) >= 8, sorted(on["state"]["end"])
    assert set(map(tuple, experts.values())) == {("master", "momentum_buffer")}, experts


def test_control_owner_keeping_its_stale_expert_runs_diverges(runs):
    """Control of the parity: each owner assembles its grouped MXFP8 weights from the other
    rank's gathered runs but its own runs' pre-step values (mutation ``stale_own_expert_runs``,
    a change inside the compact gather's unpack). The first forward precedes any gather; after
    it the losses and every rank's state part from OFF."""
    off = _off(runs)
    stale = _run(runs, "next-stale", mutation="stale_own_expert_runs")
    assert stale["expert_slices"] > 0
    assert br.losses(stale)[0] == br.losses(off)[0]
    assert br.losses(stale) != br.losses(off)
    assert stale["ranks"] != off["ranks"]


def test_resume_in_fresh_processes_is_bitwise_on_the_next_release(runs):
    """The ON run saved at iteration 2 (torch_dist, single grouped weights per expert); fresh
    processes load it and train iteration 3: its loss, grad norm, evaluation and every rank's
    final state equal the run that went on."""
    on, resumed = _on(runs), _resumed(runs)
    assert len(br.losses(resumed)) == STEPS - SAVED_AT
    br.assert_resumed_goes_on(on, resumed, SAVED_AT)


def test_control_resume_with_a_loaded_master_one_ulp_off_diverges(runs):
    """Control of the resume: each rank's first layer-wise fp32 master one ulp up right after
    the load (mutation ``nudge_loaded_master``) ends in other state."""
    on, nudged = _on(runs), _resumed(runs, mutation="nudge_loaded_master")
    assert nudged["ranks"] != on["ranks"]


HOPPER = "tiny_qwen3_30b_a3b_hopper"


@pytest.fixture(scope="module")
def hopper_run(runs):
    """``hopper_run(tag, *extra, mutation="")``: tiny Qwen3-30B-A3B Hopper (blockwise FP8
    compute and param gather, discrete experts, fused QKV), 3 iterations, kept for the module."""
    done: dict[tuple, dict] = {}

    def run(tag: str, *extra: str, mutation: str = "") -> dict:
        key = (tag, extra, mutation)
        if key not in done:
            done[key] = br.pretrain(
                runs, tag, HOPPER, f"train.train_iters={STEPS}", "validation.eval_interval=2",
                "train.global_batch_size=4", *extra, mutation=mutation, probe=True,
            )  # fmt: skip
        return done[key]

    return run


def test_blockwise_fp8_gather_on_equals_off_on_the_next_release(hopper_run):
    """The blockwise FP8 param gather (codes + scales through the plugin's gather plans, the
    receivers' columnwise refresh) on 0.20: ON = OFF bitwise; ON held persistent blockwise
    weights and gather plans on every rank, OFF neither."""
    on, off = hopper_run("hopper-on"), hopper_run("hopper-off", *br.GATHER_OFF)
    br.assert_gather_on_equals_off(on, off, STEPS)
    assert all(r["blockwise_weights"] > 0 and r["blockwise_groups"] > 0 for r in on["probe"])
    assert all(r["blockwise_weights"] == 0 == r["blockwise_groups"] for r in off["probe"])


def test_control_blockwise_receivers_with_stale_columnwise_copies_diverge(hopper_run):
    """Control: receivers keep the columnwise copy of each gathered blockwise weight (what TE's
    dgrad GEMM reads) as it was (mutation ``blockwise_columnwise``); from step 2's backward on,
    the grad norms and every rank's state part from OFF."""
    off = hopper_run("hopper-off", *br.GATHER_OFF)
    stale = hopper_run("hopper-stale", mutation="blockwise_columnwise")
    assert all(rank["columnwise_derived"] > 0 for rank in stale["probe"]), stale["probe"]
    assert br.losses(stale)[0] == br.losses(off)[0]
    assert br.grad_norms(stale) != br.grad_norms(off)
    assert stale["ranks"] != off["ranks"]
