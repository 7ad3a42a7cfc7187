"""Real Redis, etcd and Envoy servers on loopback, for tests, benchmarks and `pilotfish up --full`.

Each `start_*` runs the binary as a `procs.Child` on free 127.0.0.1 ports, waits on a condition
that proves the server answers (PING, /health, /ready), and returns a `RunningService` whose
`stop()` stops exactly that PID. A missing binary raises `MissingBinary`, naming the package
that provides it; a server that dies while starting raises `StartError` with its log tail.

Where a binary is missing but a Docker engine answers and `testcontainers` is installed,
`start_or_container` runs the server in a container instead (see `containers_usable`).
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import platform
import shutil
import socket
import ssl
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pilotfish.envoy_binary import EnvoyNotFound, find_envoy_binary
from pilotfish.procs import Child, StartError, free_port, port_is_free, wait_until

LOOPBACK = "127.0.0.1"
# free_port() can lose its port to another process before the child binds it; retry then.
_PORT_ATTEMPTS = 3


class MissingBinary(StartError):
    """The server's executable is not installed; the message says how to install it."""


@dataclass
class RunningService:
    """A started server: where it answers and how to stop it.

    `child` is the local process, or None when the server runs in a container.
    """

    name: str
    url: str
    port: int
    child: Child | None
    work_dir: Path | None = None
    log_path: Path | None = None
    config_path: Path | None = None
    _stop_hook: Callable[[], None] | None = field(default=None, repr=False)

    def stop(self) -> None:
        """Stop this server (idempotent); touches no other process."""
        if self.child is not None:
            self.child.stop()
        if self._stop_hook is not None:
            hook, self._stop_hook = self._stop_hook, None
            hook()

    def __enter__(self) -> RunningService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _PortTaken(StartError):
    """The child died and another process holds a port picked for it by free_port()."""


# ---------------------------------------------------------------------------------------------
# binaries


def _find_binary(name: str, env_var: str, install: str) -> Path:
    if explicit := os.environ.get(env_var):
        path = Path(explicit)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise MissingBinary(f"{env_var}={explicit} is not an executable file")
    # /usr/bin is where Debian puts both; PATH may be trimmed in CI runners and sudo shells.
    for candidate in (shutil.which(name), f"/usr/bin/{name}"):
        if candidate and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise MissingBinary(f"{name} not found on PATH: {install} (or set {env_var})")


def redis_binary() -> Path:
    return _find_binary(
        "redis-server",
        "PILOTFISH_REDIS_BINARY",
        "apt-get install redis-server (or run scripts/install-system-deps.sh)",
    )


def etcd_binary() -> Path:
    return _find_binary(
        "etcd",
        "PILOTFISH_ETCD_BINARY",
        "apt-get install etcd-server, which provides /usr/bin/etcd (or run scripts/install-system-deps.sh)",
    )


def envoy_binary() -> Path:
    try:
        return find_envoy_binary()
    except EnvoyNotFound as exc:
        raise MissingBinary(str(exc)) from None


# ---------------------------------------------------------------------------------------------
# readiness probes

# Loopback probes must never go through an HTTP(S)_PROXY from the environment.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_call(url: str, body: bytes | None = None, timeout: float = 2.0) -> tuple[int, bytes]:
    """GET (or POST when `body` is given) without any proxy; returns (status, body).

    HTTP error statuses are returned, not raised; connection failures raise OSError.
    """
    request = urllib.request.Request(url, data=body, method="GET" if body is None else "POST")
    if body is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with _DIRECT.open(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def redis_answers_ping(
    port: int,
    host: str = LOOPBACK,
    timeout: float = 1.0,
    *,
    password: str = "",
    ssl_context: ssl.SSLContext | None = None,
) -> bool:
    """PING answered (after AUTH with `password`; over TLS with `ssl_context`)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw:
            sock = ssl_context.wrap_socket(raw, server_hostname=host) if ssl_context is not None else raw
            if password:
                secret = password.encode()
                sock.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(secret), secret))
                if not sock.recv(64).startswith(b"+OK"):
                    return False
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:  # ssl.SSLError included
        return False


def etcd_is_healthy(url: str, timeout: float = 1.0) -> bool:
    try:
        status, body = http_call(f"{url}/health", timeout=timeout)
        return status == 200 and json.loads(body).get("health") == "true"
    except (OSError, http.client.HTTPException, ValueError):
        return False


def envoy_is_live(admin_url: str, timeout: float = 1.0) -> bool:
    try:
        status, body = http_call(f"{admin_url}/ready", timeout=timeout)
        return status == 200 and body.strip() == b"LIVE"
    except (OSError, http.client.HTTPException):
        return False


# ---------------------------------------------------------------------------------------------
# local processes


def _wait_ready(
    service: RunningService, ready: Callable[[], bool], timeout: float, picked_ports: Sequence[int]
) -> RunningService:
    child = service.child
    assert child is not None
    what = f"{service.name} at {service.url} (log: {service.log_path})"
    try:
        wait_until(ready, timeout, what, interval=0.1, alive=child.exited)
    except StartError as exc:
        died = child.exited() is not None
        child.stop()  # a server that missed its deadline must not outlive the error
        # Someone else holding a port we picked means we lost the race after free_port().
        lost_race = died and any(not port_is_free(p) for p in picked_ports)
        raise (_PortTaken if lost_race else StartError)(str(exc)) from None
    except BaseException:
        child.stop()  # interrupted while waiting (Ctrl-C, SIGTERM): the caller never got a handle to it
        raise
    return service


def _launch(attempt: Callable[[], RunningService]) -> RunningService:
    """Run `attempt`; when another process took a port it picked, try again with new ones."""
    for n in range(1, _PORT_ATTEMPTS + 1):
        try:
            return attempt()
        except _PortTaken as exc:
            if n == _PORT_ATTEMPTS:
                raise StartError(str(exc)) from None
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class RedisTls:
    """Serve Redis over TLS only (its plaintext port off): this certificate and key, and with a CA,
    client certificates required (`tls-auth-clients yes`)."""

    cert: Path
    key: Path
    ca: Path
    auth_clients: bool = True


def start_redis(
    work_dir: Path,
    port: int | None = None,
    *,
    timeout: float = 30.0,
    die_with_parent: bool = False,
    password_file: Path | None = None,
    tls: RedisTls | None = None,
) -> RunningService:
    """redis-server on 127.0.0.1, configured on the command line, with no persistence.

    `password_file`: a file holding the password Redis requires (`requirepass`), handed to Redis in a
    config file readable by its owner only, so it never appears on a command line (`ps`).
    `tls`: serve TLS only, on the port (the URL is then rediss://).
    `die_with_parent`: see `procs.Child`."""
    binary = redis_binary()
    work_dir.mkdir(parents=True, exist_ok=True)
    log_path = work_dir / "redis.log"
    password = password_file.read_text().strip() if password_file is not None else ""
    secret_args: list[str] = []
    if password:
        conf = work_dir / "redis-secret.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            quoted = password.replace("\\", "\\\\").replace('"', '\\"')
            f.write(f'requirepass "{quoted}"\n')
        secret_args = [str(conf)]  # redis-server reads a config file named first
    ready_ssl: ssl.SSLContext | None = None
    if tls is not None:
        ready_ssl = ssl.create_default_context(cafile=str(tls.ca))
        if tls.auth_clients:
            ready_ssl.load_cert_chain(str(tls.cert), str(tls.key))

    def attempt() -> RunningService:
        p = port or free_port()
        if tls is None:
            listen = ["--port", str(p)]
        else:
            listen = ["--port", "0", "--tls-port", str(p), "--tls-cert-file", str(tls.cert),
                      "--tls-key-file", str(tls.key), "--tls-ca-cert-file", str(tls.ca),
                      "--tls-auth-clients", "yes" if tls.auth_clients else "no"]  # fmt: skip
        argv = [
            str(binary),
            *secret_args,
            "--bind", LOOPBACK,
            *listen,
            "--protected-mode", "yes",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(work_dir),
            "--daemonize", "no",
            "--supervised", "no",
            "--logfile", "",  # stdout, which Child appends to log_path
            "--loglevel", "warning",
        ]  # fmt: skip
        child = Child("redis-server", argv, log_path=log_path, cwd=work_dir, die_with_parent=die_with_parent)
        scheme = "rediss" if tls is not None else "redis"
        service = RunningService("redis", f"{scheme}://{LOOPBACK}:{p}/0", p, child, work_dir, log_path)

        def ready() -> bool:
            return redis_answers_ping(p, password=password, ssl_context=ready_ssl)

        return _wait_ready(service, ready, timeout, [] if port else [p])

    return _launch(attempt)


# Go's names for the machines etcd 3.4 refuses unless ETCD_UNSUPPORTED_ARCH names them.
_GOARCH = {"aarch64": "arm64", "arm64": "arm64", "armv7l": "arm", "armv6l": "arm", "i686": "386",
           "i386": "386", "s390x": "s390x", "riscv64": "riscv64", "ppc64": "ppc64"}  # fmt: skip


def _etcd_env() -> dict[str, str]:
    # etcd reads ETCD_* variables as flags and refuses to start when one shadows a flag we pass.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64", "ppc64le"):
        env["ETCD_UNSUPPORTED_ARCH"] = _GOARCH.get(machine, machine)
    return env


def start_etcd(work_dir: Path, port: int | None = None, *, timeout: float = 60.0) -> RunningService:
    """A single-member etcd on 127.0.0.1 with a fresh data dir under `work_dir`."""
    binary = etcd_binary()
    work_dir.mkdir(parents=True, exist_ok=True)
    log_path = work_dir / "etcd.log"

    def attempt() -> RunningService:
        client, peer = port or free_port(), free_port()
        client_url, peer_url = f"http://{LOOPBACK}:{client}", f"http://{LOOPBACK}:{peer}"
        # A new data dir per attempt: a dir left by a failed attempt remembers its old peer URL.
        data_dir = tempfile.mkdtemp(prefix="etcd-data-", dir=work_dir)
        argv = [
            str(binary),
            "--name", "pilotfish",
            "--data-dir", data_dir,
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"pilotfish={peer_url}",
            "--initial-cluster-state", "new",
            "--initial-cluster-token", f"pilotfish-{client}",
            "--logger", "zap",
            "--log-outputs", "stderr",
            "--log-level", "warn",
        ]  # fmt: skip
        child = Child("etcd", argv, env=_etcd_env(), log_path=log_path, cwd=work_dir)
        service = RunningService("etcd", client_url, client, child, work_dir, log_path)
        picked = [peer] if port else [client, peer]
        return _wait_ready(service, lambda: etcd_is_healthy(client_url), timeout, picked)

    return _launch(attempt)


def start_envoy(
    bootstrap_yaml: str,
    work_dir: Path,
    admin_port: int | None = None,
    *,
    name: str = "envoy",
    concurrency: int | None = None,
    extra_args: Sequence[str] = (),
    timeout: float = 60.0,
    die_with_parent: bool = False,
) -> RunningService:
    """Envoy with `bootstrap_yaml`, ready once its admin `/ready` answers LIVE.

    The admin listener belongs to this function, not to the bootstrap: it is always
    127.0.0.1:`admin_port` (a free port when None), merged over whatever the bootstrap says,
    so the caller renders only listeners and clusters. `.url` and `.port` are the admin's.
    Hot restart is disabled, so Envoys never share a base id or shared-memory region and any
    number run at once, and a restarted one binds the same ports at once. Files are `<name>.yaml`
    and `<name>.log` in `work_dir`. `die_with_parent`: see `procs.Child`.
    """
    binary = envoy_binary()
    work_dir.mkdir(parents=True, exist_ok=True)
    config_path = work_dir / f"{name}.yaml"
    config_path.write_text(bootstrap_yaml)
    log_path = work_dir / f"{name}.log"

    def attempt() -> RunningService:
        admin = admin_port or free_port()
        admin_yaml = json.dumps({"admin": {"address": {"socket_address": {
            "address": LOOPBACK, "port_value": admin}}}})  # fmt: skip
        argv = [
            str(binary),
            "--config-path", str(config_path),
            "--config-yaml", admin_yaml,  # merged over the file: sets only the admin address
            "--disable-hot-restart",
            "--log-level", "warn",
            "--log-path", str(log_path),  # the same file Child appends stdout/stderr to
        ]  # fmt: skip
        if concurrency is not None:
            argv += ["--concurrency", str(concurrency)]
        argv += list(extra_args)
        child = Child(name, argv, log_path=log_path, cwd=work_dir, die_with_parent=die_with_parent)
        admin_url = f"http://{LOOPBACK}:{admin}"
        service = RunningService(name, admin_url, admin, child, work_dir, log_path, config_path)
        picked = [] if admin_port else [admin]
        return _wait_ready(service, lambda: envoy_is_live(admin_url), timeout, picked)

    return _launch(attempt)


# ---------------------------------------------------------------------------------------------
# containers: only where a binary is missing, a Docker engine answers and testcontainers exists


def docker_engine_answers(timeout: float = 1.0) -> bool:
    """True when the Docker engine (DOCKER_HOST or the default socket) answers GET /_ping."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    parsed = urllib.parse.urlparse(host)
    try:
        if parsed.scheme == "unix":
            if not os.path.exists(parsed.path):
                return False
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(parsed.path)
        elif parsed.scheme == "tcp" and parsed.hostname and parsed.port:
            sock = socket.create_connection((parsed.hostname, parsed.port), timeout=timeout)
        else:
            return False
        with sock:
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            return sock.recv(256).split(b"\r\n", 1)[0].endswith(b" 200 OK")
    except OSError:
        return False


def containers_usable() -> bool:
    return importlib.util.find_spec("testcontainers") is not None and docker_engine_answers()


def start_redis_container(image: str = "redis:7") -> RunningService:
    from testcontainers.redis import RedisContainer  # type: ignore[import-not-found]

    container = RedisContainer(image).start()  # waits until redis answers
    host, port = container.get_container_host_ip(), int(container.get_exposed_port(6379))
    return RunningService("redis", f"redis://{host}:{port}/0", port, None, _stop_hook=container.stop)


def start_etcd_container(image: str = "quay.io/coreos/etcd:v3.4.34", timeout: float = 60.0) -> RunningService:
    from testcontainers.core.container import DockerContainer  # type: ignore[import-not-found]

    container = (
        DockerContainer(image)
        .with_exposed_ports(2379)
        .with_command(
            "/usr/local/bin/etcd --name pilotfish --listen-client-urls http://0.0.0.0:2379"
            " --advertise-client-urls http://127.0.0.1:2379"
        )
    )
    container.start()
    host, port = container.get_container_host_ip(), int(container.get_exposed_port(2379))
    url = f"http://{host}:{port}"
    try:
        wait_until(lambda: etcd_is_healthy(url), timeout, f"etcd container at {url}", interval=0.2)
    except StartError:
        container.stop()
        raise
    return RunningService("etcd", url, port, None, _stop_hook=container.stop)


def start_or_container(local: Callable[[], RunningService], container: Callable[[], RunningService]) -> RunningService:
    """`local()`, or `container()` when the local binary is missing and containers are usable.

    Local binaries come first: they start in milliseconds and need no image pulls.
    """
    try:
        return local()
    except MissingBinary:
        if not containers_usable():
            raise
    return container()
