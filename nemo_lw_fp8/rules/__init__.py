"""Every configuration rule the plugin knows, in one list: :data:`RULES`.

A rule looks at a flat view of the settings (:class:`Settings`, built from megatron's
``OptimizerConfig`` + ``DistributedDataParallelConfig``, from megatron-training ``args``, or by
hand) and returns a message when the combination is unsupported. :func:`check` raises
:class:`ConfigError` naming the flag and the fix; nothing is ever corrected silently. Each
:class:`Rule` declares the flag(s) its message names and the words of its fix (``names``,
``fix``; :data:`CHECKPOINT_MESSAGES` for the checkpoint rules), which
``tests/rules/test_guard_messages.py`` checks every message and docs/guards.md against.

Rules run when the configuration is finalised: in megatron-training's ``validate_args`` (patched),
and when the plugin's patched ``LayerWiseDistributedOptimizer`` is built. ``docs/guards.md`` lists
them; each has a test in ``tests/rules/test_guards.py`` or ``tests/rules/test_guard_catalogue.py``.

The rules themselves live by topic, each module importing only :mod:`.settings`:
:mod:`.fp8` (FP8 param gather, compact basics), :mod:`.grouped` (single grouped
expert weights, TE's launch environment), :mod:`.integration` (recipes, launchers, the
plugin's own settings) and :mod:`.scope` (what is outside the tested scope). This module
puts them in one ordered list (the first broken rule is the one reported) and runs them. The
rules on loading a checkpoint another run wrote are in :mod:`nemo_lw_fp8.rules.checkpoint` and
importable from here.
"""

from __future__ import annotations

from typing import Any

from nemo_lw_fp8.rules import scope as scope_guards

# The checkpoint-load rules: a module of their own, listed here with every other rule.
from nemo_lw_fp8.rules.checkpoint import CHECKPOINT_FIXED_FIELDS as CHECKPOINT_FIXED_FIELDS
from nemo_lw_fp8.rules.checkpoint import CHECKPOINT_MESSAGES as CHECKPOINT_MESSAGES
from nemo_lw_fp8.rules.checkpoint import CHECKPOINT_RULES as CHECKPOINT_RULES
from nemo_lw_fp8.rules.checkpoint import checkpoint_bucket_resplit as checkpoint_bucket_resplit
from nemo_lw_fp8.rules.checkpoint import checkpoint_mismatch as checkpoint_mismatch
from nemo_lw_fp8.rules.checkpoint import checkpoint_missing_files as checkpoint_missing_files
from nemo_lw_fp8.rules.checkpoint import checkpoint_tp_resplit as checkpoint_tp_resplit
from nemo_lw_fp8.rules.checkpoint import checkpoint_truncated_files as checkpoint_truncated_files
from nemo_lw_fp8.rules.checkpoint import (
    pretrained_checkpoint_mismatch as pretrained_checkpoint_mismatch,
)
from nemo_lw_fp8.rules.fp8 import LAYER_WISE_FP8_GATHER_RECIPES as LAYER_WISE_FP8_GATHER_RECIPES
from nemo_lw_fp8.rules.fp8 import RULES as FP8_RULES
from nemo_lw_fp8.rules.fp8 import blockwise_reuse_message as blockwise_reuse_message
from nemo_lw_fp8.rules.grouped import CUTEDSL_ENV as CUTEDSL_ENV
from nemo_lw_fp8.rules.grouped import GROUPED_WEIGHT_MIN_TE as GROUPED_WEIGHT_MIN_TE
from nemo_lw_fp8.rules.grouped import GROUPED_WEIGHT_RULES as GROUPED_WEIGHT_RULES
from nemo_lw_fp8.rules.grouped import LAUNCH_ENV_RULES as LAUNCH_ENV_RULES
from nemo_lw_fp8.rules.grouped import SINGLE_GROUPED_WEIGHT_ENV as SINGLE_GROUPED_WEIGHT_ENV
from nemo_lw_fp8.rules.grouped import _installed_te_version as _installed_te_version
from nemo_lw_fp8.rules.grouped import _version_tuple as _version_tuple
from nemo_lw_fp8.rules.integration import INTEGRATION_RULES as _INTEGRATION_RULES
from nemo_lw_fp8.rules.integration import qkv_split_blockwise_message as qkv_split_blockwise_message
from nemo_lw_fp8.rules.integration import qkv_split_nvfp4_message as qkv_split_nvfp4_message
from nemo_lw_fp8.rules.settings import ConfigError as ConfigError
from nemo_lw_fp8.rules.settings import Rule as Rule
from nemo_lw_fp8.rules.settings import Settings as Settings
from nemo_lw_fp8.rules.settings import message_misses as message_misses

#: Settings outside what the plugin is tested on (nemo_lw_fp8/rules/scope.py).
SCOPE_RULES: tuple[Rule, ...] = (
    Rule("layer-wise-context-parallel", "layer-wise Muon is tested with context parallel 1",
         scope_guards.layer_wise_context_parallel,
         names=("model.context_parallel_size", "--context-parallel-size"),
         fix="set model.context_parallel_size=1 (--context-parallel-size 1), or use Adam with "
         "the distributed optimizer for long-context runs"),
    Rule("layer-wise-checkpoint-format", "layer-wise runs save and resume torch_dist",
         scope_guards.layer_wise_ckpt_format,
         names=("checkpoint.ckpt_format", "--ckpt-format"),
         fix=f"set checkpoint.ckpt_format={scope_guards.TESTED_CKPT_FORMAT} "
         f"(--ckpt-format {scope_guards.TESTED_CKPT_FORMAT})"),
    Rule("hf-pretrained-directory", "a Hugging Face checkpoint is imported before it is loaded",
         scope_guards.hf_pretrained_route,
         names=("checkpoint.pretrained_checkpoint", "Hugging Face directory"),
         fix="convert it first, nemo-lw-fp8 hf-import HF_DIR OUT --recipe <this recipe>, and set "
         "checkpoint.pretrained_checkpoint=OUT"),
    Rule("hf-save-single-grouped", "single grouped weights are exported by hf-export",
         scope_guards.hf_save_single_grouped,
         names=("checkpoint.also_save_hf_checkpoint=true", "model.moe_single_grouped_weight"),
         fix="set checkpoint.also_save_hf_checkpoint=false and export a saved run with "
         "nemo-lw-fp8 hf-export RUN_DIR OUT"),
)
#: The rules of recipes, launchers and the plugin's own settings (their cases are in
#: tests/rules/test_guard_catalogue.py; the others' in tests/rules/test_guards.py).
INTEGRATION_RULES: tuple[Rule, ...] = _INTEGRATION_RULES + SCOPE_RULES + LAUNCH_ENV_RULES
#: Every rule, in the order :func:`check` reports them.
RULES: tuple[Rule, ...] = FP8_RULES + GROUPED_WEIGHT_RULES + INTEGRATION_RULES


class _RecordingView:
    """The settings as a rule sees them, recording which fields the rule reads."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self.read: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.read.append(name)
        return getattr(self._settings, name)


def _with_sources(message: str, settings: Settings, read: list[str]) -> str:
    """``message`` plus where the fields the rule read came from (when that was recorded)."""
    sources = dict(settings.sources)
    named = []
    for name in dict.fromkeys(read):
        if name in sources:
            named.append(f"{name}={getattr(settings, name)!r} from {sources[name]}")
    return f"{message} (read: {'; '.join(named)})" if named else message


def violations(settings: Settings) -> list[tuple[str, str]]:
    """Every rule the settings break, as ``(rule, message)``."""
    found = []
    for rule in RULES:
        view = _RecordingView(settings)
        message = rule.violated(view)  # type: ignore[arg-type]
        if message:
            found.append((rule.name, _with_sources(message, settings, view.read)))
    return found


def check(settings: Settings) -> None:
    """Raise :class:`ConfigError` for the first rule the settings break."""
    found = violations(settings)
    if found:
        rule, message = found[0]
        raise ConfigError(rule, message)


# --------------------------------------------------------------------------- checkpoint loads:
# the rules ``checkpoint-mismatch``, ``-missing-shard`` and ``-truncated-shard``
# (CHECKPOINT_RULES) live in nemo_lw_fp8/rules/checkpoint.py (imported above): they read a
# saved run's config and files, not Settings, and are checked when Bridge loads a checkpoint
# (mechanics/checkpointing.py).

