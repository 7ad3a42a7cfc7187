"""InferencePool discovery (`k8s-pool:`) through the official kubernetes_asyncio client, against a stand-in API server.

No real API server installs here (see discovery/README.md), so, as `test_discovery_k8s.py` does for
EndpointSlices, an aiohttp server speaks the API server's wire format, here for two collections:
`/api/v1/namespaces/{ns}/pods` and `/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools`.
- a list is a `PodList` / `InferencePoolList` with `metadata.resourceVersion`, filtered by
  `labelSelector` (equality terms) and `fieldSelector` (`metadata.name=`);
- `watch=1` streams newline-delimited `{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}`
  replayed from the `resourceVersion` asked for, one revision counter for every collection as
  etcd keeps it; a BOOKMARK (only when `allowWatchBookmarks` is asked) carries the newest revision
  after each batch; a watch the server ends normally stands for `timeoutSeconds` running out;
- a version older than the last compaction gets a 410 `Expired` Status: as an ERROR event in an
  open stream, or as the HTTP status of a new watch request.
The objects are written by hand in the shape Kubernetes serialises them (Pod status conditions,
podIP/podIPs, deletionTimestamp; the InferencePool as its v1 CRD defines it), on loopback addresses.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pilotfish.cli import build_parser
from pilotfish.config import ConfigError, struct_from_args
from pilotfish.discovery import InstanceRemovedEvent, StoreUnavailable, open_discovery, open_registry
from pilotfish.discovery.backends.k8s_pool import InferencePoolDiscovery, PoolSpec, pod_instances, pool_spec
from pilotfish.discovery.config import DiscoveryConfig
from pilotfish.discovery.follow import follow
from pilotfish.discovery.testing import Watcher, wait_for
from pilotfish.procs import free_port

NS, COMP, KNS, POOL = "pilotfish", "engine", "inference", "vllm-pool"
PODS = f"/api/v1/namespaces/{KNS}/pods"
POOLS = f"/apis/inference.networking.k8s.io/v1/namespaces/{KNS}/inferencepools"


def pod(
    name: str,
    ip: str | None = "127.0.0.2",
    ready: bool | None = True,
    labels: dict[str, str] | None = None,
    deleting: bool = False,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Pod as the API server serialises it; ready=None: not yet probed (no Ready condition)."""
    conditions = [
        {"type": "PodReadyToStartContainers", "status": "True", "lastProbeTime": None,
         "lastTransitionTime": "2026-11-20T10:00:02Z"},
        {"type": "Initialized", "status": "True", "lastProbeTime": None, "lastTransitionTime": "2026-11-20T10:00:01Z"},
        {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": "2026-11-20T10:00:00Z"},
    ]  # fmt: skip
    if ready is not None:
        state = "True" if ready else "False"
        for kind in ("Ready", "ContainersReady"):
            condition = {"type": kind, "status": state, "lastProbeTime": None,
                         "lastTransitionTime": "2026-11-20T10:01:00Z"}  # fmt: skip
            if not ready:
                condition["reason"] = "ContainersNotReady"
                condition["message"] = "containers with unready status: [vllm]"
            conditions.append(condition)
    metadata: dict[str, Any] = {
        "name": name,
        "generateName": "vllm-7d9f8c6b5-",
        "namespace": KNS,
        "uid": f"uid-{name}",
        "resourceVersion": "0",
        "creationTimestamp": "2026-11-20T10:00:00Z",
        "labels": {"app": "vllm", "pod-template-hash": "7d9f8c6b5"} if labels is None else labels,
        "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "vllm-7d9f8c6b5", "uid": "uid-rs",
             "controller": True, "blockOwnerDeletion": True}
        ],
    }  # fmt: skip
    if annotations:
        metadata["annotations"] = annotations
    if deleting:
        metadata["deletionTimestamp"] = "2026-11-20T11:00:00Z"
        metadata["deletionGracePeriodSeconds"] = 30
    status: dict[str, Any] = {
        "phase": "Running" if ip else "Pending",
        "conditions": conditions,
        "hostIP": "10.0.0.1",
        "hostIPs": [{"ip": "10.0.0.1"}],
        "qosClass": "Burstable",
        "startTime": "2026-11-20T10:00:00Z",
    }
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": metadata,
        "spec": {
            "containers": [
                {"name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                 "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
                 "resources": {}, "terminationMessagePath": "/dev/termination-log",
                 "terminationMessagePolicy": "File", "imagePullPolicy": "IfNotPresent"}
            ],
            "restartPolicy": "Always",
            "nodeName": "node-1",
            "serviceAccountName": "default",
        },
        "status": status,
    }  # fmt: skip


def inference_pool(labels: dict[str, str] | None = None, ports: tuple[int, ...] = (8000,)) -> dict[str, Any]:
    """An InferencePool (inference.networking.k8s.io/v1) as the API server serialises it."""
    return {
        "kind": "InferencePool",
        "apiVersion": "inference.networking.k8s.io/v1",
        "metadata": {
            "name": POOL,
            "namespace": KNS,
            "uid": "uid-pool",
            "resourceVersion": "0",
            "generation": 1,
            "creationTimestamp": "2026-11-20T09:00:00Z",
        },
        "spec": {
            "selector": {"matchLabels": {"app": "vllm"} if labels is None else labels},
            "targetPorts": [{"number": p} for p in ports],
            "appProtocol": "http",
            "endpointPickerRef": {
                "group": "", "kind": "Service", "name": "pilotfish-epp", "port": {"number": 9002},
                "failureMode": "FailClose",
            },
        },
        "status": {"parents": []},
    }  # fmt: skip


def _gone(message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": "Expired", "code": 410}  # fmt: skip


class StandInApiServer:
    """List and watch of pods and InferencePools in the API server's wire format, with history and 410s."""

    LIST_KINDS = {PODS: ("PodList", "v1"), POOLS: ("InferencePoolList", "inference.networking.k8s.io/v1")}

    def __init__(self) -> None:
        self.revision = 100
        self.objects: dict[str, dict[str, dict[str, Any]]] = {PODS: {}, POOLS: {}}
        self.history: list[tuple[int, str, str, dict[str, Any]]] = []  # (revision, collection, type, object)
        self.oldest_watchable = 0
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.failing = False  # every request answers 503
        self.admit_watches = asyncio.Event()  # cleared: new watch requests wait (a client reconnecting)
        self.admit_watches.set()
        self.refused = 0  # watch requests answered with HTTP 410
        self.bookmarked: dict[str, int] = {}  # collection -> the newest bookmark written
        self._changed = asyncio.Condition()
        self._generation = 0  # bumped to end every open watch (normally, or with a 410)
        self._end_with_gone = False
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.closing = False

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._handle)
        app.router.add_get("/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        self.port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        assert self.runner is not None
        self.closing = True
        await self._notify()
        await self.runner.cleanup()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def apply(self, collection: str, kind: str, obj: dict[str, Any]) -> int:
        self.revision += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.revision)
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            self.objects[collection].pop(name, None)
        else:
            self.objects[collection][name] = obj
        self.history.append((self.revision, collection, kind, obj))
        await self._notify()
        return self.revision

    async def end_watches(self) -> None:
        """Every open watch ends normally, as when its timeoutSeconds runs out."""
        self._end_with_gone = False
        self._generation += 1
        await self._notify()

    async def expire_watches(self) -> None:
        """Compaction: every open watch gets a 410 ERROR, and resuming from before now fails."""
        self.oldest_watchable = self.revision
        self._end_with_gone = True
        self._generation += 1
        await self._notify()

    def lists(self, collection: str) -> list[dict[str, str]]:
        return [q for c, q in self.requests if c == collection and q.get("watch") not in ("true", "1", "True")]

    def watches(self, collection: str) -> list[dict[str, str]]:
        return [q for c, q in self.requests if c == collection and q.get("watch") in ("true", "1", "True")]

    @staticmethod
    def _selected(obj: dict[str, Any], labels: str, fields: str) -> bool:
        have = obj["metadata"].get("labels", {})
        if not all(have.get(k) == v for k, v in (t.split("=", 1) for t in labels.split(",") if t)):
            return False
        for term in (t for t in fields.split(",") if t):
            key, _, value = term.partition("=")
            assert key in ("metadata.name", "metadata.namespace"), f"field selector {key} not supported"
            if obj["metadata"].get(key.split(".", 1)[1]) != value:
                return False
        return True

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        collection = request.path
        self.requests.append((collection, dict(request.query)))
        if self.failing:
            return web.json_response(
                {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 503,
                 "reason": "ServiceUnavailable"},
                status=503,
            )  # fmt: skip
        labels, fields = request.query.get("labelSelector", ""), request.query.get("fieldSelector", "")
        if request.query.get("watch") in ("true", "1", "True"):
            since = int(request.query.get("resourceVersion") or self.revision)
            bookmarks = request.query.get("allowWatchBookmarks") in ("true", "1", "True")
            return await self._watch(request, collection, labels, fields, since, bookmarks)
        kind, api_version = self.LIST_KINDS[collection]
        items = []
        if request.match_info["ns"] == KNS:
            for obj in self.objects[collection].values():
                if self._selected(obj, labels, fields):
                    item = copy.deepcopy(obj)
                    del item["kind"], item["apiVersion"]  # list items carry neither
                    items.append(item)
        return web.json_response(
            {"kind": kind, "apiVersion": api_version, "metadata": {"resourceVersion": str(self.revision)},
             "items": items}
        )  # fmt: skip

    async def _watch(
        self, request: web.Request, collection: str, labels: str, fields: str, since: int, bookmarks: bool
    ) -> web.StreamResponse:
        await self.admit_watches.wait()
        if since < self.oldest_watchable:  # a new watch from a compacted version: HTTP 410
            self.refused += 1
            return web.json_response(_gone(f"too old resource version: {since} ({self.oldest_watchable})"), status=410)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)

        async def send(kind: str, obj: dict[str, Any]) -> None:
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        generation = self._generation
        sent = since
        kind_name, api_version = self.LIST_KINDS[collection][0].removesuffix("List"), self.LIST_KINDS[collection][1]
        while True:
            for revision, where, kind, obj in self.history:
                if revision > sent and where == collection and self._selected(obj, labels, fields):
                    await send(kind, obj)
            sent = self.revision
            if bookmarks:
                await send("BOOKMARK", {"kind": kind_name, "apiVersion": api_version,
                                        "metadata": {"resourceVersion": str(sent)}})  # fmt: skip
                self.bookmarked[collection] = max(sent, self.bookmarked.get(collection, 0))
            async with self._changed:
                await self._changed.wait()
            if self.closing or self.failing:
                return response
            if self._generation != generation:
                if self._end_with_gone:
                    await send("ERROR", _gone("too old resource version"))
                return response


@pytest.fixture
async def api() -> AsyncIterator[StandInApiServer]:
    server = StandInApiServer()
    await server.start()
    yield server
    await server.stop()


def pool_url(api: StandInApiServer) -> str:
    return f"k8s-pool://127.0.0.1:{api.port}/{KNS}/{POOL}?metadata_port=8090"


# ---- mapping: pool and pod objects to instances, as GIE pickers judge them -----------------------


@pytest.mark.parametrize(
    ("obj", "listed"),
    [
        (pod("p"), True),
        (pod("p", ready=False), False),
        (pod("p", ready=None), False),  # not yet probed: no Ready condition
        (pod("p", deleting=True), False),  # terminating: GIE drops it at once
        (pod("p", ip=None), False),  # scheduled, no IP yet
        (pod("p", labels={"app": "other"}), False),  # the pool does not select it
        (pod("p", labels={"app": "vllm", "extra": "x"}), True),  # matchLabels is a subset match
    ],
)
def test_pod_readiness_and_selection_map_to_listed(obj: dict[str, Any], listed: bool) -> None:
    spec = pool_spec(inference_pool())
    assert spec is not None
    assert bool(pod_instances(obj, spec, NS, COMP, 8090)) is listed


def test_pod_fields_become_instance_fields() -> None:
    spec = pool_spec(inference_pool())
    assert spec == PoolSpec(match_labels=(("app", "vllm"),), target_ports=(8000,))
    (inst,) = pod_instances(pod("vllm-0", ip="10.1.2.3"), spec, NS, COMP, 8090).values()
    assert (inst.instance_id, inst.host, inst.port, inst.namespace, inst.component, inst.address) == (
        "vllm-0", "10.1.2.3", 8000, NS, COMP, "10.1.2.3:8000"
    )  # fmt: skip
    assert inst.metadata_url == "http://10.1.2.3:8090/metadata"
    (v6,) = pod_instances(pod("vllm-1", ip="fd00::5"), spec, NS, COMP, 8090).values()
    assert v6.address == "[fd00::5]:8000" and v6.metadata_url == "http://[fd00::5]:8090/metadata"


def test_several_target_ports_are_ranks_and_active_ports_narrow_them() -> None:
    spec = pool_spec(inference_pool(ports=(8000, 8001)))
    assert spec is not None
    found = pod_instances(pod("vllm-0"), spec, NS, COMP, 8090)
    assert {k: v.port for k, v in found.items()} == {"vllm-0-rank-0": 8000, "vllm-0-rank-1": 8001}
    narrowed = pod("vllm-0", annotations={"inference.networking.k8s.io/active-ports": "8001, 9999"})
    assert {k: v.port for k, v in pod_instances(narrowed, spec, NS, COMP, 8090).items()} == {"vllm-0-rank-1": 8001}


@pytest.mark.parametrize(
    "spec",
    [
        {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]},
        {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": []},
        {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 0}]},
        {"targetPorts": [{"number": 8000}]},
    ],
)
def test_a_pool_without_a_selector_or_ports_selects_nothing(spec: dict[str, Any]) -> None:
    assert pool_spec({"metadata": {"name": POOL}, "spec": spec}) is None


# ---- URLs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "namespace", "name", "api_url"),
    [
        ("k8s-pool:vllm-pool", None, "vllm-pool", None),
        ("k8s-pool:inference/vllm-pool", "inference", "vllm-pool", None),
        ("k8s-pool://inference/vllm-pool", "inference", "vllm-pool", None),
        ("k8s-pool:vllm-pool?namespace=inference&kubeconfig=/k&context=c", "inference", "vllm-pool", None),
        ("k8s-pool://127.0.0.1:8001/inference/vllm-pool", "inference", "vllm-pool", "http://127.0.0.1:8001"),
    ],
)
def test_pool_urls(url: str, namespace: str | None, name: str, api_url: str | None) -> None:
    discovery = open_discovery(url)
    assert isinstance(discovery, InferencePoolDiscovery)
    ref = discovery._pool
    assert (ref.options.kube_namespace, ref.name, ref.options.api_url) == (namespace, name, api_url)


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("k8s-pool:", "names no InferencePool"),
        ("k8s-pool:a/b/c", "names no InferencePool"),
        ("k8s-pool:Not_A_Name", "not a Kubernetes name"),
        ("k8s-pool:a/p?namespace=b", "disagree"),
        ("k8s-pool:p?port_name=http", "unknown option"),
        ("k8s-pool:p?metadata_port=x", "metadata_port"),
    ],
)
def test_bad_pool_urls_name_the_problem(url: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        open_discovery(url)


def test_a_pool_is_read_only() -> None:
    with pytest.raises(ConfigError, match="read-only"):
        open_registry("k8s-pool:inference/vllm-pool")


def test_ext_proc_and_scheduler_take_a_pool_url() -> None:
    from pilotfish.ext_proc.config import ExtProcConfig
    from pilotfish.scheduler.config import SchedulerConfig

    parser = build_parser()
    url = "k8s-pool:inference/vllm-pool"
    ext = parser.parse_args(["ext-proc", "--discovery", url])
    assert struct_from_args(ExtProcConfig, ext, ext.config).discovery == url
    sched = parser.parse_args(["scheduler", "--discovery", url])
    assert struct_from_args(SchedulerConfig, sched, sched.config_path).discovery == url


# ---- against the stand-in API server ---------------------------------------------------------------


async def test_list_reads_the_pool_then_its_pods(api: StandInApiServer) -> None:
    discovery = open_discovery(pool_url(api))
    try:
        with pytest.raises(StoreUnavailable, match="not found"):  # no pool yet: a picker is not ready
            await discovery.list_instances(NS, COMP)
        await api.apply(POOLS, "ADDED", inference_pool())
        for obj in (pod("a", "127.0.0.2"), pod("b", "127.0.0.3", ready=False), pod("c", "127.0.0.4", deleting=True),
                    pod("d", None), pod("e", "127.0.0.5", labels={"app": "other"}), pod("f", "127.0.0.6")):  # fmt: skip
            await api.apply(PODS, "ADDED", obj)
        listed = await discovery.list_instances(NS, COMP)
        assert [(i.instance_id, i.address) for i in listed] == [("a", "127.0.0.2:8000"), ("f", "127.0.0.6:8000")]
    finally:
        await discovery.close()
    assert api.lists(POOLS)[-1]["fieldSelector"] == f"metadata.name={POOL}"
    assert api.lists(PODS)[-1]["labelSelector"] == "app=vllm"


async def test_watch_follows_pods_and_the_pool(api: StandInApiServer) -> None:
    await api.apply(POOLS, "ADDED", inference_pool())
    await api.apply(PODS, "ADDED", pod("a", "127.0.0.2"))
    await api.apply(PODS, "ADDED", pod("b", "127.0.0.3", ready=False))
    discovery = open_discovery(pool_url(api))
    watcher = Watcher(discovery, NS, COMP)
    try:
        await wait_for(lambda: watcher.ids() == {"a"}, "the ready pod")
        await api.apply(PODS, "MODIFIED", pod("b", "127.0.0.3"))
        await wait_for(lambda: watcher.ids() == {"a", "b"}, "b added once its Ready condition turns True")
        await api.apply(PODS, "MODIFIED", pod("a", "127.0.0.2", deleting=True))
        await wait_for(lambda: watcher.ids() == {"b"}, "a removed as soon as it is terminating")
        await api.apply(PODS, "DELETED", pod("a", "127.0.0.2", deleting=True))
        await api.apply(PODS, "ADDED", pod("c", None))
        await api.apply(PODS, "MODIFIED", pod("c", "127.0.0.4"))
        await api.apply(PODS, "ADDED", pod("x", "127.0.0.9", labels={"app": "other"}))
        await wait_for(lambda: watcher.ids() == {"b", "c"}, "c once it has an IP; a pod not selected ignored")
        assert watcher.instances["c"].address == "127.0.0.4:8000"

        # the pool's target ports change: every pod becomes one instance per rank
        await api.apply(POOLS, "MODIFIED", inference_pool(ports=(8000, 8001)))
        await wait_for(
            lambda: watcher.ids() == {"b-rank-0", "b-rank-1", "c-rank-0", "c-rank-1"}, "one instance per target port"
        )
        assert watcher.instances["c-rank-1"].address == "127.0.0.4:8001"

        # the pool's selector changes: the pod watch restarts with it
        await api.apply(POOLS, "MODIFIED", inference_pool(labels={"app": "other"}))
        await wait_for(lambda: watcher.ids() == {"x"}, "the pods of the new selector (one target port again)")
        assert api.watches(PODS)[-1]["labelSelector"] == "app=other"

        # the pool goes: nothing is routable; it comes back: its pods are
        await api.apply(POOLS, "DELETED", inference_pool(labels={"app": "other"}))
        await wait_for(lambda: watcher.ids() == set(), "no instances without the pool")
        await api.apply(POOLS, "ADDED", inference_pool())
        await wait_for(lambda: watcher.ids() == {"b", "c"}, "the pool back")
    finally:
        await watcher.close()
        await discovery.close()


async def test_watch_resumes_from_bookmarks_and_relists_on_410(api: StandInApiServer) -> None:
    await api.apply(POOLS, "ADDED", inference_pool())
    await api.apply(PODS, "ADDED", pod("a", "127.0.0.2"))
    discovery = open_discovery(pool_url(api))
    watcher = Watcher(discovery, NS, COMP)
    try:
        await wait_for(lambda: watcher.ids() == {"a"}, "the ready pod")
        await wait_for(lambda: len(api.watches(PODS)) == 1, "the pod watch")
        assert all(q.get("allowWatchBookmarks") in ("true", "True") for q in api.watches(PODS) + api.watches(POOLS))
        listed_at = api.watches(PODS)[0]["resourceVersion"]

        # Pool events move the revision; the pod watch sees them only as a bookmark. When the
        # server ends the watch (its timeoutSeconds), the client resumes from the bookmark, not
        # from its list, and does not list again.
        bumped = await api.apply(POOLS, "MODIFIED", inference_pool())
        await wait_for(lambda: api.bookmarked.get(PODS, 0) >= bumped, "a pod bookmark past the pool's change")
        await api.end_watches()  # the client reads what was written before the stream's end
        await wait_for(lambda: len(api.watches(PODS)) >= 2, "the pod watch resumed")
        resumed = api.watches(PODS)[1]["resourceVersion"]
        assert int(resumed) == bumped > int(listed_at), "resumed from the bookmark's resourceVersion"
        assert len(api.lists(PODS)) == 1 and len(api.lists(POOLS)) == 1, "a watch that ends is resumed, not relisted"

        # Compaction: the open watches get a 410 ERROR; the client lists again and catches up with
        # a change made meanwhile, then watches from the new list.
        await api.expire_watches()
        await api.apply(PODS, "ADDED", pod("b", "127.0.0.3"))
        await wait_for(lambda: watcher.ids() == {"a", "b"}, "relisted after 410")
        assert len(api.lists(PODS)) >= 2 and len(api.lists(POOLS)) >= 2

        # The watches end and, while the client reconnects, a change lands and the history is
        # compacted past the version it resumes from: HTTP 410 on the new watch, a relist again.
        lists_before, watches_before = len(api.lists(PODS)), len(api.watches(PODS))
        api.admit_watches.clear()
        await api.end_watches()
        await wait_for(lambda: len(api.watches(PODS)) > watches_before, "the client reconnecting")
        await api.apply(PODS, "DELETED", pod("a", "127.0.0.2"))
        api.oldest_watchable = api.revision
        api.admit_watches.set()
        await wait_for(lambda: watcher.ids() == {"b"}, "a removed after an HTTP 410 and a relist")
        assert api.refused >= 1 and len(api.lists(PODS)) > lists_before
        assert {e.instance.instance_id for e in watcher.events} == {"a", "b"}
    finally:
        await watcher.close()
        await discovery.close()


async def test_an_unreachable_api_server_keeps_the_view(api: StandInApiServer) -> None:
    await api.apply(POOLS, "ADDED", inference_pool())
    await api.apply(PODS, "ADDED", pod("a", "127.0.0.2"))
    discovery = InferencePoolDiscovery(open_discovery(pool_url(api))._pool, interval=0.05)
    watcher = Watcher(discovery, NS, COMP)
    try:
        await wait_for(lambda: watcher.ids() == {"a"}, "the ready pod")
        api.failing = True
        await api.end_watches()
        requests = len(api.requests)
        await wait_for(lambda: len(api.requests) >= requests + 4, "retries against the failing server")
        assert watcher.ids() == {"a"}, "the last view is kept while the API server fails"
        await api.apply(PODS, "ADDED", pod("b", "127.0.0.3"))
        api.failing = False
        await wait_for(lambda: watcher.ids() == {"a", "b"}, "caught up once the API server answers")
    finally:
        await watcher.close()
        await discovery.close()


async def test_follow_is_synced_only_once_the_pool_and_its_pods_are_read(api: StandInApiServer) -> None:
    """What `pilotfish ext-proc --discovery k8s-pool:...` and the scheduler run: ready after the first sync."""
    config = DiscoveryConfig(discovery=pool_url(api), discovery_interval_seconds=0.05)
    added: set[str] = set()
    synced = asyncio.Event()
    task = asyncio.create_task(follow(config, lambda i: added.add(i.instance_id), added.discard, synced.set))
    try:
        await wait_for(lambda: len(api.lists(POOLS)) >= 3, "the first listing retried")
        assert not synced.is_set(), "not synced while the pool does not exist"
        await api.apply(PODS, "ADDED", pod("a", "127.0.0.2"))
        await api.apply(POOLS, "ADDED", inference_pool())
        await asyncio.wait_for(synced.wait(), 30)
        assert added == {"a"}
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_ext_proc_turns_ready_after_the_pools_first_sync(api: StandInApiServer) -> None:
    """The gRPC health the manifests probe: liveness at once, readiness after the pool is read."""
    from pilotfish.ext_proc.config import ExtProcConfig
    from pilotfish.ext_proc.server import ExtProcServer

    serving = health_pb2.HealthCheckResponse.SERVING
    config = ExtProcConfig(
        port=free_port(), scheduler_address="", discovery=pool_url(api), discovery_interval_seconds=0.05
    )

    async def status(port: int, service: str) -> int:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
            return reply.status

    server = ExtProcServer(config)
    port = await server.start()
    try:
        assert await status(port, "liveness") == serving
        await wait_for(lambda: len(api.lists(POOLS)) >= 3, "the first listing retried")
        assert await status(port, "readiness") != serving
        await api.apply(POOLS, "ADDED", inference_pool())
        await api.apply(PODS, "ADDED", pod("a", "127.0.0.2"))
        for _ in range(600):
            if await status(port, "readiness") == serving:
                break
            await asyncio.sleep(0.05)
        assert await status(port, "readiness") == serving
    finally:
        await server.stop(0)


async def test_a_narrowed_selector_keeps_the_pods_it_still_selects(api: StandInApiServer) -> None:
    await api.apply(POOLS, "ADDED", inference_pool())
    await api.apply(PODS, "ADDED", pod("a", "127.0.0.2", labels={"app": "vllm", "tier": "gold"}))
    await api.apply(PODS, "ADDED", pod("b", "127.0.0.3"))
    discovery = open_discovery(pool_url(api))
    watcher = Watcher(discovery, NS, COMP)
    try:
        await wait_for(lambda: watcher.ids() == {"a", "b"}, "both pods")
        await api.apply(POOLS, "MODIFIED", inference_pool(labels={"app": "vllm", "tier": "gold"}))
        await wait_for(lambda: watcher.ids() == {"a"}, "only the pod the new selector matches")
        await wait_for(lambda: api.watches(PODS)[-1]["labelSelector"] == "app=vllm,tier=gold", "the new pod watch")
        removed = [e.instance.instance_id for e in watcher.events if isinstance(e, InstanceRemovedEvent)]
        assert removed == ["b"], "a stays through the restart of the pod watch: no remove-and-add"
    finally:
        await watcher.close()
        await discovery.close()
