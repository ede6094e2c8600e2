"""Checks on ``key=value`` overrides and YAML files before Megatron-Bridge applies them.

Bridge's ``process_config_with_overrides`` (OmegaConf + Hydra) writes a value into the
``ConfigContainer`` without asking the dataclass what the field holds: ``optimizer.lr=abc``
becomes the string ``"abc"`` and ``train.train_iters=-5`` is taken as it is, and a model is then
built from them. So before that call, every override and every YAML leaf is checked here against
the recipe's own config objects:

* the key exists (a close name is suggested when it does not);
* the value has the field's type (``int``, ``float``, ``bool``, ``str``, ``Optional`` and
  ``Literal`` of those; fields of other types are left to Bridge);
* after the merge, the values in :data:`RANGES` are in range (counts > 0, rates >= 0 ...).

Each failure is a :class:`~nemo_lw_fp8.cli.UsageError` naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from nemo_lw_fp8.errors import UsageError

#: Range rules on the final config: dotted key -> (test, what the value must be).
#: Counts are > 0; rates, intervals that may be switched off, and weights are >= 0.
_POSITIVE = (lambda v: v > 0, "> 0")
_NON_NEGATIVE = (lambda v: v >= 0, ">= 0")
_UNIT = (lambda v: 0 <= v < 1, "in [0, 1)")
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "train.train_iters": _POSITIVE,
    "train.global_batch_size": _POSITIVE,
    "train.micro_batch_size": _POSITIVE,
    "optimizer.lr": _NON_NEGATIVE,
    "optimizer.min_lr": _NON_NEGATIVE,
    "optimizer.weight_decay": _NON_NEGATIVE,
    "optimizer.clip_grad": _NON_NEGATIVE,
    "optimizer.adam_beta1": _UNIT,
    "optimizer.adam_beta2": _UNIT,
    "optimizer.muon_momentum": _UNIT,
    "scheduler.lr_warmup_iters": _NON_NEGATIVE,
    "scheduler.lr_decay_iters": _POSITIVE,
    "validation.eval_interval": _POSITIVE,
    "validation.eval_iters": _NON_NEGATIVE,
    "dataset.seq_length": _POSITIVE,
    "logger.log_interval": _POSITIVE,
    "model.num_layers": _POSITIVE,
    "model.hidden_size": _POSITIVE,
    "model.ffn_hidden_size": _POSITIVE,
    "model.num_attention_heads": _POSITIVE,
    "model.num_moe_experts": _POSITIVE,
    "model.moe_router_topk": _POSITIVE,
    "model.moe_ffn_hidden_size": _POSITIVE,
    "model.seq_length": _POSITIVE,
    "model.tensor_model_parallel_size": _POSITIVE,
    "model.pipeline_model_parallel_size": _POSITIVE,
    "model.virtual_pipeline_model_parallel_size": _POSITIVE,
    "model.expert_model_parallel_size": _POSITIVE,
    "model.expert_tensor_parallel_size": _POSITIVE,
    "model.context_parallel_size": _POSITIVE,
    "ddp.bucket_size": _POSITIVE,
    "ddp.num_distributed_optimizer_instances": _POSITIVE,
}

_SCALARS = (bool, int, float, str, type(None))


def split(item: str) -> tuple[str, str]:
    """``key=value`` -> ``(key, value)``; a Hydra prefix (``+``, ``++``, ``~``) stays on the key."""
    if "=" not in item or item.startswith("="):
        raise UsageError(
            f"override {item!r} is not key=value (e.g. train.train_iters=10)",
            "write each override as section.field=value",
        )
    key, value = item.split("=", 1)
    return key.strip(), value


def parse_value(key: str, text: str) -> Any:
    """The value as Hydra will read it (ints, floats, bools, null, quoted strings, lists...)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(f"{key}={text}").value()
    except Exception as error:  # noqa: BLE001 - Hydra's grammar errors, shown to the user
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(
            f"override {key}={text!r} cannot be parsed: {first}",
            "quote strings with special characters, e.g. key='a b'",
        ) from error


def _field_types(owner: Any) -> dict[str, Any]:
    cls = type(owner)
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - unresolvable annotations: use them as written
        hints = {}
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls)}


def _names(owner: Any) -> list[str]:
    if dataclasses.is_dataclass(owner):
        return [f.name for f in dataclasses.fields(owner)]
    return list(owner) if isinstance(owner, dict) else []


def resolve(cfg: Any, key: str) -> tuple[Any, str]:
    """The object holding ``key``'s last part, and that part; :class:`UsageError` when a part
    does not exist (with the closest known names)."""
    parts = key.split(".")
    owner = cfg
    for depth, part in enumerate(parts):
        known = _names(owner)
        last = depth == len(parts) - 1
        if part not in known:
            where = ".".join(parts[:depth]) or "the config"
            close = difflib.get_close_matches(part, known, n=3)
            prefix = ".".join(parts[:depth] + [""])
            listed = ", ".join(sorted(known)[:12]) + (" ..." if len(known) > 12 else "")
            hint = (
                "did you mean " + ", ".join(prefix + c for c in close) + "?"
                if close
                else f"{where} has: {listed}"
            )
            raise UsageError(f"unknown key {key!r}: {where} has no field {part!r}", hint)
        if last:
            return owner, part
        owner = owner[part] if isinstance(owner, dict) else getattr(owner, part)
        if owner is None or not (dataclasses.is_dataclass(owner) or isinstance(owner, dict)):
            raise UsageError(
                f"unknown key {key!r}: {'.'.join(parts[: depth + 1])} is not a section",
                "set the field itself, e.g. " + ".".join(parts[: depth + 1]) + "=VALUE",
            )
    raise AssertionError("unreachable")


def _accepts(annotation: Any, value: Any) -> bool | None:
    """Whether ``value`` fits ``annotation``; ``None`` when the annotation is not checked here."""
    if annotation is Any:
        return None
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        answers = [_accepts(a, value) for a in typing.get_args(annotation)]
        if any(a is True for a in answers):
            return True
        return None if any(a is None for a in answers) else False
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    return None


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("NoneType", "None")


def _example(annotation: Any) -> str:
    for value, text in ((True, "true"), (3e-4, "3e-4"), (10, "10"), ("x", "name")):
        if _accepts(annotation, value):
            return text
    return "VALUE"


def check_value(cfg: Any, key: str, value: Any) -> None:
    """``key`` exists in ``cfg`` and ``value`` has its field's type (when the type is simple)."""
    if key.startswith(("+", "~")):
        return  # Hydra adds or deletes keys; Bridge checks those itself
    owner, name = resolve(cfg, key)
    if not dataclasses.is_dataclass(owner) or not isinstance(value, _SCALARS):
        return
    annotation = _field_types(owner).get(name, Any)
    if _accepts(annotation, value) is False:
        raise UsageError(
            f"{key}={value!r}: expected {_type_name(annotation)}, got {type(value).__name__}",
            f"give a value of that type, e.g. {key}={_example(annotation)}",
        )


def flatten(tree: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    """Dotted keys and leaf values of a YAML mapping (a ``_target_`` node is one leaf)."""
    if isinstance(tree, dict) and "_target_" not in tree:
        for key, value in tree.items():
            yield from flatten(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], tree


def check_overrides(cfg: Any, config_file: str | None, overrides: Sequence[str]) -> None:
    """Every YAML leaf and every ``key=value`` against ``cfg`` (the recipe as built)."""
    if config_file:
        import yaml

        with open(config_file) as handle:
            tree = yaml.safe_load(handle) or {}
        if not isinstance(tree, dict):
            raise UsageError(f"{config_file}: not a mapping of sections", "see recipes/*.yaml")
        for key, value in flatten(tree):
            try:
                check_value(cfg, key, value)
            except UsageError as error:
                raise UsageError(f"{config_file}: {error.problem}", error.fix) from None
    for item in overrides:
        key, text = split(item)
        check_value(cfg, key, parse_value(key, text))


def check_ranges(cfg: Any) -> None:
    """The values of :data:`RANGES` in the merged config."""
    for key, (test, wanted) in RANGES.items():
        owner: Any = cfg
        for part in key.split("."):
            owner = getattr(owner, part, None)
            if owner is None:
                break
        value = owner
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isnan(value) or not test(value):
            raise UsageError(
                f"{key}={value!r} is out of range: it must be {wanted}",
                f"set {key} to a value {wanted}",
            )
