"""A stand-in shadow for control-channel tests: accepts rank 0, records messages, certifies commits."""

from __future__ import annotations

import socket
import threading

from checkmate.control import (
    Certified,
    Commit,
    ControlProtocolError,
    Goodbye,
    Message,
    recv_message,
    send_message,
)
from checkmate.control_frame import bind


class FakeShadow:
    def __init__(self, address: tuple[str, int], name: str = "shadow0") -> None:
        self.name = name
        self.messages: list[Message] = []
        self.connections = 0
        self._server = socket.create_server(address, reuse_port=False)
        self._server.settimeout(0.2)
        self.address = self._server.getsockname()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            bind(conn, server=True, name=self.name)
            self.connections += 1
            with conn:
                while not self._stop.is_set():
                    try:
                        message = recv_message(conn, timeout=30.0)
                    except (OSError, ControlProtocolError):
                        break
                    self.messages.append(message)
                    if isinstance(message, Commit):
                        try:
                            send_message(
                                conn, Certified(message.job_id, self.name, message.iteration), timeout=5.0
                            )
                        except OSError:  # rank 0 closed first
                            break
                    if isinstance(message, Goodbye):
                        break

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._server.close()
