"""Serve one Prometheus registry at /metrics on the service's own event loop (aiohttp).

With the component's security settings (pilotfish/security.py) it serves TLS from the same files
as its other listeners (reloaded when they change) and, with a token, answers only requests with
`Authorization: Bearer <token>` (401 otherwise, counted in pilotfish_auth_refused_total).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from pilotfish.procs import StartError

if TYPE_CHECKING:
    from pilotfish.security import Security


def register_counts(
    registry: CollectorRegistry,
    name: str,
    documentation: str,
    labels: list[str],
    counts: Callable[[], Mapping[tuple[str, ...], int]],
) -> None:
    """A counter family read from `counts()` at each scrape, its keys the label values in `labels`'
    order: for counts kept in a plain Counter where they happen (a per-event prometheus Counter would
    cost the hot path more)."""
    from prometheus_client.core import CounterMetricFamily

    class _Collector:
        def collect(self) -> Iterator[Any]:
            family = CounterMetricFamily(name, documentation, labels=labels)
            for values, n in sorted(counts().items()):
                family.add_metric(list(values), n)
            yield family

    registry.register(_Collector())


async def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    flag: str = "--metrics-port",
    *,
    security: Security | None = None,
) -> web.AppRunner:
    """Start /metrics; a port in use fails with one line naming the flag."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    middlewares = [security.metrics_middleware()] if security is not None and security.token else []
    app = web.Application(middlewares=middlewares)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    ssl_context = security.server_ssl_context() if security is not None else None
    try:
        await web.TCPSite(runner, host, port, reuse_port=False, ssl_context=ssl_context).start()
    except OSError as exc:
        await runner.cleanup()
        raise StartError(f"cannot listen on {host}:{port} ({flag}): {exc.strerror or exc}") from None
    return runner
