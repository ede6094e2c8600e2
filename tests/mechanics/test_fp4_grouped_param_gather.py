"""FP4 primary single grouped expert weights under layer-wise Muon: the owner's FP4 gather of a
grouped NVFP4 weight (issue 30; docs/nvfp4.md, "FP4 primary single grouped weights under
layer-wise Muon").

The model is ``tests/mechanics/test_nvfp4_param_gather.py``'s 2-layer TE-spec MoE GPT (4
experts, top-2, NVFP4 compute from megatron's recipe with stochastic rounding off, the RHT on)
with megatron's ``TEGroupedMLP`` through TE's op fuser and FP4 primary weights (``fp4_param`` +
DDP's ``fp4_param_gather``), trained under layer-wise Muon on two data-parallel ranks (the plugin's
compact layout, owner reduce, overlapped gathers; megatron's padded layout in the extended tier;
B200 answers); and at expert parallel 2 on four ranks, where each expert-data-parallel group of
two ranks owns and gathers its EP rank's grouped weights. Every compact run of a parity or a
resume synced its Muon gradients by the owner reduce, as the ranks issued them
(``tests/support/owner_reduce_probe.py``).

* ``single``: one ``GroupedTensor`` of ``NVFP4Tensor`` members per expert linear
  (``moe_single_grouped_weight``); its owner (of the whole weight, or of a run of its experts)
  quantizes each member from its expert's fp32 master and ships per-member codes, 16x16 tile
  scales and amaxes (``mechanics/nvfp4_gather.py``).
* ``discrete``: the same experts as discrete FP4 primary weights through the same op fuser, each
  gathered by the existing per-weight FP4 gather.

Why single = discrete bitwise: both start from the same bf16 init values (the same seed, the
same per-expert initialisation), each expert's master takes Muon's per-expert step from the same
gradient (``mechanics/grouped.orthogonalize_per_expert``), and each owner casts
``bf16(master)`` of every expert with the same single-tensor quantizer (16x16 blocks, no RHT, no
SR; the amax of the expert alone), so both runs' GEMMs read the same codes, scales and amaxes.
FP4 param gather OFF is no reference here: OFF would be bf16 single grouped weights, which TE
2.20.2 refuses under NVFP4.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from nemo_lw_fp8.cpu.te import backend as te_backend
from tests.support import owner_reduce_probe as probe
from tests.support.harness import BootOptions, ParallelSpec, run_on_ranks
from tests.support.parity import assert_diverges
from tests.support.resumable import assert_same_run

if te_backend.te_package_dirs() is None:  # find, never import, TE in this process
    pytest.skip("TE's own modules need TE's Python package", allow_module_level=True)

BOOT = BootOptions(fp8_emulation=True)
#: Expert parallel 2 on 4 ranks: two expert-data-parallel groups of 2 ranks, each EP rank
#: holding 2 of the 4 experts of every grouped weight.
EP2 = dict(world_size=4, parallel=ParallelSpec(ep=2), boot=BOOT)

#: Grouped buffers of a ``GroupedTensor`` compared across ranks and with the owner's cast.
BUFFERS = ("rowwise_data", "scale_inv", "columnwise_data", "columnwise_scale_inv", "amax",
           "columnwise_amax")  # fmt: skip
#: The same buffers as an ``NVFP4Tensor`` member names them.
MEMBER_BUFFERS = ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data",
                  "_columnwise_scale_inv", "_amax_rowwise", "_amax_columnwise")  # fmt: skip


def _stale_grouped_amax(mp: pytest.MonkeyPatch) -> None:
    """Receivers of a grouped weight keep every member's previous amaxes (the GEMMs' global
    scales) after the gather; other weights are unpacked as usual."""
    from nemo_lw_fp8.mechanics import nvfp4_gather

    real = nvfp4_gather.unpack_param

    def unpack(param, payload):
        members = nvfp4_gather.grouped_members(param)
        kept = None if members is None else [
            (m._amax_rowwise.clone(), m._amax_columnwise.clone()) for m in members
        ]  # fmt: skip
        real(param, payload)
        for member, (row, col) in zip(members or [], kept or [], strict=True):
            member._amax_rowwise.copy_(row)
            member._amax_columnwise.copy_(col)

    mp.setattr(nvfp4_gather, "unpack_param", unpack)


def _stale_grouped_columnwise(mp: pytest.MonkeyPatch) -> None:
    """Grouped weights keep their previous columnwise copies (dgrad reads them) after the
    gather; other weights derive theirs as usual."""
    from nemo_lw_fp8.mechanics import nvfp4_gather

    real = nvfp4_gather.derive_columnwise

    def derive(param):
        if not nvfp4_gather.is_grouped_nvfp4(param):
            real(param)

    mp.setattr(nvfp4_gather, "derive_columnwise", derive)


#: mutation name -> what it does to the grouped weights' receivers (controls).
MUTATIONS = {"stale_amax": _stale_grouped_amax, "stale_columnwise": _stale_grouped_columnwise}


def grouped_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every grouped NVFP4 weight's grouped buffers (codes, scales, amaxes of both usages)."""
    from nemo_lw_fp8.mechanics import nvfp4_gather

    return {
        f"{name}:{buffer}": getattr(param, buffer).clone()
        for name, param in module.named_parameters()
        if nvfp4_gather.is_grouped_nvfp4(param)
        for buffer in BUFFERS
    }


def owner_cast_differs(
    optimizer: Any, module: torch.nn.Module
) -> tuple[int, list[str], list[tuple[int, int]]]:
    """On the owner of each grouped NVFP4 weight: each member's stored buffers (after the last
    gather, columnwise copy derived) against TE's single-tensor cast, both usages, of
    ``bf16(master)`` of that expert with a fresh copy of the member's quantizer. Returns how
    many members were checked, which buffers differ, and the expert runs (``[lo, hi)``) this
    rank owns of grouped weights owned in runs."""
    from nemo_lw_fp8.mechanics import expert_slices, masters, nvfp4_gather

    def children(opt: Any) -> list[Any]:
        nested = getattr(opt, "chained_optimizers", None) or []
        own = [opt] if hasattr(opt, "fp32_from_float16_groups") else []
        return own + [c for child in nested for c in children(child)]

    names = {id(p): n for n, p in module.named_parameters()}
    checked, differ, runs = 0, [], []
    for child in children(optimizer):
        for param, master in masters.model_main_pairs(child):
            members = nvfp4_gather.grouped_members(param)
            if members is None:
                continue
            if expert_slices.is_slice(param):
                runs.append((param.lo, param.hi))
                param = param.parent
            for i, member in enumerate(members):
                quantizer = member._quantizer.copy()
                quantizer.set_usage(rowwise=True, columnwise=True)
                fresh = quantizer(master[i].detach().to(torch.bfloat16).contiguous())
                checked += 1
                for buffer in MEMBER_BUFFERS:
                    a, b = getattr(member, buffer), getattr(fresh, buffer)
                    if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                        differ.append(f"{names[id(param)]}[{i}].{buffer}")
    return checked, differ, sorted(runs)


def grouped_fp4_run(
    single: bool,
    mutation: str | None = None,
    steps: tuple[int, int] = (0, 3),
    save_dir: str | None = None,
    load_dir: str | None = None,
    nudge_loaded_master: bool = False,
    layout: str = "compact",
    ownership: str = "whole",
) -> dict[str, Any]:
    """Layer-wise Muon (compact layout, overlapped gathers, owner reduce) on the op-fuser MoE GPT
    with FP4 primary expert weights, single grouped (``single``) or discrete: steps
    ``steps[0]..steps[1]-1`` with an eval after step 0, an optional ``torch_dist`` load (into a
    build from another seed) before and save after. Returns losses, eval losses, this rank's
    masters and momenta under discrete names, the grouped kernels TE called, the weight classes
    of the experts, what each gather sent and this rank's expert-parallel rank."""
    import functools

    import tests.mechanics.test_nvfp4_param_gather as base
    from tests.cpu.test_nvfp4_grouped import _build_gpt_grouped_experts
    from tests.support import nvfp4_runs, resumable, scenarios, training
    from tests.support.scenarios import Scenario

    scenario = Scenario(
        model="gpt", optimizer="muon", plugin=True, seed=5, micro_batch=4,
        distribution=f"layerwise_{layout}", overlap=layout == "compact", fp4_param_gather=True,
        grouped_weight_ownership=ownership,
    )  # fmt: skip
    seen: list[str] = []
    sends: list[dict[str, Any]] = []
    with nvfp4_runs.nvfp4_on_blackwell() as mp:
        import transformer_engine_torch as tex

        mp.setenv("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1")  # megatron's op-fuser GLU switch
        mp.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1" if single else "0")
        from megatron.core import parallel_state

        # the EP size the harness initialised, as a run at that size says it (megatron's TE
        # layers mark expert weights for the expert-data-parallel group by this field)
        ep = parallel_state.get_expert_model_parallel_world_size()
        moe = dict(
            base.MOE, moe_grouped_gemm=True, use_transformer_engine_op_fuser=True,
            moe_single_grouped_weight=single, expert_model_parallel_size=ep,
        )  # fmt: skip
        mp.setattr(base, "MOE", moe)
        mp.setattr(
            scenarios, "build_gpt", functools.partial(_build_gpt_grouped_experts, grouped=True)
        )
        for name in ("group_quantize", "te_general_grouped_gemm_for_grouped_tensor",
                     "te_general_grouped_gemm_for_discrete_in", "split_quantize"):  # fmt: skip
            real = getattr(tex, name)

            def wrapped(*args, _real=real, _name=name, **kwargs):
                seen.append(_name)
                return _real(*args, **kwargs)

            mp.setattr(tex, name, wrapped)
        nvfp4_runs.record_owner_gathers(mp, sends)
        if mutation is not None:
            MUTATIONS[mutation](mp)
        module, config = base.build_gpt(True, seed=5 if load_dir is None else 17, moe=True)
        kinds = sorted({type(p).__name__ for n, p in module.named_parameters() if "experts" in n})
        preserved = [
            n for n, p in module.named_parameters()
            if "experts" in n and getattr(p, "get_high_precision_init_val", None) is not None
        ]  # fmt: skip
        model, optimizer = training.wrap_and_build_optimizer(module, config, scenario)
        losses, eval_losses = resumable.train_steps(
            scenario, model, optimizer, steps, load_dir=load_dir, save_dir=save_dir,
            nudge_loaded_master=nudge_loaded_master,
        )  # fmt: skip
        state = training.state_by_part(optimizer, model[0].module)
        buffers = grouped_buffers(module)
        checked, differ, runs = owner_cast_differs(optimizer, module)
    return {
        "ep_rank": parallel_state.get_expert_model_parallel_rank(),
        "buffers": buffers,
        "owner_cast_checked": checked,
        "owner_cast_differs": differ,
        "expert_runs": runs,
        "losses": losses,
        "eval_losses": eval_losses,
        "state": discrete_names(state),
        "weight_types": kinds,
        "preserved_init": preserved,
        "kernels": sorted(set(seen)),
        "sends": sends,
    }


def _run(single: bool, probed: bool = True, **kwargs: Any) -> list[dict]:
    """:func:`grouped_fp4_run` on the ranks (``kwargs``: its keyword arguments and
    ``run_on_ranks``'s), with ``probed`` what each rank's grad syncs issued in
    ``result["grad_sync"]`` (``tests/support/owner_reduce_probe.py``)."""
    if probed:
        return run_on_ranks(probe.run_probed, grouped_fp4_run, single, **kwargs)
    return run_on_ranks(grouped_fp4_run, single, **kwargs)


def _owner_reduced(**runs: list[dict]) -> None:
    """Each of ``runs`` (label -> results of a probed :func:`_run`) synced its Muon gradients,
    the grouped experts' included, by the owner reduce."""
    for label, results in runs.items():
        probe.assert_reduced_to_owners(results, label)


def discrete_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Masters and momenta of a whole grouped weight (``...experts.linear_fc1.weight``, shape
    ``(E, out, in)``) under the discrete weights' names (``...weight0`` .. ``weight{E-1}``)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if re.search(r"\.experts\.linear_fc[12]\.weight$", name) and value.dim() == 3:
            for i, member in enumerate(value.unbind(0)):
                out[f"{name}{i}"] = member.clone()
        else:
            out[name] = value
    return out


def _same_buffers(a: dict, b: dict) -> None:
    """Two ranks hold the same grouped NVFP4 bytes (every buffer of every grouped weight)."""
    assert a.keys() == b.keys() and a, sorted(a)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"grouped buffers differ between ranks: {differ}"


@pytest.mark.parametrize(
    "layout, ownership",
    [("compact", "whole"), pytest.param("padded", "whole", marks=pytest.mark.extended),
     ("compact", "expert")],
    ids=["compact-whole", "padded-whole", "compact-expert-runs"],
)  # fmt: skip
def test_fp4_single_grouped_equals_discrete_under_layer_wise_muon(layout, ownership):
    """FP4 primary single grouped weights (one ``GroupedTensor`` per expert linear, the owner's
    grouped FP4 gather; the compact layout with overlapped gathers, owned whole or in runs of
    experts by both ranks; in the extended tier megatron's padded layout without overlap)
    train like FP4 primary discrete weights
    through the same op fuser, bitwise in losses, the eval loss, every fp32 master and Muon
    momentum; the single grouped run took TE's grouped-tensor GEMM and shipped uint8 payloads
    only; after the last gather both ranks hold the same grouped bytes, and they are TE's
    single-tensor cast of each expert's ``bf16(master)`` (both usages: the receivers' derived
    columnwise copies included)."""
    compact = layout == "compact"  # megatron's padded layout has no owner reduce to probe
    discrete = _run(False, compact, layout=layout, world_size=2, boot=BOOT)
    single = _run(True, compact, layout=layout, ownership=ownership, world_size=2, boot=BOOT)
    if compact:
        _owner_reduced(discrete=discrete, single=single)
    runs = [run for r in single for run in r["expert_runs"]]
    if ownership == "whole":
        assert not runs, runs
    else:  # every expert of the 4 grouped weights owned as a run, runs on both ranks
        assert all(r["expert_runs"] for r in single), runs
        assert sum(hi - lo for lo, hi in runs) == 16, runs
    for r in single:
        assert r["weight_types"] == ["GroupedTensor"], r["weight_types"]
        assert "te_general_grouped_gemm_for_grouped_tensor" in r["kernels"], r["kernels"]
        assert "te_general_grouped_gemm_for_discrete_in" not in r["kernels"], r["kernels"]
        assert r["sends"] and {s["dtype"] for s in r["sends"]} == {"torch.uint8"}
        assert not r["owner_cast_differs"], r["owner_cast_differs"]
        # the masters start from TE's preserved bf16 init values, as the discrete run's
        assert len(r["preserved_init"]) == 4, r["preserved_init"]
    for r in discrete:
        assert r["weight_types"] == ["NVFP4Tensor"], r["weight_types"]
        assert len(r["preserved_init"]) == 16, r["preserved_init"]
        assert r["sends"] and {s["dtype"] for s in r["sends"]} == {"torch.uint8"}
    # 2 layers x 2 expert linears x 4 experts, each checked on its owner
    assert sum(r["owner_cast_checked"] for r in single) == 16
    _same_buffers(single[0]["buffers"], single[1]["buffers"])
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in single)
    assert_same_run(discrete, single)


@pytest.mark.parametrize(
    "mutation, ownership",
    [("stale_amax", "whole"),
     pytest.param("stale_columnwise", "whole", marks=pytest.mark.extended),
     ("stale_amax", "expert")],
    ids=["stale_amax", "stale_columnwise", "stale_amax-expert-runs"],
)  # fmt: skip
def test_fp4_grouped_gather_controls_diverge(mutation, ownership):
    """Controls: receivers of the grouped weights that keep every member's previous amaxes, or
    their previous columnwise copies, after the gather (the other weights gathered as usual;
    grouped weights owned whole, or in runs of experts) train differently from the discrete FP4
    primary run, which the unmutated run equals."""
    discrete = run_on_ranks(grouped_fp4_run, False, world_size=2, boot=BOOT)
    mutated = run_on_ranks(
        grouped_fp4_run, True, mutation, ownership=ownership, world_size=2, boot=BOOT
    )
    assert_diverges(discrete, mutated, assert_same_run)


def by_expert_rank(results: list[dict]) -> list[dict]:
    """Each rank's results with its expert masters and momenta named by the EP rank holding
    them: at EP > 1 every EP rank's local experts carry the same names."""
    return [
        {**r, "state": {(f"ep{r['ep_rank']}:{k}" if ".experts." in k else k): v
                        for k, v in r["state"].items()}}  # fmt: skip
        for r in results
    ]


def assert_resumes(directory: str, ownership: str, args: dict) -> None:
    """Save (``torch_dist``) after two steps, load into a build from another seed, two more
    steps: the losses, masters and momenta of four uninterrupted steps, and the same grouped
    bytes on every rank, bitwise. Control: one loaded master one ulp off diverges."""
    args = dict(args, ownership=ownership)
    whole = _run(True, steps=(0, 4), **args)
    first = run_on_ranks(grouped_fp4_run, True, steps=(0, 2), save_dir=directory, **args)
    resumed = _run(True, steps=(2, 4), load_dir=directory, **args)
    _owner_reduced(uninterrupted=whole, resumed=resumed)
    for rank in range(len(whole)):
        assert first[rank]["losses"] + resumed[rank]["losses"] == whole[rank]["losses"]
        _same_buffers(whole[rank]["buffers"], resumed[rank]["buffers"])
    assert not any(r["owner_cast_differs"] for r in resumed)
    no_evals = [{**r, "losses": [], "eval_losses": []} for r in by_expert_rank(whole)]
    assert_same_run(no_evals, [{**r, "losses": [], "eval_losses": []}
                               for r in by_expert_rank(resumed)])  # fmt: skip
    nudged = run_on_ranks(
        grouped_fp4_run, True, steps=(2, 4), load_dir=directory, nudge_loaded_master=True, **args
    )
    assert_diverges(
        [{**r, "eval_losses": []} for r in by_expert_rank(resumed)],
        [{**r, "eval_losses": []} for r in by_expert_rank(nudged)],
        assert_same_run,
    )


@pytest.mark.parametrize("ownership", ["whole", "expert"], ids=["whole", "expert-runs"])
def test_fp4_single_grouped_resumes_bitwise(tmp_path, ownership):
    """FP4 primary single grouped weights (owned whole, or in runs of experts), compact layout
    with overlap: a ``torch_dist`` resume equals the uninterrupted run (:func:`assert_resumes`,
    with its one-ulp control)."""
    assert_resumes(str(tmp_path), ownership, dict(world_size=2, boot=BOOT))


# --------------------------------------------------------------------------- expert parallel 2


@pytest.mark.parametrize("ownership", ["whole", "expert"], ids=["whole", "expert-runs"])
def test_fp4_single_grouped_equals_discrete_at_expert_parallel_2(ownership):
    """EP 2 on 4 ranks (two expert-data-parallel groups of 2, each EP rank holding 2 experts of
    every grouped weight): FP4 primary single grouped = discrete FP4 primary, bitwise in losses,
    the eval loss, every master and momentum (expert ones per EP rank); the grouped weights are
    owned and gathered in their expert-data-parallel group (whole, or in runs of one expert per
    rank): both ranks of a group end with the same grouped bytes, the two EP ranks with others,
    and all 16 members (2 layers x 2 linears x 2 experts x 2 EP ranks) equal TE's cast of their
    master on their owner."""
    discrete = _run(False, **EP2)
    single = _run(True, ownership=ownership, **EP2)
    _owner_reduced(discrete=discrete, single=single)
    groups: dict[int, list[dict]] = {}
    for r in single:
        groups.setdefault(r["ep_rank"], []).append(r)
        assert r["weight_types"] == ["GroupedTensor"], r["weight_types"]
        assert r["sends"] and {s["dtype"] for s in r["sends"]} == {"torch.uint8"}
        assert not r["owner_cast_differs"], r["owner_cast_differs"]
    assert sorted(groups) == [0, 1] and all(len(g) == 2 for g in groups.values())
    for first, second in groups.values():
        _same_buffers(first["buffers"], second["buffers"])
    one, other = groups[0][0]["buffers"], groups[1][0]["buffers"]
    assert any(not torch.equal(one[k], other[k]) for k in one)
    assert sum(r["owner_cast_checked"] for r in single) == 16
    runs = [run for r in single for run in r["expert_runs"]]
    assert (not runs) if ownership == "whole" else sum(hi - lo for lo, hi in runs) == 16, runs
    assert_same_run(by_expert_rank(discrete), by_expert_rank(single))


def test_fp4_grouped_gather_control_diverges_at_expert_parallel_2():
    """Control at EP 2: receivers of the grouped weights that keep every member's previous
    amaxes after the gather train differently from the discrete run."""
    discrete = run_on_ranks(grouped_fp4_run, False, **EP2)
    mutated = run_on_ranks(grouped_fp4_run, True, "stale_amax", **EP2)
    assert_diverges(by_expert_rank(discrete), by_expert_rank(mutated), assert_same_run)


@pytest.mark.parametrize("ownership", ["whole", "expert"], ids=["whole", "expert-runs"])
def test_fp4_single_grouped_resumes_bitwise_at_expert_parallel_2(tmp_path, ownership):
    """The resume of :func:`assert_resumes` at EP 2 on 4 ranks (control: one ulp off)."""
    assert_resumes(str(tmp_path), ownership, EP2)
