"""Multi-latent attention on megatron-core's local (non-TE) spec.

Behaviour: megatron-core 0.19.2's ``MLASelfAttention`` builds its core attention with
``k_channels=q_head_dim, v_channels=v_head_dim``; TE's ``DotProductAttention`` takes those, the
local ``DotProductAttention`` does not, so every DeepSeek-style model fails to build without TE
(``TypeError: unexpected keyword argument 'k_channels'``) - on CPU, and wherever TE is absent.
With this patch the local attention accepts both: queries and keys of ``k_channels`` per head
(softmax scale ``1/sqrt(k_channels)`` unless the caller passes its own, as MLA always does), values
and the output of ``v_channels`` per head. Without them it behaves exactly as before.

Mirrors: no upstream pull request yet (a bug in 0.19.2's local MLA spec; see
``docs/recipes.md``). The number recorded below is 0.

Patches: ``DotProductAttention.__init__`` (wrapped: the two keywords are consumed, the original
runs, then the per-partition output width is set from ``v_channels``).

Verdict: the record's (``patches/record.py``): applied over every recorded build, checked by the
fingerprint of each object it wraps; never decided by reading upstream's source.
"""

from __future__ import annotations

import math
from typing import Any

from nemo_lw_fp8.patches.framework import Override, Patch, register

FEATURE = "mla_local_attention"


def _make_init(original):
    def __init__(
        self,
        config: Any,
        *args: Any,
        k_channels: int | None = None,
        v_channels: int | None = None,
        **kwargs: Any,
    ) -> None:
        if k_channels is not None and kwargs.get("softmax_scale") is None and len(args) < 5:
            kwargs["softmax_scale"] = 1.0 / math.sqrt(k_channels)
        original(self, config, *args, **kwargs)
        if k_channels is not None:
            self.hidden_size_per_attention_head = k_channels
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    return __init__


def _build_overrides() -> list[Override]:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return [
        Override(
            DotProductAttention, "__init__", _make_init(DotProductAttention.__dict__["__init__"])
        )
    ]


PATCH = register(
    Patch(
        name=FEATURE,
        upstream_pr=0,
        summary="local DotProductAttention accepts MLA's k_channels / v_channels",
        build_overrides=_build_overrides,
    )
)
