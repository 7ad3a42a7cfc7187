"""Which requests a migration moves: the rescheduler's rule x order x value, in one place.

    select_requests(candidates, rule="TOKEN", order="SR", value=1024, total_kv_tokens=...)

Used by the llumlet (over its LoadState) and by the virtual-time cluster (over its engines'
requests), so both move the same requests for the same flags.

Orders (--rescheduling-req-select-order):
  LCR    running requests, last come first
  FCR    running requests, first come first
  LR     running requests, longest sequence (prompt + generated) first
  SR     running requests, shortest sequence first
  FCW    waiting requests, first come first
  FCWSR  waiting requests first come first; if none wait, running shortest first

Rules (--rescheduling-req-select-rule), over the ordered requests:
  NUM_REQ  the first `value` requests
  TOKEN    requests in order until their tokens reach `value`
  RATIO    requests in order until their tokens reach `value` (0..1) of the instance's KV cache
A TOKEN or RATIO selection always takes at least the first request, so a long request is never
stuck where it is because it alone exceeds the budget.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# the names, and their checks, come from llumlet.proto's enums (protos/migration_selection.py)
from pilotfish.protos.migration_selection import SELECT_ORDERS, check_order, check_rule

__all__ = ["MigrationCandidate", "check_order", "check_rule", "ordered", "select_requests"]


@dataclass(frozen=True, slots=True)
class MigrationCandidate:
    request_id: str
    arrival: float  # any increasing clock or sequence number: only the order matters
    running: bool  # in the running batch (waiting otherwise)
    num_tokens: int  # prompt + generated


def ordered(candidates: Iterable[MigrationCandidate], order: str) -> list[MigrationCandidate]:
    """The candidates an order considers, first to move first; ties keep arrival order."""
    cands = sorted(candidates, key=lambda c: (c.arrival, c.request_id))
    running = [c for c in cands if c.running]
    waiting = [c for c in cands if not c.running]
    if order == "LCR":
        return running[::-1]
    if order == "FCR":
        return running
    if order == "LR":
        return sorted(running, key=lambda c: -c.num_tokens)
    if order == "SR":
        return sorted(running, key=lambda c: c.num_tokens)
    if order == "FCW":
        return waiting
    if order == "FCWSR":
        return waiting or sorted(running, key=lambda c: c.num_tokens)
    raise ValueError(f"unknown request select order {order!r} (choose {', '.join(SELECT_ORDERS)})")


def select_requests(
    candidates: Sequence[MigrationCandidate],
    rule: str,
    order: str,
    value: float,
    total_kv_tokens: int = 0,
) -> list[str]:
    """The ids to migrate, in the order they should go."""
    check_rule(rule)
    queue = ordered(candidates, order)
    if not queue or value <= 0:
        return []
    if rule == "NUM_REQ":
        return [c.request_id for c in queue[: max(1, math.floor(value))]]
    budget = value if rule == "TOKEN" else min(value, 1.0) * total_kv_tokens
    chosen: list[str] = []
    tokens = 0
    for c in queue:
        if chosen and tokens >= budget:
            break
        chosen.append(c.request_id)
        tokens += c.num_tokens
    return chosen
