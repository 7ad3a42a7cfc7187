"""What the scheduler's callers may send, and how fast: input bounds, report guard, per-peer rates.

Every listener (the gRPC service, the Session stream, the Session socket) goes through these:

- `RequestBounds.check` refuses a ScheduleRequest outside the configured bounds (`max_model_len`
  for prompt_tokens and max_tokens, a bounded request id, model name and prefix-hash list) with
  `OutOfBounds`, an INVALID_ARGUMENT. One forged Schedule with prompt_tokens = 4e9 would
  otherwise weigh more than a fleet's real load.
- `ReportGuard` remembers, for each request this scheduler answered, the most tokens a real
  stream of it can generate (its max_tokens, or the model length less its prompt) and the last
  count applied. A Report above that is clamped to it; one that brings no progress (the same or a
  lower count, no new prefill_done, no move) is dropped and does not renew the held request, so
  the account's staleness expiry still reclaims a forged entry however many Reports name it.
- `PeerRates` keeps a token bucket per peer IP for Schedule, Report (counted per TokenReport) and
  Release; the defaults are far above what a gateway sends. Over the limit a Schedule is answered
  RESOURCE_EXHAUSTED (the gateway answers its client 429); a Session's report or release is
  dropped, a unary Report or Release answered RESOURCE_EXHAUSTED. Each refusal is counted
  (`ListenerStats`, exported by telemetry.py).
- `grpc_server_options` turns the config into grpc.aio server options (message size, streams,
  connections, idle and keepalive).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import unquote

from pilotfish.protos import scheduler_pb2
from pilotfish.scheduler.errors import InvalidRequestError, SchedulerError

if TYPE_CHECKING:
    from pilotfish.scheduler.config import SchedulerConfig

MAX_MODEL_NAME_LENGTH = 256  # as the CMS bounds a model name (cms/records.py)
# gRPC keepalive: how long the server waits for a ping's answer before it drops the connection
GRPC_KEEPALIVE_TIMEOUT_MS = 20_000
# the per-peer bucket table is bounded: beyond it, idle (full) buckets are forgotten first
MAX_PEERS = 4096


class OutOfBounds(InvalidRequestError):
    """A request outside the configured bounds; `reason` labels the refusal metric."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class RequestBounds:
    max_model_len: int = 1_048_576
    max_prefix_block_hashes: int = 65_536
    max_request_id_length: int = 256

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> RequestBounds:
        return cls(
            max_model_len=config.max_model_len,
            max_prefix_block_hashes=config.max_prefix_block_hashes,
            max_request_id_length=config.max_request_id_length,
        )

    def check(self, request: scheduler_pb2.ScheduleRequest) -> None:
        """Raise OutOfBounds (INVALID_ARGUMENT) naming the first field out of bounds."""
        if len(request.request_id) > self.max_request_id_length:
            raise OutOfBounds(
                f"request_id of {len(request.request_id)} characters; at most {self.max_request_id_length}",
                "request_id_length",
            )
        if len(request.model) > MAX_MODEL_NAME_LENGTH:
            raise OutOfBounds(
                f"model name of {len(request.model)} characters; at most {MAX_MODEL_NAME_LENGTH}", "model_length"
            )
        if request.prompt_tokens > self.max_model_len:
            raise OutOfBounds(
                f"prompt_tokens {request.prompt_tokens} is over the max model length {self.max_model_len}",
                "prompt_tokens",
            )
        if request.max_tokens > self.max_model_len:
            raise OutOfBounds(
                f"max_tokens {request.max_tokens} is over the max model length {self.max_model_len}", "max_tokens"
            )
        if len(request.prefix_block_hashes) > self.max_prefix_block_hashes:
            raise OutOfBounds(
                f"{len(request.prefix_block_hashes)} prefix block hashes; at most {self.max_prefix_block_hashes}",
                "prefix_block_hashes",
            )

    def check_id(self, request_id: str) -> str:
        """The reason a Report's or Release's request id is refused, or "" (an id no Schedule could hold)."""
        return "request_id_length" if len(request_id) > self.max_request_id_length else ""


class ReportGuard:
    """Per answered request: [most tokens a real stream can report, last count applied, prefill
    seen, last activity]; ordered by activity so expiry pops from the front, as the LRS does.

    Not thread-safe: one owner, the service's loop.
    """

    def __init__(
        self, max_model_len: int, staleness_seconds: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_model_len = max_model_len
        self.staleness_seconds = staleness_seconds
        self._clock = clock
        self._held: OrderedDict[str, list] = OrderedDict()  # type: ignore[type-arg]

    def __len__(self) -> int:
        return len(self._held)

    def scheduled(self, request_id: str, prompt_tokens: int, max_tokens: int) -> None:
        """A Schedule was answered (a repeat only counts as activity, as in the LRS)."""
        now = self._clock()
        held = self._held.get(request_id)
        if held is not None:
            held[3] = now
            self._held.move_to_end(request_id)
        else:
            cap = max(self.max_model_len - prompt_tokens, 0)
            if max_tokens:
                cap = min(cap, max_tokens)
            self._held[request_id] = [cap, 0, False, now]
        deadline = now - self.staleness_seconds
        held_ = self._held
        while held_:
            first = next(iter(held_.values()))
            if first[3] > deadline:
                break
            held_.popitem(last=False)

    def released(self, request_id: str, generated_tokens: int = 0) -> int:
        """Forget the request; returns the answer length its release may count, clamped as a report's."""
        held = self._held.pop(request_id, None)
        cap = self.max_model_len if held is None else held[0]
        return min(generated_tokens, cap)

    def admit(self, report: scheduler_pb2.TokenReport) -> tuple[int, str]:
        """(generated_tokens to apply, why it was changed or dropped: "" / "clamped" / "no_progress").

        A dropped report (no_progress) must not reach the core: there it would renew the entry."""
        generated = report.generated_tokens
        held = self._held.get(report.request_id)
        if held is None:  # not answered here (or forgotten): only the model length bounds it
            if generated > self.max_model_len:
                return self.max_model_len, "clamped"
            return generated, ""
        why = ""
        if generated > held[0]:
            generated, why = held[0], "clamped"
        progress = generated > held[1] or (report.prefill_done and not held[2]) or bool(report.served_address)
        if not progress:
            return generated, "no_progress"
        held[1] = max(held[1], generated)
        held[2] = held[2] or report.prefill_done
        held[3] = self._clock()
        self._held.move_to_end(report.request_id)
        return generated, why


class TokenBucket:
    __slots__ = ("burst", "last", "rate", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.last = now

    def take(self, n: float, now: float) -> bool:
        tokens = self.tokens + (now - self.last) * self.rate
        if tokens > self.burst:
            tokens = self.burst
        self.last = now
        if tokens >= n:
            self.tokens = tokens - n
            return True
        self.tokens = tokens
        return False

    def full(self, now: float) -> bool:
        return self.tokens + (now - self.last) * self.rate >= self.burst


class PeerBuckets:
    """One peer's buckets; None for a call that is not limited (rate 0)."""

    __slots__ = ("release", "report", "schedule")

    def __init__(self, rates: PeerRates, now: float) -> None:
        self.schedule = rates.bucket(rates.schedule_rate, now)
        self.report = rates.bucket(rates.report_rate, now)
        self.release = rates.bucket(rates.release_rate, now)

    def full(self, now: float) -> bool:
        return all(b is None or b.full(now) for b in (self.schedule, self.report, self.release))


class PeerRates:
    """Token buckets per peer IP (every connection of a peer shares them)."""

    def __init__(
        self,
        schedule_rate: float,
        report_rate: float,
        release_rate: float,
        burst_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        max_peers: int = MAX_PEERS,
    ) -> None:
        self.schedule_rate = schedule_rate
        self.report_rate = report_rate
        self.release_rate = release_rate
        self.burst_seconds = burst_seconds
        self.clock = clock
        self._max_peers = max_peers
        self._peers: dict[str, PeerBuckets] = {}

    @classmethod
    def from_config(cls, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> PeerRates:
        return cls(
            config.peer_schedule_rate,
            config.peer_report_rate,
            config.peer_release_rate,
            config.peer_rate_burst_seconds,
            clock,
        )

    def bucket(self, rate: float, now: float) -> TokenBucket | None:
        return TokenBucket(rate, max(rate * self.burst_seconds, 1.0), now) if rate > 0 else None

    def peer(self, host: str) -> PeerBuckets:
        found = self._peers.get(host)
        if found is not None:
            return found
        now = self.clock()
        if len(self._peers) >= self._max_peers:
            # a full bucket is the same as a new one: forget those first, then the oldest
            for key in [k for k, b in self._peers.items() if b.full(now)]:
                del self._peers[key]
            while len(self._peers) >= self._max_peers:
                del self._peers[next(iter(self._peers))]
        buckets = self._peers[host] = PeerBuckets(self, now)
        return buckets

    def __len__(self) -> int:
        return len(self._peers)


def peer_host(peer: str) -> str:
    """The address part of a grpc peer string ('ipv4:1.2.3.4:5', 'ipv6:[::1]:5', 'unix:/p') or of
    'host:port'; the rate limits key on it, so every connection of one peer shares its buckets."""
    kind, sep, rest = peer.partition(":")
    if sep and kind in ("ipv4", "ipv6", "unix", "unix-abstract"):
        if kind.startswith("unix"):
            return peer
        peer = unquote(rest)  # grpc writes an IPv6 peer as ipv6:%5B::1%5D:port
    if peer.startswith("["):
        return peer[1 : peer.find("]")] if "]" in peer else peer
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


@dataclass(slots=True)
class ListenerStats:
    """Refusals on the scheduler's listeners, exported by telemetry.ListenerCollector."""

    refused: Counter[tuple[str, str]] = field(default_factory=Counter)  # (call, reason)
    session_closed: Counter[str] = field(default_factory=Counter)  # Session socket closes, by reason
    session_connections: Callable[[], int] = lambda: 0  # open Session socket connections

    def refuse(self, call: str, reason: str, n: int = 1) -> None:
        self.refused[(call, reason)] += n


def grpc_server_options(config: SchedulerConfig) -> list[tuple[str, int]]:
    """grpc.aio server options from the scheduler's limits (grpc core 1.85 names).

    `grpc.max_allowed_incoming_connections` caps the server's open connections (grpc core refuses
    the ones beyond it); refusals made inside grpc core (an oversize message, a connection over the
    cap) are not visible to Python and not counted by ListenerStats."""
    c = config
    options = [
        ("grpc.max_receive_message_length", c.max_message_bytes),
        ("grpc.max_concurrent_streams", c.grpc_max_concurrent_streams),
        ("grpc.max_connection_idle_ms", int(c.grpc_max_connection_idle_seconds * 1000)),
        ("grpc.keepalive_time_ms", int(c.grpc_keepalive_seconds * 1000)),
        ("grpc.keepalive_timeout_ms", GRPC_KEEPALIVE_TIMEOUT_MS),
    ]
    if c.grpc_max_connections:
        options.append(("grpc.max_allowed_incoming_connections", c.grpc_max_connections))
    return options


class RateLimited(SchedulerError):
    """Over a peer's rate: the gateway answers its client 429 and may retry."""

    code = "RESOURCE_EXHAUSTED"
