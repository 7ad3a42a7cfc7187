"""The llumlet's export process against a real redis-server: a real process the engine's starts,
fed through shared memory, writing the CMS; its stop, the engine's death (alone, with its process
tree as vLLM's shutdown kills it, with its process group), Redis restarts, its own death."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
import redis

from pilotfish import services
from pilotfish.cms import keys
from pilotfish.cms.records import decode_metadata, decode_status
from pilotfish.procs import descendants, free_port, stat_fields
from pilotfish.protos import cms_pb2
from pilotfish.vllm_plugin.config import LlumletConfig
from pilotfish.vllm_plugin.core.export_process import can_detach
from pilotfish.vllm_plugin.core.llumlet import Llumlet
from tests.integration.test_llumlet_cms import wait_for

pytestmark = pytest.mark.integration

# a TTL no test waits for: keys that vanish were removed, not expired
LONG_TTL = {"ttl_ms": 120_000, "refresh_ms": 500}


def make_llumlet(url: str, instance: str = "e0", **kw: object) -> Llumlet:
    cfg = LlumletConfig(cms_url=url, cluster="t", **{"ttl_ms": 1500, "refresh_ms": 500, **kw})  # type: ignore[arg-type]
    meta = cms_pb2.InstanceMetadata(host="127.0.0.1", http_port=8000, model="m", block_size=16)
    return Llumlet(cfg, instance, meta, own_process=True)


def status_of(client: redis.Redis, instance: str = "e0") -> cms_pb2.InstanceStatus | None:
    raw = client.get(keys.status_key("t", instance))
    return decode_status(raw, instance) if raw else None


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie (not yet reaped: ours, or init's once detached), or reaped since, is gone too
    fields = stat_fields(pid)
    return fields is None or fields[0] == "Z"


def test_the_export_process_writes_every_change_and_removes_the_keys(redis_service):
    client = redis.Redis.from_url(redis_service.url)
    llumlet = make_llumlet(redis_service.url)
    llumlet.start(serve_grpc=False)
    child = llumlet.export_process.pid  # type: ignore[union-attr]
    try:
        assert child != os.getpid()
        meta = wait_for(lambda: client.get(keys.meta_key("t", "e0")), what="metadata")
        assert decode_metadata(meta, "e0").model == "m"
        for i in range(50):
            with llumlet.events() as s:
                s.added(f"r{i}", 40)
                if i % 2:
                    s.scheduled(f"r{i}", 0, num_cached_tokens=16)
        got = wait_for(lambda: (st := status_of(client)) and st.num_waiting == 25 and st, what="fifty admissions")
        assert got.num_running == 25 and got.uncomputed_prefill_tokens == 25 * 40 + 25 * 24
        assert list(got.admitted_request_ids) == [f"r{i}" for i in range(50)]
        with llumlet.events() as s:
            s.finished("r0")
        wait_for(lambda: status_of(client).num_waiting == 24, what="a finish")  # type: ignore[union-attr]
    finally:
        llumlet.stop()
    assert client.exists(keys.meta_key("t", "e0"), keys.status_key("t", "e0")) == 0
    assert gone(child)


def test_steady_decode_steps_reach_redis_as_the_state_they_make(redis_service):
    """LoadState.decode_step goes to the export process as a tick (two words in shared memory);
    the status in Redis is the full state all the same."""
    client = redis.Redis.from_url(redis_service.url)
    llumlet = make_llumlet(redis_service.url)
    llumlet.start(serve_grpc=False)
    try:
        with llumlet.events() as s:
            s.kv_usage(4, 100, 16)
            for i in range(3):
                s.added(f"r{i}", 40)
                s.scheduled(f"r{i}", 40)
                s.progressed(f"r{i}", 40, 1)
        for step in range(1, 21):
            llumlet.decode_step(7_000 + step, 4 + step, (4 + step) * 16, time.monotonic_ns())
        got = wait_for(lambda: (st := status_of(client)) and st.step_id == 20 and st, what="twenty steady steps")
        assert (got.num_running_decode, got.running_decode_seq_len_sum) == (3, 3 * (41 + 20))
        assert (got.last_step_duration_us, got.last_step_decode_batch, got.last_step_seq_len_sum) == (
            7_020,
            3,
            3 * (41 + 20) - 3,
        )
        assert (got.used_kv_tokens, got.last_step_prefill_tokens) == (24 * 16, 0)
        with llumlet.events() as s:
            s.finished("r0")
        got = wait_for(lambda: (st := status_of(client)) and st.num_running == 2 and st, what="a finish")
        assert (got.step_id, got.running_decode_seq_len_sum) == (20, 2 * (41 + 20))
    finally:
        llumlet.stop()


@contextlib.contextmanager
def engine_process(url: str, instance: str, **popen: object) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """An engine process (a llumlet with an export process, one request waiting, a TTL no test
    waits for) and its export process's pid, once the request is in Redis; killed at the end."""
    engine_code = textwrap.dedent(f"""
        import sys, time
        from pilotfish.protos import cms_pb2
        from pilotfish.vllm_plugin.config import LlumletConfig
        from pilotfish.vllm_plugin.core.llumlet import Llumlet
        cfg = LlumletConfig(cms_url={url!r}, cluster="t", ttl_ms=120_000, refresh_ms=500)
        llumlet = Llumlet(cfg, {instance!r}, cms_pb2.InstanceMetadata(host="127.0.0.1", http_port=1), own_process=True)
        llumlet.start(serve_grpc=False)
        with llumlet.events() as s:
            s.added("r1", 10)
        print(llumlet.export_process.pid, flush=True)
        time.sleep(600)
    """)
    argv = [sys.executable, "-c", engine_code]
    engine = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, **popen)  # type: ignore[call-overload]
    try:
        child = int(engine.stdout.readline())  # type: ignore[union-attr]
        client = redis.Redis.from_url(url)
        wait_for(lambda: (st := status_of(client, instance)) and st.num_waiting == 1, what="the engine's status")
        yield engine, child
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


def instance_keys(instance: str) -> tuple[str, str]:
    return keys.meta_key("t", instance), keys.status_key("t", instance)


def wait_removed(url: str, instance: str, what: str) -> None:
    client = redis.Redis.from_url(url)
    wait_for(lambda: client.exists(*instance_keys(instance)) == 0, timeout=20, what=what)


def test_the_engine_process_dying_removes_its_keys_at_once(redis_service):
    """SIGKILL to the engine's process: its export process sees the pipe close and deletes the
    keys, long before the TTL."""
    with engine_process(redis_service.url, "dying") as (engine, child):
        engine.send_signal(signal.SIGKILL)
        engine.wait(timeout=10)
        wait_removed(redis_service.url, "dying", "the keys removed after the engine died")
        wait_for(lambda: gone(child), what="the export process to exit")


@pytest.mark.skipif(not can_detach(), reason="needs pidfd_open (Linux 5.3+): the export process stays a plain child")
def test_vllms_shutdown_killing_the_engines_process_tree_leaves_the_keys_to_the_export_process(redis_service):
    """vLLM's shutdown SIGKILLs every descendant of its engine core, then the engine core
    (vllm.utils.system_utils.kill_process_tree, at once under --shutdown-timeout 0). The export
    process is not among them, stays in the engine's process group, and removes the keys."""
    with engine_process(redis_service.url, "shutdown") as (engine, child):
        tree = descendants(engine.pid)
        assert child not in tree
        assert os.getpgid(child) == os.getpgid(engine.pid)
        for pid in [*tree[1:], engine.pid]:  # as vLLM does: the descendants first
            os.kill(pid, signal.SIGKILL)
        engine.wait(timeout=10)
        wait_removed(redis_service.url, "shutdown", "the keys removed after the engine's tree was killed")
        wait_for(lambda: gone(child), what="the export process to exit")


def test_killing_the_engines_process_group_leaves_the_keys_to_their_ttl(redis_service):
    """SIGKILL to the whole process group takes the export process too: nothing removes the keys,
    which keep their TTL (the backstop for a dead engine)."""
    with engine_process(redis_service.url, "group", start_new_session=True) as (engine, child):
        os.killpg(engine.pid, signal.SIGKILL)  # the group we started
        engine.wait(timeout=10)
        wait_for(lambda: gone(child), what="the export process killed with its group")
        client = redis.Redis.from_url(redis_service.url)
        assert client.exists(*instance_keys("group")) == 2
        assert all(client.pttl(key) > 0 for key in instance_keys("group"))


def test_the_export_process_writes_again_after_a_redis_restart(redis_binary, tmp_path):
    port = free_port()
    first = services.start_redis(tmp_path / "r1", port)
    llumlet = make_llumlet(first.url, **LONG_TTL)
    llumlet.start(serve_grpc=False)
    try:
        client = redis.Redis.from_url(first.url)
        wait_for(lambda: status_of(client), what="first status")
        first.stop()
        for i in range(3):  # the engine goes on while Redis is away: never blocked, nothing kept back
            with llumlet.events() as s:
                s.added(f"r{i}", 10)
        with services.start_redis(tmp_path / "r2", port) as second:
            client = redis.Redis.from_url(second.url)
            wait_for(
                lambda: (st := status_of(client)) and st.num_waiting == 3, timeout=30, what="the state written again"
            )
            wait_for(lambda: client.exists(keys.meta_key("t", "e0")), what="metadata written again")
            llumlet.stop()
    finally:
        llumlet.stop()
        first.stop()


def test_a_dead_export_process_is_replaced_on_an_idle_engine(redis_service):
    """No engine event follows the death: the watcher, not a hook, must bring a new one."""
    client = redis.Redis.from_url(redis_service.url)
    llumlet = make_llumlet(redis_service.url, **LONG_TTL)
    llumlet.start(serve_grpc=False)
    first = llumlet.export_process
    assert first is not None
    try:
        with llumlet.events() as s:
            s.added("r0", 10)
        wait_for(lambda: (st := status_of(client)) and st.num_waiting == 1, what="first status")
        first.kill()
        first.wait_exit()
        client.delete(keys.status_key("t", "e0"), keys.meta_key("t", "e0"))  # as if they had expired meanwhile
        wait_for(
            lambda: (e := llumlet.export_process) is not None and e.pid != first.pid and not e.wait_exit(0),
            timeout=30,
            what="a new export process",
        )
        # the new one starts from the engine's current state, metadata first
        wait_for(lambda: (st := status_of(client)) and st.num_waiting == 1, what="the state written again")
        assert client.exists(keys.meta_key("t", "e0"))
        with llumlet.events() as s:
            s.added("r1", 10)
        wait_for(lambda: (st := status_of(client)) and st.num_waiting == 2, what="a change through the new one")
    finally:
        llumlet.stop()
    assert client.exists(keys.status_key("t", "e0"), keys.meta_key("t", "e0")) == 0


def test_stopping_after_the_export_process_died_still_removes_the_keys(redis_service, monkeypatch):
    from pilotfish.vllm_plugin.core import export_supervisor

    monkeypatch.setattr(export_supervisor, "_RESPAWN_EVERY_S", 3600.0)  # no replacement in this test
    client = redis.Redis.from_url(redis_service.url)
    llumlet = make_llumlet(redis_service.url, **LONG_TTL)
    llumlet.start(serve_grpc=False)
    child = llumlet.export_process
    assert child is not None
    wait_for(lambda: status_of(client), what="first status")
    child.kill()
    child.wait_exit()
    llumlet.stop()
    assert client.exists(keys.status_key("t", "e0"), keys.meta_key("t", "e0")) == 0


@pytest.mark.parametrize("how", ["spawn refused", "never ready"])
def test_an_export_process_that_cannot_start_leaves_the_writes_to_the_engine_process(redis_service, monkeypatch, how):
    from pilotfish.vllm_plugin.core import export_process

    def refuse(*_args: object, **_kw: object) -> None:
        raise OSError("fork refused")

    if how == "spawn refused":
        monkeypatch.setattr(export_process.ExportProcess, "__init__", refuse)
    else:
        monkeypatch.setattr(export_process.sys, "executable", "/bin/false")  # a real child that exits at once
    client = redis.Redis.from_url(redis_service.url)
    llumlet = make_llumlet(redis_service.url)
    llumlet.start(serve_grpc=False)
    try:
        assert llumlet.export_process is None
        with llumlet.events() as s:
            s.added("r1", 10)
        wait_for(lambda: (st := status_of(client)) and st.num_waiting == 1, what="a write from the engine's process")
    finally:
        llumlet.stop()
    assert client.exists(keys.status_key("t", "e0")) == 0
