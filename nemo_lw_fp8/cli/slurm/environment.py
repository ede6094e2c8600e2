"""The environment every Slurm launch exports, with the reason for each variable.

Why a module of its own: the defaults are a reviewed table (docs/slurm.md, "Environment"),
shared by the sbatch script and the nemo-run executor, and differ by GPU generation. Values
follow Megatron-Bridge 0.6.2's recipe environments; user ``--env`` values win.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nemo_lw_fp8.cli.slurm.settings import check_env, check_gpu_arch, config_error


@dataclass(frozen=True)
class EnvVar:
    """One exported variable and the reason it is set (rendered as a comment above it)."""

    name: str
    value: str
    why: str


_MARGIN_WHY = (
    "TE leaves 20 SMs free in LayerNorm kernels for the overlapped NCCL kernels "
    "(Bridge's DeepSeek-V3 recipe)"
)

#: Set for every run. Values follow Megatron-Bridge 0.6.2's recipe environments
#: (``recipes/utils/environment_utils.py`` and the DeepSeek-V3 / Qwen3-MoE recipes).
COMMON_ENV: tuple[EnvVar, ...] = (
    EnvVar("PYTHONUNBUFFERED", "1", "rank output reaches the Slurm log as it is printed"),
    EnvVar(
        "TORCH_NCCL_AVOID_RECORD_STREAMS",
        "1",
        "collective buffers are freed when their work completes, not at a later stream sync: "
        "lower peak memory with overlapped param gather and grad reduce",
    ),
    EnvVar(
        "TORCH_NCCL_HIGH_PRIORITY",
        "1",
        "NCCL streams at high priority, so overlapped param gathers are not starved by GEMMs",
    ),
    EnvVar(
        "NCCL_NVLS_ENABLE",
        "0",
        "NVLink SHARP buffers cost GPU memory per communicator and MoE + layer-wise Muon "
        "create many (DP, EP, expert-DP groups); Bridge's recipes keep it off",
    ),
    EnvVar(
        "NCCL_GRAPH_REGISTER",
        "0",
        "no NCCL graph buffer registration with the expandable allocator (Bridge's default)",
    ),
    EnvVar(
        "PYTORCH_CUDA_ALLOC_CONF",
        "expandable_segments:True",
        "MoE token buffers change size every step; expandable segments fragment less",
    ),
    EnvVar("NVTE_FWD_LAYERNORM_SM_MARGIN", "20", _MARGIN_WHY),
    EnvVar("NVTE_BWD_LAYERNORM_SM_MARGIN", "20", _MARGIN_WHY),
)

#: Differs by GPU generation.
ARCH_ENV: dict[str, tuple[EnvVar, ...]] = {
    "hopper": (
        EnvVar(
            "CUDA_DEVICE_MAX_CONNECTIONS",
            "1",
            "Hopper: megatron's TP/SP/CP communication overlap needs kernels launched in "
            "program order on one hardware queue",
        ),
    ),
    "blackwell": (
        EnvVar(
            "CUDA_DEVICE_MAX_CONNECTIONS",
            "32",
            "Blackwell no longer needs the single queue (megatron-core's argument checks); "
            "Bridge's GB200 recipes use 32 so EP overlap streams run concurrently",
        ),
    ),
}


def recipe_env(recipe: str, cpu: bool = False) -> tuple[EnvVar, ...]:
    """What recipe ``recipe``'s TE layers need (:mod:`.te_env`), exported before Python starts
    so TE sees it at import. ``cpu``: without the variables TE reads at import (with them set,
    importing TE's op fuser asks the CUDA driver; ``pretrain --cpu`` exports them after its TE
    boot). A name that is no shipped recipe needs nothing known here."""
    from nemo_lw_fp8 import recipes
    from nemo_lw_fp8.recipes import te_env

    if recipes.recipe_key(recipe) not in recipes.RECIPES:
        return ()
    return tuple(
        EnvVar(var.name, var.value, var.why)
        for var in te_env.for_recipe(recipe)
        if not (cpu and var.before_import)
    )


def resolve_env(
    gpu_arch: str,
    env: Mapping[str, str] | None = None,
    recipe: str | None = None,
    cpu: bool = False,
) -> list[EnvVar]:
    """The defaults for ``gpu_arch`` (and what ``recipe``'s layers need) with ``env`` layered on
    top (user values win; one that contradicts the recipe is refused, rule
    ``op-fuser-glu-experts-env`` / ``grouped-weight-te-switch``)."""
    check_gpu_arch(gpu_arch)
    user = check_env(env or {})
    needed = recipe_env(recipe, cpu) if recipe is not None else ()
    if needed:
        from nemo_lw_fp8.errors import ConfigError
        from nemo_lw_fp8.recipes import te_env

        try:
            full = {var.name: var.value for var in recipe_env(recipe)}
            te_env.check_environment(recipe, full | user)
        except ConfigError as error:
            raise config_error("--env", str(error)) from None
    resolved: list[EnvVar] = []
    for var in (*COMMON_ENV, *ARCH_ENV[gpu_arch], *needed):
        if var.name in user:
            resolved.append(
                EnvVar(
                    var.name,
                    user.pop(var.name),
                    f"given with --env (default {var.value}: {var.why})",
                )
            )
        else:
            resolved.append(var)
    resolved.extend(EnvVar(name, value, "given with --env") for name, value in user.items())
    return resolved
