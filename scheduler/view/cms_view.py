"""Full mode's cluster view: CMS metadata and status records applied to the instance views.

The CMS reader (`pilotfish.cms.reader`) decodes records strictly and hands them here; this
module decides what they mean:

- metadata creates or updates an instance (address, infer type, model, failure domains,
  capacity); a changed address or infer type replaces the view, keeping its load;
- metadata introduces an instance only if it passes the trust checks (docs/cms-trust.md): its
  model is one the scheduler serves (when --model is given), and, when admission follows
  discovery (--cms-instance-admission, by default whenever --discovery names a backend), its
  host:port is one discovery lists; metadata that fails waits, bounded, and is admitted the
  moment discovery lists its address (and removed when discovery drops it);
- metadata gets the same bounds (it has no epoch): a timestamp_ms more than the skew ahead, or an
  update_id beyond both the held one plus the jump and the clock in microseconds plus the skew, is
  refused (counted by the status reasons, nothing changes). Metadata is kept if its update_id is not
  lower than the one held, or if the one held is past what the clock allows now, or if its
  timestamp_ms is newer by more than the staleness window (a llumlet restarted on a clock set
  back): so a forged record cannot pin the instance's address past the forger (docs/cms-trust.md);
- a status that claims a future the scheduler's clock cannot have (timestamp_ms or epoch more
  than --cms-max-clock-skew-seconds ahead, an update_id jump beyond --cms-max-update-id-jump and
  the clock) is refused before anything else looks at it: counted by reason, logged at WARNING
  (rate-limited per instance and reason), and the instance's later real statuses are taken as
  usual. Without this, one forged record with a huge update_id pins the view;
- a status is kept only if it is newer by (epoch, update_id) than the one held (stale writes
  and duplicates are dropped with a DEBUG line). A newer epoch is a restarted llumlet: its
  sequence starts over. For writers without epochs, an `update_id` lower than held with a
  `timestamp_ms` newer by more than the staleness window is taken as a restart too (WARNING,
  rate-limited), so a restart does not blind the view;
- every plausible status, newer or not, reconciles the in-flight account (see account.py); a
  "gap" there is an update_id jump spanning at least --account-admitted-window-ms (writers
  list each admitted id for that long; writers with time-based update_ids jump every time);
- a status's finished totals tell the LRS how long the engine's answers run (their growth since
  the held status, all of them after a restart); a status whose output tokens grew by more than
  MAX_ANSWER_TOKENS per finished request is refused (`invalid_field`), since the learned answer
  lengths steer the default policy;
- a status feeds its last step to the instance's online step-time fit;
- a status for an instance without metadata waits (bounded) until the metadata arrives.

Incremental: one record touches one instance; nothing copies the view.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pilotfish.cms.records import FUTURE_TIMESTAMP, INVALID, UPDATE_ID_JUMP, Bounds, implausible
from pilotfish.cms.refusals import RefusalLog
from pilotfish.config import ConfigError
from pilotfish.discovery.follow import discovery_configured
from pilotfish.protos import cms_pb2
from pilotfish.scheduler.view.account import InflightAccount
from pilotfish.scheduler.view.predictor import StepTimeModel
from pilotfish.scheduler.view.prefix_index import PrefixIndex
from pilotfish.scheduler.view.profile import LatencyProfile
from pilotfish.scheduler.view.speed import EngineSpeeds
from pilotfish.scheduler.view.types import Endpoint, EngineStatus, InferType, InstanceView

if TYPE_CHECKING:
    from pilotfish.discovery.config import DiscoveryConfig
    from pilotfish.scheduler.config import SchedulerConfig

log = logging.getLogger(__name__)

# statuses held for instances whose metadata has not arrived; more is a flood, oldest dropped
MAX_PENDING = 4096
# metadata held for instances not admitted (yet); more is a flood, oldest dropped
MAX_UNADMITTED = 4096

# output tokens one finished request may add to a status's finished_output_tokens_total: past any served
# model's context (10M tokens at most today), so no real answer is refused. A forger's +2^62 tokens on +1
# request was taken and set the engine's learned answer length (predicted_stall) for good (audit F7)
MAX_ANSWER_TOKENS = 1 << 24

ADMISSION_MODES = ("auto", "cms", "discovery")
# refusal reasons of the view's own (the reader's are in cms/records.py)
NOT_DISCOVERED = "not_discovered"
UNSERVED_MODEL = "unserved_model"


@dataclass(frozen=True, slots=True)
class CmsTrust:
    """What the view requires of CMS records before they steer scheduling (docs/cms-trust.md)."""

    bounds: Bounds = field(default_factory=Bounds)
    # only metadata whose host:port discovery lists introduces an instance
    follow_discovery: bool = False
    # metadata must name one of these models (empty: any)
    models: frozenset[str] = frozenset()

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> CmsTrust:
        """Raises ConfigError naming the flag when the admission mode is unknown or cannot work."""
        mode = config.cms_instance_admission
        if mode not in ADMISSION_MODES:
            raise ConfigError(f"--cms-instance-admission: {mode!r} is not one of {', '.join(ADMISSION_MODES)}")
        has_discovery = discovery_configured(config)
        if mode == "discovery" and not has_discovery:
            raise ConfigError("--cms-instance-admission: discovery needs --discovery to name a backend")
        bounds = Bounds(round(config.cms_max_clock_skew_seconds * 1000), config.cms_max_update_id_jump)
        follow = mode == "discovery" or (mode == "auto" and has_discovery)
        return cls(bounds, follow, frozenset(config.model))


class CmsView:
    def __init__(
        self,
        *,
        instances: dict[str, InstanceView],
        add_instance: Callable[[InstanceView], None],
        remove_instance: Callable[[str], bool],
        changed: Callable[[InstanceView], None],
        account: InflightAccount,
        prefix_index: PrefixIndex | None,
        profile: LatencyProfile,
        staleness_seconds: float,
        clock: Callable[[], float],
        prior_weight: float,
        admitted_window_ms: int = 0,
        trust: CmsTrust | None = None,
        wall_clock: Callable[[], float] = time.time,
        answered: Callable[[InstanceView, int, int], None] | None = None,
        speeds: EngineSpeeds | None = None,
        stalled: Callable[[InstanceView, bool], None] | None = None,
        stall_seconds: float = 0.0,
    ) -> None:
        """`answered(inst, requests, tokens)`: told the requests that left an engine with their answers
        (and those answers' tokens) between two of its statuses, from the records' finished totals.
        `stalled(inst, True)`: the engine's statuses showed requests on it and the same step for
        `stall_seconds` by their own timestamps (a hung engine the llumlet keeps reporting); `(inst, False)`
        once one shows it stepping, or idle, again."""
        self._stalled = stalled
        self._stall_ms = int(stall_seconds * 1000)
        # per instance: the step its statuses last showed, and since when (their timestamp) they have shown
        # it with requests on the engine (None: idle at that step); and which instances are stalled now
        self._steps: dict[str, tuple[int, int | None]] = {}
        self._stalled_ids: set[str] = set()
        self._answered = answered
        self._speeds = speeds  # told each engine step a status reports, once (view/speed.py)
        self._window_ms = admitted_window_ms
        self._prior_weight = prior_weight
        self._instances = instances
        self._add = add_instance
        self._remove = remove_instance
        self._changed = changed
        self._account = account
        self._prefix = prefix_index
        self._profile = profile
        self._restart_ms = staleness_seconds * 1000.0
        self._clock = clock
        self._wall_clock = wall_clock
        self.trust = trust if trust is not None else CmsTrust()
        # (update_id, timestamp_ms) of the metadata held per instance: what a later record must beat
        self._meta_ids: dict[str, tuple[int, int]] = {}
        self._pending: OrderedDict[str, cms_pb2.InstanceStatus] = OrderedDict()
        # the epoch of each held status (InstanceView.status has no room for it)
        self._epochs: dict[str, int] = {}
        # the admitted_total of the status held, where its writer counts (gap detection)
        self._admitted_totals: dict[str, int] = {}
        # metadata that failed admission, kept until it passes (discovery lists its address)
        self._unadmitted: OrderedDict[str, cms_pb2.InstanceMetadata] = OrderedDict()
        # the metadata each admitted instance was admitted with
        self._admitted: dict[str, cms_pb2.InstanceMetadata] = {}
        # discovery's view, when admission follows it: instance id -> address, and address counts
        self._discovered: dict[str, str] = {}
        self._discovered_addresses: Counter[str] = Counter()
        self._refusals = RefusalLog(log, clock, what="refused CMS record")
        self._restarts = RefusalLog(log, clock, what="took a CMS status as a llumlet restart")
        self._meta_overrides = RefusalLog(log, clock, what="took CMS metadata with a lower update_id than held")
        # refusals the reader reports (size, decoding), by reason
        self._reader_refused: Counter[str] = Counter()
        # scheduler-clock time each instance's status was last applied: view staleness
        self.received_at: dict[str, float] = {}
        self.num_rejected = 0
        self.num_applied = 0

    @property
    def follows_discovery(self) -> bool:
        return self.trust.follow_discovery

    def refused_by_reason(self) -> dict[str, int]:
        """CMS records refused, by reason: the view's own refusals and those the reader reported."""
        return dict(self._refusals.counts + self._reader_refused)

    def record_refused(self, instance_id: str, reason: str) -> None:
        """The reader refused a record (too big, not decodable, out of bounds): counted here."""
        self._reader_refused[reason] += 1

    def _refuse(self, instance_id: str, reason: str, message: str) -> bool:
        self._refusals.note(instance_id, reason, message)
        return False

    # -- metadata ----------------------------------------------------------------------------------

    def apply_metadata(self, meta: cms_pb2.InstanceMetadata) -> bool:
        """Create or update the instance; False if the record is not newer than the one held, or
        not admitted (a model not served, an address discovery does not list)."""
        held = self._meta_ids.get(meta.instance_id)
        now_ms = int(self._wall_clock() * 1000)
        bounds = self.trust.bounds
        # checked before anything else, as statuses are: without it one record with a huge update_id
        # pins the instance's address, every real record after it looking stale
        reason = metadata_implausible(meta, now_ms, bounds, held[0] if held is not None else None)
        if reason:
            detail = (
                f"metadata update_id {meta.update_id}, timestamp_ms {meta.timestamp_ms}; "
                f"the scheduler's clock reads {now_ms} ms"
            )
            return self._refuse(meta.instance_id, reason, detail)
        if held is not None and meta.update_id and meta.update_id < held[0] and not self._outlived(meta, held, now_ms):
            log.debug("dropped stale metadata of %s (update_id %d < %d)", meta.instance_id, meta.update_id, held[0])
            return False
        models = self.trust.models
        if models and meta.model not in models:
            # not even kept for later: the instance could never serve a request here
            return self._refuse(meta.instance_id, UNSERVED_MODEL, f"model {meta.model[:80]!r} is not served here")
        self._meta_ids[meta.instance_id] = (meta.update_id, meta.timestamp_ms)
        address = f"{_host(meta.host)}:{meta.http_port}"
        if self.trust.follow_discovery and address not in self._discovered_addresses:
            self._unadmitted[meta.instance_id] = meta
            self._unadmitted.move_to_end(meta.instance_id)
            while len(self._unadmitted) > MAX_UNADMITTED:
                self._unadmitted.popitem(last=False)
            if meta.instance_id in self._instances:  # its address moved off discovery's list
                self._drop_admitted(meta.instance_id)
            return self._refuse(meta.instance_id, NOT_DISCOVERED, f"address {address} is not one discovery lists")
        self._unadmitted.pop(meta.instance_id, None)
        self._admitted[meta.instance_id] = meta
        infer_type = InferType(meta.infer_type) if meta.infer_type in (1, 2, 3) else InferType.NEUTRAL
        endpoint = Endpoint(meta.instance_id, address, infer_type)
        models = frozenset({meta.model}) if meta.model else frozenset()
        old = self._instances.get(meta.instance_id)
        if old is not None and old.endpoint == endpoint and old.models == models:
            inst = old
        else:
            inst = InstanceView(endpoint, models=models)
            if old is not None:
                inst.status, inst.inflight, inst.step_model = old.status, old.inflight, old.step_model
                inst.speed_scale = old.speed_scale
            if inst.step_model is None:
                inst.step_model = StepTimeModel(self._profile, self._prior_weight)
        inst.node_id, inst.unit_id = meta.node_id, meta.unit_id
        inst.llumlet_address = f"{_host(meta.host)}:{meta.llumlet_port}" if meta.llumlet_port else ""
        inst.kv_events_endpoint, inst.kv_events_topic = meta.kv_events_endpoint, meta.kv_events_topic
        inst.block_size = meta.block_size or inst.block_size
        inst.max_num_batched_tokens = meta.max_num_batched_tokens
        inst.max_num_seqs = meta.max_num_seqs
        if self._prefix is not None and meta.num_gpu_blocks:
            self._prefix.set_capacity(meta.instance_id, meta.num_gpu_blocks)
        if inst is not old:
            self._add(inst)
        self._changed(inst)
        pending = self._pending.pop(meta.instance_id, None)
        if pending is not None:
            self.apply_status(pending)
        return True

    def _outlived(self, meta: cms_pb2.InstanceMetadata, held: tuple[int, int], now_ms: int) -> bool:
        """Whether metadata with a lower update_id than the held one replaces it all the same: the held
        update_id is past what the clock allows now (a forger stepped it a jump beyond the clock; no writer
        counts that far), or the record's timestamp_ms is newer by more than the staleness window (a llumlet
        restarted on a clock set back, or a forged update_id within the skew: metadata has no epoch)."""
        held_id, held_ms = held
        ceiling = _update_id_ceiling(now_ms, self.trust.bounds)
        if held_id > ceiling:
            why = f"the held update_id {held_id} is past the clock's {ceiling}; the new one is {meta.update_id}"
        elif meta.timestamp_ms > held_ms + self._restart_ms:
            why = f"update_id fell from {held_id} to {meta.update_id} with a timestamp newer than {held_ms} ms"
        else:
            return False
        self._meta_overrides.note(meta.instance_id, "metadata", why)
        return True

    # -- status ------------------------------------------------------------------------------------

    def apply_status(self, status: cms_pb2.InstanceStatus) -> bool:
        """Reconcile the account with it and keep it if newer; False if its load was not applied
        (refused as implausible, not newer, or waiting for its instance's metadata)."""
        instance_id = status.instance_id
        inst = self._instances.get(instance_id)
        held = inst.status if inst is not None else None
        held_epoch = self._epochs.get(instance_id, 0) if held is not None else None
        now_ms = int(self._wall_clock() * 1000)
        reason = implausible(status, now_ms, self.trust.bounds, held_epoch, held.update_id if held else 0)
        if reason:
            detail = (
                f"update_id {status.update_id}, timestamp_ms {status.timestamp_ms}, epoch {status.epoch}; "
                f"the scheduler's clock reads {now_ms} ms"
            )
            return self._refuse(instance_id, reason, detail)
        if inst is None:
            self._pending[instance_id] = status
            self._pending.move_to_end(instance_id)
            while len(self._pending) > MAX_PENDING:
                self._pending.popitem(last=False)
            return False
        # read once: a protobuf field read costs several times a local's, and the virtual-time
        # cluster applies a status per engine step
        epoch, update_id, timestamp_ms = status.epoch, status.update_id, status.timestamp_ms
        new_epoch = held is not None and epoch != held_epoch
        if held is None:
            newer = True
        elif new_epoch:
            newer = epoch > (held_epoch or 0)
        else:
            newer = update_id > held.update_id
        # ids are listed for a window after admission: one can only be lost if statuses were skipped
        # across a stretch longer than that window. A writer that counts its admissions says whether
        # all since the held status are listed; for one that does not, an update_id jump is taken as
        # a skip (it also comes of a pause: update_ids are microseconds of wall time)
        admitted_total = status.admitted_total if status.HasField("admitted_total") else None
        held_total = self._admitted_totals.get(instance_id)
        gap = (
            newer
            and held is not None
            and not new_epoch
            and (
                # fewer than held: a writer that started over (a respawned export process) lost what it had
                not 0 <= admitted_total - held_total <= len(status.admitted_request_ids)
                if admitted_total is not None and held_total is not None
                else update_id > held.update_id + 1 and timestamp_ms - held.timestamp_ms >= self._window_ms
            )
        )
        restart = not newer and held is not None and timestamp_ms > held.timestamp_ms + self._restart_ms
        answered = tokens = 0
        if (newer or restart) and (status.num_finished_total or status.finished_output_tokens_total):
            answered, tokens = _answer_growth(status, held, new_epoch)
            # what the learned answer lengths take from one record is bounded, or one record sets them
            if tokens > max(answered, 1) * MAX_ANSWER_TOKENS:
                detail = (
                    f"finished_output_tokens_total grew by {tokens} with {answered} finished requests "
                    f"(at most {MAX_ANSWER_TOKENS} tokens each)"
                )
                return self._refuse(instance_id, INVALID, detail)
        if newer and new_epoch:
            assert held is not None
            self._restarts.note(
                instance_id,
                "epoch",
                f"epoch {held_epoch} -> {epoch}; its update_id sequence starts over",
                logging.INFO,
            )
            # what the old llumlet exported last may be lost: reconcile as after a gap
            gap = True
        if restart:
            assert held is not None
            self._restarts.note(
                instance_id,
                "timestamp",
                f"update_id fell from {held.update_id} to {update_id} with a newer timestamp",
            )
            newer = gap = True
        self._account.apply_status(inst, status.admitted_request_ids, gap)
        if not newer:
            self.num_rejected += 1
            log.debug("dropped stale status of %s (update_id %d)", instance_id, update_id)
            return False
        self._epochs[instance_id] = epoch
        if admitted_total is None:
            self._admitted_totals.pop(instance_id, None)
        else:
            self._admitted_totals[instance_id] = admitted_total
        inst.status = applied = EngineStatus.from_proto(status)
        if self._answered is not None and answered > 0 and tokens >= 0:
            self._answered(inst, answered, tokens)
        model = inst.step_model
        if model is None:
            model = inst.step_model = StepTimeModel(self._profile, self._prior_weight)
        if (
            model.observe(
                status.step_id,
                status.last_step_duration_us,
                status.last_step_prefill_tokens,
                status.last_step_decode_batch,
                status.last_step_seq_len_sum,
            )
            and self._speeds is not None
        ):
            self._speeds.observe_step(
                inst,
                status.last_step_duration_us / 1000.0,
                status.last_step_prefill_tokens,
                status.last_step_decode_batch,
                status.last_step_seq_len_sum,
            )
        if self._stalled is not None and self._stall_ms:
            self._watch_steps(inst, applied)
        self.received_at[instance_id] = self._clock()
        self.num_applied += 1
        self._changed(inst)
        return True

    def _watch_steps(self, inst: InstanceView, status: EngineStatus) -> None:
        """Whether the engine has stalled: requests running on it, and the same step in every status for the
        stall period. Only writers that count steps are judged (step_id 0 says nothing). Waiting requests alone
        say nothing: the llumlet counts only steps that schedule tokens, and an engine may hold requests it cannot
        schedule yet (a decode engine waiting for a prefill's KV, a grammar still compiling); a hung step always
        has requests running (the llumlet marks them running when they are scheduled)."""
        assert self._stalled is not None
        instance_id, step = inst.instance_id, status.step_id
        busy = status.num_running > 0
        held = self._steps.get(instance_id)
        if held is None or held[0] != step or not busy or held[1] is None:
            self._steps[instance_id] = (step, status.timestamp_ms if busy else None)
            if instance_id in self._stalled_ids:  # (stalled means busy at the same step: it moved or idles now)
                self._stalled_ids.discard(instance_id)
                self._stalled(inst, False)
            return
        if step and instance_id not in self._stalled_ids and status.timestamp_ms - held[1] >= self._stall_ms:
            self._stalled_ids.add(instance_id)
            self._stalled(inst, True)

    # -- departures ----------------------------------------------------------------------------------

    def status_gone(self, instance_id: str) -> None:
        """The status key expired while the metadata lives: the llumlet stopped reporting.

        The instance stays known but has no status, so schedulability blocks it.
        """
        self._pending.pop(instance_id, None)
        inst = self._instances.get(instance_id)
        if inst is not None and inst.status is not None:
            inst.status = None
            self.received_at.pop(instance_id, None)
            self._epochs.pop(instance_id, None)
            self._admitted_totals.pop(instance_id, None)
            self._changed(inst)

    def remove(self, instance_id: str) -> bool:
        """The instance's records are gone (TTL expired, deregistered): forget it entirely."""
        self._meta_ids.pop(instance_id, None)
        self._pending.pop(instance_id, None)
        self._unadmitted.pop(instance_id, None)
        return self._drop_admitted(instance_id)

    def _drop_admitted(self, instance_id: str) -> bool:
        self._admitted.pop(instance_id, None)
        self._steps.pop(instance_id, None)
        self._stalled_ids.discard(instance_id)
        self.received_at.pop(instance_id, None)
        self._epochs.pop(instance_id, None)
        self._admitted_totals.pop(instance_id, None)
        if self._prefix is not None:
            self._prefix.forget(instance_id)
        return self._remove(instance_id)

    def known(self) -> set[str]:
        return set(self._meta_ids)

    # -- staleness -------------------------------------------------------------------------------------

    def status_age(self, instance_id: str, wall_now: float) -> float | None:
        """Seconds the instance's status has aged: from its timestamp, or from when it was applied if
        that is longer (a writer's clock a little ahead, or the reader cut off from Redis: the age
        grows either way). None without a status."""
        inst = self._instances.get(instance_id)
        if inst is None or inst.status is None:
            return None
        age = wall_now - inst.status.timestamp_ms / 1000.0
        received = self.received_at.get(instance_id)
        if received is not None:
            age = max(age, self._clock() - received)
        return max(0.0, age)

    # -- discovery (when admission follows it) ---------------------------------------------------------

    def discovered(self, instance_id: str, address: str) -> None:
        """Discovery lists an engine: metadata waiting for its address is admitted now."""
        old = self._discovered.get(instance_id)
        if old == address:
            return
        if old is not None:
            self.undiscovered(instance_id)
        self._discovered[instance_id] = address
        self._discovered_addresses[address] += 1
        for waiting in [m for m in self._unadmitted.values() if f"{_host(m.host)}:{m.http_port}" == address]:
            self.apply_metadata(waiting)

    def undiscovered(self, instance_id: str) -> None:
        """Discovery dropped an engine: instances at its address leave scheduling (their metadata waits)."""
        address = self._discovered.pop(instance_id, None)
        if address is None:
            return
        self._discovered_addresses[address] -= 1
        if self._discovered_addresses[address] > 0:
            return
        del self._discovered_addresses[address]
        for inst in [i for i in self._instances.values() if i.endpoint.address == address]:
            meta = self._admitted.get(inst.instance_id)
            if meta is not None:
                self.apply_metadata(meta)  # now fails admission: the instance leaves, its metadata waits

    async def follow_discovery(self, config: DiscoveryConfig) -> None:
        """Keep discovery's list current until cancelled (run it when `follows_discovery`)."""
        from pilotfish.discovery.follow import follow

        await follow(config, lambda found: self.discovered(found.instance_id, found.address), self.undiscovered)


def _answer_growth(status: cms_pb2.InstanceStatus, held: EngineStatus | None, new_epoch: bool) -> tuple[int, int]:
    """The finished totals' growth since the held status: (requests, output tokens). A restarted writer
    (new epoch, or totals that fell) counts from 0, so its first record's totals are all new."""
    finished, tokens = status.num_finished_total, status.finished_output_tokens_total
    if held is not None and not new_epoch and finished >= held.num_finished_total:
        return finished - held.num_finished_total, tokens - held.finished_output_tokens_total
    return finished, tokens


def _update_id_ceiling(now_ms: int, bounds: Bounds) -> int:
    """The highest update_id a writer may claim from scratch: llumlets count from the wall clock in
    microseconds (up to the skew ahead), simple writers from 1 (up to the jump)."""
    return max(bounds.max_update_id_jump, (now_ms + bounds.max_clock_skew_ms) * 1000)


def metadata_implausible(
    meta: cms_pb2.InstanceMetadata, now_ms: int, bounds: Bounds, held_update_id: int | None = None
) -> str:
    """The reason code metadata is refused for, or "" when it is plausible: the bounds
    `pilotfish.cms.records.implausible` puts on a status, for a record without an epoch.

    - timestamp_ms more than the skew ahead of `now_ms` (the reader's wall clock);
    - update_id beyond both the held one plus `max_update_id_jump` and the clock in microseconds plus
      the skew. A held update_id itself past that ceiling is no base: otherwise a forger writing record
      after record could climb a jump each time, as far ahead of the clock as it likes.
    """
    if meta.timestamp_ms > now_ms + bounds.max_clock_skew_ms:
        return FUTURE_TIMESTAMP
    ceiling = _update_id_ceiling(now_ms, bounds)
    base = held_update_id if held_update_id is not None and held_update_id <= ceiling else 0
    if meta.update_id > max(base + bounds.max_update_id_jump, ceiling):
        return UPDATE_ID_JUMP
    return ""


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
