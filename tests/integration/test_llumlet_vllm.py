"""End to end on real vLLM on CPU: the llumlet plugin inside vLLM writes the CMS as load changes.

One vLLM start per scheduler variant (async, vLLM's default where the executor supports it, and
sync with --no-async-scheduling), shared by every test of the module. The tiny Llama is built
here (config + a tokenizer trained on the spot, dummy weights): nothing downloads. vLLM comes
from scripts/install-vllm.sh; without it the module skips, except under CI=true, where it fails.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import redis

from pilotfish import services
from pilotfish.cms import keys
from pilotfish.cms.notices import split_notice
from pilotfish.cms.prefix_hash import prefix_block_hashes
from pilotfish.cms.records import decode_metadata, decode_status
from pilotfish.procs import Child, descendants, free_port, stat_fields, wait_until_async
from pilotfish.protos import cms_pb2, llumlet_pb2, llumlet_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.service import SchedulerServer
from pilotfish.vllm_plugin import testing
from pilotfish.vllm_plugin.core.export_process import can_detach

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

CLUSTER = "e2e"
TTL_MS = 120_000  # longer than any wait here: keys that vanish were removed
PROMPT = "the quick brown fox jumps over the lazy dog " * 8
# a loaded two-core machine: vLLM may take minutes to start, a batch of requests a minute to run
START_TIMEOUT = 600
WAIT = 120
LONG_TOKENS = 1800  # with PROMPT, within the engine's --max-model-len 2048


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off"):
        pytest.fail(f"{reason} (CI is set: a missing dependency fails instead of skipping)", pytrace=False)
    pytest.skip(reason)


@dataclass
class Engine:
    child: Child
    url: str
    port: int
    redis: redis.Redis
    log_path: Path
    instance_id: str = ""
    meta: cms_pb2.InstanceMetadata = field(default_factory=cms_pb2.InstanceMetadata)

    def status(self) -> cms_pb2.InstanceStatus | None:
        raw = self.redis.get(keys.status_key(CLUSTER, self.instance_id))
        return None if raw is None else decode_status(raw, self.instance_id)

    def status_notices(self) -> redis.client.PubSub:
        """A subscription to the llumlet's notices, in place when this returns."""
        pubsub = self.redis.pubsub()
        pubsub.subscribe(keys.instance_events_channel(CLUSTER, self.instance_id))
        wait_for(lambda: (m := pubsub.get_message(timeout=0.1)) and m["type"] == "subscribe", WAIT, "a subscription")
        return pubsub

    def watch_statuses(
        self, pubsub: redis.client.PubSub, seen: list[cms_pb2.InstanceStatus], stop: threading.Event
    ) -> None:
        """Append every status the llumlet publishes until `stop`: from the notices, which carry the record,
        so none is missed however slowly this thread runs (polling the key, a loaded machine missed most)."""
        try:
            while not stop.is_set():
                message = pubsub.get_message(timeout=0.05)
                notice = split_notice(message["data"]) if message and message["type"] == "message" else None
                if notice is None or notice[0] != keys.STATUS:
                    continue
                record = notice[2]
                status = decode_status(record, self.instance_id) if record is not None else self.status()
                if status is not None and (not seen or status.update_id != seen[-1].update_id):
                    seen.append(status)
        finally:
            pubsub.close()


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory) -> Iterator[services.RunningService]:
    try:
        service = services.start_redis(tmp_path_factory.mktemp("redis"))
    except services.MissingBinary as exc:
        _missing(str(exc))
    with service:
        yield service


@pytest.fixture(scope="module")
def engine(redis_server, tmp_path_factory) -> Iterator[Engine]:
    if testing.vllm_python() is None:
        _missing("vLLM is not installed: run scripts/install-vllm.sh (or set PILOTFISH_VLLM_PYTHON)")
    model = testing.build_tiny_llama(tmp_path_factory.mktemp("model"))
    work = tmp_path_factory.mktemp("vllm")
    env = {
        "PILOTFISH_CMS_URL": redis_server.url,
        "PILOTFISH_CLUSTER": CLUSTER,
        "PILOTFISH_TTL_MS": str(TTL_MS),
        "PILOTFISH_REFRESH_MS": "1000",
    }
    # vLLM's KV-event publisher: the llumlet advertises it, the scheduler's subscriber reads it
    # (ipc: vLLM binds it, and nothing listens beyond this machine)
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                 "endpoint": f"ipc://{work / 'kv-events.sock'}"}  # fmt: skip
    child, url = testing.start_vllm(
        model, work, llumlet_env=env, timeout=START_TIMEOUT,
        # room for LONG_TOKENS (the tiny Llama's positions go to 2048)
        extra_args=["--kv-events-config", json.dumps(kv_events), "--max-model-len", "2048"],
    )  # fmt: skip
    port = int(url.rsplit(":", 1)[1])
    client = redis.Redis.from_url(redis_server.url)
    eng = Engine(child, url, port, client, work / "vllm.log")
    try:
        meta_key = wait_for(lambda: client.keys(keys.meta_pattern(CLUSTER)), 60, "llumlet metadata")[0]
        eng.instance_id = keys.instance_of(meta_key)
        eng.meta = decode_metadata(client.get(meta_key), eng.instance_id)
        yield eng
    finally:
        child.stop(grace=20)
        client.delete(*client.keys(f"{keys.PREFIX}:{CLUSTER}:*") or ["-"])


def complete(
    engine: Engine, request_id: str, max_tokens: int, results: dict[str, str], hang_up: threading.Event | None = None
) -> None:
    """One streamed completion; records its finish reason (or the error) under its id. Once
    `hang_up` is set the client closes the stream at its next token ("hung up"): vLLM aborts it."""
    conn = http.client.HTTPConnection("127.0.0.1", engine.port, timeout=WAIT * 2)
    body = {"model": testing.MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}  # fmt: skip
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json", "X-Request-Id": request_id})  # fmt: skip
        response = conn.getresponse()
        finish = f"http {response.status}"
        for line in response:
            if hang_up is not None and hang_up.is_set():
                finish = "hung up"
                break
            if line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"][0]
                finish = choice.get("finish_reason") or finish
        results[request_id] = finish
    except Exception as exc:
        results[request_id] = f"error {exc}"
    finally:
        conn.close()


def test_metadata_describes_the_engine(engine: Engine):
    meta = engine.meta
    assert (meta.host, meta.http_port, meta.model) == ("127.0.0.1", engine.port, testing.MODEL_NAME)
    assert meta.llumlet_port > 0 and meta.block_size > 0 and meta.num_gpu_blocks > 0
    assert meta.max_num_seqs == 16 and meta.max_num_batched_tokens == 1024
    status = engine.status()
    assert status is not None and status.total_kv_tokens == meta.num_gpu_blocks * meta.block_size
    assert status.schedulable and status.num_waiting == status.num_running == 0


def test_the_load_is_written_by_an_export_process(engine: Engine):
    """The default: a process vLLM's engine core starts writes the CMS, fed through shared memory.
    It has left the engine core's process tree (vLLM's shutdown SIGKILLs that tree) and stays in
    vLLM's process group."""
    found = re.search(r"exporting to .* from process (\d+)", engine.log_path.read_text(errors="replace"))
    assert found, "the llumlet did not log its export process"
    exporter = int(found.group(1))
    assert b"pilotfish.vllm_plugin.core.export_process" in Path(f"/proc/{exporter}/cmdline").read_bytes()
    fields = stat_fields(exporter)
    assert fields is not None and int(fields[2]) == os.getpgid(engine.child.pid)  # vLLM's process group
    cores = [pid for pid in descendants(engine.child.pid) if _comm(pid).startswith("VLLM::EngineCor")]
    assert len(cores) == 1
    if can_detach():
        assert exporter not in descendants(cores[0])
    else:  # a plain child of the engine core
        assert int(fields[1]) == cores[0]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text()
    except OSError:
        return ""


def test_status_follows_waiting_and_running(engine: Engine):
    seen: list[cms_pb2.InstanceStatus] = []
    stop = threading.Event()

    watcher = threading.Thread(target=engine.watch_statuses, args=(engine.status_notices(), seen, stop))
    watcher.start()
    results: dict[str, str] = {}
    # 24 requests for 16 seats (--max-num-seqs 16): some must wait. Each would decode LONG_TOKENS,
    # so all 24 arrive while the first 16 run even where a loaded machine's API server takes
    # seconds to admit them (fresh-clone CI once saw 4 at a time with 320-token requests); once
    # the status has shown all of that, the clients hang up, and vLLM aborts what is left.
    ids = [f"pf-{os.getpid()}-{i}" for i in range(24)]
    start_line = threading.Barrier(len(ids))
    hang_up = threading.Event()

    def client(rid: str) -> None:
        start_line.wait(timeout=WAIT)
        complete(engine, rid, LONG_TOKENS, results, hang_up)

    wanted = {f"cmpl-{rid}-0" for rid in ids}  # vLLM's random suffix stripped
    admitted: set[str] = set()
    peak = {"running": 0, "waiting": 0, "step": 0}
    looked = 0

    def all_seen() -> bool:
        nonlocal looked
        for s in seen[looked:]:  # the records the watcher added since the last look
            admitted.update(s.admitted_request_ids)
            peak["running"] = max(peak["running"], s.num_running)
            peak["waiting"] = max(peak["waiting"], s.num_waiting)
            looked += 1
            peak["step"] = s.step_id
        # and some decoding: 16 steps
        return wanted <= admitted and peak["running"] == 16 and peak["waiting"] >= 1 and peak["step"] >= 16

    clients = [threading.Thread(target=client, args=(rid,)) for rid in ids]
    try:
        for c in clients:
            c.start()
        wait_for(lambda: all_seen() or len(results) == len(ids), WAIT * 3, "24 requests admitted, 16 running")
        hang_up.set()
        for c in clients:
            c.join(timeout=WAIT * 3)
        wait_for(lambda: (s := engine.status()) and s.num_waiting == 0 and s.num_running == 0, WAIT, "an idle status")
    finally:
        hang_up.set()
        stop.set()
        watcher.join()
    assert set(results) == set(ids) and set(results.values()) <= {"hung up", "length"}, results
    assert max(s.num_running for s in seen) == 16
    assert max(s.num_waiting for s in seen) >= 1
    assert any(s.num_running_decode > 0 for s in seen)
    # each decode holds the prompt and 1..LONG_TOKENS generated tokens (the decode step's O(1) path included)
    prompt = prompt_tokens(engine)
    assert all(
        s.num_running_decode * (prompt + 1)
        <= s.running_decode_seq_len_sum
        <= s.num_running_decode * (prompt + LONG_TOKENS)
        for s in seen
    )
    assert any(s.uncomputed_prefill_tokens > 0 for s in seen)
    assert max(s.used_kv_tokens for s in seen) > 0
    assert all(s.num_waiting + s.num_running <= 24 for s in seen)
    assert wanted <= {rid for s in seen for rid in s.admitted_request_ids}
    steps = [s.step_id for s in seen]
    assert steps == sorted(steps) and steps[-1] >= 16
    assert any(s.last_step_duration_us > 0 and s.last_step_decode_batch > 0 for s in seen)
    updates = [s.update_id for s in seen]
    assert updates == sorted(set(updates))


def prompt_tokens(engine: Engine) -> int:
    """How many tokens PROMPT is, by vLLM's count."""
    conn = http.client.HTTPConnection("127.0.0.1", engine.port, timeout=WAIT)
    body = {"model": testing.MODEL_NAME, "prompt": PROMPT, "max_tokens": 1}
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        return int(json.loads(conn.getresponse().read())["usage"]["prompt_tokens"])
    finally:
        conn.close()


def post_token_prompt(engine: Engine, tokens: list[int]) -> None:
    """A completion whose prompt is token ids: the engine caches exactly these (no BOS, no tokenizer)."""
    conn = http.client.HTTPConnection("127.0.0.1", engine.port, timeout=WAIT)
    body = {"model": testing.MODEL_NAME, "prompt": tokens, "max_tokens": 2, "ignore_eos": True}
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()[:300]
        response.read()
    finally:
        conn.close()


async def test_the_scheduler_indexes_vllm_kv_events(engine: Engine, redis_server: services.RunningService):
    """Real vLLM's ZMQ KV events, found through the llumlet's metadata, fill the scheduler's prefix
    index with the gateway's hashes of the same token ids, and a Schedule for that prefix goes there."""
    assert engine.meta.kv_events_endpoint.startswith("ipc://") and engine.meta.kv_events_topic == "kv"
    gateway_block = engine.meta.block_size  # vLLM on CPU: 128 tokens, against a 1024-token context
    config = SchedulerConfig(
        enable_full_mode_scheduling=True, enable_cache_aware_scheduling=True, redis_url=redis_server.url,
        cms_cluster=CLUSTER, port=free_port(), cms_poll_interval_seconds=0.2,
        kv_events_prefix_block_size=gateway_block,
    )  # fmt: skip
    server = SchedulerServer(config)
    await server.start()
    try:
        core, subscriber = server.core, server.kv_events
        assert subscriber is not None and core.prefix_index is not None
        await wait_until_async(lambda: len(subscriber) == 1, WAIT, "a KV-event subscription to vLLM")
        prefix = [16 + (k * 37) % 240 for k in range(gateway_block * 3)]  # inside the tiny vocabulary
        hashes = prefix_block_hashes(prefix, gateway_block)
        assert core.prefix_index.match(hashes) == {}
        deadline = time.monotonic() + WAIT
        attempt = 0
        # the SUB socket may still be joining when the first events go out: a new suffix each try
        while core.prefix_index.match(hashes).get(engine.instance_id, 0) < len(hashes):
            assert time.monotonic() < deadline, f"vLLM's KV events never filled the index: {subscriber.stats}"
            attempt += 1
            await asyncio.to_thread(post_token_prompt, engine, [*prefix, 16 + attempt % 240, 17])
            await wait_until_async(lambda: subscriber.stats.applied["stored"] > 0, WAIT, "a stored event")
        assert not subscriber.stats.dropped
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            decision = await scheduler_pb2_grpc.SchedulerStub(channel).Schedule(
                scheduler_pb2.ScheduleRequest(
                    request_id="follow-up", model=testing.MODEL_NAME, prompt_tokens=len(prefix) + 8,
                    prefix_block_hashes=prefix_block_hashes([*prefix, *range(20, 28)], gateway_block),
                    prefix_block_size=gateway_block,
                ),
                timeout=WAIT,
            )  # fmt: skip
        assert decision.target.instance_id == engine.instance_id
    finally:
        await server.stop(grace=1)


def test_the_status_counts_the_answers_and_their_tokens(engine: Engine):
    """What a full-mode scheduler learns answer lengths from (its gateway reads no response bodies): three
    5-token answers add 3 to num_finished_total and 15 to finished_output_tokens_total, each exactly."""
    wait_for(lambda: (s := engine.status()) and s.num_waiting == 0 and s.num_running == 0, WAIT, "an idle status")
    before = engine.status()
    assert before is not None
    results: dict[str, str] = {}
    for i in range(3):
        complete(engine, f"pf-answer-{os.getpid()}-{i}", 5, results)
    assert set(results.values()) == {"length"}, results
    wait_for(
        lambda: (s := engine.status()) and s.num_finished_total >= before.num_finished_total + 3, WAIT, "3 answers"
    )
    after = engine.status()
    assert after is not None and after.epoch == before.epoch
    assert after.num_finished_total == before.num_finished_total + 3
    assert after.finished_output_tokens_total == before.finished_output_tokens_total + 15


def test_abort_over_grpc_ends_the_stream(engine: Engine):
    # The tiny model on an idle machine decodes 900 tokens in about a second, so the Abort can
    # lose the race with the request's end; then a new request is tried (never a sleep).
    with grpc.insecure_channel(f"127.0.0.1:{engine.meta.llumlet_port}") as channel:
        stub = llumlet_pb2_grpc.LlumletStub(channel)
        stub.GetStatus(llumlet_pb2.GetStatusRequest(), timeout=30)  # connected before the race starts
        for attempt in range(5):
            results: dict[str, str] = {}
            rid = f"pf-abort-{os.getpid()}-{attempt}"
            client = threading.Thread(target=complete, args=(engine, rid, 900, results))
            client.start()
            exported = f"cmpl-{rid}-0"

            def decoding_or_done(rid: str = rid, results: dict[str, str] = results) -> bool:
                status = engine.status()
                return rid in results or (status is not None and status.num_running_decode == 1)

            wait_for(decoding_or_done, WAIT, "the request decoding")
            aborted: list[str] = []
            while rid not in results and not aborted:
                reply = stub.Abort(llumlet_pb2.AbortRequest(request_ids=[exported, "no-such-request"]), timeout=30)
                aborted = list(reply.aborted_request_ids)
            client.join(timeout=WAIT)
            if aborted:
                break
            assert results.get(rid) == "length", results  # it ended on its own before the Abort landed
        else:
            pytest.fail("every request finished before its Abort landed")
        assert aborted == [exported]
        assert results.get(rid) == "abort"
        # the abort is applied at the engine's next step: the llumlet reports it gone
        wait_for(
            lambda: stub.GetStatus(llumlet_pb2.GetStatusRequest(), timeout=30).num_running == 0,
            WAIT,
            "the aborted request to leave the running batch",
        )


async def test_a_hung_engine_core_is_found_stalled_and_let_back_once_it_steps(
    engine: Engine, redis_server: services.RunningService
):
    """A hung GPU or engine loop, as SIGSTOP on vLLM's engine core makes one: the export process goes on
    refreshing the last record (fresh timestamps, the same step, a request running), the engine's /health would
    still answer, and the request hangs. The full-mode scheduler ejects the engine as stalled, and lets it back
    once it steps again."""
    config = SchedulerConfig(
        enable_full_mode_scheduling=True, redis_url=redis_server.url, cms_cluster=CLUSTER, port=free_port(),
        cms_poll_interval_seconds=0.2, engine_stall_seconds=2.0,
    )  # fmt: skip
    server = SchedulerServer(config)
    await server.start()
    results: dict[str, str] = {}
    request = threading.Thread(target=complete, args=(engine, "hung-1", LONG_TOKENS, results))
    cores = [pid for pid in descendants(engine.child.pid) if _comm(pid).startswith("VLLM::EngineCor")]
    assert len(cores) == 1
    stopped = False
    try:
        core = server.core

        def running() -> bool:  # the request on the engine, which has stepped (a writer's step 0 says nothing)
            inst = next((i for i in core.instances() if i.instance_id == engine.instance_id), None)
            status = inst.status if inst is not None else None
            return status is not None and status.num_running > 0 and status.step_id > 0

        request.start()
        await wait_until_async(running, WAIT, "the request running, as the scheduler sees it")
        os.kill(cores[0], signal.SIGSTOP)
        stopped = True
        await wait_until_async(lambda: core.health.is_ejected(engine.instance_id), WAIT, "the engine found stalled")
        assert core.health.ejections(engine.instance_id)["stalled"] == 1
        assert running()  # the record stays live: the request on it, as the export process refreshes it
        os.kill(cores[0], signal.SIGCONT)
        stopped = False
        await wait_until_async(lambda: not core.health.is_ejected(engine.instance_id), WAIT, "the engine back")
        assert core.health.on_probation(engine.instance_id)
    finally:
        if stopped:
            os.kill(cores[0], signal.SIGCONT)
        await asyncio.to_thread(request.join, WAIT * 2)
        await server.stop(grace=1)
    assert results.get("hung-1") == "length"  # it ran on to its end once the engine came back


def test_vllms_own_shutdown_removes_the_keys(engine: Engine):
    """SIGTERM to vLLM's API server: its shutdown (abort, --shutdown-timeout 0, the default)
    SIGKILLs the engine core's process tree at once, before the scheduler's shutdown hook runs.
    The export process, outside that tree, sees the engine core die and removes the keys. Their
    TTL is longer than the wait: only that removal passes."""
    if not can_detach():
        pytest.skip("needs pidfd_open (Linux 5.3+): the export process is then killed with vLLM's tree")
    meta_key = keys.meta_key(CLUSTER, engine.instance_id)
    status_key = keys.status_key(CLUSTER, engine.instance_id)
    assert engine.redis.exists(meta_key, status_key) == 2
    engine.child.stop(grace=WAIT)  # SIGTERM, our child's PID only
    wait_for(lambda: not engine.redis.exists(meta_key, status_key), 60, "the keys removed")
    # the export process's last line: its own report (bench llumlet reads it)
    assert f"llumlet {engine.instance_id} stopping:" in engine.log_path.read_text(errors="replace")


def test_scheduler_cls_follows_vllms_async_choice():
    # vLLM on CPU forces async scheduling off, so the engine above runs the sync variant; the
    # async one is checked here, by what `--scheduler-cls` turns into for each setting.
    python = testing.vllm_python()
    if python is None:
        _missing("vLLM is not installed: run scripts/install-vllm.sh (or set PILOTFISH_VLLM_PYTHON)")
    code = (
        "from types import SimpleNamespace as N\n"
        "from vllm.v1.core.sched.async_scheduler import AsyncScheduler\n"
        "from pilotfish.vllm_plugin import LlumletScheduler\n"
        "for flag in (True, False):\n"
        "    config = N(scheduler_config=N(async_scheduling=flag))\n"
        "    obj = LlumletScheduler.__new__(LlumletScheduler, vllm_config=config)\n"
        "    assert isinstance(obj, LlumletScheduler) and isinstance(obj, AsyncScheduler) == flag, (flag, type(obj))\n"
        "print('ok')\n"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_inert_without_a_cms(redis_server, tmp_path_factory):
    # The module's second (and last) vLLM start: the llumlet's scheduler class, no PILOTFISH_CMS_URL.
    if testing.vllm_python() is None:
        _missing("vLLM is not installed: run scripts/install-vllm.sh (or set PILOTFISH_VLLM_PYTHON)")
    model = testing.build_tiny_llama(tmp_path_factory.mktemp("model-inert"))
    work = tmp_path_factory.mktemp("vllm-inert")
    child, url = testing.start_vllm(model, work, llumlet_env=None, timeout=START_TIMEOUT, name="inert")
    try:
        port = int(url.rsplit(":", 1)[1])
        results: dict[str, str] = {}
        complete(Engine(child, url, port, redis.Redis.from_url(redis_server.url), work / "inert.log"), "inert-1", 8,
                 results)  # fmt: skip
        assert results == {"inert-1": "length"}
        log = (work / "inert.log").read_text(errors="replace")
        assert "PILOTFISH_CMS_URL unset, scheduler runs unchanged" in log
        assert "exporting to" not in log
        # nothing of this engine's (its default id ends in its port): the module's other engine, or a
        # record of it not yet expired, may still be in this Redis
        written = redis.Redis.from_url(redis_server.url).keys(f"{keys.PREFIX}:*")
        assert not [key for key in written if keys.instance_of(key).endswith(f"-{port}")], written
    finally:
        child.stop(grace=20)
