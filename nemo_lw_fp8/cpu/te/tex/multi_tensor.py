"""``tex``'s multi-tensor helpers megatron-core calls for the gradient norm and clipping
(``multi_tensor_l2norm``, ``multi_tensor_scale``, ``multi_tensor_scale_tensor``), in fp32 on CPU."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def multi_tensor_l2norm(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    per_tensor: bool | None = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 L2 norm of all tensors together, and per tensor when ``per_tensor`` (else empty)."""
    tensors = list(tensor_lists[0])
    device = tensors[0].device if tensors else torch.device("cpu")
    norms = (
        torch.stack([torch.linalg.vector_norm(t.detach().float().reshape(-1)) for t in tensors])
        if tensors
        else torch.zeros(0, device=device)
    )
    total = torch.linalg.vector_norm(norms).reshape(1)
    per = norms if per_tensor else torch.empty(0, dtype=torch.float32, device=device)
    return total, per


def _scale_lists(
    noop_flag: torch.Tensor | None,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    scale: torch.Tensor,
) -> None:
    finite = True
    with torch.no_grad():
        for src, dst in zip(tensor_lists[0], tensor_lists[1], strict=True):
            src32 = src.float()
            finite = finite and bool(torch.isfinite(src32).all())
            dst.copy_(src32 * scale)
    if not finite and noop_flag is not None:
        noop_flag.fill_(1)


def multi_tensor_scale(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    scale: float,
) -> None:
    """``out = fp32(in) * fp32(scale)`` per pair; ``noop_flag = 1`` if an input is not finite."""
    _scale_lists(noop_flag, tensor_lists, torch.tensor(scale, dtype=torch.float32))


def multi_tensor_scale_tensor(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: Sequence[Sequence[torch.Tensor]],
    scale: torch.Tensor,
) -> None:
    """As :func:`multi_tensor_scale` with the scale read from a one-element tensor."""
    _scale_lists(noop_flag, tensor_lists, scale.detach().float().reshape(-1)[0])
