"""The six MoE architectures as explicit hyper-parameters, and their tiny twins.

Why this module exists: Megatron-Bridge 0.6.2's recipes fetch Hugging Face configs at build time;
this plugin must build the same models offline, so every number megatron-core's
``TransformerConfig`` / ``MLATransformerConfig`` needs is written down here, under megatron's own
field names (``MoEArchitecture.provider_kwargs()`` hands them to a Bridge model provider).

* :class:`MoEArchitecture` and the six published models: DeepSeek-V3 (671B), DeepSeek-V2-Lite
  (15.7B), Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Next-80B-A3B, Qwen3.5-35B-A3B (text model),
  in :data:`ARCHITECTURES` (:func:`get_architecture` looks one up by any spelling);
* :func:`tiny`: a same-structure model that trains on 2 CPU ranks in seconds.

This is the one place a model's numbers are written down: sizes (:mod:`.counting`), parameter
shapes (:mod:`.shapes`) and parallelism (:mod:`.parallel`) all read this table; it imports
none of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True, kw_only=True)
class MoEArchitecture:
    """Hyper-parameters of one decoder-only MoE model, named as megatron-core's config fields.

    Lists that megatron accepts as ``list`` (``moe_layer_freq``, ``linear_attention_freq``) are
    tuples here so the instance stays hashable; :meth:`provider_kwargs` turns them into lists.
    ``None`` means "megatron's default / not used by this model".
    """

    name: str
    published_total_params: float  # as published (671e9 for DeepSeek-V3 ...)
    vision_params_in_published: int = 0  # part of the published total this text model lacks

    # trunk
    num_layers: int
    hidden_size: int
    vocab_size: int
    seq_length: int = 4096  # what the Bridge pretraining recipes train with
    max_position_embeddings: int
    make_vocab_size_divisible_by: int = 128
    normalization: str = "RMSNorm"
    layernorm_epsilon: float = 1e-6
    layernorm_zero_centered_gamma: bool = False
    gated_linear_unit: bool = True  # SwiGLU: linear_fc1 has 2 x ffn rows
    # torch.nn.functional name; megatron's default is gelu, all six models use SiLU (SwiGLU;
    # Gated DeltaNet also gates its output and activates its convolution with it)
    activation_func: str = "silu"
    add_bias_linear: bool = False
    untie_embeddings_and_output_weights: bool = True

    # attention (GQA fields; MLA below)
    num_attention_heads: int
    num_query_groups: int | None = None
    kv_channels: int | None = None
    qk_layernorm: bool = False
    attention_output_gate: bool = False
    position_embedding_type: str = "rope"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0

    # multi-latent attention (MLATransformerConfig); q_lora_rank None = plain linear_q_proj
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_head_dim: int | None = None
    qk_pos_emb_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_type: str | None = None  # "yarn" for DeepSeek
    rotary_scaling_factor: float | None = None
    original_max_position_embeddings: int | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    # hybrid linear attention (Gated DeltaNet), as Bridge's qwen3_next / qwen35 bridges set them
    experimental_attention_variant: str | None = None  # "gated_delta_net"
    linear_attention_freq: int | tuple[int, ...] | None = None  # N: layers i with (i+1)%N==0 SDPA
    linear_conv_kernel_dim: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None

    # MLP / MoE
    ffn_hidden_size: int | None = None  # dense layers only
    num_moe_experts: int
    moe_ffn_hidden_size: int
    moe_router_topk: int
    moe_layer_freq: int | tuple[int, ...] = 1  # tuple: 0 = dense, 1 = MoE, per layer
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_enable_expert_bias: bool = False
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0

    # multi-token prediction
    mtp_num_layers: int | None = None

    # -- derived views ------------------------------------------------------------------------

    def moe_layer_pattern(self) -> list[int]:
        """Per decoder layer: 1 = MoE, 0 = dense (megatron's reading of ``moe_layer_freq``)."""
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return [1 if i % freq == 0 else 0 for i in range(self.num_layers)]
        if len(freq) != self.num_layers:
            raise ValueError(f"{self.name}: moe_layer_freq has {len(freq)} entries, not layers")
        return list(freq)

    def linear_attention_pattern(self) -> list[int]:
        """Per decoder layer: 1 = Gated DeltaNet, 0 = softmax attention (megatron's rule)."""
        freq = self.linear_attention_freq
        if freq is None:
            return [0] * self.num_layers
        if isinstance(freq, int):
            return [0 if (i + 1) % freq == 0 else 1 for i in range(self.num_layers)]
        if len(freq) != self.num_layers:
            raise ValueError(f"{self.name}: linear_attention_freq length != num_layers")
        return list(freq)

    @property
    def first_k_dense(self) -> int:
        """Leading dense layers (DeepSeek's ``first_k_dense_replace``)."""
        pattern = self.moe_layer_pattern()
        k = pattern.index(1) if 1 in pattern else len(pattern)
        if any(v == 0 for v in pattern[k:]):
            raise ValueError(f"{self.name}: dense layers after the first MoE layer")
        return k

    @property
    def attention_kind(self) -> str:
        """Attention kind for tables: "MLA", "GQA" or "GQA+GDN" (hybrid)."""
        if self.multi_latent_attention:
            return "MLA"
        return "GQA+GDN" if self.experimental_attention_variant else "GQA"

    def provider_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for a Bridge ``GPTModelProvider`` / ``MLAModelProvider`` (megatron
        field names; ``None`` values, which leave megatron's default, and this module's
        bookkeeping fields left out)."""
        skip = {
            "name",
            "published_total_params",
            "vision_params_in_published",
            "max_position_embeddings",  # HF's; Bridge maps it to seq_length, set from the recipe
        }
        out: dict[str, Any] = {}
        for key, value in self.__dict__.items():
            # MLA's q_lora_rank=None means "no q LoRA", not megatron's default 512
            keep_none = key == "q_lora_rank" and self.multi_latent_attention
            if key in skip or (value is None and not keep_none):
                continue
            if key == "activation_func":
                import torch.nn.functional as F

                out[key] = getattr(F, value)
                continue
            if key == "untie_embeddings_and_output_weights":
                out["share_embeddings_and_output_weights"] = not value
                continue
            out[key] = list(value) if isinstance(value, tuple) else value
        return out


def _first_k_dense(k: int, layers: int) -> tuple[int, ...]:
    return (0,) * k + (1,) * (layers - k)


# DeepSeek-V3 config.json: 61 layers, first_k_dense_replace 3, n_routed_experts 256 (top-8 in
# n_group 8 / topk_group 4, sigmoid + noaux_tc bias, routed_scaling_factor 2.5), 1 shared expert,
# MLA (q_lora 1536, kv_lora 512, nope 128, rope 64, v 128), yarn factor 40, 1 MTP layer.
DEEPSEEK_V3 = MoEArchitecture(
    name="deepseek-v3",
    published_total_params=671e9,
    num_layers=61,
    hidden_size=7168,
    vocab_size=129280,
    max_position_embeddings=163840,
    make_vocab_size_divisible_by=1280,  # Bridge's DeepSeekV3Bridge
    num_attention_heads=128,
    qk_layernorm=True,  # MLA: the q / kv LoRA norms
    multi_latent_attention=True,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_head_dim=128,
    qk_pos_emb_head_dim=64,
    v_head_dim=128,
    rope_type="yarn",
    rotary_scaling_factor=40.0,
    original_max_position_embeddings=4096,
    mscale=1.0,
    mscale_all_dim=1.0,
    ffn_hidden_size=18432,
    num_moe_experts=256,
    moe_ffn_hidden_size=2048,
    moe_router_topk=8,
    moe_layer_freq=_first_k_dense(3, 61),
    moe_shared_expert_intermediate_size=2048,
    moe_router_score_function="sigmoid",
    moe_router_pre_softmax=True,
    moe_router_enable_expert_bias=True,
    moe_router_num_groups=8,
    moe_router_group_topk=4,
    moe_router_topk_scaling_factor=2.5,
    moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=1e-4,
    mtp_num_layers=1,
)

# DeepSeek-V2-Lite config.json: 27 layers, first_k_dense_replace 1, 64 routed experts top-6
# (softmax, greedy, routed_scaling_factor 1.0), 2 shared experts of 1408, MLA without q LoRA.
DEEPSEEK_V2_LITE = MoEArchitecture(
    name="deepseek-v2-lite",
    published_total_params=15.7e9,
    num_layers=27,
    hidden_size=2048,
    vocab_size=102400,
    max_position_embeddings=163840,
    make_vocab_size_divisible_by=3200,  # Bridge's DeepSeekV2Bridge
    num_attention_heads=16,
    qk_layernorm=True,
    multi_latent_attention=True,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_head_dim=128,
    qk_pos_emb_head_dim=64,
    v_head_dim=128,
    rope_type="yarn",
    rotary_scaling_factor=40.0,
    original_max_position_embeddings=4096,
    mscale=0.707,
    mscale_all_dim=0.707,
    ffn_hidden_size=10944,
    num_moe_experts=64,
    moe_ffn_hidden_size=1408,
    moe_router_topk=6,
    moe_layer_freq=_first_k_dense(1, 27),
    moe_shared_expert_intermediate_size=2 * 1408,
    moe_router_pre_softmax=True,
    moe_router_topk_scaling_factor=1.0,
    moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=1e-3,
)

# Qwen3-30B-A3B config.json: 48 layers, all MoE (128 experts of 768, top-8), GQA 32 / 4 of 128.
QWEN3_30B_A3B = MoEArchitecture(
    name="qwen3-30b-a3b",
    published_total_params=30.5e9,
    num_layers=48,
    hidden_size=2048,
    vocab_size=151936,
    max_position_embeddings=40960,
    num_attention_heads=32,
    num_query_groups=4,
    kv_channels=128,
    qk_layernorm=True,
    rotary_base=1_000_000.0,
    ffn_hidden_size=6144,  # in config.json, unused (no dense layer)
    num_moe_experts=128,
    moe_ffn_hidden_size=768,
    moe_router_topk=8,
    moe_router_load_balancing_type="global_aux_loss",
    moe_aux_loss_coeff=1e-3,
)

# Qwen3-235B-A22B config.json: 94 layers, all MoE (128 experts of 1536, top-8), GQA 64 / 4.
QWEN3_235B_A22B = MoEArchitecture(
    name="qwen3-235b-a22b",
    published_total_params=235e9,
    num_layers=94,
    hidden_size=4096,
    vocab_size=151936,
    max_position_embeddings=40960,
    num_attention_heads=64,
    num_query_groups=4,
    kv_channels=128,
    qk_layernorm=True,
    rotary_base=1_000_000.0,
    ffn_hidden_size=12288,  # in config.json, unused
    num_moe_experts=128,
    moe_ffn_hidden_size=1536,
    moe_router_topk=8,
    moe_router_load_balancing_type="global_aux_loss",
    moe_aux_loss_coeff=1e-3,
)

# Qwen3-Next-80B-A3B config.json: 48 layers, full_attention_interval 4 (Gated DeltaNet on 3 of
# 4), gated GQA 16 / 2 of 256 with partial rotary 0.25, 512 experts of 512 (top-10) plus a gated
# shared expert of 512, zero-centred RMSNorm, 1 MTP layer.
QWEN3_NEXT_80B_A3B = MoEArchitecture(
    name="qwen3-next-80b-a3b",
    published_total_params=80e9,
    num_layers=48,
    hidden_size=2048,
    vocab_size=151936,
    max_position_embeddings=262144,
    layernorm_zero_centered_gamma=True,
    num_attention_heads=16,
    num_query_groups=2,
    kv_channels=256,
    qk_layernorm=True,
    attention_output_gate=True,
    rotary_base=10_000_000.0,
    rotary_percent=0.25,
    experimental_attention_variant="gated_delta_net",
    linear_attention_freq=4,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    ffn_hidden_size=5120,  # in config.json, unused
    num_moe_experts=512,
    moe_ffn_hidden_size=512,
    moe_router_topk=10,
    moe_shared_expert_intermediate_size=512,
    moe_shared_expert_gate=True,
    moe_router_load_balancing_type="global_aux_loss",
    moe_aux_loss_coeff=1e-3,
    mtp_num_layers=1,
)


def _qwen35_vision_encoder_params() -> int:
    """Qwen3.5's vision tower (depth 27, width 1152, MLP 4304, 16x16x2 patches, 2304 learned
    positions, 2x2 patch merger into the 2048-wide text model): in the published 35B, not in a
    text-only model. Counted so the published total can be compared like for like."""
    width, mlp, depth, merged = 1152, 4304, 27, 4 * 1152
    patch = 3 * 2 * 16 * 16 * width + width
    positions = 2304 * width
    block = 2 * 2 * width + (3 * width * width + 3 * width) + (width * width + width)
    block += (width * mlp + mlp) + (mlp * width + width)
    merger = 2 * width + (merged * merged + merged) + (merged * 2048 + 2048)
    return patch + positions + depth * block + merger


# Qwen3.5-35B-A3B text_config: 40 layers, full_attention_interval 4, gated GQA 16 / 2 of 256,
# 256 experts of 512 (top-8) plus a gated shared expert of 512, vocab 248320, 1 MTP layer.
QWEN3_5_35B_A3B = MoEArchitecture(
    name="qwen3.5-35b-a3b",
    published_total_params=35e9,
    vision_params_in_published=_qwen35_vision_encoder_params(),
    num_layers=40,
    hidden_size=2048,
    vocab_size=248320,
    max_position_embeddings=262144,
    layernorm_zero_centered_gamma=True,
    num_attention_heads=16,
    num_query_groups=2,
    kv_channels=256,
    qk_layernorm=True,
    attention_output_gate=True,
    rotary_base=10_000_000.0,
    rotary_percent=0.25,
    experimental_attention_variant="gated_delta_net",
    linear_attention_freq=4,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    num_moe_experts=256,
    moe_ffn_hidden_size=512,
    moe_router_topk=8,
    moe_shared_expert_intermediate_size=512,
    moe_shared_expert_gate=True,
    moe_router_load_balancing_type="global_aux_loss",
    moe_aux_loss_coeff=1e-3,
    mtp_num_layers=1,
)

ARCHITECTURES: dict[str, MoEArchitecture] = {
    a.name: a
    for a in (
        DEEPSEEK_V3,
        DEEPSEEK_V2_LITE,
        QWEN3_30B_A3B,
        QWEN3_235B_A22B,
        QWEN3_NEXT_80B_A3B,
        QWEN3_5_35B_A3B,
    )
}


def _key(name: str) -> str:
    return re.sub(r"[-_.]", "", name.lower())


def get_architecture(name: str) -> MoEArchitecture:
    """Look a model up by name; ``deepseek_v3``, ``deepseek-v3``, ``qwen3_5_35b_a3b`` all work."""
    for arch in ARCHITECTURES.values():
        if _key(arch.name) == _key(name):
            return arch
    raise KeyError(f"unknown architecture {name!r}; known: {', '.join(ARCHITECTURES)}")


# ----------------------------------------------------------------------------- tiny twins


def tiny(
    arch: MoEArchitecture, *, num_layers: int | None = None, tensor_parallel: int = 1
) -> MoEArchitecture:
    """A same-structure model small enough for 2 CPU ranks (seconds per step).

    Kept: attention kind (MLA with / without q LoRA, gated GQA, hybrid Gated DeltaNet pattern),
    leading dense layers, shared experts (and their gate), router kind (sigmoid + expert bias +
    group-limited routing), MTP, untied output layer. Widths are multiples of 32 (MXFP8 blocks),
    expert widths of 128 (TE's grouped MXFP8 tensors lay out scales alike in its kernel and its
    Python only for multiples of 128, docs/te-modules.md);
    8 experts split over EP 1, 2, 4 or 8; top-2. ``num_layers``: another depth (recipe twins
    give each pipeline stage its layers).

    ``tensor_parallel``: the TP size the model will be sharded at (a twin of a TP > 1 recipe).
    Above 1, every width TP splits (attention heads x kv channels, the fused QKV rows, the dense
    and shared-expert FFN) gives each shard whole 128-wide blockwise tiles (so whole 32-wide
    MXFP8 blocks too; rule ``fp8-gather-tp-block-boundary``) and the query groups divide by TP.
    For MLA, 4 x TP heads of 32 (+ 32 rotary) channels: each shard holds 128 ``linear_proj``
    columns (heads x v_head_dim) and 256 rows of the q and kv up projections (heads x (qk +
    rotary), heads x (qk + v)); the q / kv down projections are not split (TP-duplicated). At 1
    the widths are the ones every tiny recipe has always had. Hybrid layers keep their widths:
    FP8 gather refuses Gated DeltaNet at TP > 1 (``fp8-gather-tensor-parallel``).
    """
    tp = tensor_parallel
    hidden, experts, vocab = 128, 8, 512
    dense = min(arch.first_k_dense, 1)  # one leading dense layer keeps the structure
    layers = 4 if arch.experimental_attention_variant else dense + 2
    layers = num_layers or layers
    changes: dict[str, Any] = {
        "name": f"tiny-{arch.name}",
        "published_total_params": 0.0,
        "vision_params_in_published": 0,
        "num_layers": layers,
        "hidden_size": hidden,
        "vocab_size": vocab,
        "seq_length": 64,
        "max_position_embeddings": 64,
        "make_vocab_size_divisible_by": 128,
        "num_attention_heads": 4,
        "ffn_hidden_size": 128 * max(2, tp) if dense else None,
        "num_moe_experts": experts,
        "moe_ffn_hidden_size": 128,
        "moe_router_topk": 2,
        "moe_layer_freq": _first_k_dense(dense, layers) if dense else 1,
    }
    if arch.moe_shared_expert_intermediate_size:
        # keep the ratio of shared to routed width (2 for DeepSeek-V2-Lite's two shared experts)
        ratio = arch.moe_shared_expert_intermediate_size // arch.moe_ffn_hidden_size
        changes["moe_shared_expert_intermediate_size"] = 128 * max(ratio, 1) * tp
    if arch.moe_router_num_groups:
        changes |= {"moe_router_num_groups": 4, "moe_router_group_topk": 2}
    if arch.multi_latent_attention:
        changes |= {
            "num_attention_heads": 4 * tp,
            "q_lora_rank": None if arch.q_lora_rank is None else 64,
            "kv_lora_rank": 64,
            "qk_head_dim": 32,
            "qk_pos_emb_head_dim": 32,
            "v_head_dim": 32,
            "original_max_position_embeddings": 64,
        }
    else:
        # 2 heads per query group; heads x kv channels = 128 x TP (4 heads of 32 at TP 1, as
        # ever): each TP shard holds 128 linear_proj columns and 256 linear_qkv rows.
        groups = max(2, tp)
        heads = 2 * groups
        changes |= {
            "num_attention_heads": heads,
            "num_query_groups": groups,
            "kv_channels": 128 * tp // heads,
        }
    if arch.experimental_attention_variant:
        # in_proj rows 2*qk + 2*v + 2*value_heads = 1568 (megatron asserts a multiple of 32)
        changes |= {
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_num_key_heads": 8,
            "linear_num_value_heads": 16,
        }
    if arch.mtp_num_layers:
        changes["mtp_num_layers"] = 1
    return replace(arch, **changes)
