"""One security model for every control-plane link: TLS (mutual when a CA is given) and a shared token.

Every component's config struct inherits `SecurityConfig`, so the flags are the same everywhere
(`--tls-cert-file`, `--tls-key-file`, `--tls-ca-file`, `--tls-no-client-auth`, `--tls-server-name`,
`--auth-token-file`, `--redis-password-file`, `--insecure`; the llumlet's environment mirrors are
`PILOTFISH_TLS_CERT_FILE` and so on). A field left unset falls back to that `PILOTFISH_*` variable, so a
parent can hand a secret's *file* to every child without putting anything on a command line.

`Security.from_config(config)` reads the files once (errors name the flag) and gives each link what it
needs:

- gRPC (scheduler, ext_proc; the llumlet's own guard in vllm_plugin/core/server.py): `add_port` serves
  TLS from the files, re-read when they change; `aio_interceptor` checks the token on every method
  but health. Clients: `aio_channel` / `channel`, and `metadata` on each call.
- The Session socket (asyncio): `server_ssl_context` (re-read when the files change) and
  `check_session_auth` on the first frame; clients: `client_ssl_context`, `session_auth_frame`.
- /metrics (aiohttp): `server_ssl_context`, `metrics_middleware`; a scraper sets its
  `bearer_token_file` and `tls_config`.
- Redis (CMS, discovery), client only: `redis_options(url)`, the password file, and for rediss://
  the CA and this component's certificate.

Roles of the files: the certificate and key are this component's identity, presented as a server and,
for mutual TLS, as a client; the CA bundle verifies the peer (a server then requires client
certificates, unless `--tls-no-client-auth`: the endpoint picker serves a gateway that presents none,
and verifies the scheduler it dials with the CA). A client dials TLS when it has a certificate or a CA.
The token is checked with a constant-time compare; a refusal is UNAUTHENTICATED (gRPC), 401 (HTTP) or a
closed socket, and counted in `pilotfish_auth_refused_total{listener,reason}`.

`check_listener(host, flag)`: a listener bound beyond loopback (anything but 127.0.0.0/8, ::1 and
localhost) with neither TLS nor a token refuses to start with one line naming the flags to set;
`--insecure` lets it start with a WARNING.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import ssl
import threading
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from pilotfish.config import ConfigError

log = logging.getLogger("pilotfish.security")

ENV_PREFIX = "PILOTFISH_"
AUTHORIZATION = "authorization"
# the Session socket's first frame when the client has a token: no protobuf message starts with a
# 0 byte (field number 0 does not exist), so it cannot be mistaken for a SessionRequest
SESSION_AUTH_PREFIX = b"\x00pilotfish-auth/1\x00"
# health answers no secret and is what probes (kubelet's gRPC probe cannot send metadata) ask
OPEN_SERVICES = ("/grpc.health.v1.Health/",)
MAX_TOKEN_BYTES = 4096


class SecurityConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The security flags every component shares (pilotfish/security.py)."""

    tls_cert_file: Annotated[
        str,
        Meta(description="PEM certificate chain this component presents: its listeners serve TLS, and it is "
             "the client certificate on the links it dials (re-read when the file changes)"),
    ] = ""  # fmt: skip
    tls_key_file: Annotated[str, Meta(description="PEM private key of --tls-cert-file")] = ""
    tls_ca_file: Annotated[
        str,
        Meta(description="PEM CA bundle that verifies peers: servers then require client certificates "
             "(mutual TLS), clients verify the servers they dial (empty: the system's CAs)"),
    ] = ""  # fmt: skip
    tls_no_client_auth: Annotated[
        bool,
        Meta(description="listeners serve TLS without asking for client certificates, even with --tls-ca-file "
             "(which then only verifies the servers this component dials): the endpoint picker, whose "
             "gateway presents none"),
    ] = False  # fmt: skip
    tls_server_name: Annotated[
        str, Meta(description="name expected in the certificates of the servers dialled (empty: the host dialled)")
    ] = ""
    auth_token_file: Annotated[
        str,
        Meta(description="file holding the shared bearer token: every control-plane call must carry it "
             "(gRPC 'authorization: Bearer', the Session socket's first frame, /metrics), and it is sent "
             "on every call this component makes"),
    ] = ""  # fmt: skip
    redis_password_file: Annotated[
        str, Meta(description="file holding the Redis password, used when the Redis URL carries none")
    ] = ""
    insecure: Annotated[
        bool,
        Meta(description="allow a listener beyond loopback without TLS or a token (WARNING); without it such "
             "a component refuses to start"),
    ] = False  # fmt: skip


_FIELDS = ("tls_cert_file", "tls_key_file", "tls_ca_file", "tls_no_client_auth", "tls_server_name",
           "auth_token_file", "redis_password_file", "insecure")  # fmt: skip
_BOOL_FIELDS = ("tls_no_client_auth", "insecure")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def is_loopback(host: str) -> bool:
    """Whether a bind address reaches only this machine (0.0.0.0 and :: reach every interface)."""
    bare = host.strip().strip("[]")
    if bare.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to, not known to be loopback


def _read(path: str, field: str, limit: int = 1 << 20) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"{_flag(field)}: cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise ConfigError(f"{_flag(field)}: {path} is larger than {limit} bytes")
    return data


def _secret(path: str, field: str) -> bytes:
    value = _read(path, field, MAX_TOKEN_BYTES).strip()
    if not value:
        raise ConfigError(f"{_flag(field)}: {path} is empty")
    if any(b < 0x21 or b > 0x7E for b in value):
        raise ConfigError(f"{_flag(field)}: {path} must hold one line of printable ASCII without spaces")
    return value


def _stamp(paths: Iterable[str]) -> tuple[tuple[int, int, int], ...]:
    out = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append((0, 0, 0))
    return tuple(out)


class AuthStats:
    """Refusals by (listener, reason); served as pilotfish_auth_refused_total by `register_auth_stats`."""

    def __init__(self) -> None:
        self.refused: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()  # the llumlet's gRPC server counts from its threads

    def refuse(self, listener: str, reason: str) -> None:
        with self._lock:
            self.refused[(listener, reason)] += 1


def register_auth_stats(registry: Any, stats: AuthStats) -> None:
    """Expose `stats` on a prometheus_client registry."""
    from pilotfish.metrics_http import register_counts

    register_counts(
        registry,
        "pilotfish_auth_refused",
        "control-plane calls refused for missing or wrong credentials, by listener and reason",
        ["listener", "reason"],
        lambda: stats.refused,
    )


class _ServerFiles:
    """The server's certificate, key and CA, re-read when one of the files changes."""

    def __init__(self, cert: str, key: str, ca: str) -> None:
        self.cert, self.key, self.ca = cert, key, ca
        self._lock = threading.Lock()
        self._stamp = _stamp(self._paths)
        self.pem = self._load()
        self.generation = 0

    @property
    def _paths(self) -> tuple[str, ...]:
        return tuple(p for p in (self.cert, self.key, self.ca) if p)

    def _load(self) -> tuple[bytes, bytes, bytes | None]:
        cert = _read(self.cert, "tls_cert_file")
        key = _read(self.key, "tls_key_file")
        ca = _read(self.ca, "tls_ca_file") if self.ca else None
        # ssl checks the pair and the CA now, so a bad file fails at start, naming it
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"--tls-cert-file/--tls-key-file: {self.cert}, {self.key}: {exc}") from None
        if self.ca:
            try:
                context.load_verify_locations(self.ca)
            except (ssl.SSLError, OSError) as exc:
                raise ConfigError(f"--tls-ca-file: {self.ca}: {exc}") from None
        return cert, key, ca

    def refresh(self) -> bool:
        """Re-read the files if one changed since the last look; True when they were. A change that
        does not load (a key written before its certificate) keeps the old ones until the next look."""
        stamp = _stamp(self._paths)
        if stamp == self._stamp:
            return False
        with self._lock:
            if stamp == self._stamp:
                return False
            try:
                pem = self._load()
            except ConfigError as exc:
                log.warning("TLS files changed but do not load yet (%s); serving the previous ones", exc)
                return False
            self.pem, self._stamp = pem, stamp
            self.generation += 1
            log.info("TLS certificate reloaded from %s", self.cert)
            return True


class _ReloadingSslContext:
    """An asyncio server's ssl.SSLContext whose handshakes use the files as they are now: the
    `sni_callback` (called on every ClientHello, with or without a server name) swaps in a context
    built from the changed files."""

    def __init__(self, files: _ServerFiles, alpn: tuple[str, ...] = ()) -> None:
        self._files = files
        self._alpn = alpn  # every context built carries it: a reloaded one replaces the first mid-handshake
        self._current = self._build()
        self._generation = files.generation
        self.context = self._build()
        self.context.sni_callback = self._on_hello

    def _build(self) -> ssl.SSLContext:
        files = self._files
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(files.cert, files.key)
        if files.ca:
            context.load_verify_locations(files.ca)
            context.verify_mode = ssl.CERT_REQUIRED
        if self._alpn:
            context.set_alpn_protocols(list(self._alpn))
        return context

    def _on_hello(self, sslobj: Any, server_name: str | None, context: ssl.SSLContext) -> None:
        files = self._files
        files.refresh()
        if files.generation != self._generation:
            try:
                self._current = self._build()
            except (ssl.SSLError, OSError) as exc:  # changed again under us: next handshake
                log.warning("TLS reload failed: %s", exc)
            else:
                self._generation = files.generation
        if self._generation:
            sslobj.context = self._current
        return None


class Security:
    """What one component's `SecurityConfig` resolves to; build with `from_config`."""

    def __init__(
        self,
        *,
        cert: str = "",
        key: str = "",
        ca: str = "",
        client_auth: bool = True,
        server_name: str = "",
        token: bytes = b"",
        redis_password: str = "",
        insecure: bool = False,
        stats: AuthStats | None = None,
    ) -> None:
        if bool(cert) != bool(key):
            missing = "--tls-key-file" if cert else "--tls-cert-file"
            raise ConfigError(f"{missing}: --tls-cert-file and --tls-key-file go together")
        self.cert, self.key, self.ca, self.server_name = cert, key, ca, server_name
        self.token = token
        self.redis_password = redis_password
        self.insecure = insecure
        self.stats = stats if stats is not None else AuthStats()
        # the listeners' CA: it makes them require client certificates (mutual TLS)
        self._files = _ServerFiles(cert, key, ca if client_auth else "") if cert else None
        if ca and not self.mutual:
            _read(ca, "tls_ca_file")  # a client-only CA: checked now, used when dialling
        self._expected = b"Bearer " + token if token else b""
        self._ssl_servers: dict[tuple[str, ...], _ReloadingSslContext] = {}

    @classmethod
    def from_config(
        cls, config: Any, environ: Mapping[str, str] | None = None, *, legacy_token: str = "", legacy_name: str = ""
    ) -> Security:
        """Resolve a config struct that inherits SecurityConfig; unset fields fall back to PILOTFISH_*.
        `legacy_token`: a component's older token setting (`legacy_name`), the same token as the file's."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in _FIELDS:
            value = getattr(config, field, None)
            if not value:
                raw = environ.get(env_name(field), "")
                value = raw.strip().lower() in ("1", "true", "yes", "on") if field in _BOOL_FIELDS else raw.strip()
            values[field] = value
        token = _secret(values["auth_token_file"], "auth_token_file") if values["auth_token_file"] else b""
        if legacy_token:
            legacy_b = legacy_token.encode()
            if token and not hmac.compare_digest(token, legacy_b):
                raise ConfigError(f"--auth-token-file: differs from {legacy_name}; set one of them")
            token = legacy_b
        password = ""
        if values["redis_password_file"]:
            password = _secret(values["redis_password_file"], "redis_password_file").decode()
        return cls(
            cert=values["tls_cert_file"],
            key=values["tls_key_file"],
            ca=values["tls_ca_file"],
            client_auth=not values["tls_no_client_auth"],
            server_name=values["tls_server_name"],
            token=token,
            redis_password=password,
            insecure=bool(values["insecure"]),
        )

    # -- what is configured --

    @property
    def tls(self) -> bool:
        """Listeners serve TLS."""
        return self._files is not None

    @property
    def mutual(self) -> bool:
        """Listeners require a client certificate signed by the CA."""
        return self._files is not None and bool(self._files.ca)

    @property
    def client_tls(self) -> bool:
        """Links this component dials use TLS."""
        return bool(self.cert or self.ca)

    @property
    def authenticates(self) -> bool:
        """Callers prove who they are: a token, or a client certificate."""
        return bool(self.token) or self.mutual

    def check_listener(self, host: str, flag: str = "--host") -> None:
        """Refuse (ConfigError, one line) a listener beyond loopback with neither TLS nor a token."""
        if is_loopback(host):
            return
        if not (self.tls or self.token):
            if not self.insecure:
                raise ConfigError(
                    f"{flag}: {host} is beyond loopback; set --tls-cert-file and --tls-key-file, or "
                    "--auth-token-file (or --insecure to serve it without either)"
                )
            log.warning("%s %s: listening beyond loopback without TLS or a token (--insecure)", flag, host)
        elif not self.authenticates:
            log.warning(
                "%s %s: TLS without client certificates (--tls-ca-file) or a token (--auth-token-file): "
                "any peer that reaches it can call it",
                flag,
                host,
            )

    def reload(self) -> bool:
        """Re-read the certificate files now if they changed (servers also do it per handshake)."""
        return self._files.refresh() if self._files is not None else False

    # -- the token --

    def token_ok(self, value: str | bytes | None) -> bool:
        """Whether an `authorization` value carries the token (always True when none is configured)."""
        if not self._expected:
            return True
        if value is None:
            return False
        given = value.encode() if isinstance(value, str) else value
        return hmac.compare_digest(given, self._expected)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """gRPC call metadata carrying the token (None without one)."""
        return ((AUTHORIZATION, "Bearer " + self.token.decode()),) if self.token else None

    # -- gRPC --

    def server_credentials(self) -> Any:
        """grpc ServerCredentials from the files; the certificate is re-read when the files change."""
        import grpc

        files = self._files
        assert files is not None

        def config_now() -> Any:
            cert, key, ca = files.pem
            return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

        seen = [files.generation]

        def fetch() -> Any:  # grpc core asks on each new handshake; None: unchanged
            files.refresh()
            if files.generation == seen[0]:
                return None
            seen[0] = files.generation
            return config_now()

        return grpc.dynamic_ssl_server_credentials(config_now(), fetch, require_client_authentication=bool(files.ca))

    def add_port(self, server: Any, address: str) -> int:
        """`server.add_secure_port` with TLS configured, else `add_insecure_port`; returns the port."""
        if self._files is not None:
            return int(server.add_secure_port(address, self.server_credentials()))
        return int(server.add_insecure_port(address))

    def channel_credentials(self) -> Any:
        import grpc

        ca = _read(self.ca, "tls_ca_file") if self.ca else None
        if self.cert:
            cert, key, _ = self._files.pem if self._files is not None else (b"", b"", None)
            return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        return grpc.ssl_channel_credentials(root_certificates=ca)

    def _channel_options(self, options: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
        out = list(options)
        if self.client_tls and self.server_name:
            out.append(("grpc.ssl_target_name_override", self.server_name))
        return out

    def aio_channel(self, address: str, options: Iterable[tuple[str, Any]] = ()) -> Any:
        """A grpc.aio channel to `address`: TLS when this component dials TLS."""
        import grpc

        if self.client_tls:
            return grpc.aio.secure_channel(address, self.channel_credentials(), self._channel_options(options))
        return grpc.aio.insecure_channel(address, list(options))

    def channel(self, address: str, options: Iterable[tuple[str, Any]] = ()) -> Any:
        """A synchronous grpc channel to `address`."""
        import grpc

        if self.client_tls:
            return grpc.secure_channel(address, self.channel_credentials(), self._channel_options(options))
        return grpc.insecure_channel(address, list(options))

    def call_authorized(self, method: str, authorization: str | bytes | None) -> bool:
        """Whether a gRPC call to `method` ("/package.Service/Method") with this `authorization`
        value may run: every call carries the token but health's."""
        if not self._expected or method.startswith(OPEN_SERVICES):
            return True
        return authorization is not None and self.token_ok(authorization)

    def _authorized(self, details: Any) -> bool:
        value = None
        for key, given in details.invocation_metadata or ():
            if key == AUTHORIZATION:
                value = given
                break
        return self.call_authorized(details.method, value)

    def aio_interceptor(self, listener: str) -> Any:
        """A grpc.aio server interceptor: every call but health carries the token, else UNAUTHENTICATED."""
        import grpc

        security = self

        class _TokenCheck(grpc.aio.ServerInterceptor):
            async def intercept_service(self, continuation: Any, details: Any) -> Any:
                handler = await continuation(details)
                if handler is None or security._authorized(details):
                    return handler

                async def deny(request: Any, context: Any) -> Any:
                    security.refused_call(listener, context.peer(), details.method)
                    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

                return _handler_like(handler, deny)

        return _TokenCheck()

    def refused_call(self, listener: str, peer: str, what: str) -> None:
        """Count and log a call or request turned away for its token, on any of the listeners."""
        self.stats.refuse(listener, "unauthenticated")
        log.debug("%s: refused %s from %s: missing or wrong token", listener, what, peer)

    # -- asyncio sockets (Session, metrics) --

    def server_ssl_context(self, alpn: tuple[str, ...] = ()) -> ssl.SSLContext | None:
        """For asyncio servers (create_server, aiohttp): None without TLS; re-reads changed files.
        `alpn`: the application protocols offered (("h2",) for an HTTP/2 server)."""
        if self._files is None:
            return None
        server = self._ssl_servers.get(alpn)
        if server is None:
            server = self._ssl_servers[alpn] = _ReloadingSslContext(self._files, alpn)
        return server.context

    def client_ssl_context(self) -> ssl.SSLContext | None:
        """For asyncio clients: None when this component dials plaintext."""
        if not self.client_tls:
            return None
        context = ssl.create_default_context(cafile=self.ca or None)
        if self.cert:
            context.load_cert_chain(self.cert, self.key)
        return context

    def session_auth_frame(self) -> bytes:
        """The Session socket's first frame's payload when this client has a token ('' without one)."""
        return SESSION_AUTH_PREFIX + self.token if self.token else b""

    def check_session_auth(self, first: bytes) -> bool | None:
        """Judge a Session socket's first frame: True (an auth frame with the token: consumed), None
        (not an auth frame and none needed: a Session message), False (refuse the connection)."""
        if first.startswith(SESSION_AUTH_PREFIX):
            if not self._expected:
                return True  # a client with a token, a server without one: accepted
            return hmac.compare_digest(first[len(SESSION_AUTH_PREFIX) :], self.token)
        return None if not self._expected else False

    def metrics_middleware(self, listener: str = "metrics") -> Any:
        """aiohttp middleware: `Authorization: Bearer <token>` on every request (401 otherwise)."""
        from aiohttp import web

        security = self

        @web.middleware
        async def check(request: web.Request, handler: Any) -> Any:
            if security.token_ok(request.headers.get("Authorization")):
                return await handler(request)
            security.refused_call(listener, str(request.remote), request.path)
            return web.Response(status=401, text="missing or wrong bearer token\n",
                                headers={"WWW-Authenticate": "Bearer"})  # fmt: skip

        return check

    # -- Redis --

    def redis_options(self, url: str) -> dict[str, Any]:
        """Keyword arguments for redis-py's from_url: the password file when the URL has none, and for
        rediss:// the CA and this component's certificate (Redis with tls-auth-clients)."""
        parts = urllib.parse.urlsplit(url)
        options: dict[str, Any] = {}
        if self.redis_password and not parts.password:
            options["password"] = self.redis_password
        if parts.scheme == "rediss":
            if self.ca:
                options["ssl_ca_certs"] = self.ca
            if self.cert:
                options["ssl_certfile"], options["ssl_keyfile"] = self.cert, self.key
        elif parts.hostname and not is_loopback(parts.hostname) and not (parts.password or self.redis_password):
            log.warning("Redis at %s: plaintext and no password beyond loopback (use rediss:// and a password)",
                        parts.hostname)  # fmt: skip
        return options


def _handler_like(handler: Any, deny: Callable[..., Any]) -> Any:
    """An RPC method handler of the same kind as `handler` whose behaviour is `deny`: a streaming
    method must get a streaming handler, or grpc would wait for a request the client never sends."""
    import grpc

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)


def write_secret(path: Path, value: str) -> Path:
    """Write a secret file readable by its owner only (created 0600, never world-readable first)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return path
