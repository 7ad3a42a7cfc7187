"""End-to-end fixtures: the lite stack through real Envoy."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pilotfish.procs import ChildGroup
from pilotfish.stack import Stack, StackSpec, start_stack

MODEL = "pilotfish-sim"


@pytest.fixture(scope="module")
def stack(envoy_binary: Path) -> Iterator[Stack]:
    """Two engines, scheduler and ext_proc (both with /metrics) and Envoy, shared by a module's tests."""
    group = ChildGroup()
    with tempfile.TemporaryDirectory(prefix="pilotfish-e2e-") as tmp:
        try:
            yield start_stack(
                StackSpec(engines=2, model=MODEL, scheduler_metrics=True, ext_proc_metrics=True), group, Path(tmp)
            )
        finally:
            group.stop_all()


StartStack = Callable[..., Stack]


@pytest.fixture
def make_stack(envoy_binary: Path) -> Iterator[StartStack]:
    """`make_stack(**StackSpec fields)`: a stack of the test's own, for tests that kill its parts."""
    group = ChildGroup()
    with tempfile.TemporaryDirectory(prefix="pilotfish-e2e-") as tmp:

        def start(**fields: object) -> Stack:
            return start_stack(StackSpec(**fields), group, Path(tmp))  # type: ignore[arg-type]

        try:
            yield start
        finally:
            group.stop_all()
