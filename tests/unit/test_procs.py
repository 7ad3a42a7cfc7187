"""pilotfish.procs: port helpers, start-up failure reports, stop escalation and stop order."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from pilotfish.procs import (
    Child,
    ChildGroup,
    StartError,
    cpu_seconds,
    descendants,
    free_port,
    free_port_block,
    group_members,
    port_answers,
    port_is_free,
    stat_fields,
    thread_cpu_seconds,
    wait_until,
)

# Generous: these only bound a failure; a passing run returns as soon as the condition holds.
READY_TIMEOUT = 60.0

# Prints `ready <name>` once its SIGTERM handler is installed; on SIGTERM appends its name to
# argv[2] and exits, or (with argv[3] == "ignore") just notes the signal and keeps running.
_TRAP_TERM = """
import signal, sys, time
name, record, mode = sys.argv[1], sys.argv[2], sys.argv[3]
def on_term(signum, frame):
    with open(record, "a") as f:
        f.write(name + "\\n")
    print("got TERM", flush=True)
    if mode != "ignore":
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", name, flush=True)
while True:
    time.sleep(0.1)
"""


def _log_has(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text()


def _trapping_child(tmp_path: Path, name: str, mode: str = "exit") -> Child:
    log = tmp_path / f"{name}.log"
    argv = [sys.executable, "-c", _TRAP_TERM, name, str(tmp_path / "terms"), mode]
    child = Child(name, argv, log_path=log)
    wait_until(lambda: _log_has(log, f"ready {name}"), READY_TIMEOUT, name, alive=child.exited)
    return child


def test_port_helpers_follow_a_listening_socket() -> None:
    port = free_port()
    assert port_is_free(port)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        assert not port_is_free(port)
        assert port_answers(port)
    assert not port_answers(port)


def test_wait_until_reports_the_reason_a_thing_died() -> None:
    with pytest.raises(StartError, match="thing: it died"):
        wait_until(lambda: False, READY_TIMEOUT, "thing", alive=lambda: "it died")


def test_wait_until_times_out_naming_what() -> None:
    with pytest.raises(StartError, match="thing: not ready after"):
        wait_until(lambda: False, 0.2, "thing")


def test_wait_port_reports_an_early_exit_with_its_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "early.log"
    child = Child("early", [sys.executable, "-c", "print('cannot start: marker-42'); raise SystemExit(3)"],
                  log_path=log)  # fmt: skip
    with pytest.raises(StartError, match=r"early on 127\.0\.0\.1:\d+: exited with code 3 .*marker-42"):
        child.wait_port(free_port(), timeout=READY_TIMEOUT)
    child.stop()


def test_a_missing_executable_is_a_start_error(tmp_path: Path) -> None:
    with pytest.raises(StartError, match="cannot run"):
        Child("ghost", [str(tmp_path / "no-such-program")])


def test_stop_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    child = _trapping_child(tmp_path, "stubborn", mode="ignore")
    child.stop(grace=3.0)
    assert child.proc.returncode == -signal.SIGKILL
    assert (tmp_path / "terms").read_text() == "stubborn\n"  # SIGTERM came first


def test_stop_is_harmless_after_the_child_exited(tmp_path: Path) -> None:
    child = Child("quick", [sys.executable, "-c", "pass"])
    child.proc.wait(READY_TIMEOUT)
    child.stop()
    assert child.exited() == "exited with code 0"


def test_child_group_stops_in_reverse_order(tmp_path: Path) -> None:
    group = ChildGroup()
    for name in ("first", "second", "third"):
        log = tmp_path / f"{name}.log"
        argv = [sys.executable, "-c", _TRAP_TERM, name, str(tmp_path / "terms"), "exit"]
        child = group.start(name, argv, log_path=log)
        ready = f"ready {name}"
        wait_until(lambda log=log, ready=ready: _log_has(log, ready), READY_TIMEOUT, name, alive=child.exited)
    assert group.first_exited() is None
    children = list(group.children)
    group.stop_all()
    # Each stop() waits for its child's exit, so the order of the record is the stop order.
    assert (tmp_path / "terms").read_text().split() == ["third", "second", "first"]
    assert all(c.proc.returncode == 0 for c in children)
    assert group.children == []


def test_free_port_block_returns_consecutive_ports_that_bind() -> None:
    base = free_port_block(3)
    held = []
    try:
        for port in range(base, base + 3):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind(("127.0.0.1", port))
    finally:
        for s in held:
            s.close()


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice() -> None:
    # an outgoing connection takes its local port from the ephemeral range, so a port picked
    # there could be taken before the server binds it (a CI run saw exactly that)
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert all(port < low for port in ports)
    assert len(set(ports)) == len(ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[-1]))


# Starts a grandchild that leaves its tree (its parent exits) and prints its pid, then sleeps.
_DETACHING = """
import os, sys, time
if os.fork() == 0:
    if os.fork():
        os._exit(0)
    print(os.getpid(), flush=True)
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_group_members_finds_what_left_the_tree(tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    child = Child("detaching", [sys.executable, "-c", _DETACHING], log_path=log)
    orphan = 0
    try:
        wait_until(lambda: log.exists() and log.read_text().strip(), READY_TIMEOUT, "the grandchild's pid")
        orphan = int(log.read_text().split()[0])
        assert orphan not in descendants(child.pid)
        assert set(group_members(child.pid)) >= {child.pid, orphan}
        assert orphan not in group_members(os.getpgid(0))  # our own group: not theirs
    finally:
        if orphan:
            with contextlib.suppress(ProcessLookupError):
                os.kill(orphan, signal.SIGKILL)  # the grandchild we started, by PID
        child.stop()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_stat_fields_read_a_process_and_none_once_it_is_gone(tmp_path: Path) -> None:
    fields = stat_fields(os.getpid())
    assert fields is not None and int(fields[1]) == os.getppid() and int(fields[2]) == os.getpgid(0)
    assert cpu_seconds(os.getpid()) > 0
    child = Child("done", [sys.executable, "-c", "pass"], log_path=tmp_path / "done.log")
    child.proc.wait(timeout=READY_TIMEOUT)  # reaped: its pid names nothing now
    assert stat_fields(child.pid) is None and cpu_seconds(child.pid) == 0.0
    child.stop()


def test_exit_status_names_the_signal_that_killed_a_child(tmp_path: Path) -> None:
    child = _trapping_child(tmp_path, "victim")
    assert child.exit_status() is None and child.exited() is None
    os.kill(child.pid, signal.SIGKILL)
    child.proc.wait(READY_TIMEOUT)
    assert child.exit_status() == "killed by SIGKILL"
    assert child.exited() is not None and child.exited().startswith("killed by SIGKILL — last output: ready victim")
    child.stop()


def test_respawn_runs_the_same_command_with_the_same_log_in_its_place(tmp_path: Path) -> None:
    group = ChildGroup()
    names = ("first", "second", "third")
    for name in names:
        log = tmp_path / f"{name}.log"
        argv = [sys.executable, "-c", _TRAP_TERM, name, str(tmp_path / "terms"), "exit"]
        child = group.start(name, argv, log_path=log, cwd=tmp_path)
        wait_until(lambda log=log, n=name: _log_has(log, f"ready {n}"), READY_TIMEOUT, name, alive=child.exited)
    old = group.children[1]
    with pytest.raises(AssertionError, match="still running"):
        group.respawn(old)  # only a dead child is started again
    os.kill(old.pid, signal.SIGKILL)
    old.proc.wait(READY_TIMEOUT)
    new = group.respawn(old)
    assert new is group.children[1] and new.pid != old.pid
    assert (new.name, new.argv, new.cwd, new.log_path) == (old.name, old.argv, old.cwd, old.log_path)
    log = tmp_path / "second.log"
    wait_until(lambda: log.read_text().count("ready second") == 2, READY_TIMEOUT, "the respawned child")
    group.stop_all()
    assert (tmp_path / "terms").read_text().split() == ["third", "second", "first"]  # order kept


# Starts a sleeping Child (die_with_parent as argv[1] says), prints its pid, then sleeps itself.
_PARENT = """
import sys, time
from pilotfish.procs import Child
child = Child("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], die_with_parent=sys.argv[1] == "1")
print(child.pid, flush=True)
time.sleep(60)
"""


def _gone_or_zombie(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is None or fields[0] == "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("die_with_parent", [True, False])
def test_a_child_started_to_die_with_its_parent_goes_when_the_parent_is_killed(
    tmp_path: Path, die_with_parent: bool
) -> None:
    log = tmp_path / "parent.log"
    parent = Child("parent", [sys.executable, "-c", _PARENT, "1" if die_with_parent else "0"], log_path=log)
    grandchild = 0
    try:
        wait_until(
            lambda: log.exists() and log.read_text().strip(), READY_TIMEOUT, "the child's pid", alive=parent.exited
        )
        grandchild = int(log.read_text().split()[0])
        os.kill(parent.pid, signal.SIGKILL)
        parent.proc.wait(READY_TIMEOUT)
        if die_with_parent:
            wait_until(lambda: _gone_or_zombie(grandchild), READY_TIMEOUT, "the child of a killed parent to die")
        else:
            assert not _gone_or_zombie(grandchild)  # the default: it outlives its parent
    finally:
        if grandchild and not _gone_or_zombie(grandchild):
            os.kill(grandchild, signal.SIGKILL)  # the process this test started, by PID
        parent.stop()


def test_respawn_keeps_die_with_parent(tmp_path: Path) -> None:
    group = ChildGroup(die_with_parent=True)
    child = group.start("quick", [sys.executable, "-c", "pass"], log_path=tmp_path / "quick.log")
    assert child.die_with_parent
    child.proc.wait(READY_TIMEOUT)
    again = group.respawn(child)
    assert again.die_with_parent
    group.stop_all()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
def test_thread_cpu_seconds_counts_this_process_work_finer_than_ticks(tmp_path: Path) -> None:
    import time

    before, cpu_before = thread_cpu_seconds(os.getpid()), time.process_time()
    while time.process_time() - cpu_before < 0.05:  # CPU burnt, not wall time waited
        sum(range(1000))
    spent = time.process_time() - cpu_before
    # the same run time the kernel gives process_time, within a tick either way
    assert spent - 0.011 <= thread_cpu_seconds(os.getpid()) - before <= spent + 0.05
    child = Child("done", [sys.executable, "-c", "pass"], log_path=tmp_path / "done.log")
    child.proc.wait(timeout=READY_TIMEOUT)
    assert thread_cpu_seconds(child.pid) == 0.0
    child.stop()
