"""`k8s:` registry side: the pod serves its own metadata and readiness; Kubernetes does the rest.

No store is written. `set_metadata` keeps the metadata in memory and serves it at `/metadata`;
`set_ready` flips what `/ready` answers, and the pod's readiness probe (`httpGet: /ready` on the
metadata port) makes Kubernetes add the pod to, or mark it not ready in, the EndpointSlices that
discovery watches. The instance id is the pod name (`$POD_NAME`, else the hostname, which
Kubernetes sets to the pod name).

The server binds 127.0.0.1 unless told otherwise; in a pod pass `metadata_host=0.0.0.0` so the
kubelet and other pods reach it.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from pilotfish.discovery.api import InstanceHandle, InstanceStatus, ServiceRegistry
from pilotfish.discovery.backends.k8s import DEFAULT_METADATA_PORT


def pod_name() -> str:
    return os.environ.get("POD_NAME") or socket.gethostname()


class K8sHandle(InstanceHandle):
    def __init__(self, registry: K8sRegistry, instance_id: str) -> None:
        self._registry = registry
        self._id = instance_id
        self.metadata: dict[str, Any] = {}
        self.ready = False

    def instance_id(self) -> str:
        return self._id

    async def set_metadata(self, metadata: Mapping[str, Any]) -> None:
        data = dict(metadata)
        json.dumps(data)  # fail here, not on the first GET, when it cannot be served
        self.metadata = data

    async def set_ready(self, status: InstanceStatus | str | bool) -> None:
        self.ready = InstanceStatus.parse(status) is InstanceStatus.READY

    async def deregister(self) -> None:
        self.ready = False
        self._registry.handles.pop(self._id, None)


class K8sRegistry(ServiceRegistry):
    def __init__(self, *, metadata_host: str = "127.0.0.1", metadata_port: int = DEFAULT_METADATA_PORT) -> None:
        self.metadata_host = metadata_host
        self.metadata_port = metadata_port
        self.handles: dict[str, K8sHandle] = {}
        self._runner: web.AppRunner | None = None

    async def register_instance(
        self,
        namespace: str,
        component: str,
        *,
        instance_id: str | None = None,
        host: str | None = None,
        port: int | None = None,
    ) -> InstanceHandle:
        # namespace/component live in the pod's labels (and the Service's); host and port in the
        # pod spec. Kubernetes owns them, so they are not ours to write.
        name = instance_id or pod_name()
        if name in self.handles:
            raise ValueError(f"instance {name!r} is already registered")
        await self._serve()
        handle = K8sHandle(self, name)
        self.handles[name] = handle
        return handle

    async def _serve(self) -> None:
        if self._runner is not None:
            return
        app = web.Application()
        app.router.add_get("/metadata", self._metadata)
        app.router.add_get("/metadata/{instance_id}", self._metadata)
        app.router.add_get("/ready", self._ready)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.metadata_host, self.metadata_port)
        await site.start()
        if self.metadata_port == 0:  # an ephemeral port (tests): report the one the kernel chose
            self.metadata_port = runner.addresses[0][1]
        self._runner = runner

    async def _metadata(self, request: web.Request) -> web.Response:
        wanted = request.match_info.get("instance_id")
        if wanted is None and len(self.handles) == 1:
            wanted = next(iter(self.handles))
        handle = self.handles.get(wanted or "")
        if handle is None:
            return web.json_response({"error": "no such instance (name it: /metadata/<id>)"}, status=404)
        return web.json_response(handle.metadata)

    async def _ready(self, _request: web.Request) -> web.Response:
        ready = bool(self.handles) and all(h.ready for h in self.handles.values())
        return web.Response(status=200 if ready else 503, text="ready" if ready else "not ready")

    async def close(self) -> None:
        for handle in list(self.handles.values()):
            await handle.deregister()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
