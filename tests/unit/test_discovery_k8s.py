"""Kubernetes discovery through the official kubernetes_asyncio client, against a stand-in API server.

No real API server installs from the registries this project uses (Debian has kubectl only; PyPI
and npm ship no kube-apiserver), so an aiohttp server here speaks the API server's wire format for
`/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices`: an EndpointSliceList with
`metadata.resourceVersion` for a list, and for `watch=1` newline-delimited
`{"type": "ADDED"|"MODIFIED"|"DELETED"|"BOOKMARK"|"ERROR", "object": {...}}` events, replayed from
the `resourceVersion` asked for, with a 410 Expired `Status` when that version is too old. The
objects are written as Kubernetes serialises them (see SLICE below), addresses on loopback.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from pilotfish.discovery import MetadataUnavailable, open_discovery, open_registry
from pilotfish.discovery.backends.k8s import K8sDiscovery, K8sOptions, slice_instances
from pilotfish.discovery.backends.k8s_registry import K8sRegistry
from pilotfish.discovery.testing import Watcher, wait_for
from pilotfish.procs import free_port
from pilotfish.services import http_call

NS, COMP, KNS = "pilotfish", "engine", "inference"


def endpoint(pod: str, address: str, ready: bool | None = True) -> dict[str, Any]:
    conditions: dict[str, Any] = {"serving": ready is not False, "terminating": False}
    if ready is not None:
        conditions["ready"] = ready
    return {
        "addresses": [address],
        "conditions": conditions,
        "targetRef": {"kind": "Pod", "namespace": KNS, "name": pod, "uid": f"uid-{pod}"},
        "nodeName": "node-1",
        "zone": "zone-a",
    }


def endpoint_slice(name: str, endpoints: list[dict[str, Any]], component: str = COMP, metadata_port: int = 8090):
    """An EndpointSlice as the API server serialises it (the controller copies the Service's labels)."""
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {
            "name": name,
            "generateName": f"vllm-{component}-",
            "namespace": KNS,
            "uid": f"uid-{name}",
            "resourceVersion": "0",
            "generation": 1,
            "creationTimestamp": "2026-11-20T10:00:00Z",
            "labels": {
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                "kubernetes.io/service-name": f"vllm-{component}",
                "pilotfish.io/namespace": NS,
                "pilotfish.io/component": component,
            },
            "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-11-20T10:00:00Z"},
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "name": f"vllm-{component}",
                    "uid": "uid-svc",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [
            {"name": "http", "protocol": "TCP", "port": 8000},
            {"name": "metadata", "protocol": "TCP", "port": metadata_port},
        ],
    }


class StandInApiServer:
    """EndpointSlice list and watch in the API server's wire format, with history and 410s."""

    def __init__(self) -> None:
        self.revision = 100
        self.slices: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.oldest_watchable = 0
        self.requests: list[dict[str, str]] = []
        self._changed = asyncio.Condition()
        self._expire = 0  # bumped to end every open watch with a 410
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.closing = False

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        self.port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        assert self.runner is not None
        self.closing = True  # open watches return, so cleanup does not wait on them
        async with self._changed:
            self._changed.notify_all()
        await self.runner.cleanup()

    async def apply(self, kind: str, obj: dict[str, Any]) -> None:
        self.revision += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.revision)
        if kind == "DELETED":
            self.slices.pop(obj["metadata"]["name"], None)
        else:
            self.slices[obj["metadata"]["name"]] = obj
        self.history.append((self.revision, kind, obj))
        async with self._changed:
            self._changed.notify_all()

    async def expire_watches(self) -> None:
        """Compaction: every open watch gets 410 Gone, and resuming from before now fails."""
        self.oldest_watchable = self.revision
        self._expire += 1
        async with self._changed:
            self._changed.notify_all()

    @staticmethod
    def _selected(obj: dict[str, Any], selector: str) -> bool:
        labels = obj["metadata"].get("labels", {})
        pairs = [term.split("=", 1) for term in selector.split(",") if term]
        return all(labels.get(k) == v for k, v in pairs)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(dict(request.query))
        if request.match_info["ns"] != KNS:
            return web.json_response(
                {
                    "kind": "EndpointSliceList",
                    "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": str(self.revision)},
                    "items": [],
                }
            )
        selector = request.query.get("labelSelector", "")
        if request.query.get("watch") not in ("true", "1", "True"):
            items = []
            for obj in self.slices.values():
                if self._selected(obj, selector):
                    item = copy.deepcopy(obj)
                    del item["kind"], item["apiVersion"]  # list items carry neither
                    items.append(item)
            return web.json_response(
                {
                    "kind": "EndpointSliceList",
                    "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": str(self.revision)},
                    "items": items,
                }
            )
        return await self._watch(request, selector, int(request.query.get("resourceVersion") or self.revision))

    async def _watch(self, request: web.Request, selector: str, since: int) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)

        async def send(kind: str, obj: dict[str, Any]) -> None:
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        if since < self.oldest_watchable:
            await send(
                "ERROR",
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Failure",
                    "message": f"too old resource version: {since} ({self.oldest_watchable})",
                    "reason": "Expired",
                    "code": 410,
                },
            )
            return response
        expire = self._expire
        sent = since
        while True:
            for revision, kind, obj in self.history:
                if revision > sent:
                    sent = revision
                    if self._selected(obj, selector):
                        await send(kind, obj)
            await send(
                "BOOKMARK",
                {
                    "kind": "EndpointSlice",
                    "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": str(sent)},
                },
            )
            async with self._changed:
                await self._changed.wait()
            if self.closing:
                return response
            if self._expire != expire:
                await send(
                    "ERROR",
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Failure",
                        "message": "too old resource version",
                        "reason": "Expired",
                        "code": 410,
                    },
                )
                return response


@pytest.fixture
async def api() -> AsyncIterator[StandInApiServer]:
    server = StandInApiServer()
    await server.start()
    yield server
    await server.stop()


def k8s_url(api: StandInApiServer) -> str:
    return f"k8s://127.0.0.1:{api.port}?namespace={KNS}"


@pytest.mark.parametrize(
    ("conditions_ready", "listed"),
    [(True, True), (None, True), (False, False)],  # unset means ready, as Kubernetes documents
)
def test_endpoint_readiness_maps_to_listed(conditions_ready: bool | None, listed: bool) -> None:
    obj = endpoint_slice("s", [endpoint("pod-a", "127.0.0.2", conditions_ready)])
    found = slice_instances(obj, NS, COMP, K8sOptions())
    assert ("pod-a" in found) is listed


def test_slice_fields_become_instance_fields() -> None:
    obj = endpoint_slice("s", [endpoint("pod-a", "127.0.0.2"), {"addresses": ["127.0.0.9"], "conditions": {}}])
    found = slice_instances(obj, NS, COMP, K8sOptions())
    assert list(found) == ["pod-a"]  # an endpoint without a pod reference has no instance id: skipped
    inst = found["pod-a"]
    assert (inst.instance_id, inst.host, inst.port, inst.namespace, inst.component) == (
        "pod-a",
        "127.0.0.2",
        8000,
        NS,
        COMP,
    )
    assert inst.metadata_url == "http://127.0.0.2:8090/metadata"
    no_meta_port = endpoint_slice("s", [endpoint("pod-a", "127.0.0.2")])
    no_meta_port["ports"] = [{"name": "http", "protocol": "TCP", "port": 8000}]
    assert slice_instances(no_meta_port, NS, COMP, K8sOptions(metadata_port=9999))["pod-a"].metadata_url.endswith(
        ":9999/metadata"
    )


async def test_list_selects_by_labels_and_readiness(api: StandInApiServer) -> None:
    await api.apply(
        "ADDED",
        endpoint_slice("engine-1", [endpoint("pod-a", "127.0.0.2"), endpoint("pod-b", "127.0.0.3", ready=False)]),
    )
    await api.apply("ADDED", endpoint_slice("engine-2", [endpoint("pod-c", "127.0.0.4", ready=None)]))
    await api.apply("ADDED", endpoint_slice("prefill-1", [endpoint("pod-p", "127.0.0.5")], component="prefill"))
    discovery = open_discovery(k8s_url(api))
    assert isinstance(discovery, K8sDiscovery)
    try:
        assert [i.instance_id for i in await discovery.list_instances(NS, COMP)] == ["pod-a", "pod-c"]
        assert [i.instance_id for i in await discovery.list_instances(NS, "prefill")] == ["pod-p"]
    finally:
        await discovery.close()
    assert api.requests[0]["labelSelector"] == "pilotfish.io/namespace=pilotfish,pilotfish.io/component=engine"


async def test_watch_maps_endpoint_slice_events(api: StandInApiServer) -> None:
    first = endpoint_slice("engine-1", [endpoint("pod-a", "127.0.0.2"), endpoint("pod-b", "127.0.0.3", ready=False)])
    await api.apply("ADDED", first)
    discovery = open_discovery(k8s_url(api))
    watcher = Watcher(discovery, NS, COMP)
    try:
        await wait_for(lambda: watcher.ids() == {"pod-a"}, "initial ready pod")

        both = endpoint_slice("engine-1", [endpoint("pod-a", "127.0.0.2"), endpoint("pod-b", "127.0.0.3")])
        await api.apply("MODIFIED", both)  # pod-b turns ready: Added
        await wait_for(lambda: watcher.ids() == {"pod-a", "pod-b"}, "pod-b added when ready")

        a_down = endpoint_slice("engine-1", [endpoint("pod-a", "127.0.0.2", False), endpoint("pod-b", "127.0.0.3")])
        await api.apply("MODIFIED", a_down)  # pod-a turns not ready: Removed
        await wait_for(lambda: watcher.ids() == {"pod-b"}, "pod-a removed when not ready")

        await api.apply("ADDED", endpoint_slice("engine-2", [endpoint("pod-c", "127.0.0.4")]))
        await api.apply("ADDED", endpoint_slice("prefill-1", [endpoint("pod-p", "127.0.0.5")], component="prefill"))
        await wait_for(lambda: watcher.ids() == {"pod-b", "pod-c"}, "a second slice; another component ignored")

        await api.apply("DELETED", a_down)  # the slice goes: its endpoints are Removed
        await wait_for(lambda: watcher.ids() == {"pod-c"}, "endpoints of a deleted slice removed")

        # Compaction: the watch gets 410 Gone and cannot resume; the client lists again and
        # catches up with a change made meanwhile.
        await api.expire_watches()
        await api.apply(
            "MODIFIED", endpoint_slice("engine-2", [endpoint("pod-c", "127.0.0.4"), endpoint("pod-d", "127.0.0.6")])
        )
        await wait_for(lambda: watcher.ids() == {"pod-c", "pod-d"}, "relisted after 410")
        lists = [r for r in api.requests if r.get("watch") not in ("true", "1", "True")]
        assert len(lists) >= 2, "expected a relist after the 410"
        assert {e.instance.instance_id for e in watcher.events} == {"pod-a", "pod-b", "pod-c", "pod-d"}
    finally:
        await watcher.close()
        await discovery.close()


async def test_registry_serves_metadata_and_readiness_to_discovery(api: StandInApiServer) -> None:
    registry = open_registry("k8s:?metadata_port=0")
    assert isinstance(registry, K8sRegistry)
    handle = await registry.register_instance(NS, COMP, instance_id="pod-a")
    base = f"http://127.0.0.1:{registry.metadata_port}"
    try:
        assert handle.instance_id() == "pod-a"
        assert (await asyncio.to_thread(http_call, base + "/ready"))[0] == 503  # the readiness probe
        await handle.set_metadata({"model": {"name": "Qwen3-32B", "max_num_seqs": 256}})
        await handle.set_ready("ready")
        assert (await asyncio.to_thread(http_call, base + "/ready"))[0] == 200

        # Kubernetes would now mark the endpoint ready; the stand-in does what it would.
        served = endpoint_slice("engine-1", [endpoint("pod-a", "127.0.0.1")], metadata_port=registry.metadata_port)
        await api.apply("ADDED", served)
        discovery = open_discovery(k8s_url(api))
        try:
            [instance] = await discovery.list_instances(NS, COMP)
            assert await instance.metadata() == {"model": {"name": "Qwen3-32B", "max_num_seqs": 256}}
        finally:
            await discovery.close()

        await handle.set_ready("not_ready")
        assert (await asyncio.to_thread(http_call, base + "/ready"))[0] == 503
    finally:
        await registry.close()
    with pytest.raises(MetadataUnavailable):
        await instance.metadata(timeout=2)
