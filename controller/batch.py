"""Writing one change as one batch per switch, undone as a whole if any update fails.

BMv2's P4Runtime server (PI) only implements CONTINUE_ON_ERROR atomicity, so
rollback is ours: when a switch rejects an update, the updates of the change
that did succeed (on that switch and on the switches written before it) are
undone with their inverses, in reverse order. The error names the rejected
update and the switch's ``p4.v1.Error``. Every batch is encoded before the
first one is sent, so a naming mistake writes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from p4.v1 import p4runtime_pb2

from controller.entities import EntityCodec, Update
from controller.errors import (
    ControllerError,
    RollbackFailedError,
    SwitchRpcError,
    WriteRejectedError,
)
from controller.switch_connection import SwitchConnection

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SwitchBatch:
    switch: str
    connection: SwitchConnection
    codec: EntityCodec
    updates: Sequence[Update]


def apply_change(batches: Sequence[SwitchBatch], what: str) -> None:
    """Write every batch, in order; on any failure undo all that was written and raise.

    Raises WriteRejectedError (a switch rejected an update), SwitchRpcError
    (a write failed as a whole) or RollbackFailedError (undoing failed too).
    """
    encoded: list[tuple[SwitchBatch, list[p4runtime_pb2.Update]]] = []
    for batch in batches:
        try:
            encoded.append((batch, [batch.codec.to_update(u) for u in batch.updates]))
        except (KeyError, ValueError) as exc:
            raise ControllerError(
                f"{what}: cannot encode an update for switch {batch.switch}: {exc}"
            ) from None

    written: list[tuple[SwitchBatch, list[Update]]] = []
    for batch, messages in encoded:
        if not messages:
            continue
        logger.info("%s: writing %d update(s) to switch %s", what, len(messages), batch.switch)
        try:
            errors = batch.connection.write(messages)
        except SwitchRpcError as exc:
            _undo(written, what, cause=str(exc))
            uncertain = ""
            if exc.code_name in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"):
                uncertain = (
                    f"; switch {batch.switch} may hold part of the batch: run `checkmate-ctl reconcile`"
                )
            raise SwitchRpcError(
                f"{what}: {exc}. Updates already written to other switches were undone; the registry is "
                f"unchanged{uncertain}",
                exc.code_name,
            ) from None
        succeeded = [u for u, e in zip(batch.updates, errors, strict=True) if e is None]
        rejected = [(u, e) for u, e in zip(batch.updates, errors, strict=True) if e is not None]
        written.append((batch, succeeded))
        if rejected:
            first_update, first_error = rejected[0]
            cause = f"switch {batch.switch} rejected {first_update}: {first_error}"
            undone = _undo(written, what, cause=cause)
            more = f" (and {len(rejected) - 1} more rejected update(s))" if len(rejected) > 1 else ""
            raise WriteRejectedError(
                f"{what}: {cause}{more}. The {undone} update(s) that had succeeded were undone; "
                f"the switches are as before and the registry is unchanged",
                batch.switch,
                [(str(u), e) for u, e in rejected],
            )


def _undo(written: list[tuple[SwitchBatch, list[Update]]], what: str, cause: str) -> int:
    """Write the inverses of ``written`` (last switch first, last update first); return how many."""
    failures: list[str] = []
    count = 0
    for batch, updates in reversed(written):
        inverses = [u.inverse() for u in reversed(updates)]
        if not inverses:
            continue
        count += len(inverses)
        logger.warning("%s: undoing %d update(s) on switch %s", what, len(inverses), batch.switch)
        try:
            errors = batch.connection.write([batch.codec.to_update(u) for u in inverses])
        except SwitchRpcError as exc:
            failures.append(f"switch {batch.switch}: {exc}")
            continue
        failures += [f"switch {batch.switch}: {u}: {e}" for u, e in zip(inverses, errors, strict=True) if e]
    if failures:
        raise RollbackFailedError(
            f"{what}: {cause}; undoing the change failed too, so the switches differ from the registry "
            f"until `checkmate-ctl reconcile` runs: " + "; ".join(failures)
        )
    return count


def batches_for(
    changes: Mapping[str, Sequence[Update]],
    connections: Mapping[str, SwitchConnection],
    codecs: Mapping[str, EntityCodec],
) -> list[SwitchBatch]:
    return [
        SwitchBatch(switch, connections[switch], codecs[switch], changes[switch])
        for switch in sorted(changes)
        if changes[switch]
    ]
