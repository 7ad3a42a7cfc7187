"""bench faults: the functions that turn records into figures and goals, the report, the config,
and a --quick smoke run through the real stack (skipped without Envoy)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pilotfish.bench import faults as fb
from pilotfish.bench import faults_soak as fs
from pilotfish.bench.faults import FAULTS, INCOMPLETE, OK, Record, Window

ROOT = Path(__file__).resolve().parents[2]
T = fb.TARGET_ENGINE


def rec(t: float, outcome: str = OK, instance: str = "sim-0", route: str = "scheduler", end: float = 0.0) -> Record:
    return Record(t_send=t, t_end=end or t + 0.2, outcome=outcome, instance=instance, route=route)


def sample(t: float, dispatched: float, up: bool = True) -> dict:
    if not up:
        return {"t": t, "up": False}
    return {"t": t, "up": True, "dispatch": {T: dispatched}, "inflight": {T: 0.0}, "ejected": {T: 0.0},
            "account": 0.0, "account_entries": 0.0, "staleness_max": None}  # fmt: skip


def test_outcome_counts_group_failures_by_the_error_the_client_saw() -> None:
    records = [rec(0), rec(1), rec(2, INCOMPLETE), rec(3, "HTTP 503: upstream connect error"), rec(4, INCOMPLETE)]
    assert fb.outcome_counts(records) == {
        "sent": 5,
        "ok": 2,
        "failed": 3,
        "failed_by_error": {INCOMPLETE: 2, "HTTP 503: upstream connect error": 1},
        "incomplete_streams": 2,
        "slower_than_2s": 0,
        "longest_s": 0.2,
    }


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (503, b"upstream connect error or disconnect/reset before headers.   reset reason: connection failure",
         "HTTP 503: upstream connect error or disconnect/reset befor"),
        (500, b"", "HTTP 500"),
        (429, b'{"error":\n  "busy"}', 'HTTP 429: {"error": "busy"}'),
    ],
)  # fmt: skip
def test_http_error_keeps_the_start_of_the_body_on_one_line(status: int, body: bytes, expected: str) -> None:
    assert fb.http_error(status, body) == expected


def test_engine_figures_count_picks_after_one_second_and_the_bound() -> None:
    # killed at 10, restarted at 20, answering at 20.5
    w = Window(start=10.0, restart=20.0, back=20.5, inflight_at_start=2)
    records = [
        rec(9.5, instance=T, end=10.3),  # in flight on it at the kill (client side: 1; scheduler said 2)
        rec(9.9, instance="sim-0", end=10.1),
        rec(10.2, INCOMPLETE, instance=T),  # picked in the first second
        rec(10.6, instance=T),  # the last pick while down: detect 0.6
        rec(10.8),
        rec(12.0, instance=T),  # picked after 1 s: counted
        rec(21.0, INCOMPLETE, instance=T),
        rec(21.4, instance=T),  # first good pick after it is back: recover 0.9
    ]
    samples = [sample(10.9, 5), sample(11.2, 5), sample(15.0, 6), sample(19.9, 6), sample(20.2, 9)]
    figures = fb.engine_figures(records, [w], samples)
    assert figures["routed_to_faulty_during"] == 3
    assert figures["routed_to_faulty_after_1s"] == 1
    assert figures["dispatched_to_faulty_after_1s"] == 1  # samples 11.2 .. 19.9
    assert figures["inflight_on_faulty_at_fault"] == 2
    assert figures["sent_first_second"] == 3  # 10.2, 10.6, 10.8
    assert figures["failed_bound"] == 5
    assert figures["detect_s"] == 2.0  # the last pick while down, 12.0, less 10
    assert figures["recover_s"] == 0.9


def test_engine_figures_with_no_pick_while_down_detect_at_once_and_unknown_recovery() -> None:
    w = Window(start=5.0, restart=8.0, back=8.2)
    records = [rec(4.0, instance=T), rec(5.5), rec(9.0)]
    figures = fb.engine_figures(records, [w], [sample(5.1, 3, up=False)])
    assert figures["detect_s"] == 0.0
    assert figures["recover_s"] is None  # never picked again before the load stopped
    assert figures["dispatched_to_faulty_after_1s"] is None  # no two samples: unknown, not zero


def test_engine_figures_over_flaps_add_up_and_take_the_worst() -> None:
    windows = [Window(1.0, 2.0, 2.1), Window(4.0, 5.0, 5.1)]
    records = [rec(1.2, instance=T), rec(2.5, instance=T), rec(4.9, instance=T), rec(6.0, instance=T)]
    figures = fb.engine_figures(records, windows, [])
    assert figures["routed_to_faulty_during"] == 2
    assert figures["routed_to_faulty_after_1s"] == 0  # 4.9 is within 1 s of 4.0
    assert figures["detect_s"] == 0.9
    assert figures["recover_s"] == 0.9  # max(2.5 - 2.1, 6.0 - 5.1)


def test_component_figures_detect_the_first_request_served_around_and_recover_after_the_restart() -> None:
    w = Window(start=3.0, restart=6.0, back=6.4)
    records = [
        rec(2.0),
        rec(3.1, "HTTP 500: ext_proc"),  # failed: not a detection
        rec(3.5, route="fallback"),  # served around it: detect 0.5
        rec(6.5, route="fallback"),  # still not via the scheduler after the restart: recover 0.5
        rec(7.0),
    ]
    figures = fb.component_figures(records, [w])
    assert figures == {"detect_s": 0.5, "recover_s": 0.5, "answers_after_restart_s": 0.4,
                       "recover_after_answering_s": 0.1, "not_via_scheduler": 3}  # fmt: skip


def test_component_figures_when_the_client_never_saw_the_fault() -> None:
    figures = fb.component_figures([rec(1.0), rec(4.0), rec(8.0)], [Window(3.0, 6.0, 6.2)])
    assert figures["detect_s"] is None and figures["recover_s"] == 0.0 and figures["not_via_scheduler"] == 0


def test_per_second_buckets_by_send_time() -> None:
    rows = fb.per_second([rec(0.1, instance=T), rec(0.9, INCOMPLETE, route=""), rec(2.5, instance=T)], T)
    assert rows == [
        {"t": 0, "ok": 1, "failed": 1, "picked": 1, "around": 1},
        {"t": 1, "ok": 0, "failed": 0, "picked": 0, "around": 0},
        {"t": 2, "ok": 1, "failed": 0, "picked": 1, "around": 0},
    ]
    assert fb.per_second([]) == []


@pytest.mark.parametrize(
    ("points", "flat"),
    [
        ([(0, 50_000), (10, 100 * 1024), (20, 100 * 1024), (30, 104 * 1024)], True),  # 4% after the warm-up
        ([(0, 100 * 1024), (10, 100 * 1024), (20, 110 * 1024), (30, 120 * 1024)], False),  # +20%
        ([(10, 10 * 1024), (30, 11 * 1024)], True),  # +1 MiB on a small process
    ],
)
def test_rss_growth_is_measured_after_the_warmup(points: list[tuple[float, int]], flat: bool) -> None:
    growth = fs.rss_growth(points, warmup=10, flat_pct=5.0)
    assert growth["flat"] is flat
    assert growth["first_mib"] == points[1][1] / 1024 if len(points) > 2 else growth["first_mib"] == 10.0


def test_rss_growth_slope_is_per_minute() -> None:
    growth = fs.rss_growth([(0, 1024), (30, 2048), (60, 3072)], warmup=0, flat_pct=5.0)
    assert growth["slope_mib_per_min"] == 2.0
    assert growth["growth_mib"] == 2.0 and not growth["flat"]
    assert growth["second_half_growth_mib"] == 1.0


def test_rss_growth_tells_a_step_that_levels_off_from_a_climb() -> None:
    step = [(t, 100 * 1024 + (20 * 1024 if t >= 100 else 0)) for t in range(0, 600, 10)]
    growth = fs.rss_growth(step, warmup=10, flat_pct=5.0)
    assert growth["growth_mib"] == 20.0 and not growth["flat"] and growth["second_half_growth_mib"] == 0.0


def _entry(**figures: object) -> dict:
    base = {"failed": 0, "account_after": {"drained": True, "account": 0.0, "inflight_requests": 0.0,
                                           "account_entries": 0.0, "seconds": 0.2}}  # fmt: skip
    return base | figures


def test_goals_of_an_engine_kill() -> None:
    entry = _entry(failed=3, failed_bound=5, routed_to_faulty_after_1s=0,
                   dispatched_to_faulty_after_1s=1.0,
                   envoy_retries={"upstream_rq_retry": 4.0, "upstream_rq_retry_success": 4.0})  # fmt: skip
    met = {g["goal"]: g["met"] for g in fb.goals(FAULTS["engine-kill"], entry)}
    assert met == {
        "failed <= in flight on it + sent in the first second": True,
        "none routed to it after 1 s": False,  # the scheduler dispatched one
        "retried requests succeed": True,
        "the scheduler's account drains to zero": True,
    }


def test_goals_of_a_stall_and_of_a_component() -> None:
    stall = {g["goal"]: g["met"] for g in fb.goals(FAULTS["engine-stall"], _entry(detect_s=4.2))}
    assert stall["new requests stop going to it within 2 s"] is False
    undrained = _entry(failed=0, recover_s=1.5)
    undrained["account_after"] = undrained["account_after"] | {"drained": False, "account": 3.0}
    met = {g["goal"]: g["met"] for g in fb.goals(FAULTS["scheduler-kill"], undrained)}
    assert met == {"zero failed": True, "recovery <= 2 s": True, "the scheduler's account drains to zero": False}


def test_quick_shortens_what_the_user_did_not_set() -> None:
    cfg = fb.FaultsBenchConfig(quick=True, rate=7.0)
    quick = cfg.effective({"quick", "rate"})
    assert quick.faults == ["engine-kill"] and quick.rate == 7.0 and quick.soak_seconds == 4.0
    assert fb.FaultsBenchConfig().effective(set()) == fb.FaultsBenchConfig()
    assert fb.FaultsBenchConfig().soak_seconds == 60.0 and set(fb.FaultsBenchConfig().faults) == set(FAULTS)


def test_every_fault_has_an_injector_or_says_why_not() -> None:
    for name, fault in FAULTS.items():
        assert (name in fb.INJECT) != (fault.kind == "not-applicable"), name


def test_an_unknown_fault_is_refused_naming_the_flag(tmp_path: Path) -> None:
    from pilotfish.config import ConfigError

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    fb.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path), "--faults", "engine-kill,disk-full"])
    with pytest.raises(ConfigError, match="--faults: 'disk-full'"):
        fb.run(args)


def test_the_report_has_a_row_per_fault_and_the_soak() -> None:
    kill = _entry(fault="engine-kill", mode="lite", kind="engine", applies=True, what="w", models="m",
                  sent=10, ok=9, failed=1, incomplete_streams=1, routed_to_faulty_after_1s=0,
                  dispatched_to_faulty_after_1s=0.0, detect_s=0.3, recover_s=0.5, failed_by_error={INCOMPLETE: 1},
                  skipped_by_client_cap=0, routes={"scheduler": 10}, events=[{"t": 1.0, "what": "kill"}],
                  wall_seconds=20.0, timeline_png="timeline-engine-kill.png", goals=[])  # fmt: skip
    kill["goals"] = [{"goal": "g", "met": True, "figure": "f"}]
    na = {"fault": "llumlet-export-kill", "mode": "full", "applies": False, "what": "w", "models": "m",
          "reason": fb.EXPORT_PROCESS_NOT_APPLICABLE}  # fmt: skip
    samples = [{"t": float(t), "rss_kib": {"scheduler": 1024}} for t in range(0, 61, 2)]
    memory = fs.summarise_memory(samples, [(0.0, 0.5)], fb.FaultsBenchConfig())
    soak = {"seconds": 60.0, "rate": 20.0, "sent": 1200, "ok": 1200, "failed": 0, "memory_flat": memory.pop("flat"),
            "account_after": {"drained": True}, "rss_png": "soak-rss.png", **memory}  # fmt: skip
    settings = {"rate": 20.0, "max_tokens": 32, "stream_tokens": 128}
    md = fb.render_markdown({"wall_seconds": 300.0, "settings": settings, "faults": [kill, na], "soak": soak})
    assert "| engine-kill | lite | 10 | 9 | 1 | 1 | 0 / 0 | 0.3 | 0.5 | yes | 1 of 1 met |" in md
    assert "| llumlet-export-kill | full |" in md and "does not apply" in md
    assert "| scheduler | 1.0 | 1.0 | 1.0 | 0 | 0 (2.1) | no (too short) |" in md and "## Soak: 60 s at 20/s" in md
    assert "Memory flat: **yes**, decided by whole-run growth" in md
    json.dumps({"faults": [kill, na], "soak": soak})  # result.json must serialise


@pytest.mark.integration
def test_quick_run_through_the_real_stack(tmp_path: Path) -> None:
    """`pilotfish bench faults --quick`: one engine kill and a short soak, about 20 s on an idle 2-core machine."""
    from pilotfish.services import MissingBinary, envoy_binary

    try:
        envoy_binary()
    except MissingBinary as exc:
        pytest.skip(str(exc))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "pilotfish", "bench", "faults", "--out", str(out), "--quick", "--soak-seconds", "3"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    (kill,) = result["faults"]
    assert kill["fault"] == "engine-kill" and kill["sent"] > 0
    assert kill["account_after"]["drained"], kill["account_after"]
    assert kill["sent"] == kill["ok"] + kill["failed"]
    assert (out / "report.md").read_text().startswith("# bench faults")
    assert result["soak"]["processes"] and result["soak"]["sent"] > 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "timeline-engine-kill.png").stat().st_size > 0 and (out / "soak-rss.png").exists()
