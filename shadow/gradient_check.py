"""The shadow's check of its assembled copies against rank 0's gradient tags, before any apply.

Gradient DATA datagrams carry no MAC (docs/security.md), so a host that forges a
worker's source address can put its own values into a shadow's buckets before the
genuine copies arrive. Rank 0 tags every fully reduced bucket
(:class:`checkmate.auth.GradientDigests`) and sends the tags in its authenticated
commit; :meth:`GradientCheck.forged` recomputes them over the bucket the shadow
assembled. A bucket whose tag differs is never applied: the apply thread throws its
copies away (counted ``forged_gradient``), logs it and repairs the bucket from the
workers (REPAIR_DATA carries the job's MAC; DATA copies of the bucket are refused from
then on); only if the repaired bucket fails the tag too is rank 0 asked for fresh state.
This holds whatever ``CHECKMATE_FINGERPRINT_EVERY`` is. A commit without tags comes
from an older rank 0 (the commit itself is authenticated, so nobody else can strip them):
its iteration is applied unchecked, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from checkmate.auth import GradientDigests
from checkmate.tensors import tensor_payload
from shadow.iteration_window import PendingIteration


class GradientCheck:
    """One secret's checkers, per job id (thread-safe)."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._by_job: dict[int, GradientDigests] = {}
        self._lock = threading.Lock()

    def _for_job(self, job_id: int) -> GradientDigests:
        with self._lock:
            checker = self._by_job.get(job_id)
            if checker is None:
                checker = self._by_job[job_id] = GradientDigests(self._secret, job_id)
            return checker

    def forged(
        self, job_id: int, digests: Mapping[str, Any] | None, pending: PendingIteration
    ) -> list[tuple[int, str]]:
        """``(bucket, why)`` for each owned bucket of ``pending`` that is not what rank 0 tagged."""
        if digests is None:
            return []
        checker = self._for_job(job_id)
        bad = []
        for bucket_id, assembly in sorted(pending.buckets.items()):
            data = tensor_payload(assembly.buffer.contiguous())
            why = checker.check(digests, bucket_id, data)
            if why is not None:
                bad.append((bucket_id, why))
        return bad
