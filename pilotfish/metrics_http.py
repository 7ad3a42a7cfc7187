"""Serve one Prometheus registry at /metrics on the service's own event loop (aiohttp)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from pilotfish.procs import StartError


async def serve_metrics(
    registry: CollectorRegistry, host: str, port: int, flag: str = "--metrics-port"
) -> web.AppRunner:
    """Start /metrics; a port in use fails with one line naming the flag."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_port=False).start()
    except OSError as exc:
        await runner.cleanup()
        raise StartError(f"cannot listen on {host}:{port} ({flag}): {exc.strerror or exc}") from None
    return runner
