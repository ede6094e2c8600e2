"""The checkpoint-load rules, listed from :mod:`nemo_lw_fp8.rules` (which imports them).

A checkpoint another run wrote (read from its Bridge ``run_config.yaml`` and its DCP metadata) is
refused before anything of it is loaded into the model or the optimizer: ``checkpoint-mismatch``
(:func:`checkpoint_mismatch`; for a model-only load of ``checkpoint.pretrained_checkpoint``, whose
FP8 recipe and optimizer are this run's own, ``pretrained-checkpoint-mismatch``:
:func:`pretrained_checkpoint_mismatch`, the weight shapes only), ``checkpoint-missing-shard``
(:func:`checkpoint_missing_files`), ``checkpoint-truncated-shard``, ``checkpoint-bucket-resplit``
(:func:`checkpoint_bucket_resplit`) and ``checkpoint-tp-resplit`` (:func:`checkpoint_tp_resplit`),
checked by :mod:`nemo_lw_fp8.mechanics.checkpointing`.
They read a saved config and files, not the :class:`~nemo_lw_fp8.rules.Settings` the other
rules read, hence a module of their own.
"""

from __future__ import annotations

from typing import Any

#: Fields of a Bridge ``run_config.yaml`` that a resume cannot change: the model's shapes, its
#: FP8 or FP4 recipe and bf16-kept layers (the weights' quantized form) and the optimizer (its
#: state's meaning).
CHECKPOINT_FIXED_FIELDS: tuple[tuple[str, str], ...] = tuple(
    ("model", name)
    for name in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
        "num_query_groups", "kv_channels", "multi_latent_attention", "q_lora_rank",
        "kv_lora_rank", "num_moe_experts", "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size", "mtp_num_layers", "vocab_size",
        "experimental_attention_variant", "fp8", "fp8_recipe",
        # NVFP4 primary weights are stored as FP4 codes: a bf16 or FP8 run cannot read them, and
        # the bf16-kept last layers decide which weights are FP4 at all.
        "fp4", "fp4_recipe", "fp4_param", "first_last_layers_bf16",
        "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
    )
) + (("optimizer", "optimizer"),)  # fmt: skip


def checkpoint_mismatch(saved: dict[str, Any], current: dict[str, Any], where: str) -> str | None:
    """Rule ``checkpoint-mismatch``: the fields of :data:`CHECKPOINT_FIXED_FIELDS` that differ
    between a checkpoint's saved config and this run's (both as ``{section: {field: value}}``)."""
    differences = []
    for section, name in CHECKPOINT_FIXED_FIELDS:
        old = (saved.get(section) or {}).get(name)
        new = (current.get(section) or {}).get(name)
        if old != new:
            differences.append(f"{section}.{name}: {old!r} in the checkpoint, {new!r} here")
    if not differences:
        return None
    return (
        f"the checkpoint {where} was written by another model, FP8 / FP4 recipe or optimizer: "
        + "; ".join(differences)
        + ". Fix: point checkpoint.load at a checkpoint of this recipe, or set these back; "
        "to start this run from scratch, drop checkpoint.load. Nothing was loaded."
    )


#: The model fields a model-only load (``checkpoint.pretrained_checkpoint``) needs equal: the
#: shapes of the weights it reads. The FP8 / FP4 recipe and the optimizer are this run's own: the
#: weights are read as values and quantized here, and no optimizer state is read.
PRETRAINED_SHAPE_FIELDS: tuple[str, ...] = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "num_moe_experts",
    "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "mtp_num_layers",
    "vocab_size", "experimental_attention_variant",
)  # fmt: skip


def _has_dense_layers(model: dict[str, Any]) -> bool:
    """Whether some decoder layer of ``model`` has a dense MLP (one ``ffn_hidden_size`` wide):
    every layer without experts, and with them the layers ``moe_layer_freq`` leaves dense."""
    if not model.get("num_moe_experts"):
        return True
    frequency = model.get("moe_layer_freq", 1)
    if isinstance(frequency, int):
        return frequency > 1
    return 0 in list(frequency or [1])


def _effective_shapes(model: dict[str, Any]) -> dict[str, Any]:
    """The shape fields megatron derives when they are unset, derived (a config that leaves
    ``kv_channels`` unset and one that writes it out describe the same weights)."""
    shapes = {name: model.get(name) for name in PRETRAINED_SHAPE_FIELDS}
    heads = shapes["num_attention_heads"]
    if shapes["kv_channels"] is None and heads and shapes["hidden_size"]:
        shapes["kv_channels"] = shapes["hidden_size"] // heads
    if shapes["num_query_groups"] is None:
        shapes["num_query_groups"] = heads
    if shapes["moe_ffn_hidden_size"] is None and shapes["num_moe_experts"]:
        shapes["moe_ffn_hidden_size"] = shapes["ffn_hidden_size"]
    for flag in ("multi_latent_attention",):
        shapes[flag] = bool(shapes[flag])
    for count in ("mtp_num_layers",):
        shapes[count] = shapes[count] or 0
    return shapes


def pretrained_checkpoint_mismatch(
    saved: dict[str, Any], current: dict[str, Any], where: str
) -> str | None:
    """Rule ``pretrained-checkpoint-mismatch``: the weight shapes that differ between a
    checkpoint loaded as ``checkpoint.pretrained_checkpoint`` and this run (both as
    ``{section: {field: value}}``). ``ffn_hidden_size`` counts only when this run has a dense
    MLP layer."""
    old = _effective_shapes(saved.get("model") or {})
    new = _effective_shapes(current.get("model") or {})
    if not _has_dense_layers(current.get("model") or {}):
        old.pop("ffn_hidden_size"), new.pop("ffn_hidden_size")
    differences = [
        f"model.{name}: {old[name]!r} in the checkpoint, {new[name]!r} here"
        for name in old
        if old[name] != new[name]
    ]
    if not differences:
        return None
    return (
        f"the checkpoint {where} (checkpoint.pretrained_checkpoint) holds weights of other "
        "shapes than this model's: " + "; ".join(differences) + ". Fix: point "
        "checkpoint.pretrained_checkpoint at a checkpoint of this model (for a Hugging Face "
        "one: nemo-lw-fp8 hf-import HF_DIR OUT --recipe <this recipe>), or set these back. "
        "Nothing was loaded."
    )


def checkpoint_missing_files(missing: list[str], where: str) -> str | None:
    """Rule ``checkpoint-missing-shard``: files the checkpoint's metadata lists but lacks."""
    if not missing:
        return None
    return (
        f"the checkpoint {where} is incomplete: its metadata lists {len(missing)} file(s) that "
        f"are not there ({', '.join(sorted(missing)[:4])}{', ...' if len(missing) > 4 else ''}). "
        "Fix: copy the whole iteration directory (an interrupted copy or save leaves this), or "
        "load an earlier iteration (checkpoint.ckpt_step=N). Nothing was loaded."
    )


def checkpoint_truncated_files(short: dict[str, tuple[int, int]], where: str) -> str | None:
    """Rule ``checkpoint-truncated-shard``: files shorter than the checkpoint's metadata needs
    (``short``: file -> (bytes on disk, bytes needed))."""
    if not short:
        return None
    named = [f"{name} ({have} of {need} bytes)" for name, (have, need) in sorted(short.items())]
    return (
        f"the checkpoint {where} is incomplete: {len(short)} file(s) are shorter than its "
        f"metadata says ({', '.join(named[:4])}{', ...' if len(named) > 4 else ''}). Fix: copy "
        "the whole iteration directory again (an interrupted copy leaves this), or load an "
        "earlier iteration (checkpoint.ckpt_step=N). Nothing was loaded."
    )


def checkpoint_bucket_resplit(
    fully_reshardable: bool,
    saved_bucket_size: int | None,
    bucket_size: int | None,
    saved_buckets: dict[str, list[int]],
    where: str,
) -> str | None:
    """Rule ``checkpoint-bucket-resplit``: a ``dp_reshardable`` checkpoint whose distributed
    optimizer buckets this run would cut differently.

    ``dp_reshardable`` writes the sibling Adam's state as one tensor per DDP bucket
    (``saved_buckets``: per buffer, the elements of each saved bucket), so a load finds it only
    if this run's buckets are the saved ones. They end at ``ddp.bucket_size`` elements, which
    megatron sets to ``max(40M, 1M x DP)`` when unset: a resume at another DP past 40 (or with
    another explicit size) cuts buffers above the smaller size elsewhere, and megatron's load
    stops deep inside on tensors the checkpoint lacks. A bucket closes once it reaches the size,
    so saved buckets all below both sizes were closed by something else (a buffer's end, a
    forced split) and are cut the same here: allowed.
    """
    if fully_reshardable or saved_bucket_size == bucket_size or not saved_buckets:
        return None
    sizes = [s for s in (saved_bucket_size, bucket_size) if s is not None]
    limit = min(sizes) if sizes else float("inf")
    if all(n < limit for buckets in saved_buckets.values() for n in buckets):
        return None
    return (
        f"the checkpoint {where} holds the distributed optimizer's state as dp_reshardable "
        f"buckets of ddp.bucket_size={saved_bucket_size} elements, but this run's buckets are "
        f"{bucket_size} elements (megatron's default max(40M, 1M x DP) changes past DP 40), so "
        "they would not match the saved bucket tensors. Fix: set "
        f"ddp.bucket_size={saved_bucket_size} for this run, or resume from a checkpoint saved "
        "with checkpoint.dist_ckpt_optim_fully_reshardable=true. Nothing was loaded."
    )


def checkpoint_tp_resplit(
    fully_reshardable: bool,
    saved_tp: int | None,
    tp: int | None,
    saved_buckets: dict[str, list[int]],
    where: str,
) -> str | None:
    """Rule ``checkpoint-tp-resplit``: a ``dp_reshardable`` checkpoint of another
    tensor-parallel size.

    ``dp_reshardable`` writes the sibling Adam's state as one flat tensor per DDP bucket of
    this TP rank's shards, so its length follows the TP size: megatron-core 0.19.2 then stops
    inside the load on a global shape mismatch of ``...bucket_idx_0.param`` (measured: a TP-2
    bucket of 66432 elements against 131968 at TP 1, ``tiny_qwen3_30b_a3b``). A
    ``fully_reshardable`` checkpoint holds that state per parameter in model space and loads
    at another TP (docs/checkpointing.md, "Another tensor-parallel size")."""
    if fully_reshardable or saved_tp is None or saved_tp == tp or not saved_buckets:
        return None
    return (
        f"the checkpoint {where} holds the distributed optimizer's state as dp_reshardable "
        f"buckets of model.tensor_model_parallel_size={saved_tp} shards, but this run has "
        f"model.tensor_model_parallel_size={tp}, and those buckets do not reshard across TP. "
        f"Fix: set model.tensor_model_parallel_size={saved_tp} for this run, or resume from a "
        "checkpoint saved with checkpoint.dist_ckpt_optim_fully_reshardable=true. Nothing was "
        "loaded."
    )


CHECKPOINT_RULES: tuple[tuple[str, str], ...] = (
    ("checkpoint-mismatch", "a resume keeps the model's shapes, FP8 recipe and optimizer"),
    ("pretrained-checkpoint-mismatch", "a pretrained checkpoint has the model's weight shapes"),
    ("checkpoint-missing-shard", "every file the checkpoint's metadata lists is there"),
    ("checkpoint-truncated-shard", "every file is as long as the checkpoint's metadata says"),
    ("checkpoint-bucket-resplit", "a dp_reshardable resume keeps the saved optimizer buckets"),
    ("checkpoint-tp-resplit", "a dp_reshardable resume keeps the saved tensor-parallel size"),
)
#: What each checkpoint rule's message must name and the words of its fix, as ``Rule.names`` and
#: ``Rule.fix`` for the other rules (``<...>``: a value the message fills in;
#: ``nemo_lw_fp8.rules.settings.message_misses``). docs/guards.md lists the names in its rows.
CHECKPOINT_MESSAGES: dict[str, tuple[tuple[str, ...], str]] = {
    "checkpoint-mismatch": (
        ("<section>.<field>: <saved> in the checkpoint, <this run's> here", "checkpoint.load"),
        "point checkpoint.load at a checkpoint of this recipe, or set these back; to start this "
        "run from scratch, drop checkpoint.load",
    ),
    "pretrained-checkpoint-mismatch": (
        ("model.<field>: <saved> in the checkpoint, <this run's> here",
         "checkpoint.pretrained_checkpoint"),
        "point checkpoint.pretrained_checkpoint at a checkpoint of this model (for a Hugging Face "
        "one: nemo-lw-fp8 hf-import HF_DIR OUT --recipe <this recipe>), or set these back",
    ),
    "checkpoint-missing-shard": (
        ("the checkpoint <iteration directory>", "checkpoint.ckpt_step=N"),
        "copy the whole iteration directory (<why>), or load an earlier iteration "
        "(checkpoint.ckpt_step=N)",
    ),
    "checkpoint-truncated-shard": (
        ("the checkpoint <iteration directory>", "checkpoint.ckpt_step=N"),
        "copy the whole iteration directory again (<why>), or load an earlier iteration "
        "(checkpoint.ckpt_step=N)",
    ),
    "checkpoint-bucket-resplit": (
        ("ddp.bucket_size=<saved>", "checkpoint.dist_ckpt_optim_fully_reshardable=true"),
        "set ddp.bucket_size=<saved> for this run, or resume from a checkpoint saved with "
        "checkpoint.dist_ckpt_optim_fully_reshardable=true",
    ),
    "checkpoint-tp-resplit": (
        ("model.tensor_model_parallel_size=<saved>",
         "checkpoint.dist_ckpt_optim_fully_reshardable=true"),
        "set model.tensor_model_parallel_size=<saved> for this run, or resume from a checkpoint "
        "saved with checkpoint.dist_ckpt_optim_fully_reshardable=true",
    ),
}  # fmt: skip
