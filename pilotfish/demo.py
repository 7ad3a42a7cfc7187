"""The workload `pilotfish up --demo` sends through Envoy, and the table it prints.

Half the requests stream, half do not; prompts and output lengths vary with a fixed seed so
two runs send the same sequence.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from dataclasses import dataclass

import aiohttp

from pilotfish.stats import percentile

ENGINE_HEADER = "x-pilotfish-engine"
ROUTE_HEADER = "x-pilotfish-route"


@dataclass(slots=True)
class Outcome:
    engine: str
    route: str
    ok: bool
    latency_s: float
    ttft_s: float | None
    error: str = ""


async def _one(session: aiohttp.ClientSession, url: str, model: str, i: int, rng: random.Random) -> Outcome:
    stream = i % 2 == 0
    words = rng.randint(8, 200)
    body = {
        "model": model,
        "prompt": f"request {i}: " + " ".join(f"word{rng.randint(0, 999)}" for _ in range(words)),
        "max_tokens": rng.randint(8, 32),
        "stream": stream,
    }
    start = time.perf_counter()
    ttft = None
    try:
        async with session.post(url, json=body, headers={"x-request-id": f"demo-{i}"}) as resp:
            engine = resp.headers.get(ENGINE_HEADER, "?")
            route = resp.headers.get(ROUTE_HEADER, "?")
            if resp.status != 200:
                text = (await resp.text())[:200]
                return Outcome(engine, route, False, time.perf_counter() - start, None, f"HTTP {resp.status}: {text}")
            if stream:
                async for line in resp.content:
                    if ttft is None and line.startswith(b"data:") and b"[DONE]" not in line:
                        ttft = time.perf_counter() - start
            else:
                await resp.read()
            return Outcome(engine, route, True, time.perf_counter() - start, ttft)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Outcome("?", "?", False, time.perf_counter() - start, None, f"{type(exc).__name__}: {exc}")


async def run_workload(base_url: str, model: str, requests: int, concurrency: int, seed: int = 7) -> list[Outcome]:
    rng = random.Random(seed)
    url = f"{base_url}/v1/completions"
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def bounded(i: int) -> Outcome:
            async with gate:
                return await _one(session, url, model, i, rng)

        return list(await asyncio.gather(*(bounded(i) for i in range(requests))))


def _ms(value: float) -> str:
    return "-" if value != value else f"{value * 1000:.1f}"  # NaN: no sample


def format_table(outcomes: list[Outcome]) -> str:
    by_engine: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by_engine[o.engine].append(o)
    header = "| engine | requests | errors | TTFT p50 ms | TTFT p99 ms | latency p50 ms | latency p99 ms |"
    rows = [header, "|---|---:|---:|---:|---:|---:|---:|"]
    for engine, group in [*sorted(by_engine.items()), ("all", outcomes)]:
        ok = [o for o in group if o.ok]
        ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
        lat = [o.latency_s for o in ok]
        rows.append(
            f"| {engine} | {len(group)} | {len(group) - len(ok)} | {_ms(percentile(ttft, 50))} | "
            f"{_ms(percentile(ttft, 99))} | {_ms(percentile(lat, 50))} | {_ms(percentile(lat, 99))} |"
        )
    routes: dict[str, int] = defaultdict(int)
    for o in outcomes:
        routes[o.route] += 1
    rows.append("")
    rows.append("routed by: " + ", ".join(f"{k} {v}" for k, v in sorted(routes.items())))
    errors = [o.error for o in outcomes if not o.ok]
    if errors:
        rows.append(f"first error: {errors[0]}")
    return "\n".join(rows)
