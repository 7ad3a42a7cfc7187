"""The one client of `pilotfish bench realtime`: every request sent at its arrival time, streamed, timed.

The same request list goes to every target. Bodies are built before the clock starts; each
request is posted at `start + arrival` to the target's one URL (or, for direct round-robin, to
engine i mod N), read to the end of its SSE stream, and recorded at the client: first token,
last token, tokens received, the engine that served it (the simulator's `x-pilotfish-engine`
header, which every router passes back) and, for a failure, why. A failure never stops the run.

The client's own CPU (process time over wall time of the replay) is measured so the report can
show that the client was not the bottleneck.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
import msgspec

from pilotfish.simulator.cluster.metrics import RequestRecord
from pilotfish.simulator.replay import ReplayConfig, read_sse, request_body
from pilotfish.simulator.traces.model import TraceRequest

ENGINE_HEADER = "x-pilotfish-engine"  # set by every simulated engine on its response


@dataclass(slots=True)
class ReplayResult:
    records: list[RequestRecord]
    wall_seconds: float  # from the first send to the last stream's end
    client_cpu_seconds: float  # this process's CPU over the same span


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    request: TraceRequest,
    body: dict,
    start: float,
    engine_index: dict[str, int],
    tick: Callable[[], None],
) -> RequestRecord:
    record = RequestRecord(request.request_id, -1, request.arrival, request.input_length, request.output_length)
    delay = start + request.arrival - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.monotonic()
    record.arrival = sent - start  # the actual send time: the loop may be late, and TTFT counts from here
    try:
        async with session.post(
            f"{url}/v1/completions", json=body, headers={"x-request-id": request.request_id}
        ) as resp:
            record.engine = engine_index.get(resp.headers.get(ENGINE_HEADER, ""), -1)
            if resp.status != 200:
                record.finish_reason = f"http {resp.status}: {(await resp.text())[:200]}"
                return record
            await read_sse(resp, record, start)
        if record.finished is not None and record.num_output_tokens < request.output_length:
            record.finish_reason = f"short: {record.num_output_tokens} of {request.output_length} tokens"
            record.finished = None
        elif record.finished is None and record.finish_reason is None:
            record.finish_reason = "stream ended without [DONE]"
    except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError) as exc:
        record.finish_reason = f"{type(exc).__name__}: {exc}"[:200]
        record.finished = None
    finally:
        tick()
    return record


async def replay(
    trace: Sequence[TraceRequest],
    urls: Sequence[str],
    engine_ids: Sequence[str],
    *,
    token_id_prompts: bool,
    timeout: float,
    tick: Callable[[], None] = lambda: None,
) -> ReplayResult:
    """Send every request at its arrival; request i goes to urls[i % len(urls)] (one URL: all to it)."""
    config = ReplayConfig(model="pilotfish-sim", text_prompts=not token_id_prompts)
    bodies = [request_body(r, config) for r in trace]  # built before the clock starts
    engine_index = {engine_id: i for i, engine_id in enumerate(engine_ids)}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        cpu0 = time.process_time()
        start = time.monotonic() + 0.05
        tasks = [
            _one(session, urls[i % len(urls)], r, body, start, engine_index, tick)
            for i, (r, body) in enumerate(zip(trace, bodies, strict=True))
        ]
        records = list(await asyncio.gather(*tasks))
        wall = time.monotonic() - start
        cpu = time.process_time() - cpu0
    return ReplayResult(records, wall, cpu)


async def warm_up(
    urls: Sequence[str],
    *,
    count: int,
    token_id_prompts: bool,
    timeout: float = 60.0,
    engine_ids: Sequence[str] = (),
) -> list[tuple[str, int]]:
    """`count` tiny sequential requests per URL, retried until answered: connections up, the view complete.

    Their prompts share nothing with any trace prompt, so they leave the prefix caches as cold as before.
    Returns each answered warm-up's prompt and the engine that served it (index in `engine_ids`, -1 unknown):
    a router counts these requests too, which a replay of its decisions needs.
    """
    from pilotfish.simulator.tokens import fallback_token_ids

    engine_index = {engine_id: i for i, engine_id in enumerate(engine_ids)}
    served: list[tuple[str, int]] = []
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for url in urls:
            for i in range(count):
                text = f" warm up request number {i} zz"
                body = {
                    "model": "pilotfish-sim",
                    "prompt": fallback_token_ids(text) if token_id_prompts else text,
                    "max_tokens": 1,
                    "stream": True,
                }
                while True:
                    try:
                        async with session.post(f"{url}/v1/completions", json=body) as resp:
                            await resp.read()
                            if resp.status == 200:
                                served.append((text, engine_index.get(resp.headers.get(ENGINE_HEADER, ""), -1)))
                                break
                            reason = f"HTTP {resp.status}"
                    except (TimeoutError, aiohttp.ClientError) as exc:
                        reason = type(exc).__name__
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{url} did not serve a warm-up request within {timeout:.0f}s ({reason})")
                    await asyncio.sleep(0.2)
    return served
