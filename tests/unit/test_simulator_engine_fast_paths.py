"""The engine's hot-path helpers agree with the plain definitions they stand in for."""

from __future__ import annotations

import pytest

from pilotfish.simulator.engine.block_hash import block_hashes, extend_block_hashes_from
from pilotfish.simulator.engine.kv_cache import BlockPool
from pilotfish.simulator.engine.request import SimRequest


@pytest.mark.parametrize("num_output", [0, 1, 5, 13])
def test_token_ids_between_is_a_slice_of_all_tokens(num_output: int) -> None:
    request = SimRequest("r", list(range(100, 111)), 50)
    request.output_token_ids = list(range(900, 900 + num_output))
    total = request.num_tokens
    for start in range(total + 2):
        for stop in range(start, total + 3):
            assert request.token_ids_between(start, stop) == request.all_token_ids[start:stop], (start, stop)


@pytest.mark.parametrize("known", [0, 1, 3])
def test_hashes_from_a_tail_equal_the_hashes_of_all_tokens(known: int) -> None:
    tokens = list(range(37))
    hashes = block_hashes(tokens[:known * 4], 4)
    assert extend_block_hashes_from(hashes, tokens[known * 4:], 4) == block_hashes(tokens, 4)


def test_take_hands_out_fresh_blocks_in_id_order_then_the_least_recently_freed() -> None:
    pool = BlockPool(6)
    first = pool.take(4)
    assert [b.block_id for b in first] == [0, 1, 2, 3]
    pool.release([first[2], first[0]])
    # two fresh ones left, then the freed ones in the order they were freed
    assert [b.block_id for b in pool.take(4)] == [4, 5, 2, 0]
    assert pool.num_free == 0
    pool.materialize()
    assert [b.block_id for b in BlockPool(3).take(2)] == [0, 1]
