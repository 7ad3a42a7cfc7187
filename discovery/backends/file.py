"""`file:PATH` — instances listed in a YAML file, re-read whenever the file changes.

The file holds a list (or `{instances: [...]}`) whose entries are `id=host:port` strings or
mappings `{id, host, port, namespace?, component?, metadata?}`. A file that turns bad while
running keeps the last good list and logs one WARNING per bad version; a bad file at start-up is
a ConfigError.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pilotfish.config import ConfigError
from pilotfish.discovery.api import InstanceEvent, ServiceDiscovery
from pilotfish.discovery.backends.memory import matches
from pilotfish.discovery.static import Instance, parse_instance
from pilotfish.discovery.view import Emit, View, event_stream

log = logging.getLogger(__name__)

_Stamp = tuple[int, int, int]  # (inode, size, mtime_ns): any change means re-read


def parse_entries(data: Any, where: str) -> list[Instance]:
    """The instances of a loaded YAML document; ConfigError names the entry and the reason."""
    if data is None:
        data = []
    if isinstance(data, dict):
        data = data.get("instances") or []
    if not isinstance(data, list):
        raise ConfigError(f"{where}: expected a list of instances (or a mapping with 'instances')")
    out: list[Instance] = []
    seen: set[tuple[str, str, str]] = set()
    for n, entry in enumerate(data):
        try:
            instance = _entry(entry)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{where}: instance #{n + 1}: {exc}") from None
        key = (instance.namespace, instance.component, instance.instance_id)
        if key in seen:
            raise ConfigError(f"{where}: instance id {instance.instance_id!r} is listed twice")
        seen.add(key)
        out.append(instance)
    return out


def _entry(entry: Any) -> Instance:
    if isinstance(entry, str):
        return parse_instance(entry)
    if not isinstance(entry, dict):
        raise ValueError("must be 'id=host:port' or a mapping with host and port")
    host, port = entry.get("host"), entry.get("port")
    if not isinstance(host, str) or not host or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError("needs host (string) and port (1-65535)")
    metadata = entry.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ValueError("metadata must be a mapping")
    return Instance(
        str(entry.get("id") or f"{host}:{port}"),
        host,
        port,
        str(entry.get("namespace") or ""),
        str(entry.get("component") or ""),
        metadata_snapshot=metadata,
    )


class FileDiscovery(ServiceDiscovery):
    def __init__(self, path: str | Path, interval: float = 1.0) -> None:
        self._path = Path(path)
        self._interval = interval
        self._stamp: _Stamp | None = None
        self._instances: list[Instance] = []
        self._logged_bad: _Stamp | None = None
        self._reload(strict=True)

    def _stat(self) -> _Stamp | None:
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _reload(self, strict: bool = False) -> None:
        stamp = self._stat()
        if stamp is not None and stamp == self._stamp:
            return
        try:
            if stamp is None:
                raise ConfigError(f"instance file {self._path} does not exist")
            self._instances = parse_entries(load_yaml_mapping_or_list(self._path), str(self._path))
            self._stamp = stamp
        except ConfigError as exc:
            if strict:
                raise
            if stamp != self._logged_bad:
                self._logged_bad = stamp
                log.warning("keeping the last good instance list: %s", exc)

    async def list_instances(self, namespace: str, component: str) -> list[Instance]:
        self._reload()
        found = [i for i in self._instances if matches(i, namespace, component)]
        return sorted(found, key=lambda i: i.instance_id)

    def watch(self, namespace: str, component: str) -> AsyncIterator[InstanceEvent]:
        async def produce(emit: Emit) -> None:
            view = View()
            while True:
                found = await self.list_instances(namespace, component)
                emit(view.replace({i.instance_id: i for i in found}))
                await asyncio.sleep(self._interval)

        return event_stream(produce)

    async def close(self) -> None:
        return None


def load_yaml_mapping_or_list(path: Path) -> Any:
    """Like config.load_yaml_mapping, but a top-level list is allowed too."""
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read instance file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"instance file {path} is not valid YAML: {exc}") from None
