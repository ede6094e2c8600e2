"""What every configuration rule reads and returns: :class:`Settings` (a flat view of megatron's
configs under megatron's names), :class:`Rule` and :class:`ConfigError`.

A module of its own so that the rule modules (:mod:`.fp8`, :mod:`.grouped`, :mod:`.integration`,
:mod:`.scope`) and the catalogue (:mod:`nemo_lw_fp8.rules`, which lists them all in ``RULES``
and runs them) import it without importing each other.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from nemo_lw_fp8.errors import ConfigError as ConfigError
from nemo_lw_fp8.vocabulary import DEFAULT_GATHER_PADDING_TOLERANCE


@dataclass(frozen=True)
class Settings:
    """The settings the rules read, under megatron's names (CLI flags in the messages)."""

    optimizer: str = "adam"
    use_layer_wise_distributed_optimizer: bool = False
    use_distributed_optimizer: bool = False
    #: How layer-wise buffers are laid out: "padded" (0.19.2's shard-aligned layout),
    #: "legacy" (no layout, flatten + all_gather), or "compact" (issue #5).
    layer_wise_layout: str = "padded"
    fp8_recipe: str | None = None
    fp8_param_gather: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    overlap_param_gather: bool = False
    bf16: bool = True
    num_distributed_optimizer_instances: int = 1
    #: megatron's own flag (True: a layer-wise param layout is computed; False: legacy path).
    use_layer_wise_param_layout: bool = True
    # --- single grouped expert weights (#5464, issue 6) ---
    #: TransformerConfig / args: TE's one GroupedTensor per expert linear.
    moe_single_grouped_weight: bool = False
    use_megatron_fsdp: bool = False
    use_torch_fsdp2: bool = False
    #: "fp4" recipe name (megatron's ``fp4_recipe`` when ``--fp4-format`` is set), else None.
    fp4_recipe: str | None = None
    #: NVFP4 primary weights: megatron-training's ``--fp4-param-gather`` (DDP config), which it
    #: also hands to ``TransformerConfig.fp4_param``.
    fp4_param_gather: bool = False
    fp4_param: bool = False
    #: Transformer Engine version; None: the installed one (read without importing TE).
    te_version: str | None = None
    #: TE's switch ``NVTE_GROUPED_LINEAR_SINGLE_PARAM``; None: read the environment.
    grouped_linear_single_param: bool | None = None
    moe_grouped_gemm: bool = True
    use_transformer_engine_op_fuser: bool = True
    # --- the launch environment of TE's op-fuser experts (issue 28; docs/recipes.md) ---
    #: TransformerConfig: MoE experts (None / 0: a dense model).
    num_moe_experts: int | None = None
    #: TransformerConfig: gated experts (SwiGLU with ``activation_func`` silu).
    gated_linear_unit: bool = False
    #: TransformerConfig: the activation (a function, or its name).
    activation_func: Any = None
    #: TE / megatron switch ``NVTE_CUTEDSL_FUSED_GROUPED_MLP``; None: read the environment
    #: (where only a value set to 0 is refused: unset, the recipe's env_vars may still give it).
    cutedsl_fused_grouped_mlp: bool | None = None
    # --- recipes and launchers (issue 7); None = not known at this call site ---
    #: FP8 format (``--fp8-format`` / Bridge ``fp8``); None when FP8 is off.
    fp8: str | None = None
    tensor_model_parallel_size: int = 1
    #: None: megatron's default, the TP size.
    expert_tensor_parallel_size: int | None = None
    # --- the model's widths TP / ETP shard (rule fp8-gather-tp-block-boundary); None: not
    # known at this call site (TransformerConfig's defaults are applied when it is built) ---
    hidden_size: int | None = None
    ffn_hidden_size: int | None = None
    num_attention_heads: int | None = None
    #: None: one group per head (multi-head attention).
    num_query_groups: int | None = None
    #: None: hidden_size // num_attention_heads.
    kv_channels: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    multi_latent_attention: bool = False
    #: Multi-latent attention's head widths (MLATransformerConfig; None: not known here): the
    #: up projections' rows per head are ``qk_head_dim + qk_pos_emb_head_dim`` (queries) and
    #: ``qk_head_dim + v_head_dim`` (keys and values), ``linear_proj`` reads ``v_head_dim``.
    qk_head_dim: int | None = None
    qk_pos_emb_head_dim: int | None = None
    v_head_dim: int | None = None
    #: TransformerConfig: "gated_delta_net" / "dsa" layers (hybrid models), None: none.
    experimental_attention_variant: str | None = None
    #: TransformerConfig: a gate on the attention output (Q rows doubled in ``linear_qkv``).
    attention_output_gate: bool = False
    #: The DDP config's ``overlap_param_gather`` when it can differ from the optimizer's.
    ddp_overlap_param_gather: bool | None = None
    overlap_param_gather_with_optimizer_step: bool = False
    optimizer_cpu_offload: bool = False
    gather_padding_tolerance: float = DEFAULT_GATHER_PADDING_TOLERANCE
    #: Compact layout: how a single grouped weight is owned ("whole", "expert", "auto").
    grouped_weight_ownership: str = "whole"
    #: Fused QKV weights owned as their Q, K, V parts ("split"), "whole", or "auto" (split on the
    #: compact layout unless the weights are blockwise FP8; layout.resolve_qkv_ownership).
    qkv_ownership: str = "auto"
    #: Compact layout: how Muon gradients are synced ("reduce_to_owner", "all_reduce").
    layer_wise_grad_sync: str = "reduce_to_owner"
    #: Bridge's ``logger.log_l2_norm_grad_to_tensorboard``: logs every parameter's main_grad.
    log_l2_norm_grad_to_tensorboard: bool = False
    #: Compact layout: cap on a layer-wise bucket's closing threshold (None: no cap).
    bucket_cap_numel: int | None = None
    #: ``OptimizerConfig.fp8_recipe`` when the recipe itself was read elsewhere (the parameters'
    #: types, ``TransformerConfig``); None: not set or not known at this call site.
    optimizer_fp8_recipe: str | None = None
    #: TransformerConfig / ``--context-parallel-size`` (rule ``layer-wise-context-parallel``).
    context_parallel_size: int = 1
    #: Bridge ``checkpoint.ckpt_format`` / ``--ckpt-format``; None: not known at this call site.
    ckpt_format: str | None = None
    #: Bridge ``checkpoint.also_save_hf_checkpoint``: every save also writes a Hugging Face copy
    #: through Bridge's name mapping.
    also_save_hf_checkpoint: bool = False
    #: Bridge ``checkpoint.pretrained_checkpoint`` is a Hugging Face directory, which Bridge
    #: converts through its name mapping instead of a ``torch_dist`` load (read by
    #: ``nemo_lw_fp8.bridge.settings_from_config``).
    pretrained_checkpoint_is_hf: bool = False
    #: Where each value was read (``(field, "DistributedDataParallelConfig.fp8_param_gather")``
    #: pairs); a rule's message names the sources of the fields it read. Empty: not recorded.
    sources: tuple[tuple[str, str], ...] = ()

    @property
    def layer_wise(self) -> bool:
        return self.use_layer_wise_distributed_optimizer or self.optimizer.startswith("dist_")

    @classmethod
    def from_megatron(cls, optimizer_config: Any, ddp_config: Any = None, **extra: Any) -> Settings:
        """Read the fields the rules need from megatron config objects (missing ones default)."""
        values: dict[str, Any] = {}
        for source in (ddp_config, optimizer_config):
            if source is None:
                continue
            for field in fields(cls):
                if field.name != "sources" and hasattr(source, field.name):
                    values[field.name] = getattr(source, field.name)
        values.update(extra)
        return cls(**values)

    @classmethod
    def from_args(cls, args: Any) -> Settings:
        """Read megatron-training ``args`` (argparse namespace)."""
        values = {
            f.name: getattr(args, f.name)
            for f in fields(cls)
            if f.name != "sources" and hasattr(args, f.name)
        }
        if not getattr(args, "group_query_attention", True):
            values["num_query_groups"] = None  # megatron-training's meaning: one group per head
        if hasattr(args, "use_layer_wise_param_layout") and "layer_wise_layout" not in values:
            values["layer_wise_layout"] = "padded" if args.use_layer_wise_param_layout else "legacy"
        return cls(**values)


@dataclass(frozen=True)
class Rule:
    """A rule: its ``name``, a ``summary``, the check (``violated``: a one-line message, or None)
    and what every message of it must say: ``names``, the flag(s) it is about, and ``fix``, the
    words of its fix (after ``Fix:``). Both may hold ``<...>`` placeholders for values the
    message fills in (:func:`message_misses`); docs/guards.md lists ``names`` in its rows."""

    name: str
    summary: str
    violated: Callable[[Settings], str | None]
    names: tuple[str, ...]
    fix: str


_PLACEHOLDER = re.compile(r"<[^<>]+>")


def _pattern(text: str) -> re.Pattern[str]:
    """``text`` as a regular expression, each ``<...>`` placeholder standing for any text."""
    pieces = _PLACEHOLDER.split(text)
    return re.compile(".+?".join(re.escape(piece) for piece in pieces))


def message_misses(message: str, names: tuple[str, ...], fix: str) -> list[str]:
    """What a refusal's ``message`` lacks of a rule's table entry: each name of ``names`` not in
    it, the ``fix`` not after its ``Fix:``, a message of more than one line. Empty: none."""
    missing = [f"name {name!r}" for name in names if not _pattern(name).search(message)]
    _, found, after = message.partition("Fix:")
    if not found or not _pattern(fix).search(after):
        missing.append(f"fix {fix!r} after 'Fix:'")
    if len(message.splitlines()) != 1:
        missing.append("one line")
    return missing
