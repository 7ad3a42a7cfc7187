"""The llumlet's settings, once: defaults and meanings here; environment variables derive from them.

Inside vLLM there is no command line of ours, so every setting is an environment variable named
`PILOTFISH_` + the field in capitals (`cms_url` -> `PILOTFISH_CMS_URL`), or a key of the YAML
file named by `PILOTFISH_LLUMLET_CONFIG` (variables win over the file). With no `cms_url` the
llumlet is off and the engine runs exactly as without the plugin.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Annotated, Any

from msgspec import Meta

from pilotfish.cms.keys import BadId, check_id
from pilotfish.config import ConfigError, _field_info, load_yaml_mapping, struct_from_mapping
from pilotfish.security import Security, SecurityConfig

ENV_PREFIX = "PILOTFISH_"
CONFIG_FILE_ENV = "PILOTFISH_LLUMLET_CONFIG"
INFER_TYPES = ("neutral", "prefill", "decode")


def _doc(description: str, **constraints: Any) -> Meta:
    return Meta(description=description, **constraints)


class LlumletConfig(SecurityConfig, kw_only=True, forbid_unknown_fields=True):
    """The security settings (PILOTFISH_TLS_*, PILOTFISH_AUTH_TOKEN_FILE, ...) come first, as on every component."""

    cms_url: Annotated[str, _doc("Redis URL of the CMS (redis://host:port/db); empty: llumlet off")] = ""
    cluster: Annotated[str, _doc("cluster name, the namespace of every CMS key")] = "default"
    instance_id: Annotated[str, _doc("this engine's id in the CMS; empty: <hostname>-<http port>[-dp<rank>]")] = ""
    advertise_host: Annotated[
        str, _doc("address the scheduler and gateway reach the engine at; empty: vLLM's --host, else 127.0.0.1")
    ] = ""
    http_port: Annotated[int, _doc("the engine's OpenAI port; 0: vLLM's --port", ge=0, le=65535)] = 0
    llumlet_host: Annotated[str, _doc("bind address of the llumlet gRPC server (Migrate, Abort, GetStatus)")] = (
        "127.0.0.1"
    )
    llumlet_port: Annotated[int, _doc("llumlet gRPC port; 0: any free port", ge=0, le=65535)] = 0
    llumlet_token: Annotated[
        str,
        _doc(
            "deprecated, use PILOTFISH_AUTH_TOKEN_FILE (the same token): if set, gRPC callers must send "
            "'authorization: Bearer <token>'; with neither, on loopback every call is open, beyond it (with "
            "PILOTFISH_INSECURE or TLS without client certificates) Abort, Migrate and MigrateIn are refused "
            "and GetStatus carries no request ids"
        ),
    ] = ""
    serve_grpc: Annotated[
        bool,
        _doc(
            "serve the llumlet gRPC API; false: none (no thread of it in the engine's process, and the "
            "rescheduler cannot migrate or abort this engine's requests)"
        ),
    ] = True
    infer_type: Annotated[str, _doc("neutral, prefill or decode (PD disaggregation role)")] = "neutral"
    node_id: Annotated[str, _doc("the machine this engine runs on; empty: the hostname")] = ""
    unit_id: Annotated[str, _doc("the deployment unit (PD group) this engine belongs to")] = ""
    ttl_ms: Annotated[int, _doc("TTL of the metadata and status keys: a dead llumlet vanishes after it", ge=500)] = (
        10_000
    )
    refresh_ms: Annotated[int, _doc("metadata and status are re-written at least this often", ge=100)] = 3_000
    admitted_window_ms: Annotated[
        int, _doc("an admitted request id stays in exported status this long, for readers that skip records", ge=0)
    ] = 2_000
    max_admitted_ids: Annotated[int, _doc("cap on admitted ids per status record (newest kept)", ge=1, le=4096)] = 1024
    stats_log_s: Annotated[
        int, _doc("log the llumlet's own event -> Redis staleness (p50/p99) this often; 0: only at shutdown", ge=0)
    ] = 0
    min_export_interval_us: Annotated[
        int, _doc("least time between two status writes; 0: export on every change, coalesced", ge=0)
    ] = 0
    export_process: Annotated[
        bool,
        _doc(
            "vLLM: write to the CMS from a child process that the engine hands each change through shared "
            "memory (a few us on the engine thread, no system call, no thread of ours in the engine's process); "
            "false: write from the engine's process (engine_thread_writes picks the thread)"
        ),
    ] = True
    exporter_cpus: Annotated[
        str,
        _doc(
            "CPUs the export process runs on: auto (those the engine's process may not use when it is pinned, "
            "else any), inherit (the engine's), or a list such as 2-3,6"
        ),
    ] = "auto"
    exporter_poll_us: Annotated[
        int,
        _doc(
            "how often the export process looks for a change while the engine is busy (it sleeps when idle); "
            "each look costs it ~18 us of CPU on a small VM",
            ge=10,
        ),
    ] = 500
    engine_thread_writes: Annotated[
        bool,
        _doc(
            "write a change from vLLM's engine thread when the socket takes it at once (fresher: event -> view "
            "p99 ~1 ms against ~3.5 ms); false: every write from the export thread (the write's CPU then leaves "
            "the step's critical path)"
        ),
    ] = True
    gil_switch_interval_us: Annotated[
        int,
        _doc(
            "lower the engine process's GIL switch interval (sys.setswitchinterval) to this when the export "
            "thread writes; Python's 5000 us lets an engine thread running Python hold it back that long; 0: leave it",
            ge=0,
        ),
    ] = 1000
    max_migrations: Annotated[
        int,
        _doc("most requests migrating at once, out of and into this engine each (a migrated request counts until "
             "it finishes: its tokens are relayed through the source)", ge=1, le=256),
    ] = 8  # fmt: skip
    migration_accept_timeout_ms: Annotated[
        int, _doc("how long a source waits for the destination to accept a migrating request", ge=100)
    ] = 10_000
    vllm_metrics: Annotated[
        bool,
        _doc(
            "vLLM: show the llumlet's figures (pilotfish_llumlet_*) on vLLM's own /metrics: the exporter writes a "
            "small snapshot file that vLLM's API-server process reads; false: no file, no pilotfish_llumlet_* family"
        ),
    ] = True
    metrics_dir: Annotated[
        str,
        _doc(
            "directory of the llumlets' metrics snapshots, shared by vLLM's API server and engine processes; "
            "empty: pilotfish-llumlet-<uid> under the system's temporary directory"
        ),
    ] = ""
    metrics_interval_ms: Annotated[
        int, _doc("how often the metrics snapshot is re-written (and read at most)", ge=100, le=60_000)
    ] = 1000

    def __post_init__(self) -> None:
        if self.infer_type not in INFER_TYPES:
            raise ValueError(f"infer_type must be one of {', '.join(INFER_TYPES)}, not {self.infer_type!r}")
        if self.refresh_ms * 2 > self.ttl_ms:
            raise ValueError(f"refresh_ms {self.refresh_ms} must be at most half of ttl_ms {self.ttl_ms}")
        cpus = self.exporter_cpus
        if cpus not in ("auto", "inherit") and not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", cpus):
            raise ValueError(f"exporter_cpus must be auto, inherit or a CPU list like 2-3,6, not {cpus!r}")
        try:
            check_id(self.cluster, "cluster")
            if self.instance_id:
                check_id(self.instance_id, "instance_id")
        except BadId as exc:
            raise ValueError(str(exc)) from None

    @property
    def enabled(self) -> bool:
        return bool(self.cms_url)


def llumlet_security(config: LlumletConfig) -> Security:
    """The llumlet's TLS files, token (PILOTFISH_AUTH_TOKEN_FILE, or the older PILOTFISH_LLUMLET_TOKEN) and
    Redis password, read now; raises ConfigError naming the setting."""
    try:
        return Security.from_config(config, legacy_token=config.llumlet_token, legacy_name="PILOTFISH_LLUMLET_TOKEN")
    except ConfigError as exc:
        message = re.sub(r"--([a-z0-9-]+)", lambda m: env_name(m.group(1).replace("-", "_")), str(exc))
        raise ConfigError(f"llumlet: {message}") from None


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def config_from_env(environ: Mapping[str, str] | None = None) -> LlumletConfig:
    """The YAML file named by PILOTFISH_LLUMLET_CONFIG (if any), then PILOTFISH_* variables."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    if path := environ.get(CONFIG_FILE_ENV):
        values.update(load_yaml_mapping(path))
    for name, *_ in _field_info(LlumletConfig):
        if (raw := environ.get(env_name(name))) is not None:
            values[name] = raw
    try:
        return struct_from_mapping(LlumletConfig, values)
    except ConfigError as exc:
        # struct_from_mapping names flags; inside vLLM the operator sets variables
        message = re.sub(r"--([a-z0-9-]+)", lambda m: env_name(m.group(1).replace("-", "_")), str(exc))
        raise ConfigError(f"llumlet: {message}") from None


def env_table() -> str:
    """Markdown table of the variables, for vllm_plugin/README.md (generated, never hand-written)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, _tp, default, description in _field_info(LlumletConfig):
        shown = "unset" if default == "" else f"`{str(default).lower() if isinstance(default, bool) else default}`"
        rows.append(f"| `{env_name(name)}` | {shown} | {description} |")
    return "\n".join(rows)
