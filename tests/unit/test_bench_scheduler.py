"""`pilotfish bench scheduler`: its requests are ones a gateway could send, and its table has the
thread's CPU time beside the wall clock (bench/scheduler.py)."""

from __future__ import annotations

import argparse
import random
import shlex
from pathlib import Path

from pilotfish.bench import scheduler as bench
from pilotfish.config import struct_from_args


def parse(*argv: str) -> bench.SchedulerBenchConfig:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return struct_from_args(bench.SchedulerBenchConfig, parser.parse_args(list(argv)))


def measured(tmp_path: Path, *argv: str) -> dict:
    """The result a run with these flags makes, its command line included."""
    cfg = parse(*argv)
    result = bench.measure(cfg, bench.chosen_configs(cfg))
    result["command"] = bench.command(cfg, tmp_path)
    return result


def test_a_request_never_carries_more_prefix_blocks_than_its_prompt_fills() -> None:
    rng = random.Random(3)
    prefix = bench.prefix_chains(rng)[0]
    assert len(prefix) == bench.PREFIX_BLOCKS
    for prompt in [16, 17, 31, 32, 100, 127, 128, 129, 4095, *(rng.randrange(16, 4096) for _ in range(200))]:
        req = bench.request("r", prompt, prefix)
        blocks = len(req.prefix_block_hashes)
        assert blocks * bench.BLOCK_SIZE <= prompt
        # every block the prompt fills, up to the prefix's length, and the prefix's own leading hashes
        assert blocks == min(bench.PREFIX_BLOCKS, prompt // bench.BLOCK_SIZE)
        assert tuple(req.prefix_block_hashes) == prefix[:blocks]


def test_decisions_report_wall_and_thread_cpu_time() -> None:
    for full in (False, True):
        fig = bench._decisions(16, full, 50, seed=1)
        for summary in (fig, fig["cpu"]):
            assert summary["n"] == 50
            assert 0 < summary["p50_us"] <= summary["p99_us"]


def test_table_has_the_cpu_columns_and_the_command_its_sizes(tmp_path: Path) -> None:
    result = measured(tmp_path, "--configs", "default", "--decisions-only", "--sizes", "16", "--decisions", "20")
    md = bench.render_markdown(result)
    assert "| CPU p50 µs | CPU p99 µs |" in md
    rows = [line for line in md.splitlines() if line.startswith("| lite default") or line.startswith("| full default")]
    # the shipped default in each mode, as it is and re-keyed between decisions (the re-keying's own lines after)
    assert len(rows) == 4 and all(len(r.split("|")) == 11 for r in rows)
    rekeyed = [line for line in md.splitlines() if line.startswith("- ") and "re-keyed between decisions" in line]
    assert len(rekeyed) == 2 and all(" µs, p50 " in line for line in rekeyed)
    assert "--sizes 16 --decisions 20" in result["command"]
    # a result written before the CPU column renders still, its CPU cells empty
    old = {k: {kk: vv for kk, vv in v.items() if kk != "cpu"} for k, v in result["decisions"].items()}
    assert "| 16 |" in bench.render_markdown({**result, "decisions": old})


def test_a_repeat_share_asks_one_prompt_again_and_says_so(tmp_path: Path) -> None:
    asked: list[tuple[int, tuple[int, ...]]] = []
    request = bench.request

    def recorded(request_id: str, prompt_tokens: int, prefix: tuple[int, ...]):  # type: ignore[no-untyped-def]
        req = request(request_id, prompt_tokens, prefix)
        asked.append((prompt_tokens, tuple(req.prefix_block_hashes)))
        return req

    bench.request = recorded  # type: ignore[assignment]
    try:
        bench._decisions(16, True, 400, seed=1, repeat_share=0.5)
    finally:
        bench.request = request  # type: ignore[assignment]
    repeated = [a for a in asked if a[0] == bench.REPEATED_TOKENS]
    # one prompt, all of its tokens in whole blocks, asked about half the time (400 timed + 80 warm-up)
    assert len({hashes for _, hashes in repeated}) == 1
    assert len(repeated[0][1]) * bench.BLOCK_SIZE == bench.REPEATED_TOKENS
    assert 160 < len(repeated) < 320
    result = measured(tmp_path, "--configs", "full default", "--decisions-only", "--sizes", "16", "--decisions", "20",
                      "--repeat-share", "0.5")
    assert "--repeat-share 0.5" in result["command"]
    assert "50% of the decisions ask one 64-token prompt again" in bench.render_markdown(result)


def test_index_blocks_time_the_collector_over_a_filled_index(tmp_path: Path) -> None:
    result = measured(tmp_path, "--configs", "full default", "--decisions-only", "--sizes", "4", "--decisions", "20",
                      "--index-blocks", "600")
    collector = result["collector"]
    # 4 engines of 600 blocks: 3 prompts of 256 blocks each (the last cut by the capacity), some shared
    assert collector["instances"] == 4 and collector["blocks_per_instance"] == 600
    assert 600 <= collector["blocks"] <= 4 * 600 and collector["full_pass_ms"] > 0
    assert "--index-blocks 600" in result["command"]
    assert "## The garbage collector's full pass (4 engines, 600 blocks each" in bench.render_markdown(result)


def test_other_statuses_update_that_many_engines_after_each_decision(tmp_path: Path) -> None:
    made: list[int] = []
    status = bench._status

    def counted(k: int, update_id: int, rng: random.Random, admitted: list[str] = ()):  # type: ignore[no-untyped-def,assignment]
        made.append(k)
        return status(k, update_id, rng, admitted)

    bench._status = counted  # type: ignore[assignment]
    try:
        for others in (0, 3):
            made.clear()
            bench._decisions(16, True, 50, seed=1, other_statuses=others)
            # 16 at the start, then per decision (50 timed + 10 warm-up) the chosen engine's and the others
            assert len(made) == 16 + 60 * (1 + others)
    finally:
        bench._status = status  # type: ignore[assignment]
    result = measured(tmp_path, "--configs", "full default", "--decisions-only", "--sizes", "16", "--decisions", "20",
                      "--other-statuses", "8")
    assert "--other-statuses 8" in result["command"]
    assert "8 status update(s) of other engines after each decision" in bench.render_markdown(result)


def test_the_command_quotes_a_configuration_label_with_a_space(tmp_path: Path) -> None:
    cfg = parse("--configs", "full default", "--decisions-only")
    line = bench.command(cfg, tmp_path)
    assert "--configs 'full default' --decisions-only" in line
    # and it parses back to the same configuration
    again = parse(*shlex.split(line)[3:-2])
    assert again.configs == ["full default"] and again.decisions_only
