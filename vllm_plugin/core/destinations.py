"""Where a llumlet may send a migrating request: only to a llumlet the CMS knows.

A Migrate names a destination (`destination_instance_id`, `destination_llumlet_address`). Before
anything is detached or sent (the request's prompt, its output so far, its sampling parameters,
and the cluster's token in the call's metadata), the source reads the destination's records from
the CMS and goes on only if:

- its metadata is there (written by its llumlet, with a TTL) and decodes strictly (cms/records.py);
- it serves the same model as this engine;
- it has a llumlet gRPC port, and the address it registered (`host:llumlet_port`, as the
  rescheduler dials it) is the address the Migrate names;
- its status is there, decodes, and is fresh: `timestamp_ms` no older than `max_age_ms` (the
  llumlets' TTL) and not ahead of this clock by more than the CMS's clock-skew bound.

Otherwise the Migrate is refused with PERMISSION_DENIED (INVALID_ARGUMENT when no destination id
is named, UNAVAILABLE when the CMS cannot be read, twice: nothing is sent on a guess). The address dialled
is the registered one. This is as strong as the CMS's own protection (docs/cms-trust.md: Redis
ACLs let a llumlet write only its own keys).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pilotfish.cms import keys
from pilotfish.cms.records import BadRecord, Bounds, decode_metadata, decode_status, implausible

# refusal reasons (counter keys and log labels)
NO_ID = "no_destination_id"
UNREGISTERED = "unregistered"
BAD_RECORD = "bad_record"
OTHER_MODEL = "other_model"
NO_PORT = "no_llumlet_port"
OTHER_ADDRESS = "address_mismatch"
NOT_LIVE = "not_live"
STALE = "stale"
CMS_UNREACHABLE = "cms_unreachable"

# a read Redis has not answered in 4 s is tried once more on a fresh connection (a timeout or a dropped
# one): a loaded test machine saw the CMS read miss 2 s twice; two misses still end within the
# rescheduler's 10 s Migrate deadline
_SOCKET_TIMEOUT_S = 4.0
_RETRIES = 1


class DestinationRefused(Exception):
    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


# (destination instance id, address named by the Migrate) -> the address to dial; raises DestinationRefused
DestinationCheck = Callable[[str, str], str]


def llumlet_address(host: str, port: int) -> str:
    """`host:port` as the scheduler's view writes a llumlet's address (IPv6 in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class CmsDestinations:
    """The default DestinationCheck: the destination's records in the CMS (Redis), read per Migrate."""

    def __init__(
        self,
        url: str,
        cluster: str,
        model: Callable[[], str],
        max_age_ms: int,
        bounds: Bounds | None = None,
        clock: Callable[[], float] = time.time,
        client: Any = None,
        redis_options: dict[str, Any] | None = None,
    ) -> None:
        self._url = url
        self._redis_options = dict(redis_options or {})  # password, rediss:// files (pilotfish/security.py)
        self._cluster = cluster
        self._model = model
        self._max_age_ms = max_age_ms
        self._bounds = bounds or Bounds()
        self._clock = clock
        self._client = client

    def _redis(self) -> Any:
        if self._client is None:  # lazily: a llumlet that never migrates never connects for this
            self._client = redis.Redis.from_url(
                self._url,
                socket_timeout=_SOCKET_TIMEOUT_S,
                socket_connect_timeout=_SOCKET_TIMEOUT_S,
                retry=Retry(NoBackoff(), _RETRIES),
                **self._redis_options,
            )
        return self._client

    def __call__(self, instance_id: str, address: str) -> str:
        def refuse(reason: str, message: str) -> DestinationRefused:
            detail = f"destination {instance_id!r}: {message}"
            return DestinationRefused(grpc.StatusCode.PERMISSION_DENIED, reason, detail)

        if not instance_id:
            raise DestinationRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                NO_ID,
                "destination_instance_id is required: a destination must be an instance registered in the CMS",
            )
        try:
            keys.check_id(instance_id, "destination_instance_id")
        except keys.BadId as exc:
            raise DestinationRefused(grpc.StatusCode.INVALID_ARGUMENT, NO_ID, str(exc)) from None
        try:
            raw_meta, raw_status = self._redis().mget(
                keys.meta_key(self._cluster, instance_id), keys.status_key(self._cluster, instance_id)
            )
        except redis.RedisError as exc:
            raise DestinationRefused(
                grpc.StatusCode.UNAVAILABLE,
                CMS_UNREACHABLE,
                f"cannot read the CMS to check destination {instance_id!r} ({type(exc).__name__}); nothing was sent",
            ) from None
        if raw_meta is None:
            raise refuse(UNREGISTERED, "no CMS metadata: not a registered llumlet of this cluster")
        try:
            meta = decode_metadata(raw_meta, instance_id)
        except BadRecord as exc:
            raise refuse(BAD_RECORD, f"its CMS metadata is refused: {exc}") from None
        model = self._model()
        if meta.model != model:
            raise refuse(OTHER_MODEL, f"serves model {meta.model!r}, not {model!r}")
        if not meta.llumlet_port:
            raise refuse(NO_PORT, "its metadata has no llumlet gRPC port")
        registered = llumlet_address(meta.host, meta.llumlet_port)
        if address and address != registered:
            raise refuse(OTHER_ADDRESS, f"registered at {registered}, not at {address[:100]!r}")
        if raw_status is None:
            raise refuse(NOT_LIVE, "no CMS status: not live")
        try:
            status = decode_status(raw_status, instance_id)
        except BadRecord as exc:
            raise refuse(BAD_RECORD, f"its CMS status is refused: {exc}") from None
        now_ms = int(self._clock() * 1000)
        if why := implausible(status, now_ms, self._bounds):
            raise refuse(BAD_RECORD, f"its CMS status is implausible ({why})")
        age_ms = now_ms - status.timestamp_ms
        if age_ms > self._max_age_ms:
            raise refuse(STALE, f"its CMS status is {age_ms / 1000:.1f} s old (max {self._max_age_ms / 1000:g} s)")
        return registered
