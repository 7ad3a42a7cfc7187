"""The policy context holds no defaults of its own: built bare or from a config, it takes SchedulerConfig's,
so a hit on prefix hashes without a block size counts the gateway's blocks (cms/prefix_hash.py)."""

from __future__ import annotations

import pytest

from pilotfish.cms.prefix_hash import DEFAULT_BLOCK_SIZE
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.policy.context import PolicyContext
from pilotfish.scheduler.policy.registry import context_from_config
from pilotfish.scheduler.view.prefix_index import PrefixIndex
from pilotfish.scheduler.view.types import RequestInfo


def _hit(ctx: PolicyContext, block_size: int = 0) -> int:
    ctx.prefix_index = PrefixIndex()
    ctx.prefix_index.record_dispatch("a", (1, 2))
    return ctx.prefix_hits(RequestInfo("r", "m", prefix_block_hashes=(1, 2, 3), prefix_block_size=block_size))["a"]


@pytest.mark.parametrize(
    ("ctx", "block_size", "tokens"),
    [
        (PolicyContext(), 0, 2 * DEFAULT_BLOCK_SIZE),
        (context_from_config(SchedulerConfig()), 0, 2 * DEFAULT_BLOCK_SIZE),
        (context_from_config(SchedulerConfig(kv_events_prefix_block_size=32)), 0, 64),
        (PolicyContext(), 16, 32),  # the request's own block size wins
    ],
)
def test_a_hit_without_a_block_size_counts_the_gateways_blocks(
    ctx: PolicyContext, block_size: int, tokens: int
) -> None:
    assert _hit(ctx, block_size) == tokens


def test_a_bare_context_has_the_default_configs_values() -> None:
    bare, configured = PolicyContext(), context_from_config(SchedulerConfig())
    assert bare.instance_staleness_seconds == configured.instance_staleness_seconds == 10.0
    assert bare.default_block_size == configured.default_block_size == DEFAULT_BLOCK_SIZE
    assert bare.default_token_budget == configured.default_token_budget == 8192
    assert context_from_config(SchedulerConfig(default_max_num_batched_tokens=2048)).default_token_budget == 2048
