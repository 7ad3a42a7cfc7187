"""`k8s-pool:` — the engines of a Gateway API Inference Extension InferencePool, found as GIE pickers find them.

The pool (`inference.networking.k8s.io/v1`, in its namespace) names its engines by a pod selector
(`spec.selector.matchLabels`) and the ports they serve on (`spec.targetPorts`). An instance is one
target port of a pod that the selector matches and that is ready: no `deletionTimestamp`, condition
`Ready` is `"True"`, and `status.podIP` set. Its id is the pod's name when the pool has one target
port, `<pod>-rank-<i>` (the i-th target port) when it has several; a pod annotated
`inference.networking.k8s.io/active-ports: "8000,8001"` serves only the target ports it lists.
The (namespace, component) a caller asks for are stamped on the instances; the pool alone decides
which they are. `Instance.metadata()` GETs `http://<pod IP>:<metadata_port>/metadata`.

Two list-and-watch loops, as informers run them: one on the pool (`fieldSelector=metadata.name=`),
one on the pods its selector matches. Each lists, watches from the list's resourceVersion with
bookmarks, and resumes a watch that ends from the last resourceVersion it saw (a bookmark's
included); 410 Gone, or any error, lists again. While the API server is unreachable the view is
kept. A change of the pool's selector restarts the pod loop with the new selector; a deleted
pool removes every instance until it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from pilotfish.config import ConfigError
from pilotfish.discovery.api import InstanceEvent, ServiceDiscovery, StoreUnavailable
from pilotfish.discovery.backends.k8s import K8sOptions, api_client, read_list
from pilotfish.discovery.static import Instance
from pilotfish.discovery.view import Emit, View, event_stream

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
ACTIVE_PORTS_ANNOTATION = "inference.networking.k8s.io/active-ports"
MAX_EVENT_BYTES = 8 << 20  # one watch event (a pod with its managedFields is tens of KiB)
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")  # DNS subdomain (an object name)
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # DNS label


def check_name(value: str, what: str) -> str:
    pattern = _NAMESPACE if what == "namespace" else _NAME
    if not pattern.match(value):
        raise ConfigError(f"--discovery k8s-pool: {what} {value!r} is not a Kubernetes name")
    return value


@dataclass(frozen=True)
class PoolRef:
    name: str
    options: K8sOptions  # api_url, kube_namespace (the pool's), kubeconfig, context, metadata_port


@dataclass(frozen=True)
class PoolSpec:
    """What of a pool decides its instances."""

    match_labels: tuple[tuple[str, str], ...]
    target_ports: tuple[int, ...]

    @property
    def label_selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.match_labels)

    def selects(self, labels: Mapping[str, Any]) -> bool:
        return all(labels.get(k) == v for k, v in self.match_labels)


def pool_spec(obj: Mapping[str, Any] | None) -> PoolSpec | None:
    """The selector and target ports of an InferencePool (wire-format dict); None when it has none usable."""
    if not isinstance(obj, Mapping):
        return None
    spec = obj.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    ports = [p.get("number") for p in spec.get("targetPorts") or [] if isinstance(p, dict)]
    if not isinstance(labels, dict) or not labels or not all(isinstance(v, str) for v in labels.values()):
        return None
    ports = [p for p in ports if isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536]
    if not ports:
        return None
    return PoolSpec(tuple(sorted(labels.items())), tuple(dict.fromkeys(ports)))


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """As GIE's pickers judge a pod: not being deleted, and its Ready condition "True"."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if isinstance(condition, dict) and condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def _active_ports(pod: Mapping[str, Any], target_ports: tuple[int, ...]) -> set[int]:
    text = ((pod.get("metadata") or {}).get("annotations") or {}).get(ACTIVE_PORTS_ANNOTATION)
    if not isinstance(text, str):
        return set(target_ports)
    listed = {int(p) for p in (s.strip() for s in text.split(",")) if p.isdigit()}
    return listed & set(target_ports)


def pod_instances(
    pod: Mapping[str, Any], spec: PoolSpec, namespace: str, component: str, metadata_port: int
) -> dict[str, Instance]:
    """The instances one pod (wire-format dict) contributes to a pool, by id."""
    metadata = pod.get("metadata") or {}
    name, labels = metadata.get("name"), metadata.get("labels") or {}
    host = (pod.get("status") or {}).get("podIP")
    if not isinstance(name, str) or not name or not isinstance(host, str) or not host:
        return {}
    if not isinstance(labels, dict) or not spec.selects(labels) or not pod_ready(pod):
        return {}
    shown = f"[{host}]" if ":" in host else host
    active = _active_ports(pod, spec.target_ports)
    found: dict[str, Instance] = {}
    for rank, port in enumerate(spec.target_ports):
        if port not in active:
            continue
        instance_id = name if len(spec.target_ports) == 1 else f"{name}-rank-{rank}"
        found[instance_id] = Instance(
            instance_id, host, port, namespace, component, metadata_url=f"http://{shown}:{metadata_port}/metadata"
        )
    return found


def pool_instances(
    spec: PoolSpec | None, pods: Mapping[str, Mapping[str, Any]], namespace: str, component: str, metadata_port: int
) -> dict[str, Instance]:
    found: dict[str, Instance] = {}
    if spec is None:
        return found
    for name in sorted(pods):
        found.update(pod_instances(pods[name], spec, namespace, component, metadata_port))
    return found


class _Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


Call = Callable[..., Awaitable[Any]]  # a kubernetes_asyncio list_* method with its path arguments bound


async def _read_events(response: Any) -> AsyncIterator[dict[str, Any]]:
    """Newline-delimited watch events, each bounded in size."""
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while (end := buffer.find(b"\n")) >= 0:
            line, buffer = buffer[:end], buffer[end + 1 :]
            if line.strip():
                event = json.loads(line)
                if isinstance(event, dict):
                    yield event
        if len(buffer) > MAX_EVENT_BYTES:
            raise StoreUnavailable(f"kubernetes: a watch event over {MAX_EVENT_BYTES} bytes")


class _Reflector:
    """Keeps `store` (name -> object) equal to one collection: list, then watch with bookmarks."""

    def __init__(self, call: Call, what: str, options: K8sOptions, interval: float, **selectors: str) -> None:
        self.call, self.what, self.options, self.interval = call, what, options, interval
        self.selectors = selectors  # label_selector= / field_selector=
        self.store: dict[str, dict[str, Any]] = {}
        self.lists = 0

    async def list(self) -> str:
        """Replace the store with a fresh listing; returns its resourceVersion."""
        call = self.call(**self.selectors, _preload_content=False, _request_timeout=10)
        version, items = await read_list(call, self.what)
        self.store = {n: o for o in items if isinstance(o, dict) and (n := _name(o))}
        self.lists += 1
        return version

    async def watch_once(self, version: str, changed: Callable[[], None]) -> str:
        """Apply one watch stream to the store; returns the last resourceVersion seen."""
        response = await self.call(
            **self.selectors,
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.options.watch_timeout_seconds,
            _preload_content=False,
            _request_timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=None),
        )
        async with response:
            if response.status == 410:
                raise _Gone()
            if response.status != 200:
                raise StoreUnavailable(f"kubernetes: watching {self.what}: HTTP {response.status}")
            async for event in _read_events(response):
                kind, obj = event.get("type"), event.get("object") or {}
                if not isinstance(obj, dict):
                    continue
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone()
                    raise StoreUnavailable(f"kubernetes: watching {self.what}: {obj.get('message')}")
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind == "BOOKMARK" or not (name := _name(obj)):
                    continue
                if kind == "DELETED":
                    self.store.pop(name, None)
                elif kind in ("ADDED", "MODIFIED"):
                    self.store[name] = obj
                else:
                    continue
                changed()
        return version

    async def run(self, changed: Callable[[], None]) -> None:
        """Forever: list (calling `changed`), watch and resume; relist on 410 Gone or an error."""
        failing = False
        while True:
            try:
                version = await self.list()
                changed()
                if failing:
                    log.info("kubernetes: %s readable again", self.what)
                    failing = False
                while True:  # a watch the server ends (timeoutSeconds) resumes where it stopped
                    version = await self.watch_once(version, changed)
            except _Gone:
                continue
            except (TimeoutError, StoreUnavailable, aiohttp.ClientError, OSError, ValueError) as exc:
                if not failing:
                    log.warning("kubernetes: %s unreadable, keeping the last view: %s", self.what, exc)
                failing = True
                await asyncio.sleep(self.interval)


class InferencePoolDiscovery(ServiceDiscovery):
    def __init__(self, pool: PoolRef, *, interval: float = 1.0) -> None:
        self._pool = pool
        self._options = pool.options
        self._interval = interval
        self._api_client: Any = None

    @property
    def pool(self) -> str:
        return f"{self._options.namespace()}/{self._pool.name}"

    async def _client(self) -> Any:
        if self._api_client is None:
            self._api_client = await api_client(self._options, "k8s-pool")
        return self._api_client

    def _pool_reflector(self, api_client: Any) -> _Reflector:
        from kubernetes_asyncio import client

        api = client.CustomObjectsApi(api_client)
        namespace = self._options.namespace()

        def call(**kw: Any) -> Awaitable[Any]:
            return api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, **kw)

        selector = f"metadata.name={self._pool.name}"
        return _Reflector(call, f"InferencePool {self.pool}", self._options, self._interval, field_selector=selector)

    def _pod_reflector(self, api_client: Any, spec: PoolSpec) -> _Reflector:
        from kubernetes_asyncio import client

        api = client.CoreV1Api(api_client)
        namespace = self._options.namespace()

        def call(**kw: Any) -> Awaitable[Any]:
            return api.list_namespaced_pod(namespace, **kw)

        what = f"pods of InferencePool {self.pool} ({spec.label_selector})"
        return _Reflector(call, what, self._options, self._interval, label_selector=spec.label_selector)

    async def list_instances(self, namespace: str, component: str) -> list[Instance]:
        """The pool's ready instances now; StoreUnavailable while the pool does not exist (a picker
        is not ready for a pool it cannot read)."""
        api_client = await self._client()
        pools = self._pool_reflector(api_client)
        await pools.list()
        spec = pool_spec(pools.store.get(self._pool.name))
        if spec is None:
            state = "has no selector and target ports" if self._pool.name in pools.store else "not found"
            raise StoreUnavailable(f"kubernetes: InferencePool {self.pool} {state}")
        pods = self._pod_reflector(api_client, spec)
        await pods.list()
        found = pool_instances(spec, pods.store, namespace, component, self._options.metadata_port)
        return [found[k] for k in sorted(found)]

    def watch(self, namespace: str, component: str) -> AsyncIterator[InstanceEvent]:
        async def produce(emit: Emit) -> None:
            api_client = await self._client()
            view = View()
            pools = self._pool_reflector(api_client)
            pods: _Reflector | None = None
            pods_task: asyncio.Task[None] | None = None
            spec: PoolSpec | None = None
            failed: list[BaseException] = []
            missing = False
            me = asyncio.current_task()

            def recompute() -> None:
                store = pods.store if pods is not None else {}
                emit(view.replace(pool_instances(spec, store, namespace, component, self._options.metadata_port)))

            def pods_done(task: asyncio.Task[None]) -> None:
                if not task.cancelled() and task.exception() is not None and me is not None:
                    failed.append(task.exception())  # type: ignore[arg-type]
                    me.cancel()  # a bug in the pod loop must reach the consumer, not vanish in a task

            def pool_changed() -> None:
                nonlocal spec, pods, pods_task, missing
                new = pool_spec(pools.store.get(self._pool.name))
                if new is None and not missing:
                    log.warning("kubernetes: InferencePool %s is missing or selects nothing: no instances", self.pool)
                missing = new is None
                if (new and new.match_labels) != (spec and spec.match_labels):
                    if pods_task is not None:
                        pods_task.remove_done_callback(pods_done)
                        pods_task.cancel()
                    kept = pods.store if pods is not None else {}
                    pods, pods_task = None, None
                    if new is not None:
                        pods = self._pod_reflector(api_client, new)
                        # until the new selector's list arrives, pods already known that it selects
                        # stay (no remove-and-add flap); the list replaces them
                        pods.store = dict(kept)
                        pods_task = asyncio.create_task(pods.run(recompute), name="k8s-pool-pods")
                        pods_task.add_done_callback(pods_done)
                spec = new
                recompute()

            try:
                await pools.run(pool_changed)
            except asyncio.CancelledError:
                if failed:
                    raise failed[0] from None
                raise
            finally:
                if pods_task is not None:
                    pods_task.remove_done_callback(pods_done)
                    pods_task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await pods_task

        return event_stream(produce)

    async def close(self) -> None:
        if self._api_client is not None:
            await self._api_client.close()
            self._api_client = None


def _name(obj: Mapping[str, Any]) -> str | None:
    name = (obj.get("metadata") or {}).get("name")
    return name if isinstance(name, str) and name else None
