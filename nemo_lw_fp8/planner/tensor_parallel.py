"""Tensor parallelism in the planner: the shard of each parameter a rank holds, the ranks of one
pipeline stage, and Newton-Schulz work under megatron's ``muon_tp_mode``.

megatron-core 0.19.2 splits a column-parallel linear's weight along its output rows (dim 0, of a
grouped ``(E, m, n)`` expert weight dim 1) and a row-parallel one along its input columns (the
last dim) over TP ranks (expert weights over ETP ranks); norms, the router, MLA's down
projections (``backend.linear()``, TE's ``parallel_mode="duplicated"``) and the shared-expert
gate stay whole on every TP rank. :func:`tp_shard` gives the shard by parameter name, as
:mod:`.shapes` names them.

The ranks of one pipeline stage are numbered as megatron's ``RankGenerator`` with the default
order ``tp-cp-ep-dp-pp`` numbers them (:class:`StageRanks`): the dense grid has TP fastest, then
CP x DP (the gradient group, size ``dp``); the expert grid has ETP fastest, then EP, then the
expert data-parallel group, whose size is world / (PP x EP x ETP)
(``parallel_state.initialize_model_parallel``'s ``expert_data_parallel_size``), not
``dp / ep``: at TP 2, ETP 1 the expert group spans both TP ranks of a dense group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from nemo_lw_fp8.layout import packing as lo
from nemo_lw_fp8.planner.shapes import ParamSpec

#: megatron's Newton-Schulz modes for TP-sharded matrices (``OptimizerConfig.muon_tp_mode``).
MUON_TP_MODES = ("duplicated", "blockwise", "distributed")

# Parameter-name endings megatron shards along the output rows (column-parallel; the embedding is
# vocab-parallel, GDN's conv1d / dt_bias / A_log follow in_proj's heads) or the input columns.
_COLUMN = re.compile(
    r"(linear_qkv|linear_q_proj|linear_q_up_proj|linear_kv_up_proj|linear_fc1|in_proj)\.weight\d*$"
    r"|word_embeddings\.weight$|output_layer\.weight$|conv1d\.weight$|\.dt_bias$|\.A_log$"
)
_ROW = re.compile(r"(linear_proj|linear_fc2|out_proj)\.weight\d*$")


def tp_dim(spec: ParamSpec) -> int | None:
    """The dimension megatron partitions over TP / ETP (``partition_dim``), ``None`` if the
    parameter is whole on every tensor-parallel rank."""
    if _ROW.search(spec.name):
        return len(spec.shape) - 1
    if _COLUMN.search(spec.name):
        # a grouped (E, m, n) expert weight: rows are dim 1; conv1d (C, 1, k) and vectors: dim 0
        grouped = spec.expert_parallel and len(spec.shape) == 3
        return 1 if grouped else 0
    return None


def tp_shard(spec: ParamSpec, tp: int, etp: int) -> ParamSpec:
    """The shard of ``spec`` one tensor-parallel rank holds: split ``etp`` ways for a routed
    expert weight, ``tp`` ways otherwise, along :func:`tp_dim`; unchanged when whole."""
    degree = etp if spec.expert_parallel else tp
    dim = tp_dim(spec)
    if degree == 1 or dim is None:
        return spec
    shape = list(spec.shape)
    if shape[dim] % degree:
        raise ValueError(f"{spec.name}: dim {dim} of {spec.shape} does not split over {degree}")
    shape[dim] //= degree
    return replace(spec, shape=tuple(shape), tp=degree, tp_dim=dim)


def pad_vocab(specs: list[ParamSpec], tp: int, divisible_by: int = 128) -> list[ParamSpec]:
    """``specs`` with the embedding and output layer's vocabulary padded as Megatron-Bridge pads
    it (``make_vocab_size_divisible_by`` 128, times TP) before megatron splits it over TP; the
    architectures' vocabularies are multiples of 128 already, so TP 1 changes nothing."""
    step = divisible_by * tp
    out = []
    for s in specs:
        if s.embedding_or_output and s.shape[0] % step:
            s = replace(s, shape=(-(-s.shape[0] // step) * step, *s.shape[1:]))
        out.append(s)
    return out


@dataclass(frozen=True)
class StageRanks:
    """The ``tp * dp`` ranks of one pipeline stage (``dp``: the dense data-parallel x CP size)
    and their dense and expert data-parallel groups, as megatron numbers them."""

    dp: int
    ep: int = 1
    tp: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        if min(self.dp, self.ep, self.tp, self.etp) < 1 or self.n % (self.ep * self.etp):
            raise ValueError(
                f"TP {self.tp} x DP {self.dp} ranks do not split into EP {self.ep} x ETP "
                f"{self.etp} x expert DP"
            )

    @property
    def n(self) -> int:
        """Ranks in the stage (world / PP)."""
        return self.tp * self.dp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: world / (PP x EP x ETP)."""
        return self.n // (self.ep * self.etp)

    def dense_member(self, rank: int) -> int:
        """Rank's index in its dense data-parallel (x CP) group."""
        return rank // self.tp

    def expert_member(self, rank: int) -> int:
        """Rank's index in its expert data-parallel group."""
        return rank // (self.ep * self.etp)

    def dense_groups(self) -> list[list[int]]:
        """Dense data-parallel groups (one per TP rank), members in group-rank order."""
        return [[t + self.tp * k for k in range(self.dp)] for t in range(self.tp)]

    def expert_groups(self) -> list[list[int]]:
        """Expert data-parallel groups (one per (ETP, EP) rank pair), in group-rank order; at
        TP = ETP = 1 :func:`nemo_lw_fp8.layout.packing.default_expert_groups`."""
        width = self.ep * self.etp
        return [[g + width * k for k in range(self.edp)] for g in range(width)]

    def initial_loads(self, dense_loads: list[int], group: list[int]) -> list[int] | None:
        """Dense Newton-Schulz work of an expert group's members (the compact patch's
        ``_expert_group_dense_loads``): ``None`` when the group leaves its first member's dense
        group, as at TP 2, ETP 1; then experts are balanced on their own."""
        dense = self.dense_groups()[group[0] % self.tp]
        return lo.expert_initial_loads(dense_loads, dense, group)

    def view(self, values: list[int], expert: bool) -> list[int]:
        """A per-member vector of a (dense or expert) data-parallel group over the stage's
        ranks (every group of a kind holds the same shapes)."""
        member = self.expert_member if expert else self.dense_member
        return [values[member(r)] for r in range(self.n)]


def ns_cost(shape: tuple[int, ...], spec: ParamSpec, mode: str) -> int:
    """Newton-Schulz work of one owner for a matrix of local ``shape`` cut from ``spec`` under
    ``muon_tp_mode``: ``blockwise`` runs on the shard; ``duplicated`` all-gathers the shard over
    TP and every TP rank runs the whole; ``distributed`` keeps the shard and all-reduces the Gram
    matrix of the unsplit side ``k``, so a rank does ``k * k * p / tp`` (``p`` the full split
    side; the warning of ``newton_schulz_tp``: splitting the short side costs more)."""
    if mode not in MUON_TP_MODES:
        raise ValueError(f"muon_tp_mode must be one of {MUON_TP_MODES}, got {mode!r}")
    if spec.tp_dim is None or spec.tp == 1 or mode == "blockwise":
        return lo.newton_schulz_cost(shape)
    full = list(shape)
    full[spec.tp_dim] *= spec.tp
    if mode == "duplicated":
        return lo.newton_schulz_cost(tuple(full))
    stack = 1 if len(full) == 2 else full[0]
    split = full[spec.tp_dim]
    other = full[-1] if spec.tp_dim == len(full) - 2 else full[-2]
    return stack * other * other * split // spec.tp


#: megatron's ``OptimizerConfig.muon_num_ns_steps`` default: Newton-Schulz iterations per update.
NS_STEPS = 5


def _ring_all_reduce(world: int, nbytes: int) -> int:
    """Bytes one rank receives in a ring all-reduce of ``nbytes`` (reduce-scatter, all-gather)."""
    return 2 * (world - 1) * nbytes // world


def tp_comm_bytes(
    shape: tuple[int, ...], spec: ParamSpec, mode: str, ns_steps: int = NS_STEPS
) -> int:
    """Bytes one TP rank receives over the TP group while Newton-Schulz orthogonalizes an owned
    piece of local ``shape`` cut from ``spec`` (``emerging_optimizers``' ``newton_schulz_tp``):

    * ``duplicated``: one ``all_gather`` of the fp32 momentum-updated gradient, ``tp - 1``
      shards of ``shape``;
    * ``distributed``: each of the ``ns_steps`` iterations all-reduces the fp32 Gram matrix of
      the unsplit side ``k`` (``k x k`` per stacked matrix), and the normalisation all-reduces
      one fp32 sum of squares per stacked matrix first; ring all-reduces, ``2 (tp - 1) / tp`` of
      each;
    * ``blockwise``, whole parameters and TP 1: nothing.

    fp32 because megatron runs Newton-Schulz at the default matmul precision; under
    ``torch.set_float32_matmul_precision("medium")`` the Gram matrices would be bf16."""
    if mode not in MUON_TP_MODES:
        raise ValueError(f"muon_tp_mode must be one of {MUON_TP_MODES}, got {mode!r}")
    if mode == "blockwise" or spec.tp_dim is None or spec.tp == 1:
        return 0
    tp = spec.tp
    if mode == "duplicated":
        numel = 1
        for d in shape:
            numel *= d
        return numel * (tp - 1) * 4
    full = list(shape)
    full[spec.tp_dim] *= tp
    stack = 1 if len(full) == 2 else full[0]
    other = full[-1] if spec.tp_dim == len(full) - 2 else full[-2]
    gram = _ring_all_reduce(tp, stack * other * other * 4)
    return ns_steps * gram + _ring_all_reduce(tp, stack * 4)
