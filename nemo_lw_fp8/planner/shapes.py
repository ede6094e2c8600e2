"""Parameter shapes of large MoE models, built from explicit hyper-parameters (TP = PP = 1).

:func:`to_model_spec` turns an architecture of :mod:`.architectures` into a :class:`ModelSpec`;
:data:`SPECS` holds those and the hand-written ``tiny-moe`` (the planner's model names).
Nothing here downloads anything: every shape follows from the numbers in a :class:`ModelSpec`,
laid out the way megatron-core 0.19.2 builds the model with its Transformer Engine layer specs
(names, shapes and registration order of ``model.named_parameters()``):

* the input layernorm is fused into ``linear_qkv`` (GQA) or is a separate ``TENorm`` (MLA); the
  pre-MLP layernorm is fused into a dense layer's ``linear_fc1`` and is a separate norm before a
  MoE layer;
* routed experts are one 2-D parameter per expert and linear (``linear_fc1.weight<i>``,
  ``linear_fc2.weight<i>``, megatron's default ``TEGroupedLinear`` without a single grouped
  weight); gated MLPs (SwiGLU) have ``fc1`` of ``2 * ffn`` rows;
* the router weight ``(num_experts, hidden)`` is a plain parameter; DeepSeek-V3's score
  correction bias is megatron's ``router.expert_bias`` *buffer*: counted in the published total,
  not trainable, not in any optimizer.

Muon routing follows megatron's ``is_managed_by_layer_wise_optimizer``: a parameter is
Muon-managed iff it is 2-D and not an embedding or output layer. So the router weight **is**
Muon-managed (2-D), and so is every attention, MLP and expert matrix; norms, biases, the
embedding and the output layer go to Adam.

Expert-parallel parameters (``allreduce = False`` in megatron) are the routed experts only; the
shared experts and the router are replicated over the expert-parallel group. With EP = ``ep`` a
rank holds ``num_experts / ep`` experts of each MoE layer (:meth:`ParamSpec.local`).

``quantized`` marks weights of Transformer Engine linear layers: with ``fp8_param_gather`` they are
persistent MXFP8 tensors; everything else (router, embeddings, output layer, norms) stays bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from nemo_lw_fp8.recipes.architectures import ARCHITECTURES, MoEArchitecture


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as megatron-core builds it (TP = PP = 1).

    ``expert_index`` / ``num_experts`` identify a routed-expert weight so a single EP rank's view
    can be cut (:meth:`local`); a 3-D grouped expert weight ``(E, m, n)`` sets ``num_experts = E``
    and ``expert_index = None``. ``qkv_split``: on a fused ``linear_qkv`` weight, megatron's
    ``qkv_split_shapes`` (rows of Q, K, V, with ``attention_output_gate`` Q, gate, K, V, per
    query group), the parts Muon orthogonalizes separately with ``muon_split_qkv``.
    """

    name: str
    shape: tuple[int, ...]
    muon: bool
    expert_parallel: bool = False
    quantized: bool = False
    trainable: bool = True
    embedding_or_output: bool = False
    expert_index: int | None = None
    num_experts: int = 0
    qkv_split: tuple[int, ...] | None = None
    #: Tensor-parallel degree this spec is one shard of (TP, or ETP for an expert weight) and
    #: the dimension megatron partitions (``partition_dim``); 1 / ``None``: the whole parameter
    #: (:func:`.tensor_parallel.tp_shard`).
    tp: int = 1
    tp_dim: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The whole parameter's shape: what Newton-Schulz sees in ``muon_tp_mode="duplicated"``."""
        if self.tp_dim is None:
            return self.shape
        dims = list(self.shape)
        dims[self.tp_dim] *= self.tp
        return tuple(dims)

    def local(self, ep: int) -> ParamSpec | None:
        """This parameter as one expert-parallel rank (rank 0) holds it, or ``None`` if it is not
        there; every EP rank holds the same shapes, so rank 0 stands for all."""
        if not self.expert_parallel or ep == 1:
            return self
        if self.num_experts % ep:
            raise ValueError(f"{self.name}: {self.num_experts} experts do not split over EP {ep}")
        per_rank = self.num_experts // ep
        if self.expert_index is None:  # grouped (E, m, n) weight: keep E / ep experts
            return replace(self, shape=(per_rank, *self.shape[1:]), num_experts=per_rank)
        return self if self.expert_index < per_rank else None


def _matrix(
    name: str, rows: int, cols: int, *, quantized: bool = True, embedding: bool = False
) -> ParamSpec:
    return ParamSpec(
        name, (rows, cols), muon=not embedding, quantized=quantized, embedding_or_output=embedding
    )


def _vector(name: str, size: int) -> ParamSpec:
    return ParamSpec(name, (size,), muon=False)


@dataclass(frozen=True)
class ModelSpec:
    """Hyper-parameters of a decoder-only (MoE) transformer, named as in megatron's
    ``TransformerConfig``; a new model is one more instance of this class.

    Attention per layer: GQA (``num_query_groups`` KV heads of ``kv_channels``), or MLA when
    ``multi_latent_attention`` (``q_lora_rank = None`` means a plain ``linear_q_proj``), or
    Gated DeltaNet on the layers ``linear_attention_freq`` selects (every layer whose
    ``(index + 1) % linear_attention_freq != 0``, as megatron's hybrid pattern for Qwen3-Next).
    MLP per layer: dense for the first ``first_k_dense_replace`` layers, MoE after.
    """

    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    # GQA
    num_query_groups: int | None = None
    kv_channels: int | None = None
    qk_layernorm: bool = False
    attention_output_gate: bool = False
    # MLA
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # Gated DeltaNet (linear attention)
    linear_attention_freq: int | None = None
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # MLP / MoE
    ffn_hidden_size: int | None = None
    gated_linear_unit: bool = True
    first_k_dense_replace: int = 0
    num_moe_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_router_expert_bias: bool = False
    untie_embeddings_and_output_weights: bool = True
    # Multi-token prediction: megatron's ``mtp.layers.<i>`` (enorm, hnorm, eh_proj, one
    # full-attention MoE layer, final norm), registered after the decoder; 0 = published size
    mtp_num_layers: int = 0
    published_params: float | None = None  # e.g. 671e9, for the totals check

    def _fc1_rows(self, ffn: int) -> int:
        return 2 * ffn if self.gated_linear_unit else ffn

    def _is_linear_attention(self, index: int) -> bool:
        freq = self.linear_attention_freq
        return freq is not None and (index + 1) % freq != 0

    def _attention(self, p: str, index: int, full_attention: bool = False) -> list[ParamSpec]:
        h = self.hidden_size
        if not full_attention and self._is_linear_attention(index):
            qk = self.linear_num_key_heads * self.linear_key_head_dim
            v = self.linear_num_value_heads * self.linear_value_head_dim
            conv = 2 * qk + v
            return [
                _vector(f"{p}.in_proj.layer_norm_weight", h),
                _matrix(f"{p}.in_proj.weight", conv + v + 2 * self.linear_num_value_heads, h),
                ParamSpec(f"{p}.conv1d.weight", (conv, 1, self.linear_conv_kernel_dim), False),
                _vector(f"{p}.dt_bias", self.linear_num_value_heads),
                _vector(f"{p}.A_log", self.linear_num_value_heads),
                _vector(f"{p}.out_norm.weight", self.linear_value_head_dim),
                _matrix(f"{p}.out_proj.weight", h, v),
            ]
        heads = self.num_attention_heads
        if self.multi_latent_attention:
            q_out = heads * (self.qk_head_dim + self.qk_pos_emb_head_dim)
            specs = [
                _vector(f"{p}.input_layernorm.weight", h),
                _matrix(f"{p}.linear_proj.weight", h, heads * self.v_head_dim),
            ]
            if self.q_lora_rank is None:
                specs.append(_matrix(f"{p}.linear_q_proj.weight", q_out, h))
            else:
                specs += [
                    _matrix(f"{p}.linear_q_down_proj.weight", self.q_lora_rank, h),
                    _vector(f"{p}.linear_q_up_proj.layer_norm_weight", self.q_lora_rank),
                    _matrix(f"{p}.linear_q_up_proj.weight", q_out, self.q_lora_rank),
                ]
            kv_up = heads * (self.qk_head_dim + self.v_head_dim)
            specs += [
                _matrix(
                    f"{p}.linear_kv_down_proj.weight",
                    self.kv_lora_rank + self.qk_pos_emb_head_dim,
                    h,
                ),
                _vector(f"{p}.linear_kv_up_proj.layer_norm_weight", self.kv_lora_rank),
                _matrix(f"{p}.linear_kv_up_proj.weight", kv_up, self.kv_lora_rank),
            ]
            return specs
        assert self.kv_channels is not None and self.num_query_groups is not None
        q = heads * self.kv_channels * (2 if self.attention_output_gate else 1)
        kv = 2 * self.num_query_groups * self.kv_channels
        # megatron's _get_qkv_split_shapes: per query group Q (gate) K V rows
        per_group = heads // self.num_query_groups * self.kv_channels
        split = (per_group,) * (2 if self.attention_output_gate else 1) + (self.kv_channels,) * 2
        specs = [
            _matrix(f"{p}.linear_proj.weight", h, heads * self.kv_channels),
            _vector(f"{p}.linear_qkv.layer_norm_weight", h),
            replace(_matrix(f"{p}.linear_qkv.weight", q + kv, h), qkv_split=split),
        ]
        if self.qk_layernorm:
            specs += [
                _vector(f"{p}.q_layernorm.weight", self.kv_channels),
                _vector(f"{p}.k_layernorm.weight", self.kv_channels),
            ]
        return specs

    def _mlp(self, p: str, index: int) -> list[ParamSpec]:
        h = self.hidden_size
        if self.num_moe_experts is None or index < self.first_k_dense_replace:
            assert self.ffn_hidden_size is not None
            ffn = self.ffn_hidden_size
            return [
                _vector(f"{p}.mlp.linear_fc1.layer_norm_weight", h),
                _matrix(f"{p}.mlp.linear_fc1.weight", self._fc1_rows(ffn), h),
                _matrix(f"{p}.mlp.linear_fc2.weight", h, ffn),
            ]
        experts = self.num_moe_experts
        ffn = self.moe_ffn_hidden_size
        assert ffn is not None
        specs = [
            _vector(f"{p}.pre_mlp_layernorm.weight", h),
            _matrix(f"{p}.mlp.router.weight", experts, h, quantized=False),
        ]
        if self.moe_router_expert_bias:
            specs.append(
                ParamSpec(f"{p}.mlp.router.expert_bias", (experts,), False, trainable=False)
            )
        for fc, shape in (("linear_fc1", (self._fc1_rows(ffn), h)), ("linear_fc2", (h, ffn))):
            specs += [
                ParamSpec(
                    f"{p}.mlp.experts.{fc}.weight{i}",
                    shape,
                    muon=True,
                    expert_parallel=True,
                    quantized=True,
                    expert_index=i,
                    num_experts=experts,
                )
                for i in range(experts)
            ]
        shared = self.moe_shared_expert_intermediate_size
        if shared:
            specs += [
                _matrix(f"{p}.mlp.shared_experts.linear_fc1.weight", self._fc1_rows(shared), h),
                _matrix(f"{p}.mlp.shared_experts.linear_fc2.weight", h, shared),
            ]
            if self.moe_shared_expert_gate:
                specs.append(_matrix(f"{p}.mlp.shared_experts.gate_weight", 1, h, quantized=False))
        return specs

    def params(self) -> list[ParamSpec]:
        """All parameters (and counted buffers) in megatron's forward registration order."""
        h = self.hidden_size
        specs = [
            _matrix(
                "embedding.word_embeddings.weight",
                self.vocab_size,
                h,
                quantized=False,
                embedding=True,
            )
        ]
        for index in range(self.num_layers):
            prefix = f"decoder.layers.{index}"
            attn = prefix if self._is_linear_attention(index) else f"{prefix}.self_attention"
            specs += self._attention(attn, index)
            specs += self._mlp(prefix, index)
        specs.append(_vector("decoder.final_layernorm.weight", h))
        for index in range(self.mtp_num_layers):
            prefix = f"mtp.layers.{index}"
            specs += [
                _vector(f"{prefix}.enorm.weight", h),
                _vector(f"{prefix}.hnorm.weight", h),
                _matrix(f"{prefix}.eh_proj.weight", h, 2 * h),
            ]
            layer = f"{prefix}.mtp_model_layer"
            specs += self._attention(f"{layer}.self_attention", index, full_attention=True)
            specs += self._mlp(layer, self.num_layers)  # an MoE layer, like the last decoder one
            specs.append(_vector(f"{prefix}.final_layernorm.weight", h))
        if self.untie_embeddings_and_output_weights:
            specs.append(
                _matrix("output_layer.weight", self.vocab_size, h, quantized=False, embedding=True)
            )
        return specs


def to_model_spec(
    arch: MoEArchitecture, *, include_mtp: bool = False, name: str | None = None
) -> ModelSpec:
    """The planner's :class:`ModelSpec` (parameter shapes in megatron's registration order).

    ``include_mtp=False`` gives the published-size model (the :data:`SPECS` entries);
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


# A hand-written model with no architecture entry: small enough for the planner's tests.
TINY_MOE = ModelSpec(
    name="tiny-moe",
    num_layers=2,
    hidden_size=64,
    vocab_size=256,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=16,
    qk_layernorm=True,
    ffn_hidden_size=128,
    first_k_dense_replace=1,
    num_moe_experts=8,
    moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=32,
)


#: The planner's models by name, filled here and nowhere else: every architecture at its
#: published size (no MTP), derived from the one architecture table, plus the hand-written ones.
SPECS: dict[str, ModelSpec] = {
    **{name: to_model_spec(arch) for name, arch in ARCHITECTURES.items()},
    TINY_MOE.name: TINY_MOE,
}


def param_shapes(name: str) -> list[ParamSpec]:
    """The parameters of model ``name`` (a key of :data:`SPECS`), full model, all experts."""
    try:
        spec = SPECS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(SPECS))}") from None
    return spec.params()


def total_params(specs: list[ParamSpec]) -> int:
    """Element count of a parameter list (counted buffers such as ``expert_bias`` included)."""
    return sum(s.numel for s in specs)
