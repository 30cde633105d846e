"""Ask a job's shadows for their status, for ``checkmate-ctl job show``.

Each shadow answers a ``status_request`` on its control port (TCP, default
48880) with its status document (docs/shadow.md, "Status fields"). This module
asks each with :func:`checkmate.control.query_status` (the control channel's one status
client, torch-free) and turns the answers into lines or JSON.

Every query has a deadline: connecting, sending and reading the whole reply
together take at most ``timeout`` seconds. The shadows are asked in parallel,
and a shadow that is down, slow or answers garbage becomes a
:class:`ShadowStatus` with an ``error``; nothing here raises for one shadow.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from checkmate.control import ShadowStatusError, query_status
from checkmate.control_frame import DEFAULT_CONTROL_PORT, ControlAuth
from checkmate.job import JobSpec
from checkmate.network import Addr, Network, NetworkError

logger = logging.getLogger(__name__)

SHADOW_CONTROL_PORT = DEFAULT_CONTROL_PORT
"""A shadow's control port unless told otherwise."""
DEFAULT_SHADOW_TIMEOUT_S = 2.0
"""Seconds ``job show`` gives each shadow to answer."""
MAX_PARALLEL_QUERIES = 32


@dataclass(frozen=True)
class ShadowStatus:
    """The answer of one shadow: its status document, or why there is none."""

    shadow: str
    address: str
    """``host:port`` asked, or "" when the shadow has no address."""
    status: dict[str, Any] | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The status document, or ``{"error": ...}``."""
        if self.status is not None:
            return self.status
        return {"error": self.error or "no status"}


def _format_address(address: Addr) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def shadow_addresses(
    spec: JobSpec,
    network: Network,
    control_port: int = SHADOW_CONTROL_PORT,
    overrides: Mapping[str, Addr] | None = None,
) -> dict[str, Addr | ShadowStatusError]:
    """Where to ask each of the job's shadows: ``overrides[name]``, else its network IP + ``control_port``.

    A shadow that is neither overridden nor a host of the network maps to the error.
    """
    overrides = overrides or {}
    addresses: dict[str, Addr | ShadowStatusError] = {}
    for name in spec.shadows:
        if name in overrides:
            addresses[name] = overrides[name]
            continue
        try:
            addresses[name] = (str(network.host(name).address), control_port)
        except NetworkError as exc:
            addresses[name] = ShadowStatusError(f"no address: {exc}")
    return addresses


def _ask(
    name: str, address: Addr | ShadowStatusError, timeout: float, job_id: int, auth: ControlAuth | None
) -> ShadowStatus:
    if isinstance(address, ShadowStatusError):
        return ShadowStatus(name, "", error=str(address))
    where = _format_address(address)
    try:
        # the job's shadow by name: a node that names itself otherwise in its hello is refused
        return ShadowStatus(name, where, status=query_status(address, timeout, job_id, auth, name=name))
    except ShadowStatusError as exc:
        logger.info("shadow %s at %s: %s", name, where, exc)
        return ShadowStatus(name, where, error=str(exc))


def query_shadows(
    addresses: Mapping[str, Addr | ShadowStatusError],
    timeout: float = DEFAULT_SHADOW_TIMEOUT_S,
    job_id: int = 0,
    secret: bytes | None = None,
) -> list[ShadowStatus]:
    """Every shadow's status, asked in parallel, in the order of ``addresses``; never raises for a shadow.

    ``secret``: the job's (from the registry); None: this process's."""
    auth = ControlAuth(secret) if secret is not None else None
    if not addresses:
        return []
    names = list(addresses)
    with ThreadPoolExecutor(
        max_workers=min(len(names), MAX_PARALLEL_QUERIES), thread_name_prefix="shadow-status"
    ) as pool:
        return list(pool.map(lambda name: _ask(name, addresses[name], timeout, job_id, auth), names))


# ---- one line per shadow ---------------------------------------------------------------
def _value(document: Mapping[str, Any], key: str) -> str:
    value = document.get(key)
    return "-" if value is None else str(value)


def _counts(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, Mapping) else {}


def summary_line(answer: ShadowStatus, job_id: int | None = None) -> str:
    """``sh1 10.0.9.1:48880: running  certified 41  applied 41  lag 1  received ...`` or the error.

    With ``job_id``, a shadow that serves another job says so.
    """
    where = f"{answer.shadow} {answer.address}" if answer.address else answer.shadow
    if answer.status is None:
        return f"{where}: error: {answer.error}"
    doc = answer.status
    parts = [
        f"{where}: {_value(doc, 'state')}",
        f"certified {_value(doc, 'certified_iteration')}",
        f"applied {_value(doc, 'applied_iteration')}",
        f"lag {_value(doc, 'lag_iterations')}",
        f"received {_value(doc, 'packets_received')} packets / {_value(doc, 'bytes_received')} bytes",
    ]
    disk = doc.get("disk")
    if isinstance(disk, Mapping):  # how old the newest complete checkpoint on disk is
        if disk.get("newest_complete_step") is None:
            parts.append("disk none")
        else:
            parts.append(
                f"disk step {disk['newest_complete_step']} ({_value(disk, 'age_iterations')} behind, "
                f"{_value(disk, 'age_seconds')} s old)"
            )
    repairs = _counts(doc.get("repairs"))
    parts.append(
        f"repairs {repairs.get('requests', 0)} requests / {repairs.get('elements_repaired', 0)} elements"
        + (f" / {repairs['unrepairable']} unrepairable" if repairs.get("unrepairable") else "")
    )
    drops = {k: v for k, v in _counts(doc.get("drops")).items() if v}
    if drops:
        parts.append("drops " + ", ".join(f"{k} {v}" for k, v in sorted(drops.items())))
    else:
        parts.append("drops 0")
    if doc.get("blocked"):
        parts.append(f"blocked: {doc['blocked']}")
    divergence = doc.get("divergence")
    if isinstance(divergence, Mapping):
        shown = [str(m) for m in divergence.get("mismatches") or []][:3]
        parts.append(
            f"DIVERGED after iteration {divergence.get('iteration', '-')}: "
            f"{divergence.get('mismatched_tensors', len(shown))} tensors differ from rank 0's "
            f"({', '.join(shown) or '-'}); certified only through {divergence.get('last_verified', '-')}, "
            "re-seeding"
        )
    elif doc.get("divergences"):
        last = doc.get("last_divergence")
        when = last.get("iteration", "-") if isinstance(last, Mapping) else "-"
        parts.append(f"divergences {doc['divergences']} (last after iteration {when}; re-seeded)")
    served = doc.get("job_id")
    if job_id is not None and served is not None and served != job_id:
        parts.append(f"serves job {served}, not {job_id}")
    return "  ".join(parts)


# ---- the job's protection, from every shadow's answer ------------------------------------
NOT_PROTECTING = ("waiting_for_job", "waiting_for_layout", "diverged")
"""Shadow states in which a shadow holds no certified state of the job that advances."""


def protection(answers: Sequence[ShadowStatus], job_id: int | None = None) -> dict[str, Any]:
    """Whether the shadows protect the job, as ``job show`` sees it from their answers.

    Protected: every shadow answered, serves the job, is ``running`` (or ``stalled``, said as a
    warning: an iteration it waits for) and has certified an iteration. ``certified_through`` is
    the last iteration every shadow certified, ``lag_iterations`` the slowest shadow's lag
    (``latest_commit - applied``, its own view; rank 0's, against its last commit, is in the
    agent's metrics and ``agent.stats()["protection"]``).
    """
    problems: list[str] = []
    warnings: list[str] = []
    certified: list[int] = []
    lags: list[int] = []
    for answer in answers:
        if answer.status is None:
            problems.append(f"{answer.shadow}: no answer ({answer.error})")
            continue
        doc = answer.status
        served = doc.get("job_id")
        state = str(doc.get("state"))
        blocked = f" ({doc['blocked']})" if doc.get("blocked") else ""
        if job_id is not None and served is not None and served != job_id:
            problems.append(f"{answer.shadow}: serves job {served}")
        elif state in NOT_PROTECTING:
            problems.append(f"{answer.shadow}: {state}{blocked}")
        elif state != "running":
            warnings.append(f"{answer.shadow}: {state}{blocked}")
        value = doc.get("certified_iteration")
        certified.append(value if isinstance(value, int) else -1)
        lag = doc.get("lag_iterations")
        if isinstance(lag, int):
            lags.append(lag)
    through = min(certified) if certified and len(certified) == len(answers) else None
    if through is not None and through < 0 and not problems:
        problems.append("no iteration certified by every shadow yet")
    return {
        "protected": not problems and through is not None and through >= 0,
        "certified_through": through if through is not None and through >= 0 else None,
        "lag_iterations": max(lags) if lags else None,
        "problems": problems,
        "warnings": warnings,
    }


def protection_line(summary: Mapping[str, Any]) -> str:
    """``protection: every shadow certified through iteration 40 (the slowest lags 2)`` or UNPROTECTED."""
    if not summary["protected"]:
        return "protection: UNPROTECTED: " + "; ".join(summary["problems"] or ["no shadow"])
    line = (
        f"protection: every shadow certified through iteration {summary['certified_through']} "
        f"(the slowest lags {'-' if summary['lag_iterations'] is None else summary['lag_iterations']})"
    )
    return line + (f"; {'; '.join(summary['warnings'])}" if summary["warnings"] else "")
