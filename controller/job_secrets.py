"""Job secrets in the registry: one file per job, mode 0600, under the controller's state directory.

``checkmate-ctl job add`` creates a job's secret (or takes one from ``--secret-file``)
and keeps it as ``<state dir>/secrets/job-<id>.secret`` (hex, one line; the directory
is 0700, the file 0600). ``checkmate-ctl job secret N`` prints where it is, and with
``--check FILE`` refuses a job file whose ``"secret"`` differs. The secret reaches
workers and shadows through a job file or an environment variable
(:mod:`checkmate.auth`), never a command line. ``job remove`` deletes it.

Every lane of a tensor-parallel job (:func:`controller.jobs.split_lanes`) is a job with a
secret of its own, so a lane's secret opens no other lane: ``job add --tp-degree T`` issues a
fresh one per lane, or, given ``--secret-file``, derives lane t's from it
(:func:`lane_secret`: HMAC-SHA256 of the file's secret and the lane's job id; whoever holds
the file can derive every lane's, a lane's holder none of the others'). A lane added on its
own (``--tp-index``) whose secret is another registered lane's is refused
(:meth:`JobSecrets.check_distinct`).
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
from pathlib import Path

from checkmate.auth import (
    AuthConfigError,
    derive_key,
    generate_secret,
    parse_secret,
    read_secret_file,
    secret_from_job_file,
)
from controller.errors import ControllerError

logger = logging.getLogger(__name__)

SECRETS_DIR = "secrets"


class JobSecretError(ControllerError):
    """A job secret that is missing, unreadable, too open or different from the registry's."""


class JobSecrets:
    """The secret files of one state directory."""

    def __init__(self, state_dir: str | Path) -> None:
        self.directory = Path(state_dir) / SECRETS_DIR

    def path(self, job_id: int) -> Path:
        return self.directory / f"job-{job_id}.secret"

    def create(self, job_id: int, take_from: Path | None = None, derive_lane: bool = False) -> Path:
        """Keep a new secret for ``job_id`` (``take_from``: a file holding one); its path.

        ``derive_lane``: keep :func:`lane_secret` of the file's secret for ``job_id`` instead
        (a lane of a TP job added with the others from one secret file).
        """
        if take_from is not None:
            try:
                raw = read_secret_file(take_from)
            except AuthConfigError as exc:
                raise JobSecretError(str(exc)) from None
            secret = lane_secret(raw, job_id) if derive_lane else raw.hex()
        else:
            secret = generate_secret()
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        path = self.path(job_id)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(secret + "\n")
        os.replace(tmp, path)
        logger.info("job %d: secret kept in %s (mode 0600)", job_id, path)
        return path

    def read(self, job_id: int) -> bytes:
        """The job's secret; JobSecretError naming the file if missing, unreadable or readable by others."""
        path = self.path(job_id)
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise JobSecretError(
                f"job {job_id} has no secret in the registry ({path} is missing): "
                "remove and add the job again"
            ) from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise JobSecretError(
                f"{path} is readable by others (mode {stat.S_IMODE(mode):04o}); chmod 600 it"
            )
        try:
            return parse_secret(path.read_text(encoding="utf-8"), f"registry secret {path}")
        except (OSError, AuthConfigError) as exc:
            raise JobSecretError(str(exc)) from None

    def remove(self, job_id: int) -> None:
        self.path(job_id).unlink(missing_ok=True)

    def check_job_file(self, job_id: int, job_file: Path) -> None:
        """Refuse (JobSecretError naming the file) a job file whose secret is not the registry's."""
        try:
            in_file = secret_from_job_file(job_file)
        except AuthConfigError as exc:
            raise JobSecretError(str(exc)) from None
        if not hmac.compare_digest(in_file, self.read(job_id)):
            raise JobSecretError(
                f"job file {job_file}: its secret differs from job {job_id}'s in the registry "
                f"({self.path(job_id)})"
            )

    def check_distinct(self, job_id: int, take_from: Path, others: list[int]) -> None:
        """Refuse (JobSecretError) the secret in ``take_from`` for lane ``job_id`` when it is also the
        registered secret of one of ``others`` (the other lanes of its TP job)."""
        try:
            mine = read_secret_file(take_from)
        except AuthConfigError as exc:
            raise JobSecretError(str(exc)) from None
        for other in others:
            if other == job_id or not self.path(other).exists():
                continue
            if hmac.compare_digest(mine, self.read(other)):
                raise JobSecretError(
                    f"{take_from}: this secret is job {other}'s, another lane of job {job_id}'s TP job; "
                    "each lane has its own secret (give another --secret-file, or none to have one created)"
                )


def lane_secret(secret: bytes, job_id: int) -> str:
    """Lane ``job_id``'s secret derived from a TP job's ``secret`` (hex): HMAC-SHA256(secret, label)."""
    return derive_key(secret, "lane", job_id).hex()
