"""What a Slurm launch may contain: shared names, the checks on every user value, the command.

Why a module of its own: both launchers (:mod:`nemo_lw_fp8.cli.slurm.sbatch` writes an sbatch
script, :mod:`nemo_lw_fp8.cli.slurm.nemo_run_executor` builds a nemo-run ``SlurmExecutor``) and the
command line (:mod:`nemo_lw_fp8.cli.slurm.command`) refuse the same bad input with the same
:class:`SlurmConfigError`, whose message starts with the flag to fix. Values that reach the
shell are quoted by the launchers; values that land in ``#SBATCH`` lines (parsed by sbatch, not
by bash) are restricted here to a safe character set instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

#: The module every launcher runs (the ``nemo-lw-fp8`` console script's module).
CLI_MODULE = "nemo_lw_fp8.cli"
BRIDGE_INSTALL_HINT = "pip install 'nemo-lw-fp8[bridge]'"
GPU_ARCHS = ("hopper", "blackwell")
EXECUTORS = ("sbatch", "nemo-run")


class SlurmConfigError(ValueError):
    """A launch setting that cannot work; the message names the command-line flag."""


# Environment variable names (``--env NAME=VALUE``).
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Values written into ``#SBATCH`` lines: sbatch parses these itself (not bash), so instead of
# quoting we accept only characters that mean the same to sbatch and to a reader.
_SBATCH_SAFE = re.compile(r"[A-Za-z0-9_.,:+@/%=-]+")
# Slurm time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}")
# Hydra-style override key: optional + / ++ / ~ prefix, then a dotted name (list indices allowed).
_OVERRIDE_KEY = re.compile(r"(\+{1,2}|~)?[A-Za-z_][A-Za-z0-9_.\[\]-]*")


def config_error(flag: str, message: str) -> SlurmConfigError:
    """The error for a bad ``flag``: its message starts with the flag."""
    return SlurmConfigError(f"{flag}: {message}")


def check_text(flag: str, value: str) -> str:
    """Reject line breaks and NULs: they would end a comment line or an argv word."""
    if not isinstance(value, str):
        raise config_error(flag, f"expected a string, got {type(value).__name__}")
    if any(ch in value for ch in "\n\r\x00"):
        raise config_error(flag, f"must not contain line breaks or NUL characters, got {value!r}")
    return value


def check_count(flag: str, value: int) -> int:
    """A positive integer (node and GPU counts); ``True``/``False`` are not counts."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise config_error(flag, f"expected an integer, got {value!r}")
    if value < 1:
        raise config_error(flag, f"must be >= 1, got {value}")
    return value


def check_sbatch_value(flag: str, value: str) -> str:
    """A value written into an ``#SBATCH`` line: safe characters only (sbatch does not quote)."""
    check_text(flag, value)
    if not _SBATCH_SAFE.fullmatch(value):
        raise config_error(
            flag,
            f"{value!r} is written into an #SBATCH line; use only letters, digits and "
            "_ . , : + @ / % = -",
        )
    return value


def check_recipe(recipe: str) -> str:
    """A non-empty recipe name on one line."""
    check_text("RECIPE", recipe)
    if not recipe.strip():
        raise config_error("RECIPE", "the recipe name must not be empty")
    return recipe


def check_overrides(overrides: Sequence[str]) -> list[str]:
    """Hydra-style ``key=value`` overrides, each with a dotted key."""
    checked = []
    for item in overrides:
        check_text("key=value override", item)
        key, sep, _ = item.partition("=")
        if not sep or not _OVERRIDE_KEY.fullmatch(key):
            raise config_error(
                "key=value override",
                f"expected key=value with a dotted key (e.g. train.train_iters=2), got {item!r}",
            )
        checked.append(item)
    return checked


def check_env(env: Mapping[str, str]) -> dict[str, str]:
    """Environment variables with valid names and one-line values (as strings)."""
    checked = {}
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise config_error("--env", f"{name!r} is not a valid environment variable name")
        checked[name] = check_text(f"--env {name}", str(value))
    return checked


def check_mounts(mounts: Sequence[str]) -> list[str]:
    """pyxis mounts, one ``SRC[:DST[:FLAGS]]`` each (pyxis splits the joined list on commas)."""
    checked = []
    for mount in mounts:
        check_text("--container-mounts", mount)
        if not mount or "," in mount:
            raise config_error(
                "--container-mounts",
                f"each mount is SRC[:DST[:FLAGS]] without commas (pyxis splits on them), "
                f"got {mount!r}",
            )
        checked.append(mount)
    return checked


def check_gpu_arch(gpu_arch: str) -> str:
    """One of :data:`GPU_ARCHS` (it selects the architecture-specific environment)."""
    if gpu_arch not in GPU_ARCHS:
        raise config_error(
            "--gpu-arch", f"expected one of {', '.join(GPU_ARCHS)}, got {gpu_arch!r}"
        )
    return gpu_arch


def check_time(time: str) -> str:
    """A Slurm time limit: minutes, MM:SS, HH:MM:SS or D-HH[:MM[:SS]]."""
    if not _SLURM_TIME.fullmatch(check_text("--time", time)):
        raise config_error(
            "--time", f"expected MM, MM:SS, HH:MM:SS or D-HH[:MM[:SS]], got {time!r}"
        )
    return time


def check_allocation(nodes: int, gpus_per_node: int, time: str) -> None:
    """The size and wall-clock limit of the allocation, as both launchers ask for it."""
    check_count("--nodes", nodes)
    check_count("--gpus-per-node", gpus_per_node)
    check_time(time)


def check_sbatch_values(*flags_and_values: tuple[str, str | None]) -> None:
    """:func:`check_sbatch_value` on each ``(flag, value)`` pair whose value is given."""
    for flag, value in flags_and_values:
        if value is not None:
            check_sbatch_value(flag, value)


def default_job_name(recipe: str) -> str:
    """``nemo-lw-fp8-<recipe>`` with anything sbatch-unsafe replaced by ``_``."""
    return "nemo-lw-fp8-" + re.sub(r"[^A-Za-z0-9_.-]", "_", recipe.strip())


def pretrain_args(
    recipe: str,
    *,
    config_file: str | None = None,
    overrides: Sequence[str] = (),
    cpu: bool = False,
) -> list[str]:
    """Arguments after ``python -m nemo_lw_fp8.cli``: the ``pretrain`` command both paths run."""
    args = ["pretrain", "--recipe", check_recipe(recipe)]
    if config_file is not None:
        args += ["--config-file", check_text("--config-file", config_file)]
    if cpu:
        args.append("--cpu")
    return args + check_overrides(overrides)
