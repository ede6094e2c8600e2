"""NVFP4 primary weights under the layer-wise optimizer: FP4 bytes on the data-parallel wire.

With megatron's ``fp4_param`` (persistent TE ``NVFP4Tensor`` weights, 16x16 blocks) and the DDP
config's ``fp4_param_gather``, a layer-wise bucket group's weights travel as the owner made them:

* the owner (the rank that runs Muon on the whole matrix) quantizes the bf16 cast of its fp32
  master once, in place, with the weight's own TE quantizer (:func:`quantize_owned`). The
  per-tensor amax is a reduction over the whole matrix, and only the owner holds the whole
  matrix's update, so no amax reduction across ranks is needed (megatron's Adam path must
  all-reduce it because each rank holds a shard);
* it ships, per weight, the rowwise FP4 codes (``M*K/2`` bytes), one E4M3 scale per 16x16 tile
  (``M*K/256`` bytes: with 2D blocks the rowwise scale buffer repeats each tile's byte on its 16
  rows) and the fp32 amax (:func:`pack_param`);
* receivers write the codes, rebuild the rowwise scale buffer from the tiles (compact, or in
  cuBLAS's swizzled order when the weight keeps its scales swizzled), set both amaxes
  (:func:`write_rowwise`), and derive the columnwise copy the dgrad / wgrad GEMMs read
  (:func:`derive_columnwise`): with 16x16 blocks the columnwise copy is the rowwise one
  transposed, codes (TE's ``nvfp4_data_transpose``) and tile scales alike, and its amax is the
  rowwise amax. TE's own ``_create_columnwise`` reads the rowwise scales as compact, so it
  cannot derive from swizzled ones; the derivation here un-swizzles first.

The gather itself is the owner-packed collective of :mod:`.blockwise` (one per bucket group),
which calls :func:`param_wire_bytes`, :func:`pack_param`, :func:`unpack_param` and
:func:`derive_columnwise` for NVFP4 weights. Functions are called through this module so a test
can switch one off (a stale amax, a stale columnwise copy) and see the run diverge.

Single grouped expert weights (one TE ``GroupedTensor`` per expert linear, FP4 primary: its
members are ``NVFP4Tensor`` views into the grouped buffers) travel the same way, member by
member: the owner of the whole grouped weight casts each member from its expert's part of the
fp32 master with the grouped weight's quantizer (megatron's ``copy_tensor_to_quantized_param``:
the single-tensor cast TE gave each member under ``quantized_model_init``; one amax per member),
and ships, member after member, the same codes + tile scales + amax as for a weight of its own.
Receivers write each member's views and derive each member's columnwise copy. Nothing in the
format is shared between members, so the grouped weight's payload is its members' payloads.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_lw_fp8.mechanics import expert_slices, te_classes, wire

#: NVFP4 block length, and the 2D tile edge of weights.
TILE = 16


def is_nvfp4(param: torch.Tensor) -> bool:
    """Whether ``param`` is a TE ``NVFP4Tensor`` (a persistent FP4 weight; its buffers are
    attributes of the tensor)."""
    return te_classes.holds(
        param, te_classes.te_class("transformer_engine.pytorch.tensor.nvfp4_tensor", "NVFP4Tensor")
    )


def grouped_members(param: torch.Tensor) -> list[Any] | None:
    """The ``NVFP4Tensor`` members of an FP4 primary single grouped weight (views into its
    grouped buffers, TE's cached ``quantized_tensors``), those of experts ``[lo, hi)`` for an
    expert run of one (:class:`~.expert_slices.ExpertSlice`), or ``None`` for any other
    parameter."""
    if expert_slices.is_slice(param):
        members = grouped_members(param.parent)
        return None if members is None else members[param.lo : param.hi]
    if not hasattr(param, "quantized_tensors") or not hasattr(param, "num_tensors"):
        return None
    members = param.quantized_tensors
    if members is None and getattr(param, "quantizer", None) is not None:
        members = param.split_into_quantized_tensors()
    if not members or not all(is_nvfp4(member) for member in members):
        return None
    return list(members)


def is_grouped_nvfp4(param: torch.Tensor) -> bool:
    """Whether ``param`` is a single grouped weight of NVFP4 members (FP4 primary)."""
    return grouped_members(param) is not None


def is_fp4_weight(param: torch.Tensor) -> bool:
    """Whether the owner-packed FP4 gather carries ``param``: an ``NVFP4Tensor`` weight or a
    grouped weight of ``NVFP4Tensor`` members."""
    return is_nvfp4(param) or is_grouped_nvfp4(param)


def dims(param: torch.Tensor) -> tuple[int, int]:
    """The flattened ``(M, K)`` of a weight (TE flattens leading dims)."""
    cols = param.shape[-1]
    return param.numel() // cols, cols


def uses_2d_blocks(param: torch.Tensor) -> bool:
    """Whether the weight's quantizer casts 16x16 tiles (the columnwise copy is then derivable)."""
    quantizer = getattr(param, "_quantizer", None)
    return bool(quantizer is not None and quantizer.with_2d_quantization)


def param_wire_bytes(param: torch.Tensor) -> int:
    """Bytes one NVFP4 weight occupies on the wire: codes, one scale per tile, the fp32 amax (a
    grouped weight: the sum over its members)."""
    members = grouped_members(param)
    if members is not None:
        return sum(param_wire_bytes(member) for member in members)
    rows, cols = dims(param)
    return rows * cols // 2 + (rows // TILE) * (cols // TILE) + 4


# --------------------------------------------------------------------------- scale layouts


def _padded_scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """TE's NVFP4 scale buffer of a usage whose data is ``(rows, cols)``: rows padded to 128,
    block columns to 4."""
    blocks = -(-cols // TILE)
    return -(-rows // 128) * 128, -(-blocks // 4) * 4


def _swizzle(compact: torch.Tensor) -> torch.Tensor:
    """cuBLAS's block-scale order (128x4 tiles of the compact matrix as stored, each tile's rows
    interleaved in four groups of 32), same shape: what TE's 2D kernel writes with
    ``optimize_for_gemm`` (``cast/nvfp4/swizzle.cuh``)."""
    rows, cols = compact.shape
    tiles = compact.reshape(rows // 128, 4, 32, cols // 4, 4)
    return tiles.permute(0, 3, 2, 1, 4).reshape(rows, cols)


def _unswizzle(swizzled: torch.Tensor) -> torch.Tensor:
    rows, cols = swizzled.shape
    tiles = swizzled.reshape(rows // 128, cols // 4, 32, 4, 4)
    return tiles.permute(0, 3, 2, 1, 4).reshape(rows, cols)


def tile_scales(param: torch.Tensor) -> torch.Tensor:
    """The ``(M/16, K/16)`` E4M3 tile scales of a 2D-quantized weight, read from its rowwise
    scale buffer (the first row of each tile; un-swizzled first when stored swizzled)."""
    tensor = param
    rows, cols = dims(param)
    stored = tensor._rowwise_scale_inv.view(torch.uint8)
    compact = _unswizzle(stored) if tensor._with_gemm_swizzled_scales else stored
    return compact[0:rows:TILE, : cols // TILE]


def scales_from_tiles(tiles: torch.Tensor, rows: int, cols: int, swizzled: bool) -> torch.Tensor:
    """A usage's scale buffer for data of shape ``(rows, cols)`` whose ``(rows/16, cols/16)``
    tiles are ``tiles``: each tile's byte on its 16 rows, zero padding, swizzled on request."""
    out = torch.zeros(_padded_scale_shape(rows, cols), dtype=torch.uint8, device=tiles.device)
    out[:rows, : cols // TILE] = tiles.repeat_interleave(TILE, dim=0)
    return _swizzle(out) if swizzled else out


# --------------------------------------------------------------------------- owner side


def quantize_owned(param: torch.nn.Parameter, master: torch.Tensor) -> None:
    """The owner's one quantization: the bf16 cast of the fp32 master (the value FP4 param
    gather off holds in its bf16 weight), through the weight's own quantizer, in place. For a
    grouped weight megatron's copy casts each member from its expert's slice with the grouped
    weight's (single-tensor) quantizer, ``update_quantized`` into the member's views."""
    from megatron.core.fp8_utils import copy_tensor_to_quantized_param

    if expert_slices.is_slice(param):
        # an expert run: megatron's per-member cast, on the run's members only
        quantizer = param.parent.quantizer
        values = master.detach().to(param.parent.dtype).view(param.shape)
        for value, member in zip(values.unbind(0), grouped_members(param) or [], strict=True):
            quantizer.update_quantized(value, member)
        return
    copy_tensor_to_quantized_param(param, master.detach().to(param.dtype).view(param.shape))


def pack_param(param: torch.nn.Parameter, master: torch.Tensor | None, out: torch.Tensor) -> None:
    """Quantize an owned weight (when this rank holds its master) and write its wire bytes into
    ``out`` (uint8, :func:`param_wire_bytes` long): codes, tile scales, amax. A grouped weight
    is cast whole (each member from its expert's part of the master) and packed member by
    member."""
    if master is not None:
        quantize_owned(param, master)
    members = grouped_members(param)
    if members is not None:
        offset = 0
        for member in members:
            n = param_wire_bytes(member)
            pack_param(member, None, out[offset : offset + n])
            offset += n
        return
    tensor = param
    rows, cols = dims(param)
    codes = tensor._rowwise_data.reshape(-1).view(torch.uint8)
    n_codes = rows * cols // 2
    out[:n_codes].copy_(codes)
    tiles = tile_scales(param).reshape(-1)
    out[n_codes : n_codes + tiles.numel()].copy_(tiles)
    amax = tensor._amax_rowwise.reshape(1).to(torch.float32).view(torch.uint8)
    out[n_codes + tiles.numel() :].copy_(amax)


# --------------------------------------------------------------------------- receiver side


def write_amax(param: torch.nn.Parameter, amax: torch.Tensor) -> None:
    """The owner's per-tensor amax into both usages (the GEMM's alpha reads the one of its
    usage; with 16x16 blocks the two are the same value)."""
    tensor = param
    tensor._amax_rowwise.view(-1).copy_(amax)
    if tensor._amax_columnwise is not None:
        tensor._amax_columnwise.view(-1).copy_(amax)


def unpack_param(param: torch.nn.Parameter, payload: torch.Tensor) -> None:
    """Receiver: the owner's codes, tile scales and amax into the weight's rowwise copy (a
    grouped weight: into each member's views, member by member)."""
    members = grouped_members(param)
    if members is not None:
        offset = 0
        for member in members:
            n = param_wire_bytes(member)
            unpack_param(member, payload[offset : offset + n])
            offset += n
        return
    tensor = param
    rows, cols = dims(param)
    n_codes = rows * cols // 2
    n_tiles = (rows // TILE) * (cols // TILE)
    tensor._rowwise_data.view(torch.uint8).view(-1).copy_(payload[:n_codes])
    tiles = payload[n_codes : n_codes + n_tiles].reshape(rows // TILE, cols // TILE)
    stored = tensor._rowwise_scale_inv.view(torch.uint8)
    stored.copy_(scales_from_tiles(tiles, rows, cols, tensor._with_gemm_swizzled_scales))
    write_amax(param, payload[n_codes + n_tiles :].clone().view(torch.float32))


def derive_columnwise(param: torch.nn.Parameter) -> None:
    """The columnwise copy from the rowwise one (16x16 blocks: the exact transpose): codes by
    TE's nibble transpose, tile scales transposed into the columnwise buffer (swizzled like the
    rowwise ones), amax copied; a grouped weight's members each on their own."""
    members = grouped_members(param)
    if members is not None:
        for member in members:
            _derive_columnwise_of(member)
        return
    _derive_columnwise_of(param)


def _derive_columnwise_of(param: Any) -> None:
    """:func:`derive_columnwise` of one ``NVFP4Tensor`` (a weight or a grouped weight's member)."""
    import transformer_engine_torch as tex

    tensor = param
    if tensor._columnwise_data is None:
        return  # the weight keeps no columnwise copy: TE creates it from the rowwise one
    rows, cols = dims(param)
    tex.nvfp4_data_transpose(
        tensor._rowwise_data.view(torch.uint8).reshape(rows, cols // 2),
        out=tensor._columnwise_data.view(torch.uint8).reshape(cols, rows // 2),
    )
    tiles = tile_scales(param)
    stored = tensor._columnwise_scale_inv.view(torch.uint8)
    stored.copy_(scales_from_tiles(tiles.t(), cols, rows, tensor._with_gemm_swizzled_scales))
    tensor._amax_columnwise.copy_(tensor._amax_rowwise)


# --------------------------------------------------------------------------- configuration


def gather_on(ddp_config: Any) -> bool:
    """Whether DDP was configured for NVFP4 primary weights (megatron-training's
    ``--fp4-param-gather`` sets ``DistributedDataParallelConfig.fp4_param_gather``)."""
    return bool(getattr(ddp_config, "fp4_param_gather", False))


def check(params: list[torch.nn.Parameter]) -> None:
    """What only the built weights can tell: 16x16 blocks (a 1x16 weight's columnwise blocks run
    along the other dim, so receivers could not derive them) and shapes of whole tiles."""
    from nemo_lw_fp8 import rules as guards

    singles = [m for p in params for m in (grouped_members(p) or [p])]
    one_d = [tuple(p.shape) for p in singles if not uses_2d_blocks(p)]
    if one_d:
        raise guards.ConfigError(
            "fp4-primary-weights-layer-wise",
            f"layer-wise NVFP4 param gather needs 16x16 weight blocks (NVFP4BlockScaling's "
            f"default fp4_quant_fwd_weight 2D); weights {one_d[:3]} use 1x16 blocks, whose "
            "columnwise copy cannot be derived from the rowwise one. Fix: keep the recipe's 2D "
            "weight quantization, or drop --fp4-param-gather.",
        )


class _NVFP4Codec:
    """NVFP4 primary weights on the wire: codes + 16x16 tile scales + the amax, per weight or per
    member of a grouped weight. Calls this module's functions by name, so a test that replaces
    one (a stale amax, a stale columnwise copy) changes what the gather does."""

    name = "NVFP4"

    def claims(self, param: torch.Tensor) -> bool:
        return is_fp4_weight(param)

    def wire_bytes(self, param: torch.Tensor) -> int:
        return param_wire_bytes(param)

    def pack(
        self, param: torch.nn.Parameter, master: torch.Tensor | None, out: torch.Tensor
    ) -> None:
        pack_param(param, master, out)

    def unpack(self, param: torch.nn.Parameter, payload: torch.Tensor) -> None:
        unpack_param(param, payload)

    def derive_columnwise(self, params: list[torch.nn.Parameter]) -> None:
        for param in params:
            derive_columnwise(param)


wire.register(_NVFP4Codec())
