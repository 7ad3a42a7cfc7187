"""The CMS reader: keeps a sink in step with the records in Redis (the scheduler's full-mode view).

Two paths:

- **notices**: each writer publishes a notice on its own channel,
  `keys.instance_events_channel(cluster, id)`, after each write (cms/notices.py); a status notice
  carries the record itself, any other makes the reader GET that one key. A notice about another
  instance than its channel's is refused (counted, nothing read), and one on the shared channel
  (`keys.events_channel`) is only ever a reason to GET, so a Redis ACL that confines each llumlet
  to its own keys and its own channel confines what its notices can change too. The decoded record
  is handed over at once, from the subscription's transport callback (no task wakes per notice).
  Of the statuses one read of the subscription brings, only each instance's newest is decoded. A
  channel whose instance id passed the checks once is remembered, so its next status notices are
  taken without splitting and checking again;
- **poll**: every `poll_interval` seconds it SCANs both key patterns and reads the values, both
  kinds in one pipelined round trip each, so a lost notice, a reader that subscribed late, or an
  expired key (a dead llumlet) is caught up.
  A value identical to the one last seen (by its digest) is not decoded again.

Values are read with GETRANGE 0..MAX_RECORD_BYTES, so a record over the size bound is refused
without being transferred whole, let alone decoded. Records are decoded by `cms.records`
(strict, bounded); a bad one is counted by reason, logged at WARNING (rate-limited per instance
and reason, cms/refusals.py) and skipped, and the sink keeps what it held. Of a refused record
only a summary is kept (`Rejected`: instance, reason, size, digest), and a fingerprint of the value
its key held (`RefusedKeys`, bounded), so the same value polled again costs a lookup: it is not
decoded, counted or logged again until the key changes or leaves Redis. Redis faults are retried
with exponential backoff and jitter, capped at MAX_BACKOFF so the view resumes within about a
second of Redis returning (a WARNING when the outage starts, INFO when it ends); the reader never
exits on one. Everything runs on the caller's event loop, so the sink needs no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from pilotfish.cms import keys
from pilotfish.cms.notices import MAX_BULK, MAX_NOTICE, OVERSIZED, PushParser, pack_command, split_notice
from pilotfish.cms.records import (
    INVALID,
    MALFORMED,
    MAX_RECORD_BYTES,
    OVERSIZE,
    BadRecord,
    Rejected,
    decode_metadata,
    decode_status,
    digest,
)
from pilotfish.cms.refusals import LOG_INTERVAL_SECONDS, RefusalLog, RefusedKeys
from pilotfish.protos import cms_pb2

log = logging.getLogger(__name__)

MGET_BATCH = 512
SCAN_COUNT = 1000
# How long a record must stay missing before the reader believes its instance gone (see __init__).
REMOVAL_GRACE_SECONDS = 3.0
# the refusal reason of a notice published on one instance's channel about another
NOTICE_SENDER = "notice_sender"

# Reconnect backoff: doubles from FIRST_BACKOFF to MAX_BACKOFF, each sleep drawn from [half, all]
# of it, so readers do not reconnect in step and one resumes within ~1 s of Redis returning.
FIRST_BACKOFF = 0.05
MAX_BACKOFF = 1.0
# a failure this soon after Redis answered again continues the backoff (and says nothing new): a
# Redis, proxy or load balancer that takes the connection and drops it at once is not retried (and
# logged) twenty times a second
STABLE_AFTER = 10.0
CONNECT_TIMEOUT = 2.0
CLOSE_TIMEOUT = 1.0
# summaries of refused records kept (one per key, for `rejected()`); beyond this the oldest is
# forgotten. Whether a key's value was refused already is `RefusedKeys`'s, with a larger bound.
MAX_REJECTED = 4 * MGET_BATCH
# the value digest a key refused for its name is remembered with (its value is never read)
_BAD_NAME = digest(b"")
# own channels whose instance id has been checked (see `_Sender`); beyond this they are checked afresh
MAX_SENDERS = 4096


class CmsSink(Protocol):
    def apply_metadata(self, meta: cms_pb2.InstanceMetadata) -> bool: ...
    def apply_status(self, status: cms_pb2.InstanceStatus) -> bool: ...
    def status_gone(self, instance_id: str) -> None: ...
    def remove(self, instance_id: str) -> bool: ...
    def known(self) -> set[str]: ...

    # optional: `record_refused(instance_id, reason)` is called for every record the reader refuses


class CmsReader:
    def __init__(
        self,
        redis_url: str,
        cluster: str,
        sink: CmsSink,
        poll_interval: float = 2.0,
        *,
        redis_options: dict[str, Any] | None = None,
        removal_grace: float = REMOVAL_GRACE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        notice_records: bool = True,
    ) -> None:
        """`redis_options`: extra redis-py connection options (the password, rediss:// CA and client
        certificate: pilotfish/security.py's `redis_options`). `notice_records`: take a status from the
        notice that carries it on its writer's own channel (never from the shared channel); False reads
        the key instead, where ACLs confine each llumlet's keys but not its notice channel."""
        self.notice_records = notice_records
        keys.check_id(cluster, "cluster name")
        self.redis_url = redis_url
        self._redis_options = dict(redis_options or {})
        self.cluster = cluster
        self.sink = sink
        self.poll_interval = poll_interval
        self._client: Any = None
        # a digest of the last value each key held and handed over: records are never kept whole
        self._last_digest: dict[str, bytes] = {}
        self._rejected: dict[str, Rejected] = {}
        # which value each refused key held, so an unchanged one costs a lookup per poll
        self._refused_keys = RefusedKeys()
        self.num_unremembered = 0  # refusals past that memory's bound: not counted (see `_reject`)
        self._unremembered_logged_at = float("-inf")
        self._refusals = RefusalLog(log, clock, what="rejected CMS record")
        self._note_refused = getattr(sink, "record_refused", None)
        self._polled = asyncio.Event()
        self.num_redis_errors = 0
        self.num_polls = 0
        self.num_notices = 0
        self._own_channel_prefix = (keys.events_channel(cluster) + ":").encode()
        # own channel's name after the prefix -> its instance, once a notice there passed every check
        self._senders: dict[bytes, _Sender] = {}
        # A key missing from a poll is believed gone only after `removal_grace`: a Redis that restarts
        # comes back empty, and its llumlets write their records again within their refresh interval;
        # dropping the engines at once would leave nothing to schedule on in between.
        self.removal_grace = removal_grace
        self._clock = clock
        self._sleep = asyncio.sleep  # the reconnect backoff's wait (a test's own, so no other task's changes)
        self._missing_since: dict[tuple[str, str], float] = {}

    @property
    def num_bad_records(self) -> int:
        """Records refused (distinct values per key), all reasons."""
        return self._refusals.total

    @property
    def refused_by_reason(self) -> dict[str, int]:
        return dict(self._refusals.counts)

    def rejected(self) -> dict[str, Rejected]:
        """The summary of the refused record each key holds, where it holds one."""
        return dict(self._rejected)

    async def wait_first_poll(self, timeout: float | None = None) -> None:
        """Until one full poll has completed (the view holds everything Redis held then)."""
        await asyncio.wait_for(self._polled.wait(), timeout)

    async def run(self) -> None:
        """Subscribe and poll until cancelled."""
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # timeouts, so a half-open connection after a Redis restart fails (and is retried)
        # instead of hanging the poll forever; no retries inside redis-py (its default retries a
        # command ten times over seconds): `_retrying` owns the backoff, with its cap
        self._client = aioredis.from_url(
            self.redis_url,
            decode_responses=False,
            socket_connect_timeout=CONNECT_TIMEOUT,
            socket_timeout=10.0,
            retry=Retry(NoBackoff(), 0),
            **self._redis_options,
        )
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._retrying(self._listen, "notice subscription"))
                group.create_task(self._retrying(self._poll_forever, "poll"))
        finally:
            # bounded: closing talks to Redis, which may be the thing that is down
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._client.aclose(), CLOSE_TIMEOUT)

    async def _retrying(self, work: Any, what: str) -> None:
        backoff = FIRST_BACKOFF
        failing = False
        answered_at = -math.inf  # when Redis last answered again after failing (the clock's)

        def recovered() -> None:
            nonlocal failing, answered_at
            if failing:
                if self._clock() - answered_at >= STABLE_AFTER:
                    log.info("CMS %s: Redis answers again", what)
                failing = False
                answered_at = self._clock()

        while True:
            try:
                await work(recovered)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a Redis outage, a protocol error: never fatal
                _raise_if_cancelling(exc)
                self.num_redis_errors += 1
                if not failing and self._clock() - answered_at >= STABLE_AFTER:
                    log.warning("CMS %s failed (%s); retrying with backoff", what, exc)
                    backoff = FIRST_BACKOFF
                failing = True
            await self._sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, MAX_BACKOFF)

    async def _poll_forever(self, recovered: Any) -> None:
        while True:
            _raise_if_cancelling()
            await self.poll_once()
            recovered()
            self._polled.set()
            await asyncio.sleep(self.poll_interval)

    async def poll_once(self) -> None:
        """Read every record once: apply what changed, drop instances whose keys are gone."""
        meta_keys, status_keys = await self._scan(keys.meta_pattern(self.cluster), keys.status_pattern(self.cluster))
        found: list[tuple[str, str, str]] = []
        present: set[int] = set()  # every key this scan found, as `RefusedKeys` fingerprints it
        # metadata first, so a status finds its instance
        for kind, names in ((keys.META, meta_keys), (keys.STATUS, status_keys)):
            for name in names:
                try:
                    instance_id = keys.instance_in(name, self.cluster, kind)
                except keys.BadId as exc:
                    # refused by its name alone, unread: one such key must not stop the poll (the
                    # departures and newcomers it would otherwise miss)
                    present.add(hash(name))
                    present.add(hash(name.decode(errors="replace")))
                    self._refuse_name(name, exc)
                    continue
                key = name.decode()
                present.add(hash(key))
                found.append((key, kind, instance_id))
        # one pipeline for both kinds
        seen = await self._read_all(found)
        meta_seen, status_seen = seen[keys.META], seen[keys.STATUS]
        missing = {(keys.META, i) for i in self.sink.known() - meta_seen}
        held = self._last_digest
        missing |= {(keys.STATUS, i) for i in meta_seen - status_seen if keys.status_key(self.cluster, i) in held}
        now = self._clock()
        for gone in self._missing_since.keys() - missing:  # back (or forgotten): no longer pending
            del self._missing_since[gone]
        for kind, instance_id in missing:
            if now - self._missing_since.setdefault((kind, instance_id), now) < self.removal_grace:
                continue
            del self._missing_since[(kind, instance_id)]
            if kind == keys.META:
                self._forget(keys.meta_key(self.cluster, instance_id))
                self._forget(keys.status_key(self.cluster, instance_id))
                self.sink.remove(instance_id)
            elif self._forget(keys.status_key(self.cluster, instance_id)):
                self.sink.status_gone(instance_id)
        # digests of keys that are gone are forgotten, but for those whose departure waits out the
        # grace (the status check above needs them): a key whose instance the sink never knew (a status
        # with no metadata) has no departure, and ids rotated through Redis would be kept forever
        waiting = {keys.status_key(self.cluster, instance_id) for _, instance_id in self._missing_since}
        waiting |= {keys.meta_key(self.cluster, i) for kind, i in self._missing_since if kind == keys.META}
        for key in [key for key in held if hash(key) not in present and key not in waiting]:
            del held[key]
        # refusals of keys that are gone are forgotten: the memory holds only keys Redis holds
        self._refused_keys.retain(present)
        for key in [key for key in self._rejected if hash(key) not in present]:
            del self._rejected[key]
        self.num_polls += 1

    async def _scan(self, *patterns: str) -> list[list[bytes]]:
        """The keys matching each pattern: the SCANs of all patterns share a round trip (a poll's
        CPU is mostly per command, and the usual cluster's keys fit in one SCAN of each)."""
        found: list[list[bytes]] = [[] for _ in patterns]
        cursors = [0] * len(patterns)
        pending = list(range(len(patterns)))
        while pending:
            pipe = self._client.pipeline(transaction=False)
            for i in pending:
                pipe.scan(cursors[i], match=patterns[i], count=SCAN_COUNT)
            replies = await pipe.execute()
            for i, (cursor, batch) in zip(pending, replies, strict=True):
                found[i].extend(batch)
                cursors[i] = int(cursor)
            pending = [i for i in pending if cursors[i]]
        return found

    async def _read_all(self, found: list[tuple[str, str, str]]) -> dict[str, set[str]]:
        """Read and apply each (key, kind, instance) in order; the instances whose key held a value,
        by kind."""
        seen: dict[str, set[str]] = {keys.META: set(), keys.STATUS: set()}
        for start in range(0, len(found), MGET_BATCH):
            batch = found[start : start + MGET_BATCH]
            pipe = self._client.pipeline(transaction=False)
            for key, _, _ in batch:
                pipe.getrange(key, 0, MAX_RECORD_BYTES)  # at most one byte over the bound
            values = await pipe.execute(raise_on_error=False)
            for (key, kind, instance_id), raw in zip(batch, values, strict=True):
                if raw != b"":  # b"": gone since the SCAN (GETRANGE reads a missing key as empty)
                    # a key holding a bad record still exists: the sink keeps what it held
                    await self._apply(key, kind, raw, instance_id)
                    seen[kind].add(instance_id)
        return seen

    async def _listen(self, recovered: Any) -> None:
        # a connection of its own, made by redis-py (socket, TLS, AUTH, protocol handshake); from
        # then on its bytes go to `_Subscription`, which hands inline statuses over as they arrive
        conn = self._client.connection_pool.make_connection()
        try:
            await conn.connect()
            transport = conn._writer.transport
            subscription = _Subscription(self, transport.get_protocol())
            transport.set_protocol(subscription)
            leftover = bytes(getattr(conn._reader, "_buffer", b""))  # nothing is owed after the handshake
            if leftover:
                subscription.data_received(leftover)
            # the writers' own channels (a record they carry is theirs, where ACLs confine each writer
            # to its channel) and the shared one (plain notices only: GET what they name)
            transport.write(pack_command(b"PSUBSCRIBE", keys.instance_events_pattern(self.cluster).encode()))
            transport.write(pack_command(b"SUBSCRIBE", keys.events_channel(self.cluster).encode()))
            recovered()
            # notices sent while unsubscribed are lost: the next poll catches them up
            while True:
                await subscription.wake.wait()
                subscription.wake.clear()
                if subscription.ended is not None:
                    raise subscription.ended
                plain, subscription.to_read = subscription.to_read, {}
                for kind, instance_id in plain:
                    await self._read_key(kind, instance_id)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.disconnect(), CLOSE_TIMEOUT)

    def _take_notices(self, messages: list[list[object]]) -> dict[tuple[str, str], None]:
        """Hand over the inline statuses among `messages` (of each instance only the newest: the view
        would drop the older ones anyway); returns the plainly announced keys, to be read with a GET."""
        inline: dict[str, bytes] = {}
        plain: dict[tuple[str, str], None] = {}
        own_prefix = self._own_channel_prefix
        senders = self._senders
        for message in messages:
            sender: bytes | None  # the instance whose own channel carried it; None: the shared channel
            if len(message) == 4 and message[0] == b"pmessage" and isinstance(message[3], bytes):
                channel, data = message[2], message[3]
                if not isinstance(channel, bytes) or not channel.startswith(own_prefix):
                    continue
                sender = channel[len(own_prefix):]
                # the usual notice, a status on the channel of an instance whose id passed the checks
                # before: what split_notice would return (the id holds no ':'), without splitting
                known = senders.get(sender)
                if known is not None and len(data) <= MAX_NOTICE and data.startswith(known.status_prefix):
                    self.num_notices += 1
                    if self.notice_records:
                        inline[known.instance_id] = data[len(known.status_prefix):]
                    else:
                        plain[(keys.STATUS, known.instance_id)] = None
                    continue
            elif len(message) == 3 and message[0] == b"message" and isinstance(message[2], bytes):
                data, sender = message[2], None
            else:
                if OVERSIZED in message:  # a message over the parser's bound, discarded unread
                    self._refuse_notice(message, OVERSIZE, f"a notice of over {MAX_BULK} bytes")
                continue  # a subscription's confirmation, or nothing of ours
            notice = split_notice(data)
            if notice is None:
                # skipped, the subscription goes on: a publisher's bad notice must not cost every other
                # instance its fast path
                if len(data) > MAX_NOTICE:
                    self._refuse_notice(message, OVERSIZE, f"a notice of {len(data)} bytes (max {MAX_NOTICE})")
                else:
                    self._refuse_notice(message, MALFORMED, f"not a notice: {data[:80]!r}")
                continue
            self.num_notices += 1
            kind, instance_id, record = notice
            if sender is not None and sender != instance_id.encode():
                # published on one instance's channel about another: whoever may publish there is not
                # that instance; nothing is read or changed
                self._refusals.note(instance_id, NOTICE_SENDER, f"a notice about {instance_id!r} on "
                                    f"{sender.decode(errors='replace')!r}'s channel")
                if self._note_refused is not None:
                    self._note_refused(instance_id, NOTICE_SENDER)
                continue
            if sender is not None and sender not in senders:
                if len(senders) >= MAX_SENDERS:
                    senders.clear()
                senders[sender] = _Sender(instance_id, self.cluster)
            if record is None or sender is None or not self.notice_records:
                plain[(kind, instance_id)] = None
            else:
                inline[instance_id] = record
        for instance_id, record in inline.items():  # never over the size bound: no STRLEN to await
            known = senders.get(instance_id.encode())
            key = known.status_key if known is not None else keys.status_key(self.cluster, instance_id)
            self._hand_over(key, keys.STATUS, record, instance_id=instance_id)
        return plain

    def _refuse_notice(self, message: list[object], reason: str, detail: str) -> None:
        """Count and log (rate-limited) a notice that is no notice of ours; nothing is read or changed."""
        channel = message[2] if message[0] == b"pmessage" else message[1]
        if not isinstance(channel, bytes):
            label = "?"
        elif channel.startswith(self._own_channel_prefix):  # the instance whose channel it came on
            label = channel[len(self._own_channel_prefix) :][: keys.MAX_ID_LENGTH].decode(errors="replace")
            label = label if label.isprintable() else ascii(label)
        else:
            label = "(shared channel)"
        self._refusals.note(label, reason, f"{detail}, on {ascii(channel)[:300]}")
        if self._note_refused is not None:
            self._note_refused(label, reason)

    async def _read_key(self, kind: str, instance_id: str) -> None:
        make_key = keys.meta_key if kind == keys.META else keys.status_key
        key = make_key(self.cluster, instance_id)
        try:
            raw = await self._client.getrange(key, 0, MAX_RECORD_BYTES)
        except Exception as exc:  # WRONGTYPE and the like; a connection error is the caller's
            if not _is_reply_error(exc):
                raise
            raw = exc
        if raw == b"":
            return  # deleted since; the poll settles departures
        await self._apply(key, kind, raw, instance_id)

    async def _apply(self, key: str, kind: str, raw: bytes | Exception, instance_id: str = "") -> bool:
        """Decode and hand over; True if the key holds a valid record (changed or not)."""
        if isinstance(raw, bytes) and len(raw) > MAX_RECORD_BYTES and not self._known_value(key, raw):
            # only the bound's worth was read: ask for the whole size, for the refusal's summary
            size = len(raw)
            with contextlib.suppress(Exception):
                size = int(await self._client.strlen(key))
            return self._hand_over(key, kind, raw, size, instance_id)
        return self._hand_over(key, kind, raw, instance_id=instance_id)

    def _known_value(self, key: str, raw: bytes) -> bool:
        """The value last handed over or refused for `key`."""
        raw_digest = digest(raw)
        return self._last_digest.get(key) == raw_digest or self._refused_keys.holds(key, raw_digest)

    def _hand_over(
        self, key: str, kind: str, raw: bytes | Exception, full_size: int = 0, instance_id: str = ""
    ) -> bool:
        """`_apply` without the STRLEN an oversized value needs (`full_size`, when known);
        `instance_id`: the key's, when the caller knows it."""
        instance_id = instance_id or keys.instance_of(key)
        if isinstance(raw, Exception):  # not a string key: nothing a writer of ours would leave
            # the error stands for the value, so the same wrong-typed key polled again is skipped
            raw_digest, size = digest(b"error: " + str(raw).encode(errors="replace")), 0
            if self._refused_keys.holds(key, raw_digest):
                return False
            failure = BadRecord(f"{kind} key holds no string ({raw})", MALFORMED)
        else:
            raw_digest, size = digest(raw), len(raw)
            if self._last_digest.get(key) == raw_digest:
                return True  # unchanged since it was handed over
            if self._refused_keys.holds(key, raw_digest):
                return False  # the same refused value, polled again
            failure = None
            if size > MAX_RECORD_BYTES:
                size = max(size, full_size)
                failure = BadRecord(f"{kind} record of {size} bytes exceeds {MAX_RECORD_BYTES}", OVERSIZE)
        record: Any = None
        if failure is None:
            try:
                if kind == keys.META:
                    record = decode_metadata(raw, instance_id)  # type: ignore[arg-type]
                else:
                    record = decode_status(raw, instance_id)  # type: ignore[arg-type]
            except BadRecord as exc:
                failure = exc
        if failure is not None:
            self._reject(key, instance_id, failure, size, raw_digest)
            return False
        self._rejected.pop(key, None)
        self._refused_keys.discard(key)
        self._last_digest[key] = raw_digest
        if kind == keys.META:
            self.sink.apply_metadata(record)
        else:
            self.sink.apply_status(record)
        return True

    def _reject(
        self, key: str, instance_id: str, failure: BadRecord, size: int, raw_digest: bytes, name: bytes = b""
    ) -> None:
        """Count and log (rate-limited) a refused record; keep its summary, never its bytes.
        `name`: the key as Redis has it, when refused for its name (not UTF-8, say)."""
        if not self._refused_keys.add(name or key, raw_digest):
            # past the memory's bound, a refusal cannot be told from the same one last poll: counting
            # or logging it would count and log every such key on every poll; one summary instead
            self.num_unremembered += 1
            now = self._clock()
            if now - self._unremembered_logged_at >= LOG_INTERVAL_SECONDS:
                self._unremembered_logged_at = now
                log.warning(
                    "more than %d CMS keys hold refused records: those past the bound are neither counted "
                    "nor logged one by one (%d such refusals so far)",
                    self._refused_keys.limit, self.num_unremembered,
                )
            return
        self._rejected.pop(key, None)
        while len(self._rejected) >= MAX_REJECTED:  # bound the memory a flood of bad keys costs
            del self._rejected[next(iter(self._rejected))]
        self._rejected[key] = Rejected(instance_id, failure.reason, size, raw_digest)
        self._refusals.note(instance_id, failure.reason, f"{key}: {failure}")
        if self._note_refused is not None:
            self._note_refused(instance_id, failure.reason)

    def _refuse_name(self, name: bytes, failure: keys.BadId) -> None:
        """Count and log (rate-limited) a key refused for its name, once while it exists."""
        if self._refused_keys.holds(name, _BAD_NAME):
            return
        # no instance id to name: the key's last part, escaped, stands for it in the log
        label = ascii(name.rsplit(b":", 1)[-1][: keys.MAX_ID_LENGTH])
        text = name.decode(errors="replace")
        self._reject(text, label, BadRecord(f"key refused: {failure}", INVALID), 0, _BAD_NAME, name)

    def _forget(self, key: str) -> bool:
        self._rejected.pop(key, None)
        self._refused_keys.discard(key)
        return self._last_digest.pop(key, None) is not None

    def forget_all(self, instances: Iterable[str]) -> None:
        for instance_id in instances:
            self._forget(keys.meta_key(self.cluster, instance_id))
            self._forget(keys.status_key(self.cluster, instance_id))


class _Sender:
    """An instance whose own channel carried a notice that passed every check: its id, the prefix its
    status notices start with, and its status key, so the next notices there need no splitting."""

    __slots__ = ("instance_id", "status_key", "status_prefix")

    def __init__(self, instance_id: str, cluster: str) -> None:
        self.instance_id = instance_id
        self.status_key = keys.status_key(cluster, instance_id)
        self.status_prefix = f"{keys.STATUS}:{instance_id}:".encode()


def _is_reply_error(exc: BaseException) -> bool:
    from redis.exceptions import ResponseError

    return isinstance(exc, ResponseError)


def _raise_if_cancelling(cause: BaseException | None = None) -> None:
    """Re-raise a pending cancellation: redis-py can swallow a CancelledError delivered during a
    read (or turn it into a ConnectionError), and a reader that loops on would never stop."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from cause


class _Subscription(asyncio.Protocol):
    """The notice connection's reader: parses what arrives and hands inline statuses over at once, in
    the transport's callback, so no task wakes per notice; what needs a GET, and the end of the
    subscription, go to the listening task (`wake`)."""

    def __init__(self, reader: CmsReader, previous: asyncio.BaseProtocol) -> None:
        self._reader = reader
        # redis-py's protocol: told when the connection is lost, so its disconnect() completes
        self._previous = previous
        self._parser = PushParser()
        self.to_read: dict[tuple[str, str], None] = {}
        self.ended: BaseException | None = None
        self.wake = asyncio.Event()

    def data_received(self, data: bytes) -> None:
        if self.ended is not None:
            return
        try:
            self.to_read.update(self._reader._take_notices(self._parser.feed(data)))
        except Exception as exc:  # a protocol error, a sink that raised: the task ends the subscription
            self.ended = exc
        if self.to_read or self.ended is not None:
            self.wake.set()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.ended is None:
            self.ended = exc or ConnectionError("Redis closed the notice subscription")
        self.wake.set()
        self._previous.connection_lost(exc)
