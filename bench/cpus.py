"""Keep the measuring client off vLLM's CPUs: `--vllm-cpus` for the benchmarks that run vLLM on CPU.

vLLM on CPU busy-waits with sched_yield in its engine core and its worker. On this kernel (6.18,
EEVDF) a client sharing those CPUs was measured runnable but waiting for 11.3 of 17 s of a run
at 20 req/s while using 0.4 s of CPU; its event loop stalled up to 2.4 s, and every such stall
read as vLLM's latency. With vLLM on CPU 0 and the client on CPU 1 it waited 0.03 s in total.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Annotated

from msgspec import Meta

HELP = (
    "CPU ids for vLLM (comma-separated); this process (the client) and what it starts besides vLLM get the "
    "rest. auto: the first CPU when there are two or more; none: no pinning (vLLM's busy-waiting then starves "
    "the client on a small machine, and its stalls read as vLLM's)"
)

DEFAULT = "auto"
# --vllm-cpus as a field of a benchmark's config struct: `vllm_cpus: VllmCpus = DEFAULT`
VllmCpus = Annotated[str, Meta(description=HELP)]


def split_cpus(spec: str) -> tuple[set[int] | None, set[int] | None]:
    """(vLLM's CPUs, everyone else's) from --vllm-cpus; (None, None) leaves both unpinned."""
    available = os.sched_getaffinity(0)
    if spec == "none":
        return None, None
    if spec == "auto":
        if len(available) < 2:
            return None, None
        vllm = {min(available)}
    else:
        try:
            vllm = {int(c) for c in spec.split(",") if c.strip()}
        except ValueError:
            raise SystemExit(f"--vllm-cpus: {spec!r} is not auto, none or a list of CPU ids") from None
    rest = available - vllm
    if not vllm <= available or not rest:
        raise SystemExit(f"--vllm-cpus: {spec!r} must name some, not all, of this process's CPUs {sorted(available)}")
    return vllm, rest


@contextlib.contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """Run the block on `cpus` (children started in it inherit them), then go back; None: as is."""
    if not cpus:
        yield
        return
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def worker_cpus(cpus: set[int] | None) -> str | None:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND for `cpus`."""
    return ",".join(str(c) for c in sorted(cpus)) if cpus else None
