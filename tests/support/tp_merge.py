"""The per-parameter state of a tensor-parallel run put back together as one TP-1 run holds it.

Why: a ``torch_dist`` checkpoint saved at TP 2 and loaded at TP 1 must give each parameter the
fp32 master, Muon momentum and Adam moments that the TP-2 ranks held, as whole tensors. To
compare, the TP-2 shards are merged here the way megatron-core 0.19.2's ``sharded_state_dict``
places them in the checkpoint's global tensors (the load at TP 1 reads those global tensors):

* ``make_sharded_tensors_for_checkpoint`` / ``make_tp_sharded_tensor_for_checkpoint``
  (``transformer/utils.py``): TP rank ``r`` of ``T`` writes its shard at chunk ``r`` of ``T``
  along the layer's TP axis. That axis is the one the layer registers as the parameter's
  ``partition_dim``: 0 for column-parallel weights (``TELayerNormColumnParallelLinear``,
  ``TEColumnParallelLinear``, ``TELinear`` in ``column`` mode, ``VocabParallelEmbedding``, the
  output layer), 1 for row-parallel ones (``TERowParallelLinear``, ``TELinear`` in ``row``
  mode). The runs record ``partition_dim`` per parameter (tests/support/bridge_run.py,
  ``install_state_tensors``); this module takes the axis from there.
* ``apply_swiglu_sharded_factory`` (``transformer/mlp.py``): a gated ``linear_fc1`` of a dense
  MLP or shared expert (``[W; V]`` on each rank) is written as two chunks per rank, ``W_r`` at
  chunk ``r`` and ``V_r`` at chunk ``T + r`` of ``2T``, so the TP-1 weight is
  ``[W_0 .. W_{T-1}; V_0 .. V_{T-1}]``, not the ranks' rows end to end. Grouped experts are
  never TP-sharded in these runs (expert TP 1).
* The word embedding and the output layer are padded to a vocabulary multiple that grows with
  TP (``make_vocab_size_divisible_by x TP``); both entries load with
  ``allow_shape_mismatch=True`` (``VocabParallelEmbedding.sharded_state_dict``,
  ``LanguageModule.sharded_state_dict``), which copies the rows both sizes have and leaves the
  rest zero (``dist_checkpointing/strategies/torch.py``). :func:`merge_over_tp` does the same to
  ``vocab_rows``.
* QKV parts (the record's ``<weight>/qkv_part<j>``): each rank's fused ``linear_qkv`` holds
  whole query groups (``num_query_groups / T`` of them, in order), and a part is its rows of
  every group, group-major (``nemo_lw_fp8/mechanics/qkv_parts.py``); the TP-1 part is the
  ranks' parts end to end along 0.

Names follow :mod:`nemo_lw_fp8.mechanics.state_by_name`: ``pp<p>/chunk<c>/[ep<e>/]tp<r>/<name>``
for a TP-sharded parameter, without ``tp<r>/`` otherwise (and at TP 1).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

_TP = re.compile(r"^(?P<head>(?:pp\d+/chunk\d+/)(?:ep\d+/)?)tp(?P<rank>\d+)/(?P<tail>.+)$")
_PART = re.compile(r"^(?P<base>.+)/qkv_part\d+$")
#: Parameters padded along the vocabulary (axis 0), loaded with ``allow_shape_mismatch``.
VOCAB_PARAMETERS = ("embedding.word_embeddings.weight", "output_layer.weight")

State = dict[str, dict[str, torch.Tensor]]


def _is_gated_fc1(tail: str) -> bool:
    """A dense MLP's or shared expert's ``linear_fc1`` weight (megatron wraps its sharded entry
    in ``apply_swiglu_sharded_factory`` when the MLP is gated); grouped experts are not
    TP-sharded here."""
    return tail.endswith("linear_fc1.weight") and ".experts.experts." not in tail


def _cat_swiglu(shards: list[torch.Tensor]) -> torch.Tensor:
    """``[W_0 .. W_{T-1}; V_0 .. V_{T-1}]`` from each rank's ``[W_r; V_r]``."""
    halves = [torch.chunk(shard, 2, dim=0) for shard in shards]
    return torch.cat([w for w, _ in halves] + [v for _, v in halves], dim=0)


def _to_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """The rows an ``allow_shape_mismatch`` load keeps: the first ``rows``, zeros past the
    saved ones."""
    if tensor.shape[0] >= rows:
        return tensor[:rows]
    pad = torch.zeros((rows - tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype)
    return torch.cat([tensor, pad], dim=0)


def merge_over_tp(
    ranks: Iterable[State],
    partition_dim: dict[str, int],
    gated: bool,
    vocab_rows: int | None = None,
) -> State:
    """One TP-1 state from every rank's state of a TP run (ranks holding the same entry must
    agree: replicas across TP or DP). ``partition_dim``: the TP axis of each sharded
    parameter, keyed by its recorded name (``tp<r>/`` included); ``gated``: the MLPs are gated
    (SwiGLU); ``vocab_rows``: the padded vocabulary of the TP-1 run (None: as merged)."""
    whole: State = {}
    shards: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    axes: dict[str, int] = {}
    for state in ranks:
        for name, kinds in state.items():
            match = _TP.match(name)
            if match is None:
                _agree(whole, name, kinds)
                continue
            merged_name = match["head"] + match["tail"]
            held = shards.setdefault(merged_name, {})
            rank = int(match["rank"])
            if rank in held:
                _agree({merged_name: held[rank]}, merged_name, kinds)
            held[rank] = kinds
            part = _PART.match(name)
            axis = 0 if part else partition_dim[name]
            if part and partition_dim[part["base"]] != 0:
                raise ValueError(f"{name}: a QKV part of a weight not split along rows")
            if axes.setdefault(merged_name, axis) != axis:
                raise ValueError(f"{merged_name}: TP ranks disagree on the axis")
    for name, held in shards.items():
        order = sorted(held)
        if order != list(range(len(order))):
            raise ValueError(f"{name}: TP ranks {order} held it, not 0..{len(order) - 1}")
        tail = name.split("/", 2)[-1]
        merged = {}
        for kind in held[0]:
            pieces = [held[rank][kind] for rank in order]
            if _is_gated_fc1(tail) and gated and "/qkv_part" not in name:
                merged[kind] = _cat_swiglu(pieces)
            else:
                merged[kind] = torch.cat(pieces, dim=axes[name])
            if vocab_rows is not None and tail.endswith(VOCAB_PARAMETERS):
                merged[kind] = _to_rows(merged[kind], vocab_rows)
        if name in whole:
            raise ValueError(f"{name}: held both whole and as TP shards")
        whole[name] = merged
    return whole


def _agree(into: State, name: str, kinds: dict[str, torch.Tensor]) -> None:
    """Keep ``kinds`` under ``name``; a second holder must hold the same bits."""
    if name in into:
        held = into[name]
        same = held.keys() == kinds.keys() and all(
            torch.equal(held[k].view(-1).view(torch.uint8), kinds[k].view(-1).view(torch.uint8))
            for k in held
        )
        if not same:
            raise ValueError(f"{name}: two ranks hold different state")
    into[name] = kinds


def bitwise_differences(a: State, b: State) -> list[str]:
    """``name/kind`` of every entry whose bits, shape or dtype differ, or that one side lacks."""
    out = []
    for name in sorted(set(a) | set(b)):
        left, right = a.get(name, {}), b.get(name, {})
        for kind in sorted(set(left) | set(right)):
            x, y = left.get(kind), right.get(kind)
            same = (
                x is not None
                and y is not None
                and x.dtype == y.dtype
                and x.shape == y.shape
                and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
            )
            if not same:
                out.append(f"{name}/{kind}")
    return out


def without_expert_rank(state: State) -> State:
    """``state`` with the ``ep0/`` of expert parameters dropped, for runs at expert-parallel
    size 1. Why: :mod:`nemo_lw_fp8.mechanics.state_by_name` names a parameter by its EP rank when
    megatron gives it the expert process groups (``allreduce`` False), and TE's linears do that
    only at ``EP > 1`` or expert TP != TP: at TP 2 / expert TP 1 the experts are ``ep0/...``, at
    TP 1 the same experts are not. At EP 1 the rank says nothing."""
    out: State = {}
    for name, kinds in state.items():
        short = re.sub(r"^(pp\d+/chunk\d+/)ep0/", r"\1", name)
        if short in out:
            raise ValueError(f"{name}: {short} is there twice")
        out[short] = kinds
    return out
