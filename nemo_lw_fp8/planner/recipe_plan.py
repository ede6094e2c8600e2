"""``nemo-lw-fp8 plan --recipe NAME``: the plan of a recipe as shipped, against the GPU's memory.

A recipe name (:mod:`nemo_lw_fp8.recipes`) gives the architecture, the FP8 variant and the
parallelism (:data:`.parallel.PARALLELISM` for the variant's GPU family); ``key=value`` overrides
use pretrain's names for the fields the planner reads (:data:`OVERRIDES`). Every pipeline rank's
parameters are planned (:func:`.pipeline.stage_param_specs`) and the busiest one reported, its
peak (persistent state of the compact layout plus the transient gather buffer beyond the idle
gradient buffer) set against the GPU's memory (:data:`GPU_MEMORY`). Activations, TE workspaces
and NCCL buffers are not counted, so "fits" leaves the headroom printed for them.

Nothing here imports Megatron-Bridge; the planner imports megatron-core's layout code.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from nemo_lw_fp8.errors import UsageError
from nemo_lw_fp8.layout.packing import resolve_qkv_ownership
from nemo_lw_fp8.planner.pipeline import stage_param_specs
from nemo_lw_fp8.planner.rank_plan import plan
from nemo_lw_fp8.planner.shapes import ParamSpec, to_model_spec
from nemo_lw_fp8.planner.tensor_parallel import MUON_TP_MODES
from nemo_lw_fp8.recipes.architectures import MoEArchitecture, get_architecture, tiny
from nemo_lw_fp8.recipes.parallel import ParallelismDefaults, parallelism
from nemo_lw_fp8.vocabulary import GROUPED_WEIGHT_OWNERSHIP, QKV_OWNERSHIP

#: Usable memory of one GPU, decimal bytes (the vendor's figure).
GPU_MEMORY = {"h100": 80e9, "h200": 141e9, "b200": 180e9, "gb200": 186e9}
#: The GPU each recipe variant is planned against (the family its parallelism comes from).
VARIANT_GPU = {"mxfp8": "gb200", "hopper": "h100", "nvfp4": "gb200", "tiny": "h100"}

#: Overrides the planner reads: pretrain's key -> (ParallelismDefaults field or plan setting).
OVERRIDES = {
    "model.tensor_model_parallel_size": "tp",
    "model.pipeline_model_parallel_size": "pp",
    "model.virtual_pipeline_model_parallel_size": "vpp",
    "model.expert_model_parallel_size": "ep",
    "model.expert_tensor_parallel_size": "etp",
    "model.context_parallel_size": "cp",
    "model.pipeline_model_parallel_layout": "pipeline_layout",
    "train.global_batch_size": "global_batch_size",
    "train.micro_batch_size": "micro_batch_size",
    "model.moe_single_grouped_weight": "single_grouped_weight",
    "optimizer.grouped_weight_ownership": "ownership",
    "optimizer.qkv_ownership": "qkv_ownership",
    "optimizer.gather_padding_tolerance": "gather_padding_tolerance",
    "optimizer.muon_tp_mode": "muon_tp_mode",
    "mixed_precision.fp8_param_gather": "fp8_param_gather",
    "mixed_precision.fp4_param_gather": "fp8_param_gather",
    "mixed_precision.num_layers_at_end_in_bf16": "bf16_layers_at_end",
    "ddp.bucket_size": "bucket_size",
    "ddp.grad_reduce_in_fp32": "grad_reduce_in_fp32",
}


@dataclasses.dataclass
class RecipeSetup:
    """What the planner needs from a recipe (after overrides)."""

    recipe: str
    arch: MoEArchitecture
    par: ParallelismDefaults
    gpu: str
    single_grouped_weight: bool
    ownership: str = "whole"
    qkv_ownership: str = "auto"  # plan --qkv-ownership (LayerWiseConfig.qkv_ownership)
    #: The recipe computes in blockwise FP8 (Hopper): its fused QKV weights are owned whole.
    blockwise: bool = False
    fp8_param_gather: bool = True
    gather_padding_tolerance: float = 0.1
    #: megatron's Newton-Schulz mode for TP-sharded matrices (the factory's default).
    muon_tp_mode: str = "duplicated"
    bucket_size: int | None = None
    grad_reduce_in_fp32: bool = True
    #: How the quantized weights are held: "mxfp8" (also the planner's count for blockwise
    #: FP8), "nvfp4" (NVFP4 primary weights of the ``nvfp4`` recipes).
    weight_format: str = "mxfp8"
    #: Decoder layers at the end whose weights stay bf16 (megatron's ``first_last_layers_bf16``
    #: with ``num_layers_at_end_in_bf16``; the NVFP4 recipes set it).
    bf16_layers_at_end: int = 0


def _parse(key: str, text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "none"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip().strip("'\"")


def recipe_setup(name: str, overrides: list[str] = ()) -> RecipeSetup:  # type: ignore[assignment]
    """The recipe's model, parallelism and settings, with ``key=value`` overrides."""
    from nemo_lw_fp8 import recipes

    key = recipes.recipe_key(name)
    if key not in recipes.RECIPES:
        raise UsageError(f"unknown recipe {name!r}", "`nemo-lw-fp8 recipes` lists the recipes")
    tiny_of = recipes.tiny_variant_of(key)
    if tiny_of is not None:
        arch, par = recipes.tiny_architecture_of(key), recipes.tiny_parallelism()
        gpu, variant = VARIANT_GPU["tiny"], tiny_of[1]
    else:
        model = next(m for m in recipes.MODELS if key.startswith(recipes.recipe_key(m) + "_"))
        variant = key[len(recipes.recipe_key(model)) + 1 :]
        arch = get_architecture(model)
        par = parallelism(arch, recipes.VARIANT_GPU[variant])
        gpu = VARIANT_GPU[variant]
    # Hopper recipes gather blockwise FP8 weights, which the plugin keeps whole (their owner
    # quantizes whole 128 x 128 tiles): no grouped weights, no Q / K / V parts.
    hopper = variant == "hopper"
    # NVFP4 recipes: discrete expert weights (recipes.DISCRETE_EXPERT_VARIANTS), persistent
    # NVFP4 weights.
    setup = RecipeSetup(
        key, arch, par, gpu, single_grouped_weight=variant not in recipes.DISCRETE_EXPERT_VARIANTS,
        blockwise=hopper, weight_format="nvfp4" if variant == "nvfp4" else "mxfp8",
        qkv_ownership="whole" if variant == "nvfp4" else "auto",  # as recipes.build sets it
        bf16_layers_at_end=recipes.nvfp4_bf16_layers_at_end(arch.num_layers)
        if variant == "nvfp4" else 0,
    )  # fmt: skip
    changes: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise UsageError(
                f"override {item!r} is not key=value", "e.g. model.pipeline_model_parallel_size=8"
            )
        k, text = item.split("=", 1)
        if k not in OVERRIDES:
            raise UsageError(
                f"plan does not read {k!r}",
                "it reads: " + ", ".join(sorted(OVERRIDES)),
            )
        value = _parse(k, text)
        field = OVERRIDES[k]
        if field in {f.name for f in dataclasses.fields(ParallelismDefaults)}:
            changes[field] = value
        elif field == "grad_reduce_in_fp32" or field == "single_grouped_weight":
            setattr(setup, field, bool(value))
        else:
            setattr(setup, field, value)
    if changes:
        setup.par = dataclasses.replace(setup.par, **changes)
    return setup


def bf16_at_end(specs: list[ParamSpec], arch: MoEArchitecture, layers: int) -> list[ParamSpec]:
    """The weights of the last ``layers`` decoder layers (megatron's 0-based global index,
    ``decoder.layers.<i>.``) as bf16: megatron builds them outside the FP4 / FP8 init context
    (``first_last_layers_bf16``), so they are plain parameters in the bf16 buffers."""
    if layers <= 0:
        return specs
    first = arch.num_layers - layers
    out = []
    for spec in specs:
        match = re.match(r"decoder\.layers\.(\d+)\.", spec.name)
        if match is not None and int(match.group(1)) >= first and spec.quantized:
            spec = dataclasses.replace(spec, quantized=False)
        out.append(spec)
    return out


def group_experts(specs: list[ParamSpec]) -> list[ParamSpec]:
    """Per-expert weights as megatron's single grouped weights: one ``(E, m, n)`` parameter per
    MoE layer and linear (TE's ``GroupedLinear`` with one parameter), at the first expert's
    place."""
    out: list[ParamSpec] = []
    seen: dict[str, int] = {}
    for spec in specs:
        match = re.fullmatch(r"(.*\.experts\.linear_fc[12]\.weight)(\d+)", spec.name)
        if match is None or spec.expert_index is None:
            out.append(spec)
            continue
        base = match.group(1)
        if base in seen:
            continue
        seen[base] = len(out)
        out.append(
            dataclasses.replace(
                spec,
                name=base,
                shape=(spec.num_experts, *spec.shape),
                expert_index=None,
            )
        )
    return out


def planned_qkv_ownership(setup: RecipeSetup) -> str:
    """How the recipe's compact layout owns fused QKV weights (``"auto"`` resolved as a run
    resolves it); an explicit ``split`` the run would refuse is refused here too, as one line."""
    value = setup.qkv_ownership
    if value not in QKV_OWNERSHIP:
        raise UsageError(f"optimizer.qkv_ownership={value!r}", "one of " + ", ".join(QKV_OWNERSHIP))
    if value == "split" and setup.blockwise:
        raise UsageError(
            "optimizer.qkv_ownership=split on a blockwise FP8 recipe (its QKV weights are owned "
            "whole)",
            "optimizer.qkv_ownership=auto or whole",
        )
    return resolve_qkv_ownership(value, "compact", setup.blockwise)


def plan_recipe(setup: RecipeSetup) -> dict[str, Any]:
    """The plan of every pipeline rank's parameters; the busiest rank's in full."""
    par, arch = setup.par, setup.arch
    if setup.muon_tp_mode not in MUON_TP_MODES:
        raise UsageError(
            f"optimizer.muon_tp_mode={setup.muon_tp_mode!r}", "one of " + ", ".join(MUON_TP_MODES)
        )
    qkv_ownership = planned_qkv_ownership(setup)
    if setup.ownership not in GROUPED_WEIGHT_OWNERSHIP:
        raise UsageError(
            f"optimizer.grouped_weight_ownership={setup.ownership!r}",
            "one of " + ", ".join(GROUPED_WEIGHT_OWNERSHIP),
        )
    if setup.single_grouped_weight and par.etp > 1:
        # the guards' op-fuser-experts-expert-tensor-parallel, said where the plan is made
        raise UsageError(
            f"single grouped expert weights at model.expert_tensor_parallel_size={par.etp}: "
            "megatron-core 0.19.2 builds them only through TE's op fuser, which it runs at "
            "expert TP 1 only",
            "model.expert_tensor_parallel_size=1, or model.moe_single_grouped_weight=false "
            "(discrete expert weights; the run also needs "
            "model.use_transformer_engine_op_fuser=false)",
        )
    world = par.world_size
    # megatron's initialize_model_parallel: dense DP = world / (TP PP CP), expert DP =
    # world / (ETP EP PP); both must be whole.
    if world % (par.tp * par.pp * par.cp) or world % (par.etp * par.ep * par.pp):
        raise UsageError(
            f"world size {world} does not split into TP {par.tp} x PP {par.pp} x CP {par.cp} "
            f"and into ETP {par.etp} x EP {par.ep} x PP {par.pp}",
            "choose sizes that divide the number of GPUs",
        )
    dp = world // (par.tp * par.pp * par.cp)
    dp_cp = dp * par.cp  # the gradient group also spans CP
    try:
        stages = par.stages(arch)
    except ValueError as error:
        raise UsageError(
            str(error), "set model.pipeline_model_parallel_layout or another PP"
        ) from None
    if len(stages) != par.pp * (par.vpp or 1):
        raise UsageError(
            f"the layout has {len(stages)} stages, PP x VPP = {par.pp * (par.vpp or 1)}",
            "make the layout's stage count match",
        )
    plans: dict[tuple, dict[str, Any]] = {}
    by_rank = []
    for rank in range(par.pp):
        specs = bf16_at_end(stage_param_specs(arch, par, rank), arch, setup.bf16_layers_at_end)
        if setup.single_grouped_weight:
            specs = group_experts(specs)
        signature = tuple(
            (s.shape, s.muon, s.expert_parallel, s.quantized, s.qkv_split) for s in specs
        )
        if signature not in plans:
            plans[signature] = plan(
                specs,
                dp_cp,
                par.ep,
                bucket_size=setup.bucket_size,
                fp8_param_gather=setup.fp8_param_gather,
                grad_dtype="fp32" if setup.grad_reduce_in_fp32 else "bf16",
                gather_padding_tolerance=setup.gather_padding_tolerance,
                grouped_weight_ownership=setup.ownership,
                qkv_ownership=qkv_ownership,
                tp=par.tp,
                etp=par.etp,
                muon_tp_mode=setup.muon_tp_mode,
                weight_format=setup.weight_format,
            )
        by_rank.append(plans[signature])

    def peak(result: dict[str, Any]) -> int:
        compact = result["layouts"]["compact"]
        return compact["bytes_per_rank"]["total"] + compact["transient_gather"]["extra_bytes"]

    busiest = max(range(par.pp), key=lambda r: (peak(by_rank[r]), -r))
    result = dict(by_rank[busiest])
    memory = GPU_MEMORY[setup.gpu]
    top = peak(result)
    if setup.blockwise and setup.fp8_param_gather:
        # counted as MXFP8-sized weights; what the Hopper recipes gather is blockwise FP8
        result["param_gather"] = "blockwise"
    result.update(
        {
            "model": arch.name,
            "recipe": setup.recipe,
            "gpu": setup.gpu,
            "parallelism": {
                "world": world,
                "tp": par.tp,
                "pp": par.pp,
                "vpp": par.vpp,
                "ep": par.ep,
                "etp": par.etp,
                "cp": par.cp,
                "dp": dp,
                "expert_dp": world // (par.etp * par.ep * par.pp),
            },  # fmt: skip
            "pp_rank": busiest,
            "pp_rank_peaks": [peak(r) for r in by_rank],
            "single_grouped_weight": setup.single_grouped_weight,
            "grouped_weight_ownership": setup.ownership,
            "verdict": {
                "peak_bytes": top,
                "gpu_bytes": memory,
                "fits": top <= memory,
                "headroom_bytes": memory - top,
            },
        }
    )
    return result


def plan_model(
    model: str, *, tp: int, pp: int, vpp: int | None, ep: int, etp: int, cp: int, dp: int,
    gpu: str, single_grouped_weight: bool, **settings: Any,
) -> dict[str, Any]:  # fmt: skip
    """The model form: an architecture at explicit sizes (world = TP x PP x CP x DP)."""
    setup = model_setup(
        model, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, cp=cp, dp=dp, gpu=gpu,
        single_grouped_weight=single_grouped_weight, **settings,
    )  # fmt: skip
    result = plan_recipe(setup)
    result["recipe"] = None
    return result


def model_setup(
    model: str, *, tp: int, pp: int, vpp: int | None, ep: int, etp: int, cp: int, dp: int,
    gpu: str, single_grouped_weight: bool, **settings: Any,
) -> RecipeSetup:  # fmt: skip
    """What :func:`plan_model` plans: the architecture at explicit sizes."""
    arch = tiny(get_architecture(model[5:])) if model.startswith("tiny-") else None
    arch = arch or get_architecture(model)
    par = ParallelismDefaults(
        recipe="command line", nodes=1, gpus_per_node=tp * pp * cp * dp, tp=tp, pp=pp,
        vpp=vpp, ep=ep, etp=etp, cp=cp, global_batch_size=dp,
    )  # fmt: skip
    return RecipeSetup(model, arch, par, gpu, single_grouped_weight, **settings)


def spec_names() -> list[str]:
    """Model names the model form accepts (the six architectures)."""
    from nemo_lw_fp8.recipes.architectures import ARCHITECTURES

    return sorted(ARCHITECTURES)


__all__ = [
    "GPU_MEMORY",
    "OVERRIDES",
    "group_experts",
    "model_setup",
    "plan_model",
    "plan_recipe",
    "to_model_spec",
]
