"""Single grouped expert weights as E matrices for Muon (the layer-wise side of #5464).

TE's single grouped expert weight is ONE parameter holding E expert matrices: a ``GroupedTensor``
of wrapper shape ``(E, out, in)`` (its storage's ``logical_shape`` is ``(E*out, in)``). Muon must
see it as a matrix-shaped parameter (megatron-core 0.19.2 routes only 2-D params to Muon and
hands the grouped weight to Adam) and must orthogonalise and scale each expert on its own,
bitwise what E separate weights get (:func:`orthogonalize_per_expert`). TE's grouped *bias*,
``(E, out)``, stays a vector.

A parameter is a grouped weight with E members when it is TE's ``GroupedTensor`` (E =
``num_tensors``) or carries :data:`MEMBERS_ATTR` ``= E`` (CPU expert layers of our own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: Tag for 2-D matrices that stack E expert matrices (the CPU expert layers set it).
MEMBERS_ATTR = "nemo_lw_fp8_grouped_members"


def _is_grouped_tensor(param: torch.Tensor) -> bool:
    try:
        from megatron.core.fp8_utils import is_grouped_tensor
    except ImportError:
        return False
    return bool(is_grouped_tensor(param))


def grouped_members(param: torch.Tensor) -> int:
    """How many expert matrices ``param`` stacks (1 for an ordinary matrix)."""
    members = getattr(param, MEMBERS_ATTR, None)
    if members:
        return int(members)
    if _is_grouped_tensor(param):
        from megatron.core.fp8_utils import _unwrap_parameter_data

        return int(getattr(_unwrap_parameter_data(param), "num_tensors", 1) or 1)
    return 1


def is_grouped_weight(param: torch.Tensor) -> bool:
    """A single grouped expert weight: TE ``GroupedTensor`` of 2-D members (wrapper shape
    ``(E, out, in)``), or a 2-D matrix tagged with :data:`MEMBERS_ATTR`."""
    if getattr(param, MEMBERS_ATTR, None):
        return True
    return _is_grouped_tensor(param) and param.dim() == 3


def is_grouped_vector(param: torch.Tensor) -> bool:
    """TE's single grouped bias: wrapper shape ``(E, out)``, E vectors, not a matrix."""
    return _is_grouped_tensor(param) and param.dim() == 2


def is_muon_matrix(param: torch.Tensor) -> bool:
    """Muon's routing rule with grouped weights counted as (stacks of) matrices."""
    if getattr(param, "is_embedding_or_output_parameter", False):
        return False
    if is_grouped_weight(param):
        return True
    return param.dim() == 2 and not is_grouped_vector(param)


def is_nonlinear_or_embedding(param: torch.Tensor) -> bool:
    """The complement: what Muon's default overrides hand to the scalar optimizer."""
    return not is_muon_matrix(param)


def is_muon_excluded(param: torch.Tensor) -> bool:
    """megatron-core 0.20's wider exclusion (its predicate ``muon_excluded``): what
    :func:`is_nonlinear_or_embedding` excludes, and any param a model tagged ``use_muon=False``
    (0.20's Mamba / gated-delta input projections)."""
    if not getattr(param, "use_muon", True):
        return True
    return is_nonlinear_or_embedding(param)


def orthogonalize_per_expert(
    original: Callable[..., torch.Tensor],
    muon: Any,
    param: torch.Tensor,
    grad: torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:
    """``TensorParallelMuon.orthogonalize`` applied to each expert of a grouped weight."""
    if grad.dim() == 3:
        # Only grouped weights reach Muon as 3-D tensors (see the routing rule); the optimizer
        # sees their fp32 master, a plain (E, out, in) tensor.
        return torch.stack([original(muon, param, member, **kwargs) for member in grad.unbind(0)])
    members = grouped_members(param)
    if members <= 1:
        return original(muon, param, grad, **kwargs)
    rows, cols = grad.shape[0], grad.shape[-1]
    if grad.dim() != 2 or rows % members:
        raise RuntimeError(
            f"grouped weight with {members} members has momentum of shape "
            f"{tuple(grad.shape)}: its first dimension must split evenly into members"
        )
    per_expert = grad.view(members, rows // members, cols)
    # One Newton-Schulz per expert, exactly as for separate weights (a batched 3-D run would
    # reorder the arithmetic).
    updates = [original(muon, param, member, **kwargs) for member in per_expert]
    return torch.stack(updates).view(grad.shape)
