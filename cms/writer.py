"""The llumlet's side of the CMS: write status and metadata with a TTL, announce each write.

Synchronous redis-py for connecting (auth, db, TLS) and for metadata; the status hot path packs
its two commands by hand (SET with PX and PUBLISH, pipelined without MULTI: readers never need
the two atomically; the notice only tells them to look) and reads the replies itself.

Two ways to write a status, on the one held connection:
  write_status       blocking, until Redis has answered both commands (the export thread);
  try_write_status   never blocks: hands the command to the kernel if it takes it whole at once
                     and leaves the replies to be read by the next write (the engine's thread).
                     A failure it meets (an error reply, Redis gone) is kept, not raised, for
                     collect_replies to raise on the thread that counts, logs and retries.
  collect_replies    blocking: the replies owed to writes made without waiting, so an error
                     reply or a dead connection after the last of them is not left unseen.
Each status notice carries the record when it is small (cms/notices.py), so a reader need not GET it.
Status writes must not overlap: the caller serializes them (the llumlet's export lock), which also
keeps records reaching Redis in update_id order.

Every status written carries the writer's `epoch` (its incarnation: wall-clock ms when it was
made, unless given), set on the record (or, for pre-encoded bytes, appended to them: protobuf
merges a repeated scalar field, the last one winning). A reader orders statuses by (epoch, update_id),
so a restarted llumlet's first status is taken as a new sequence, however its update_id compares.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import time
from typing import Any

import redis

from pilotfish.cms import keys
from pilotfish.cms.notices import pack_command as _pack
from pilotfish.cms.notices import status_notice
from pilotfish.protos import cms_pb2

# A llumlet that cannot reach Redis must not stall its export thread for long: it retries with
# the latest state anyway, so an old write finishing late is worth nothing.
SOCKET_TIMEOUT_S = 2.0
_REPLIES_PER_WRITE = 2  # SET, PUBLISH


class CmsWriter:
    def __init__(
        self,
        url: str,
        cluster: str,
        instance_id: str,
        ttl_ms: int,
        epoch: int | None = None,
        *,
        redis_options: dict[str, Any] | None = None,
    ) -> None:
        """`redis_options`: extra redis-py connection options (the password, rediss:// CA and client
        certificate: pilotfish/security.py's `redis_options`)."""
        self.cluster = keys.check_id(cluster, "cluster")
        self.instance_id = keys.check_id(instance_id, "instance_id")
        self.ttl_ms = ttl_ms
        self.epoch = epoch if epoch is not None else time.time_ns() // 1_000_000
        self._epoch_field = cms_pb2.InstanceStatus(epoch=self.epoch).SerializeToString()
        self.status_key = keys.status_key(cluster, instance_id)
        self.meta_key = keys.meta_key(cluster, instance_id)
        # its own channel: an ACL can confine it there, which is what lets readers trust an inline record
        self.channel = keys.instance_events_channel(cluster, instance_id)
        self._meta_notice = f"{keys.META}:{instance_id}"
        self._status_key_b = self.status_key.encode()
        self._ttl_b = str(ttl_ms).encode()
        self._channel_b = self.channel.encode()
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=SOCKET_TIMEOUT_S,
            health_check_interval=30,
            **(redis_options or {}),
        )
        # the held status connection; _fd is its descriptor for non-blocking writes, -1 when
        # there is none or it cannot take them (TLS)
        self._conn: Any = None
        self._fd = -1
        self._unsent = b""  # the tail of a command the kernel took only part of
        self._unread = 0  # replies owed to writes made so far
        self._replies = b""  # bytes of those replies read, not yet a whole line
        self._inline_error: Exception | None = None  # what try_write_status met, for collect_replies

    def write_status(self, status: cms_pb2.InstanceStatus) -> None:
        """Write and wait for Redis's answers (sets `status.epoch` to the writer's); raises on a
        Redis or connection error."""
        status.epoch = self.epoch
        self._send_and_settle(self._socket(), self._packed(status.SerializeToString()))

    def write_status_bytes(self, raw: bytes) -> None:
        """`write_status` for an encoded record; the writer's epoch is appended (protobuf merges it)."""
        self._send_and_settle(self._socket(), self._packed(raw + self._epoch_field))

    def try_write_status(self, status: cms_pb2.InstanceStatus) -> bool:
        """Write without waiting: True if the kernel took the whole command now.

        False (nothing lost, the caller writes the latest state the blocking way instead) when no
        connection is up, the socket buffer is full, or an earlier write failed; a failure drops
        the connection, and the blocking write reconnects and reports the cause. Replies to
        earlier writes are read if they are there, and never waited for.
        """
        fd = self._fd
        if fd < 0 or self._unsent:
            return False
        try:
            if self._unread:
                with contextlib.suppress(BlockingIOError):  # not there yet: the next write reads them
                    self._take_replies(os.read(fd, 65536))
            status.epoch = self.epoch
            packed = self._packed(status.SerializeToString())
            sent = os.write(fd, packed)
        except BlockingIOError:
            return False
        except Exception as exc:  # kept for collect_replies: this thread must not raise into the engine
            self._inline_error = exc
            self._drop()
            return False
        self._unread += _REPLIES_PER_WRITE
        if sent < len(packed):
            self._unsent = packed[sent:]  # the next blocking write sends it first
            return False
        return True

    def can_try_write(self) -> bool:
        """Whether try_write_status could take a write now (checked before making the status)."""
        return self._fd >= 0 and not self._unsent

    def owes_replies(self) -> bool:
        return bool(self._unread or self._unsent or self._inline_error)

    def collect_replies(self) -> None:
        """Raise what try_write_status met, else read every reply owed to its writes (blocking,
        within the socket's timeout); raises on an error reply or a closed connection."""
        error, self._inline_error = self._inline_error, None
        if error is not None:
            raise error
        if self._conn is not None and (self._unread or self._unsent):
            self._send_and_settle(self._conn._sock)

    def write_metadata(self, meta: cms_pb2.InstanceMetadata) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.meta_key, meta.SerializeToString(), px=self.ttl_ms)
        pipe.publish(self.channel, self._meta_notice)
        pipe.execute()

    def remove(self) -> None:
        """Delete both keys and announce it: a clean shutdown need not wait for the TTL."""
        # the status writes still unanswered land first, or one could bring the key back; the
        # delete goes on regardless, on the client's own connection
        with contextlib.suppress(Exception):
            self.collect_replies()
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(self.meta_key, self.status_key)
        pipe.publish(self.channel, self._meta_notice)
        pipe.execute()

    def close(self) -> None:
        self._drop()
        self.client.close()

    # ---- the status connection ----------------------------------------------------------------

    def _packed(self, raw: bytes) -> bytes:
        # the notice carries the record (cms/notices.py): readers need no GET per write
        notice = status_notice(self.instance_id, raw)
        return _pack(b"SET", self._status_key_b, raw, b"PX", self._ttl_b) + _pack(b"PUBLISH", self._channel_b, notice)

    def _socket(self) -> Any:
        if self._conn is None:
            conn = self.client.connection_pool.get_connection()
            sock = conn._sock  # redis-py connected it (auth, db, TLS); from here on it is ours
            self._conn = conn
            # Python keeps a socket with a timeout non-blocking underneath, so a plain write to
            # its descriptor returns at once; not so under TLS, where only the socket object may write.
            if not isinstance(sock, ssl.SSLSocket) and not os.get_blocking(sock.fileno()):
                self._fd = sock.fileno()
        return self._conn._sock

    def _send_and_settle(self, sock: Any, command: bytes = b"") -> None:
        """Send what is unsent (and `command`), then read until every reply owed is in (blocking,
        within the socket's timeout)."""
        try:
            sock.sendall(self._unsent + command)
            self._unsent = b""
            if command:
                self._unread += _REPLIES_PER_WRITE
            while self._unread:
                self._take_replies(sock.recv(4096))
        except BaseException:
            # a half-read reply would poison the next call: start over on a fresh connection
            self._drop()
            raise

    def _take_replies(self, data: bytes) -> None:
        """Count whole reply lines (+OK, :N, or -ERROR); raise on an error reply or a closed peer."""
        if not data:
            raise ConnectionError("Redis closed the connection")
        buffered = self._replies + data
        lines = buffered.split(b"\r\n")
        self._replies = lines.pop()
        for line in lines:
            if line.startswith(b"-"):
                raise redis.ResponseError(line[1:].decode(errors="replace"))
        self._unread -= len(lines)

    def _drop(self) -> None:
        conn, self._conn, self._fd = self._conn, None, -1
        self._unsent, self._unread, self._replies = b"", 0, b""
        if conn is not None:
            conn.disconnect()
            self.client.connection_pool.release(conn)
