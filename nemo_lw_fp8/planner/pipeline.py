"""The planner on one pipeline rank of a recipe: which parameters each rank holds, and its plan.

:func:`stage_param_specs` cuts a model's parameters (:mod:`.shapes`) along the pipeline stages of
its :class:`~.parallel.ParallelismDefaults`; :func:`plan_rank` runs :func:`.planner.plan` on
the rank holding the most, which is what bounds memory.
"""

from __future__ import annotations

from typing import Any

from nemo_lw_fp8.planner.rank_plan import plan
from nemo_lw_fp8.planner.shapes import ParamSpec, to_model_spec
from nemo_lw_fp8.planner.tensor_parallel import pad_vocab
from nemo_lw_fp8.recipes.architectures import MoEArchitecture, get_architecture
from nemo_lw_fp8.recipes.parallel import ParallelismDefaults, parallelism


def _rank_holds(spec: ParamSpec, items: list[str]) -> bool:
    """Whether a parameter lives on a pipeline rank holding ``items`` (decoder layers as "t<i>",
    MTP layers as "m<i>", "E", "L")."""
    parts = spec.name.split(".")
    if parts[0] == "embedding":
        return "E" in items
    if parts[0] == "output_layer" or parts[:2] == ["decoder", "final_layernorm"]:
        return "L" in items  # megatron builds the final norm with the last decoder stage
    if parts[0] == "mtp":
        return f"m{parts[2]}" in items
    return f"t{parts[2]}" in items


def specs_on_rank(
    specs: list[ParamSpec],
    stages: list[list[str]],
    pp: int,
    pp_rank: int,
    stage: int | None = None,
) -> list[ParamSpec]:
    """The parameters of ``specs`` (a whole model, megatron's names) that pipeline rank
    ``pp_rank`` holds, for virtual stages ``stages`` in megatron's order (lists of "E", "t",
    "m", "L"; stage ``s`` lives on rank ``s % pp``); only virtual stage ``stage`` if given."""
    items: list[str] = []
    counters = {"t": 0, "m": 0}
    for stage_index, items_of_stage in enumerate(stages):
        held = stage_index % pp == pp_rank and stage in (None, stage_index)
        for item in items_of_stage:
            if item in counters:
                if held:
                    items.append(f"{item}{counters[item]}")
                counters[item] += 1
            elif held:
                items.append(item)
    return [s for s in specs if _rank_holds(s, items)]


def chunk_param_specs(
    arch: MoEArchitecture, par: ParallelismDefaults, pp_rank: int, *, include_mtp: bool = True
) -> list[list[ParamSpec]]:
    """The parameters of each virtual-pipeline chunk pipeline rank ``pp_rank`` holds, chunk by
    chunk (megatron wraps each chunk in its own DDP, with its own buffers)."""
    if par.cp != 1:
        raise ValueError("the planner models CP = 1")
    specs = pad_vocab(to_model_spec(arch, include_mtp=include_mtp).params(), par.tp)
    stages = par.stages(arch)
    return [
        specs_on_rank(specs, stages, par.pp, pp_rank, stage=k)
        for k in range(pp_rank, len(stages), par.pp)
    ]


def stage_param_specs(
    arch: MoEArchitecture, par: ParallelismDefaults, pp_rank: int, *, include_mtp: bool = True
) -> list[ParamSpec]:
    """The parameters pipeline rank ``pp_rank`` holds (whole, all experts; the planner cuts
    one rank's TP shards and EP share)."""
    if par.cp != 1:
        raise ValueError("the planner models CP = 1")
    specs = pad_vocab(to_model_spec(arch, include_mtp=include_mtp).params(), par.tp)
    return specs_on_rank(specs, par.stages(arch), par.pp, pp_rank)


def plan_rank(
    arch: MoEArchitecture | str, gpu: str, *, pp_rank: int | None = None, **plan_kwargs: Any
) -> dict[str, Any]:
    """:func:`.planner.plan` for one pipeline rank of ``arch`` under its
    :data:`~.parallel.PARALLELISM` defaults on ``gpu``: the rank holding the most parameters
    unless ``pp_rank`` is given. DP, EP, TP and ETP are the defaults' dense data-parallel,
    expert-parallel and (expert) tensor-parallel sizes."""
    arch = arch if isinstance(arch, MoEArchitecture) else get_architecture(arch)
    par = parallelism(arch, gpu)
    ranks = range(par.pp) if pp_rank is None else [pp_rank]
    by_rank = {r: stage_param_specs(arch, par, r) for r in ranks}
    rank = max(by_rank, key=lambda r: sum(s.numel for s in by_rank[r]))
    result = plan(
        by_rank[rank], par.data_parallel_size, par.ep, tp=par.tp, etp=par.etp, **plan_kwargs
    )
    result["model"] = arch.name
    result["gpu"] = gpu
    result["pp_rank"] = rank
    return result
