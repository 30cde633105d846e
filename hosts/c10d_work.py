"""The ``checkmate`` backend's Work objects and small helpers (hosts/c10d_backend.py uses them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "BACKEND_NAME",
    "CheckmateBackendError",
    "FutureWork",
    "all_of",
    "as_bytes",
    "done_work",
    "from_bytes",
    "unsupported",
]

BACKEND_NAME = "checkmate"
"""What ``init_process_group(backend=...)`` names (also ``"cpu:checkmate"``)."""


class CheckmateBackendError(RuntimeError):
    """The backend could not start (rendezvous, transport) or a collective failed."""


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A private contiguous uint8 copy of ``tensor``'s memory (safe to resend after the caller moves on)."""
    flat = tensor.detach().to("cpu").reshape(-1).contiguous().clone()
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def from_bytes(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``raw`` (uint8) reinterpreted as ``like``'s dtype and shape."""
    if like.numel() == 0:
        return torch.empty_like(like, device="cpu")
    return raw.view(like.dtype).view(like.shape)


class FutureWork(dist._Work):
    """A collective's Work over its future: ``wait`` raises the collective's error.

    (torch's ``_create_work_from_future`` wraps a future whose error its ``wait`` does not raise, so
    a failed collective would pass silently.) ``wait``'s timeout is the group's: every pending
    collective fails at its deadline.
    """

    def __init__(self, future: torch.futures.Future[Any]) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: Any = None) -> bool:
        self._future.wait()  # raises what the collective failed with
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return bool(self._future.done())

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:  # noqa: BLE001 - any stored error means the collective failed
            return False
        return True

    def result(self) -> Any:
        return self._future.wait()


def done_work(value: Any) -> dist.Work:
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(value)
    return FutureWork(future)


def all_of(works: list[dist.Work], value: Any) -> dist.Work:
    """One Work completing with ``value`` once all ``works`` have (failing with the first error)."""
    futures = [work.get_future() for work in works]

    def check(done: torch.futures.Future[Any]) -> Any:
        for future in done.value():
            future.value()  # raises the collective's error
        return value

    return FutureWork(torch.futures.collect_all(futures).then(check))


def unsupported(collective: str, instead: str) -> dist.Work:
    raise NotImplementedError(
        f'{collective} is not supported by the torch.distributed backend "{BACKEND_NAME}"; use {instead}'
    )
