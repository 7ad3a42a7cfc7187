"""bench faults' soak: the memory rule on synthetic series (a steady leak fails, a one-time step
then level passes only when Envoy's live bytes come back, noise passes), the in-flight peaks, the
step set against them, and the parsing of Envoy's admin stats."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest

from pilotfish.bench import faults as fb
from pilotfish.bench import faults_soak as fs

CFG = fb.FaultsBenchConfig()  # the shipped rule: 10%/h + 2 MiB/h over the second half, live bytes 10% + 1 MiB
MiB = 1024


def soak(
    rss: Callable[[float], float],
    live: Callable[[float], float] | None = lambda t: 8.0,
    seconds: float = 600,
    every: float = 2,
) -> list[dict]:
    """Samples as measure_soak writes them: envoy and scheduler follow `rss` (MiB), Envoy's live
    bytes follow `live` (MiB; None: its admin never answered)."""
    out = []
    for k in range(int(seconds / every) + 1):
        t = k * every
        kib = round(rss(t) * MiB)
        envoy = {"allocated": live(t) * fs.MIB, "heap_size": 12 * fs.MIB, "rq_active": 6.0,
                 "upstream_cx": 4.0 if t < 150 else 250.0} if live else {}  # fmt: skip
        out.append({"t": float(t), "rss_kib": {"envoy": kib, "scheduler": kib}, "anon_kib": {"envoy": kib - 50 * MiB},
                    "file_kib": {"envoy": 50 * MiB}, "envoy": envoy, "client_in_flight": 6})  # fmt: skip
    return out


def steady_spans(seconds: float = 600, rate: float = 20, duration: float = 0.3) -> list[tuple[float, float]]:
    return [(k / rate, k / rate + duration) for k in range(int(seconds * rate))]


def test_a_steady_leak_is_not_flat() -> None:
    # 15 MiB an hour on 60 MiB: above 10% + 2 MiB; its whole-run growth (2.5 MiB, 4%) passes the old rule
    summary = fs.summarise_memory(soak(lambda t: 60 + 15 * t / 3600), steady_spans(), CFG)
    assert not summary["flat"] and summary["whole_run_flat"]
    assert summary["processes"]["scheduler"]["leak"]["slope_mib_per_hour"] == pytest.approx(15, abs=0.1)
    assert "scheduler: RSS still growing in the second half" in summary["why_not"]
    assert summary["processes"]["scheduler"]["leak"]["quarter_slopes_mib_per_hour"] == pytest.approx([15] * 4, abs=0.2)


def test_growth_that_stops_shows_in_the_last_quarter() -> None:
    # +20 MiB an hour until 450 s, level after (as the simulated engines grow in a 10-minute soak)
    summary = fs.summarise_memory(soak(lambda t: 50 + 20 * min(t, 450) / 3600), steady_spans(), CFG)
    quarters = summary["processes"]["scheduler"]["leak"]["quarter_slopes_mib_per_hour"]
    assert quarters[:2] == pytest.approx([20, 20], abs=0.2) and quarters[3] == 0


@pytest.mark.parametrize(("live_after", "flat"), [(8.0, True), (8.5, True), (14.0, False)])
def test_a_step_then_level_is_flat_only_when_envoys_live_bytes_come_back(live_after: float, flat: bool) -> None:
    # Envoy 67 -> 86 MiB at 150 s, level after; live bytes 8 MiB, up to 20 during the burst, then `live_after`
    def live(t: float) -> float:
        return 8.0 if t < 150 else 20.0 if t < 160 else live_after

    summary = fs.summarise_memory(soak(lambda t: 67 if t < 150 else 86, live), steady_spans(), CFG)
    assert summary["flat"] is flat and not summary["whole_run_flat"]
    assert summary["decided_by"] == "second-half slope and Envoy's live bytes"
    envoy = summary["processes"]["envoy"]
    assert not envoy["leak"]["leak"] and envoy["step"]["rise_mib"] == 19.0
    assert envoy["step"]["made_of"]["anon"] == 19.0 and envoy["step"]["made_of"]["file"] == 0.0
    assert summary["envoy_live"]["max_mib"] == 20.0 and summary["envoy_live"]["returned"] is flat
    if not flat:  # the reason names the connections a burst leaves open, which hold live bytes
        assert summary["why_not"] == [
            f"Envoy's live bytes did not come back to their level after the warm-up (8.0 → {live_after} MiB; "
            "4 → 250 upstream connections open)"
        ]


def test_noise_is_flat() -> None:
    rng = random.Random(7)
    summary = fs.summarise_memory(soak(lambda t: 60 + rng.uniform(-0.3, 0.3)), steady_spans(), CFG)
    assert summary["flat"], summary["why_not"]


def test_without_envoys_live_bytes_the_rule_cannot_say_flat() -> None:
    summary = fs.summarise_memory(soak(lambda t: 60, live=None), steady_spans(), CFG)
    assert not summary["flat"] and summary["envoy_live"] is None
    assert summary["why_not"] == ["Envoy's live bytes were not sampled"]


def test_a_soak_too_short_for_the_slope_falls_back_on_the_whole_run_growth() -> None:
    # 60 s: a second half of 25 s, where +0.2 MiB would extrapolate to ~29 MiB an hour
    summary = fs.summarise_memory(soak(lambda t: 60 + (0.2 if t > 45 else 0), seconds=60), steady_spans(60), CFG)
    assert summary["flat"] and summary["decided_by"].startswith("whole-run growth")
    assert summary["processes"]["envoy"]["leak"]["leak"] and not summary["processes"]["envoy"]["leak"]["decides"]
    grew = fs.summarise_memory(soak(lambda t: 60 + t / 10, seconds=60), steady_spans(60), CFG)
    assert not grew["flat"] and grew["why_not"][0].startswith("envoy: RSS grew")


@pytest.mark.parametrize(
    ("spans", "times", "peaks"),
    [
        ([(0.0, 1.0), (0.5, 1.5), (2.5, 3.0)], [1.0, 2.0, 3.0], [2, 1, 1]),  # the level at a boundary counts
        ([(0.0, 0.1), (0.2, 0.3), (0.4, 0.5)], [1.0], [1]),  # one after another: never two at once
        ([(0.0, -1.0), (0.5, -1.0)], [1.0, 2.0], [2, 2]),  # never ended: in flight to the end
        ([(1.0, 2.0), (2.0, 3.0)], [2.0, 3.0], [1, 1]),  # an end and a start at the same instant
        ([], [1.0], [0]),
    ],
)
def test_inflight_peaks(spans: list[tuple[float, float]], times: list[float], peaks: list[int]) -> None:
    assert fs.inflight_peaks(spans, times) == peaks


def test_a_step_under_a_burst_is_said_to_coincide_and_one_without_is_not() -> None:
    spans = steady_spans()
    spans += [(150.0 + k / 100, 155.0) for k in range(60)]  # 60 more at once, a stalled client catching up
    burst = fs.summarise_memory(soak(lambda t: 67 if t < 152 else 86), spans, CFG)
    step = burst["processes"]["envoy"]["step"]
    assert step["coincides_with_burst"] and step["inflight_peak_at_step"] >= 60
    assert burst["inflight"]["client_peak"] == step["inflight_peak_at_step"]
    assert burst["inflight"]["client_peak_at_s"] == 152.0
    quiet = fs.summarise_memory(soak(lambda t: 67 if t < 400 else 86), spans, CFG)["processes"]["envoy"]["step"]
    assert not quiet["coincides_with_burst"] and quiet["inflight_peak_at_step"] == quiet["inflight_peak_typical"]


def test_largest_step_is_the_biggest_rise_within_the_window() -> None:
    points = [(0.0, 10.0), (10.0, 10.0), (20.0, 11.0), (30.0, 14.0), (40.0, 14.0), (200.0, 20.0)]
    assert fs.largest_step(points, warmup=5, window=20) == {"rise_mib": 4.0, "from_s": 10.0, "to_s": 30.0}


def test_envoys_stats_leave_out_the_admins_own_requests() -> None:
    text = (
        "http.admin.downstream_rq_active: 1\nhttp.inference.downstream_rq_active: 7\n"
        "http.admin.downstream_cx_active: 1\nhttp.inference.downstream_cx_active: 56\n"
        "cluster.picked_pool.upstream_cx_active: 248\ncluster.pilotfish_ext_proc.upstream_cx_active: 2\n"
        "server.memory_allocated: 8388608\nserver.memory_heap_size: 12582912\n"
        "server.memory_physical_size: 15000000\nserver.memory_unknown: 3\ncluster.x: nan\n"
    )
    assert fs.parse_envoy_stats(text) == {
        "rq_active": 7.0,
        "downstream_cx": 56.0,
        "upstream_cx": 250.0,
        "allocated": 8388608.0,
        "heap_size": 12582912.0,
        "physical_size": 15000000.0,
    }
    assert fs.parse_envoy_stats("") == {}


def test_the_soak_report_names_the_rule_and_serialises() -> None:
    memory = fs.summarise_memory(soak(lambda t: 67 if t < 150 else 86), steady_spans(), CFG)
    summary = {"memory_flat": memory.pop("flat"), **memory}
    md = "\n".join(fs.render_memory(summary))
    assert "Memory flat: **yes**, decided by second-half slope and Envoy's live bytes" in md
    assert "By the whole-run rule alone: not flat" in md
    assert "| envoy | 67.0 | 86.0 | 86.0 | 28.4 (over) | 0 (" in md and "+19 at 148-150 s: +19 / +0" in md
    json.dumps(summary)


def test_envoys_memory_page_is_read_with_its_uint64_strings() -> None:
    fields = {"allocated": "7340032", "heap_size": "12582912", "pageheap_free": "1048576", "pageheap_unmapped": "0",
              "total_thread_cache": "2097152", "total_physical_bytes": "15000000"}  # fmt: skip
    text = json.dumps(fields)
    assert fs.parse_envoy_memory(text) == {
        "allocated": 7340032.0,
        "heap_size": 12582912.0,
        "pageheap_free": 1048576.0,
        "pageheap_unmapped": 0.0,
        "thread_cache": 2097152.0,
        "physical_size": 15000000.0,
    }
    assert fs.parse_envoy_memory("not json") == {} and fs.parse_envoy_memory('{"allocated": null}') == {}
