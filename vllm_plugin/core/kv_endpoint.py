"""Which of vLLM's KV-event publisher endpoints a scheduler can subscribe to.

vLLM's ZmqEventPublisher binds only wildcard (`tcp://*:PORT`) and `ipc://` endpoints; to any
other (`tcp://collector:5557`) it connects, pushing events to a collector that binds. A scheduler
subscribes by connecting, so only a bound publisher can be advertised in the CMS. `tcp://*:0`
binds a port vLLM picks and does not report, so it cannot be advertised either.
"""

from __future__ import annotations


def subscribable_endpoint(endpoint: str, host: str) -> str:
    """The endpoint to advertise for a publisher configured at `endpoint` on `host`; "" if none."""
    if endpoint.startswith("ipc://"):
        return endpoint
    if endpoint.startswith("tcp://*:"):
        port = endpoint.removeprefix("tcp://*:")
        if port.isdigit() and int(port) > 0:
            return f"tcp://{host}:{port}"
    return ""
