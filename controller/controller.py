"""The controller: switches, registry and network description behind one object.

:class:`Controller` connects to every switch of a network description (one
:class:`SwitchConnection` each, opened on first use), keeps the job registry
in a state directory, and carries out the user's commands:

* :meth:`push_pipeline` and :meth:`install_forwarding` (routes and the source check
  derived from them, controller/route_ipv4.py);
* :meth:`add_job`, :meth:`remove_job`, :meth:`move_shard`: each one change,
  written as one batch per switch and undone as a whole if any switch
  rejects anything, recorded in the registry only once every switch took it;
* :meth:`reconcile`: read every switch back and make it match;
* :meth:`jobs` and :meth:`job_status` (with the switch's per-job counters).

Adds and moves are strict: they write exactly the difference between the
job's old and new plans, so an entry someone put on a switch behind the
controller's back makes the switch reject the write (and the change is undone).
Removal deletes whatever the switches hold for the job, so it also works
after entries vanished. ``checkmate-ctl`` reconciles on start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from p4.config.v1 import p4info_pb2

from checkmate.job import JobSpec, JobSpecError
from checkmate.network import Network
from checkmate.p4 import names
from checkmate.p4.conformance import check_names
from checkmate.p4.p4info import P4InfoIndex, P4InfoNameError
from checkmate.tls import TlsFiles
from controller.batch import apply_change, batches_for
from controller.counters import JOB_COUNTERS, CounterValue, read_counters
from controller.entities import (
    Entity,
    EntityCodec,
    MulticastGroup,
    TableEntry,
    Update,
    UpdateKind,
    sort_updates,
)
from controller.errors import ControllerError, JobError
from controller.jobs import Taken, allocate, job_updates, plan_entities
from controller.pipeline import PipelineConfig, push_pipeline
from controller.reconcile import GROUPS, OWNED_TABLES, ReconcileReport, plan_reconcile, read_installed
from controller.registry import JobRecord, Registry
from controller.route_ipv4 import TABLES as FORWARDING_TABLES
from controller.route_ipv4 import forwarding_entries
from controller.switch_connection import DEFAULT_TIMEOUT_S, PIPELINE_TIMEOUT_S, SwitchConnection

logger = logging.getLogger(__name__)

EntityMap = dict[tuple[object, ...], Entity]
ALL_SCOPE = (*OWNED_TABLES, GROUPS)


@dataclass(frozen=True)
class JobStatus:
    """A registered job with its counters since it was added, per switch."""

    record: JobRecord
    counters: dict[str, dict[str, CounterValue]]

    def total(self, counter: str) -> CounterValue:
        total = CounterValue()
        for values in self.counters.values():
            total = total + values.get(counter, CounterValue())
        return total


class Controller:
    """Programs the switches of ``network``; its registry lives in ``state_dir``."""

    def __init__(
        self,
        network: Network,
        state_dir: str | Path,
        election_id: int = 1,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_groups: int | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        self.network = network
        self.tls = tls
        """P4Runtime over TLS to every switch (None: plaintext, the tutorial workflow)."""
        self.election_id = election_id
        self.timeout = timeout
        self.max_groups = max_groups
        """Cap on multicast groups per switch, below each switch's own ``max_multicast_groups``."""
        self.registry = Registry(state_dir)
        self._connections: dict[str, SwitchConnection] = {}
        self._codecs: dict[str, EntityCodec] = {}

    # ---- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        for name, connection in sorted(self._connections.items()):
            try:
                connection.close()
            except ControllerError as exc:
                logger.warning("switch %s: closing the connection failed: %s", name, exc)
        self._connections.clear()
        self._codecs.clear()
        self.registry.close()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connection(self, switch: str) -> SwitchConnection:
        """The session with ``switch``, opened on first use (SwitchUnreachableError if it cannot be)."""
        if switch not in self._connections:
            spec = self.network.switch(switch)
            self._connections[switch] = SwitchConnection(
                switch, spec.grpc, spec.device_id, self.election_id, self.timeout, self.tls
            )
        return self._connections[switch]

    def connect(self, switches: Iterable[str] | None = None) -> None:
        """Open sessions with ``switches`` (all by default) before anything is written."""
        for switch in sorted(self.network.switches if switches is None else switches):
            self.connection(switch)

    def codec(self, switch: str) -> EntityCodec:
        """The entity codec for the P4Info ``switch`` runs (NoPipelineError if none)."""
        if switch not in self._codecs:
            self._codecs[switch] = checked_codec(
                self.connection(switch).get_p4info(), f"switch {switch}'s P4Info"
            )
        return self._codecs[switch]

    def _all_codecs(self) -> dict[str, EntityCodec]:
        return {switch: self.codec(switch) for switch in sorted(self.network.switches)}

    # ---- pipeline and forwarding ----------------------------------------------------------
    def push_pipeline(
        self, config: PipelineConfig, reconcile: bool = True, timeout: float = PIPELINE_TIMEOUT_S
    ) -> ReconcileReport | None:
        """Push ``config`` to every switch; then (by default) reinstall forwarding and every job."""
        codec = checked_codec(config.p4info, "the P4Info to push")
        self.connect()
        for switch in sorted(self.network.switches):
            push_pipeline(self.connection(switch), config, timeout=timeout)
            self._codecs[switch] = codec
        return self.reconcile() if reconcile else None

    def install_forwarding(self) -> ReconcileReport:
        """Make every switch's ``route_ipv4`` and ``check_source`` hold exactly what the routes say."""
        return self.reconcile(scope=FORWARDING_TABLES)

    # ---- desired state ----------------------------------------------------------------------
    def _job_plans(
        self, report: ReconcileReport | None = None
    ) -> tuple[list[JobRecord], dict[str, EntityMap]]:
        """Every registered job re-planned on the current network; records whose ids changed."""
        desired: dict[str, EntityMap] = {switch: {} for switch in self.network.switches}
        changed: list[JobRecord] = []
        records = self.registry.jobs()
        taken_groups: dict[str, set[int]] = {}
        taken_rids: dict[str, set[int]] = {}
        for record in records:
            for (switch, _, _), group_id in record.groups.items():
                taken_groups.setdefault(switch, set()).add(group_id)
            for (switch, _), rid in record.rids.items():
                taken_rids.setdefault(switch, set()).add(rid)
        slots = {r.slot for r in records}
        for record in records:
            mine_groups = {(s, g) for (s, _, _), g in record.groups.items()}
            mine_rids = {(s, r) for (s, _), r in record.rids.items()}
            taken = Taken(
                groups={
                    s: ids - {g for (ms, g) in mine_groups if ms == s} for s, ids in taken_groups.items()
                },
                rids={s: ids - {r for (ms, r) in mine_rids if ms == s} for s, ids in taken_rids.items()},
                slots=slots - {record.slot},
            )
            try:
                fresh = allocate(
                    self.network, record.spec, taken, previous=record, max_groups=self.max_groups
                )
                plan = plan_entities(self.network, fresh)
            except ControllerError as exc:
                if report is None:
                    raise
                logger.error("job %d cannot be planned on this network: %s", record.job_id, exc)
                report.skipped_jobs.append(f"job {record.job_id}: {exc}")
                continue
            if fresh != record:
                changed.append(fresh)
                for (switch, _, _), group_id in fresh.groups.items():
                    taken_groups.setdefault(switch, set()).add(group_id)
                for (switch, _), rid in fresh.rids.items():
                    taken_rids.setdefault(switch, set()).add(rid)
            for switch, entities in plan.items():
                desired[switch].update(entities)
        return changed, desired

    def desired_state(self, report: ReconcileReport | None = None) -> dict[str, EntityMap]:
        """Per switch, every entity the network's routes (``route_ipv4``, ``check_source``) and the
        registered jobs need."""
        _, desired = self._desired(report)
        return desired

    def _desired(self, report: ReconcileReport | None) -> tuple[list[JobRecord], dict[str, EntityMap]]:
        changed, desired = self._job_plans(report)
        for switch in self.network.switches:
            for entry in forwarding_entries(self.network, switch):
                desired[switch][entry.key] = entry
        return changed, desired

    # ---- reconciliation ---------------------------------------------------------------------
    def read_installed(self, switch: str, scope: Sequence[str] = ALL_SCOPE) -> EntityMap:
        return read_installed(self.connection(switch), self.codec(switch), scope)

    def reconcile(self, scope: Sequence[str] = ALL_SCOPE) -> ReconcileReport:
        """Read every switch back and insert what is missing, modify what differs, delete what is stale."""
        with self.registry.lock():
            self.connect()
            codecs = self._all_codecs()
            report = ReconcileReport()
            changed, desired = self._desired(report)
            changes: dict[str, list[Update]] = {}
            for switch in sorted(self.network.switches):
                installed = self.read_installed(switch, scope)
                changes[switch] = plan_reconcile(desired[switch], installed, scope)
                report.add(switch, changes[switch])
            apply_change(batches_for(changes, self._connections, codecs), "reconcile")
            for record in changed:
                self.registry.put_job(record)
        logger.info("reconcile: %s", report.summary())
        return report

    # ---- jobs -------------------------------------------------------------------------------
    def jobs(self) -> list[JobRecord]:
        return self.registry.jobs()

    def job(self, job_id: int) -> JobRecord:
        record = self.registry.job(job_id)
        if record is None:
            known = self.registry.job_ids()
            raise JobError(f"job {job_id} is not registered; registered jobs: {known or 'none'}")
        return record

    def _taken(self, except_job: int | None) -> Taken:
        switches = sorted(self.network.switches)
        return Taken(
            groups={s: self.registry.used_group_ids(s, except_job) for s in switches},
            rids={s: self.registry.used_rids(s, except_job) for s in switches},
            slots=self.registry.used_slots(except_job),
        )

    def add_job(self, spec: JobSpec) -> JobRecord:
        """Install a new job on every switch; register it once all switches took it."""
        with self.registry.lock():
            if self.registry.job(spec.job_id) is not None:
                raise JobError(
                    f"job {spec.job_id} is already registered; remove it first or use `shadow move`"
                )
            record = allocate(self.network, spec, self._taken(None), max_groups=self.max_groups)
            changes = job_updates(self.network, None, record)
            self.connect()
            codecs = self._all_codecs()
            baselines: dict[tuple[str, str], tuple[int, int]] = {}
            for switch in sorted(self.network.switches):
                values = read_counters(self.connection(switch), codecs[switch], record.slot)
                for name, value in values.items():
                    baselines[(switch, name)] = (value.packets, value.bytes)
            record = JobRecord(record.spec, record.slot, record.groups, record.rids, baselines)
            apply_change(batches_for(changes, self._connections, codecs), f"job add {spec.job_id}")
            self.registry.put_job(record)
        logger.info(
            "job %d added: slot %d, %d group(s), %d rid(s)",
            spec.job_id,
            record.slot,
            len(record.groups),
            len(record.rids),
        )
        return record

    def move_shard(self, job_id: int, shard_key: int, shadow: str) -> JobRecord:
        """Re-point one shard of a job to another shadow (workers are untouched)."""
        after = self._change_job(
            job_id,
            lambda spec: spec.with_shard_moved(shard_key, shadow),
            f"shadow move job {job_id} shard {shard_key} -> {shadow}",
        )
        logger.info("job %d: shard %d now goes to %s", job_id, shard_key, shadow)
        return after

    def resize_job(self, job_id: int, workers: tuple[str, ...]) -> JobRecord:
        """Give a job another worker ring (an elastic restart), as one batch per switch.

        Replication entries of ring links that remain are kept; those of links that
        vanished are deleted and new links get theirs. Shadows and shard map are unchanged.
        """
        after = self._change_job(
            job_id, lambda spec: spec.with_workers(workers), f"job resize {job_id} -> {','.join(workers)}"
        )
        logger.info("job %d: workers now %s", job_id, ",".join(workers))
        return after

    def _change_job(self, job_id: int, change: Callable[[JobSpec], JobSpec], what: str) -> JobRecord:
        """Write exactly the difference between a job's plan and the plan of ``change(spec)``."""
        with self.registry.lock():
            before = self.job(job_id)
            try:
                spec = change(before.spec)
            except JobSpecError as exc:
                raise JobError(str(exc)) from None
            after = allocate(
                self.network, spec, self._taken(job_id), previous=before, max_groups=self.max_groups
            )
            changes = job_updates(self.network, before, after)
            self.connect()
            codecs = self._all_codecs()
            apply_change(batches_for(changes, self._connections, codecs), what)
            self.registry.put_job(after)
        return after

    def remove_job(self, job_id: int) -> JobRecord:
        """Delete everything the switches hold for the job, then forget it."""
        with self.registry.lock():
            record = self.job(job_id)
            self.connect()
            codecs = self._all_codecs()
            changes: dict[str, list[Update]] = {}
            for switch in sorted(self.network.switches):
                installed = self.read_installed(switch)
                owned = [e for e in installed.values() if _owned_by(record, switch, e)]
                changes[switch] = sort_updates(Update(UpdateKind.DELETE, e) for e in owned)
            apply_change(batches_for(changes, self._connections, codecs), f"job remove {job_id}")
            self.registry.remove_job(job_id)
        logger.info("job %d removed", job_id)
        return record

    def job_status(self, job_id: int) -> JobStatus:
        """The job with its counters (since it was added) at every switch."""
        record = self.job(job_id)
        counters: dict[str, dict[str, CounterValue]] = {}
        for switch in sorted(self.network.switches):
            values = read_counters(self.connection(switch), self.codec(switch), record.slot, JOB_COUNTERS)
            counters[switch] = {
                name: value.since(record.baselines.get((switch, name), (0, 0)))
                for name, value in values.items()
            }
        return JobStatus(record, counters)


def checked_codec(info: p4info_pb2.P4Info, what: str) -> EntityCodec:
    """The codec for ``info``, once it is known to define every name the controller uses.

    ControllerError naming each missing or renamed table, action, field or counter: a switch
    running another program is refused when the controller first meets it, not at a write.
    """
    index = P4InfoIndex(info)
    try:
        check_names(index, what)
    except P4InfoNameError as exc:
        raise ControllerError(str(exc)) from None
    return EntityCodec(index)


def _owned_by(record: JobRecord, switch: str, entity: Entity) -> bool:
    """Whether an installed entity belongs to the job: its job id, or a group/rid it holds there."""
    if isinstance(entity, MulticastGroup):
        return entity.group_id in {g for (s, _, _), g in record.groups.items() if s == switch}
    assert isinstance(entity, TableEntry)
    if entity.table == names.LookupJob.NAME:
        return entity.match_value(names.LookupJob.JOB_ID) == record.job_id
    if entity.table == names.ReplicateToShadow.NAME:
        return entity.match_value(names.ReplicateToShadow.JOB_ID) == record.job_id
    if entity.table == names.RewriteShadowCopy.NAME:
        rid = entity.match_value(names.RewriteShadowCopy.EGRESS_RID)
        return rid in {r for (s, _), r in record.rids.items() if s == switch}
    return False
