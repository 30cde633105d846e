"""The persistent job registry: SQLite under the controller's state directory.

It records, per job, its description, its counter slot, and the multicast
group ids and rids it holds at each switch, plus the counter values seen when
the job was added (``job show`` reports counts since then). The schema is
created if missing and never migrated; the primary keys and UNIQUE
constraints make two jobs sharing a group id, rid or slot impossible. Every
change is one transaction (``BEGIN IMMEDIATE``), and :meth:`Registry.lock`
serialises controllers that share a state directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sqlite3
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from checkmate.job import JobSpec
from controller.errors import ControllerError

logger = logging.getLogger(__name__)

DB_NAME = "registry.sqlite3"
LOCK_NAME = "controller.lock"

GroupKey = tuple[str, int, str]
"""(switch, next-hop port, shadow)."""
RidKey = tuple[str, str]
"""(switch, shadow)."""
BaselineKey = tuple[str, str]
"""(switch, counter name)."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id  INTEGER PRIMARY KEY,
    spec    TEXT    NOT NULL,
    slot    INTEGER NOT NULL UNIQUE CHECK (slot BETWEEN 1 AND 255),
    created REAL    NOT NULL
);
CREATE TABLE IF NOT EXISTS groups (
    switch        TEXT    NOT NULL,
    group_id      INTEGER NOT NULL CHECK (group_id BETWEEN 1 AND 32767),
    job_id        INTEGER NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
    next_hop_port INTEGER NOT NULL,
    shadow        TEXT    NOT NULL,
    PRIMARY KEY (switch, group_id),
    UNIQUE (switch, job_id, next_hop_port, shadow)
);
CREATE TABLE IF NOT EXISTS rids (
    switch TEXT    NOT NULL,
    rid    INTEGER NOT NULL CHECK (rid BETWEEN 1 AND 65535),
    job_id INTEGER NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
    shadow TEXT    NOT NULL,
    PRIMARY KEY (switch, rid),
    UNIQUE (switch, job_id, shadow)
);
CREATE TABLE IF NOT EXISTS counter_baselines (
    job_id  INTEGER NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
    switch  TEXT    NOT NULL,
    counter TEXT    NOT NULL,
    packets INTEGER NOT NULL,
    bytes   INTEGER NOT NULL,
    PRIMARY KEY (job_id, switch, counter)
);
"""


class RegistryError(ControllerError):
    """The registry cannot be opened, locked or written."""


@dataclass(frozen=True)
class JobRecord:
    """A registered job and everything allocated to it."""

    spec: JobSpec
    slot: int
    groups: Mapping[GroupKey, int] = field(default_factory=dict)
    rids: Mapping[RidKey, int] = field(default_factory=dict)
    baselines: Mapping[BaselineKey, tuple[int, int]] = field(default_factory=dict)

    @property
    def job_id(self) -> int:
        return self.spec.job_id


class Registry:
    """The job registry in ``state_dir``. Close it (or use ``with``) when done."""

    def __init__(self, state_dir: str | Path, timeout: float = 10.0) -> None:
        self.state_dir = Path(state_dir)
        self.timeout = timeout
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.state_dir / DB_NAME, timeout=timeout, isolation_level=None)
            self._db.execute("PRAGMA foreign_keys = ON")
            self._db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise RegistryError(f"cannot open the job registry in {self.state_dir}: {exc}") from None
        self._lock_file: int | None = None

    def close(self) -> None:
        self._db.close()
        if self._lock_file is not None:
            os.close(self._lock_file)
            self._lock_file = None

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- locking ------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the state directory's lock (one changing controller at a time)."""
        fd = os.open(self.state_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise RegistryError(
                            f"another controller holds {self.state_dir / LOCK_NAME} "
                            f"(waited {self.timeout:g} s)"
                        ) from None
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise RegistryError(f"cannot start a registry transaction: {exc}") from None
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        else:
            self._db.execute("COMMIT")

    # ---- reads --------------------------------------------------------------------------
    def job_ids(self) -> list[int]:
        return [row[0] for row in self._db.execute("SELECT job_id FROM jobs ORDER BY job_id")]

    def job(self, job_id: int) -> JobRecord | None:
        row = self._db.execute("SELECT spec, slot FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        if row is None:
            return None
        spec = JobSpec.from_json(json.loads(row[0]))
        groups = {
            (s, p, sh): g
            for s, g, p, sh in self._db.execute(
                "SELECT switch, group_id, next_hop_port, shadow FROM groups WHERE job_id = ?", (job_id,)
            )
        }
        rids = {
            (s, sh): r
            for s, r, sh in self._db.execute(
                "SELECT switch, rid, shadow FROM rids WHERE job_id = ?", (job_id,)
            )
        }
        baselines = {
            (s, c): (p, b)
            for s, c, p, b in self._db.execute(
                "SELECT switch, counter, packets, bytes FROM counter_baselines WHERE job_id = ?", (job_id,)
            )
        }
        return JobRecord(spec, row[1], groups, rids, baselines)

    def jobs(self) -> list[JobRecord]:
        records = [self.job(job_id) for job_id in self.job_ids()]
        return [r for r in records if r is not None]

    def used_slots(self, except_job: int | None = None) -> set[int]:
        return {r[0] for r in self._db.execute("SELECT slot FROM jobs WHERE job_id IS NOT ?", (except_job,))}

    def used_group_ids(self, switch: str, except_job: int | None = None) -> set[int]:
        rows = self._db.execute(
            "SELECT group_id FROM groups WHERE switch = ? AND job_id IS NOT ?", (switch, except_job)
        )
        return {r[0] for r in rows}

    def used_rids(self, switch: str, except_job: int | None = None) -> set[int]:
        rows = self._db.execute(
            "SELECT rid FROM rids WHERE switch = ? AND job_id IS NOT ?", (switch, except_job)
        )
        return {r[0] for r in rows}

    # ---- writes -------------------------------------------------------------------------
    def put_job(self, record: JobRecord) -> None:
        """Insert or replace a job with all its allocations, atomically."""
        try:
            with self._transaction() as db:
                db.execute("DELETE FROM jobs WHERE job_id = ?", (record.job_id,))
                db.execute(
                    "INSERT INTO jobs (job_id, spec, slot, created) VALUES (?, ?, ?, ?)",
                    (
                        record.job_id,
                        json.dumps(record.spec.to_json(), sort_keys=True),
                        record.slot,
                        time.time(),
                    ),
                )
                db.executemany(
                    "INSERT INTO groups (switch, group_id, job_id, next_hop_port, shadow) "
                    "VALUES (?, ?, ?, ?, ?)",
                    [(s, g, record.job_id, p, sh) for (s, p, sh), g in sorted(record.groups.items())],
                )
                db.executemany(
                    "INSERT INTO rids (switch, rid, job_id, shadow) VALUES (?, ?, ?, ?)",
                    [(s, r, record.job_id, sh) for (s, sh), r in sorted(record.rids.items())],
                )
                db.executemany(
                    "INSERT INTO counter_baselines (job_id, switch, counter, packets, bytes) "
                    "VALUES (?, ?, ?, ?, ?)",
                    [(record.job_id, s, c, p, b) for (s, c), (p, b) in sorted(record.baselines.items())],
                )
        except sqlite3.Error as exc:
            raise RegistryError(f"cannot record job {record.job_id}: {exc}") from None
        logger.info("registry: recorded job %d (slot %d)", record.job_id, record.slot)

    def remove_job(self, job_id: int) -> None:
        try:
            with self._transaction() as db:
                db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))
        except sqlite3.Error as exc:
            raise RegistryError(f"cannot remove job {job_id}: {exc}") from None
        logger.info("registry: removed job %d", job_id)

    def dump(self) -> dict[str, list[tuple[object, ...]]]:
        """Every row of every table, sorted: tests compare registries with it."""
        out: dict[str, list[tuple[object, ...]]] = {}
        for table in ("jobs", "groups", "rids", "counter_baselines"):
            columns = "job_id, spec, slot" if table == "jobs" else "*"
            out[table] = sorted(tuple(r) for r in self._db.execute(f"SELECT {columns} FROM {table}"))
        return out
