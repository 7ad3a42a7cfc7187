"""The scheduler's live page: the fleet, its load and the decisions, as they happen.

`pilotfish scheduler --ui-port N` (loopback unless `--ui-host` says otherwise; beyond loopback the
security rules of every listener apply) serves:

| path | what |
|---|---|
| `/` | the page: each engine's load metrics, in-flight requests, KV use, staleness and health; recent |
|  | decisions; migrations by policy; the policy in force. It polls `/api/state` every second. |
| `/api/state` | the same as JSON (`live_state`) |

Reading the state costs the Schedule path nothing: per-engine figures come from the live view when
the page asks, and the recent decisions from a bounded ring buffer the core appends one tuple to
per decision (scheduler/telemetry.py `Telemetry.recent`). Migrations are the rescheduler's counters
(`pilotfish_rescheduling_*_total`) by policy, not a log of each move.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from pilotfish.scheduler.telemetry import policy_metric_family
from pilotfish.scheduler.view.types import RequestInfo

if TYPE_CHECKING:
    from aiohttp import web

    from pilotfish.scheduler.core import SchedulerCore
    from pilotfish.security import Security

_SCRAPE_REQUEST = RequestInfo(request_id="", model="")
RECENT_SHOWN = 50


def live_state(core: SchedulerCore, recent: int = RECENT_SHOWN) -> dict[str, Any]:
    """What the page shows, as plain JSON types."""
    config = core.config
    wall = time.time()
    # perf_counter stamps of the ring buffer -> wall-clock seconds
    offset = wall - time.perf_counter()
    metrics = {m.name: m for p in core.policy.pipelines.values() for m in p.metrics}
    now = core.ctx.wall_clock()
    engines = []
    for inst in core.instances():
        status = inst.status
        age = core.cms.status_age(inst.instance_id, now) if core.cms is not None else None
        values = {}
        for name, metric in metrics.items():
            family, scale, _ = policy_metric_family(name)
            values[family.removeprefix("pilotfish_scheduler_policy_")] = metric.value(inst, _SCRAPE_REQUEST) * scale
        engines.append(
            {
                "engine": inst.instance_id,
                "address": inst.endpoint.address,
                "infer_type": inst.endpoint.infer_type.name.lower(),
                "models": sorted(inst.models),
                "dispatched": inst.lrs.num_dispatched,
                "held_requests": inst.lrs.num_requests,
                "held_tokens": inst.lrs.num_tokens,
                "inflight_unconfirmed": inst.inflight.requests,
                "running": status.num_running if status is not None else None,
                "waiting": status.num_waiting if status is not None else None,
                "kv_used_tokens": status.used_kv_tokens if status is not None else None,
                "kv_total_tokens": status.total_kv_tokens if status is not None else None,
                "kv_usage": (status.used_kv_tokens / status.total_kv_tokens)
                if status is not None and status.total_kv_tokens
                else None,
                "schedulable": status.schedulable if status is not None else True,
                "staleness_seconds": age,
                "ejected": core.health.is_ejected(inst.instance_id),
                "metrics": values,
            }
        )
    decisions = []
    for started, request_id, decision in list(core._telemetry.recent)[-recent:][::-1]:
        decisions.append(
            {
                "at": started + offset,
                "request_id": request_id,
                "engine": decision.target.instance_id,
                "decode_engine": decision.decode_target.instance_id if decision.decode_target is not None else None,
                "fallbacks": [e.instance_id for e in decision.fallbacks],
            }
        )
    return {
        "time": wall,
        "mode": "full" if core.full_mode else "lite",
        "policy": {
            "name": config.scheduling_policy,
            "metrics": sorted(metrics),
            "rescheduling": list(config.rescheduling_policies) if config.enable_rescheduling else [],
        },
        "decisions_total": int(core.registry.get_sample_value("pilotfish_scheduler_decision_seconds_count") or 0),
        "held_requests": core.account_size,
        "engines": engines,
        "recent_decisions": decisions,
        "migrations": _migrations(core),
    }


def _migrations(core: SchedulerCore) -> list[dict[str, Any]]:
    """The rescheduler's counters by policy (empty where no rescheduler runs on this core)."""
    by_policy: dict[str, dict[str, float]] = {}
    for family in core.registry.collect():
        if not family.name.startswith("pilotfish_rescheduling_") or family.name.endswith("cycles"):
            continue
        what = family.name.removeprefix("pilotfish_rescheduling_")
        for sample in family.samples:
            if sample.name.endswith("_total") and "policy" in sample.labels:
                row = by_policy.setdefault(sample.labels["policy"], {})
                row[what] = row.get(what, 0.0) + sample.value
    return [{"policy": p, **{k: int(v) for k, v in row.items()}} for p, row in sorted(by_policy.items())]


async def serve_ui(core: SchedulerCore, host: str, port: int, security: Security | None = None) -> web.AppRunner:
    """Start the page on host:port; a port in use fails with one line naming --ui-port. With the
    scheduler's security settings it is served as /metrics is: TLS from the same files, and with a
    token only to requests that carry it (a browser beyond loopback then needs a proxy that adds it);
    beyond loopback with neither, it refuses to start (pilotfish/security.py)."""
    from aiohttp import web

    from pilotfish.procs import StartError
    from pilotfish.scheduler.ui.page import PAGE

    if security is not None:
        security.check_listener(host, "--ui-host")

    async def page(_: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html", charset="utf-8")

    async def state(_: web.Request) -> web.Response:
        return web.json_response(live_state(core), headers={"Cache-Control": "no-store"})

    middlewares = [security.metrics_middleware("ui")] if security is not None and security.token else []
    app = web.Application(middlewares=middlewares)
    app.router.add_get("/", page)
    app.router.add_get("/api/state", state)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        ssl_context = security.server_ssl_context() if security is not None else None
        await web.TCPSite(runner, host, port, reuse_port=False, ssl_context=ssl_context).start()
    except OSError as exc:
        await runner.cleanup()
        raise StartError(f"cannot listen on {host}:{port} (--ui-port): {exc.strerror or exc}") from None
    return runner
