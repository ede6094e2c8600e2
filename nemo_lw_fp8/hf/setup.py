"""What a Hugging Face conversion needs around it, on a GPU and on CPU.

Why: Megatron-Bridge's conversion builds a megatron model from TE's spec and asks megatron's
parallel state for its groups, so it needs Transformer Engine importable and a process group
even for one process. On a GPU machine that is real TE and a one-rank gloo group (the
conversion's tensors are built on the CPU, as Bridge's ``export_ckpt`` builds them). On CPU it is
the plugin's CPU set-up, as ``nemo-lw-fp8 pretrain --cpu`` does it: TE's Python over the
emulated kernels (:func:`nemo_lw_fp8.cpu.te.backend.activate`; without it Bridge fails with
``No module named 'transformer_engine'``), megatron's CPU stand-ins
(:mod:`nemo_lw_fp8.cpu.megatron.bridge_pretrain`), a one-rank gloo group (without one, megatron
asks the CUDA driver: ``Found no NVIDIA driver``) and TE's device questions answered as a
Blackwell GPU would.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

#: TE reads it when a grouped linear is built: set, the experts become ONE grouped weight,
#: which Bridge's expert mappings do not address. Cleared while a conversion model is built.
SINGLE_PARAM_ENV = "NVTE_GROUPED_LINEAR_SINGLE_PARAM"


def on_cpu() -> bool:
    """No CUDA device here: the conversion runs over the CPU emulation of TE's kernels."""
    import torch

    return not torch.cuda.is_available()


def boot() -> None:
    """Make TE importable before megatron is (real TE on a GPU, its emulation on CPU)."""
    from nemo_lw_fp8.cpu.te import backend as te_backend

    te_backend.activate()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """A one-rank gloo process group and megatron's parallel state (model-parallel sizes 1), the
    RNG states megatron's layers fork, and on CPU the stand-ins and device answers; all undone
    on exit. Inside an existing process group nothing is created."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    boot()
    cpu = on_cpu()
    created = not dist.is_initialized()
    saved_env = os.environ.pop(SINGLE_PARAM_ENV, None)
    with contextlib.ExitStack() as stack:
        if cpu:
            from nemo_lw_fp8.cpu.megatron import bridge_pretrain as cpu_bridge
            from nemo_lw_fp8.cpu.te import device as te_device

            fresh = not cpu_bridge.installed()
            cpu_bridge.install("te")
            if fresh:
                stack.callback(cpu_bridge.uninstall)
            stack.enter_context(te_device.target_gpu(te_device.BLACKWELL))
        if created:
            # gloo on a GPU too (as Bridge's export_ckpt): the conversion's tensors live on
            # the CPU (``use_cpu_initialization``), where NCCL moves nothing.
            dist.init_process_group(
                backend="gloo",
                init_method=f"tcp://127.0.0.1:{_free_port()}",
                world_size=1,
                rank=0,
            )
            stack.callback(dist.destroy_process_group)
            parallel_state.initialize_model_parallel()
            stack.callback(parallel_state.destroy_model_parallel)
        if cpu:
            original = torch.cuda.device_count
            torch.cuda.device_count = lambda: 1  # megatron registers its RNG states only then
            try:
                model_parallel_cuda_manual_seed(0)
            finally:
                torch.cuda.device_count = original
        else:
            torch.cuda.set_device(0)
            model_parallel_cuda_manual_seed(0)
        try:
            yield
        finally:
            if saved_env is not None:
                os.environ[SINGLE_PARAM_ENV] = saved_env


def conversion_provider(provider: object) -> object:
    """``provider`` (a recipe's or a run's model provider) as Bridge converts it: one process,
    bf16 weights, discrete expert weights, TE's op fuser off, no FP8 / FP4 parameters.

    Why: Bridge's expert mappings address one weight per expert (``weight0`` ...), and
    megatron-core 0.19.2 builds single grouped weights only through the op fuser, whose
    ``Fused GroupedMLP`` Bridge cannot rebuild. The checkpoint layout is the same either way
    (:mod:`nemo_lw_fp8.mechanics.grouped_checkpoint` writes single grouped weights per expert),
    so neither the checkpoint's keys nor the weights' values depend on it."""
    import torch

    settings = {
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": None,
        "pipeline_model_parallel_layout": None,
        "expert_model_parallel_size": 1,
        "expert_tensor_parallel_size": 1,
        "context_parallel_size": 1,
        "sequence_parallel": False,
        "pipeline_dtype": None,
        "moe_single_grouped_weight": False,
        "use_transformer_engine_op_fuser": False,
        "fp8": None,
        "fp8_param": False,
        "fp4": None,
        "fp4_param": False,
        "bf16": True,
        "params_dtype": torch.bfloat16,
        "gradient_accumulation_fusion": False,
        "account_for_embedding_in_pipeline_split": False,
        "account_for_loss_in_pipeline_split": False,
        "num_layers_in_first_pipeline_stage": None,
        "num_layers_in_last_pipeline_stage": None,
    }
    for name, value in settings.items():
        if hasattr(provider, name):
            setattr(provider, name, value)
    return provider
