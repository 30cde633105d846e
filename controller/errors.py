"""The controller's errors. Every one carries a message that names the cause.

The CLI prints ``str(error)`` and exits 1 for any :class:`ControllerError`;
library users catch the subclass they can act on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class ControllerError(Exception):
    """Base of every error the controller raises on purpose."""


class SwitchUnreachableError(ControllerError):
    """No P4Runtime server answered at a switch's address within the timeout."""


class NotPrimaryError(ControllerError):
    """Another client with a higher election id is the switch's primary controller."""


class NoPipelineError(ControllerError):
    """The switch has no forwarding pipeline yet (``checkmate-ctl pipeline push`` first)."""


class SwitchRpcError(ControllerError):
    """A P4Runtime RPC failed as a whole (not per update): unavailable, timed out, refused."""

    def __init__(self, message: str, code_name: str = "UNKNOWN") -> None:
        super().__init__(message)
        self.code_name = code_name


@dataclass(frozen=True)
class UpdateError:
    """The ``p4.v1.Error`` a switch returned for one update of a batch."""

    index: int
    code_name: str
    """Canonical gRPC code, e.g. ``ALREADY_EXISTS``."""
    message: str

    def __str__(self) -> str:
        return f"{self.code_name}: {self.message}" if self.message else self.code_name


class WriteRejectedError(ControllerError):
    """A switch rejected an update of a batch; everything written for the change was undone."""

    def __init__(self, message: str, switch: str, errors: list[tuple[str, UpdateError]]) -> None:
        super().__init__(message)
        self.switch = switch
        self.errors = errors
        """(update description, error) for every rejected update."""


class RollbackFailedError(ControllerError):
    """Undoing a failed change failed too: the switch differs from the registry until reconciled."""


class JobError(ControllerError):
    """A job request that cannot be carried out (unknown hosts, duplicate id, ...)."""


class CapacityError(JobError):
    """The target cannot hold what a job needs (multicast groups, rids, job slots)."""
