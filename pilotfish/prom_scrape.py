"""Read a Prometheus /metrics page: tests, benchmarks and the demo compare figures across processes."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pilotfish.services import http_call

Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(port: int, host: str = "127.0.0.1") -> Samples:
    """Every sample of http://host:port/metrics, by sample name."""
    status, body = http_call(f"http://{host}:{port}/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics on {host}:{port} answered HTTP {status}")
    out: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def metric(port: int, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when there are none)."""
    return sum(v for sample_labels, v in scrape(port).get(name, []) if labels.items() <= sample_labels.items())
