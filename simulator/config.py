"""Every simulator setting and its default, once; flags, YAML keys and the README derive from here.

Two structs because two things consume them: `EngineConfig` is the engine model alone (the HTTP
driver and a virtual-time driver both build engines from it); `ServeConfig` is what only the
HTTP fleet needs (ports, model name, tokenizer).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta

# _UNSET marks a flag the user did not type, so YAML values survive untyped flags
from pilotfish.config import _UNSET, ConfigError, add_struct_arguments, load_yaml_mapping, struct_from_mapping


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    max_num_seqs: Annotated[int, Meta(ge=1, description="most requests running at once per engine")] = 256
    max_num_batched_tokens: Annotated[
        int, Meta(ge=1, description="token budget of one engine step (prefill chunks + decodes)")
    ] = 8192
    max_model_len: Annotated[int, Meta(ge=2, description="longest prompt + output one request may have")] = 8192
    block_size: Annotated[int, Meta(ge=1, description="tokens per KV-cache block")] = 16
    num_gpu_blocks: Annotated[int, Meta(ge=1, description="KV-cache blocks per engine")] = 8192
    enable_prefix_caching: Annotated[bool, Meta(description="reuse cached KV blocks of identical prompt prefixes")] = (
        True
    )
    profile: Annotated[str, Meta(description="step-time profile: a name in simulator/profiles/ or a YAML path")] = (
        "llama3-8b-a100"
    )
    step_ms: Annotated[float | None, Meta(description="fixed cost of one step in ms (overrides the profile)")] = None
    prefill_ms_per_token: Annotated[
        float | None, Meta(description="step cost per prefill token in ms (overrides the profile)")
    ] = None
    decode_ms_per_token: Annotated[
        float | None,
        Meta(description="step cost per decoding request in ms (overrides the profile)"),
    ] = None
    step_scale: Annotated[
        float,
        Meta(gt=0, description="every step's time as a multiple of the profile's (after the overrides): a slower "
             "GPU, or one gone slow"),
    ] = 1.0  # fmt: skip
    migration_bandwidth_gbps: Annotated[
        float, Meta(gt=0, description="migration by KV transfer: link bandwidth between engines, gigabits/s")
    ] = 100.0
    kv_bytes_per_token: Annotated[
        int,
        Meta(ge=1, description="KV-cache bytes per token a KV transfer moves (Llama-3-8B bf16: 2 x 32 layers "
             "x 8 KV heads x 128 x 2 B)"),
    ] = 131072  # fmt: skip

    def kv_transfer_seconds(self, num_tokens: int) -> float:
        """How long moving `num_tokens` tokens of KV cache to another engine takes."""
        return num_tokens * self.kv_bytes_per_token * 8 / (self.migration_bandwidth_gbps * 1e9)

    def __post_init__(self) -> None:
        for name in ("step_ms", "prefill_ms_per_token", "decode_ms_per_token"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")


# --answer-faults: how an engine's completions fail fast ("ok": they do not)
ANSWER_FAULTS = ("ok", "refuse", "empty", "cut", "hang")


class ServeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    engines: Annotated[int, Meta(ge=1, description="simulated engines, one port each")] = 2
    host: Annotated[str, Meta(description="address every engine binds")] = "127.0.0.1"
    base_port: Annotated[
        int, Meta(ge=0, le=65535, description="port of engine 0, then +1 per engine (0: any free ports)")
    ] = 8001
    ports: Annotated[
        list[int], Meta(description="explicit ports, one per engine (overrides --engines and --base-port)")
    ] = msgspec.field(default_factory=list)
    model: Annotated[str, Meta(description="model name served and reported in /v1/models")] = "pilotfish-sim"
    engine_id_prefix: Annotated[str, Meta(description="engine ids are <prefix>-0, <prefix>-1, ...")] = "sim"
    tokenizer_path: Annotated[
        str | None, Meta(description="tokenizer.json for prompt tokens (unset: deterministic fallback)")
    ] = None
    default_output_tokens: Annotated[
        int, Meta(ge=1, description="output length when a request gives no max_tokens (ends with stop)")
    ] = 64
    kv_events_endpoint: Annotated[
        str | None,
        Meta(
            description="publish vLLM KV events over ZMQ PUB: engine i binds this tcp://HOST:PORT plus i (unset: off)"
        ),
    ] = None
    kv_events_topic: Annotated[str, Meta(description="ZMQ topic of the KV event messages (vLLM's default: empty)")] = ""
    kv_events_engines: Annotated[
        list[int], Meta(description="engine indices that publish KV events (empty: all, when the endpoint is set)")
    ] = msgspec.field(default_factory=list)
    cms_url: Annotated[
        str,
        Meta(description="Redis URL of a CMS: each engine runs a llumlet that exports its load there (full mode); "
             "empty: none"),
    ] = ""  # fmt: skip
    cms_cluster: Annotated[str, Meta(description="cluster name: the namespace of the llumlets' CMS keys")] = "default"
    step_scales: Annotated[
        list[Annotated[float, Meta(gt=0)]],
        Meta(description="each engine's --step-scale, a pattern repeated over the fleet (1,4: every other engine "
             "four times slower); empty: the engine config's for all"),
    ] = msgspec.field(default_factory=list)
    answer_faults: Annotated[
        list[str],
        Meta(description="each engine's answers, a pattern repeated over the fleet: ok, or a fast failure behind a "
             "live server whose /health answers: refuse (429 to every completion), empty (200 streams with no "
             "body), cut (one token, then the end without data: [DONE]), hang (read the request, pass it to no "
             "engine and answer nothing until the client goes); empty: ok for all"),
    ] = msgspec.field(default_factory=list)  # fmt: skip
    infer_types: Annotated[
        list[str],
        Meta(description="prefill/decode role of each engine in order: neutral, prefill or decode (empty: all "
             "neutral); the llumlet reports it, and a decode engine serves a request naming its prefill engine "
             "in x-prefiller-host-port (one of this fleet's engines) on the KV that engine computed"),
    ] = []  # fmt: skip

    def resolved_ports(self) -> list[int]:
        """One port per engine; 0 asks the kernel for a free one."""
        if self.ports:
            return list(self.ports)
        if self.base_port == 0:
            return [0] * self.engines
        return [self.base_port + i for i in range(self.engines)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", dest="config_path", default=None, help="YAML file of settings (keys as flags)")
    add_struct_arguments(parser, ServeConfig)
    add_struct_arguments(parser, EngineConfig)


def configs_from_args(args: argparse.Namespace) -> tuple[ServeConfig, EngineConfig]:
    """YAML values (one file feeds both structs), then the flags the user typed."""
    path: str | Path | None = getattr(args, "config_path", None)
    values = {str(k).replace("-", "_"): v for k, v in (load_yaml_mapping(path) if path else {}).items()}
    serve_keys = set(ServeConfig.__struct_fields__)
    engine_keys = set(EngineConfig.__struct_fields__)
    unknown = sorted(set(values) - serve_keys - engine_keys)
    if unknown:
        raise ConfigError(f"config file {path}: unknown key {unknown[0]!r}")
    for name in serve_keys | engine_keys:
        given = getattr(args, name, _UNSET)
        if given is not _UNSET:
            values[name] = given
    serve = struct_from_mapping(ServeConfig, {k: v for k, v in values.items() if k in serve_keys})
    engine = struct_from_mapping(EngineConfig, {k: v for k, v in values.items() if k in engine_keys})
    if serve.ports and len(set(serve.ports)) != len(serve.ports):
        raise ConfigError("invalid configuration: --ports lists a port twice")
    return serve, engine
