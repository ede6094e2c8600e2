"""Megatron-Bridge pretraining recipes with layer-wise Muon + FP8 param gather for MoE models.

Each recipe is a function returning a Megatron-Bridge ``ConfigContainer`` built offline from the
explicit hyper-parameters of :mod:`nemo_lw_fp8.recipes.architectures` (no Hugging Face Hub), with:

* layer-wise Muon from the plugin's optimizer factory
  (:func:`nemo_lw_fp8.bridge.layer_wise_muon_fp8_with_cosine_annealing`): compact layout,
  overlapped param gather;
* FP8 by GPU family: ``mxfp8`` (Blackwell: MXFP8 compute, MXFP8 parameters gathered from the
  grad buffer - Bridge's ``bf16_with_mxfp8_mixed``) or ``hopper`` (Hopper: blockwise FP8
  compute, blockwise FP8 parameters with FP8 codes + scales on the wire, no grad-buffer reuse);
  ``nvfp4`` (GB200 / B200, DeepSeek-V3 and Qwen3-235B only: Bridge's ``bf16_with_nvfp4_mixed``,
  NVFP4 primary weights with FP4 codes + tile scales + amax on the wire, the last 15% of the
  decoder layers in bf16, TE's stochastic rounding as TE ships it; docs/nvfp4.md, "NVFP4
  recipes");
* single grouped expert weights (TE's ``GroupedLinear`` with one parameter) on the grouped GEMM
  (``mxfp8`` recipes, tiny ones included; the blockwise gather handles discrete expert weights
  only, and single grouped NVFP4 weights are not verified: discrete for ``hopper`` and
  ``nvfp4``);
* parallelism from :func:`nemo_lw_fp8.planner.parallelism` (best published Bridge recipe
  of the model, adapted to Muon).

Names: ``<model>_<variant>`` (``deepseek_v3_mxfp8``, ``qwen3_235b_a22b_hopper``...),
``tiny_<model>`` (same architecture, tiny widths, MXFP8; trains on 2 CPU ranks with ``--cpu``)
and ``tiny_<model>_hopper`` (the same with the Hopper variant: ``build_tiny(variant="hopper")``,
blockwise FP8 emulated on CPU, discrete experts), ``tiny_<model>_nvfp4`` likewise. Every
recipe can be overridden from YAML / ``key=value`` (see :mod:`nemo_lw_fp8.cli.pretrain`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nemo_lw_fp8.recipes.architectures import MoEArchitecture, get_architecture, tiny
from nemo_lw_fp8.recipes.catalogue import (
    DISCRETE_EXPERT_VARIANTS,
    MODELS,
    NVFP4_BF16_END_SHARE,
    VARIANT_GPU,
    VARIANT_MODELS,
    VARIANTS,
    nvfp4_bf16_layers_at_end,
    recipe_key,
    recipe_names,
    tiny_name,
    tiny_variant_of,
    variants_of,
)
from nemo_lw_fp8.recipes.factory import (
    build,
    build_tiny,
    mixed_precision,
    short_run,
    tiny_parallelism,
)
from nemo_lw_fp8.recipes.twins import build_twin, twin_world_size


def _make(model: str, variant: str) -> Callable[..., Any]:
    def recipe(**overrides: Any) -> Any:
        return build(model, variant=variant, **overrides)

    recipe.__name__ = f"{recipe_key(model)}_{variant}"
    recipe.__doc__ = (
        f"{model} pretraining, layer-wise Muon, {variant} FP8 param gather "
        f"({VARIANT_GPU[variant]} parallelism)."
    )
    if variant == "nvfp4":
        recipe.__doc__ = (
            f"{model} pretraining, layer-wise Muon, NVFP4 compute, NVFP4 primary weights and "
            f"FP4 param gather, discrete experts ({VARIANT_GPU[variant]} / b200 parallelism)."
        )
    return recipe


def _make_tiny(model: str, variant: str) -> Callable[..., Any]:
    def recipe(**overrides: Any) -> Any:
        return build_tiny(model, **({"variant": variant} | overrides))

    recipe.__name__ = tiny_name(model, variant)
    recipe.__doc__ = f"Tiny {model} architecture (2 CPU ranks with --cpu), every feature on."
    if variant == "hopper":
        recipe.__doc__ = (
            f"Tiny {model} architecture (2 CPU ranks with --cpu), Hopper variant: blockwise FP8 "
            "compute and param gather, discrete experts."
        )
    if variant == "nvfp4":
        recipe.__doc__ = (
            f"Tiny {model} architecture (2 CPU ranks with --cpu), NVFP4 variant: NVFP4 compute, "
            "NVFP4 primary weights and FP4 param gather, discrete experts."
        )
    return recipe


def _make_twin(full: str) -> Callable[..., Any]:
    def recipe(**overrides: Any) -> Any:
        return build_twin(full, **overrides)

    recipe.__name__ = f"twin_{full}"
    recipe.__doc__ = (
        f"{full}'s parallelism structure at CPU size (PP / VPP 2 and EP over TP x DP 2 where "
        "it has them, TP as shipped): "
        f"torchrun --nproc-per-node {twin_world_size(full)} ... --cpu."
    )
    return recipe


RECIPES: dict[str, Callable[..., Any]] = {}
for _model in MODELS:
    for _variant in variants_of(_model):
        RECIPES[f"{recipe_key(_model)}_{_variant}"] = _make(_model, _variant)
    for _variant in variants_of(_model):
        RECIPES[tiny_name(_model, _variant)] = _make_tiny(_model, _variant)
    for _variant in variants_of(_model):
        RECIPES[f"twin_{recipe_key(_model)}_{_variant}"] = _make_twin(
            f"{recipe_key(_model)}_{_variant}"
        )
del _model, _variant


def get_recipe(name: str) -> Callable[..., Any]:
    try:
        return RECIPES[recipe_key(name)]
    except KeyError:
        raise KeyError(f"unknown recipe {name!r}; known: {', '.join(sorted(RECIPES))}") from None


def tiny_architecture_of(name: str) -> MoEArchitecture | None:
    """The tiny architecture behind a ``tiny_*`` recipe name (None for full-size recipes)."""
    found = tiny_variant_of(name)
    return None if found is None else tiny(get_architecture(found[0]))


__all__ = [
    "DISCRETE_EXPERT_VARIANTS",
    "MODELS",
    "NVFP4_BF16_END_SHARE",
    "RECIPES",
    "VARIANTS",
    "VARIANT_GPU",
    "VARIANT_MODELS",
    "build",
    "build_tiny",
    "build_twin",
    "get_recipe",
    "mixed_precision",
    "nvfp4_bf16_layers_at_end",
    "recipe_key",
    "recipe_names",
    "short_run",
    "tiny_architecture_of",
    "tiny_name",
    "tiny_parallelism",
    "tiny_variant_of",
    "twin_world_size",
    "variants_of",
]
