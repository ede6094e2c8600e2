"""What a weight looks like on the data-parallel wire of an owner-packed gather, one codec per
format.

The owner-packed gather (:mod:`.blockwise`: one collective per bucket group, each owner's weights
packed into its segment) moves weights of three kinds: blockwise FP8 (codes + one fp32 scale per
128x128 tile), NVFP4 primary weights (codes + 16x16 tile scales + the amax) and everything else in
its own dtype (bf16). Each kind is one :class:`WireCodec`: how many bytes a weight takes, how its
owner packs it, how a receiver unpacks it, and how receivers derive the columnwise copy the
backward GEMMs read. A format's module registers its codec once (:func:`register`, a line at its
end); the gather asks :func:`codec_of` and never branches on the format itself.

A new wire format is one codec in its own module, registered there: nothing in the gather changes.
"""

from __future__ import annotations

from typing import Protocol

import torch


class WireCodec(Protocol):
    """One wire format of the owner-packed gather."""

    #: Shown in errors and docs.
    name: str

    def claims(self, param: torch.Tensor) -> bool:
        """Whether ``param`` travels in this format."""
        ...

    def wire_bytes(self, param: torch.Tensor) -> int:
        """Bytes ``param`` occupies in its owner's segment."""
        ...

    def pack(
        self, param: torch.nn.Parameter, master: torch.Tensor | None, out: torch.Tensor
    ) -> None:
        """Owner: write ``param``'s wire bytes (from its fp32 ``master`` where it has one) into
        ``out`` (uint8, :meth:`wire_bytes` long)."""
        ...

    def unpack(self, param: torch.nn.Parameter, payload: torch.Tensor) -> None:
        """Receiver: write the owner's bytes ``payload`` into ``param``."""
        ...

    def derive_columnwise(self, params: list[torch.nn.Parameter]) -> None:
        """Receiver, after every segment is unpacked: the columnwise copies of ``params`` (all of
        this format) from their rowwise data."""
        ...


class _OwnDtype:
    """Everything no other codec claims: the weight's own bytes (bf16 for a bf16 model)."""

    name = "own dtype"

    def claims(self, param: torch.Tensor) -> bool:
        return True

    def wire_bytes(self, param: torch.Tensor) -> int:
        return param.numel() * param.element_size()

    def pack(
        self, param: torch.nn.Parameter, master: torch.Tensor | None, out: torch.Tensor
    ) -> None:
        source = master if master is not None else param
        raw = source.detach().to(param.dtype).reshape(-1).contiguous().view(torch.uint8)
        out[: raw.numel()].copy_(raw)

    def unpack(self, param: torch.nn.Parameter, payload: torch.Tensor) -> None:
        param.data.view(-1).copy_(payload.clone().view(param.dtype))

    def derive_columnwise(self, params: list[torch.nn.Parameter]) -> None:
        """A plain tensor has no columnwise copy."""


#: The fallback codec, asked last.
OWN_DTYPE: WireCodec = _OwnDtype()
_REGISTERED: list[WireCodec] = []


def register(codec: WireCodec) -> WireCodec:
    """Add ``codec`` (once per name: registering a name again replaces it) ahead of the fallback."""
    for index, known in enumerate(_REGISTERED):
        if known.name == codec.name:
            _REGISTERED[index] = codec
            return codec
    _REGISTERED.append(codec)
    return codec


def codecs() -> tuple[WireCodec, ...]:
    """Every codec in the order they are asked: as registered, then :data:`OWN_DTYPE`."""
    return (*_REGISTERED, OWN_DTYPE)


def codec_of(param: torch.Tensor) -> WireCodec:
    """The codec ``param`` travels in: the first registered one that claims it, else its own
    dtype."""
    for codec in _REGISTERED:
        if codec.claims(param):
            return codec
    return OWN_DTYPE
