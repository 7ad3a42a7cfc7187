"""The migration vocabulary by name, from llumlet.proto's enums: the one place it is spelled.

The rescheduler's flags (--rescheduling-req-select-rule / -order, --rescheduling-migration-method),
the MigrateRequest it sends and the llumlet's request selection all say a rule, an order or a
method by these names; the numbers on the wire are the enums'. A value added to an enum in
llumlet.proto is a new name here, and nowhere else needs a change to accept it.

    SELECT_RULES                  ("NUM_REQ", "TOKEN", "RATIO")
    SELECT_ORDERS                 ("LCR", "FCR", "LR", "SR", "FCW", "FCWSR")
    MIGRATION_METHODS             ("auto", "recompute", "kv_transfer")
    rule_number("TOKEN")          llumlet_pb2.SELECT_RULE_TOKEN
    rule_name(SELECT_RULE_TOKEN)  "TOKEN" (None for UNSPECIFIED or a number this build does not know)
"""

from __future__ import annotations

from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from pilotfish.protos import llumlet_pb2

# the enums' zero: a rule or order left unset on the wire; a method left to the source llumlet ("auto")
_UNSPECIFIED = 0


def _by_name(enum: EnumTypeWrapper, prefix: str) -> dict[str, int]:
    """Name without the enum's prefix -> number, in declaration order, the unspecified zero left out."""
    return {name.removeprefix(prefix): number for name, number in enum.items() if number != _UNSPECIFIED}


_RULES = _by_name(llumlet_pb2.SelectRule, "SELECT_RULE_")
_ORDERS = _by_name(llumlet_pb2.SelectOrder, "SELECT_ORDER_")
# methods are flag values, lower case; unspecified is "auto": the source llumlet decides
_METHODS = {
    "auto": _UNSPECIFIED,
    **{k.lower(): v for k, v in _by_name(llumlet_pb2.MigrationMethod, "MIGRATION_METHOD_").items()},
}

SELECT_RULES: tuple[str, ...] = tuple(_RULES)
SELECT_ORDERS: tuple[str, ...] = tuple(_ORDERS)
MIGRATION_METHODS: tuple[str, ...] = tuple(_METHODS)
_RULE_NAMES = {number: name for name, number in _RULES.items()}
_ORDER_NAMES = {number: name for name, number in _ORDERS.items()}


def check_rule(rule: str) -> str:
    if rule not in _RULES:
        raise ValueError(f"unknown request select rule {rule!r} (choose {', '.join(SELECT_RULES)})")
    return rule


def check_order(order: str) -> str:
    if order not in _ORDERS:
        raise ValueError(f"unknown request select order {order!r} (choose {', '.join(SELECT_ORDERS)})")
    return order


def check_method(method: str) -> str:
    if method not in _METHODS:
        raise ValueError(f"unknown migration method {method!r} (choose {', '.join(MIGRATION_METHODS)})")
    return method


def rule_number(rule: str) -> int:
    return _RULES[check_rule(rule)]


def order_number(order: str) -> int:
    return _ORDERS[check_order(order)]


def method_number(method: str) -> int:
    return _METHODS[check_method(method)]


def rule_name(number: int) -> str | None:
    return _RULE_NAMES.get(number)


def order_name(number: int) -> str | None:
    return _ORDER_NAMES.get(number)
