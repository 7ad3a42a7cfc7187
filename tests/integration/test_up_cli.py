"""`pilotfish up` as a user runs it: the demo, Ctrl-C, bad input ending in one clear line, the
metrics it prints, and a killed child restarted until it dies too often.

Each run carries a unique marker in its environment, which every child inherits; afterwards
no process on the machine may still carry it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pilotfish.procs import free_port, port_answers, wait_until
from pilotfish.services import http_call

pytestmark = pytest.mark.integration

MARKER = "PILOTFISH_TEST_RUN"


def processes_with(marker: str) -> list[int]:
    """PIDs whose environment carries this run's marker (only our own children can)."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # exited meanwhile, or not ours to read
            continue
    return found


def up(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> tuple[subprocess.CompletedProcess, str]:
    marker = uuid.uuid4().hex
    run_env = {**os.environ, MARKER: marker, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "pilotfish", "up", *args],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return proc, marker


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_demo_serves_through_two_engines(envoy_binary: Path, tmp_path: Path) -> None:
    proc, marker = up("--demo", "--port", str(free_port()), "--demo-requests", "16", "--log-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| sim-")]
    assert len(rows) == 2, proc.stdout
    assert "routed by: scheduler 16" in proc.stdout
    assert processes_with(marker) == []


def test_demo_in_full_mode_with_its_own_redis(envoy_binary: Path, redis_binary: Path, tmp_path: Path) -> None:
    proc, marker = up(
        "--demo", "--full", "--port", str(free_port()), "--demo-requests", "16", "--log-dir", str(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "routed by: scheduler 16" in proc.stdout
    assert (tmp_path / "redis" / "redis.log").exists()
    assert processes_with(marker) == []  # the Redis it started is stopped too


def test_sigint_stops_every_child(envoy_binary: Path, tmp_path: Path) -> None:
    port = free_port()
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, "-m", "pilotfish", "up", "--port", str(port), "--log-dir", str(tmp_path)],
        env={**os.environ, MARKER: marker},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(
            lambda: port_answers(port),
            120,
            "pilotfish up's Envoy listener",
            alive=lambda: None if proc.poll() is None else f"exited {proc.returncode}",
        )
        assert len(processes_with(marker)) >= 5  # up, engines, scheduler, ext_proc, envoy
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_until(lambda: processes_with(marker) == [], 30, "every child of pilotfish up to exit")
    assert not port_answers(port)


def test_unknown_flag_is_one_line() -> None:
    proc, _ = up("--bogus")
    assert proc.returncode == 2
    assert last_line(proc.stderr) == "pilotfish up: error: unrecognized arguments: --bogus"


def test_port_in_use_is_one_line_and_starts_nothing(envoy_binary: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc, marker = up("--port", str(port))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"pilotfish up: error: port {port} on 127.0.0.1 is in use; choose another with --port"
    assert processes_with(marker) == []


def test_missing_envoy_binary_is_one_line() -> None:
    proc, marker = up("--port", str(free_port()), env={"PILOTFISH_ENVOY_BINARY": "/nonexistent/envoy"})
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "pilotfish up: error: PILOTFISH_ENVOY_BINARY=/nonexistent/envoy is not an executable file"
    )
    assert processes_with(marker) == []


def test_envoy_dying_at_start_stops_the_others(tmp_path: Path) -> None:
    # An "Envoy" that exits at once: engines, scheduler and ext_proc are already up by then.
    fake_envoy = {"PILOTFISH_ENVOY_BINARY": "/bin/false"}
    proc, marker = up("--port", str(free_port()), "--log-dir", str(tmp_path), env=fake_envoy)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "envoy" in proc.stderr and "exited with code 1" in proc.stderr
    assert processes_with(marker) == []


# ---------------------------------------------------------------------------------------------
# a running `pilotfish up`: its printed metrics and PIDs, a killed child restarted

START_TIMEOUT = 180.0  # bounds a failure only; a passing run goes on as soon as the stack answers
BACK_TIMEOUT = 60.0


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    marker: str
    port: int
    out: Path
    err: Path

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()

    def alive(self) -> str | None:
        code = self.proc.poll()
        return None if code is None else f"pilotfish up exited {code}: {self.stderr()[-2000:]}"

    def metrics(self) -> dict[str, str]:
        """component -> URL, from the block printed at start."""
        block = self.stdout().split("Prometheus metrics:\n", 1)[1].split("Processes:\n", 1)[0]
        return dict(re.fullmatch(r"  (.+?)\s+(http://\S+)", line).groups() for line in block.splitlines())  # type: ignore[union-attr]

    def pids(self) -> dict[str, int]:
        block = self.stdout().split("Processes:\n", 1)[1]
        return {m[1]: int(m[2]) for m in re.finditer(r"^  (\S+)\s+pid (\d+)$", block, re.M)}


@contextmanager
def running_up(tmp_path: Path, *args: str) -> Iterator[Running]:
    port, marker = free_port(), uuid.uuid4().hex
    out, err = tmp_path / "up.out", tmp_path / "up.err"
    with out.open("wb") as out_f, err.open("wb") as err_f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pilotfish", "up", "--port", str(port), "--log-dir", str(tmp_path / "logs"), *args],
            env={**os.environ, MARKER: marker},
            stdout=out_f,
            stderr=err_f,
            stdin=subprocess.DEVNULL,
        )
    up = Running(proc, marker, port, out, err)
    try:
        wait_until(lambda: "Ctrl-C stops everything." in up.stdout(), START_TIMEOUT, "pilotfish up", alive=up.alive)
        yield up
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        wait_until(lambda: processes_with(marker) == [], 30, "every child of pilotfish up to exit")


def route_through_envoy(port: int) -> str | None:
    """The route a completion through Envoy took (`scheduler`, `fallback`, ...); None unless 200."""
    import urllib.request

    body = json.dumps({"model": "pilotfish-sim", "prompt": "hello", "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10) as response:
            response.read()
            return response.headers.get("x-pilotfish-route", "") if response.status == 200 else None
    except OSError:
        return None


def scrape(url: str) -> set[str]:
    """The sample names in a Prometheus text body (the parser raises on anything else)."""
    status, body = http_call(url, timeout=10)
    assert status == 200, f"{url}: HTTP {status}"
    return {sample.name for family in text_string_to_metric_families(body.decode()) for sample in family.samples}


def sample_value(url: str, name: str, **labels: str) -> float:
    status, body = http_call(url, timeout=10)
    assert status == 200, f"{url}: HTTP {status}"
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


EXPECTED_METRIC = {  # component (as printed, engines by prefix) -> a sample its /metrics must carry
    "engine": "vllm:num_requests_running",
    "scheduler": "pilotfish_scheduler_decision_seconds_count",
    "ext_proc": "pilotfish_ext_proc_generated_tokens_total",
    "envoy": "envoy_server_live",
}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_prints_every_metrics_url_and_restarts_a_killed_scheduler_until_it_dies_too_often(
    envoy_binary: Path, tmp_path: Path
) -> None:
    with running_up(tmp_path, "--engines", "2", "--max-restarts", "1") as up:
        urls = up.metrics()
        assert sorted(urls) == ["engine sim-0", "engine sim-1", "envoy", "ext_proc", "scheduler"]
        for component, url in urls.items():
            assert url.startswith("http://127.0.0.1:")
            assert EXPECTED_METRIC[component.split()[0]] in scrape(url), component
        pids = up.pids()
        assert sorted(pids) == ["engines", "envoy", "ext_proc", "scheduler"]
        assert set(pids.values()) <= set(processes_with(up.marker))
        assert route_through_envoy(up.port) == "scheduler"

        old = pids["scheduler"]
        os.kill(old, signal.SIGKILL)
        back = re.compile(r"scheduler is back as pid (\d+)")
        wait_until(
            lambda: back.search(up.stderr()) is not None, BACK_TIMEOUT, "the scheduler's restart", alive=up.alive
        )
        assert f"scheduler (pid {old}) killed by SIGKILL; restarting it (restart 1; 1 of 1 allowed" in up.stderr()
        new = int(back.search(up.stderr())[1])  # type: ignore[index]
        assert new != old and pid_alive(new) and new in processes_with(up.marker)
        # the same URLs answer, and requests through Envoy are scheduled again
        assert EXPECTED_METRIC["scheduler"] in scrape(urls["scheduler"])
        wait_until(
            lambda: route_through_envoy(up.port) == "scheduler",
            BACK_TIMEOUT,
            "a request through Envoy routed by the new scheduler",
            alive=up.alive,
        )

        # one more death within the window is over --max-restarts 1: everything stops, exit 1
        os.kill(new, signal.SIGKILL)
        assert up.proc.wait(60) == 1
        error = up.stderr().strip().splitlines()[-1]
        assert error.startswith(f"pilotfish up: error: scheduler (pid {new}) died again after 1 restart within 60s")
        assert "killed by SIGKILL" in error and error.endswith("; stopping")
        assert not port_answers(up.port)


def test_full_mode_restarts_its_redis_and_scheduling_resumes(
    envoy_binary: Path, redis_binary: Path, tmp_path: Path
) -> None:
    with running_up(tmp_path, "--full", "--engines", "2") as up:
        pids = up.pids()
        assert "redis-server" in pids
        for component, url in up.metrics().items():
            assert EXPECTED_METRIC[component.split()[0]] in scrape(url), component
        wait_until(
            lambda: route_through_envoy(up.port) == "scheduler",
            BACK_TIMEOUT,
            "scheduling before the kill",
            alive=up.alive,
        )
        scheduler_metrics = up.metrics()["scheduler"]
        applied = "pilotfish_scheduler_cms_records_total"
        os.kill(pids["redis-server"], signal.SIGKILL)
        wait_until(
            lambda: "redis-server is back as pid" in up.stderr(), BACK_TIMEOUT, "Redis's restart", alive=up.alive
        )
        assert f"redis-server (pid {pids['redis-server']}) killed by SIGKILL; restarting it" in up.stderr()
        # the scheduler's CMS reader reconnects and applies records the llumlets write to the new Redis
        before = sample_value(scheduler_metrics, applied, result="applied")
        wait_until(
            lambda: (
                route_through_envoy(up.port) == "scheduler"
                and sample_value(scheduler_metrics, applied, result="applied") > before
            ),
            BACK_TIMEOUT,
            "the scheduler applying records from the restarted Redis",
            alive=up.alive,
        )
        assert up.proc.poll() is None


def test_a_sigkilled_up_leaves_no_child_behind(envoy_binary: Path, tmp_path: Path) -> None:
    with running_up(tmp_path) as up:
        assert len(up.pids()) == 4
        os.kill(up.proc.pid, signal.SIGKILL)  # no chance to stop its children: the kernel does
        assert up.proc.wait(60) == -signal.SIGKILL
        wait_until(lambda: processes_with(up.marker) == [], 30, "every child of a SIGKILLed pilotfish up to exit")
        wait_until(lambda: not port_answers(up.port), 30, "Envoy's listener to close")
