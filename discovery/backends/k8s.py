"""`k8s:` — discovery from EndpointSlices, through the official kubernetes_asyncio client.

An instance is one endpoint of an EndpointSlice labelled `pilotfish.io/namespace=<namespace>` and
`pilotfish.io/component=<component>` (the Service's labels, which Kubernetes copies onto its
slices). Its id is the pod's name (`targetRef.name`), its address the endpoint's first address and
the slice's traffic port. Ready (`conditions.ready` true or unset) is Added; not ready or gone is
Removed. `Instance.metadata()` GETs `http://<address>:<metadata port>/metadata`, which the pod's
own registry serves (`backends/k8s_registry.py`).

List, then watch from the list's resourceVersion; a watch that ends is resumed from the last
resourceVersion seen, and one that fails or reports 410 Gone lists again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from pilotfish.config import ConfigError
from pilotfish.discovery.api import InstanceEvent, ServiceDiscovery, StoreUnavailable
from pilotfish.discovery.static import Instance
from pilotfish.discovery.view import Emit, View, event_stream

log = logging.getLogger(__name__)

LABEL_NAMESPACE = "pilotfish.io/namespace"
LABEL_COMPONENT = "pilotfish.io/component"
METADATA_PORT_NAME = "metadata"
DEFAULT_METADATA_PORT = 8090
_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True)
class K8sOptions:
    api_url: str | None = None  # plain-HTTP API server (kubectl proxy, tests); None: in-cluster or kubeconfig
    kube_namespace: str | None = None  # None: the pod's own namespace, else "default"
    kubeconfig: str | None = None
    context: str | None = None
    port_name: str | None = None  # the slice port consumers route to; None: the first not named "metadata"
    metadata_port: int = DEFAULT_METADATA_PORT  # when the slice has no port named "metadata"
    watch_timeout_seconds: int = 240

    def namespace(self) -> str:
        if self.kube_namespace:
            return self.kube_namespace
        try:
            return _SA_NAMESPACE.read_text().strip() or "default"
        except OSError:
            return "default"


def label_selector(namespace: str, component: str) -> str:
    return f"{LABEL_NAMESPACE}={namespace},{LABEL_COMPONENT}={component}"


def slice_instances(obj: dict[str, Any], namespace: str, component: str, options: K8sOptions) -> dict[str, Instance]:
    """The ready endpoints of one EndpointSlice (wire-format dict) as Instances, by pod name."""
    ports = [p for p in obj.get("ports") or [] if isinstance(p, dict) and isinstance(p.get("port"), int)]
    if options.port_name:
        traffic = next((p["port"] for p in ports if p.get("name") == options.port_name), None)
    else:
        traffic = next((p["port"] for p in ports if p.get("name") != METADATA_PORT_NAME), None)
    meta_port = next((p["port"] for p in ports if p.get("name") == METADATA_PORT_NAME), options.metadata_port)
    found: dict[str, Instance] = {}
    if traffic is None:
        return found
    for endpoint in obj.get("endpoints") or []:
        if not isinstance(endpoint, dict):
            continue
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False:  # unset means ready, as Kubernetes documents
            continue
        name = (endpoint.get("targetRef") or {}).get("name")
        addresses = endpoint.get("addresses") or []
        if not isinstance(name, str) or not name or not addresses or not isinstance(addresses[0], str):
            continue
        host = addresses[0]
        shown = f"[{host}]" if ":" in host else host
        found[name] = Instance(
            name, host, traffic, namespace, component, metadata_url=f"http://{shown}:{meta_port}/metadata"
        )
    return found


def union(
    slices: dict[str, dict[str, Any]], namespace: str, component: str, options: K8sOptions
) -> dict[str, Instance]:
    found: dict[str, Instance] = {}
    for name in sorted(slices):
        found.update(slice_instances(slices[name], namespace, component, options))
    return found


class _Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


class K8sDiscovery(ServiceDiscovery):
    def __init__(self, options: K8sOptions, *, interval: float = 1.0) -> None:
        self._options = options
        self._interval = interval
        self._api_client: Any = None
        self._api: Any = None

    async def _discovery_api(self) -> Any:
        if self._api is None:
            from kubernetes_asyncio import client

            self._api_client = await api_client(self._options, "k8s")
            self._api = client.DiscoveryV1Api(self._api_client)
        return self._api

    async def _list(self, namespace: str, component: str) -> tuple[str, dict[str, dict[str, Any]]]:
        api = await self._discovery_api()
        call = api.list_namespaced_endpoint_slice(
            self._options.namespace(),
            label_selector=label_selector(namespace, component),
            _preload_content=False,
            _request_timeout=10,
        )
        version, items = await read_list(call, "EndpointSlices")
        slices = {o["metadata"]["name"]: o for o in items if isinstance(o, dict) and _name(o)}
        return version, slices

    async def list_instances(self, namespace: str, component: str) -> list[Instance]:
        _, slices = await self._list(namespace, component)
        found = union(slices, namespace, component, self._options)
        return [found[k] for k in sorted(found)]

    async def _watch_once(
        self,
        namespace: str,
        component: str,
        version: str,
        slices: dict[str, dict[str, Any]],
        changed: Callable[[], None],
    ) -> str:
        """Apply one watch stream's events to `slices`; returns the last resourceVersion seen."""
        api = await self._discovery_api()
        response = await api.list_namespaced_endpoint_slice(
            self._options.namespace(),
            label_selector=label_selector(namespace, component),
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=self._options.watch_timeout_seconds,
            _preload_content=False,
            _request_timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=None),
        )
        async with response:
            if response.status == 410:
                raise _Gone()
            if response.status != 200:
                raise StoreUnavailable(f"kubernetes: watching EndpointSlices: HTTP {response.status}")
            while line := await response.content.readline():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone()
                    raise StoreUnavailable(f"kubernetes watch error: {obj.get('message')}")
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind == "BOOKMARK" or not (name := _name(obj)):
                    continue
                if kind == "DELETED":
                    slices.pop(name, None)
                elif kind in ("ADDED", "MODIFIED"):
                    slices[name] = obj
                changed()
        return version

    def watch(self, namespace: str, component: str) -> AsyncIterator[InstanceEvent]:
        async def produce(emit: Emit) -> None:
            view = View()
            failing = False
            while True:
                try:
                    version, slices = await self._list(namespace, component)
                    emit(view.replace(union(slices, namespace, component, self._options)))
                    if failing:
                        log.info("kubernetes discovery recovered")
                        failing = False

                    def changed(slices: dict[str, dict[str, Any]] = slices) -> None:
                        emit(view.replace(union(slices, namespace, component, self._options)))

                    while True:  # a watch that times out normally is resumed where it stopped
                        version = await self._watch_once(namespace, component, version, slices, changed)
                except _Gone:
                    continue
                except (TimeoutError, StoreUnavailable, aiohttp.ClientError, OSError, ValueError) as exc:
                    if not failing:
                        log.warning("kubernetes discovery failed, keeping %d instances: %s", len(view.instances), exc)
                    failing = True
                    await asyncio.sleep(self._interval)

        return event_stream(produce)

    async def close(self) -> None:
        if self._api_client is not None:
            await self._api_client.close()
            self._api_client = self._api = None


def _name(obj: dict[str, Any]) -> str | None:
    name = (obj.get("metadata") or {}).get("name")
    return name if isinstance(name, str) and name else None


async def api_client(options: K8sOptions, scheme: str) -> Any:
    """A kubernetes_asyncio ApiClient: the URL's API server, else in-cluster, else the kubeconfig;
    `scheme` names the --discovery form in the error."""
    from kubernetes_asyncio import client, config

    configuration = client.Configuration()
    try:
        if options.api_url:
            configuration.host = options.api_url
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)
        else:
            await config.load_kube_config(
                config_file=options.kubeconfig, context=options.context, client_configuration=configuration
            )
    except (config.ConfigException, OSError, ValueError) as exc:
        raise ConfigError(f"--discovery {scheme}: cannot load the Kubernetes client config: {exc}") from None
    return client.ApiClient(configuration)


async def read_list(call: Awaitable[Any], what: str) -> tuple[str, list[Any]]:
    """A list call made with `_preload_content=False`: (resourceVersion, items); StoreUnavailable
    on a transport fault, a status other than 200, or a body that is not a list."""
    try:
        response = await call
        async with response:
            body = await response.read()
            status = response.status
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise StoreUnavailable(f"kubernetes: listing {what}: {exc or type(exc).__name__}") from None
    if status != 200:
        raise StoreUnavailable(f"kubernetes: listing {what}: HTTP {status}: {body[:200]!r}")
    try:
        data = json.loads(body)
        items = data.get("items") or []
        version = str((data.get("metadata") or {}).get("resourceVersion") or "")
    except (ValueError, AttributeError):
        raise StoreUnavailable(f"kubernetes: the {what} list is not valid JSON") from None
    return version, items
