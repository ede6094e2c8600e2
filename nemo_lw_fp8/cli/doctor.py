"""``nemo-lw-fp8 doctor``: what is installed, which FP8 backend is in use, what each patch does.

The patch table has one row per patch (megatron-core, Megatron-Bridge and the plugin's own), and
its status is the verdict ``nemo_lw_fp8.apply()`` acts on, from the same function
(:func:`nemo_lw_fp8.patches.verdict.decide`; tests assert the two equal):

``patched``   the record has this exact code and the patch applies (or is applied);
``native``    the record says this exact upstream code already does it: nothing is installed;
``refused``   the installed version, or an object the patch wraps, is not one it was tested on
              (named); ``apply()`` raises the same one line;
``pending``   a Megatron-Bridge patch where Bridge cannot be imported in this process.

Under ``NEMO_LW_FP8_ALLOW_UNTESTED_MEGATRON=1`` a refused patch reads ``patched``, with the
changed objects named. The upstream table then names each tracked Megatron-LM change with the
state of its patch, and notes where upstream landed part of it (``native (extendable)``: for
DistributedOptimizer; the plugin extends it to the layer-wise optimizer).

To fingerprint what ``apply()`` would wrap, ``doctor`` imports megatron-core and, when it is
installed, Megatron-Bridge's config module (over the CPU emulation of TE where TE has no GPU):
some 15 s on a shared 2-core box. The report also names every package whose version differs
from the environment the suite passed in (:mod:`nemo_lw_fp8.cli.tested_env`). Third-party
warnings printed meanwhile are held back (:mod:`nemo_lw_fp8.cli.quiet`): one summary line,
``--verbose`` prints them.
"""

from __future__ import annotations

import json
import platform
import sys
from dataclasses import asdict, dataclass

PACKAGES = (
    ("torch", "torch"),
    ("megatron-core", "megatron-core"),
    ("transformer-engine", "transformer-engine"),
    ("megatron-bridge", "megatron-bridge"),
    ("nemo-run", "nemo-run"),
    ("emerging-optimizers", "emerging-optimizers"),
)


@dataclass
class ChangeStatus:
    pr: int
    title: str
    status: str
    reason: str


def accelerator() -> dict[str, object]:
    import torch

    if not torch.cuda.is_available():
        return {"kind": "cpu", "name": platform.processor() or platform.machine()}
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return {
        "kind": "cuda",
        "name": torch.cuda.get_device_name(index),
        "compute_capability": f"{major}.{minor}",
        "mxfp8_kernels": major == 10,
    }


def fp8_backend() -> dict[str, str]:
    """Which FP8 implementation this process would use, without importing TE."""
    import torch

    from nemo_lw_fp8.cpu.te import backend as te_backend

    active = te_backend.active_backend()
    if active is not None:
        return {"backend": active, "reason": "activated in this process"}
    dirs = te_backend.te_package_dirs()
    if dirs is None:
        return {"backend": "none", "reason": "Transformer Engine's Python package is not installed"}
    where = dirs[0] if dirs else "site-packages"
    if torch.cuda.is_available() and not dirs:
        return {"backend": "transformer_engine", "reason": "Transformer Engine with a CUDA device"}
    return {
        "backend": "emulated (on activation)",
        "reason": f"no usable TE kernels here; TE {te_backend.pinned_te_version}'s classes in "
        f"{where} run over the exact MXFP8 emulation",
    }


def _import_stack() -> str:
    """Import what ``apply()`` would patch: megatron-core, and Bridge's config module when
    Bridge is installed (its patches then get a verdict, not ``pending``). Returns why Bridge
    was not imported ("" if it was)."""
    import importlib.util

    if importlib.util.find_spec("megatron.bridge") is None:
        return "Megatron-Bridge is not installed"
    from nemo_lw_fp8.cpu.te import backend as te_backend

    try:
        te_backend.activate()
        import megatron.bridge.training.config  # noqa: F401
    except Exception as error:  # noqa: BLE001 - the reason is the finding
        return f"Megatron-Bridge did not import: {type(error).__name__}: {error}"
    return ""


#: Why a Bridge patch reads ``pending`` when the caller did not ask for Bridge's import.
BRIDGE_NOT_ASKED = "Megatron-Bridge not imported in this process (the doctor command imports it)"


def patch_verdicts(import_bridge: bool = False) -> list[dict[str, object]]:
    """One row per patch: the verdict ``apply()`` acts on here (the same function decides).

    ``import_bridge``: first import Bridge's config module (activating the CPU emulation of TE
    where TE has no GPU), as the ``doctor`` command does in its own process, so Bridge patches
    get their verdict; a library caller's process is left as it was unless it asks.
    """
    from nemo_lw_fp8 import patches
    from nemo_lw_fp8.patches import framework

    bridge_missing = _import_stack() if import_bridge else BRIDGE_NOT_ASKED
    patches.load_all()
    rows = []
    for name, verdict in framework.verdicts().items():
        patch = framework.registry()[name]
        reason = verdict.reason
        if verdict.status == "pending" and bridge_missing:
            reason = str(bridge_missing)
        rows.append(
            {
                "patch": name,
                "target": patch.target,
                "status": verdict.status,
                "reason": reason,
                "changed": list(verdict.changed),
                "upstream_pr": patch.upstream_pr,
            }
        )
    return rows


def upstream_status(verdicts: list[dict[str, object]] | None = None) -> list[ChangeStatus]:
    """One row per tracked megatron-core change: its patch's verdict (``patch_verdicts``), or
    for a change the plugin needs no patch for, whether megatron-core has it."""
    from nemo_lw_fp8.patches.upstream import megatron_core_changes

    by_patch = {row["patch"]: row for row in verdicts or patch_verdicts()}
    rows = []
    for pr, (title, detect, patch) in megatron_core_changes().items():
        part = None
        if detect is not None:
            try:
                part = detect()
            except Exception as exc:  # noqa: BLE001 - a detector failure is itself a finding
                rows.append(ChangeStatus(pr, title, "unavailable", f"detector failed: {exc}"))
                continue
        if patch is None:
            native, reason = part
            status = "native" if native else "unavailable"
            if not native:
                reason = f"{reason}; the plugin has no patch for it"
            rows.append(ChangeStatus(pr, title, status, reason))
            continue
        verdict = by_patch[patch.name]
        status, reason = str(verdict["status"]), str(verdict["reason"])
        if status == "patched" and not patch.applied:
            status = "patchable"
        if part is not None and part[0] and status in ("patched", "patchable"):
            # Upstream has the change for some optimizers; the plugin extends it further.
            status = "native (extended)" if patch.applied else "native (extendable)"
            reason = f"{part[1]}; layer-wise extension: {patch.summary}"
        rows.append(ChangeStatus(pr, title, status, reason))
    return rows


def expert_paths() -> dict[str, object]:
    """Which expert implementation the recipes' MoE layers take on which GPU (TE's CuTe-DSL
    fused grouped MLP or the op fuser's unfused ops; :mod:`nemo_lw_fp8.recipes.te_env`), and on
    this machine with its environment."""
    import os

    from nemo_lw_fp8.recipes import te_env

    capability, frontend = te_env.this_machine()
    rows = []
    for variant, recipe in (("mxfp8", "deepseek_v3_mxfp8"), ("hopper", "deepseek_v3_hopper")):
        for gpu, path in te_env.recipe_paths(recipe):
            rows.append({"recipes": f"*_{variant}", "gpu": gpu, "path": path})
        # The launchers export what the recipe needs unless the environment says otherwise.
        env_set = not te_env.contradictions(te_env.for_recipe(recipe), os.environ)
        here = te_env.expert_path(te_env.recipe_model(recipe), capability, frontend, env_set)
        rows.append({"recipes": f"*_{variant}", "gpu": "this machine (launched)", "path": here})
    return {
        "compute_capability": None if capability is None else "{}.{}".format(*capability),
        "cudnn_frontend": frontend,
        "environment": {
            name: os.environ.get(name)
            for name in (te_env.CUTEDSL_ENV, te_env.SINGLE_GROUPED_WEIGHT_ENV)
        },
        "rows": rows,
    }


def nvfp4_support(accelerator_report: dict[str, object]) -> dict[str, object]:
    """What NVFP4 can do here: TE's kernels on a Blackwell GPU, else the CPU emulation's share
    of TE's NVFP4 (docs/nvfp4.md), and where layer-wise Muon stands with it."""
    from nemo_lw_fp8.cpu.te.tex import cast_nvfp4 as te_extension_nvfp4

    capability = accelerator_report.get("compute_capability")
    return {
        # TE's NVFP4 kernels need SM 10.0 or newer (Blackwell).
        "gpu_kernels": capability is not None and int(str(capability).split(".")[0]) >= 10,
        "cpu_emulation": list(te_extension_nvfp4.EMULATED),
        "refused_on_cpu": list(te_extension_nvfp4.REFUSED),
        "layer_wise_muon": "NVFP4 compute with bf16 weights trains (TE-spec GPT, experts as "
        "SequentialMLP or TEGroupedMLP with discrete weights, stochastic "
        "rounding off on CPU only); bf16 single grouped NVFP4 expert weights refused (rule "
        "grouped-weight-nvfp4-layer-wise), FP4 primary ones train; NVFP4 primary "
        "weights (fp4_param + "
        "fp4_param_gather) train with FP4 bytes on the data-parallel wire (owner-quantized codes "
        "+ 16x16 tile scales + amax, about 0.25x of bf16), bitwise like bf16 weights, at TP 1 on "
        "the padded or compact layout; the rest refused (rule fp4-primary-weights-layer-wise); "
        "NVFP4 recipes: deepseek_v3_nvfp4, qwen3_235b_a22b_nvfp4 (discrete experts, "
        "TE's stochastic rounding on GPUs, off on CPU; docs/nvfp4.md, NVFP4 recipes)",
    }


def collect(import_bridge: bool = False) -> dict[str, object]:
    """The report (``import_bridge``: see :func:`patch_verdicts`; the command passes True)."""
    from nemo_lw_fp8.cli import tested_env

    installed = tested_env.installed_versions()
    versions = {"python": platform.python_version()}
    # Looked up by normalized name, so TE's package in <venv>/te-emulation counts as installed.
    versions.update({label: installed.get(tested_env.normalize(dist)) for label, dist in PACKAGES})
    device = accelerator()
    verdicts = patch_verdicts(import_bridge)
    return {
        "versions": versions,
        "drift": [asdict(row) for row in tested_env.drift(installed=installed)],
        "accelerator": device,
        "nvfp4": nvfp4_support(device),
        "fp8_backend": fp8_backend(),
        "patches": verdicts,
        "upstream": [asdict(row) for row in upstream_status(verdicts)],
        "expert_path": expert_paths(),
    }


def render(report: dict[str, object]) -> str:
    lines = ["nemo_lw_fp8 doctor", ""]
    lines.append("versions:")
    for name, value in report["versions"].items():
        lines.append(f"  {name:<20} {value or 'not installed'}")
    drift = report.get("drift")
    if drift is not None:
        lines.append("")
        if not drift:
            lines.append("tested environment:    no drift (every package at its recorded version)")
        else:
            lines.append(
                f"tested environment:    {len(drift)} package(s) differ from "
                "nemo_lw_fp8/tested-constraints.txt (docs/install.md):"
            )
            for row in drift:
                lines.append(
                    f"  {row['package']:<28} tested {row['tested']:<14} "
                    f"installed {row['installed'] or 'none'}"
                )
    acc = report["accelerator"]
    lines.append("")
    detail = ", ".join(f"{k}={v}" for k, v in acc.items() if k != "kind")
    lines.append(f"accelerator:           {acc['kind']} ({detail})")
    backend = report["fp8_backend"]
    lines.append(f"fp8 backend:           {backend['backend']} - {backend['reason']}")
    fp4 = report.get("nvfp4")
    if fp4:
        lines.append("")
        lines.append("nvfp4 (docs/nvfp4.md):")
        here = "yes" if fp4["gpu_kernels"] else "no (needs SM 10.0+)"
        lines.append(f"  TE's GPU kernels here: {here}")
        lines += [f"  emulated on CPU:       {item}" for item in fp4["cpu_emulation"]]
        lines += [f"  refused on CPU:        {item}" for item in fp4["refused_on_cpu"]]
        lines.append(f"  layer-wise Muon:       {fp4['layer_wise_muon']}")
    lines.append("")
    lines.append("patches (the verdict apply() acts on here; docs/install.md, supported lines):")
    for row in report["patches"]:
        lines.append(f"  {row['patch']:<28} {row['status']:<9} {row['target']:<16} {row['reason']}")
    lines.append("")
    lines.append(f"{'change':<7} {'status':<20} {'what':<52} reason")
    for row in report["upstream"]:
        lines.append(f"#{row['pr']:<6} {row['status']:<20} {row['title']:<52} {row['reason']}")
    paths = report.get("expert_path")
    if paths:
        env = ", ".join(
            f"{k}={v if v is not None else 'unset'}" for k, v in paths["environment"].items()
        )
        lines += ["", "expert path (the recipes' MoE layers; docs/recipes.md, Launch environment):"]
        lines.append(
            f"  here: compute capability {paths['compute_capability'] or 'none (no GPU)'}, "
            f"nvidia-cudnn-frontend {paths['cudnn_frontend'] or 'not installed'}, {env}"
        )
        for row in paths["rows"]:
            lines.append(f"  {row['recipes']:<9} {row['gpu']:<38} {row['path']}")
    return "\n".join(lines)


def main(as_json: bool = False, verbose: bool = False) -> int:
    """Print the report; third-party warnings as one line (``verbose``: every one)."""
    from nemo_lw_fp8.cli.quiet import held_back

    with held_back() as held:
        report = collect(import_bridge=True)
    if as_json:
        report["hidden_warnings"] = held.messages
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
        return 0
    lines = [render(report)]
    if held.messages:
        lines.append("")
        lines += held.messages if verbose else [held.summary()]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
