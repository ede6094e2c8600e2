"""The rules of layer-wise FP8 param gather at tensor parallel > 1 (issue 29).

What is verified (``tests/mechanics/test_tp_fp8_param_gather.py``, TP 2 x DP 2 on TE's own modules):
each rank's persistent FP8 weights are its TP shards, quantized and gathered over data parallel as
whole matrices are at TP 1, with MXFP8 (1x32 blocks) and blockwise FP8 (128x128 weight tiles);
standard attention (fused ``linear_qkv``), dense MLPs, MoE experts whole per rank (expert
tensor parallel 1) and expert linears split over expert tensor parallel 2, discrete
(megatron's ``SequentialMLP``) and grouped (TE's ``GroupedLinear`` with discrete weights,
``tests/mechanics/test_tp_grouped_fp8_gather.py``; megatron fuses grouped experts and builds single
grouped weights only at ETP 1: rule ``op-fuser-experts-expert-tensor-parallel``);
multi-latent attention through Bridge (``tests/bridge/test_tp_mla_training.py``: the column-parallel
q / kv up projections, the row-parallel ``linear_proj`` and the down projections duplicated on
every TP rank, MXFP8 and blockwise). Two rules:

* ``fp8-gather-tensor-parallel``: what is still unverified at TP > 1 is refused with its
  reason (hybrid Gated DeltaNet / DSA layers and a gated attention output);
* ``fp8-gather-tp-block-boundary``: a TP (or ETP) shard boundary inside a quantization block,
  read from the model's dimensions at configuration time: every sharded width per rank must be
  a whole number of blocks (MXFP8: 32; blockwise: 128).

A dimension not known at a call site (``None``: not set yet) is skipped there; the rules run
again on the built model's ``TransformerConfig`` when the optimizer is built.
"""

from __future__ import annotations

from nemo_lw_fp8.rules.settings import Settings

#: The width of a quantization block along a sharded dimension, per FP8 recipe: MXFP8 scales
#: 1x32 blocks in both directions (rowwise and columnwise copies); blockwise FP8 weights are
#: 128x128 tiles.
BLOCK_WIDTH = {"mxfp8": 32, "blockwise": 128}


def _tp_gather(s: Settings) -> bool:
    return s.layer_wise and s.fp8_param_gather


def expert_tensor_parallel(s: Settings) -> int:
    """The expert-tensor-parallel size megatron uses: ``None`` means the TP size
    (``ModelParallelConfig.__post_init__``)."""
    etp = s.expert_tensor_parallel_size
    return s.tensor_model_parallel_size if etp is None else etp


def fp8_gather_tensor_parallel(s: Settings) -> str | None:
    if not _tp_gather(s):
        return None
    tp = s.tensor_model_parallel_size
    unverified = [
        (f"model.experimental_attention_variant={s.experimental_attention_variant!r}",
         s.experimental_attention_variant, "the hybrid layers' (Gated DeltaNet / DSA) projections"),
        ("model.attention_output_gate=True", s.attention_output_gate,
         "a gated attention output's linear_qkv (Q rows doubled)"),
    ]  # fmt: skip
    for flag, on, what in unverified:
        if tp > 1 and on:
            return (
                f"layer-wise Muon with --fp8-param-gather at TP={tp} is verified with standard "
                f"attention (fused linear_qkv) and multi-latent attention only, got {flag}: "
                f"{what} have not been run with FP8 gather. Fix: set "
                "model.tensor_model_parallel_size=1 (use PP / EP for memory), or drop "
                "--fp8-param-gather."
            )
    return None


def _sharded_widths(s: Settings) -> list[tuple[str, int, int, str]]:
    """``(dimension, value, shards, what it shards)`` for each width TP / ETP splits; a
    dimension not known here is left out."""
    tp, etp = s.tensor_model_parallel_size, expert_tensor_parallel(s)
    out: list[tuple[str, int, int, str]] = []
    if s.ffn_hidden_size is not None:
        out.append(("model.ffn_hidden_size", s.ffn_hidden_size, tp,
                    "linear_fc1 rows / linear_fc2 columns"))  # fmt: skip
    heads, hidden = s.num_attention_heads, s.hidden_size
    kv = s.kv_channels
    if kv is None and heads and hidden is not None:
        kv = hidden // heads
    if heads and kv is not None and not s.multi_latent_attention:
        groups = s.num_query_groups or heads
        out.append(("model.num_attention_heads x model.kv_channels", heads * kv, tp,
                    "linear_proj columns"))  # fmt: skip
        out.append(("(model.num_attention_heads + 2 x model.num_query_groups) x "
                    "model.kv_channels", (heads + 2 * groups) * kv, tp,
                    "linear_qkv rows"))  # fmt: skip
    if heads and s.multi_latent_attention:
        out.extend(_mla_widths(s, heads, tp))
    if s.num_moe_experts:
        if s.moe_ffn_hidden_size is not None:
            out.append(("model.moe_ffn_hidden_size", s.moe_ffn_hidden_size, etp,
                        "expert linear_fc1 rows / linear_fc2 columns"))  # fmt: skip
        if s.moe_shared_expert_intermediate_size:
            out.append(("model.moe_shared_expert_intermediate_size",
                        s.moe_shared_expert_intermediate_size, tp,
                        "shared-expert linear_fc1 rows / linear_fc2 columns"))  # fmt: skip
    return out


def _mla_widths(s: Settings, heads: int, tp: int) -> list[tuple[str, int, int, str]]:
    """Multi-latent attention's TP-sharded widths: the query up projection's rows
    (``linear_q_up_proj``, or ``linear_q_proj`` without q LoRA), the key / value up projection's
    rows and ``linear_proj``'s columns, each ``heads x`` a per-head width. The down projections
    (``linear_q_down_proj``, ``linear_kv_down_proj``) are duplicated on every TP rank, whole
    matrices as at TP 1, so no TP shard cuts their blocks; their input width is
    ``hidden_size``."""
    qk, rope, v = s.qk_head_dim, s.qk_pos_emb_head_dim, s.v_head_dim
    out: list[tuple[str, int, int, str]] = []
    if qk is not None and rope is not None:
        out.append(("model.num_attention_heads x (model.qk_head_dim + "
                    "model.qk_pos_emb_head_dim)", heads * (qk + rope), tp,
                    "linear_q_up_proj rows"))  # fmt: skip
    if qk is not None and v is not None:
        out.append(("model.num_attention_heads x (model.qk_head_dim + model.v_head_dim)",
                    heads * (qk + v), tp, "linear_kv_up_proj rows"))  # fmt: skip
    if v is not None:
        out.append(("model.num_attention_heads x model.v_head_dim", heads * v, tp,
                    "linear_proj columns"))  # fmt: skip
    return out


def fp8_gather_tp_block_boundary(s: Settings) -> str | None:
    block = BLOCK_WIDTH.get(s.fp8_recipe or "")
    if not _tp_gather(s) or block is None:
        return None
    for name, value, shards, what in _sharded_widths(s):
        if shards > 1 and value % (shards * block):
            expert = "moe_ffn" in name
            size = "ETP" if expert else "TP"
            flag = f"model.{'expert_tensor' if expert else 'tensor_model'}_parallel_size"
            return (
                f"--fp8-param-gather with {s.fp8_recipe} FP8 at {size}={shards}: {name}={value} "
                f"gives each shard {value / shards:g} {what}, not a whole number of "
                f"{block}-wide quantization blocks, so a block would straddle two shards. Fix: "
                f"make {name} a multiple of {shards * block} ({size} x {block}), or change "
                f"{flag}, or drop --fp8-param-gather."
            )
    return None
