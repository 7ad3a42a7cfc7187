"""The llumlet's side of the CMS: write status and metadata with a TTL, announce each write.

Synchronous redis-py on purpose: it runs on the llumlet's own export thread, never on an engine
loop, and a blocking client there is simpler and cheaper than an event loop per engine. Each
status write is one round trip: SET with PX and PUBLISH, pipelined without MULTI (readers never
need the two atomically; the notice only tells them to look).
"""

from __future__ import annotations

from typing import Any

import redis

from pilotfish.cms import keys
from pilotfish.protos import cms_pb2

# A llumlet that cannot reach Redis must not stall its export thread for long: it retries with
# the latest state anyway, so an old write finishing late is worth nothing.
SOCKET_TIMEOUT_S = 2.0


class CmsWriter:
    def __init__(self, url: str, cluster: str, instance_id: str, ttl_ms: int) -> None:
        self.cluster = keys.check_id(cluster, "cluster")
        self.instance_id = keys.check_id(instance_id, "instance_id")
        self.ttl_ms = ttl_ms
        self.status_key = keys.status_key(cluster, instance_id)
        self.meta_key = keys.meta_key(cluster, instance_id)
        self.channel = keys.events_channel(cluster)
        self._status_notice = f"{keys.STATUS}:{instance_id}"
        self._meta_notice = f"{keys.META}:{instance_id}"
        self._status_key_b = self.status_key.encode()
        self._ttl_b = str(ttl_ms).encode()
        self._status_publish = _pack(b"PUBLISH", self.channel.encode(), self._status_notice.encode())
        self._conn: Any = None
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=SOCKET_TIMEOUT_S,
            health_check_interval=30,
        )

    def write_status(self, status: cms_pb2.InstanceStatus) -> None:
        self.write_status_bytes(status.SerializeToString())

    def write_status_bytes(self, raw: bytes) -> None:
        # The hot path, once per load change: the two commands packed by hand and sent on one
        # held connection. redis-py's pipeline object costs ~150 µs of Python per call here,
        # ten times the round trip itself, and this time is the staleness the scheduler sees.
        packed = _pack(b"SET", self._status_key_b, raw, b"PX", self._ttl_b) + self._status_publish
        conn = self._conn
        if conn is None:
            conn = self._conn = self.client.connection_pool.get_connection()
        try:
            conn.send_packed_command([packed], check_health=False)
            for _ in range(2):
                reply = conn.read_response()
                if isinstance(reply, Exception):
                    raise reply
        except BaseException:
            # a half-read reply would poison the next call: start over on a fresh connection
            self._conn = None
            conn.disconnect()
            self.client.connection_pool.release(conn)
            raise

    def write_metadata(self, meta: cms_pb2.InstanceMetadata) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.meta_key, meta.SerializeToString(), px=self.ttl_ms)
        pipe.publish(self.channel, self._meta_notice)
        pipe.execute()

    def remove(self) -> None:
        """Delete both keys and announce it: a clean shutdown need not wait for the TTL."""
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(self.meta_key, self.status_key)
        pipe.publish(self.channel, self._meta_notice)
        pipe.execute()

    def close(self) -> None:
        if self._conn is not None:
            self.client.connection_pool.release(self._conn)
            self._conn = None
        self.client.close()


def _pack(*parts: bytes) -> bytes:
    """One Redis command in RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)
