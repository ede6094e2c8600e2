"""Blockwise FP8 (Hopper) layer-wise param gather with FP8 bytes on the wire.

With ``fp8_param_gather`` and TE's ``Float8BlockScaling`` recipe (persistent
``Float8BlockwiseQTensor`` weights, 128x128 tiles), each layer-wise bucket group is gathered
here instead of by megatron:

* the owner of a weight (the rank that runs Muon on it) casts its fp32 master to bf16 and
  quantizes it once, in place, into its own weight (TE's quantizer: rowwise codes and one fp32
  scale per 128x128 tile) -- :func:`quantize_owned`;
* it ships the rowwise FP8 codes plus the tiles' fp32 ``scale_inv`` (no padding) in one segment
  per rank; one collective per bucket group: an even ``all_gather_into_tensor`` when padding the
  segments to the longest costs at most ``gather_padding_tolerance`` of the payload, else one
  uneven ``all_gather`` of the same segments;
* receivers write the codes and scales into their weights (:func:`write_scales`) and derive the
  columnwise form by the exact transpose rule (:func:`derive_columnwise`: megatron's
  ``post_all_gather_processing`` -> TE's ``Float8BlockwiseQTensor._create_columnwise``).

About half of bf16's bytes: ``M*K + 4*ceil(M/128)*ceil(K/128)`` instead of ``2*M*K``. Nothing
is staged in the grad buffer. Bitwise equal to FP8 param gather off with the same blockwise FP8
compute: the owner quantizes exactly the bf16 values FP8-gather-off would hold. With blockwise
weights present, layer-wise and DistOpt buckets never share a bucket group
(:func:`separate_owner_kinds`), so each group has one owner kind.

NVFP4 primary weights (``fp4_param`` + ``fp4_param_gather``) take the same collective: their
per-weight wire bytes, packing, unpacking and columnwise derivation are
:mod:`.nvfp4_gather`'s (FP4 codes + 16x16 tile scales + the amax), for single grouped FP4
weights member by member.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from nemo_lw_fp8 import config as plugin_config
from nemo_lw_fp8 import rules as guards
from nemo_lw_fp8.layout import packing as layout_math
from nemo_lw_fp8.mechanics import (
    bucket_owners,
    expert_slices,
    masters,
    nvfp4_gather,
    owner_gather,
    te_classes,
    wire,
)
from nemo_lw_fp8.state import group_state, peek

BLOCK = 128


# --------------------------------------------------------------------------- what a param is


def is_blockwise(param: torch.Tensor) -> bool:
    """Whether ``param`` is a TE ``Float8BlockwiseQTensor`` (any block dimension)."""
    module = "transformer_engine.pytorch.tensor.float8_blockwise_tensor"
    return te_classes.holds(param, te_classes.te_class(module, "Float8BlockwiseQTensor"))


def is_owner_quantized(param: torch.Tensor) -> bool:
    """Whether the owner quantizes ``param`` and ships its quantized bytes (blockwise FP8 or
    NVFP4 primary weights)."""
    return is_blockwise(param) or nvfp4_gather.is_fp4_weight(param)


def _tiles(param: torch.Tensor) -> tuple[int, int]:
    rows = param.numel() // param.shape[-1] if param.dim() else 1
    cols = param.shape[-1] if param.dim() else 1
    return -(-rows // BLOCK), -(-cols // BLOCK)


def param_wire_bytes(param: torch.Tensor) -> int:
    """Bytes one parameter occupies on the wire, as its codec says (:mod:`.wire`)."""
    return wire.codec_of(param).wire_bytes(param)


# --------------------------------------------------------------------------- the group state


@dataclass
class BlockwiseGroup:
    """What one layer-wise bucket group gathers: per rank, the params it owns, in order."""

    segments: list[list[torch.nn.Parameter]]
    segment_bytes: list[int]
    #: One even all_gather_into_tensor (segments padded to the longest) or one uneven all_gather.
    even: bool
    process_group: Any
    #: The owner already quantized its own weights in place; it unpacks only the others'.
    unpack_own: ClassVar[bool] = False

    @property
    def gather_bytes(self) -> int:
        return owner_gather.gathered_length(self.segment_bytes, self.even)

    def segment_start(self, rank: int) -> int:
        return owner_gather.segment_start(self.segment_bytes, self.even, rank)


def _gather_group(bucket_group: Any) -> Any:
    group = getattr(bucket_group, "intra_distributed_optimizer_instance_group", None)
    return group if group is not None else bucket_group.data_parallel_group


def _owner_map(params_lists: list[list[Any]] | None) -> dict[Any, int] | None:
    if params_lists is None:
        return None
    return {param: rank for rank, params in enumerate(params_lists) for param in params}


def _runs_of(owners: dict[Any, int] | None, param: torch.nn.Parameter) -> list[tuple[Any, int]]:
    """The expert runs (:class:`~.expert_slices.ExpertSlice`) of ``param`` with their owners,
    in expert order (empty when ``param`` is owned whole)."""
    if owners is None:
        return []
    runs = [(p, r) for p, r in owners.items() if expert_slices.is_slice(p) and p.parent is param]
    return sorted(runs, key=lambda run: run[0].lo)


def attach_groups(optimizer: Any) -> int:
    """Give every layer-wise bucket group that holds blockwise weights its gather state.

    Ownership is the layer-wise optimizer's own (``dp_cp_params_list`` /
    ``expt_dp_params_list``, set by 0.19.2's padded sharding or by the compact patch), so the
    rank that steps a weight is the one that ships it. Returns the number of groups.
    """
    dense = _owner_map(getattr(optimizer, "dp_cp_params_list", None))
    expert = _owner_map(getattr(optimizer, "expt_dp_params_list", None))
    count = 0
    for chunk in optimizer.model_chunks:
        tolerance = plugin_config.gather_padding_tolerance(chunk.ddp_config)
        kinds = ((chunk.bucket_groups, dense), (chunk.expert_parallel_bucket_groups, expert))
        for bucket_groups, owners in kinds:
            for group in bucket_groups:
                params = [p for b in group.buckets for p in b.params_list]
                if not any(is_owner_quantized(p) for p in params):
                    continue
                if not all(bucket_owners.owned_by_layer_wise(b) for b in group.buckets):
                    raise RuntimeError(
                        "a bucket group mixes layer-wise blockwise FP8 buckets with DistOpt "
                        "buckets; the blockwise_fp8_param_gather patch keeps them apart when it "
                        "is applied before the model is wrapped"
                    )
                process_group = _gather_group(group)
                size = process_group.size()
                segments: list[list[torch.nn.Parameter]] = [[] for _ in range(size)]
                for param in params:
                    rank = 0 if owners is None else owners.get(param)
                    runs = _runs_of(owners, param) if rank is None else []
                    if runs and nvfp4_gather.is_grouped_nvfp4(param):
                        # FP4 primary grouped weight owned in runs of experts: each run's
                        # owner ships its members
                        for run, owner in runs:
                            segments[owner].append(run)
                        continue
                    if rank is None:
                        raise RuntimeError(
                            f"layer-wise param of shape {tuple(param.shape)} has no owner"
                        )
                    segments[rank].append(param)
                sizes = [sum(param_wire_bytes(p) for p in seg) for seg in segments]
                # Takes over from a compact group's own (bf16) gather (compact_gather.plan_of).
                group_state(group).blockwise = BlockwiseGroup(
                    segments, sizes, layout_math.even_gather_fits(sizes, tolerance), process_group
                )
                count += 1
    return count


# --------------------------------------------------------------------------- owner side


def _master(param: torch.nn.Parameter) -> torch.Tensor | None:
    return getattr(param, "main_param", None)


def quantize_owned(param: torch.nn.Parameter, master: torch.Tensor) -> None:
    """The owner's one quantization: the bf16 cast of the fp32 master, as FP8-gather-off would
    hold it, through the weight's own TE quantizer (in place: rowwise codes and scales)."""
    from megatron.core.fp8_utils import copy_tensor_to_quantized_param

    copy_tensor_to_quantized_param(param, master.detach().to(param.dtype).view(param.shape))


def _scale_bytes(param: torch.nn.Parameter) -> torch.Tensor:
    m_tiles, k_tiles = _tiles(param)
    valid = param._rowwise_scale_inv[:m_tiles, :k_tiles].contiguous()
    return valid.view(torch.uint8).reshape(-1)


def pack_owned(state: BlockwiseGroup, rank: int, out: torch.Tensor) -> None:
    """Quantize this rank's owned weights and write their wire bytes into ``out`` (uint8)."""
    offset = 0
    for param in state.segments[rank]:
        codec = wire.codec_of(param)
        n = codec.wire_bytes(param)
        codec.pack(param, _master(param), out[offset : offset + n])
        offset += n


# --------------------------------------------------------------------------- receiver side


def write_scales(param: torch.nn.Parameter, payload: torch.Tensor) -> None:
    """Receiver: the owner's tile scales into the weight's rowwise scale_inv (valid region)."""
    m_tiles, k_tiles = _tiles(param)
    values = payload.clone().view(torch.float32).view(m_tiles, k_tiles)
    param._rowwise_scale_inv[:m_tiles, :k_tiles].copy_(values)


def _unpack_param(param: torch.nn.Parameter, payload: torch.Tensor) -> None:
    wire.codec_of(param).unpack(param, payload)


def unpack(state: BlockwiseGroup, gathered: torch.Tensor, my_rank: int) -> None:
    for rank in owner_gather.ranks_to_unpack(state, my_rank):
        offset = state.segment_start(rank)
        for param in state.segments[rank]:
            n = param_wire_bytes(param)
            _unpack_param(param, gathered[offset : offset + n])
            offset += n


def derive_columnwise(params: list[torch.nn.Parameter]) -> None:
    """Every codec derives the columnwise copies of its weights among ``params``, in the
    codecs' order (:func:`.wire.codecs`)."""
    formats = [wire.codec_of(param) for param in params]
    for codec in wire.codecs():
        own = [param for param, form in zip(params, formats, strict=True) if form is codec]
        if own:
            codec.derive_columnwise(own)


# --------------------------------------------------------------------------- the collective


def _dispatch(group: Any, async_op: bool) -> None:
    record = group_state(group)
    state: BlockwiseGroup = record.blockwise
    owner_gather.gather_owned(
        group,
        record,
        state.segment_bytes,
        state.even,
        state.process_group,
        torch.uint8,
        lambda rank, send: pack_owned(state, rank, send),
        async_op,
        _finish,
    )


def _finish(group: Any) -> None:
    record = group_state(group)
    gathered = owner_gather.take_pending(record)
    if gathered is not None:
        state: BlockwiseGroup = record.blockwise
        with torch.no_grad():
            unpack(state, gathered, state.process_group.rank())


#: One collective of owner-packed FP8 codes + scales per bucket group, under megatron's
#: start/finish contract (:mod:`.owner_gather`); ``_post_param_sync`` derives the columnwise
#: copies once the weights are current.
SYNC = owner_gather.OwnerPackedSync(
    dispatch=lambda group, async_op: _dispatch(group, async_op),
    unpack=lambda group: _finish(group),
    post=lambda group: group._post_param_sync(),
)


def plan_of(group: Any) -> BlockwiseGroup | None:
    """The blockwise gather plan of ``group`` (``None``: someone else gathers it)."""
    record = peek(group)
    return None if record is None else record.blockwise


# --------------------------------------------------------------------------- bucket groups


def _layer_wise_buffer(buffer: Any) -> bool:
    return bool(buffer.params) and all(
        getattr(p, "is_managed_by_layer_wise_optimizer", False) for p in buffer.params
    )


def _gathers_quantized(ddp_config: Any, param: torch.Tensor) -> bool:
    """Whether the plugin's owner-packed gather ships ``param``'s quantized bytes."""
    if is_blockwise(param):
        return bool(getattr(ddp_config, "fp8_param_gather", False))
    return nvfp4_gather.is_fp4_weight(param) and nvfp4_gather.gather_on(ddp_config)


def holds_layer_wise_blockwise(buffers: list[Any]) -> bool:
    return any(
        _layer_wise_buffer(b) and any(_gathers_quantized(b.ddp_config, p) for p in b.params)
        for b in buffers
    )


def separate_owner_kinds(buffers: list[Any]) -> list[list[Any]]:
    """Buffers split so no bucket group mixes layer-wise (one owner per weight) and DistOpt
    (byte-range shards) buckets; called by name so a mutation test can put one list back."""
    layer_wise = [b for b in buffers if _layer_wise_buffer(b)]
    rest = [b for b in buffers if not _layer_wise_buffer(b)]
    return [subset for subset in (layer_wise, rest) if subset]


# --------------------------------------------------------------------------- the optimizer


def layer_wise_blockwise_params(optimizer: Any) -> list[torch.nn.Parameter]:
    params = []
    for chunk in optimizer.model_chunks:
        for param in chunk.module.parameters():
            if getattr(param, "is_managed_by_layer_wise_optimizer", False) and (
                _gathers_quantized(chunk.ddp_config, param)
            ):
                params.append(param)
    return params


def check(optimizer: Any, params: list[torch.nn.Parameter]) -> None:
    """What only the built weights can tell (the configuration rules ran before this step,
    ``blockwise-gather-no-grad-buffer-reuse`` among them): their tile shape."""
    nvfp4_gather.check([p for p in params if nvfp4_gather.is_fp4_weight(p)])
    one_d = [
        tuple(p.shape) for p in params if is_blockwise(p) and not getattr(p, "_is_2D_scaled", False)
    ]
    if one_d:
        raise guards.ConfigError(
            "blockwise-gather-2d-weights",
            f"layer-wise blockwise FP8 gather needs 128x128 weight tiles (TE's "
            f"Float8BlockScaling default w_block_scaling_dim=2); weights {one_d[:3]} use 1x128 "
            "blocks, whose columnwise scales cannot be derived from the rowwise ones. Fix: keep "
            "w_block_scaling_dim=2, or drop --fp8-param-gather.",
        )


def set_up(optimizer: Any) -> None:
    """After the layer-wise optimizer is built: check, masters from TE's init values, no
    re-quantization in the inner step, gather plans for the bucket groups."""
    params = layer_wise_blockwise_params(optimizer)
    if not params or not getattr(optimizer, "use_buffer_param_sync", False):
        return
    check(optimizer, params)
    masters.init_masters_from_high_precision(optimizer)
    masters.skip_requantize_on_inner_step(optimizer)
    attach_groups(optimizer)


class _BlockwiseCodec:
    """Blockwise FP8 (Hopper) weights on the wire: the owner's rowwise FP8 codes, then one fp32
    scale per 128x128 tile (the valid region of its ``scale_inv``)."""

    name = "blockwise FP8"

    def claims(self, param: torch.Tensor) -> bool:
        return is_blockwise(param)

    def wire_bytes(self, param: torch.Tensor) -> int:
        m_tiles, k_tiles = _tiles(param)
        return param.numel() + 4 * m_tiles * k_tiles

    def pack(
        self, param: torch.nn.Parameter, master: torch.Tensor | None, out: torch.Tensor
    ) -> None:
        """Quantize from the master (where there is one), then write codes and tile scales."""
        if master is not None:
            quantize_owned(param, master)
        codes = param._rowwise_data.reshape(-1).view(torch.uint8)
        out[: codes.numel()].copy_(codes)
        scales = _scale_bytes(param)
        out[codes.numel() : codes.numel() + scales.numel()].copy_(scales)

    def unpack(self, param: torch.nn.Parameter, payload: torch.Tensor) -> None:
        n = param.numel()
        param._rowwise_data.view(-1).copy_(payload[:n])
        write_scales(param, payload[n:])

    def derive_columnwise(self, params: list[torch.nn.Parameter]) -> None:
        """Columnwise codes and scales from the rowwise ones (128x128 tiles: the exact
        transpose), through megatron's post-all-gather hook, i.e. TE's ``_create_columnwise``."""
        from megatron.core.fp8_utils import post_all_gather_processing

        post_all_gather_processing(params)


wire.register(_BlockwiseCodec())
