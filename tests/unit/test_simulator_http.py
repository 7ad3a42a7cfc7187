"""The simulated engine over HTTP: vLLM's response shapes, errors, metrics and slot accounting."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pilotfish.simulator.config import EngineConfig, ServeConfig
from pilotfish.simulator.fleet import Fleet, serve_engines
from pilotfish.simulator.tokens import WORDS, fallback_token_ids, render_chat

MODEL = "pilotfish-sim"
FAST = EngineConfig(step_ms=0.5, prefill_ms_per_token=0, decode_ms_per_token=0, max_model_len=100_000)


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    async with serve_engines(ServeConfig(engines=1, base_port=0, default_output_tokens=7), FAST) as f:
        yield f


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def wait_until(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    """Poll a condition (not a sleep-as-wait): returns as soon as it holds."""
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.01)


async def metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and not line.startswith("vllm:cache_config_info"):
            series, value = line.rsplit(" ", 1)
            assert f'model_name="{MODEL}"' in series
            name = series.split("{", 1)[0]
            if "finished_reason=" in series:
                name += "." + series.split('finished_reason="', 1)[1].split('"', 1)[0]
            out[name] = float(value)
    return out


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    """Every `data:` event in order; the final [DONE] as the string "[DONE]"."""
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events: list[Any] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: ")
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def words(n: int) -> str:
    return "".join(WORDS[i % len(WORDS)] for i in range(n))


# ---- non-streaming ----------------------------------------------------------------------------


async def test_completion_shape_and_usage(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    prompt = "Hello world, how are you today?"
    async with http.post(
        f"{url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 5},
        headers={"x-request-id": "req-1"},
    ) as resp:
        assert resp.status == 200
        assert resp.headers["x-pilotfish-engine"] == "sim-0"
        assert resp.headers["x-request-id"] == "req-1"
        body = await resp.json()
    assert body["id"] == "cmpl-req-1"
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL
    assert isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["text"] == words(5)
    assert choice["logprobs"] is None
    assert choice["finish_reason"] == "length"
    n_prompt = len(fallback_token_ids(prompt))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 5, "total_tokens": n_prompt + 5}


async def test_chat_shape_and_max_completion_tokens(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    payload = {"model": MODEL, "messages": messages, "max_completion_tokens": 3, "max_tokens": 9}
    async with http.post(f"{fleet.urls[0]}/v1/chat/completions", json=payload) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == words(3)
    assert choice["finish_reason"] == "length"
    n_prompt = len(fallback_token_ids(render_chat(messages)))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 3, "total_tokens": n_prompt + 3}


async def test_prompt_token_ids_are_counted_as_given(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    for prompt in ([5, 6, 7, 8], [[5, 6, 7, 8]]):
        async with http.post(f"{fleet.urls[0]}/v1/completions", json={"prompt": prompt, "max_tokens": 2}) as resp:
            body = await resp.json()
        assert body["usage"]["prompt_tokens"] == 4


async def test_without_max_tokens_the_model_stops_and_ignore_eos_runs_to_the_limit(
    http: aiohttp.ClientSession,
) -> None:
    engine = EngineConfig(step_ms=0.2, prefill_ms_per_token=0, decode_ms_per_token=0, max_model_len=40)
    async with serve_engines(ServeConfig(engines=1, base_port=0, default_output_tokens=7), engine) as f:
        url = f"{f.urls[0]}/v1/completions"
        async with http.post(url, json={"prompt": "one two three"}) as resp:
            body = await resp.json()
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"]["completion_tokens"] == 7
        async with http.post(url, json={"prompt": "one two three", "ignore_eos": True}) as resp:
            body = await resp.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["total_tokens"] == 40


# ---- streaming --------------------------------------------------------------------------------


async def test_completion_stream_chunks(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    payload = {"prompt": "tell me", "max_tokens": 4, "stream": True}
    async with http.post(f"{fleet.urls[0]}/v1/completions", json=payload) as resp:
        assert resp.status == 200
        assert resp.headers["x-pilotfish-engine"] == "sim-0"
        events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 4  # one per token, no usage chunk unless asked
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    for i, chunk in enumerate(chunks):
        assert chunk["object"] == "text_completion"
        assert chunk["model"] == MODEL
        assert "usage" not in chunk
        [choice] = chunk["choices"]
        assert choice["index"] == 0
        assert choice["logprobs"] is None
        assert choice["text"] == WORDS[i]
        assert choice["finish_reason"] == ("length" if i == 3 else None)


async def test_chat_stream_with_include_usage(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is up"}]}]
    payload = {"messages": messages, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{fleet.urls[0]}/v1/chat/completions", json=payload) as resp:
        events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    role, *tokens, usage = events[:-1]
    assert role["object"] == "chat.completion.chunk"
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [t["choices"][0]["delta"]["content"] for t in tokens] == list(WORDS[:3])
    assert [t["choices"][0]["finish_reason"] for t in tokens] == [None, None, "length"]
    assert all("usage" not in t for t in tokens)
    assert usage["choices"] == []
    n_prompt = len(fallback_token_ids(render_chat([{"role": "user", "content": "what is up"}])))
    assert usage["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 3, "total_tokens": n_prompt + 3}


async def test_continuous_usage_stats(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    payload = {
        "prompt": "a b",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    async with http.post(f"{fleet.urls[0]}/v1/completions", json=payload) as resp:
        events = await read_sse(resp)
    tokens = events[:3]
    assert [t["usage"]["completion_tokens"] for t in tokens] == [1, 2, 3]
    assert events[3]["choices"] == [] and events[3]["usage"]["total_tokens"] == 5


# ---- errors -----------------------------------------------------------------------------------

ERRORS: list[tuple[str, str, bytes | dict[str, Any], int]] = [
    ("invalid json", "/v1/completions", b"{not json", 400),
    ("body not an object", "/v1/completions", b"[1, 2]", 400),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400),
    ("prompt wrong type", "/v1/completions", {"prompt": 12}, 400),
    ("prompt list of mixed", "/v1/completions", {"prompt": ["a", 1]}, 400),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 3}, 400),
    ("messages wrong type", "/v1/chat/completions", {"messages": "hello"}, 400),
    ("message without role", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400),
    ("max_tokens zero", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
    ("max_tokens string", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400),
    (
        "max_completion_tokens negative",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
        400,
    ),
    ("n two", "/v1/completions", {"prompt": "x", "n": 2}, 400),
    ("stream not bool", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400),
    (
        "stream_options without stream",
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
    ),
    ("context too long", "/v1/completions", {"prompt": "x", "max_tokens": 100_000}, 400),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404),
    (
        "unknown model chat",
        "/v1/chat/completions",
        {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
        404,
    ),
]


@pytest.mark.parametrize(("path", "body", "status"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
async def test_errors_are_vllm_shaped(
    fleet: Fleet, http: aiohttp.ClientSession, path: str, body: bytes | dict[str, Any], status: int
) -> None:
    url = fleet.urls[0]
    kwargs: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with http.post(f"{url}{path}", headers={"x-request-id": "bad-1"}, **kwargs) as resp:
        assert resp.status == status
        assert resp.headers["x-pilotfish-engine"] == "sim-0"
        assert resp.headers["x-request-id"] == "bad-1"
        error = await resp.json()
    assert error["object"] == "error"
    assert error["type"] == ("BadRequestError" if status == 400 else "NotFoundError")
    assert error["code"] == status
    assert isinstance(error["message"], str) and error["message"]
    assert "param" in error
    async with http.get(f"{url}/health") as resp:  # the server stays up
        assert resp.status == 200


async def test_a_body_that_is_not_the_encoding_it_declares_is_the_clients_error(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    """Not a 500: a client's bad body must not count against the engine (the gateway ejects an engine
    after a run of 5xx)."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    async with http.post(f"{fleet.urls[0]}/v1/completions", data=body, headers={"content-encoding": "gzip"}) as resp:
        assert resp.status == 400
        assert (await resp.json())["type"] == "BadRequestError"


# ---- health, models, metrics ------------------------------------------------------------------


async def test_health_and_models(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{fleet.urls[0]}/health") as resp:
        assert resp.status == 200
        assert await resp.read() == b""
        assert resp.headers["x-pilotfish-engine"] == "sim-0"
    async with http.get(f"{fleet.urls[0]}/v1/models") as resp:
        body = await resp.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL]


async def test_metrics_follow_running_and_waiting_requests(http: aiohttp.ClientSession) -> None:
    engine = EngineConfig(
        step_ms=1,
        prefill_ms_per_token=0,
        decode_ms_per_token=0,
        max_num_seqs=1,
        max_model_len=1_000_000,
        num_gpu_blocks=70_000,
    )
    async with serve_engines(ServeConfig(engines=1, base_port=0), engine) as f:
        url = f.urls[0]
        before = await metrics(http, url)
        assert before["vllm:num_requests_running"] == 0
        assert before["vllm:num_requests_waiting"] == 0
        assert before["vllm:kv_cache_usage_perc"] == 0
        long = {"prompt": "one two three four", "max_tokens": 500_000, "stream": True}
        first = await http.post(f"{url}/v1/completions", json=long)
        await first.content.readline()  # a token arrived: it is running

        async def one_running_one_waiting() -> bool:
            m = await metrics(http, url)
            return m["vllm:num_requests_running"] == 1 and m["vllm:num_requests_waiting"] == 1

        second = asyncio.create_task(http.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}))
        await wait_until(one_running_one_waiting)
        during = await metrics(http, url)
        assert during["vllm:kv_cache_usage_perc"] > 0
        assert during["vllm:prompt_tokens_total"] == 4

        async def generated_more() -> bool:
            m = await metrics(http, url)
            return m["vllm:generation_tokens_total"] > during["vllm:generation_tokens_total"]

        await wait_until(generated_more)
        first.close()  # client abort: frees the only slot, so the waiting request runs
        async with await second as resp:
            body = await resp.json()
        assert body["usage"]["completion_tokens"] == 2

        async def idle() -> bool:
            m = await metrics(http, url)
            return m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0

        await wait_until(idle)
        after = await metrics(http, url)
        assert after["vllm:prompt_tokens_total"] == 4 + 1
        assert after["vllm:request_success_total.abort"] == 1
        assert after["vllm:request_success_total.length"] == 1
        assert after["vllm:kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
async def test_client_abort_frees_the_slot(http: aiohttp.ClientSession, stream: bool) -> None:
    engine = EngineConfig(
        step_ms=1,
        prefill_ms_per_token=0,
        decode_ms_per_token=0,
        max_num_seqs=1,
        max_model_len=1_000_000,
        num_gpu_blocks=70_000,
    )
    async with serve_engines(ServeConfig(engines=1, base_port=0), engine) as f:
        url = f.urls[0]
        payload = {"prompt": "long one", "max_tokens": 500_000, "stream": stream}

        async def hold() -> None:
            async with http.post(f"{url}/v1/completions", json=payload) as resp:
                await resp.read()

        holder = asyncio.create_task(hold())

        async def running() -> bool:
            return (await metrics(http, url))["vllm:num_requests_running"] == 1

        await wait_until(running)
        holder.cancel()  # the client hangs up
        with pytest.raises(asyncio.CancelledError):
            await holder

        async def freed() -> bool:
            m = await metrics(http, url)
            return m["vllm:num_requests_running"] == 0 and m["vllm:request_success_total.abort"] == 1

        await wait_until(freed)
        async with http.post(f"{url}/v1/completions", json={"prompt": "next", "max_tokens": 3}) as resp:
            assert (await resp.json())["usage"]["completion_tokens"] == 3


async def test_repeated_prompt_hits_the_prefix_cache(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    prompt = " ".join(f"word{i}" for i in range(40))
    n_prompt = len(fallback_token_ids(prompt))
    for _ in range(2):
        async with http.post(f"{fleet.urls[0]}/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as resp:
            assert (await resp.json())["usage"]["prompt_tokens"] == n_prompt
    m = await metrics(http, fleet.urls[0])
    block = EngineConfig().block_size
    assert m["vllm:prefix_cache_queries_total"] == 2 * n_prompt
    assert m["vllm:prefix_cache_hits_total"] == (n_prompt - 1) // block * block


async def test_preemption_shows_in_metrics_and_loses_no_token(http: aiohttp.ClientSession) -> None:
    # 8 blocks of 4 tokens: three requests growing to 12 tokens each cannot all stay resident
    engine = EngineConfig(
        step_ms=0.2, prefill_ms_per_token=0, decode_ms_per_token=0, block_size=4, num_gpu_blocks=8, max_model_len=32
    )
    async with serve_engines(ServeConfig(engines=1, base_port=0), engine) as f:
        url = f"{f.urls[0]}/v1/completions"

        async def complete(i: int) -> dict[str, Any]:
            async with http.post(url, json={"prompt": [i] * 4, "max_tokens": 8}) as resp:
                return await resp.json()

        bodies = await asyncio.gather(*(complete(i) for i in range(3)))
        assert [b["usage"]["completion_tokens"] for b in bodies] == [8, 8, 8]
        assert all(b["choices"][0]["text"] == words(8) for b in bodies)
        m = await metrics(http, f.urls[0])
        assert m["vllm:num_preemptions_total"] >= 1
        assert m["vllm:generation_tokens_total"] == 24


async def test_tokenizer_file_counts_prompt_tokens(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    prompt = "hello internationalization world"
    assert len(fallback_token_ids(prompt)) == 4  # so the count below shows the file was used
    serve = ServeConfig(engines=1, base_port=0, tokenizer_path=str(path))
    async with serve_engines(serve, FAST) as f:
        url = f"{f.urls[0]}/v1/completions"
        async with http.post(url, json={"prompt": prompt, "max_tokens": 1}) as resp:
            assert (await resp.json())["usage"]["prompt_tokens"] == 3


# ---- fleets -----------------------------------------------------------------------------------


async def test_two_engines_answer_on_their_own_ports(http: aiohttp.ClientSession) -> None:
    async with serve_engines(ServeConfig(engines=2, base_port=0, engine_id_prefix="e"), FAST) as f:
        assert [a.engine_id for a in f.addresses] == ["e-0", "e-1"]
        assert len({a.port for a in f.addresses}) == 2
        for address in f.addresses:
            headers = {"x-request-id": f"to-{address.engine_id}"}
            async with http.post(
                f"{address.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers
            ) as resp:
                assert resp.headers["x-pilotfish-engine"] == address.engine_id
                assert resp.headers["x-request-id"] == f"to-{address.engine_id}"
                assert (await resp.json())["id"] == f"cmpl-to-{address.engine_id}"
        assert f.by_id("e-1").address == f.addresses[1]


def test_cli_serves_until_sigterm_and_exits_zero() -> None:
    argv = [sys.executable, "-m", "pilotfish", "sim", "serve", "--engines", "2", "--base-port", "0", "--step-ms", "1"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().strip() for _ in range(2)]
        assert lines[0].startswith("engine sim-0 ready on 127.0.0.1:")
        assert lines[1].startswith("engine sim-1 ready on 127.0.0.1:")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_decode_engine_prefills_only_on_an_engine_of_its_own_fleet(http: aiohttp.ClientSession) -> None:
    """x-prefiller-host-port names the prefill engine; anything outside the fleet is refused unread."""
    async with serve_engines(ServeConfig(engines=2, base_port=0, default_output_tokens=3), FAST) as pair:
        prefill, decode = pair.urls
        prefill_address = prefill.removeprefix("http://")
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 3}
        before = (await metrics(http, prefill))["vllm:request_success_total.length"]
        headers = {"x-prefiller-host-port": prefill_address}
        async with http.post(f"{decode}/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 200
            assert resp.headers["x-pilotfish-prefilled-by"] == prefill_address
            assert (await resp.json())["usage"]["completion_tokens"] == 3
        assert (await metrics(http, prefill))["vllm:request_success_total.length"] == before + 1
        for outsider in ("127.0.0.1:1", "169.254.169.254:80", "example.com:80"):
            async with http.post(
                f"{decode}/v1/completions", json=body, headers={"x-prefiller-host-port": outsider}
            ) as resp:
                assert resp.status == 400
                assert "not a peer" in (await resp.json())["message"]
