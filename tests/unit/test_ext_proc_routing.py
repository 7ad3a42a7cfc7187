"""Fallback routing: round-robin order and the circuit breaker's states."""

import pytest

from pilotfish.discovery.static import Instance, parse_instance, parse_instances
from pilotfish.ext_proc.openai import RequestError
from pilotfish.ext_proc.routing import CircuitBreaker, RoundRobin


def test_round_robin_cycles_in_order():
    rr = RoundRobin([Instance("a", "h", 1), Instance("b", "h", 2)])
    assert [rr.pick().instance_id for _ in range(5)] == ["a", "b", "a", "b", "a"]


def test_round_robin_with_no_instance_is_503():
    with pytest.raises(RequestError) as info:
        RoundRobin([]).pick()
    assert info.value.status == 503


def test_breaker_opens_after_threshold_and_probes_once(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("pilotfish.ext_proc.routing.time.monotonic", lambda: now[0])
    breaker = CircuitBreaker(threshold=2, open_seconds=5)
    assert breaker.allow()
    breaker.failure()
    assert breaker.allow()  # one failure is below the threshold
    breaker.failure()
    assert not breaker.allow()  # open
    now[0] += 5.1
    assert breaker.allow()  # half-open: one probe
    assert not breaker.allow()  # ... and only one
    breaker.failure()  # the probe failed: open again
    assert not breaker.allow()
    now[0] += 5.1
    assert breaker.allow()
    breaker.success()  # recovered: closed
    assert breaker.allow() and breaker.allow()


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("127.0.0.1:8001", Instance("127.0.0.1:8001", "127.0.0.1", 8001)),
        ("e0=10.0.0.1:9000", Instance("e0", "10.0.0.1", 9000)),
        ("e1=[::1]:9000", Instance("e1", "::1", 9000)),
    ],
)
def test_parse_instance(spec, expected):
    assert parse_instance(spec) == expected


@pytest.mark.parametrize("spec", ["nohost", "e0=host", "e0=host:x", "e0=host:0", "=h:1", "h:70000"])
def test_parse_instance_rejects(spec):
    with pytest.raises(ValueError, match="instance"):
        parse_instance(spec)


def test_duplicate_ids_rejected():
    with pytest.raises(ValueError, match="twice"):
        parse_instances(["a=h:1", "a=h:2"])


def test_address_brackets_ipv6():
    assert parse_instance("e=[::1]:9000").address == "[::1]:9000"
    assert parse_instance("e=10.0.0.1:9000").address == "10.0.0.1:9000"
