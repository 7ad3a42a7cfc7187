"""What a client's flow-control headers may claim: a band up to --client-priority-max, never above it."""

import asyncio

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from pilotfish.discovery.static import parse_instances
from pilotfish.ext_proc.flow import BAND_NAMES, FlowHeaders, flow_of
from pilotfish.ext_proc.processor import ExtProcServicer
from pilotfish.ext_proc.routing import CircuitBreaker, Router
from pilotfish.ext_proc.telemetry import ExtProcMetrics
from pilotfish.protos import scheduler_pb2

UNSPECIFIED = scheduler_pb2.PRIORITY_UNSPECIFIED
CRITICAL, STANDARD, SHEDDABLE = (
    scheduler_pb2.PRIORITY_CRITICAL,
    scheduler_pb2.PRIORITY_STANDARD,
    scheduler_pb2.PRIORITY_SHEDDABLE,
)
BODY = b'{"model": "m", "prompt": "hello there", "max_tokens": 4}'


@pytest.mark.parametrize("max_claim", BAND_NAMES)
@pytest.mark.parametrize("claim", [*BAND_NAMES, "CRITICAL ", "urgent", ""])
def test_a_claim_above_the_cap_is_sent_as_the_models_band_and_flagged(max_claim: str, claim: str) -> None:
    flow = FlowHeaders(max_claim=max_claim)
    named = {"critical": CRITICAL, "standard": STANDARD, "sheddable": SHEDDABLE}.get(claim.strip().lower())
    priority, key, over = flow.read({"x-request-priority": claim, "x-tenant-id": "acme"})
    assert key == flow_of("acme")
    if named is None:  # no band named: the model's band, and nothing claimed
        assert (priority, over) == (UNSPECIFIED, False)
    elif named < {"critical": CRITICAL, "standard": STANDARD, "sheddable": SHEDDABLE}[max_claim]:
        assert (priority, over) == (UNSPECIFIED, True)
    else:
        assert (priority, over) == (named, False)


class RecordingRouter(Router):
    """The gateway's router with no scheduler (round-robin), keeping each Schedule request it is given."""

    def __init__(self) -> None:
        super().__init__(None, parse_instances(["e0=127.0.0.1:9001"]), breaker=CircuitBreaker(3, 1.0))
        self.asked: list[scheduler_pb2.ScheduleRequest] = []

    async def choose(self, request: scheduler_pb2.ScheduleRequest):  # type: ignore[no-untyped-def]
        self.asked.append(request)
        return await super().choose(request)


def schedule_request(priority: str, flow: FlowHeaders) -> tuple[scheduler_pb2.ScheduleRequest, float]:
    """The Schedule request the servicer sends for a completion with this priority header, and the
    count of ignored claims after it."""
    router, metrics = RecordingRouter(), ExtProcMetrics()
    svc = ExtProcServicer(router, lambda text: [1] * len(text.split()), frozenset(), 1 << 20, metrics,
                          flow_headers=flow)
    headers = base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
        base_pb2.HeaderValue(key="x-request-priority", raw_value=priority.encode()),
    ])
    messages = [ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=headers)),
                ep.ProcessingRequest(request_body=ep.HttpBody(body=BODY, end_of_stream=True))]

    async def feed():  # type: ignore[no-untyped-def]
        for m in messages:
            yield m

    async def drive() -> None:
        async for _ in svc.Process(feed(), None):
            pass

    asyncio.run(drive())
    (asked,) = router.asked
    return asked, metrics.registry.get_sample_value("pilotfish_ext_proc_priority_claims_ignored_total")


def test_by_default_a_client_cannot_claim_critical_but_may_lower_itself() -> None:
    asked, ignored = schedule_request("critical", FlowHeaders())
    assert (asked.priority, ignored) == (UNSPECIFIED, 1)
    asked, ignored = schedule_request("sheddable", FlowHeaders())
    assert (asked.priority, ignored) == (SHEDDABLE, 0)


def test_an_operator_who_sets_the_header_upstream_lets_it_claim_critical() -> None:
    asked, ignored = schedule_request("critical", FlowHeaders(max_claim="critical"))
    assert (asked.priority, ignored) == (CRITICAL, 0)
