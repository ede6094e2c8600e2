"""Every refusal's message names its flag(s) and its fix (issue 45): the catalogue holds, per
rule, the names its message must say and the words of its fix (``Rule.names`` / ``Rule.fix``,
``CHECKPOINT_MESSAGES`` for the checkpoint rules); each rule is tripped here and its one-line
message checked against that table, and docs/guards.md's "message names" column is checked
against the same table. Control: a rule whose message is replaced by "Fix: ?" (same verdict)
fails the check by its assertion."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from nemo_lw_fp8 import rules as guards
from nemo_lw_fp8.rules import ConfigError, Settings, message_misses
from tests.recipes.test_recipes import EXPECTED_RULES
from tests.rules.test_guard_catalogue import CASES
from tests.rules.test_guards import BAD, FP4_PRIMARY_OK, GOOD_MXFP8, TP_REFUSED

DOCS = Path(__file__).resolve().parents[2] / "docs" / "guards.md"
RULES = {rule.name: rule for rule in guards.RULES}

#: The branches of ``fp4-primary-weights-layer-wise`` the catalogue's cases leave out, each
#: with its own fix (the rule's table holds what they all say).
FP4_BRANCHES = [
    (f"fp4 primary, {next(iter(changes))}", FP4_PRIMARY_OK | changes,
     "fp4-primary-weights-layer-wise")
    for changes in (dict(fp4_param_gather=False), dict(layer_wise_layout="legacy"),
                    dict(fp4_recipe="custom"), dict(bf16=False),
                    dict(num_distributed_optimizer_instances=2))
]  # fmt: skip

#: (case, settings, rule): the catalogue's cases (tests/rules/test_guard_catalogue.py), each
#: rule's case of tests/rules/test_guards.py, its TP refusals and the FP4 branches above.
MESSAGE_CASES: list[tuple[str, dict, str]] = (
    [(f"catalogue: {case}", settings, rule) for case, settings, rule in CASES]
    + [(f"guards: {rule}", GOOD_MXFP8.__dict__ | changes, rule)
       for rule, (changes, _) in sorted(BAD.items())]
    + [(f"guards TP: {case}", settings, rule) for case, settings, rule, _ in TP_REFUSED]
    + FP4_BRANCHES
)  # fmt: skip


def assert_names_and_fix(names: tuple[str, ...], fix: str, message: str) -> None:
    """The check: ``message`` is one line naming every one of ``names`` and, after ``Fix:``,
    the ``fix``."""
    misses = message_misses(message, names, fix)
    assert misses == [], f"the message lacks {misses}: {message}"


def refusal(settings: dict, rule: str) -> str:
    """The message ``check`` refuses ``settings`` with, after asserting the verdict: ``rule``."""
    with pytest.raises(ConfigError) as caught:
        guards.check(Settings(**settings))
    assert caught.value.rule == rule, caught.value
    return str(caught.value)


def test_every_rule_is_tripped_here():
    assert {rule for _, _, rule in MESSAGE_CASES} == set(RULES)


def test_every_rule_has_names_and_a_fix():
    for rule in guards.RULES:
        assert rule.names and all(rule.names), rule.name
        assert len(set(rule.names)) == len(rule.names), rule.name
        assert rule.fix and "Fix:" not in rule.fix and "\n" not in rule.fix, rule.name
    assert set(guards.CHECKPOINT_MESSAGES) == {name for name, _ in guards.CHECKPOINT_RULES}
    for name, (names, fix) in guards.CHECKPOINT_MESSAGES.items():
        assert names and all(names) and fix and "Fix:" not in fix, name


@pytest.mark.parametrize(("case", "settings", "rule"), MESSAGE_CASES,
                         ids=[case for case, _, _ in MESSAGE_CASES])  # fmt: skip
def test_the_message_names_the_flags_and_the_fix(case, settings, rule):
    message = refusal(settings, rule)
    assert_names_and_fix(RULES[rule].names, RULES[rule].fix, message)


#: One refusal per checkpoint rule: (rule, message).
CHECKPOINT_CASES = [
    ("checkpoint-mismatch", lambda: guards.checkpoint_mismatch(
        {"model": {"num_layers": 3}}, {"model": {"num_layers": 4}}, "ck/iter_2")),
    ("pretrained-checkpoint-mismatch", lambda: guards.pretrained_checkpoint_mismatch(
        {"model": {"hidden_size": 64}}, {"model": {"hidden_size": 128}}, "hf/iter_0")),
    ("checkpoint-missing-shard", lambda: guards.checkpoint_missing_files(
        ["__0_0.distcp"], "ck/iter_2")),
    ("checkpoint-truncated-shard", lambda: guards.checkpoint_truncated_files(
        {"__0_0.distcp": (10, 20)}, "ck/iter_2")),
    ("checkpoint-bucket-resplit", lambda: guards.checkpoint_bucket_resplit(
        False, 40_000_000, 64_000_000, {"buffer 0": [40_000_000, 7]}, "ck/iter_2")),
    ("checkpoint-tp-resplit", lambda: guards.checkpoint_tp_resplit(
        False, 2, 1, {"buffer 0": [66432]}, "ck/iter_2")),
]  # fmt: skip


def test_every_checkpoint_rule_is_tripped_here():
    assert [rule for rule, _ in CHECKPOINT_CASES] == [name for name, _ in guards.CHECKPOINT_RULES]


@pytest.mark.parametrize(("rule", "make"), CHECKPOINT_CASES, ids=[r for r, _ in CHECKPOINT_CASES])
def test_a_checkpoint_refusal_names_the_fields_and_the_fix(rule, make):
    names, fix = guards.CHECKPOINT_MESSAGES[rule]
    assert_names_and_fix(names, fix, make())


# --------------------------------------------------------------------------- the control


@pytest.mark.parametrize("rule", sorted(RULES))
def test_control_a_message_without_its_names_fails_the_check(rule, monkeypatch):
    """The rule's message replaced by "Fix: ?" (the same verdict on its first case): the check
    above fails on it by its assertion, naming what is missing; nothing else breaks."""
    case, settings, _ = next(c for c in MESSAGE_CASES if c[2] == rule)
    original = RULES[rule]

    def unnamed(s):
        return "Fix: ?" if original.violated(s) else None

    patched = tuple(
        dataclasses.replace(r, violated=unnamed) if r is original else r for r in guards.RULES
    )
    monkeypatch.setattr(guards, "RULES", patched)
    message = refusal(settings, rule)  # the same verdict
    assert message.endswith("Fix: ?"), message
    with pytest.raises(AssertionError, match="the message lacks"):
        assert_names_and_fix(original.names, original.fix, message)


@pytest.mark.parametrize("rule", sorted(guards.CHECKPOINT_MESSAGES))
def test_control_a_checkpoint_message_without_its_names_fails_the_check(rule):
    names, fix = guards.CHECKPOINT_MESSAGES[rule]
    with pytest.raises(AssertionError, match="the message lacks"):
        assert_names_and_fix(names, fix, "the checkpoint is wrong. Fix: ?")


def test_control_placeholders_stand_for_a_value_not_for_nothing():
    """``<...>`` matches the value a message fills in, not an empty one or a missing word."""
    names, fix = ("--fp8-recipe <recipe>",), "set <value>"
    assert message_misses("--fp8-recipe mxfp8. Fix: set x", names, fix) == []
    assert message_misses("--fp8-recipe. Fix: set x", names, fix) == [f"name {names[0]!r}"]
    assert message_misses("--fp8-recipe mxfp8. Fix: set", names, fix) == [
        f"fix {fix!r} after 'Fix:'"
    ]
    assert message_misses("set x, --fp8-recipe mxfp8. Fix: ?", names, fix) == [
        f"fix {fix!r} after 'Fix:'"
    ]
    assert message_misses("--fp8-recipe mxfp8. Fix: set x\nand y", names, fix) == ["one line"]


# --------------------------------------------------------------------------- docs/guards.md

#: Listed in docs/guards.md but not in the catalogue: refused when the optimizer is built, from
#: the built weights (nemo_lw_fp8/mechanics/blockwise.py), not from the settings.
BUILD_ONLY = {"blockwise-gather-2d-weights"}
HEADER = "| rule | rejects | message names | fix |"


def docs_rows() -> dict[str, list[str]]:
    """Each rule row of docs/guards.md's tables as its cells, after checking it renders as a
    table row: its run of ``|`` lines starts with the header and the separator."""
    lines = DOCS.read_text().splitlines()
    rows: dict[str, list[str]] = {}
    for number, line in enumerate(lines):
        if not line.startswith("| `"):
            continue
        top = number
        while top > 0 and lines[top - 1].startswith("|"):
            top -= 1
        assert lines[top] == HEADER and lines[top + 1] == "|---|---|---|---|", (number + 1, line)
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        assert len(cells) == 4, (number + 1, line)
        rule = re.match(r"`([^`]+)`", cells[0]).group(1)
        assert rule not in rows, f"{rule} has two rows"
        rows[rule] = cells
    return rows


def listed_names(cell: str) -> list[str]:
    """The names of a "message names" cell: backticked, separated by commas only."""
    names = re.findall(r"`([^`]+)`", cell)
    assert ", ".join(f"`{name}`" for name in names) == cell, cell
    return names


def test_docs_have_one_table_row_per_rule():
    rows = docs_rows()
    catalogue = set(RULES) | set(guards.CHECKPOINT_MESSAGES)
    assert set(rows) == catalogue | BUILD_ONLY


def test_docs_list_exactly_the_names_of_each_rules_message():
    rows = docs_rows()
    tables = {name: rule.names for name, rule in RULES.items()}
    tables |= {name: names for name, (names, _) in guards.CHECKPOINT_MESSAGES.items()}
    wrong = {
        rule: (listed_names(rows[rule][2]), list(names))
        for rule, names in tables.items()
        if listed_names(rows[rule][2]) != list(names)
    }
    assert wrong == {}


def test_docs_count_the_bad_and_supported_combinations_the_tests_have():
    """docs/guards.md says how many combinations the catalogue and the Bridge override test hold:
    the numbers are counted here, from the tests themselves."""
    text = " ".join(DOCS.read_text().split())
    bad = sum(1 for rule in EXPECTED_RULES.values() if rule)
    supported = len(EXPECTED_RULES) - bad
    assert f"{len(CASES)} in all" in text
    assert f"({bad} bad combinations" in text
    assert f"and {supported} supported" in text
    assert "test_recipes.py::test_bridge_overrides_trip_their_rule" in text
