"""CPU stand-ins that let real megatron-core 0.19.2 distributed code run without a GPU.

megatron-core's DDP buffers and optimizers are written for CUDA. None of their *logic* needs a GPU,
but a handful of call sites touch the CUDA runtime directly. Each stand-in below exists because of
a named call site (see ``docs/testing.md``); nothing else is changed, and megatron's source is never
edited. Part of the CPU backend (:mod:`nemo_lw_fp8.cpu`): installed by the rank workers of the
tests and by ``nemo-lw-fp8 pretrain --cpu``, never by a GPU run.

Stand-ins (each can be installed and removed on its own):

``cuda_runtime``
    ``torch.cuda.current_device`` (returns the CPU device) / ``Stream`` / ``current_stream`` /
    ``stream`` / ``Event`` / ``synchronize`` / ``empty_cache``. Call sites:
    ``_ParamAndGradBuffer.__init__`` (``device=torch.cuda.current_device()``, also inside autograd
    backward: MoE's ``_gather_along_first_dim``), ``DistributedDataParallel.__init__``
    (communication stream), ``_ParamAndGradBucketGroup.start_grad_sync`` / ``finish_grad_sync``
    (stream waits), ``free_overlap_buffers`` (synchronize / empty_cache).
``cuda_device``
    A ``TorchFunctionMode`` that maps every CUDA device argument (``device='cuda'``, ``device=0``,
    ``.cuda()``, ``.to('cuda')``) to the CPU and reports CUDA type strings from ``Tensor.type()``.
    Call sites: ``MixedPrecisionOptimizer.__init__`` (``torch.tensor(..., device='cuda')``),
    ``clip_grads`` (``device='cuda'``), ``Float16OptimizerWithFloat16Params.__init__`` and
    ``DistributedOptimizer`` (``param.type() == 'torch.cuda.BFloat16Tensor'``).
``uneven_all_gather``
    gloo's ``all_gather`` refuses tensors of unequal sizes (NCCL accepts them). Falls back to one
    broadcast per source rank. Call sites: ``LayerWiseDistributedOptimizer.allgather_params``
    (legacy layer-wise path) and ``_ParamAndGradBucketGroup.start_param_sync`` (its layer-wise
    branch, #3524).
``gloo_coalescing``
    TE's quantized all-gathers over the tensor-parallel group (sequence parallelism: MXFP8 /
    blockwise / NVFP4 data and scales gathered together) open
    ``torch.distributed._coalescing_manager(group, device=..., async_ops=...)``; with a device,
    torch starts the backend's own coalescing (``_start_coalescing``), which gloo does not
    implement. On a gloo group the stand-in drops the device, so torch records the gathers and
    issues them as one coalesced all-gather (its other path, which gloo implements): the same
    collectives, the same bytes. Call sites: ``_all_gather_mxfp8``,
    ``_start_all_gather_fp8_blockwise``, ``_all_gather_nvfp4`` (TE ``pytorch/distributed.py``).
``cpu_rng``
    ``CudaRNGStatesTracker.add`` / ``fork`` keep named CUDA generator states; on CPU they keep and
    swap states of the CPU generator instead. The CUDA default generator is a stream of its own
    (:data:`DEVICE_RNG`), swapped into the CPU generator while ``GPTModel.forward`` runs, and
    ``torch.cuda.manual_seed(_all)`` / ``get_rng_state`` / ``set_rng_state`` act on it: as on a
    GPU, host draws (a ``DataLoader`` making an iterator draws its base seed) leave the model's
    dropout masks alone, and a checkpoint saves and restores the two generators apart. Call
    sites: ``GPTModel`` forward (dropout, and under ``get_cuda_rng_tracker().fork()``) and init,
    ``model_parallel_cuda_manual_seed``, Megatron-Bridge's ``get_rng_state`` and its RNG restore
    at load (``torch.cuda.get_rng_state`` / ``set_rng_state``).
``checkpoint_dequantize``
    ``FileSystemWriterAsync.prepare_write_data`` (megatron's ``torch_dist`` writer) dequantizes
    a quantized tensor (its class defines ``dequantize``, e.g. TE's ``MXFP8Tensor``) before
    writing only when it lives on a CUDA device; on CPU the TE object itself was pickled into
    the checkpoint. The stand-in applies that same rule to CPU tensors, so a CPU checkpoint holds
    what a GPU one holds (the dequantized values). Call site: its
    ``_clone_or_dequantize_if_needed`` (through the planner's ``resolve_data``).
``cpu_fused_adam``
    With Transformer Engine importable (the MXFP8 emulation pools) megatron picks TE's
    ``FusedAdam``, whose step is a CUDA kernel; without TE it falls back to torch's ``AdamW``,
    whose state layout (a per-parameter ``step``) is not the one megatron's checkpoint code is
    written for. Either way megatron gets :class:`nemo_lw_fp8.cpu.megatron.fused_adam.CPUFusedAdam`
    (FusedAdam's state layout and update rule on CPU), and ``distrib_optimizer``'s own flags say
    a TE optimizer is in use, as on a GPU. Call sites:
    ``_get_megatron_optimizer_based_on_param_groups`` (``Adam``, ``USING_PYTORCH_OPTIMIZER``),
    ``DistributedOptimizer.__init__`` / ``state_dict`` / ``load_state_dict`` (``Adam``,
    ``HAVE_APEX_OR_TE``, ``USING_TE_OPTIMIZER``: where ``step`` lives) and its
    ``dp_reshardable`` / ``fully_reshardable`` checkpoint formats.
``moe_split_sizes``
    The all-to-all token dispatcher moves its split sizes to the host before the expert-parallel
    all-to-all (``moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)``); on a GPU that turns
    a CUDA tensor into a numpy array, which ``all_to_all_single`` takes as a list of sizes. On CPU
    the tensor is already on the host and stays a tensor, which gloo's binding refuses. The
    stand-in hands numpy arrays as the GPU path does. Call site:
    ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` (expert parallel > 1).
``gated_delta_rule`` (on demand: installed by ``cpu.layers.cpu_decoder_block_spec`` when it
    builds Gated DeltaNet layers; importing fla costs seconds)
    megatron's ``GatedDeltaNet`` calls fla's Triton kernels ``causal_conv1d``, ``l2norm`` and
    ``chunk_gated_delta_rule``, which do not run on CPU tensors (and refuses to build when fla
    is missing: ``HAVE_FLA``). The PyTorch references of
    :mod:`nemo_lw_fp8.cpu.megatron.gated_delta_rule` take their place; CUDA inputs still go to fla.
    Call sites: ``GatedDeltaNet.forward`` and
    ``_setup_variant_attrs`` (``gdn.py``), ``_GDNBase._prepare_input_for_gated_delta_rule``
    and ``__init__`` (``common.py``).
``local_norm_linear``
    megatron's local backend has no fused norm + linear (its
    ``LocalSpecProvider.column_parallel_layer_norm_linear`` returns ``None``; TE's backend
    returns ``LayerNormColumnParallelLinear``). MLA with ``qk_layernorm`` and no q LoRA
    (DeepSeek-V2-Lite) can only be built with the fused form. The stand-in returns
    :class:`nemo_lw_fp8.cpu.layers.norm_linear.CPULayerNormColumnParallelLinear` (the config's norm,
    then the CPU linear), and megatron's own ``None`` in a process where the real TE is loaded.
    Call site: ``QKNormConfigResolver.__init__`` (``fused_norm_linear_impl``, in
    ``megatron/core/transformer/mla_qk_norm_config.py``), which ``MLASelfAttention`` uses for
    ``linear_q_proj`` / ``linear_q_up_proj`` / ``linear_kv_up_proj``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from nemo_lw_fp8.cpu.megatron import cuda_runtime
from nemo_lw_fp8.cpu.megatron.swap import swap_attrs


@dataclass
class StandIn:
    """One named stand-in: how to install it, how to undo it, and why it exists."""

    name: str
    call_sites: str
    install_fn: Callable[[], Callable[[], None]]
    #: installed only when asked for by name (its imports are costly and few runs need it)
    on_demand: bool = False
    _undo: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def installed(self) -> bool:
        return self._undo is not None

    def install(self) -> None:
        if self._undo is None:
            self._undo = self.install_fn()

    def uninstall(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None


# --------------------------------------------------------------------------- uneven_all_gather


class _DoneWork:
    """A finished async collective: the fallback already completed synchronously."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _install_uneven_all_gather() -> Callable[[], None]:
    original = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):  # noqa: ANN001
        sizes = {t.numel() for t in tensor_list} | {tensor.numel()}
        if len(sizes) == 1:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        my_rank = dist.get_rank(group)
        for src, out in enumerate(tensor_list):
            if src == my_rank and out.data_ptr() != tensor.data_ptr():
                out.copy_(tensor)
            global_src = dist.get_global_rank(group, src) if group is not None else src
            dist.broadcast(out, global_src, group=group)
        return _DoneWork() if async_op else None

    return swap_attrs(dist, {"all_gather": all_gather})


# --------------------------------------------------------------------------- gloo_coalescing


def _install_gloo_coalescing() -> Callable[[], None]:
    original = dist._coalescing_manager

    @functools.wraps(original)
    def coalescing_manager(group=None, device=None, async_ops=False):  # noqa: ANN001
        if device is not None and dist.get_backend(group) == "gloo":
            device = None  # gloo has no _start_coalescing; torch then coalesces the ops itself
        return original(group=group, device=device, async_ops=async_ops)

    return swap_attrs(dist, {"_coalescing_manager": coalescing_manager})


# --------------------------------------------------------------------------- cpu_rng


class _DeviceStream:
    """The CUDA default generator's stream on a CPU rank.

    On a GPU the model's random draws (dropout outside the tracker's forks) come from the CUDA
    generator, and everything else on the host (a ``DataLoader`` drawing its base seed when an
    iterator is made, ...) from the CPU generator; a checkpoint saves and restores the two apart.
    On CPU both would be the one CPU generator, so a resumed process that makes its data
    iterators after the load (Bridge's ``setup``) shifted the dropout masks. The model's forward
    therefore runs with this stream swapped into the CPU generator, and ``torch.cuda``'s
    ``manual_seed`` / ``get_rng_state`` / ``set_rng_state`` act on it.
    """

    def __init__(self) -> None:
        self.state = torch.Generator().get_state()
        self.depth = 0

    def seed(self, seed: int) -> None:
        generator = torch.Generator()
        generator.manual_seed(int(seed))
        self.set_state(generator.get_state())

    def get_state(self) -> torch.Tensor:
        return torch.get_rng_state() if self.depth else self.state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        if self.depth:
            torch.set_rng_state(state)
        else:
            self.state = state.clone()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The CPU generator draws from this stream inside (re-entrant)."""
        if self.depth == 0:
            host = torch.get_rng_state()
            torch.set_rng_state(self.state)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.state = torch.get_rng_state()
                torch.set_rng_state(host)


DEVICE_RNG = _DeviceStream()


def _install_cpu_rng() -> Callable[[], None]:
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import random as mpu_random

    tracker_cls = mpu_random.CudaRNGStatesTracker

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        generator = torch.Generator()
        generator.manual_seed(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mpu_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        outer_state = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)

    original_forward = GPTModel.__dict__["forward"]

    @functools.wraps(original_forward)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        with DEVICE_RNG.active():
            return original_forward(self, *args, **kwargs)

    undo_tracker = swap_attrs(tracker_cls, {"add": add, "fork": fork})
    undo_model = swap_attrs(GPTModel, {"forward": forward})
    # torch.manual_seed also seeds the CUDA generators (torch.cuda.manual_seed_all).
    undo_cuda = swap_attrs(
        torch.cuda,
        {
            "manual_seed": DEVICE_RNG.seed,
            "manual_seed_all": DEVICE_RNG.seed,
            "get_rng_state": lambda device="cuda": DEVICE_RNG.get_state(),
            "set_rng_state": lambda new_state, device="cuda": DEVICE_RNG.set_state(new_state),
        },
    )

    def undo() -> None:
        undo_cuda()
        undo_model()
        undo_tracker()

    return undo


# --------------------------------------------------------------------------- checkpoint_dequantize


class _DequantizingPlanner:
    """A save planner whose resolved tensors are dequantized as megatron does on a GPU."""

    def __init__(self, planner: Any) -> None:
        self._planner = planner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def resolve_data(self, item: Any) -> Any:
        data = self._planner.resolve_data(item)
        if isinstance(data, torch.Tensor) and "dequantize" in type(data).__dict__:
            return data.detach().dequantize()
        return data


def _install_checkpoint_dequantize() -> Callable[[], None]:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    original = FileSystemWriterAsync.__dict__["prepare_write_data"]

    def prepare_write_data(self: Any, plan: Any, planner: Any) -> None:
        return original(self, plan, _DequantizingPlanner(planner))

    return swap_attrs(FileSystemWriterAsync, {"prepare_write_data": prepare_write_data})


# --------------------------------------------------------------------------- cpu_fused_adam


def _install_cpu_fused_adam() -> Callable[[], None]:
    import megatron.core.optimizer as megatron_optimizer
    from megatron.core.optimizer import distrib_optimizer

    from nemo_lw_fp8.cpu.megatron.fused_adam import CPUFusedAdam

    undo_factory = swap_attrs(
        megatron_optimizer, {"USING_PYTORCH_OPTIMIZER": False, "Adam": CPUFusedAdam}
    )
    # DistributedOptimizer keeps its own record of which Adam it got (it reads 'step' from the
    # param groups for TE's FusedAdam, from the per-param state for torch's): make it agree.
    undo_distopt = swap_attrs(
        distrib_optimizer,
        {
            "HAVE_APEX_OR_TE": True,
            "USING_TE_OPTIMIZER": True,
            "USING_APEX_OPTIMIZER": False,
            "Adam": CPUFusedAdam,
        },
    )

    def undo() -> None:
        undo_distopt()
        undo_factory()

    return undo


# --------------------------------------------------------------------------- moe_split_sizes


def _host_values(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """``maybe_move_tensor_to_cpu`` as a GPU run sees it: host values, numpy when asked."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().cpu().numpy()
    return tensor


def _install_moe_split_sizes() -> Callable[[], None]:
    from megatron.core.transformer.moe import token_dispatcher

    return swap_attrs(token_dispatcher, {"maybe_move_tensor_to_cpu": _host_values})


# ------------------------------------------------------------------------- gated_delta_rule


def _install_gated_delta_rule() -> Callable[[], None]:
    from nemo_lw_fp8.cpu.megatron.gated_delta_rule import install_into_megatron

    return install_into_megatron()


# --------------------------------------------------------------------------- local_norm_linear


def _install_local_norm_linear() -> Callable[[], None]:
    from megatron.core.models.backends import LocalSpecProvider

    from nemo_lw_fp8.cpu.layers.norm_linear import CPULayerNormColumnParallelLinear
    from nemo_lw_fp8.cpu.te import backend as te_backend

    original = LocalSpecProvider.column_parallel_layer_norm_linear

    def column_parallel_layer_norm_linear(self: Any) -> type | None:
        if te_backend.active_backend() == te_backend.BACKEND_TE:
            return original(self)  # never shadow a working TE
        return CPULayerNormColumnParallelLinear

    return swap_attrs(
        LocalSpecProvider, {"column_parallel_layer_norm_linear": column_parallel_layer_norm_linear}
    )


STANDINS: dict[str, StandIn] = {
    standin.name: standin
    for standin in (
        StandIn("cuda_runtime", "DDP buffers and streams", cuda_runtime.install_cuda_runtime),
        StandIn(
            "cuda_device", "device='cuda' and param.type() checks", cuda_runtime.install_cuda_device
        ),
        StandIn("uneven_all_gather", "layer-wise uneven gathers", _install_uneven_all_gather),
        StandIn("gloo_coalescing", "TE's coalesced TP gathers on gloo", _install_gloo_coalescing),
        StandIn("cpu_rng", "CUDA RNG streams and tracker forks", _install_cpu_rng),
        StandIn(
            "checkpoint_dequantize", "torch_dist writer on CPU", _install_checkpoint_dequantize
        ),
        StandIn("cpu_fused_adam", "FusedAdam's state layout on CPU", _install_cpu_fused_adam),
        StandIn("moe_split_sizes", "all-to-all split sizes on the host", _install_moe_split_sizes),
        StandIn(
            "gated_delta_rule",
            "fla's Triton kernels in Gated DeltaNet",
            _install_gated_delta_rule,
            on_demand=True,
        ),
        StandIn("local_norm_linear", "MLA's fused Q / KV norms", _install_local_norm_linear),
    )
}


def install(names: tuple[str, ...] | None = None) -> list[str]:
    """Install the named stand-ins (by default all but the on-demand ones); returns the names
    installed."""
    if names is None:
        chosen = [name for name, standin in STANDINS.items() if not standin.on_demand]
    else:
        chosen = list(names)
    for name in chosen:
        if name not in STANDINS:
            raise KeyError(f"unknown CPU stand-in {name!r}; known: {sorted(STANDINS)}")
        STANDINS[name].install()
    return chosen


def uninstall_all() -> None:
    """Remove every installed stand-in, most recent first."""
    for standin in reversed(list(STANDINS.values())):
        standin.uninstall()


def installed() -> list[str]:
    return [name for name, standin in STANDINS.items() if standin.installed]
