"""The full-mode view: CMS records applied to instances, the step-time fit and forward prediction,
latency profiles, prefix hashing and the prefix index."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from pilotfish.cms.prefix_hash import prefix_block_hashes
from pilotfish.config import ConfigError
from pilotfish.protos import cms_pb2
from pilotfish.scheduler.config import SchedulerConfig
from pilotfish.scheduler.core import SchedulerCore
from pilotfish.scheduler.errors import NoSchedulableInstanceError, UnknownModelError
from pilotfish.scheduler.view.predictor import StepTimeModel, prefill_tokens_done
from pilotfish.scheduler.view.prefix_index import PrefixIndex
from pilotfish.scheduler.view.profile import LatencyProfile, LatencyTables, TpotTable, interp1, load_profile
from pilotfish.scheduler.view.types import Endpoint, InferType, RequestInfo

WALL = 1_700_000_000.0


def core(**kw: object) -> SchedulerCore:
    config = SchedulerConfig(enable_full_mode_scheduling=True, **kw)  # type: ignore[arg-type]
    return SchedulerCore(config, wall_clock=lambda: WALL)


def meta(name: str, **kw: object) -> cms_pb2.InstanceMetadata:
    fields: dict[str, object] = {"instance_id": name, "host": "10.0.0.1", "http_port": 8000, "model": "m"}
    fields["infer_type"] = 1
    fields.update(kw)
    return cms_pb2.InstanceMetadata(**fields)  # type: ignore[arg-type]


def status(name: str, update_id: int, **kw: object) -> cms_pb2.InstanceStatus:
    fields: dict[str, object] = {
        "instance_id": name,
        "update_id": update_id,
        "timestamp_ms": int(WALL * 1000),
        "schedulable": True,
    }
    fields.update(kw)
    return cms_pb2.InstanceStatus(**fields)  # type: ignore[arg-type]


# -- CMS records -> instance views ------------------------------------------------------------------------


def test_metadata_creates_the_instance_with_its_domains() -> None:
    c = core()
    c.apply_metadata(meta("a", host="fe80::1", http_port=9000, infer_type=2, node_id="n1", unit_id="u1", update_id=3))
    inst = c.instance("a")
    assert inst.endpoint == Endpoint("a", "[fe80::1]:9000", InferType.PREFILL)
    assert (inst.node_id, inst.unit_id, inst.models) == ("n1", "u1", frozenset({"m"}))
    assert not c.apply_metadata(meta("a", update_id=2))  # older metadata is dropped
    assert c.instance("a").infer_type == InferType.PREFILL


def test_status_is_monotonic_by_update_id() -> None:
    c = core()
    c.apply_metadata(meta("a"))
    assert c.apply_status(status("a", 5, num_waiting=5))
    assert not c.apply_status(status("a", 5, num_waiting=99))  # duplicate
    assert not c.apply_status(status("a", 4, num_waiting=99))  # reordered, older
    assert c.instance("a").status.num_waiting == 5  # type: ignore[union-attr]
    assert c.cms is not None and c.cms.num_rejected == 2


def test_a_restarted_llumlet_is_accepted_despite_a_lower_update_id() -> None:
    now = [WALL]
    config = SchedulerConfig(enable_full_mode_scheduling=True, instance_staleness_seconds=10)
    c = SchedulerCore(config, wall_clock=lambda: now[0])
    c.apply_metadata(meta("a"))
    c.apply_status(status("a", 500))
    now[0] = WALL + 60  # a minute on: a timestamp that far ahead of the clock would be refused
    later = int((WALL + 60) * 1000)
    assert c.apply_status(status("a", 1, timestamp_ms=later, num_running=3))
    assert c.instance("a").status.update_id == 1  # type: ignore[union-attr]


def test_status_before_metadata_waits_for_it() -> None:
    c = core()
    assert not c.apply_status(status("a", 2, num_waiting=7))
    c.apply_metadata(meta("a"))
    assert c.instance("a").status.num_waiting == 7  # type: ignore[union-attr]


def test_changed_address_replaces_the_view_but_keeps_its_load() -> None:
    c = core()
    c.apply_metadata(meta("a"))
    c.apply_status(status("a", 1))
    c.schedule(RequestInfo("r", "m", prompt_tokens=10))
    c.apply_metadata(meta("a", http_port=9999, update_id=2))
    inst = c.instance("a")
    assert inst.endpoint.address == "10.0.0.1:9999"
    assert inst.inflight.requests == 1 and inst.lrs.num_requests == 1 and inst.status is not None
    assert c.release("r") and inst.inflight.requests == 0


def test_status_gone_makes_the_instance_unschedulable_and_remove_forgets_it() -> None:
    c = core()
    c.apply_metadata(meta("a"))
    c.apply_status(status("a", 1))
    assert c.cms is not None
    c.cms.status_gone("a")
    with pytest.raises(NoSchedulableInstanceError, match="schedulability: 1"):
        c.schedule(RequestInfo("r", "m"))
    c.cms.remove("a")
    with pytest.raises(UnknownModelError, match="not served by any instance"):
        c.schedule(RequestInfo("r", "m"))


def test_status_feeds_the_step_time_fit_once_per_step() -> None:
    c = core()
    c.apply_metadata(meta("a"))
    step = {"last_step_duration_us": 30_000, "last_step_prefill_tokens": 100, "last_step_decode_batch": 4}
    c.apply_status(status("a", 1, step_id=7, **step))
    c.apply_status(status("a", 2, step_id=7, **step))  # another event in the same step
    c.apply_status(status("a", 3, step_id=8, **step))
    model = c.instance("a").step_model
    assert model is not None and model.observations == 2


def test_pd_and_hints() -> None:
    c = core()
    c.apply_metadata(meta("p", infer_type=2))
    c.apply_metadata(meta("d", infer_type=3))
    c.apply_metadata(meta("n", infer_type=1))
    for name in "pdn":
        c.apply_status(status(name, 1))
    both = c.schedule(RequestInfo("r1", "m"))
    assert (both.target.instance_id, both.decode_target.instance_id) == ("p", "d")  # type: ignore[union-attr]
    assert c.schedule(RequestInfo("r2", "m", infer_type_hint=InferType.NEUTRAL)).target.instance_id == "n"
    assert c.schedule(RequestInfo("r3", "m", infer_type_hint=InferType.DECODE)).target.instance_id == "d"
    # prefill side down: the neutral instance takes the request whole
    c.apply_status(status("p", 2, schedulable=False))
    fallback = c.schedule(RequestInfo("r4", "m"))
    assert fallback.target.instance_id == "n" and fallback.decode_target is None


def test_unknown_model_in_full_mode() -> None:
    c = core()
    c.apply_metadata(meta("a", model="other"))
    with pytest.raises(UnknownModelError):
        c.schedule(RequestInfo("r", "m"))
    configured = core(model=["m"])
    with pytest.raises(NoSchedulableInstanceError, match="no instance serves model 'm'"):
        configured.schedule(RequestInfo("r", "m"))


# -- step-time fit and forward prediction --------------------------------------------------------------


def test_step_time_model_starts_at_the_prior() -> None:
    profile = LatencyProfile(base_ms=8, prefill_ms_per_token=0.1, decode_ms_per_token=0.02, context_ms_per_token=0.001)
    model = StepTimeModel(profile, 2.0)
    assert model.step_ms(100, 10, 1000) == pytest.approx(profile.step_ms(100, 10, 1000))


def test_step_time_model_fits_the_engine_online() -> None:
    true = (5.0, 0.2, 0.05, 0.0002)
    model = StepTimeModel(LatencyProfile(), 2.0)  # prior: 10, 0.11, 0.03, 0.00009
    rng = random.Random(1)
    for step in range(400):
        p = rng.choice([0, rng.randint(1, 4096)])
        b = rng.randint(1, 128)
        seq = b * rng.randint(100, 3000)
        ms = true[0] + true[1] * p + true[2] * b + true[3] * seq
        model.observe(step, int(ms * 1000 * rng.uniform(0.98, 1.02)), p, b, seq)
    for p, b, seq in [(2048, 8, 8000), (0, 64, 64 * 1000), (512, 32, 32 * 2000)]:
        expected = true[0] + true[1] * p + true[2] * b + true[3] * seq
        assert model.step_ms(p, b, seq) == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize(
    ("step", "reason"),
    [((3, 0, 10, 1, 10), "no duration"), ((3, 120_000_000, 10, 1, 10), "outlier"), ((3, 5000, 0, 0, 0), "empty step")],
)
def test_step_time_model_skips_useless_steps(step: tuple[int, ...], reason: str) -> None:
    model = StepTimeModel(LatencyProfile(), 2.0)
    assert not model.observe(*step), reason


@pytest.mark.parametrize(
    ("uncomputed", "batch", "elapsed", "expected"),
    [
        (1000, 0, 0.0, 0.0),
        (0, 4, 5.0, 0.0),
        # 10 ms + 0.01 ms/token x 500-token chunks: 15 ms per step; 30 ms = two chunks
        (1000, 0, 0.030, 1000.0),
        (5000, 0, 0.030, 1000.0),
        (5000, 0, 0.015, 500.0),
        # a decode batch of 100 leaves 400 tokens of the budget: 14 ms per step
        (5000, 100, 0.028, 800.0),
    ],
)
def test_prefill_tokens_done(uncomputed: int, batch: int, elapsed: float, expected: float) -> None:
    flat = LatencyProfile(base_ms=10, prefill_ms_per_token=0.01, decode_ms_per_token=0, context_ms_per_token=0)
    model = StepTimeModel(flat, 2.0)
    assert prefill_tokens_done(model, uncomputed, batch, 0, 500, elapsed) == pytest.approx(expected)


# -- profiles and tables ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("xs", "ys", "x", "y"),
    [
        ([0, 10], [0, 100], 5, 50),
        ([0, 10, 20], [0, 100, 300], 15, 200),
        ([0, 10], [0, 100], 20, 200),  # extended past the end
        ([5, 10], [50, 100], 0, 0),  # and before the start
        ([1], [7], 100, 7),
    ],
)
def test_interp1(xs: list[float], ys: list[float], x: float, y: float) -> None:
    assert interp1(xs, ys, x) == pytest.approx(y)


def test_tables_from_profile_rows() -> None:
    profile = LatencyProfile(
        ttft_ms=[(0, 10), (1000, 110), (4000, 510)],
        tpot_ms=TpotTable(batch_sizes=[1, 11], seq_lens=[100, 1100], ms=[[10, 20], [30, 40]]),
    )
    tables = LatencyTables(profile)
    assert tables.prefill_ms(2500) == pytest.approx(310)
    assert tables.tpot_ms(6, 600) == pytest.approx(25)  # the middle of the 2x2 grid


def test_simulator_profile_is_a_valid_prior() -> None:
    path = Path(__file__).resolve().parents[2] / "simulator" / "profiles" / "llama3-8b-a100.yaml"
    profile = load_profile(str(path))
    assert profile.base_ms == 10.0 and profile.ttft_ms is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("base_ms: -1\n", "base_ms must be > 0"),
        ("ttft_ms: [[10, 1]]\n", "two or more rows"),
        ("tpot_ms: {batch_sizes: [1, 2], seq_lens: [1], ms: [[1]]}\n", "one row per batch size"),
        ("colour: red\n", "colour"),
    ],
)
def test_bad_profiles_fail_naming_the_key(text: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("name: x\n" + text)
    with pytest.raises(ConfigError, match=message):
        load_profile(str(path))


# -- prefix hashing and the prefix index ----------------------------------------------------------------


def test_prefix_hashes_are_chained_and_stable_across_processes() -> None:
    tokens = list(range(40))
    local = prefix_block_hashes(tokens, 16)
    assert len(local) == 2  # the trailing partial block is not hashed
    code = "from pilotfish.cms.prefix_hash import prefix_block_hashes as p; print(p(list(range(40)), 16))"
    remote = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert remote.strip() == str(local)
    # the known vector pins the definition (version 1): changing it breaks every gateway/llumlet pairing
    assert local == [1442646661251532998, 1152408753107277960]


@pytest.mark.parametrize(
    ("a", "b", "shared"),
    [
        (list(range(64)), list(range(64)), 4),
        (list(range(64)), [*range(32), *range(100, 132)], 2),
        (list(range(64)), [99, *range(1, 64)], 0),  # the first token differs: nothing shared
        ([*range(16), *range(16)], list(range(32)), 1),  # equal blocks at different depths differ
    ],
)
def test_prefix_hashes_share_exactly_the_common_prefix(a: list[int], b: list[int], shared: int) -> None:
    ha, hb = prefix_block_hashes(a, 16), prefix_block_hashes(b, 16)
    common = next((i for i, (x, y) in enumerate(zip(ha, hb, strict=False)) if x != y), min(len(ha), len(hb)))
    assert common == shared


def test_prefix_hash_continues_a_chain_and_rejects_bad_input() -> None:
    tokens = list(range(48))
    whole = prefix_block_hashes(tokens, 16)
    assert prefix_block_hashes(tokens[16:], 16, parent=whole[0]) == whole[1:]
    with pytest.raises(ValueError):
        prefix_block_hashes(tokens, 0)
    with pytest.raises(ValueError):
        prefix_block_hashes([-1] * 16, 16)


def test_prefix_index_match_and_kv_events() -> None:
    index = PrefixIndex()
    index.record_dispatch("a", [1, 2, 3])
    index.apply_kv_event("b", stored=[1, 2])
    assert index.match([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert index.match([9, 1]) == {}
    index.apply_kv_event("a", removed=[2])  # evicted: a's chain now breaks after block 0
    assert index.match([1, 2, 3]) == {"a": 1, "b": 2}
    index.apply_kv_event("b", cleared=True)
    assert index.match([1, 2]) == {"a": 1}
    index.forget("a")
    assert len(index) == 0


def test_prefix_index_is_bounded_per_instance() -> None:
    index = PrefixIndex(default_capacity_blocks=4)
    index.record_dispatch("a", [1, 2, 3])
    index.record_dispatch("a", [10, 11, 12])  # pushes out the oldest two
    assert index.blocks_of("a") == 4
    assert index.match([1, 2, 3]) == {}
    assert index.match([3]) == {"a": 1}
    index.set_capacity("a", 2)
    assert index.blocks_of("a") == 2


def test_core_feeds_kv_events_to_the_prefix_index() -> None:
    c = core(enable_cache_aware_scheduling=True)
    for name in ("a", "b"):
        c.apply_metadata(meta(name))
        c.apply_status(status(name, 1))
    hashes = tuple(prefix_block_hashes(list(range(64)), 16))
    c.apply_kv_event("b", stored=hashes)
    decision = c.schedule(RequestInfo("r", "m", prompt_tokens=64, prefix_block_hashes=hashes, prefix_block_size=16))
    assert decision.target.instance_id == "b"


def test_engine_status_from_proto_puts_every_field_in_its_own() -> None:
    import dataclasses

    from pilotfish.scheduler.view.types import EngineStatus

    names = [f.name for f in dataclasses.fields(EngineStatus)]
    values = {name: (i + 2 if name != "schedulable" else False) for i, name in enumerate(names)}  # distinct
    got = EngineStatus.from_proto(cms_pb2.InstanceStatus(instance_id="a", **values))
    assert {name: getattr(got, name) for name in names} == values
