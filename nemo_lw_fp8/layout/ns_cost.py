"""The work Muon does on one parameter, and its sum per rank: what ownership balances and what
the stock layouts report.

A module of its own, importing nothing of the plugin, so that :mod:`nemo_lw_fp8.layout.packing`
(ownership, the compact layout) and :mod:`nemo_lw_fp8.layout.stock` (megatron's own layouts) both
use it without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence


def newton_schulz_cost(shape: Sequence[int]) -> int:
    """Relative Newton-Schulz work for one parameter: ``m * n * min(m, n)``.

    One Newton-Schulz iteration on an ``m x n`` matrix is a few GEMMs of ``min(m, n)``-sided
    Gram matrices, i.e. ``O(m * n * min(m, n))`` flops; the constant (iterations, GEMMs per
    iteration) is the same for every matrix, so it is left out. A 3-D grouped expert weight
    ``(E, m, n)`` is orthogonalised per expert: ``E * m * n * min(m, n)``.

    Raises ``ValueError`` for anything that is not a matrix or a stack of matrices (Muon does not
    touch vectors; they have no Newton-Schulz cost to balance).
    """
    dims = tuple(int(d) for d in shape)
    if len(dims) == 2:
        m, n = dims
        return m * n * min(m, n)
    if len(dims) == 3:
        e, m, n = dims
        return e * m * n * min(m, n)
    raise ValueError(f"Newton-Schulz cost is defined for 2-D and 3-D shapes, got {dims}")


def rank_loads(values: Sequence[int], owners: Sequence[int], world_size: int) -> list[int]:
    """Sum of ``values`` per owner rank."""
    loads = [0] * world_size
    for value, owner in zip(values, owners, strict=True):
        loads[owner] += int(value)
    return loads
