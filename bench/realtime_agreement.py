"""`pilotfish bench realtime --agreement`: the reproductions in bench/peers.py against the real routers' choices.

A real router runs in `bench realtime` as usual; every response names the engine that served it
(`x-pilotfish-engine`), and the warm-up requests' engines are kept too. Afterwards the router's
reproduction replays the same requests, in the order they were sent, with the same engine set:
before each request it learns of every request that had finished by then (the real routers'
in-flight counts drop when a stream ends), it says which engines it would choose, and then it
is told where the request really went ("teacher forcing"), so one disagreement does not send
every later decision down another path.

The figure is the expected agreement: the mean, over the requests, of the probability the
reproduction gives the real router's choice. A deterministic decision counts 1 or 0; a tie the
reproduction cannot break (several workers hold the deepest prefix match: upstream takes the
first key of a hash map) counts 1/k when the real choice is one of the k; power-of-two's two
random draws give each worker an exact probability from the loads, so its figure is an expected
rate, and a uniform random pick would score 1/engines.

The real routers keep their workers in an order of their own, neither that of `--worker-urls` nor
the URLs sorted (both were tried): a hash-map order, fixed within one router process. It is the
order `round_robin` cycles through and the order `min_by_key` breaks load ties in, so the replay
learns it from what it sees, and scores what it cannot know yet as a tie:
- round robin: the warm-up requests (one per engine, sequential) reveal the whole cycle;
- cache_aware: the first warm-up (all engines idle) reveals the first worker; after that, a load
  tie among workers whose order is still unknown counts 1/k, and when the tie spans every
  unknown worker the real choice is the next in the order and is learnt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pilotfish.simulator.traces.model import TraceRequest

BLOCK_SIZE = 16  # the simulated engines' KV block size (vLLM's default), the reproductions' block unit


@dataclass(frozen=True, slots=True)
class Reproduction:
    target: str
    make: Callable[[list[int]], Any]  # worker tie order -> a fresh reproduction
    what: str
    random_draws: bool = False  # the policy draws at random: only probabilities compare


def _sglang(order: list[int]) -> Any:
    from pilotfish.bench.peers import SglangCacheAwareRouter

    return SglangCacheAwareRouter(0, order=order)


def _vllm_cache_aware(order: list[int]) -> Any:
    from pilotfish.bench.peers import vllm_router_cache_aware

    return vllm_router_cache_aware(0, order=order)


def _round_robin(order: list[int]) -> Any:
    from pilotfish.bench.peers import RoundRobinPeer

    return RoundRobinPeer(0, order=order)


def _power_of_two(order: list[int]) -> Any:
    from pilotfish.bench.peers import PowerOfTwoRouter

    return PowerOfTwoRouter(0)


REPRODUCTIONS: dict[str, Reproduction] = {
    r.target: r
    for r in (
        Reproduction("sglang-router:cache_aware", _sglang, "SglangCacheAwareRouter (sglang-router 0.3.2 defaults)"),
        Reproduction("vllm-router:cache_aware", _vllm_cache_aware, "vllm_router_cache_aware() (vllm-router 0.1.17)"),
        Reproduction("vllm-router:round_robin", _round_robin, "RoundRobinPeer"),
        Reproduction(
            "vllm-router:power_of_two", _power_of_two, "PowerOfTwoRouter (in-flight counts)", random_draws=True
        ),
    )
}
AGREEMENT_TARGETS = tuple(REPRODUCTIONS)


def route_request(request_id: str, token_ids: Sequence[int]) -> Any:
    from pilotfish.simulator.cluster import RouteRequest
    from pilotfish.simulator.engine.block_hash import block_hashes

    return RouteRequest(request_id, len(token_ids), 1, block_hashes(list(token_ids), BLOCK_SIZE), BLOCK_SIZE)


def power_of_two_probabilities(load: Sequence[int]) -> list[float]:
    """P(pick k): two distinct workers drawn uniformly in order, the first kept unless the second is less loaded."""
    n = len(load)
    if n == 1:
        return [1.0]
    p = [0.0] * n
    share = 1.0 / (n * (n - 1))
    for a in range(n):
        for b in range(n):
            if a != b:
                p[a if load[a] <= load[b] else b] += share
    return p


def replay(
    target: str,
    trace: Sequence[TraceRequest],
    records: Sequence[Any],
    warmup: Sequence[tuple[str, int]],
    engines: int,
    engine_urls: Sequence[str] = (),  # kept for the record: the URLs' order is not the router's
) -> dict[str, Any]:
    """Replay `records` (the real run, one per trace request) through the target's reproduction."""
    import heapq

    from pilotfish.simulator.tokens import fallback_token_ids
    from pilotfish.simulator.traces.prompts import prompt_token_ids

    spec = REPRODUCTIONS[target]
    seen = [k for _, k in warmup if k >= 0]
    first = seen[0] if seen else -1
    if target.endswith("round_robin") and sorted(seen[:engines]) == list(range(engines)):
        known = list(seen[:engines])  # the warm-ups walked the whole cycle
    else:
        known = [first] if first >= 0 else []
    order = known + [k for k in range(engines) if k not in known]
    router = spec.make(list(order))
    router.bind([f"sim-{k}" for k in range(engines)])
    # the warm-up requests: sequential, each done before the next; they count in the router's state
    for i, (text, k) in enumerate(warmup):
        if k < 0:
            continue
        request = route_request(f"warmup-{i}", fallback_token_ids(text))
        _commit(router, request, k, 0.0)
        router.on_finish(request.request_id, k, 0.0)
    by_id = {r.request_id: r for r in trace}
    sent = sorted((rec for rec in records if rec.engine >= 0), key=lambda rec: (rec.arrival, rec.request_id))
    finishing: list[tuple[float, str, int]] = []
    expected = 0.0
    determined = determined_agree = ties = tie_hits = 0
    real_counts = [0] * engines
    repro_counts = [0.0] * engines
    for rec in sent:
        now = rec.arrival
        while finishing and finishing[0][0] <= now:
            _, rid, k = heapq.heappop(finishing)
            router.on_finish(rid, k, now)
        request = route_request(rec.request_id, prompt_token_ids(by_id[rec.request_id]))
        probs = _probabilities(router, request, now, engines, spec.random_draws)
        real = rec.engine
        if getattr(router, "last_reason", "") in ("miss", "imbalanced") and len(known) < engines:
            # a load tie: min_by_key takes the first tied worker in an order partly unknown here
            low = min(router.load)
            tied = [k for k in range(engines) if router.load[k] == low]
            known_tied = [k for k in known if k in tied]
            if not known_tied and len(tied) > 1:  # decided by the unknown part of the order
                probs = [1.0 / len(tied) if k in tied else 0.0 for k in range(engines)]
                unknown = [k for k in range(engines) if k not in known]
                if sorted(tied) == unknown and real in tied:
                    known.append(real)  # the first of the unknown workers in the real order
                    router.order = known + [k for k in range(engines) if k not in known]
        expected += probs[real]
        choices = [k for k, p in enumerate(probs) if p > 0]
        if not spec.random_draws:
            if len(choices) == 1:
                determined += 1
                determined_agree += choices[0] == real
            else:
                ties += 1
                tie_hits += real in choices
        real_counts[real] += 1
        for k, p in enumerate(probs):
            repro_counts[k] += p
        _commit(router, request, real, now)
        end = rec.finished if rec.finished is not None else now
        heapq.heappush(finishing, (end, rec.request_id, real))
    n = len(sent)
    return {
        "reproduction": spec.what,
        "requests": n,
        "unrouted": len(records) - n,
        "expected_agreement": expected / n if n else None,
        "random_draws": spec.random_draws,
        "determined": determined,
        "determined_agree": determined_agree,
        "ties": ties,
        "tie_real_among_choices": tie_hits,
        "uniform_baseline": 1.0 / engines,
        "tie_order": order,
        "learnt_order": list(known),
        "first_warmup_engine": first,
        "real_engine_counts": real_counts,
        "reproduction_expected_counts": [round(c, 2) for c in repro_counts],
    }


def _probabilities(router: Any, request: Any, now: float, engines: int, random_draws: bool) -> list[float]:
    if random_draws:
        return power_of_two_probabilities(router.load)
    choices = router.decide(request, now)
    return [1.0 / len(choices) if k in choices else 0.0 for k in range(engines)]


def _commit(router: Any, request: Any, k: int, now: float) -> None:
    if hasattr(router, "commit"):
        router.commit(request, k, now)
    else:  # power of two: the router's own in-flight count
        router.load[k] += 1


def markdown(agreement: dict[str, dict[str, Any]]) -> list[str]:
    """The report's section: one row per real router."""
    if not agreement:
        return []
    lines = [
        "## Reproductions against the real routers",
        "",
        "Each real router's per-request choices (the engine each response named) against its reproduction in "
        "`bench/peers.py`, replayed over the same requests in the order they were sent, with the finishes the "
        "router had seen, and told the real choice after each decision. Expected agreement: the mean probability "
        "the reproduction gives the real choice (a tie among k prefix holders counts 1/k; power-of-two's draws "
        "give exact probabilities from the loads).",
        "",
        "| real router | reproduction | requests | expected agreement | determined: agree | ties: real among them "
        "| uniform pick | engines (real) | engines (reproduction, expected) |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for target, a in agreement.items():
        if "error" in a:
            lines.append(f"| {target} | - | - | - | - | - | - | {a['error'][:120]} | |")
            continue
        rate = a["expected_agreement"]
        det = "-" if a["random_draws"] else f"{a['determined_agree']}/{a['determined']}"
        tie = "-" if a["random_draws"] else f"{a['tie_real_among_choices']}/{a['ties']}"
        lines.append(
            f"| {target} | {a['reproduction']} | {a['requests']} | "
            f"{'-' if rate is None else f'{rate:.0%}'} | {det} | {tie} | {a['uniform_baseline']:.0%} | "
            f"{a['real_engine_counts']} | {a['reproduction_expected_counts']} |"
        )
    lines += [
        "",
        "Worker order (round robin's cycle, load ties), learnt from the warm-ups and the load ties seen; "
        + "; ".join(
            f"{t}: {a.get('learnt_order')}, first warm-up went to {a.get('first_warmup_engine')}"
            for t, a in agreement.items()
            if "error" not in a
        )
        + ".",
        "",
    ]
    return lines
