"""Trace loaders and transforms: shared ids share token prefixes at any block size, lengths are
exact, Azure timestamps parse, compression and looping keep what they promise."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from pilotfish.simulator.engine.block_hash import block_hashes
from pilotfish.simulator.tokens import fallback_token_ids
from pilotfish.simulator.traces import (
    SharedPrefixSpec,
    compress,
    load_azure,
    load_burstgpt,
    load_mooncake,
    load_trace_file,
    loop_to,
    prompt_text,
    prompt_token_ids,
    resolve_trace,
    shared_prefix_trace,
    take_duration,
)

ROWS = [
    {"timestamp": 0, "input_length": 1200, "output_length": 5, "hash_ids": [1, 2, 3]},
    {"timestamp": 500, "input_length": 1100, "output_length": 7, "hash_ids": [1, 2, 4]},
    {"timestamp": 1500, "input_length": 600, "output_length": 3, "hash_ids": [1, 5]},
    {"timestamp": 2000, "input_length": 512, "output_length": 1, "hash_ids": [6]},
]


@pytest.fixture
def mooncake(tmp_path: Path) -> Path:
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def shared_blocks(a: list[int], b: list[int], block_size: int) -> int:
    n = 0
    for x, y in zip(block_hashes(a, block_size), block_hashes(b, block_size), strict=False):
        if x != y:
            break
        n += 1
    return n


def test_mooncake_lengths_are_exact_and_the_last_block_partial(mooncake: Path) -> None:
    trace = load_mooncake(mooncake)
    assert [r.input_length for r in trace] == [1200, 1100, 600, 512]
    assert [len(prompt_token_ids(r)) for r in trace] == [1200, 1100, 600, 512]
    assert trace[0].segments[-1] == ("mc:3", 1200 - 1024)
    assert [r.arrival for r in trace] == [0.0, 0.5, 1.5, 2.0]
    assert [r.output_length for r in trace] == [5, 7, 3, 1]


@pytest.mark.parametrize("block_size", [16, 64])
def test_shared_hash_ids_share_exactly_their_token_prefix(mooncake: Path, block_size: int) -> None:
    a, b, c, d = (prompt_token_ids(r) for r in load_mooncake(mooncake))
    per_id = 512 // block_size
    assert a[:1024] == b[:1024] and a[1024:1100] != b[1024:1100]
    assert shared_blocks(a, b, block_size) == 2 * per_id  # ids 1, 2 shared; 3 vs 4 differ at once
    assert shared_blocks(a, c, block_size) == per_id
    assert shared_blocks(a, d, block_size) == 0


def test_a_partial_last_block_is_a_prefix_of_the_full_block(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 700, "output_length": 1, "hash_ids": [9, 8]}) + "\n"
                    + json.dumps({"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [9, 8]}))
    short, full = (prompt_token_ids(r) for r in load_mooncake(path))
    assert full[:700] == short


def test_mooncake_rejects_lengths_that_do_not_match_the_blocks(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_mooncake(path)


def test_mooncake_style_blocks_of_16_and_seconds_are_read_off_the_file(tmp_path: Path) -> None:
    # Alibaba's Qwen traces: the same fields, blocks of 16 tokens, timestamps in seconds, more fields
    path = tmp_path / "qwen.jsonl"
    rows = [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 100.25, "input_length": 40, "output_length": 9,
         "type": "text", "turn": 1, "hash_ids": [7, 8, 9]},
        {"chat_id": 2, "parent_chat_id": 1, "timestamp": 101.5, "input_length": 33, "output_length": 4,
         "type": "text", "turn": 2, "hash_ids": [7, 8, 10]},
        {"chat_id": 3, "parent_chat_id": -1, "timestamp": 100.0, "input_length": 5, "output_length": 1,
         "type": "text", "turn": 1, "hash_ids": []},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = load_trace_file(path)
    assert [r.arrival for r in trace] == [0.0, 0.25, 1.5]  # seconds, from the first request's
    assert [r.input_length for r in trace] == [5, 40, 33]
    assert trace[1].segments == (("mc:7", 16), ("mc:8", 16), ("mc:9", 8))
    assert trace[2].segments[:2] == trace[1].segments[:2]  # ids 7, 8 shared: 32 tokens
    assert trace[0].segments == (("mc:own:2", 5),)  # no hash ids: a prompt of its own
    # the block size given, the same trace
    assert load_mooncake(path, block_tokens=16) == trace


def test_a_block_size_is_the_largest_every_record_fits(tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl"
    # 300 tokens in 2 blocks: 256 fits (256 < 300 <= 512), 512 does not (300 <= 512 in one block)
    path.write_text(json.dumps({"timestamp": 0, "input_length": 300, "output_length": 1, "hash_ids": [1, 2]}) + "\n"
                    + json.dumps({"timestamp": 5, "input_length": 200, "output_length": 1, "hash_ids": [1]}) + "\n")
    trace = load_mooncake(path)
    assert trace[0].segments == (("mc:1", 256), ("mc:2", 44))
    assert trace[1].segments == (("mc:1", 200),)


def test_burstgpt_rows_leave_out_failures_and_sort(tmp_path: Path) -> None:
    path = tmp_path / "BurstGPT_1.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "5,ChatGPT,472,18,490,Conversation log\n"
                    "3.5,GPT-4,1200,0,1200,Conversation log\n"
                    "2,ChatGPT,0,77,77,API log\n")
    trace = load_burstgpt(path)
    assert [(r.arrival, r.input_length, r.output_length) for r in trace] == [(0.0, 1, 77), (3.0, 472, 18)]
    assert load_trace_file(path) == trace  # told from Azure's by the header
    assert len({r.segments[0][0] for r in trace}) == 2  # nothing shared


def test_a_csv_of_neither_format_is_refused_with_its_columns(tmp_path: Path) -> None:
    path = tmp_path / "other.csv"
    path.write_text("time,prompt,answer\n1,2,3\n")
    with pytest.raises(ValueError, match=r"other\.csv: a CSV trace needs the columns .*its header has answer, prompt"):
        load_trace_file(path)
    bad = tmp_path / "bad.csv"
    bad.write_text("Timestamp,Request tokens,Response tokens\n1,x,3\n")
    with pytest.raises(ValueError, match=r"bad\.csv:2: not a BurstGPT trace row"):
        load_trace_file(bad)


def test_prompt_text_tokenizes_back_to_the_same_ids(mooncake: Path) -> None:
    for request in load_mooncake(mooncake):
        assert fallback_token_ids(prompt_text(request)) == prompt_token_ids(request)


def test_azure_rows_parse_with_seven_fraction_digits(tmp_path: Path) -> None:
    path = tmp_path / "az.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:17:04.0319600,3180,8\n"
                    "2023-11-16 18:17:03.9799600,4808,10\n"
                    "2023-11-16 18:17:05.5000000,0,0\n")
    trace = load_azure(path)
    assert [r.input_length for r in trace] == [4808, 3180, 1]  # sorted by time; empty prompts become 1 token
    assert [r.output_length for r in trace] == [10, 8, 1]
    assert trace[0].arrival == 0.0
    assert trace[1].arrival == pytest.approx(0.052, abs=1e-6)
    assert trace[2].arrival == pytest.approx(1.52004, abs=1e-6)
    assert len({r.segments[0][0] for r in trace}) == 3  # nothing shared


def test_compression_scales_arrivals_and_keeps_requests(mooncake: Path) -> None:
    trace = load_mooncake(mooncake)
    fast = compress(trace, 4.0)
    assert [r.arrival for r in fast] == [0.0, 0.125, 0.375, 0.5]
    assert [r.segments for r in fast] == [r.segments for r in trace]
    assert [r.request_id for r in take_duration(trace, 1.0)] == ["mc-0", "mc-1"]
    with pytest.raises(ValueError):
        compress(trace, 0)


def test_looping_repeats_the_rate_with_fresh_prefixes(mooncake: Path) -> None:
    trace = load_mooncake(mooncake)  # last arrival 2.0 s: a 3 s lap
    looped = loop_to(trace, 7.0)
    assert [r.arrival for r in looped] == [0.0, 0.5, 1.5, 2.0, 3.0, 3.5, 4.5, 5.0, 6.0, 6.5]
    assert len({r.request_id for r in looped}) == len(looped)
    lap0, lap1 = prompt_token_ids(looped[0]), prompt_token_ids(looped[4])
    assert len(lap0) == len(lap1) and shared_blocks(lap0, lap1, 16) == 0
    # within a lap, sharing is as in the original
    assert shared_blocks(prompt_token_ids(looped[4]), prompt_token_ids(looped[5]), 16) == 64


def test_synthetic_groups_share_their_system_prompt() -> None:
    spec = SharedPrefixSpec(groups=3, prompts_per_group=4, system_prompt_length=(40, 80), question_length=(8, 16),
                            output_length=(2, 5), rate=10.0, seed=7)
    trace = shared_prefix_trace(spec)
    assert trace == shared_prefix_trace(spec)  # seeded
    assert len(trace) == 12
    assert all(a.arrival < b.arrival for a, b in itertools.pairwise(trace))
    by_group: dict[str, list[list[int]]] = {}
    for r in trace:
        assert 48 <= r.input_length <= 96 and 2 <= r.output_length <= 5
        by_group.setdefault(r.segments[0][0], []).append(prompt_token_ids(r))
    assert len(by_group) == 3
    for key, prompts in by_group.items():
        n = next(r.segments[0][1] for r in trace if r.segments[0][0] == key)
        assert all(p[:n] == prompts[0][:n] for p in prompts)
        assert len({tuple(p[n:]) for p in prompts}) == len(prompts)


def test_traces_resolve_from_a_folder_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "t.jsonl").write_text("")
    assert resolve_trace("t.jsonl", tmp_path) == tmp_path / "t.jsonl"
    monkeypatch.setenv("PILOTFISH_TRACE_DIR", str(tmp_path))
    assert resolve_trace("t.jsonl") == tmp_path / "t.jsonl"
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        resolve_trace("nope.jsonl", tmp_path)


def test_a_short_segment_draws_the_same_tokens_as_a_whole_chunk_begins_with() -> None:
    """A short segment's tokens (a trace of 16-token blocks) are made alone, and are the first tokens of the
    same key's longer segments, as before: simulated prefixes and hits do not change with the block size."""
    from pilotfish.simulator.traces.prompts import segment_text, segment_token_ids

    for key in ("mc:7", "qw:123456", "fam-sys:0:sys"):
        whole = segment_token_ids((key, 1300))
        for length in (1, 2, 3, 15, 16, 17, 255, 511, 512, 513):
            assert segment_token_ids((key, length)) == whole[:length]
            assert fallback_token_ids(segment_text((key, length))) == whole[:length]


def test_a_chunks_draws_are_the_prngs_16_bit_words_masked_into_the_pool() -> None:
    """The masking done a byte at a time in C gives each draw's 16-bit value masked into the pool, as one draw
    at a time does: every trace's token ids (and so every simulated prefix and figure) stay what they were."""
    import random
    from array import array

    from pilotfish.simulator.traces import prompts

    mask = prompts._POOL_SIZE - 1
    for key, index in (("mc:7", 0), ("qw:123456", 3), ("fam-sys:0:sys", 1), ("", 0)):
        seed = key if index == 0 else f"{key}/{index}"
        for count in (1, 2, 3, 16, 17, 511, 512):
            words = array("H", random.Random(seed).randbytes(4 * ((count + 1) // 2)))[:count]
            assert prompts._chunk_indices(key, index, count).tolist() == [w & mask for w in words]
    ids = prompts._chunk_ids("mc:7", 2)
    assert ids == tuple(prompts._IDS[i] for i in prompts._chunk_indices("mc:7", 2))
