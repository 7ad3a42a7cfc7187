"""The scheduler's input bounds, report guard and per-peer rates (scheduler/limits.py), alone and
through the servicer in front of a real core."""

from __future__ import annotations

import grpc
import pytest

from pilotfish.protos import scheduler_pb2
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.limits import OutOfBounds, PeerRates, ReportGuard, RequestBounds, TokenBucket, peer_host
from pilotfish.scheduler.service import SchedulerServicer, request_from_proto

BOUNDS = RequestBounds(max_model_len=1000, max_prefix_block_hashes=4, max_request_id_length=8)


def req(**fields: object) -> scheduler_pb2.ScheduleRequest:
    return scheduler_pb2.ScheduleRequest(**{"request_id": "r", "model": "m", **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"prompt_tokens": 1001}, "prompt_tokens"),
        ({"prompt_tokens": 4_000_000_000}, "prompt_tokens"),
        ({"max_tokens": 1001}, "max_tokens"),
        ({"request_id": "x" * 9}, "request_id_length"),
        ({"model": "m" * 257}, "model_length"),
        ({"prefix_block_hashes": [1, 2, 3, 4, 5]}, "prefix_block_hashes"),
    ],
)
def test_a_schedule_out_of_bounds_is_invalid_argument(fields: dict[str, object], reason: str) -> None:
    with pytest.raises(OutOfBounds) as info:
        request_from_proto(req(**fields), BOUNDS)
    assert (info.value.code, info.value.reason) == ("INVALID_ARGUMENT", reason)


def test_a_schedule_at_the_bounds_is_taken() -> None:
    info = request_from_proto(
        req(request_id="x" * 8, prompt_tokens=1000, max_tokens=1000, prefix_block_hashes=[1, 2, 3, 4]), BOUNDS
    )
    assert (info.prompt_tokens, info.max_tokens, len(info.prefix_block_hashes)) == (1000, 1000, 4)


def report(rid: str, generated: int, prefill_done: bool = False, served: str = "") -> scheduler_pb2.TokenReport:
    return scheduler_pb2.TokenReport(
        request_id=rid, generated_tokens=generated, prefill_done=prefill_done, served_address=served
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_report_guard_clamps_to_what_the_stream_can_generate_and_drops_no_progress() -> None:
    guard = ReportGuard(max_model_len=1000, staleness_seconds=300, clock=Clock())
    guard.scheduled("a", prompt_tokens=10, max_tokens=5)  # max_tokens bounds it
    guard.scheduled("b", prompt_tokens=990, max_tokens=0)  # the model length less the prompt bounds it
    assert guard.admit(report("a", 0, prefill_done=True)) == (0, "")  # the prefill is progress
    assert guard.admit(report("a", 0, prefill_done=True)) == (0, "no_progress")
    assert guard.admit(report("a", 3)) == (3, "")
    assert guard.admit(report("a", 3)) == (3, "no_progress")  # a repeat renews nothing
    assert guard.admit(report("a", 2)) == (2, "no_progress")  # nor an older count
    assert guard.admit(report("a", 3, served="10.0.0.1:1")) == (3, "")  # a move is news
    assert guard.admit(report("a", 4_000_000_000)) == (5, "clamped")
    assert guard.admit(report("a", 9)) == (5, "no_progress")  # at the bound: no more renewals
    assert guard.admit(report("b", 50)) == (10, "clamped")
    assert guard.admit(report("unknown", 4_000_000_000)) == (1000, "clamped")
    assert guard.admit(report("unknown", 7)) == (7, "")
    guard.released("a")
    assert guard.admit(report("a", 4_000_000_000)) == (1000, "clamped")  # forgotten: the model length only


def test_a_release_counts_no_longer_answer_than_the_stream_could_generate() -> None:
    guard = ReportGuard(max_model_len=1000, staleness_seconds=300, clock=Clock())
    guard.scheduled("r", prompt_tokens=100, max_tokens=50)
    assert guard.released("r", 70) == 50  # clamped as a report is
    assert guard.released("r", 70) == 70  # forgotten: only the model length bounds it
    assert guard.released("x", 5000) == 1000


def test_report_guard_forgets_what_the_account_would_have_expired() -> None:
    clock = Clock()
    guard = ReportGuard(max_model_len=1000, staleness_seconds=10, clock=clock)
    guard.scheduled("old", 1, 0)
    clock.now += 5
    guard.scheduled("new", 1, 0)
    clock.now += 6
    guard.scheduled("newest", 1, 0)  # expiry runs here: "old" is 11 s quiet
    assert len(guard) == 2


def test_token_bucket_allows_its_burst_then_its_rate() -> None:
    bucket = TokenBucket(rate=10, burst=20, now=0.0)
    assert all(bucket.take(1, 0.0) for _ in range(20))
    assert not bucket.take(1, 0.0)
    assert bucket.take(1, 0.1) and not bucket.take(1, 0.1)  # 0.1 s at 10/s: one more
    assert bucket.take(20, 100.0) and not bucket.take(21, 200.0)  # never more than the burst


def test_peer_rates_share_a_bucket_per_peer_and_stay_bounded() -> None:
    clock = Clock()
    rates = PeerRates(schedule_rate=1, report_rate=0, release_rate=5, burst_seconds=2, clock=clock, max_peers=3)
    a = rates.peer("10.0.0.1")
    assert rates.peer("10.0.0.1") is a and a.report is None  # rate 0: unlimited
    assert a.schedule is not None and a.schedule.take(2, clock()) and not a.schedule.take(1, clock())
    for host in ("10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"):
        rates.peer(host)
    assert len(rates) <= 3
    assert rates.peer("10.0.0.1").schedule is not a.schedule or len(rates) <= 3


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:10.1.2.3:5555", "10.1.2.3"),
        ("ipv6:[::1]:5555", "::1"),
        ("ipv6:%5B::1%5D:1", "::1"),  # grpc's own form
        ("unix:/tmp/s", "unix:/tmp/s"),
        ("10.1.2.3:80", "10.1.2.3"),
        ("[fd00::1]:80", "fd00::1"),
    ],
)
def test_peer_host(peer: str, host: str) -> None:
    assert peer_host(peer) == host


# ---- through the servicer, over a real core -------------------------------------------------------


def servicer(clock: Clock | None = None, **fields: object) -> tuple[SchedulerServicer, SchedulerCore]:
    config = SchedulerConfig(
        instances=["e0=127.0.0.1:8001", "e1=127.0.0.1:8002"],
        model=["m"],
        **{"request_local_account_staleness_seconds": 60.0, **fields},  # type: ignore[arg-type]
    )
    clock = clock or Clock()
    core = SchedulerCore(config, clock=clock)
    srv = SchedulerServicer(core, config)
    srv._guard = ReportGuard(config.max_model_len, config.request_local_account_staleness_seconds, clock)
    return srv, core


def session(seq: int, **fields: object) -> scheduler_pb2.SessionRequest:
    return scheduler_pb2.SessionRequest(seq=seq, schedule=req(**fields))


def reports(*items: scheduler_pb2.TokenReport) -> scheduler_pb2.SessionRequest:
    return scheduler_pb2.SessionRequest(report=scheduler_pb2.ReportRequest(reports=list(items)))


def test_forged_huge_prompts_are_refused_and_move_no_load() -> None:
    """Attack (ii), first part: 40 Schedules with prompt_tokens = 4e9 would have pinned the fleet."""
    srv, core = servicer()
    answer = srv.answerer("10.0.0.66")
    replies = [answer(session(i, request_id=f"forged-{i}", prompt_tokens=4_000_000_000)) for i in range(40)]
    assert all(r is not None and r.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] for r in replies)
    assert "over the max model length" in replies[0].error.message  # type: ignore[union-attr]
    assert core.account_size == 0 and srv.stats.refused[("schedule", "prompt_tokens")] == 40
    # real requests still spread over both engines
    targets = {answer(session(100 + i, request_id=f"real-{i}", prompt_tokens=100)).schedule.target.instance_id  # type: ignore[union-attr]
               for i in range(4)}  # fmt: skip
    assert targets == {"e0", "e1"}


def test_reports_cannot_keep_a_forged_entry_alive_past_the_staleness_expiry() -> None:
    clock = Clock()
    srv, core = servicer(clock)
    answer = srv.answerer("10.0.0.66")
    assert answer(session(1, request_id="forged", prompt_tokens=1000, max_tokens=3)).WhichOneof("kind") == "schedule"
    # a Report every 30 s, with the same count or beyond max_tokens: none renews the entry
    for count in (3, 3, 50, 4_000_000_000, 3):
        clock.now += 30
        answer(reports(report("forged", count)))
        core.expire()
    assert core.account_size == 0  # reclaimed 60 s after the last renewal (the first report)
    # clamped to max_tokens (3), the big counts bring no progress either
    assert srv.stats.refused[("report", "no_progress")] == 4


def test_a_peer_over_its_rates_gets_resource_exhausted_and_its_reports_dropped() -> None:
    srv, core = servicer(peer_schedule_rate=1.0, peer_report_rate=2.0, peer_release_rate=1.0, peer_rate_burst_seconds=2)
    # the rate clock is real: at 1/s a test does not refill a whole token between two calls
    answer = srv.answerer("10.0.0.7")
    first = [answer(session(i, request_id=f"r{i}", prompt_tokens=10)) for i in range(3)]
    assert [r.WhichOneof("kind") for r in first] == ["schedule", "schedule", "error"]  # type: ignore[union-attr]
    assert first[2].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]  # type: ignore[union-attr]
    # another peer has its own buckets
    assert srv.answerer("10.0.0.8")(session(9, request_id="other", prompt_tokens=10)).WhichOneof("kind") == "schedule"  # type: ignore[union-attr]
    answer(reports(report("r0", 1), report("r1", 1)))  # 2 reports: the burst (4) holds them
    answer(reports(report("r0", 2), report("r1", 2), report("r0", 3)))  # 3 more: over it, all dropped
    assert core.load("e0").num_tokens + core.load("e1").num_tokens == 10 + 10 + 1 + 1 + 10
    assert srv.stats.refused[("report", "rate_limited")] == 3
    for rid in ("r0", "r1", "r0"):  # a burst of 2 releases: the third is dropped
        answer(scheduler_pb2.SessionRequest(release=scheduler_pb2.ReleaseRequest(request_id=rid)))
    assert core.account_size == 1  # "other", another peer's
    assert srv.stats.refused[("schedule", "rate_limited")] == 1
    assert srv.stats.refused[("release", "rate_limited")] == 1
