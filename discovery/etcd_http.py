"""A small etcd v3 client over etcd's JSON gRPC gateway (HTTP), on aiohttp.

Why not an etcd3 library: the Python ones pin old protobuf runtimes that conflict with the
generated code here (protobuf 7). The gateway ships with every etcd 3.4+ and needs nothing more.
Keys and values travel base64-encoded; int64 fields arrive as JSON strings.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from pilotfish.discovery.api import StoreUnavailable

_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError)
MAX_WATCH_MESSAGE = 16 << 20


class EtcdError(StoreUnavailable):
    """etcd answered with an error (or not at all)."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text or "")


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that selects every key starting with `prefix`."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


class EtcdHttp:
    """Calls to one etcd cluster; `endpoints` are tried in turn when one does not answer."""

    def __init__(self, endpoints: list[str], timeout: float = 5.0) -> None:
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint")
        self._endpoints = [e.rstrip("/") for e in endpoints]
        self._current = 0
        self._timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, 2.0))
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # trust_env=False: never send loopback or cluster traffic through an environment proxy
            # read_bufsize bounds one line of the watch stream: a batch of many events is one line.
            self._session = aiohttp.ClientSession(trust_env=False, read_bufsize=MAX_WATCH_MESSAGE // 2)
        return self._session

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        last: Exception | None = None
        for _ in range(len(self._endpoints)):
            url = self._endpoints[self._current] + path
            try:
                async with self._http().post(url, json=body, timeout=self._timeout) as response:
                    data = await response.json(content_type=None)
            except _ERRORS as exc:
                last = exc
                self._current = (self._current + 1) % len(self._endpoints)
                continue
            if response.status != 200 or not isinstance(data, dict) or "error" in data:
                message = data.get("error") or data.get("message") if isinstance(data, dict) else data
                raise EtcdError(f"etcd {path}: HTTP {response.status}: {message}")
            return data
        raise EtcdError(f"etcd {path}: {last or 'no endpoint answered'}")

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        await self.call("/v3/kv/put", body)

    async def range_prefix(self, prefix: bytes) -> tuple[int, list[tuple[bytes, bytes]]]:
        """(revision, [(key, value)]) for every key under `prefix`."""
        data = await self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        revision = int(data.get("header", {}).get("revision", 0))
        return revision, [(unb64(kv.get("key")), unb64(kv.get("value"))) for kv in data.get("kvs", [])]

    async def delete(self, key: bytes) -> None:
        await self.call("/v3/kv/deleterange", {"key": _b64(key)})

    async def grant(self, ttl: int) -> int:
        data = await self.call("/v3/lease/grant", {"TTL": str(ttl)})
        return int(data["ID"])

    async def keepalive(self, lease: int) -> int:
        """The lease's renewed TTL in seconds; 0 when etcd no longer knows it (expired, or a new cluster)."""
        data = await self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(data.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        await self.call("/v3/lease/revoke", {"ID": str(lease)})

    async def watch(self, prefix: bytes, start_revision: int) -> AsyncIterator[dict[str, Any]]:
        """Each watch response (`result`) from `start_revision` on; returns when the stream ends.

        The gateway streams one JSON object per line. A stream that breaks raises EtcdError.
        """
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                   "start_revision": str(start_revision)}}  # fmt: skip
        url = self._endpoints[self._current] + "/v3/watch"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=2.0, sock_read=None)
        try:
            async with self._http().post(url, json=body, timeout=timeout) as response:
                if response.status != 200:
                    raise EtcdError(f"etcd watch: HTTP {response.status}")
                while True:
                    line = await response.content.readline()
                    if not line:
                        return
                    if len(line) > MAX_WATCH_MESSAGE:
                        raise EtcdError("etcd watch: message too large")
                    if not line.strip():
                        continue
                    message = json.loads(line)
                    if "error" in message:
                        raise EtcdError(f"etcd watch: {message['error']}")
                    yield message.get("result", {})
        except EtcdError:
            self._current = (self._current + 1) % len(self._endpoints)
            raise
        except _ERRORS as exc:
            self._current = (self._current + 1) % len(self._endpoints)
            raise EtcdError(f"etcd watch: {exc or type(exc).__name__}") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
