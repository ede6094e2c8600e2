"""The launch environment a recipe's Transformer Engine layers need, and the expert path it picks.

One place computes it; ``nemo-lw-fp8 pretrain`` (before TE is imported), ``nemo llm pretrain``,
the sbatch script, the nemo-run executor and the recipes' own ``env_vars`` all read it. Decided
from the source of megatron-core 0.19.2 and TE 2.20.2 (docs/recipes.md, "Launch environment"):

``NVTE_GROUPED_LINEAR_SINGLE_PARAM=1`` (single grouped expert weights)
    TE's ``resolve_grouped_linear_single_param_flags`` (``transformer_engine/pytorch/utils.py``)
    honours ``GroupedLinear(single_grouped_weight=True)`` only when it is > 0; otherwise it warns
    and builds ``weight0..N``. Read when the module is built.
``NVTE_CUTEDSL_FUSED_GROUPED_MLP=1`` (TE's op fuser with SwiGLU / quick-GEGLU experts)
    megatron's ``TEGroupedMLP._is_fused_impl_supported`` (``transformer/moe/experts.py``)
    returns False for a GLU activation without it, and ``TEGroupedMLP.__init__`` asserts
    "Fused GroupedMLP is not supported for this configuration." on every GPU: megatron builds its
    op-fuser experts only where TE could fuse them. In TE the variable lets
    ``GroupedMLP_CuTeGEMMGLU.is_supported()`` (``ops/fused/grouped_mlp.py``) succeed, which also
    needs compute capability 10.x, ``nvidia-cudnn-frontend`` >= 1.23 and its CuTe-DSL kernels;
    TE evaluates it once, when ``transformer_engine.pytorch.ops`` is imported, and only then
    registers the fusion. The fusion then replaces ``GroupedLinear + ScaledSwiGLU + GroupedLinear``
    when the recipe is MXFP8 with an E4M3 backward (Bridge's ``bf16_with_mxfp8_mixed``: ``e4m3``)
    or NVFP4. Elsewhere (Hopper, no cudnn-frontend, HYBRID format, the variable exported after
    TE's import) the op fuser runs the three ops unfused on TE's grouped GEMM.

Both paths read a single grouped MXFP8 weight as the plugin leaves it: the CuTe-DSL forward
takes the ``GroupedTensor`` parameter itself when it has a quantizer (MXFP8 primary weights) and
its backward the same tensor's ``columnwise_data`` (swizzled in a copy), so the weights are the
bytes the owner quantized and the FP8 param gather wrote, rowwise and columnwise.

Nothing here changes how TE rounds: the NVFP4 recipes keep TE's ``NVFP4BlockScaling`` defaults on
a GPU, stochastic rounding of the gradients included (docs/nvfp4.md, "Stochastic rounding"); a
team that wants it off exports ``NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1`` itself. Only the CPU
backend turns it off, for its own runs (:mod:`nemo_lw_fp8.cpu.megatron.bridge_pretrain`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nemo_lw_fp8.recipes import catalogue
from nemo_lw_fp8.recipes.architectures import get_architecture
from nemo_lw_fp8.vocabulary import CUTEDSL_ENV, SINGLE_GROUPED_WEIGHT_ENV

#: TE 2.20.2's floor for its fused grouped MLP (``_cudnn_frontend_version_supported``).
CUDNN_FRONTEND_MIN = "1.23.0"
#: Compute capability per GPU the recipes are planned for (SM 10.x: Blackwell).
GPU_CAPABILITY = {"gb200": (10, 0), "b200": (10, 0), "h100": (9, 0), "h200": (9, 0)}
#: megatron's activations its op fuser fuses with a GLU (``_is_fused_impl_supported``).
GLU_FUSED_ACTIVATIONS = ("silu", "quick_gelu")


@dataclass(frozen=True)
class LaunchVar:
    """One variable a recipe's layers need, with the reason (rendered as a comment)."""

    name: str
    value: str
    why: str
    #: TE reads it when ``transformer_engine`` is imported (not only when a module is built).
    before_import: bool = False


_SINGLE_PARAM_WHY = (
    "TE builds one grouped parameter per expert linear only with this set; without it TE warns "
    "and builds weight0..N, and the recipe would not train what it was configured for"
)
_CUTEDSL_WHY = (
    "megatron-core 0.19.2 builds op-fuser SwiGLU experts only with this set (else it asserts "
    "'Fused GroupedMLP is not supported for this configuration.'); on SM 10.x with "
    "nvidia-cudnn-frontend >= 1.23 TE then fuses them into its CuTe-DSL grouped MLP; it must "
    "be set before transformer_engine is imported"
)


def _get(model: Any, name: str, default: Any = None) -> Any:
    if isinstance(model, Mapping):
        return model.get(name, default)
    return getattr(model, name, default)


def activation_name(activation: Any) -> str | None:
    """``"silu"`` for ``torch.nn.functional.silu`` or the string ``"silu"``, etc."""
    if activation is None:
        return None
    if isinstance(activation, str):
        return activation
    return getattr(activation, "__name__", None)


def glu_experts(model: Any) -> bool:
    """megatron's ``use_glu_fusion``: gated experts whose activation the op fuser fuses."""
    return bool(_get(model, "gated_linear_unit")) and (
        activation_name(_get(model, "activation_func")) in GLU_FUSED_ACTIVATIONS
    )


def op_fuser_experts(model: Any) -> bool:
    """Whether megatron builds the model's experts through TE's op fuser."""
    return bool(
        _get(model, "num_moe_experts")
        and _get(model, "moe_grouped_gemm")
        and _get(model, "use_transformer_engine_op_fuser")
    )


def needs(model: Any) -> list[LaunchVar]:
    """What a model config (``TransformerConfig``, a Bridge provider, or a mapping of its
    fields) needs in the environment of every rank."""
    out = []
    if _get(model, "num_moe_experts") and _get(model, "moe_single_grouped_weight"):
        out.append(LaunchVar(SINGLE_GROUPED_WEIGHT_ENV, "1", _SINGLE_PARAM_WHY))
    if op_fuser_experts(model) and glu_experts(model):
        out.append(LaunchVar(CUTEDSL_ENV, "1", _CUTEDSL_WHY, before_import=True))
    return out


def for_config(cfg: Any) -> list[LaunchVar]:
    """What a Bridge ``ConfigContainer`` needs (its ``model``)."""
    return needs(cfg.model)


def recipe_model(name: str) -> dict[str, Any]:
    """The model fields that decide a recipe's environment, without building it (no Bridge
    import): the architecture's experts and the variant's expert presentation, as
    :func:`nemo_lw_fp8.recipes.build` sets them (``tests/recipes/test_te_launch_env.py`` checks
    every recipe's built config gives the same environment)."""
    key = catalogue.recipe_key(name)
    known = catalogue.recipe_names()
    if key not in known:
        raise KeyError(f"unknown recipe {name!r}; known: {', '.join(sorted(known))}")
    found = catalogue.tiny_variant_of(key)
    if found is None:
        key = key.removeprefix("twin_")
        variant = key.rsplit("_", 1)[1]
        model = next(m for m in catalogue.MODELS if catalogue.recipe_key(m) == key.rsplit("_",
        1)[0])
    else:
        model, variant = found
    arch = get_architecture(model)
    grouped = variant not in catalogue.DISCRETE_EXPERT_VARIANTS
    return {
        "num_moe_experts": arch.num_moe_experts,
        "moe_grouped_gemm": True,
        "use_transformer_engine_op_fuser": grouped,
        "moe_single_grouped_weight": grouped,
        "gated_linear_unit": arch.gated_linear_unit,
        "activation_func": arch.activation_func,
        "fp8_recipe": {"mxfp8": "mxfp8", "hopper": "blockwise"}.get(variant, variant),
        "fp8": None if variant == "nvfp4" else "e4m3",
        "fp4": "e2m1" if variant == "nvfp4" else None,
        "fp4_recipe": "nvfp4" if variant == "nvfp4" else None,
    }


def for_recipe(name: str) -> list[LaunchVar]:
    """What recipe ``name`` needs in the environment of every rank."""
    return needs(recipe_model(name))


def as_dict(variables: list[LaunchVar]) -> dict[str, str]:
    return {var.name: var.value for var in variables}


def export(variables: list[LaunchVar], environ: Any = None) -> dict[str, str]:
    """Set the variables in ``environ`` (the process environment) where they are unset; values
    already there win (the rules ``op-fuser-glu-experts-env`` and ``grouped-weight-te-switch``
    refuse a contradicting one, :func:`check_environment`). Returns what
    was set."""
    environ = os.environ if environ is None else environ
    set_now = {}
    for var in variables:
        if var.name not in environ:
            environ[var.name] = var.value
            set_now[var.name] = var.value
    return set_now


def user_values(overrides: Any) -> dict[str, str]:
    """``env_vars.NAME=VALUE`` among ``key=value`` overrides (the user's word wins)."""
    out = {}
    for word in overrides or ():
        key, sep, value = str(word).partition("=")
        if sep and key.startswith("env_vars."):
            out[key[len("env_vars."):]] = value.strip("'\"")
    return out


def export_for_launch(recipe: str, overrides: Any = (), *, environ: Any = None) -> dict[str, str]:
    """What ``nemo-lw-fp8 pretrain`` / ``nemo llm pretrain`` export before Bridge (and so TE)
    is imported: the recipe's variables TE reads at import (``NVTE_CUTEDSL_FUSED_GROUPED_MLP``),
    unless the environment or an ``env_vars.NAME=...`` override gives one. The others reach the
    process through the recipe's ``env_vars``, which Bridge exports before it builds."""
    given = user_values(overrides)
    wanted = [
        LaunchVar(var.name, given.get(var.name, var.value), var.why, var.before_import)
        for var in for_recipe(recipe)
        if var.before_import
    ]
    return export(wanted, environ)


def te_ops_imported() -> bool:
    """Whether TE's op fuser was imported already (it registered its fusions then)."""
    import sys

    return "transformer_engine.pytorch.ops" in sys.modules


def check_environment(recipe: str, environ: Mapping[str, str]) -> None:
    """Refuse (``ConfigError``, rules ``op-fuser-glu-experts-env`` and
    ``grouped-weight-te-switch``) a launch environment that contradicts what recipe ``name``'s
    layers need: a variable it needs set to 0, or missing after the recipe's own are applied."""
    from nemo_lw_fp8 import rules as guards

    model = recipe_model(recipe)
    settings = guards.Settings(
        num_moe_experts=model["num_moe_experts"],
        moe_grouped_gemm=model["moe_grouped_gemm"],
        use_transformer_engine_op_fuser=model["use_transformer_engine_op_fuser"],
        moe_single_grouped_weight=model["moe_single_grouped_weight"],
        gated_linear_unit=model["gated_linear_unit"],
        activation_func=model["activation_func"],
        cutedsl_fused_grouped_mlp=_enabled(environ.get(CUTEDSL_ENV, "0")),
        grouped_linear_single_param=_enabled(environ.get(SINGLE_GROUPED_WEIGHT_ENV, "0")),
    )
    rules = ("op-fuser-glu-experts-env", "grouped-weight-te-switch")
    for rule, message in guards.violations(settings):
        if rule in rules:
            raise guards.ConfigError(rule, message)


def contradictions(variables: list[LaunchVar], environ: Mapping[str, str]) -> list[str]:
    """The variables ``environ`` sets to something other than what the recipe needs (unset
    ones are not contradictions here: :func:`export` fills them)."""
    out = []
    for var in variables:
        value = environ.get(var.name)
        if value is not None and _enabled(value) != _enabled(var.value):
            out.append(var.name)
    return out


def _enabled(value: str) -> bool:
    try:
        return int(value) > 0
    except ValueError:
        return False


def _cudnn_frontend_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("nvidia-cudnn-frontend")
    except metadata.PackageNotFoundError:
        return None


def _at_least(version: str, floor: str) -> bool:
    def parts(text: str) -> tuple[int, ...]:
        out = []
        for piece in text.split(".")[:3]:
            digits = "".join(ch for ch in piece if ch.isdigit())
            out.append(int(digits) if digits else 0)
        return tuple(out)

    return parts(version) >= parts(floor)


def expert_path(model: Any, capability: tuple[int, int] | None,
                cudnn_frontend: str | None, env_set: bool = True) -> str:  # fmt: skip
    """The expert implementation megatron + TE build for ``model`` on a GPU of compute
    ``capability`` with ``cudnn_frontend`` installed (None: not installed); ``env_set``: the
    launch environment exported before TE's import."""
    if not _get(model, "num_moe_experts"):
        return "no experts"
    if not _get(model, "moe_grouped_gemm"):
        return "SequentialMLP (one TE linear per expert)"
    presentation = (
        "single grouped weights" if _get(model, "moe_single_grouped_weight") else "discrete weights"
    )
    if not _get(model, "use_transformer_engine_op_fuser"):
        return f"TEGroupedMLP unfused: TE GroupedLinear modules, {presentation}"
    if glu_experts(model) and not env_set:
        return f"none: megatron asserts at build ({CUTEDSL_ENV} unset or 0)"
    fp8_recipe, fp8 = _get(model, "fp8_recipe"), _get(model, "fp8")
    if fp8_recipe == "mxfp8" and capability is not None and capability[0] < 10:
        return "unsupported: MXFP8 GEMMs need SM >= 10.0 (use the recipe's *_hopper variant)"
    reasons = []
    if capability is None or capability[0] != 10:
        reasons.append("not SM 10.x")
    if cudnn_frontend is None or not _at_least(cudnn_frontend, CUDNN_FRONTEND_MIN):
        reasons.append(f"no nvidia-cudnn-frontend >= {CUDNN_FRONTEND_MIN}")
    if not (fp8_recipe == "nvfp4" or (fp8_recipe == "mxfp8" and fp8 == "e4m3")):
        reasons.append("not MXFP8 E4M3 / NVFP4")
    if not glu_experts(model):
        reasons.append("not a GLU activation")
    if not reasons:
        return f"TE CuTe-DSL fused grouped MLP (GroupedMLP_CuTeGEMMGLU), {presentation}"
    return (
        f"TE op fuser, unfused (GroupedLinear + ScaledSwiGLU + GroupedLinear on TE's grouped "
        f"GEMM), {presentation}: {', '.join(reasons)}"
    )


def recipe_paths(name: str, gpus: tuple[str, ...] | None = None) -> list[tuple[str, str]]:
    """``(GPU, expert path)`` for recipe ``name`` on each GPU, with and without
    nvidia-cudnn-frontend >= 1.23 where it matters."""
    model = recipe_model(name)
    out = []
    for gpu in gpus or ("gb200", "h100"):
        capability = GPU_CAPABILITY[gpu]
        with_fe = expert_path(model, capability, CUDNN_FRONTEND_MIN)
        without_fe = expert_path(model, capability, None)
        if with_fe == without_fe:
            out.append((gpu, with_fe))
        else:
            out.append((f"{gpu} + cudnn-frontend >= {CUDNN_FRONTEND_MIN}", with_fe))
            out.append((f"{gpu} without cudnn-frontend", without_fe))
    return out


def this_machine() -> tuple[tuple[int, int] | None, str | None]:
    """This process's GPU compute capability (None without CUDA) and cudnn-frontend version."""
    import torch

    capability = None
    if torch.cuda.is_available():
        capability = tuple(torch.cuda.get_device_capability(torch.cuda.current_device()))
    return capability, _cudnn_frontend_version()  # type: ignore[return-value]
