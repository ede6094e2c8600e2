"""Qwen3-MoE's HF tensors laid out as megatron's ``torch_dist`` entries, written independently
of Megatron-Bridge's mappings (the tests' reference for what an import or export must hold).

megatron stacks each layer's tensor on a first axis of ``num_layers`` (experts on the second),
fuses Q, K, V per query group (each group's query heads, then its key, then its value rows), and
fc1 of an expert as [gate; up]. The HF side keeps one tensor per projection and per expert.
"""

from __future__ import annotations

import torch

L = "model.layers.{}."
#: per-layer (megatron entry, HF name) pairs that are plain copies
PLAIN = {
    "decoder.layers.self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "decoder.layers.self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "decoder.layers.self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "decoder.layers.pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "decoder.layers.mlp.router.weight": "mlp.gate.weight",
}
TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "output_layer.weight": "lm_head.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
}
QKV = "decoder.layers.self_attention.linear_qkv.weight"
FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
FC2 = "decoder.layers.mlp.experts.experts.linear_fc2.weight"


def _qkv(hf: dict[str, torch.Tensor], prefix: str, groups: int) -> torch.Tensor:
    q, k, v = (hf[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv")
    hidden = q.shape[1]
    parts = [t.reshape(groups, -1, hidden) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, hidden)


def entries(hf: dict[str, torch.Tensor], layers: int, groups: int, experts: int) -> dict:
    """The ``torch_dist`` entries an import of ``hf`` must write."""
    out = {key: hf[name] for key, name in TOP.items()}
    for key, name in PLAIN.items():
        out[key] = torch.stack([hf[L.format(i) + name] for i in range(layers)])
    out[QKV] = torch.stack([_qkv(hf, L.format(i), groups) for i in range(layers)])

    def expert(i: int, e: int, proj: str) -> torch.Tensor:
        return hf[f"{L.format(i)}mlp.experts.{e}.{proj}_proj.weight"]

    out[FC1] = torch.stack([
        torch.stack([torch.cat([expert(i, e, "gate"), expert(i, e, "up")]) for e in range(experts)])
        for i in range(layers)
    ])  # fmt: skip
    out[FC2] = torch.stack(
        [torch.stack([expert(i, e, "down") for e in range(experts)]) for i in range(layers)]
    )
    return out


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def diverging(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> list[str]:
    """Entries whose dtype, shape or bits differ (a missing entry is an error, not a
    divergence: the comparison must reach every tensor)."""
    out = []
    for key, want in expected.items():
        got = actual[key]
        same_kind = got.dtype == want.dtype and got.shape == want.shape
        if not same_kind or not torch.equal(_bits(got), _bits(want)):
            out.append(key)
    return sorted(out)
