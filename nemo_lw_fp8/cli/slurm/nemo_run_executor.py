"""SLURM launch for ``nemo-lw-fp8 pretrain`` through nemo-run's ``SlurmExecutor``.

Why a module of its own: this path needs the optional nemo-run package (the ``bridge`` extra),
imported only when used, while the sbatch path (:mod:`nemo_lw_fp8.cli.slurm.sbatch`) needs nothing.
:func:`slurm_executor` + :func:`pretrain_script` build a nemo-run ``SlurmExecutor`` (torchrun
launcher) and ``run.Script`` with the same checks (:mod:`.slurm_settings`) and environment
(:mod:`.slurm_env`) as the sbatch script; :func:`submit_nemo_run` submits them or, with
``dryrun``, returns the sbatch text nemo-run would submit.
``nemo-lw-fp8 slurm RECIPE --executor nemo-run``. See docs/slurm.md.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from nemo_lw_fp8.cli.slurm.environment import resolve_env
from nemo_lw_fp8.cli.slurm.settings import (
    BRIDGE_INSTALL_HINT,
    CLI_MODULE,
    check_allocation,
    check_mounts,
    check_sbatch_values,
    pretrain_args,
)

__all__ = ["pretrain_script", "slurm_executor", "submit_nemo_run"]


def _import_nemo_run() -> Any:
    try:
        import nemo_run
    except ImportError as err:  # pragma: no cover - exercised only without the bridge extra
        raise ImportError(
            f"the nemo-run executor needs nemo-run; install it with {BRIDGE_INSTALL_HINT}"
        ) from err
    return nemo_run


def slurm_executor(
    *,
    nodes: int,
    gpus_per_node: int = 8,
    partition: str | None = None,
    account: str | None = None,
    time: str = "04:00:00",
    container_image: str | None = None,
    container_mounts: Sequence[str] = (),
    job_name: str | None = None,
    env: Mapping[str, str] | None = None,
    gpu_arch: str = "hopper",
    cpu: bool = False,
    tunnel: Any = None,
    packager: Any = None,
    recipe: str | None = None,
) -> Any:
    """A nemo-run ``SlurmExecutor`` with the torchrun launcher and the same environment
    (with ``recipe``: also what its TE layers need, ``te_env``).

    ``ntasks_per_node=gpus_per_node`` states one rank per GPU; nemo-run's torchrun launcher then
    submits one task per node whose torchrun starts that many ranks (it rewrites
    ``ntasks_per_node`` to 1 and ``torchrun_nproc_per_node`` to the GPU count). ``tunnel``: a
    ``run.SSHTunnel`` from a workstation; default a ``LocalTunnel`` (run on a login node).
    ``packager``: default ``run.Packager()``, i.e. ship no code: the container image must have
    nemo-lw-fp8 installed. Environment values are shell-quoted here because nemo-run writes them
    into its sbatch script as ``export NAME=VALUE`` verbatim.
    """
    run = _import_nemo_run()
    check_allocation(nodes, gpus_per_node, time)
    check_sbatch_values(
        ("--partition", partition), ("--account", account), ("--job-name", job_name)
    )
    mounts = check_mounts(container_mounts)
    env_vars = {var.name: shlex.quote(var.value) for var in resolve_env(gpu_arch, env, recipe, cpu)}
    kwargs: dict[str, Any] = dict(
        account=account,
        partition=partition,
        nodes=nodes,
        ntasks_per_node=gpus_per_node,
        time=time,
        exclusive=True,
        container_image=container_image,
        container_mounts=mounts,
        srun_args=["--no-container-mount-home"] if container_image else None,
        env_vars=env_vars,
        launcher="torchrun",
        packager=packager if packager is not None else run.Packager(),
        # nemo-run derives a prefix from the account unless one is set (and fails without one).
        job_name_prefix="nemo-lw-fp8-",
    )
    if not cpu:
        kwargs["gpus_per_node"] = gpus_per_node
    if tunnel is not None:
        kwargs["tunnel"] = tunnel
    executor = run.SlurmExecutor(**kwargs)
    if job_name is not None:
        executor.job_details.job_name = job_name
    return executor


def pretrain_script(
    recipe: str,
    *,
    config_file: str | None = None,
    overrides: Sequence[str] = (),
    cpu: bool = False,
) -> Any:
    """The ``run.Script`` both nemo-run paths execute: ``python -m nemo_lw_fp8.cli pretrain``."""
    run = _import_nemo_run()
    args = pretrain_args(recipe, config_file=config_file, overrides=overrides, cpu=cpu)
    return run.Script(path=CLI_MODULE, m=True, entrypoint="python", args=args)


def submit_nemo_run(
    recipe: str,
    *,
    dryrun: bool,
    config_file: str | None = None,
    overrides: Sequence[str] = (),
    cpu: bool = False,
    name: str | None = None,
    **executor_kwargs: Any,
) -> str | None:
    """Submit through nemo-run (detached), or with ``dryrun`` return the sbatch text it would.

    The dry run needs no cluster: nemo-run renders its files into a temporary experiment folder
    (deleted afterwards); the log paths in the text are where a real submission from this machine
    would put them (under ``NEMORUN_HOME``, default ``~/.nemo_run``).
    """
    run = _import_nemo_run()
    script = pretrain_script(recipe, config_file=config_file, overrides=overrides, cpu=cpu)
    executor = slurm_executor(cpu=cpu, recipe=recipe, **executor_kwargs)
    title = name or re.sub(r"[^A-Za-z0-9_-]", "_", recipe)
    if not dryrun:
        with run.Experiment(title, executor=executor) as exp:
            exp.add(script, name=title, tail_logs=False)
            exp.run(detach=True)
        return None
    # nemo-run's console writes progress to stdout; keep stdout for the script alone.
    with (
        contextlib.redirect_stdout(sys.stderr),
        tempfile.TemporaryDirectory(prefix="nemo-lw-fp8-dryrun-") as base,
        run.Experiment(title, executor=executor, base_dir=base, log_level="WARN") as exp,
    ):
        exp.add(script, name=title, tail_logs=False)
        exp.dryrun(log=False)
        infos = [getattr(job, "_dryrun_info", None) for job in exp.jobs]
        if any(info is None for info in infos):  # nemo-run changed: let it print instead
            exp.dryrun(log=True)
            return ""
    return "\n".join(str(info) for info in infos) + "\n"
