"""Six MoE architectures as explicit hyper-parameters, their sizes, tiny twins and parallelism.

Why this module exists: Megatron-Bridge 0.6.2's recipes fetch Hugging Face configs at build time;
this plugin must build the same models offline, so every number megatron-core's
``TransformerConfig`` / ``MLATransformerConfig`` needs is written down here, under megatron's own
field names (``MoEArchitecture.provider_kwargs()`` hands them to a Bridge model provider).

Contents, top to bottom:

* :class:`MoEArchitecture` and the six published models: DeepSeek-V3 (671B), DeepSeek-V2-Lite
  (15.7B), Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Next-80B-A3B, Qwen3.5-35B-A3B (text model);
* :func:`parameter_breakdown` / :func:`count_parameters`: an analytic count, independent of
  :mod:`nemo_lw_fp8.model_shapes` (the tests check that both agree);
* :func:`tiny`: a same-structure model that trains on 2 CPU ranks in seconds;
* :class:`ParallelismDefaults` and :data:`PARALLELISM`: per model and GPU family, taken from
  Bridge 0.6.2's recipes and adapted to layer-wise Muon;
* :func:`to_model_spec`, :func:`stage_param_specs`, :func:`plan_rank`: the planner's view.

Counting convention (``count_parameters``): every parameter of the language model as
megatron-core builds it with ``share_embeddings_and_output_weights=False``, plus the DeepSeek-V3
router's ``expert_bias`` buffer (256 per MoE layer: in the published checkpoint, not trained).
Multi-token-prediction (MTP) layers are **excluded** by default (``include_mtp=True`` adds them):
DeepSeek-V3's 671B excludes its 14B MTP module, Qwen3-Next's 80B also fits only without its MTP
layer. An MTP layer here is megatron's (it shares the embedding and output layer of the main
model), so it is smaller than the checkpoint's MTP module, which stores its own copies.
Qwen3.5-35B-A3B is published as a vision-language checkpoint: its 35B includes a ~0.45B vision
encoder that a text-only pretraining run does not build (``vision_params_in_published``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from .model_shapes import SPECS, ModelSpec, ParamSpec

# ----------------------------------------------------------------------------- architecture


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


# ----------------------------------------------------------------------------- counting


def _attention_params(a: MoEArchitecture, linear: bool) -> dict[str, int]:
    """One layer's token mixer with its input norm: (matrices, norms)."""
    h = a.hidden_size
    if linear:
        assert a.linear_key_head_dim and a.linear_num_key_heads and a.linear_num_value_heads
        assert a.linear_value_head_dim and a.linear_conv_kernel_dim
        qk = a.linear_num_key_heads * a.linear_key_head_dim
        v = a.linear_num_value_heads * a.linear_value_head_dim
        # in_proj: q, k, v, output gate z, and per-value-head beta and alpha
        in_proj = (2 * qk + 2 * v + 2 * a.linear_num_value_heads) * h
        conv = (2 * qk + v) * a.linear_conv_kernel_dim  # depthwise, no bias
        heads = 2 * a.linear_num_value_heads  # dt_bias, A_log
        return {
            "linear_attention": in_proj + conv + heads + v * h,
            "norms": h + a.linear_value_head_dim,  # input norm, gated output norm
        }
    n = a.num_attention_heads
    if a.multi_latent_attention:
        assert a.qk_head_dim and a.qk_pos_emb_head_dim and a.v_head_dim and a.kv_lora_rank
        q_out = n * (a.qk_head_dim + a.qk_pos_emb_head_dim)
        if a.q_lora_rank is None:
            q, q_norm = h * q_out, 0
        else:
            q, q_norm = h * a.q_lora_rank + a.q_lora_rank * q_out, a.q_lora_rank
        kv = h * (a.kv_lora_rank + a.qk_pos_emb_head_dim)
        kv += a.kv_lora_rank * n * (a.qk_head_dim + a.v_head_dim)
        out = n * a.v_head_dim * h
        return {"attention": q + kv + out, "norms": h + q_norm + a.kv_lora_rank}
    assert a.kv_channels and a.num_query_groups
    d = a.kv_channels
    q = n * d * (2 if a.attention_output_gate else 1)
    kv = 2 * a.num_query_groups * d
    norms = h + (2 * d if a.qk_layernorm else 0)
    return {"attention": (q + kv) * h + n * d * h, "norms": norms}


def _mlp_params(a: MoEArchitecture, moe: bool) -> dict[str, int]:
    """One layer's MLP with its pre-MLP norm."""
    h = a.hidden_size
    rows = 2 if a.gated_linear_unit else 1
    if not moe:
        assert a.ffn_hidden_size
        return {"dense_mlp": (rows + 1) * a.ffn_hidden_size * h, "norms": h}
    e = a.num_moe_experts
    out = {
        "router": e * h + (e if a.moe_router_enable_expert_bias else 0),
        "routed_experts": e * (rows + 1) * a.moe_ffn_hidden_size * h,
        "norms": h,
    }
    shared = a.moe_shared_expert_intermediate_size or 0
    out["shared_experts"] = (rows + 1) * shared * h + (h if a.moe_shared_expert_gate else 0)
    return out


def parameter_breakdown(arch: MoEArchitecture, *, include_mtp: bool = False) -> dict[str, int]:
    """Parameter counts by kind (see the module docstring for the convention).

    Keys: embedding, output_layer, attention, linear_attention, dense_mlp, router (incl. the
    expert-bias buffer), routed_experts, shared_experts (incl. their gate), norms, mtp.
    """
    h = arch.hidden_size
    total = dict.fromkeys(
        (
            "embedding",
            "output_layer",
            "attention",
            "linear_attention",
            "dense_mlp",
            "router",
            "routed_experts",
            "shared_experts",
            "norms",
            "mtp",
        ),
        0,
    )
    total["embedding"] = arch.vocab_size * h
    if arch.untie_embeddings_and_output_weights:
        total["output_layer"] = arch.vocab_size * h
    for linear, moe in zip(arch.linear_attention_pattern(), arch.moe_layer_pattern(), strict=True):
        for part in (_attention_params(arch, bool(linear)), _mlp_params(arch, bool(moe))):
            for key, value in part.items():
                total[key] += value
    total["norms"] += h  # final norm
    if include_mtp and arch.mtp_num_layers:
        per_layer = 2 * h + 2 * h * h + h  # enorm, hnorm, eh_proj, final norm
        per_layer += sum(_attention_params(arch, False).values())
        per_layer += sum(_mlp_params(arch, True).values())
        total["mtp"] = arch.mtp_num_layers * per_layer
    return total


def count_parameters(arch: MoEArchitecture, *, include_mtp: bool = False) -> int:
    """Total parameters of the language model (MTP layers only with ``include_mtp``)."""
    return sum(parameter_breakdown(arch, include_mtp=include_mtp).values())


def published_comparison(arch: MoEArchitecture) -> tuple[int, float]:
    """(our count made comparable to the published total, relative delta). Adds the vision
    encoder a text-only model lacks where the published number includes one."""
    ours = count_parameters(arch) + arch.vision_params_in_published
    return ours, (ours - arch.published_total_params) / arch.published_total_params


# ----------------------------------------------------------------------------- tiny twins


def tiny(arch: MoEArchitecture) -> MoEArchitecture:
    """A same-structure model small enough for 2 CPU ranks (seconds per step).

    Kept: attention kind (MLA with / without q LoRA, gated GQA, hybrid Gated DeltaNet pattern),
    leading dense layers, shared experts (and their gate), router kind (sigmoid + expert bias +
    group-limited routing), MTP, untied output layer. Widths are multiples of 32 (MXFP8 blocks);
    8 experts split over EP 1, 2, 4 or 8; top-2.
    """
    hidden, experts, vocab = 128, 8, 512
    dense = min(arch.first_k_dense, 1)  # one leading dense layer keeps the structure
    layers = 4 if arch.experimental_attention_variant else dense + 2
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
        "ffn_hidden_size": 256 if dense else None,
        "num_moe_experts": experts,
        "moe_ffn_hidden_size": 64,
        "moe_router_topk": 2,
        "moe_layer_freq": _first_k_dense(dense, layers) if dense else 1,
    }
    if arch.moe_shared_expert_intermediate_size:
        # keep the ratio of shared to routed width (2 for DeepSeek-V2-Lite's two shared experts)
        ratio = arch.moe_shared_expert_intermediate_size // arch.moe_ffn_hidden_size
        changes["moe_shared_expert_intermediate_size"] = 64 * max(ratio, 1)
    if arch.moe_router_num_groups:
        changes |= {"moe_router_num_groups": 4, "moe_router_group_topk": 2}
    if arch.multi_latent_attention:
        changes |= {
            "q_lora_rank": None if arch.q_lora_rank is None else 64,
            "kv_lora_rank": 64,
            "qk_head_dim": 32,
            "qk_pos_emb_head_dim": 32,
            "v_head_dim": 32,
            "original_max_position_embeddings": 64,
        }
    else:
        changes |= {"num_query_groups": 2, "kv_channels": 32}
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


# ----------------------------------------------------------------------------- parallelism


@dataclass(frozen=True, kw_only=True)
class ParallelismDefaults:
    """Where one model trains on one GPU family, with Muon-specific choices explained.

    ``pipeline_layout`` is megatron's layout string (``E`` embedding, ``t`` decoder layer, ``m``
    MTP layer, ``L`` loss, ``|`` between virtual stages listed in megatron's order: all PP ranks
    of virtual stage 0, then of stage 1, ...). ``None`` means megatron's even split, with the
    embedding / loss counted as a layer when the ``account_for_*`` flags say so.
    """

    recipe: str  # the Bridge 0.6.2 recipe function this starts from
    muon_change: str = ""  # why it differs from that (Adam) recipe; "" if it does not
    nodes: int
    gpus_per_node: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    global_batch_size: int
    seq_length: int = 4096
    pipeline_layout: str | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def data_parallel_size(self) -> int:
        """Dense data-parallel size: world / (TP * PP * CP)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_data_parallel_size(self) -> int:
        """Expert data-parallel size: world / (ETP * EP * PP)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    def model_kwargs(self) -> dict[str, Any]:
        """The parallelism fields of a Bridge model provider (megatron names)."""
        return {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.vpp,
            "expert_model_parallel_size": self.ep,
            "expert_tensor_parallel_size": self.etp,
            "context_parallel_size": self.cp,
            "sequence_parallel": self.sequence_parallel,
            "seq_length": self.seq_length,
            "pipeline_model_parallel_layout": self.pipeline_layout,
            "account_for_embedding_in_pipeline_split": self.account_for_embedding_in_pipeline_split,
            "account_for_loss_in_pipeline_split": self.account_for_loss_in_pipeline_split,
        }

    def train_kwargs(self) -> dict[str, int]:
        """The batch fields of Bridge's ``TrainingConfig``."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "global_batch_size": self.global_batch_size,
        }

    def stages(self, arch: MoEArchitecture) -> list[list[str]]:
        """Virtual pipeline stages in megatron's order, each a list of "E", "t", "m", "L"."""
        count = self.pp * (self.vpp or 1)
        if self.pipeline_layout is not None:
            return _unroll_layout(self.pipeline_layout)
        mtp = arch.mtp_num_layers or 0
        units = arch.num_layers + self.account_for_embedding_in_pipeline_split
        units += self.account_for_loss_in_pipeline_split
        if units % count:
            raise ValueError(f"{arch.name}: {units} layers do not split into {count} stages")
        per = units // count
        stages: list[list[str]] = []
        left = arch.num_layers
        for s in range(count):
            n = per
            n -= self.account_for_embedding_in_pipeline_split and s == 0
            n -= self.account_for_loss_in_pipeline_split and s == count - 1
            stages.append((["E"] if s == 0 else []) + ["t"] * n)
            left -= n
        stages[-1] += ["m"] * mtp + ["L"]
        assert left == 0
        return stages

    def rank_stages(self, arch: MoEArchitecture, pp_rank: int) -> list[str]:
        """Everything pipeline rank ``pp_rank`` holds (all its virtual stages)."""
        stages = self.stages(arch)
        return [x for s in stages[pp_rank :: self.pp] for x in s]


def _unroll_layout(layout: str) -> list[list[str]]:
    """Megatron's layout grammar: ``(...)*n`` and ``x*n`` repeat, ``|`` separates stages."""
    text = layout.replace(",", "")
    while "(" in text:
        unrolled = re.sub(r"\(([^()]*)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
        if unrolled == text:
            raise ValueError(f"bad pipeline layout {layout!r}")
        text = unrolled
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    return [list(stage) for stage in text.split("|")]


# DeepSeek-V3's 16-stage layout from Bridge's set_deepseek_v3_pipeline_model_parallel_layout
# ((16,1), (8,2), (4,4) share it): embedding + 4 layers, 14 x 4 layers, 1 layer + MTP + loss.
_DSV3_16_STAGES = "Et*4|(t*4|)*14tmL"

GPU_FAMILIES = ("h100", "b200", "gb200")

# Why layer-wise Muon changes what Adam recipes do: Muon orthogonalises whole matrices, one owner
# rank each. TP > 1 splits every dense matrix, so Newton-Schulz needs the shards gathered (or
# runs on pieces, which is not Muon); ETP > 1 does the same to experts. Hence TP = ETP = 1, with
# PP / EP taking over the memory TP saved. Everything else follows the cited recipe.
PARALLELISM: dict[str, dict[str, ParallelismDefaults]] = {
    "deepseek-v3": {
        "h100": ParallelismDefaults(
            recipe="perf_recipes deepseek_v3_pretrain_1024gpu_h100_fp8cs_config (TP2 PP8 VP4 EP64)",
            muon_change="TP2 -> 1 (whole matrices), PP8 VP4 -> PP16 as DeepSeek's own H800 run",
            nodes=128,
            gpus_per_node=8,
            pp=16,
            ep=64,
            global_batch_size=16384,
            pipeline_layout=_DSV3_16_STAGES,
        ),
        "b200": ParallelismDefaults(
            recipe="perf_recipes deepseek_v3_pretrain_256gpu_b200_fp8mx_config",
            nodes=32,
            gpus_per_node=8,
            pp=8,
            vpp=2,
            ep=8,
            global_batch_size=4096,
            pipeline_layout=_DSV3_16_STAGES,
        ),
        "gb200": ParallelismDefaults(
            recipe="perf_recipes deepseek_v3_pretrain_256gpu_gb200_fp8mx_config",
            nodes=64,
            gpus_per_node=4,
            pp=4,
            vpp=4,
            ep=64,
            global_batch_size=4096,
            pipeline_layout=_DSV3_16_STAGES,
        ),
    },
    "deepseek-v2-lite": {
        "h100": ParallelismDefaults(
            recipe="recipes deepseek_v2_lite_pretrain_8gpu_h100_bf16_config",
            nodes=1,
            gpus_per_node=8,
            ep=8,
            global_batch_size=512,
        ),
        "b200": ParallelismDefaults(
            recipe="recipes deepseek_v2_lite_pretrain_8gpu_h100_bf16_config (no B200 recipe)",
            nodes=1,
            gpus_per_node=8,
            ep=8,
            global_batch_size=512,
        ),
        "gb200": ParallelismDefaults(
            recipe="recipes deepseek_v2_lite_pretrain_8gpu_h100_bf16_config (no GB200 recipe)",
            nodes=2,
            gpus_per_node=4,
            ep=8,
            global_batch_size=512,
        ),
    },
    "qwen3-30b-a3b": {
        "h100": ParallelismDefaults(
            recipe="perf_recipes qwen3_30b_a3b_pretrain_16gpu_h100_fp8cs_config",
            nodes=2,
            gpus_per_node=8,
            ep=16,
            global_batch_size=1024,
        ),
        "b200": ParallelismDefaults(
            recipe="perf_recipes qwen3_30b_a3b_pretrain_8gpu_b200_fp8mx_config",
            nodes=1,
            gpus_per_node=8,
            ep=8,
            micro_batch_size=4,
            global_batch_size=512,
        ),
        "gb200": ParallelismDefaults(
            recipe="perf_recipes qwen3_30b_a3b_pretrain_8gpu_gb200_fp8mx_config",
            nodes=2,
            gpus_per_node=4,
            ep=8,
            micro_batch_size=4,
            global_batch_size=512,
        ),
    },
    "qwen3-235b-a22b": {
        "h100": ParallelismDefaults(
            recipe="perf_recipes qwen3_235b_a22b_pretrain_256gpu_h100_fp8cs_config (TP2 SP)",
            muon_change="TP2 -> 1 (attention is 3% of the weights; recompute pays for activations)",
            nodes=32,
            gpus_per_node=8,
            pp=8,
            vpp=4,
            ep=32,
            global_batch_size=8192,
            account_for_embedding_in_pipeline_split=True,
            account_for_loss_in_pipeline_split=True,
        ),
        "b200": ParallelismDefaults(
            recipe="perf_recipes qwen3_235b_a22b_pretrain_256gpu_b200_fp8mx_config",
            nodes=32,
            gpus_per_node=8,
            pp=8,
            vpp=3,
            ep=8,
            global_batch_size=8192,
            account_for_embedding_in_pipeline_split=True,
            account_for_loss_in_pipeline_split=True,
        ),
        "gb200": ParallelismDefaults(
            recipe="perf_recipes qwen3_235b_a22b_pretrain_256gpu_gb200_fp8mx_config",
            nodes=64,
            gpus_per_node=4,
            pp=8,
            vpp=3,
            ep=32,
            global_batch_size=8192,
            account_for_embedding_in_pipeline_split=True,
            account_for_loss_in_pipeline_split=True,
        ),
    },
    "qwen3-next-80b-a3b": {
        "h100": ParallelismDefaults(
            recipe="perf_recipes qwen3_next_80b_a3b_pretrain_128gpu_h100_fp8cs_config",
            nodes=16,
            gpus_per_node=8,
            ep=128,
            global_batch_size=1024,
        ),
        "b200": ParallelismDefaults(
            recipe="perf_recipes qwen3_next_80b_a3b_pretrain_64gpu_b200_fp8mx_config",
            nodes=8,
            gpus_per_node=8,
            ep=64,
            global_batch_size=1024,
        ),
        "gb200": ParallelismDefaults(
            recipe="perf_recipes qwen3_next_80b_a3b_pretrain_64gpu_gb200_fp8mx_config",
            nodes=16,
            gpus_per_node=4,
            pp=2,
            vpp=4,
            ep=32,
            micro_batch_size=2,
            global_batch_size=1024,
            pipeline_layout="Et*4|(t*7|)*5t*8|tmL",
        ),
    },
    "qwen3.5-35b-a3b": {
        "h100": ParallelismDefaults(
            recipe="perf_recipes qwen35_vl_35b_a3b_pretrain_16gpu_h100_bf16_config (VL, VP12)",
            muon_change="text only: VP12 was laid out for the vision tower; plain PP2 split",
            nodes=2,
            gpus_per_node=8,
            pp=2,
            ep=8,
            global_batch_size=512,
        ),
        "b200": ParallelismDefaults(
            recipe="recipes qwen35_text_35b_a3b_pretrain_8gpu_gb200_bf16_config (no B200 one)",
            nodes=1,
            gpus_per_node=8,
            ep=8,
            global_batch_size=512,
        ),
        "gb200": ParallelismDefaults(
            recipe="recipes qwen35_text_35b_a3b_pretrain_8gpu_gb200_bf16_config",
            nodes=2,
            gpus_per_node=4,
            ep=8,
            global_batch_size=512,
        ),
    },
}


def parallelism(arch: MoEArchitecture | str, gpu: str) -> ParallelismDefaults:
    """The defaults for ``arch`` on ``gpu`` ("h100"/"hopper", "b200", "gb200"/"blackwell")."""
    name = arch.name if isinstance(arch, MoEArchitecture) else get_architecture(arch).name
    family = {"hopper": "h100", "h200": "h100", "blackwell": "gb200"}.get(gpu.lower(), gpu.lower())
    if family not in GPU_FAMILIES:
        raise KeyError(f"unknown GPU family {gpu!r}; known: {', '.join(GPU_FAMILIES)}")
    return PARALLELISM[name][family]


# ----------------------------------------------------------------------------- planner view


def to_model_spec(
    arch: MoEArchitecture, *, include_mtp: bool = False, name: str | None = None
) -> ModelSpec:
    """The planner's :class:`ModelSpec` (parameter shapes in megatron's registration order).

    ``include_mtp=False`` gives the published-size model (as the existing ``SPECS`` entries);
    ``True`` the model as trained when the recipe enables MTP.
    """
    if not isinstance(arch.linear_attention_freq, int | None):
        raise ValueError("ModelSpec needs an integer linear_attention_freq")
    return ModelSpec(
        name=name or arch.name,
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        vocab_size=arch.vocab_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.kv_channels,
        qk_layernorm=arch.qk_layernorm,
        attention_output_gate=arch.attention_output_gate,
        multi_latent_attention=arch.multi_latent_attention,
        q_lora_rank=arch.q_lora_rank,
        kv_lora_rank=arch.kv_lora_rank or 512,
        qk_head_dim=arch.qk_head_dim or 128,
        qk_pos_emb_head_dim=arch.qk_pos_emb_head_dim or 64,
        v_head_dim=arch.v_head_dim or 128,
        linear_attention_freq=arch.linear_attention_freq,
        linear_num_key_heads=arch.linear_num_key_heads or 16,
        linear_num_value_heads=arch.linear_num_value_heads or 32,
        linear_key_head_dim=arch.linear_key_head_dim or 128,
        linear_value_head_dim=arch.linear_value_head_dim or 128,
        linear_conv_kernel_dim=arch.linear_conv_kernel_dim or 4,
        ffn_hidden_size=arch.ffn_hidden_size,
        gated_linear_unit=arch.gated_linear_unit,
        first_k_dense_replace=arch.first_k_dense,
        num_moe_experts=arch.num_moe_experts,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=arch.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=arch.moe_shared_expert_gate,
        moe_router_expert_bias=arch.moe_router_enable_expert_bias,
        untie_embeddings_and_output_weights=arch.untie_embeddings_and_output_weights,
        mtp_num_layers=(arch.mtp_num_layers or 0) if include_mtp else 0,
        published_params=arch.published_total_params or None,
    )


def _rank_holds(spec: ParamSpec, items: list[str]) -> bool:
    """Whether a parameter lives on a pipeline rank holding ``items`` (decoder layers as "t<i>",
    MTP layers as "m<i>", "E", "L")."""
    parts = spec.name.split(".")
    if parts[0] == "embedding":
        return "E" in items
    if parts[0] == "output_layer" or spec.name == "decoder.final_layernorm.weight":
        return "L" in items  # megatron builds the final norm with the last decoder stage
    if parts[0] == "mtp":
        return f"m{parts[2]}" in items
    return f"t{parts[2]}" in items


def stage_param_specs(
    arch: MoEArchitecture, par: ParallelismDefaults, pp_rank: int, *, include_mtp: bool = True
) -> list[ParamSpec]:
    """The parameters pipeline rank ``pp_rank`` holds (TP = 1, all experts; the planner cuts
    one EP rank's share)."""
    if par.tp != 1 or par.cp != 1:
        raise ValueError("the planner models TP = CP = 1")
    items: list[str] = []
    counters = {"t": 0, "m": 0}
    for stage_index, stage in enumerate(par.stages(arch)):
        for item in stage:
            if item in counters:
                if stage_index % par.pp == pp_rank:
                    items.append(f"{item}{counters[item]}")
                counters[item] += 1
            elif stage_index % par.pp == pp_rank:
                items.append(item)
    specs = to_model_spec(arch, include_mtp=include_mtp).params()
    return [s for s in specs if _rank_holds(s, items)]


def plan_rank(
    arch: MoEArchitecture | str, gpu: str, *, pp_rank: int | None = None, **plan_kwargs: Any
) -> dict[str, Any]:
    """``planner.plan`` for one pipeline rank of ``arch`` under its :data:`PARALLELISM`
    defaults on ``gpu``: the rank holding the most parameters unless ``pp_rank`` is given.
    DP and EP are the defaults' dense data-parallel and expert-parallel sizes."""
    from . import planner  # megatron's import is paid only here

    arch = arch if isinstance(arch, MoEArchitecture) else get_architecture(arch)
    par = parallelism(arch, gpu)
    ranks = range(par.pp) if pp_rank is None else [pp_rank]
    by_rank = {r: stage_param_specs(arch, par, r) for r in ranks}
    rank = max(by_rank, key=lambda r: sum(s.numel for s in by_rank[r]))
    result = planner.plan(by_rank[rank], par.data_parallel_size, par.ep, **plan_kwargs)
    result["model"] = arch.name
    result["gpu"] = gpu
    result["pp_rank"] = rank
    return result


# The four models model_shapes did not have join the planner's lookup (published-size
# convention, no MTP, like "deepseek-v3" and "qwen3-235b-a22b" there).
for _arch in (DEEPSEEK_V2_LITE, QWEN3_30B_A3B, QWEN3_NEXT_80B_A3B, QWEN3_5_35B_A3B):
    SPECS.setdefault(_arch.name, to_model_spec(_arch))
