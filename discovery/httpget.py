"""One small HTTP GET helper: never through an environment proxy, errors as MetadataUnavailable."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from pilotfish.discovery.static import MetadataUnavailable

MAX_METADATA_BYTES = 1 << 20


async def get_json_object(url: str, timeout: float) -> dict[str, Any]:
    """GET `url` and return its JSON object body; anything else raises MetadataUnavailable."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout), trust_env=False) as session,
            session.get(url) as response,
        ):
            body = await response.content.read(MAX_METADATA_BYTES + 1)
            if response.status != 200:
                raise MetadataUnavailable(f"GET {url}: HTTP {response.status}")
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        if isinstance(exc, MetadataUnavailable):
            raise
        raise MetadataUnavailable(f"GET {url}: {exc or type(exc).__name__}") from None
    if len(body) > MAX_METADATA_BYTES:
        raise MetadataUnavailable(f"GET {url}: body over {MAX_METADATA_BYTES} bytes")
    try:
        data = json.loads(body)
    except ValueError:
        raise MetadataUnavailable(f"GET {url}: body is not JSON") from None
    if not isinstance(data, dict):
        raise MetadataUnavailable(f"GET {url}: body is not a JSON object")
    return data
