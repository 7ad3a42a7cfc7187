"""Health of one local engine endpoint: consecutive passes and failures against thresholds."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp


@dataclass
class Endpoint:
    """One engine rank the sidecar watches: where to check it, and what to register for it."""

    instance_id: str
    engine_url: str  # http://<engine host>:<port>, as the sidecar reaches it
    check_url: str  # engine_url + the health path
    host: str  # the address consumers route to
    port: int
    rank: int


@dataclass
class HealthState:
    passes: int = 0
    failures: int = 0
    registered: bool = False

    def record(self, healthy: bool, success_threshold: int, failure_threshold: int) -> bool | None:
        """Count one check; returns True to register, False to remove, None to leave as is."""
        if healthy:
            self.passes, self.failures = self.passes + 1, 0
            if not self.registered and self.passes >= success_threshold:
                return True
        else:
            self.passes, self.failures = 0, self.failures + 1
            if self.registered and self.failures >= failure_threshold:
                return False
        return None


async def check(session: aiohttp.ClientSession, url: str, timeout: float) -> bool:
    """Healthy means HTTP 200 within `timeout`; anything else, including no answer, is not."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            await response.read()
            return response.status == 200
    except (TimeoutError, aiohttp.ClientError, OSError):
        return False
