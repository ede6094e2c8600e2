"""Recipe-faithful twins: each full recipe's parallelism *structure* on a few CPU ranks (2 or 4
for the TP-1 recipes, without or with PP; 8 for the two that ship TP 2: DeepSeek-V3 and
Qwen3-235B on H100).

A tiny model (:func:`nemo_lw_fp8.planner.tiny`) proves little about a recipe that ships PP 4 x
VPP 4 x EP 64 if it runs on 2 data-parallel ranks. A twin keeps what changes the code paths a
recipe takes, and shrinks only the sizes:

* pipeline parallel 2 when the recipe has PP > 1, with 2 virtual stages per rank when it has
  VPP; its layout string keeps the recipe's shape (embedding with the first stage's layers, MTP
  and loss after the last stage's), one decoder layer per stage; without a layout, the
  recipe's embedding / loss accounting, two units per stage;
* data parallel 2; expert parallel, when the recipe has EP > 1, over all TP x DP ranks of a
  stage: expert-data-parallel size 1 (each expert's matrices on one rank), so EP 2 at TP 1 and
  EP 4 at TP 2. Every recipe ships expert DP 1 except ``deepseek_v3_hopper`` (EP 64 over a
  stage's 128 TP x DP ranks: expert DP 2), whose twin keeps expert DP 1; expert DP > 1 is
  what the twins' DP-4 resumes exercise (tests/recipes/test_recipe_twins.py);
* TP, sequence parallelism, ETP, CP as shipped (TP 2 with SP for DeepSeek-V3 and Qwen3-235B
  on H100, 1 elsewhere; ETP and CP 1 everywhere), with the tiny model's TP-split widths in
  whole 128-wide blockwise tiles per shard (:func:`nemo_lw_fp8.planner.tiny`'s
  ``tensor_parallel``); the FP8 recipe (MXFP8 or blockwise), single grouped weights, layout,
  ownership, gradient clipping, MTP, dropout and the MoE auxiliary loss as shipped.

World: PP x TP x CP x DP, so a TP-2 twin with PP takes 8 ranks (PP 2 x TP 2 x DP 2).

Names: ``twin_<recipe>`` (``twin_deepseek_v3_mxfp8``); ``pretrain --recipe twin_... --cpu``
under ``torchrun --nproc-per-node`` :func:`twin_world_size`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from nemo_lw_fp8.recipes.architectures import MoEArchitecture, get_architecture, tiny
from nemo_lw_fp8.recipes.catalogue import MODELS, VARIANT_GPU, recipe_key, variants_of
from nemo_lw_fp8.recipes.factory import build, short_run
from nemo_lw_fp8.recipes.parallel import ParallelismDefaults, parallelism

#: Data-parallel ranks of every twin (the expert-parallel size, times TP, where the recipe has EP).
TWIN_DATA_PARALLEL = 2
PREFIX = "twin_"


def _full(recipe: str) -> tuple[MoEArchitecture, str, ParallelismDefaults]:
    """The architecture, variant and parallelism of a full recipe name (``deepseek_v3_mxfp8``)."""
    for model in MODELS:
        for variant in variants_of(model):
            if recipe_key(recipe) == f"{recipe_key(model)}_{variant}":
                arch = get_architecture(model)
                return arch, variant, parallelism(arch, VARIANT_GPU[variant])
    raise KeyError(f"{recipe!r} is not a full recipe (<model>_<variant>, `nemo-lw-fp8 recipes`)")


def twin_parallelism(full: ParallelismDefaults) -> ParallelismDefaults:
    """The recipe's parallelism structure at sizes 1 or 2 (the layout is set by
    :func:`twin_architecture`, which knows the layer count)."""
    pp = 2 if full.pp > 1 else 1
    world = pp * full.tp * full.cp * TWIN_DATA_PARALLEL
    # Expert-data-parallel size 1, as shipped: EP x ETP covers a stage's TP x CP x DP ranks.
    ep = world // (pp * full.etp) if full.ep > 1 else 1
    return replace(
        full,
        recipe=f"twin of {full.recipe}",
        muon_change="",
        nodes=1,
        gpus_per_node=world,
        pp=pp,
        vpp=2 if full.vpp else None,
        ep=ep,
        micro_batch_size=1,
        # 4 micro-batches per data-parallel rank: a multiple of PP, as interleaving wants.
        global_batch_size=4 * TWIN_DATA_PARALLEL,
        seq_length=64,
        pipeline_layout=None,
    )


def _stage_layout(stages: int, mtp: bool) -> str:
    """One decoder layer per virtual stage, the embedding first, MTP and loss last."""
    parts = ["t"] * stages
    parts[0] = "E" + parts[0]
    parts[-1] += ("m" if mtp else "") + "L"
    return "|".join(parts)


def twin_architecture(
    arch: MoEArchitecture, full: ParallelismDefaults, twin: ParallelismDefaults
) -> tuple[MoEArchitecture, ParallelismDefaults]:
    """The tiny model sized to the twin's stages, and the twin with its layout."""
    small = tiny(arch, tensor_parallel=twin.tp)
    stages = twin.pp * (twin.vpp or 1)
    layers = small.num_layers
    if full.pipeline_layout is not None:
        layers = stages
        twin = replace(twin, pipeline_layout=_stage_layout(stages, bool(small.mtp_num_layers)))
    elif twin.pp > 1:
        extra = twin.account_for_embedding_in_pipeline_split
        extra += twin.account_for_loss_in_pipeline_split
        per_stage = max(2, -(-(layers + extra) // stages))
        layers = per_stage * stages - extra
    return tiny(arch, num_layers=layers, tensor_parallel=twin.tp), twin


def twin_defaults(recipe: str) -> ParallelismDefaults:
    """The twin's parallelism (``deepseek_v3_mxfp8`` or ``twin_deepseek_v3_mxfp8``), without
    its layout."""
    return twin_parallelism(_full(_strip(recipe))[2])


def twin_world_size(recipe: str) -> int:
    """The ``--nproc-per-node`` a twin needs."""
    return twin_defaults(recipe).world_size


def _strip(name: str) -> str:
    return name[len(PREFIX) :] if name.startswith(PREFIX) else name


def build_twin(recipe: str, *, train_iters: int = 4) -> Any:
    """A Bridge ``ConfigContainer``: the twin of full recipe ``recipe`` (``deepseek_v3_mxfp8``
    or ``twin_deepseek_v3_mxfp8``), a short CPU-sized run with the recipe's training settings."""
    arch, variant, full = _full(_strip(recipe))
    shipped = build(arch, variant=variant, parallel=full)
    small, twin = twin_architecture(arch, full, twin_parallelism(full))
    cfg = build(small, variant=variant, parallel=twin, train_iters=train_iters, max_lr=3e-3)
    short_run(cfg, train_iters)
    # As shipped (the tiny recipes drop them for speed or for PP 1 layouts).
    cfg.optimizer.clip_grad = shipped.optimizer.clip_grad
    cfg.model.moe_aux_loss_coeff = shipped.model.moe_aux_loss_coeff
    cfg.ddp.check_for_nan_in_grad = shipped.ddp.check_for_nan_in_grad
    return cfg
