"""The llumlet advertises only KV-event publishers that vLLM binds: a scheduler can reach no other."""

from __future__ import annotations

import pytest

from pilotfish.vllm_plugin.core.kv_endpoint import subscribable_endpoint


@pytest.mark.parametrize(
    ("configured", "advertised"),
    [
        ("tcp://*:5557", "tcp://10.0.0.7:5557"),  # bound on every interface: reachable at the host
        ("ipc:///run/vllm/kv.sock", "ipc:///run/vllm/kv.sock"),
        ("tcp://collector:5557", ""),  # vLLM connects out to a collector: nothing to subscribe to
        ("tcp://127.0.0.1:5557", ""),
        ("tcp://*:0", ""),  # a port vLLM picks and never reports
        ("tcp://*:x", ""),
        ("", ""),
    ],
)
def test_subscribable_endpoint(configured: str, advertised: str) -> None:
    assert subscribable_endpoint(configured, "10.0.0.7") == advertised
