"""``nemo llm pretrain``, provided through nemo-run's ``nemo_run.cli`` entry-point group.

NeMo 2.x declared ``llm = nemo.collections.llm`` in that group; NeMo 3.0 is speech only and
nothing claims ``llm`` any more. This package declares it (``pyproject.toml``) for Megatron-Bridge
recipes: ``nemo llm pretrain --help`` lists the recipes as factories, and::

    nemo llm pretrain --factory tiny_deepseek_v3 cpu=True --dryrun
    torchrun --nproc-per-node 8 $(which nemo) llm pretrain --factory deepseek_v3_mxfp8 --yes \\
        'overrides=["train.train_iters=1000"]'

train exactly as ``nemo-lw-fp8 pretrain --recipe ...`` does (:mod:`nemo_lw_fp8.cli.pretrain`).

When NeMo's own ``nemo.collections.llm`` is importable (NeMo 2.x), this module registers nothing
and says so: two packages must not both answer ``nemo llm``; use ``nemo-lw-fp8 pretrain`` then.
"""

# No ``from __future__ import annotations``: nemo-run's help reads real annotation objects.
import importlib.util
import os
import sys
import warnings
from typing import Optional

from nemo_lw_fp8 import recipes


def nemo_llm_present() -> bool:
    """Whether NeMo 2.x's ``llm`` collection is installed (it owns ``nemo llm``)."""
    try:
        return importlib.util.find_spec("nemo.collections.llm") is not None
    except ModuleNotFoundError:
        return False


CONFLICT_MESSAGE = (
    "NeMo's own `nemo llm` (nemo.collections.llm, NeMo 2.x) is installed, so nemo_lw_fp8 does not "
    "register `nemo llm pretrain` (both would claim it). Use `nemo-lw-fp8 pretrain --recipe NAME` "
    "instead, or uninstall NeMo 2.x (it cannot run with megatron-core 0.19.2 anyway)."
)

if nemo_llm_present():
    warnings.warn(CONFLICT_MESSAGE, stacklevel=1)
else:
    import nemo_run as run

    @run.cli.entrypoint(namespace="llm", help="Pretrain a nemo_lw_fp8 recipe with Megatron-Bridge")
    def pretrain(
        recipe: str = "tiny_deepseek_v3",
        config_file: Optional[str] = None,  # noqa: UP045 (nemo-run reads typing.Optional)
        overrides: Optional[list[str]] = None,  # noqa: UP045
        cpu: bool = False,
        losses_json: Optional[str] = None,  # noqa: UP045
    ) -> None:
        """Build ``recipe``, apply the YAML file and ``key=value`` overrides, check, train."""
        if cpu and _megatron_imported_without_te():
            _train_in_fresh_process(recipe, config_file, overrides, losses_json)
        from nemo_lw_fp8.cli.pretrain import run as run_pretrain

        run_pretrain(recipe, config_file, list(overrides or ()), cpu, losses_json)

    def _megatron_imported_without_te() -> bool:
        """Whether another ``nemo_run.cli`` entry point (Bridge declares ``lm``) imported
        megatron-core before any Transformer Engine: megatron fixes its TE flags at import, so
        the CPU backend can no longer be booted in this process."""
        return "megatron.core" in sys.modules and "transformer_engine" not in sys.modules

    def _train_in_fresh_process(
        recipe: str,
        config_file: Optional[str],  # noqa: UP045
        overrides: Optional[list[str]],  # noqa: UP045
        losses_json: Optional[str],  # noqa: UP045
    ) -> None:
        """Replace this process by ``nemo-lw-fp8 pretrain --cpu`` with the same run (the same
        code path; torchrun's rank environment is kept, so every rank does the same)."""
        command = [sys.executable, "-m", "nemo_lw_fp8.cli", "pretrain", "--recipe", recipe, "--cpu"]
        if config_file:
            command += ["--config-file", config_file]
        if losses_json:
            command += ["--losses-json", losses_json]
        command += list(overrides or ())
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, command)

    def _register(name: str) -> None:
        def factory() -> run.Partial:
            return run.Partial(pretrain, recipe=name)

        factory.__name__ = name
        factory.__qualname__ = name
        factory.__doc__ = recipes.RECIPES[name].__doc__
        run.cli.factory(target=pretrain, name=name)(factory)

    for _name in sorted(recipes.RECIPES):
        _register(_name)
