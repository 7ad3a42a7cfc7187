"""The migration dispatcher: one cycle's pairs as parallel Migrate calls to the source llumlets.

Channels are pooled per llumlet address (--llumlet-grpc-connection-pool-size, used in turn) and
kept between cycles; those of addresses that left the view are closed by `prune`. Each call has
the --llumlet-grpc-timeout-seconds deadline. A failure is counted (rescheduling_failed_count),
logged (a timeout apart from other errors; WARNING when a source starts failing or fails for
another reason, DEBUG while it keeps failing the same way) and never stops the others.

Channels dial TLS when the process has a certificate or a CA (pilotfish/security.py, the llumlets
then verified by --tls-ca-file, this process's certificate presented for mutual TLS), and every
call carries the token (`authorization: Bearer`, --auth-token-file; or the deprecated --llumlet-token).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Iterable, Sequence

import grpc

from pilotfish.protos import llumlet_pb2, llumlet_pb2_grpc
from pilotfish.protos.migration_selection import method_number, order_number, rule_number
from pilotfish.scheduler.rescheduler.telemetry import ReschedulerTelemetry
from pilotfish.scheduler.rescheduler.types import MigrationPair, MigrationResult
from pilotfish.scheduler.view.types import InstanceView
from pilotfish.security import Security

log = logging.getLogger(__name__)

CLOSE_GRACE = 1.0


def migrate_request(pair: MigrationPair) -> llumlet_pb2.MigrateRequest:
    return llumlet_pb2.MigrateRequest(
        source_instance_id=pair.source.instance_id,
        destination_instance_id=pair.destination.instance_id,
        destination_llumlet_address=pair.destination.llumlet_address,
        select_rule=rule_number(pair.rule),
        select_order=order_number(pair.order),
        select_value=pair.value,
        method=method_number(pair.method),
        reason=pair.policy,
    )


class _Pool:
    def __init__(self, address: str, size: int, security: Security | None = None) -> None:
        if security is not None:
            self.channels = [security.aio_channel(address) for _ in range(size)]
        else:
            self.channels = [grpc.aio.insecure_channel(address) for _ in range(size)]
        self.stubs = [llumlet_pb2_grpc.LlumletStub(ch) for ch in self.channels]
        self._turn = itertools.cycle(range(size))

    def stub(self) -> llumlet_pb2_grpc.LlumletStub:
        return self.stubs[next(self._turn)]

    async def close(self) -> None:
        for ch in self.channels:
            with contextlib.suppress(Exception):
                await ch.close(CLOSE_GRACE)


class MigrationDispatcher:
    def __init__(
        self,
        telemetry: ReschedulerTelemetry,
        *,
        pool_size: int = 1,
        timeout_s: float = 10.0,
        token: str = "",
        security: Security | None = None,
    ) -> None:
        self.telemetry = telemetry
        self.pool_size = pool_size
        self.timeout_s = timeout_s
        self._security = security
        if security is not None and security.token:
            self._metadata = security.metadata
        else:
            self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._pools: dict[str, _Pool] = {}
        # the last failure reason per source, so a source that keeps failing logs once
        self._failing: dict[str, str] = {}

    async def dispatch(self, pairs: Sequence[MigrationPair]) -> list[MigrationResult]:
        """All pairs at once; returns when every call has answered or timed out, in pair order."""
        return list(await asyncio.gather(*(self._migrate(p) for p in pairs)))

    async def _migrate(self, pair: MigrationPair) -> MigrationResult:
        self.telemetry.attempted.labels(pair.policy).inc()
        if not pair.source.llumlet_address:
            result = MigrationResult(pair, reason="no_source_address", detail="its CMS metadata has no llumlet_port")
        elif not pair.destination.llumlet_address:
            result = MigrationResult(
                pair, reason="no_destination_address", detail="the destination's CMS metadata has no llumlet_port"
            )
        else:
            result = await self._call(pair)
        self._record(result)
        return result

    async def _call(self, pair: MigrationPair) -> MigrationResult:
        address = pair.source.llumlet_address
        pool = self._pools.get(address)
        if pool is None:
            pool = self._pools[address] = _Pool(address, self.pool_size, self._security)
        try:
            response = await pool.stub().Migrate(migrate_request(pair), timeout=self.timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return MigrationResult(pair, reason="timeout", detail=f"no answer within {self.timeout_s:g}s")
            return MigrationResult(pair, reason=exc.code().name.lower(), detail=exc.details() or "")
        migrated, failed = tuple(response.migrated_request_ids), tuple(response.failed_request_ids)
        if response.error and not migrated:
            return MigrationResult(pair, failed=failed, reason="rejected", detail=response.error)
        return MigrationResult(pair, migrated=migrated, failed=failed, detail=response.error)

    def _record(self, result: MigrationResult) -> None:
        pair = result.pair
        source = pair.source.instance_id
        if result.migrated:
            self.telemetry.migrated.labels(pair.policy).inc(len(result.migrated))
        if result.ok:
            self._failing.pop(source, None)
            log.debug("%r: migrated %d requests (%d failed)", pair, len(result.migrated), len(result.failed))
            return
        self.telemetry.failed.labels(pair.policy, result.reason).inc()
        level = logging.DEBUG if self._failing.get(source) == result.reason else logging.WARNING
        self._failing[source] = result.reason
        if result.reason == "timeout":
            log.log(level, "Migrate timed out on %s (%s): %r", source, pair.source.llumlet_address, pair)
        else:
            log.log(
                level,
                "Migrate failed on %s (%s): %s: %s",
                source,
                pair.source.llumlet_address,
                result.reason,
                result.detail,
            )

    async def prune(self, instances: Iterable[InstanceView]) -> None:
        """Close the channels of llumlets no longer in the view, and forget their instances' failures."""
        view = list(instances)
        live = {i.llumlet_address for i in view}
        for address in [a for a in self._pools if a not in live]:
            await self._pools.pop(address).close()
        ids = {i.instance_id for i in view}
        for instance_id in [i for i in self._failing if i not in ids]:
            del self._failing[instance_id]

    async def close(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.close()

    @property
    def addresses(self) -> list[str]:
        return list(self._pools)
