"""Pick a backend by URL, so every component takes the same `--discovery` flag.

| URL | backend |
|---|---|
| `static:` / `static:id=host:port,host:port` | fixed list, plus in-process registrations |
| `file:PATH` (`file:///abs/path.yaml`) | YAML list, re-read when the file changes |
| `redis://[:password@]host:port/db?prefix=pilotfish` (`rediss://` for TLS) | Redis hash, polled |
| `etcd://host:port[,host:port...]?prefix=pilotfish` (`etcd+https://` for TLS) | etcd lease + Watch |
| `k8s:?namespace=NS&kubeconfig=PATH&context=C&port_name=P&metadata_port=N&metadata_host=H` | EndpointSlices |
| `k8s://host:port?...` | the same, against a plain-HTTP API server (`kubectl proxy`, tests) |
| `k8s-pool:[NS/]POOL?namespace=NS&kubeconfig=PATH&context=C&metadata_port=N` | an InferencePool's ready pods |
| `k8s-pool://host:port/[NS/]POOL?...` | the same, against a plain-HTTP API server |
| `k8s-pool://NS/POOL` (no port) | `k8s-pool:NS/POOL` |

Constructors do no I/O: connections open on first use.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from pilotfish.config import ConfigError
from pilotfish.discovery.api import ServiceDiscovery, ServiceRegistry

SCHEMES = ("static", "file", "redis", "rediss", "etcd", "etcd+https", "k8s", "k8s-pool")


def redis_options(config: Any) -> dict[str, Any] | None:
    """redis-py options from a config's security settings (pilotfish/security.py) when its
    --discovery is a Redis URL, else None."""
    if _split(config.discovery)[0] not in ("redis", "rediss"):
        return None
    from pilotfish.security import Security

    return Security.from_config(config).redis_options(config.discovery)


def _split(url: str) -> tuple[str, str]:
    scheme, sep, rest = url.strip().partition(":")
    scheme = scheme.lower()
    if not sep or scheme not in SCHEMES:
        raise ConfigError(f"--discovery: {url!r} is not one of static:, file:, redis://, etcd://, k8s:, k8s-pool:")
    return scheme, rest


def _query(url: str, allowed: set[str]) -> dict[str, str]:
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query, keep_blank_values=True))
    if unknown := set(query) - allowed:
        raise ConfigError(f"--discovery: {url!r}: unknown option(s) {', '.join(sorted(unknown))}")
    return query


def _without_query(url: str, names: set[str]) -> str:
    parts = urllib.parse.urlsplit(url)
    kept = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True) if k not in names]
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(kept)))


def _redis_prefix(url: str) -> str:
    # Every other query option is redis-py's own (socket_timeout=..., and so on).
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))
    return query.get("prefix") or "pilotfish"


def _etcd_endpoints(url: str, scheme: str) -> list[str]:
    netloc = urllib.parse.urlsplit(url).netloc
    hosts = [h for h in netloc.split(",") if h]
    if not hosts:
        raise ConfigError(f"--discovery: {url!r} names no etcd endpoint (etcd://host:port)")
    http = "https" if scheme == "etcd+https" else "http"
    return [f"{http}://{h}" for h in hosts]


def _k8s_options(url: str, rest: str):  # type: ignore[no-untyped-def]
    from pilotfish.discovery.backends.k8s import DEFAULT_METADATA_PORT, K8sOptions

    q = _query(url, {"namespace", "kubeconfig", "context", "port_name", "metadata_port", "metadata_host"})
    api_url = None
    if rest.startswith("//"):
        netloc = urllib.parse.urlsplit(url).netloc
        if not netloc:
            raise ConfigError(f"--discovery: {url!r}: k8s://host:port needs host:port")
        api_url = f"http://{netloc}"
    try:
        metadata_port = int(q.get("metadata_port") or DEFAULT_METADATA_PORT)
    except ValueError:
        raise ConfigError(f"--discovery: {url!r}: metadata_port is not a number") from None
    options = K8sOptions(
        api_url=api_url,
        kube_namespace=q.get("namespace") or None,
        kubeconfig=q.get("kubeconfig") or None,
        context=q.get("context") or None,
        port_name=q.get("port_name") or None,
        metadata_port=metadata_port,
    )
    return options, q.get("metadata_host") or "127.0.0.1"


def _k8s_pool(url: str, rest: str):  # type: ignore[no-untyped-def]
    from pilotfish.discovery.backends.k8s import DEFAULT_METADATA_PORT, K8sOptions
    from pilotfish.discovery.backends.k8s_pool import PoolRef, check_name

    q = _query(url, {"namespace", "kubeconfig", "context", "metadata_port"})
    parts = urllib.parse.urlsplit(url)
    api_url = None
    path = parts.path
    if rest.startswith("//"):
        # k8s-pool://HOST:PORT/... names a plain-HTTP API server (as k8s://host:port does);
        # without a port, k8s-pool://NAMESPACE/POOL is k8s-pool:NAMESPACE/POOL
        try:
            port = parts.port
        except ValueError:
            raise ConfigError(f"--discovery: {url!r}: the API server's port is not a number") from None
        if port is None:
            path = f"{parts.netloc}/{parts.path.strip('/')}"
        else:
            api_url = f"http://{parts.netloc}"
    segments = [s for s in path.strip("/").split("/")]
    if len(segments) == 1 and segments[0]:
        namespace, name = q.get("namespace") or None, segments[0]
    elif len(segments) == 2 and all(segments):
        namespace, name = segments
        if q.get("namespace") and q["namespace"] != namespace:
            raise ConfigError(f"--discovery: {url!r}: namespace {namespace!r} and ?namespace= disagree")
    else:
        raise ConfigError(f"--discovery: {url!r} names no InferencePool (k8s-pool:[NAMESPACE/]POOL)")
    try:
        metadata_port = int(q.get("metadata_port") or DEFAULT_METADATA_PORT)
    except ValueError:
        raise ConfigError(f"--discovery: {url!r}: metadata_port is not a number") from None
    options = K8sOptions(
        api_url=api_url,
        kube_namespace=check_name(namespace, "namespace") if namespace else None,
        kubeconfig=q.get("kubeconfig") or None,
        context=q.get("context") or None,
        metadata_port=metadata_port,
    )
    return PoolRef(check_name(name, "InferencePool name"), options)


def open_discovery(
    url: str, *, ttl: float = 10.0, interval: float = 1.0, redis_options: dict[str, Any] | None = None
) -> ServiceDiscovery:
    """The reader for `url`; ConfigError names what is wrong with it. `redis_options`: redis-py
    connection options for redis:// and rediss:// (pilotfish/security.py's `redis_options`)."""
    scheme, rest = _split(url)
    if scheme == "static":
        from pilotfish.discovery.backends.memory import MemoryBackend
        from pilotfish.discovery.static import parse_instances

        try:
            return MemoryBackend(parse_instances([s for s in rest.split(",") if s.strip()]))
        except ValueError as exc:
            raise ConfigError(f"--discovery: {exc}") from None
    if scheme == "file":
        from pilotfish.discovery.backends.file import FileDiscovery

        path = urllib.parse.urlsplit(url).path if rest.startswith("//") else rest
        if not path:
            raise ConfigError(f"--discovery: {url!r} names no file (file:PATH)")
        return FileDiscovery(path, interval=interval)
    if scheme in ("redis", "rediss"):
        from pilotfish.discovery.backends.redis import RedisDiscovery

        try:
            return RedisDiscovery(
                _without_query(url, {"prefix"}),
                prefix=_redis_prefix(url),
                ttl=ttl,
                interval=interval,
                redis_options=redis_options,
            )
        except ValueError as exc:
            raise ConfigError(f"--discovery: {url!r}: {exc}") from None
    if scheme in ("etcd", "etcd+https"):
        from pilotfish.discovery.backends.etcd import EtcdDiscovery

        prefix = _query(url, {"prefix"}).get("prefix") or "pilotfish"
        return EtcdDiscovery(_etcd_endpoints(url, scheme), prefix=prefix, ttl=ttl, interval=interval)
    if scheme == "k8s-pool":
        from pilotfish.discovery.backends.k8s_pool import InferencePoolDiscovery

        return InferencePoolDiscovery(_k8s_pool(url, rest), interval=interval)
    from pilotfish.discovery.backends.k8s import K8sDiscovery

    options, _ = _k8s_options(url, rest)
    return K8sDiscovery(options, interval=interval)


def open_registry(url: str, *, ttl: float = 10.0, redis_options: dict[str, Any] | None = None) -> ServiceRegistry:
    """The writer for `url`; `file:` has none (edit the file), `static:` is in-process only."""
    scheme, rest = _split(url)
    if scheme == "file":
        raise ConfigError(f"--discovery: {url!r}: a file: list is read-only; register with redis://, etcd:// or k8s:")
    if scheme == "static":
        from pilotfish.discovery.backends.memory import MemoryBackend

        return MemoryBackend()
    if scheme == "k8s-pool":
        raise ConfigError(
            f"--discovery: {url!r}: an InferencePool is read-only: pods join it by their labels and readiness "
            "(register with k8s: to serve /ready and /metadata)"
        )
    if scheme in ("redis", "rediss"):
        from pilotfish.discovery.backends.redis import RedisRegistry

        try:
            return RedisRegistry(
                _without_query(url, {"prefix"}), prefix=_redis_prefix(url), ttl=ttl, redis_options=redis_options
            )
        except ValueError as exc:
            raise ConfigError(f"--discovery: {url!r}: {exc}") from None
    if scheme in ("etcd", "etcd+https"):
        from pilotfish.discovery.backends.etcd import EtcdRegistry

        prefix = _query(url, {"prefix"}).get("prefix") or "pilotfish"
        return EtcdRegistry(_etcd_endpoints(url, scheme), prefix=prefix, ttl=ttl)
    from pilotfish.discovery.backends.k8s_registry import K8sRegistry

    options, metadata_host = _k8s_options(url, rest)
    return K8sRegistry(metadata_host=metadata_host, metadata_port=options.metadata_port)
