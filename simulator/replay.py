"""Real-time trace replay over HTTP: each request sent at its arrival time to the engine its
decision names, streamed, and timed at the client.

Works against the simulator and real vLLM alike (`/v1/completions`, `stream: true`,
`ignore_eos`, exact `max_tokens`). Prompts are token-id lists by default, so both engines see
exactly the trace's lengths and shared prefixes; `text_prompts=True` sends `prompt_text` instead
(the simulator's fallback tokenizer turns it back into the same ids).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import msgspec

from pilotfish.simulator.cluster.metrics import RequestRecord
from pilotfish.simulator.traces.model import TraceRequest
from pilotfish.simulator.traces.prompts import prompt_text, prompt_token_ids

TokenMap = Callable[[list[int]], list[int]]


@dataclass(slots=True)
class ReplayConfig:
    model: str = "pilotfish-sim"
    text_prompts: bool = False
    token_map: TokenMap | None = None  # e.g. fold ids into a small model's vocabulary
    timeout: float = 600.0
    headers: dict[str, str] = field(default_factory=dict)


def request_body(request: TraceRequest, config: ReplayConfig) -> dict:
    if config.text_prompts:
        prompt: str | list[int] = prompt_text(request)
    else:
        ids = prompt_token_ids(request)
        prompt = config.token_map(ids) if config.token_map else ids
    # continuous usage: every chunk says how many tokens exist so far, so a token whose text is
    # empty (a byte-level piece of a character) still counts, and counts when it was made
    return {"model": config.model, "prompt": prompt, "max_tokens": request.output_length, "stream": True,
            "ignore_eos": True, "temperature": 0.0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


async def read_sse(resp: aiohttp.ClientResponse, record: RequestRecord, start: float) -> None:
    """Read a streamed completion into `record`: tokens so far, first-token and finish times
    (seconds since `start` on the monotonic clock), or the error a 200 stream reported."""
    chunks = 0
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        now = time.monotonic() - start
        if line.startswith(b"data: [DONE]"):
            record.finished = now
            return
        event = msgspec.json.decode(line[6:])
        if "error" in event:  # vLLM reports some request errors inside a 200 stream
            record.finish_reason = f"error: {event['error']}"
            return
        # tokens so far from continuous usage; a router that drops usage still passes one chunk a token
        chunks += 1 if event.get("choices") else 0
        usage = event.get("usage") or {}
        tokens = int(usage.get("completion_tokens") or chunks)
        if tokens > record.num_output_tokens:
            record.num_output_tokens = tokens
            if record.first_token is None:
                record.first_token = now


async def _one(session: aiohttp.ClientSession, url: str, engine: int, request: TraceRequest, body: dict,
               start: float, config: ReplayConfig) -> RequestRecord:
    record = RequestRecord(request.request_id, engine, request.arrival, request.input_length, request.output_length)
    delay = start + request.arrival - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.monotonic()
    record.arrival = sent - start  # the actual send time: the loop may be late
    headers = {"x-request-id": request.request_id, **config.headers}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            record.finish_reason = f"http {resp.status}: {(await resp.text())[:200]}"
            return record
        await read_sse(resp, record, start)
    return record


async def replay(
    trace: Sequence[TraceRequest],
    urls: Sequence[str],
    decide: Callable[[TraceRequest], int],
    config: ReplayConfig | None = None,
) -> list[RequestRecord]:
    """Send every request at `start + arrival` to `urls[decide(request)]`; returns client-side records."""
    config = config or ReplayConfig()
    bodies = [(r, decide(r), request_body(r, config)) for r in trace]  # built before the clock starts
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=config.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.monotonic() + 0.05
        tasks = [_one(session, urls[k], k, r, body, start, config) for r, k, body in bodies]
        return list(await asyncio.gather(*tasks))
