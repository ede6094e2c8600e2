"""Run Megatron-Bridge 0.6.2's own ``pretrain`` loop on CPU ranks (gloo).

Part of the CPU backend, like :mod:`nemo_lw_fp8.cpu.megatron.standins` (which it installs first):
used by ``nemo-lw-fp8 pretrain --cpu`` (and so ``make demo``) and the Bridge tests, never by a GPU
run. Each stand-in names the Bridge call site that needs it; Bridge's source is never edited and
everything can be undone with :func:`uninstall`.

``allow_no_cuda``
    ``training/setup.py::setup`` calls ``initialize_megatron(cfg)``, which asserts
    ``torch.cuda.is_available()`` unless ``allow_no_cuda=True``; setup never passes it.
``seed_on_cpu``
    ``initialize.py::_set_random_seed`` registers the model-parallel RNG states
    (``model_parallel_cuda_manual_seed``) only when ``torch.cuda.device_count() > 0``; without
    them ``GPTModel`` cannot fork its RNG. The device count reads 1 inside that call only (the
    ``cpu_rng`` stand-in then keeps the named states on the CPU generator).
``prebuilt_dataset_helpers``
    ``initialize_megatron`` runs ``compile_helpers()`` (``make`` in megatron's dataset folder);
    the megatron-core wheel ships the compiled ``helpers_cpp`` and no Makefile. Skipped when the
    compiled module imports (otherwise the original runs and fails loudly).
``emulated_recipe_support``
    megatron's ``TransformerBlock.forward`` enters TE's ``autocast``, which asks the GPU's
    compute capability whether FP8 (MXFP8, blockwise) is supported. With the emulation backend
    active (:mod:`nemo_lw_fp8.cpu.te.backend`) both are: the CPU layers quantize exactly.
``apex_wgrad`` (``--cpu-modules te`` only)
    Bridge turns ``gradient_accumulation_fusion`` on where TE imports; megatron's own
    ``ColumnParallelLinear`` (the output layer) then needs APEX's ``fused_weight_gradient_mlp_cuda``
    kernel, stood in by :mod:`nemo_lw_fp8.cpu.megatron.apex_wgrad`.
``gated_delta_rule`` (``--cpu-modules te``; the project path installs it when its own layers
build a Gated DeltaNet)
    megatron's Gated DeltaNet (Qwen3-Next, Qwen3.5) calls fla's Triton kernels, which take no
    CPU tensors, whichever spec builds it; the PyTorch references of
    :mod:`nemo_lw_fp8.cpu.megatron.gated_delta_rule` stand in
    (:mod:`nemo_lw_fp8.cpu.megatron.standins`).
``nvfp4_without_stochastic_rounding`` (``--cpu-modules te``)
    TE's NVFP4 stochastic rounding draws random bits on the GPU that the CPU cannot reproduce, so
    the emulation refuses it by name (docs/nvfp4.md). On a GPU the recipes keep TE's default (on);
    on CPU, and only here, the ``NVFP4BlockScaling`` megatron's ``fp4_utils.get_fp4_recipe`` builds
    gets ``disable_stochastic_rounding=True``, said once on stderr. An explicit
    ``NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=0`` is left as set: the emulation then refuses it.
``router_torch_gemm`` (``--cpu-modules project`` only)
    With TE importable, megatron's ``RouterGatingLinearFunction`` (``moe_utils.py``) runs the
    router GEMM through TE's cuBLAS ``general_gemm``; megatron's own fallback (``torch.mm``, taken
    when ``te_general_gemm`` is ``None``) is used instead. With TE's modules the router GEMM
    runs TE's ``general_gemm`` over the emulated ``generic_gemm``, as on the GPU.
``local_mtp_spec`` (``--cpu-modules project`` only)
    ``gpt_provider.mtp_block_spec`` builds multi-token-prediction layers with
    ``use_transformer_engine=True`` whatever the decoder uses; on CPU they take megatron's local
    backend (its ``get_gpt_mtp_block_spec(use_transformer_engine=False)``) like the decoder, with
    the decoder's zero-centred RMSNorm when the config asks for it.

Two model paths (``nemo-lw-fp8 pretrain --cpu --cpu-modules``): ``te`` (the default) keeps the
recipe's model exactly as on the GPU -- Bridge's provider, megatron's TE spec, TE 2.20.2's own
modules, the recipe's fusions -- with only ``transformer_engine_torch`` and TE's Triton
permutation launchers emulated and TE's device questions answered as the recipe's target GPU
(:func:`device_answers`); ``project`` swaps in the project's CPU layers (the earlier path, kept
as a named cross-check: docs/te-modules.md).

RNG states in checkpoints: ``checkpointing.py::get_rng_state`` / the loader's
``torch.cuda.get/set_rng_state`` act on the
``cpu_rng`` stand-in's CUDA generator stream (:data:`nemo_lw_fp8.cpu.megatron.standins.DEVICE_RNG`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nemo_lw_fp8.vocabulary import NVFP4_NO_SR_ENV

__all__ = ["install", "installed", "uninstall"]

_undo: list[Callable[[], None]] = []


def _swap(owner: Any, name: str, value: Any) -> None:
    from nemo_lw_fp8.cpu.megatron.swap import swap_attrs

    _undo.append(swap_attrs(owner, {name: value}))


@contextlib.contextmanager
def _one_visible_device() -> Iterator[None]:
    original = torch.cuda.device_count
    torch.cuda.device_count = lambda: 1
    try:
        yield
    finally:
        torch.cuda.device_count = original


def installed() -> bool:
    return bool(_undo)


def install(modules: str = "te") -> None:
    """Install megatron-core's CPU stand-ins, then Bridge's (idempotent per process)."""
    if _undo:
        return
    from nemo_lw_fp8.cpu.megatron import standins

    standins.install()
    _undo.append(standins.uninstall_all)

    # megatron's jit_fuser is torch.compile: on CPU, inductor compiles C++ for each fused
    # function at its first call (20-60 s per process for the Gated-DeltaNet layers) to save
    # microseconds on tiny shapes. Eager here; ON and OFF runs alike.
    import torch._dynamo

    previous_disable = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    _undo.append(lambda: setattr(torch._dynamo.config, "disable", previous_disable))

    from megatron.bridge.training import initialize as bridge_initialize
    from megatron.bridge.training import setup as bridge_setup

    _swap(
        bridge_setup,
        "initialize_megatron",
        functools.partial(bridge_initialize.initialize_megatron, allow_no_cuda=True),
    )

    original_seed = bridge_initialize._set_random_seed

    @functools.wraps(original_seed)
    def seed_on_cpu(*args: Any, **kwargs: Any) -> None:
        with _one_visible_device():
            original_seed(*args, **kwargs)

    _swap(bridge_initialize, "_set_random_seed", seed_on_cpu)

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401

        _swap(bridge_initialize, "compile_helpers", lambda: None)
    except ImportError:
        pass

    from nemo_lw_fp8.cpu.te import backend as te_backend

    if te_backend.is_emulated():
        from transformer_engine.pytorch import quantization

        checks = ("check_fp8_support", "check_mxfp8_support", "check_fp8_block_scaling_support")
        for check in checks:
            _swap(quantization, check, lambda: (True, ""))

    if modules == "te":
        from nemo_lw_fp8.cpu.megatron import apex_wgrad

        # Gated DeltaNet (Qwen3-Next, Qwen3.5) calls fla's Triton kernels from megatron's own
        # module whichever spec builds it; TE's spec changes the linears and norms around them.
        standins.install(("gated_delta_rule",))

        if apex_wgrad.install():
            _undo.append(apex_wgrad.uninstall)
        _install_nvfp4_without_stochastic_rounding()
        return
    from megatron.core.models.gpt import gpt_layer_specs

    original_mtp_spec = gpt_layer_specs.get_gpt_mtp_block_spec

    def local_mtp_spec(config: Any, spec: Any, use_transformer_engine: bool, **kwargs: Any) -> Any:
        from nemo_lw_fp8.cpu.layers.specs import swap_norms

        mtp = original_mtp_spec(config, spec, use_transformer_engine=False, **kwargs)
        return None if mtp is None else swap_norms(mtp, config)

    _swap(gpt_layer_specs, "get_gpt_mtp_block_spec", local_mtp_spec)

    from megatron.core.transformer.moe import moe_utils

    _swap(moe_utils, "te_general_gemm", None)


def _install_nvfp4_without_stochastic_rounding() -> None:
    """``nvfp4_without_stochastic_rounding`` (module docstring)."""
    import dataclasses
    import os
    import sys

    from megatron.core import fp4_utils

    original = fp4_utils.get_fp4_recipe
    said: list[bool] = []

    @functools.wraps(original)
    def nvfp4_without_stochastic_rounding(config: Any) -> Any:
        recipe = original(config)
        explicit_on = os.environ.get(NVFP4_NO_SR_ENV) == "0"
        if (
            type(recipe).__name__ == "NVFP4BlockScaling"
            and not recipe.disable_stochastic_rounding
            and not explicit_on
        ):
            recipe = dataclasses.replace(recipe, disable_stochastic_rounding=True)
            first_rank = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
            if not said and first_rank:
                said.append(True)
                sys.stderr.write(
                    "nemo_lw_fp8 --cpu: TE's NVFP4 stochastic rounding is off on CPU (its random "
                    "bits cannot be reproduced here); GPUs keep TE's default\n"
                )
        return recipe

    _swap(fp4_utils, "get_fp4_recipe", nvfp4_without_stochastic_rounding)


def uninstall() -> None:
    while _undo:
        _undo.pop()()


def device_answers(cfg: Any, modules: str = "te") -> contextlib.AbstractContextManager:
    """The scope in which TE's device questions get the recipe's target GPU's answers
    (:func:`nemo_lw_fp8.cpu.te.device.target_gpu`): SM 10.0 for MXFP8 and bf16 recipes, SM 9.0
    for blockwise FP8. Nothing to answer on the project's layers."""
    if modules != "te":
        return contextlib.nullcontext()
    from nemo_lw_fp8.cpu.te import device as te_device

    recipe = getattr(cfg.mixed_precision, "fp8_recipe", None) if cfg.mixed_precision else None
    fp8 = getattr(cfg.mixed_precision, "fp8", None) if cfg.mixed_precision else None
    target = te_device.HOPPER if fp8 and recipe == "blockwise" else te_device.BLACKWELL
    return te_device.target_gpu(target)


def adapt_config(cfg: Any, modules: str = "te") -> Any:
    """Make a Bridge ``ConfigContainer`` run on CPU ranks, keeping its features.

    gloo instead of NCCL. ``modules="te"``: nothing else changes -- the model is built as on the
    GPU (Bridge's provider, megatron's TE spec, the recipe's fusions). ``modules="project"``:
    megatron's local layers with the emulated FP8 linears and single grouped experts of
    :mod:`nemo_lw_fp8.cpu.layers.specs` when the config asks for FP8 / single grouped weights
    (decided when the model is built, after every override), the CUDA-only fusions off.
    Pipeline (and virtual pipeline) and expert parallel run as configured; tensor parallel too
    with TE's modules (their TP paths and megatron's TP communication on gloo), 1 only with the
    project's layers.
    """
    model = cfg.model
    if modules not in ("te", "project"):
        raise ValueError(f"--cpu-modules {modules!r}: one of te, project")
    if modules == "project" and model.tensor_model_parallel_size != 1:
        raise ValueError(
            "--cpu-modules project runs tensor_model_parallel_size=1 only (the project's CPU "
            "layers are not tensor parallel); got model.tensor_model_parallel_size="
            f"{model.tensor_model_parallel_size}. Fix: --cpu-modules te (TE's own modules, "
            "tensor parallel over gloo) or model.tensor_model_parallel_size=1."
        )
    cfg.dist.distributed_backend = "gloo"
    if modules == "te":
        return cfg
    from nemo_lw_fp8.cpu.layers.specs import cpu_decoder_block_spec

    def cpu_spec(config: Any, vp_stage: int | None = None) -> Any:
        return cpu_decoder_block_spec(
            config,
            fp8=config.fp8 is not None,
            fp8_recipe=getattr(config, "fp8_recipe", "mxfp8"),
            single_grouped_experts=bool(getattr(config, "moe_single_grouped_weight", False)),
            vp_stage=vp_stage,
        )

    model.transformer_layer_spec = cpu_spec
    model.transformer_impl = "local"
    for fusion in (
        "gradient_accumulation_fusion",
        "bias_activation_fusion",
        "masked_softmax_fusion",
        "persist_layer_norm",
        "apply_rope_fusion",
        "bias_dropout_fusion",
        "moe_permute_fusion",
        "cross_entropy_loss_fusion",
        "moe_router_fusion",
    ):
        if hasattr(model, fusion):
            setattr(model, fusion, False)
    model.attention_backend = None
    return cfg
