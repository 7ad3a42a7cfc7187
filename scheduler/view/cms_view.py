"""Full mode's cluster view: CMS metadata and status records applied to the instance views.

The CMS reader (`pilotfish.cms.reader`) decodes records strictly and hands them here; this
module decides what they mean:

- metadata creates or updates an instance (address, infer type, model, failure domains,
  capacity); a changed address or infer type replaces the view, keeping its load;
- a status is kept only if its `update_id` is newer than the one held (stale writes and
  duplicates are dropped with a DEBUG line). One exception: an `update_id` lower than held
  with a `timestamp_ms` newer by more than the staleness window is a restarted llumlet whose
  counter began again, and is accepted with a WARNING, so a restart does not blind the view;
- every decoded status, newer or not, reconciles the in-flight account (see account.py); a
  "gap" there is an update_id jump spanning at least --account-admitted-window-ms (writers
  list each admitted id for that long; writers with time-based update_ids jump every time);
- a status feeds its last step to the instance's online step-time fit;
- a status for an instance without metadata waits (bounded) until the metadata arrives.

Incremental: one record touches one instance; nothing copies the view.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from pilotfish.protos import cms_pb2
from pilotfish.scheduler.view.account import InflightAccount
from pilotfish.scheduler.view.predictor import StepTimeModel
from pilotfish.scheduler.view.prefix_index import PrefixIndex
from pilotfish.scheduler.view.profile import LatencyProfile
from pilotfish.scheduler.view.types import Endpoint, EngineStatus, InferType, InstanceView

log = logging.getLogger(__name__)

# statuses held for instances whose metadata has not arrived; more is a flood, oldest dropped
MAX_PENDING = 4096


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
    ) -> None:
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
        self._meta_ids: dict[str, int] = {}
        self._pending: OrderedDict[str, cms_pb2.InstanceStatus] = OrderedDict()
        # scheduler-clock time each instance's status was last applied: view staleness
        self.received_at: dict[str, float] = {}
        self.num_rejected = 0
        self.num_applied = 0

    # -- metadata ----------------------------------------------------------------------------------

    def apply_metadata(self, meta: cms_pb2.InstanceMetadata) -> bool:
        """Create or update the instance; False if the record is not newer than the one held."""
        held = self._meta_ids.get(meta.instance_id)
        if held is not None and meta.update_id and meta.update_id < held:
            log.debug("dropped stale metadata of %s (update_id %d < %d)", meta.instance_id, meta.update_id, held)
            return False
        self._meta_ids[meta.instance_id] = meta.update_id
        infer_type = InferType(meta.infer_type) if meta.infer_type in (1, 2, 3) else InferType.NEUTRAL
        endpoint = Endpoint(meta.instance_id, f"{_host(meta.host)}:{meta.http_port}", infer_type)
        models = frozenset({meta.model}) if meta.model else frozenset()
        old = self._instances.get(meta.instance_id)
        if old is not None and old.endpoint == endpoint and old.models == models:
            inst = old
        else:
            inst = InstanceView(endpoint, models=models)
            if old is not None:
                inst.status, inst.inflight, inst.step_model = old.status, old.inflight, old.step_model
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

    # -- status ------------------------------------------------------------------------------------

    def apply_status(self, status: cms_pb2.InstanceStatus) -> bool:
        """Reconcile the account with it and keep it if newer; False if its load was not applied."""
        inst = self._instances.get(status.instance_id)
        if inst is None:
            self._pending[status.instance_id] = status
            self._pending.move_to_end(status.instance_id)
            while len(self._pending) > MAX_PENDING:
                self._pending.popitem(last=False)
            return False
        held = inst.status
        newer = held is None or status.update_id > held.update_id
        # ids are listed for a window after admission: one can only be lost if statuses were
        # skipped (update_id jumped) across a stretch longer than that window
        gap = (
            newer
            and held is not None
            and status.update_id > held.update_id + 1
            and status.timestamp_ms - held.timestamp_ms >= self._window_ms
        )
        if not newer and held is not None and status.timestamp_ms > held.timestamp_ms + self._restart_ms:
            log.warning(
                "instance %s: update_id fell from %d to %d with a newer timestamp; taking it as a llumlet restart",
                status.instance_id,
                held.update_id,
                status.update_id,
            )
            # what the old llumlet exported last may be lost: reconcile as after a gap
            newer = gap = True
        self._account.apply_status(inst, status.admitted_request_ids, gap)
        if not newer:
            self.num_rejected += 1
            log.debug("dropped stale status of %s (update_id %d)", status.instance_id, status.update_id)
            return False
        inst.status = EngineStatus.from_proto(status)
        if inst.step_model is None:
            inst.step_model = StepTimeModel(self._profile, self._prior_weight)
        inst.step_model.observe(
            status.step_id,
            status.last_step_duration_us,
            status.last_step_prefill_tokens,
            status.last_step_decode_batch,
            status.last_step_seq_len_sum,
        )
        self.received_at[status.instance_id] = self._clock()
        self.num_applied += 1
        self._changed(inst)
        return True

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
            self._changed(inst)

    def remove(self, instance_id: str) -> bool:
        """The instance's records are gone (TTL expired, deregistered): forget it entirely."""
        self._meta_ids.pop(instance_id, None)
        self._pending.pop(instance_id, None)
        self.received_at.pop(instance_id, None)
        if self._prefix is not None:
            self._prefix.forget(instance_id)
        return self._remove(instance_id)

    def known(self) -> set[str]:
        return set(self._meta_ids)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
