"""pilotfish.supervise: restart a dead child, give up on one that dies too often in the window.

The children are fakes with a settable exit status; the clock is injected, so the window is
exact and nothing sleeps.
"""

from __future__ import annotations

import itertools

import pytest

from pilotfish.supervise import GaveUp, SuperviseConfig, Supervisor

_pids = itertools.count(1000)


class FakeChild:
    def __init__(self, name: str, status_at_start: str | None = None) -> None:
        self.name = name
        self.pid = next(_pids)
        self.status = status_at_start
        self.stopped = False

    def exit_status(self) -> str | None:
        return self.status

    def exited(self) -> str | None:
        return None if self.status is None else f"{self.status} — last output: boom"

    def stop(self, grace: float = 5.0) -> None:
        self.stopped = True
        self.status = self.status or "killed by SIGTERM"


class Harness:
    """A supervisor over one fake child named `scheduler`, with a clock the test sets."""

    def __init__(self, max_restarts: int, window: float, *, ready: bool = True, dies_at_start: bool = False) -> None:
        self.now = 0.0
        self.lines: list[str] = []
        self.started: list[FakeChild] = []
        self.dies_at_start = dies_at_start
        self.supervisor = Supervisor(
            SuperviseConfig(max_restarts=max_restarts, restart_window_seconds=window),
            self.respawn,  # type: ignore[arg-type]
            start_timeout=0.2,
            clock=lambda: self.now,
            log=self.lines.append,
        )
        self.child = FakeChild("scheduler")
        self.other = FakeChild("ext_proc")
        self.supervisor.watch(self.child, lambda: ready)
        self.supervisor.watch(self.other, lambda: True)

    def respawn(self, old: FakeChild) -> FakeChild:
        assert old.status is not None, "only a dead child is respawned"
        self.child = FakeChild(old.name, "exited with code 3" if self.dies_at_start else None)
        self.started.append(self.child)
        return self.child

    def die(self, at: float, status: str = "killed by SIGKILL") -> None:
        self.now = at
        self.child.status = status
        self.supervisor.check()


def test_a_dead_child_is_restarted_and_the_line_names_it_its_status_and_the_count() -> None:
    h = Harness(max_restarts=3, window=60)
    first = h.child.pid
    h.die(at=5.0)
    assert len(h.started) == 1 and h.supervisor.pids()["scheduler"] == h.child.pid != first
    assert h.lines == [
        f"scheduler (pid {first}) killed by SIGKILL; restarting it (restart 1; 1 of 3 allowed within 60s)",
        f"scheduler is back as pid {h.child.pid}",
    ]
    assert h.supervisor.restarts("scheduler") == 1 and h.supervisor.restarts("ext_proc") == 0
    h.supervisor.check()  # alive: nothing more happens
    assert len(h.started) == 1 and len(h.lines) == 2


# (max_restarts, window seconds, times the child dies, what each death leads to)
GIVE_UP_RULE = [
    (2, 10.0, [0, 1, 2], ["restart", "restart", "give up"]),
    (2, 10.0, [0, 5, 11, 12], ["restart", "restart", "restart", "give up"]),  # t=0 has left the window by 11
    (1, 10.0, [0, 10, 20, 30], ["restart"] * 4),  # a restart exactly one window ago no longer counts
    (1, 10.0, [0, 9.5], ["restart", "give up"]),
    (0, 10.0, [0], ["give up"]),  # 0: never restart
    (5, 60.0, [0, 1, 2, 3, 4, 5], ["restart"] * 5 + ["give up"]),  # the defaults' shape: K restarts, then stop
]


@pytest.mark.parametrize(("max_restarts", "window", "deaths", "outcomes"), GIVE_UP_RULE)
def test_give_up_rule(max_restarts: int, window: float, deaths: list[float], outcomes: list[str]) -> None:
    h = Harness(max_restarts, window)
    for at, outcome in zip(deaths, outcomes, strict=True):
        if outcome == "restart":
            h.die(at)
            assert h.child.status is None, f"death at t={at} should have been restarted"
        else:
            with pytest.raises(GaveUp) as caught:
                h.die(at)
            message = str(caught.value)
            assert message.startswith(f"scheduler (pid {h.child.pid}) died again after")
            assert f"within {window:g}s (--max-restarts {max_restarts})" in message
            assert message.endswith("killed by SIGKILL — last output: boom")
    assert len(h.started) == outcomes.count("restart")


def test_a_child_that_dies_while_restarting_counts_as_another_death() -> None:
    h = Harness(max_restarts=2, window=60, ready=False, dies_at_start=True)
    h.die(at=0)  # restart 1: the new one exits before it is ready
    assert h.lines[-1].startswith("scheduler did not come back: scheduler (pid ")
    assert "exited with code 3" in h.lines[-1]
    h.now = 1
    h.supervisor.check()  # restart 2, which dies too
    h.now = 2
    with pytest.raises(GaveUp, match=r"after 2 restarts .*exited with code 3"):
        h.supervisor.check()


def test_a_restarted_child_that_never_answers_is_stopped_and_counted() -> None:
    h = Harness(max_restarts=1, window=60, ready=False)
    h.die(at=0)
    hung = h.child
    assert hung.stopped and hung.status == "killed by SIGTERM"
    assert "not ready after" in h.lines[-1]
    with pytest.raises(GaveUp):
        h.supervisor.check()  # the stopped one is a death over the budget


def test_defaults_live_in_one_struct() -> None:
    config = SuperviseConfig()
    assert (config.max_restarts, config.restart_window_seconds) == (5, 60.0)
