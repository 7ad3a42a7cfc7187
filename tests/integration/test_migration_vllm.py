"""Live request migration between two real vLLM engines on CPU (adapters/vllm_migration.py).

A has --max-num-seqs 1 (so a second request waits), B the default. Clients stream from A only;
a request migrated to B keeps streaming from A, with B's tokens relayed through A's server.

Migrations go through the llumlets' own Migrate/MigrateIn (core/migration.py). Outputs are compared token by token
with an unmigrated run: temperature 0 on dummy weights is deterministic, and repetition_penalty
2.0 makes every generated token distinct (so a lost or repeated token cannot hide in a cycle)
while staying exact under recompute (vLLM penalizes prompt and output tokens alike).

Both write their load changes from vLLM's process (PILOTFISH_EXPORT_PROCESS=false; the default,
an export process, runs in test_llumlet_vllm.py): A from vLLM's engine thread, B only from the
export thread (PILOTFISH_ENGINE_THREAD_WRITES=false), so every write path runs inside real vLLM.
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import re
import signal
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
from pilotfish.cms.records import decode_metadata
from pilotfish.procs import Child, free_port
from pilotfish.protos import cms_pb2, llumlet_pb2, llumlet_pb2_grpc
from pilotfish.vllm_plugin import testing

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

CLUSTER = "migration"
PROMPT = "a llumlet exports load the instant it changes; prefill decode waiting running tokens blocks cache prefix"
# Long enough (several seconds on A) that a control plane starved by the engines' busy-waiting
# workers on two shared cores still lands its Migrate call while the request runs.
MAX_TOKENS = 1800
MAX_MODEL_LEN = ["--max-model-len", "2048"]  # the tiny model's positions
START_TIMEOUT = 600
ATTEMPTS = 10  # a Migrate call can land after the request ended (seen up to 4 times in a row on 2 cores)
WAIT = 300  # a loaded two-core machine


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off"):
        pytest.fail(f"{reason} (CI is set: a missing dependency fails instead of skipping)", pytrace=False)
    pytest.skip(reason)


@dataclass
class Engine:
    child: Child
    url: str
    llumlet: str  # the llumlet's gRPC "host:port"
    log_path: Path
    instance_id: str = ""  # as registered in the CMS: a Migrate may only name a registered destination

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @functools.cached_property
    def stub(self) -> llumlet_pb2_grpc.LlumletStub:
        # one channel for the module: no connection set-up inside a migration's timing window
        return llumlet_pb2_grpc.LlumletStub(grpc.insecure_channel(self.llumlet))

    def status(self) -> cms_pb2.InstanceStatus:
        return self.stub.GetStatus(llumlet_pb2.GetStatusRequest(), timeout=30)

    def migrate(self, request_id: str, destination: Engine | tuple[str, str]) -> llumlet_pb2.MigrateResponse:
        """`destination`: an engine, or (instance id, llumlet address) for one that is not what it claims."""
        instance_id, address = (
            destination if isinstance(destination, tuple) else (destination.instance_id, destination.llumlet)
        )
        request = llumlet_pb2.MigrateRequest(
            request_ids=[request_id], destination_llumlet_address=address, destination_instance_id=instance_id
        )
        return self.stub.Migrate(request, timeout=120)


@dataclass
class Stream:
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    errors: list[object] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.002)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def stream(engine: Engine, request_id: str, max_tokens: int = MAX_TOKENS) -> Stream:
    """Start one streamed completion in a thread; its tokens, finish and error events accumulate."""
    out = Stream()
    body = {"model": testing.MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "temperature": 0, "repetition_penalty": 2.0, "return_token_ids": True}  # fmt: skip

    def run() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", engine.port, timeout=WAIT)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json", "X-Request-Id": request_id})  # fmt: skip
            for line in conn.getresponse():
                if not line.startswith(b"data: {"):
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    out.errors.append(data["error"])
                    continue
                choice = data["choices"][0]
                out.tokens += choice.get("token_ids") or []
                out.finish = choice.get("finish_reason") or out.finish
        except Exception as exc:
            out.errors.append(repr(exc))
        finally:
            conn.close()
            out.done.set()

    threading.Thread(target=run, daemon=True).start()
    return out


def finished(s: Stream) -> Stream:
    assert s.done.wait(WAIT), "the stream did not end"
    return s


def decoding(s: Stream) -> None:
    """Until the client has a token (or the stream already ended): the request runs, and decodes.

    Read from the stream, not from GetStatus: on two cores the engines' busy-waiting can hold the
    llumlet's gRPC answers back for a second or more, a large part of the request's run.
    """
    wait_for(lambda: s.tokens or s.done.is_set(), WAIT, "the request decoding")


def migrate_while_running(a: Engine, b: Engine, rid: str, s: Stream) -> llumlet_pb2.MigrateResponse:
    """Migrate until it moves or the request has ended (the status can be a step ahead of the engine)."""
    while True:
        reply = a.migrate(exported(rid), b)
        if reply.migrated_request_ids or s.done.is_set():
            return reply
        time.sleep(0.005)


def generated_before_moving(destination: Engine, request_id: str) -> int:
    """How many tokens the request had when the destination admitted it, from its llumlet's log."""
    pattern = re.compile(rf"migrated-in request {re.escape(request_id)} admitted from \S+ with (\d+) of ")
    found = pattern.findall(destination.log_path.read_text(errors="replace"))
    assert found, f"the destination never logged admitting {request_id}"
    return int(found[-1])  # a retried call can admit twice; the last admission is the one that ran


def exported(request_id: str) -> str:
    return f"cmpl-{request_id}-0"  # what the llumlet exports for a completion's X-Request-Id


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict[str, Engine]]:
    if testing.vllm_python() is None:
        _missing("vLLM is not installed: run scripts/install-vllm.sh (or set PILOTFISH_VLLM_PYTHON)")
    try:
        redis_server = services.start_redis(tmp_path_factory.mktemp("redis"))
    except services.MissingBinary as exc:
        _missing(str(exc))
    model = testing.build_tiny_llama(tmp_path_factory.mktemp("model"))
    client = redis.Redis.from_url(redis_server.url)
    engines: dict[str, Engine] = {}
    with redis_server:
        try:
            cpus = testing.engine_cpus(2)  # one core each, or they starve each other
            roles = (("a", ["--max-num-seqs", "1", *MAX_MODEL_LEN]), ("b", MAX_MODEL_LEN))
            for (name, extra), worker_cpus in zip(roles, cpus, strict=True):
                env = {
                    "PILOTFISH_CMS_URL": redis_server.url,
                    "PILOTFISH_CLUSTER": CLUSTER,
                    "PILOTFISH_REFRESH_MS": "1000",
                    "PILOTFISH_STATS_LOG_S": "1",  # the write counts, for the write-path test
                    "PILOTFISH_EXPORT_PROCESS": "false",
                    "PILOTFISH_ENGINE_THREAD_WRITES": "true" if name == "a" else "false",
                }
                work = tmp_path_factory.mktemp(f"vllm-{name}")
                child, url = testing.start_vllm(
                    model,
                    work,
                    llumlet_env=env,
                    extra_args=extra,
                    name=name,
                    timeout=START_TIMEOUT,
                    worker_cpus=worker_cpus,
                )
                port = url.rsplit(":", 1)[1]

                def meta(port: str = port) -> cms_pb2.InstanceMetadata | None:
                    for key in client.keys(keys.meta_pattern(CLUSTER)):
                        m = decode_metadata(client.get(key), keys.instance_of(key))
                        if str(m.http_port) == port:
                            return m
                    return None

                m = wait_for(meta, 60, f"engine {name}'s llumlet metadata")
                llumlet = f"127.0.0.1:{m.llumlet_port}"
                engines[name] = Engine(child, url, llumlet, work / f"{name}.log", m.instance_id)
            yield engines
        finally:
            for engine in engines.values():
                engine.child.stop(grace=20)


@pytest.fixture(scope="module")
def unmigrated(cluster: dict[str, Engine]) -> list[int]:
    """The reference output, computed on B and on A without migration: they must agree."""
    on_b = finished(stream(cluster["b"], f"ref-b-{os.getpid()}"))
    on_a = finished(stream(cluster["a"], f"ref-a-{os.getpid()}"))
    assert (on_b.finish, on_b.errors, len(on_b.tokens)) == ("length", [], MAX_TOKENS)
    assert on_a.tokens == on_b.tokens, "the two engines disagree without migration: no reference"
    assert len(set(on_b.tokens[:300])) == 300, "the reference output repeats: it could hide a lost token"
    return on_b.tokens


def test_running_request_moves_and_the_stream_stays_whole(cluster: dict[str, Engine], unmigrated: list[int]):
    a, b = cluster["a"], cluster["b"]
    for attempt in range(ATTEMPTS):  # on a loaded machine the request may finish before the call lands
        rid = f"run-{os.getpid()}-{attempt}"
        s = stream(a, rid)
        decoding(s)
        b_steps = b.status().step_id
        reply = migrate_while_running(a, b, rid, s)
        if list(reply.migrated_request_ids) == [exported(rid)]:
            break
        finished(s)
    else:
        pytest.fail("the request finished before every migration attempt")
    finished(s)
    assert s.errors == [] and s.finish == "length"
    assert s.tokens == unmigrated  # complete, in order, none lost or repeated, recompute exact
    # B computed the rest: a step per token it generated at least (B is idle otherwise). How many
    # that is depends on when the call landed, which B's log says.
    assert b.status().step_id - b_steps >= MAX_TOKENS - generated_before_moving(b, exported(rid))
    assert f"migration of {exported(rid)} failed" not in a.log_path.read_text(errors="replace")


def test_waiting_request_moves_by_admission(cluster: dict[str, Engine], unmigrated: list[int]):
    a, b = cluster["a"], cluster["b"]
    for attempt in range(ATTEMPTS):  # on a loaded machine the first request may finish before the call lands
        first = stream(a, f"w1-{os.getpid()}-{attempt}")
        decoding(first)  # running on A
        rid = f"w2-{os.getpid()}-{attempt}"
        second = stream(a, rid)  # A runs one request at a time: this one waits
        wait_for(lambda f=first: a.status().num_waiting == 1 or f.done.is_set(), WAIT, "the second one waiting on A")
        b_steps = b.status().step_id
        reply = a.migrate(exported(rid), b)
        # A ran the first request from before the call to after it: the second was still waiting
        if list(reply.migrated_request_ids) == [exported(rid)] and not first.done.is_set():
            break
        finished(first)
        finished(second)
    else:
        pytest.fail("the first request finished before every migration attempt")
    for s in (finished(second), finished(first)):
        assert s.errors == [] and s.finish == "length"
        assert s.tokens == unmigrated
    assert b.status().step_id - b_steps >= MAX_TOKENS - generated_before_moving(b, exported(rid))


def test_a_destination_the_cms_does_not_know_is_refused_and_the_request_stays(
    cluster: dict[str, Engine], unmigrated: list[int]
):
    """B's instance id at an address where nothing listens: not B's registered llumlet, so the
    source refuses before it detaches anything or sends a byte."""
    a, b = cluster["a"], cluster["b"]
    rid = f"nodst-{os.getpid()}"
    s = stream(a, rid)
    decoding(s)
    with pytest.raises(grpc.RpcError) as refused:
        a.migrate(exported(rid), (b.instance_id, f"127.0.0.1:{free_port()}"))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finished(s)
    assert s.errors == [] and s.finish == "length"
    assert s.tokens == unmigrated


WRITE_COUNTS = re.compile(r"(\d+) status writes \((\d+) from the engine's thread\)")


def test_each_engine_writes_from_the_thread_it_was_told(cluster: dict[str, Engine], unmigrated: list[int]):
    def last_counts(engine: Engine) -> tuple[int, int] | None:
        found = WRITE_COUNTS.findall(engine.log_path.read_text(errors="replace"))
        return (int(found[-1][0]), int(found[-1][1])) if found else None

    # Both engines have served a request (`unmigrated`), so both have exported load changes.
    wait_for(lambda: (c := last_counts(cluster["a"])) and c[1] > 0 and c, WAIT, "A's inline writes")
    writes_b, _ = wait_for(lambda: last_counts(cluster["b"]), WAIT, "B's write counts")
    assert writes_b > 0 and all(int(inline) == 0 for _, inline in WRITE_COUNTS.findall(
        cluster["b"].log_path.read_text(errors="replace")))  # fmt: skip


def test_destination_killed_mid_migration(cluster: dict[str, Engine], unmigrated: list[int]):
    # Last in the module: B does not come back.
    a, b = cluster["a"], cluster["b"]
    for attempt in range(ATTEMPTS):  # on a loaded machine the request may finish before the call lands
        rid = f"kill-{os.getpid()}-{attempt}"
        s = stream(a, rid)
        decoding(s)
        reply = migrate_while_running(a, b, rid, s)
        if list(reply.migrated_request_ids) == [exported(rid)]:
            break
        finished(s)
    else:
        pytest.fail("the request finished before every migration attempt")
    os.killpg(b.child.pid, signal.SIGKILL)
    b.child.proc.wait(timeout=30)
    finished(s)
    # Either A computes the rest (the stream is whole) or it ends with an error event: never a
    # silent end. This adapter reattaches, so the first is expected.
    if s.errors:
        assert s.tokens == unmigrated[: len(s.tokens)], "an error end after a corrupted stream"
        pytest.fail(f"ended with an error instead of continuing on A: {s.errors}")
    assert s.finish == "length" and s.tokens == unmigrated
    log = a.log_path.read_text(errors="replace")
    reattached = f"migration of {exported(rid)} failed" in log
    print(f"destination killed: {'reattached on A' if reattached else 'B finished before the kill'}")
