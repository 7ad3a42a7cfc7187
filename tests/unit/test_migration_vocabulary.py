"""The migration vocabulary (select rules, orders, methods) is llumlet.proto's enums by name, spelled
once (protos/migration_selection.py); the rescheduler, the dispatcher and the llumlet all use it, and
the scheduler needs nothing of vllm_plugin for it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pilotfish.protos import llumlet_pb2
from pilotfish.protos.migration_selection import (
    MIGRATION_METHODS,
    SELECT_ORDERS,
    SELECT_RULES,
    check_method,
    check_order,
    check_rule,
    method_number,
    order_name,
    order_number,
    rule_name,
    rule_number,
)
from pilotfish.scheduler.rescheduler.dispatcher import migrate_request
from pilotfish.scheduler.rescheduler.types import MigrationPair
from pilotfish.scheduler.view.types import Endpoint, InstanceView
from pilotfish.vllm_plugin.core import selection

ROOT = Path(__file__).resolve().parents[2]


def test_every_enum_value_but_unspecified_has_a_name_that_round_trips() -> None:
    for enum, prefix, names, number, name in (
        (llumlet_pb2.SelectRule, "SELECT_RULE_", SELECT_RULES, rule_number, rule_name),
        (llumlet_pb2.SelectOrder, "SELECT_ORDER_", SELECT_ORDERS, order_number, order_name),
    ):
        declared = [n.removeprefix(prefix) for n, v in enum.items() if v != 0]
        assert list(names) == declared
        for n in names:
            assert enum.Name(number(n)) == prefix + n
            assert name(number(n)) == n
        assert name(0) is None  # unspecified: not a rule or an order
        assert name(max(enum.values()) + 1) is None  # a number this build does not know
    assert MIGRATION_METHODS == ("auto", "recompute", "kv_transfer")
    assert method_number("auto") == llumlet_pb2.MIGRATION_METHOD_UNSPECIFIED
    assert method_number("kv_transfer") == llumlet_pb2.MIGRATION_METHOD_KV_TRANSFER


@pytest.mark.parametrize(
    ("check", "value", "message"),
    [
        (check_rule, "TOKENS", "unknown request select rule 'TOKENS' (choose NUM_REQ, TOKEN, RATIO)"),
        (check_order, "XX", "unknown request select order 'XX' (choose LCR, FCR, LR, SR, FCW, FCWSR)"),
        (check_method, "teleport", "unknown migration method 'teleport' (choose auto, recompute, kv_transfer)"),
        (check_rule, "UNSPECIFIED", "unknown request select rule"),
    ],
)
def test_unknown_names_fail_naming_the_choices(check: object, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check(value)  # type: ignore[operator]


def test_the_llumlet_selection_uses_the_same_names() -> None:
    assert selection.check_rule is check_rule and selection.check_order is check_order
    # every order the vocabulary names, the selection knows how to order by
    cand = selection.MigrationCandidate("a", 0.0, running=True, num_tokens=5)
    for order in SELECT_ORDERS:
        selection.ordered([cand], order)


def test_the_dispatcher_sends_the_enums_numbers() -> None:
    a = InstanceView(Endpoint("a", "a:1"))
    b = InstanceView(Endpoint("b", "b:1"))
    msg = migrate_request(MigrationPair(a, b, "decode_load", "RATIO", "FCWSR", 0.5, "kv_transfer"))
    assert msg.select_rule == llumlet_pb2.SELECT_RULE_RATIO
    assert msg.select_order == llumlet_pb2.SELECT_ORDER_FCWSR
    assert msg.method == llumlet_pb2.MIGRATION_METHOD_KV_TRANSFER


def test_the_scheduler_does_not_import_vllm_plugin() -> None:
    offenders = []
    for path in sorted((ROOT / "scheduler").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("pilotfish.vllm_plugin")]
    assert not offenders
