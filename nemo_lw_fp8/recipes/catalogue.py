"""The recipe catalogue's words: which models have recipes, the variants (one per GPU family's FP8
flavour), how recipe names are spelled, and the facts a variant fixes. Nothing here builds a
config or imports Megatron-Bridge, so the launch environment (:mod:`.te_env`), the factory
(:mod:`.factory`), the twins (:mod:`.twins`) and the registry (:mod:`nemo_lw_fp8.recipes`) all
read the same catalogue without importing each other.
"""

from __future__ import annotations

VARIANTS = ("mxfp8", "hopper", "nvfp4")
#: GPU family each variant's parallelism is taken from.
VARIANT_GPU = {"mxfp8": "gb200", "hopper": "h100", "nvfp4": "gb200"}
#: Variants shipped for a subset of the models only (the rest: every model). NVFP4 primary
#: weights are verified for the two largest MoE models first (docs/nvfp4.md, "NVFP4 recipes").
VARIANT_MODELS = {"nvfp4": ("deepseek-v3", "qwen3-235b-a22b")}
#: Variants with discrete expert weights (TE's ``GroupedLinear`` modules, no op fuser): the
#: blockwise gather handles discrete weights only, and single grouped NVFP4 weights are not
#: verified under layer-wise Muon (rule ``grouped-weight-nvfp4-layer-wise``).
DISCRETE_EXPERT_VARIANTS = ("hopper", "nvfp4")
#: Share of the transformer layers the NVFP4 recipes keep in bf16, at the end, as Bridge's NVFP4
#: presets do (``nemotron_3_ultra_bf16_with_nvfp4_mixed``: "last 15% of layers in BF16"; Llama3
#: 8B's NVFP4 recipe: its last 4 of 32); none at the start.
NVFP4_BF16_END_SHARE = 0.15


def nvfp4_bf16_layers_at_end(num_layers: int) -> int:
    """How many of ``num_layers`` decoder layers an NVFP4 recipe keeps in bf16 at the end: the
    rounded 15%, at least one (DeepSeek-V3: 9 of 61, Qwen3-235B: 14 of 94, a twin: 1)."""
    return max(1, round(NVFP4_BF16_END_SHARE * num_layers))


#: Models with recipes (architecture names in :mod:`nemo_lw_fp8.recipes.architectures`).
MODELS = (
    "deepseek-v3",
    "deepseek-v2-lite",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
    "qwen3-next-80b-a3b",
    "qwen3.5-35b-a3b",
)


def recipe_key(name: str) -> str:
    """A model or recipe name as recipe names spell it (``qwen3.5-35b-a3b`` ->
    ``qwen3_5_35b_a3b``)."""
    return name.lower().replace("-", "_").replace(".", "_")


def variants_of(model: str) -> tuple[str, ...]:
    """The variants shipped for ``model`` (an architecture name of :data:`MODELS`)."""
    return tuple(v for v in VARIANTS if model in VARIANT_MODELS.get(v, MODELS))


def tiny_name(model: str, variant: str = "mxfp8") -> str:
    """Recipe name of a tiny model: ``tiny_<model>`` (MXFP8), ``tiny_<model>_hopper``,
    ``tiny_<model>_nvfp4``."""
    return f"tiny_{recipe_key(model)}" + ("" if variant == "mxfp8" else f"_{variant}")


def tiny_variant_of(name: str) -> tuple[str, str] | None:
    """``(model, variant)`` of a ``tiny_*`` recipe name (None for full-size recipes)."""
    key = recipe_key(name)
    for model in MODELS:
        for variant in variants_of(model):
            if key == tiny_name(model, variant):
                return model, variant
    return None


def recipe_names() -> list[str]:
    """Every recipe name the registry holds: full, tiny and twin, in the registry's order."""
    names = []
    for model in MODELS:
        names += [f"{recipe_key(model)}_{variant}" for variant in variants_of(model)]
        names += [tiny_name(model, variant) for variant in variants_of(model)]
        names += [f"twin_{recipe_key(model)}_{variant}" for variant in variants_of(model)]
    return names
