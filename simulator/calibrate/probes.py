"""How calibration talks to an engine: timed streamed requests and the prefix-cache hit counter.

`HttpProber` measures a running server (vLLM or the simulator) at the client. `VirtualProber`
runs the simulator's engine model in virtual time, so the whole measurement is exact and
instant: it is how the tests check that calibration recovers a known profile.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import aiohttp
import msgspec

from pilotfish.simulator.engine.request import SimRequest
from pilotfish.simulator.engine.scheduler import V1Engine
from pilotfish.simulator.virtual import TimedOutput, VirtualEngine


class Prober(Protocol):
    async def stream(
        self, prompts: list[list[int]], max_tokens: int | list[int], offsets: list[float] | None = None
    ) -> list[list[float]]:
        """Send the prompts together, or each `offsets[i]` seconds after the first, for `max_tokens`
        tokens each (or `max_tokens[i]`); per prompt, each output token's time after that prompt
        was sent, in seconds."""
        ...

    async def prefix_cache_hits(self) -> int:
        """The engine's cumulative prefix-cache hit tokens."""
        ...


class VirtualProber:
    def __init__(self, core: V1Engine) -> None:
        self.engine = VirtualEngine(core)
        self._seq = 0
        # as in the HTTP driver, a request reaches the engine the serving overhead after it is sent
        self._delay = core.profile.api_overhead_ms / 1000.0

    async def stream(
        self, prompts: list[list[int]], max_tokens: int | list[int], offsets: list[float] | None = None
    ) -> list[list[float]]:
        start = self.engine.now
        lengths = _per_prompt(max_tokens, len(prompts))
        sent = [start + (offsets[i] if offsets else 0.0) for i in range(len(prompts))]
        ids = [f"probe-{self._seq + i + 1}" for i in range(len(prompts))]
        self._seq += len(prompts)
        times: dict[str, list[float]] = {rid: [] for rid in ids}
        sent_at = dict(zip(ids, sent, strict=True))

        def collect(outputs: list[TimedOutput]) -> None:
            for timed in outputs:
                if timed.output.token_id is not None:
                    rid = timed.output.request_id
                    times[rid].append(timed.time - sent_at[rid])

        for i in sorted(range(len(prompts)), key=sent.__getitem__):
            collect(self.engine.add_request(SimRequest(ids[i], list(prompts[i]), lengths[i]), sent[i] + self._delay))
        collect(self.engine.run_until_idle())
        return [times[rid] for rid in ids]

    async def prefix_cache_hits(self) -> int:
        return self.engine.core.stats().prefix_cache_hits_total


class HttpProber:
    """Streams `/v1/completions` with token-id prompts (exact lengths on any tokenizer)."""

    def __init__(self, url: str, model: str, session: aiohttp.ClientSession) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.session = session

    async def _one(self, prompt: list[int], max_tokens: int, offset: float = 0.0) -> list[float]:
        if offset > 0:
            await asyncio.sleep(offset)  # the workload's pacing: this request is due then
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                "temperature": 0.0, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        times: list[float] = []
        sent = time.monotonic()
        async with self.session.post(f"{self.url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{self.url}: HTTP {resp.status}: {(await resp.text())[:300]}")
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                now = time.monotonic() - sent
                event = msgspec.json.decode(line[6:])
                if "error" in event:  # vLLM reports some request errors inside a 200 stream
                    raise RuntimeError(f"{self.url}: {event['error']}")
                usage = event.get("usage") or {}
                tokens = int(usage.get("completion_tokens") or 0)
                while len(times) < tokens:  # tokens made in one step arrive together
                    times.append(now)
        return times

    async def stream(
        self, prompts: list[list[int]], max_tokens: int | list[int], offsets: list[float] | None = None
    ) -> list[list[float]]:
        due = offsets or [0.0] * len(prompts)
        lengths = _per_prompt(max_tokens, len(prompts))
        return list(await asyncio.gather(*(self._one(p, n, t) for p, n, t in zip(prompts, lengths, due, strict=True))))

    async def prefix_cache_hits(self) -> int:
        return int(metric_value(await self.metrics_text(), "vllm:prefix_cache_hits_total"))

    async def metrics_text(self) -> str:
        async with self.session.get(f"{self.url}/metrics") as resp:
            return await resp.text()


def _per_prompt(max_tokens: int | list[int], count: int) -> list[int]:
    return [max_tokens] * count if isinstance(max_tokens, int) else list(max_tokens)


def metric_value(text: str, name: str, label: str | None = None) -> float:
    """Sum of a metric's samples in Prometheus text (those carrying `label` when given)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            if label is not None and label not in line:
                continue
            try:
                total += float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return total


def metric_labels(text: str, name: str) -> dict[str, str]:
    """The labels of a metric's first sample, e.g. vllm:cache_config_info's block_size."""
    for line in text.splitlines():
        if line.startswith(name + "{"):
            inner = line[len(name) + 1:line.rindex("}")]
            out = {}
            for part in inner.split('",'):
                key, _, value = part.partition('="')
                out[key.strip()] = value.rstrip('"')
            return out
    return {}
