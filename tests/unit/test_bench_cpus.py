"""--vllm-cpus: vLLM on its own CPUs, the client (and what it starts besides vLLM) on the rest."""

from __future__ import annotations

import pytest

from pilotfish.bench import cpus


@pytest.fixture
def four_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})


@pytest.mark.usefixtures("four_cpus")
@pytest.mark.parametrize(
    ("spec", "split"),
    [("auto", ({0}, {1, 2, 3})), ("none", (None, None)), ("2,3", ({2, 3}, {0, 1})), ("1", ({1}, {0, 2, 3}))],
)
def test_split(spec: str, split: tuple[set[int] | None, set[int] | None]) -> None:
    assert cpus.split_cpus(spec) == split


@pytest.mark.usefixtures("four_cpus")
@pytest.mark.parametrize("spec", ["0,1,2,3", "7", "x"])
def test_a_split_that_leaves_nothing_or_names_strangers_is_refused(spec: str) -> None:
    with pytest.raises(SystemExit, match="--vllm-cpus"):
        cpus.split_cpus(spec)


def test_one_cpu_is_not_split(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: {5})
    assert cpus.split_cpus("auto") == (None, None)
