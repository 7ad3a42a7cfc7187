"""/metrics in Prometheus text format under vLLM's metric names and labels."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pilotfish.simulator.engine.base import EngineStats

if TYPE_CHECKING:
    from pilotfish.simulator.config import EngineConfig
    from pilotfish.simulator.server.latency import Histogram, LatencyHistograms


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(stats: EngineStats, model: str, config: EngineConfig | None = None,
                   latency: LatencyHistograms | None = None) -> str:
    # vLLM V1 labels every series with the model and the engine-core index (one core here).
    labels = f'model_name="{_escape(model)}",engine="0"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, value: float, extra: str = "") -> None:
        family = name.removesuffix("_total") if kind == "counter" else name
        if not any(line.startswith(f"# HELP {family} ") for line in lines):
            lines.append(f"# HELP {family} {help_}")
            lines.append(f"# TYPE {family} {kind}")
        lines.append(f"{name}{{{labels}{extra}}} {float(value)}")

    metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
           stats.num_running)
    metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
           stats.num_waiting)
    metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
           stats.kv_cache_usage)
    # the pre-0.10 name of the same gauge, still read by many dashboards and routers
    metric("vllm:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage. 1 means 100 percent usage.",
           stats.kv_cache_usage)
    metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
           stats.prompt_tokens_total)
    metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
           stats.generation_tokens_total)
    metric("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
           stats.num_preemptions_total)
    metric("vllm:prefix_cache_queries_total", "counter",
           "Prefix cache queries, in terms of number of queried tokens.", stats.prefix_cache_queries_total)
    metric("vllm:prefix_cache_hits_total", "counter",
           "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_cache_hits_total)
    for reason in ("stop", "length", "abort"):
        metric("vllm:request_success_total", "counter", "Count of successfully processed requests.",
               stats.finished_total.get(reason, 0), f',finished_reason="{reason}"')
    if latency is not None:
        _histogram(lines, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                   latency.ttft, labels)
        _histogram(lines, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                   latency.itl, labels)
    if config is not None:
        # vLLM's info gauge: the CacheConfig fields as labels, plus the engine index, and no model_name
        info = (f'block_size="{config.block_size}",cache_dtype="auto",'
                f'enable_prefix_caching="{config.enable_prefix_caching}",engine="0",'
                f'num_gpu_blocks="{config.num_gpu_blocks}"')
        lines.append("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig")
        lines.append("# TYPE vllm:cache_config_info gauge")
        lines.append(f"vllm:cache_config_info{{{info}}} 1.0")
    return "\n".join(lines) + "\n"


def _histogram(lines: list[str], name: str, help_: str, hist: Histogram, labels: str) -> None:
    lines.append(f"# HELP {name} {help_}")
    lines.append(f"# TYPE {name} histogram")
    for le, count in hist.cumulative():
        lines.append(f'{name}_bucket{{{labels},le="{le}"}} {float(count)}')
    lines.append(f"{name}_count{{{labels}}} {float(hist.count)}")
    lines.append(f"{name}_sum{{{labels}}} {hist.sum}")
