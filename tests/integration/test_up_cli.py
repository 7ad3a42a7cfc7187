"""`pilotfish up` as a user runs it: the demo, Ctrl-C, and bad input ending in one clear line.

Each run carries a unique marker in its environment, which every child inherits; afterwards
no process on the machine may still carry it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pilotfish.procs import free_port, port_answers, wait_until

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
        env=run_env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
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
    proc, marker = up("--demo", "--full", "--port", str(free_port()), "--demo-requests", "16",
                      "--log-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "routed by: scheduler 16" in proc.stdout
    assert (tmp_path / "redis" / "redis.log").exists()
    assert processes_with(marker) == []  # the Redis it started is stopped too


def test_sigint_stops_every_child(envoy_binary: Path, tmp_path: Path) -> None:
    port = free_port()
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, "-m", "pilotfish", "up", "--port", str(port), "--log-dir", str(tmp_path)],
        env={**os.environ, MARKER: marker}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_until(lambda: port_answers(port), 120, "pilotfish up's Envoy listener",
                   alive=lambda: None if proc.poll() is None else f"exited {proc.returncode}")
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
