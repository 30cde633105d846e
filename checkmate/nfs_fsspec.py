"""The ``nfs://`` protocol for :mod:`fsspec`, over :mod:`checkmate.nfs`'s userspace NFS client.

``torch.distributed.checkpoint`` writes and reads through fsspec
(``FsspecWriter(url)``/``FsspecReader(url)``); importing this module (:func:`register`) makes
fsspec resolve ``nfs://SERVER/EXPORT/PATH`` to :class:`NFSFileSystem`, one connection per (server, export)
and process (fsspec caches the instance; a pickled instance connects again where it is
unpickled, as DCP's process-based async save does). Files opened for writing are durable
when closed (:class:`checkmate.nfs.NFSFile`): give DCP ``FsspecWriter(url, sync_files=False)``,
as its fsync path would otherwise fall back to ``os.sync()`` of this machine (an NFS file has no
descriptor). :meth:`NFSFileSystem.mv` is the server's atomic RENAME, not fsspec's
copy-and-delete.
"""

from __future__ import annotations

import errno
import io
import stat
from typing import Any

from fsspec import AbstractFileSystem, register_implementation

from checkmate.nfs import DEFAULT_TIMEOUT_S, NFSURL, SCHEME, NFSClient, NFSError


class NFSFileSystem(AbstractFileSystem):
    """One NFS export as an fsspec filesystem; paths are inside the export (``/a/b``)."""

    protocol = "nfs"
    root_marker = "/"

    def __init__(self, host: str, export: str, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> None:
        super().__init__(host=host, export=export, timeout=timeout, **kwargs)
        self.host, self.export = host, export
        self.client = NFSClient(host, export, timeout)

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        text = str(path[0] if isinstance(path, list) and path else path)
        if text.startswith(SCHEME):
            return NFSURL.parse(text).path
        return "/" + text.strip("/")

    @staticmethod
    def _get_kwargs_from_urls(path: str) -> dict[str, Any]:
        if not str(path).startswith(SCHEME):
            return {}
        parsed = NFSURL.parse(str(path))
        return {"host": parsed.server, "export": parsed.export}

    def unstrip_protocol(self, name: str) -> str:
        return f"{SCHEME}{self.host}{self.export}/{name.lstrip('/')}"

    # ---- what fsspec needs -----------------------------------------------------------------------
    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        try:
            found = self.client.stat(path)
        except NFSError as exc:
            if exc.errno == errno.ENOENT:
                raise FileNotFoundError(errno.ENOENT, f"no such file on the export: {path}") from exc
            raise
        kind = "directory" if stat.S_ISDIR(found.st_mode) else "file"
        return {"name": path, "size": found.st_size, "type": kind, "mtime": found.st_mtime}

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._strip_protocol(path)
        names = [f"{path.rstrip('/')}/{name}" for name in self.client.listdir(path)]
        return [self.info(name) for name in names] if detail else names

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> io.BufferedIOBase:
        """A buffered file (every unbuffered write would be a round trip to the server)."""
        return self.client.open(self._strip_protocol(path), mode)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        if create_parents:
            self.client.makedirs(path, exist_ok=True)
        else:
            self.client.mkdir(path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.client.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def rmdir(self, path: str) -> None:
        self.client.rmdir(self._strip_protocol(path))

    def rm_file(self, path: str) -> None:
        self.client.unlink(self._strip_protocol(path))

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        for one in path if isinstance(path, list) else [path]:
            stripped = self._strip_protocol(one)
            if recursive:
                self.client.rmtree(stripped)
            else:
                self.client.unlink(stripped)

    def mv(
        self, path1: str, path2: str, recursive: bool = False, maxdepth: int | None = None, **kwargs: Any
    ) -> None:
        """The server's atomic RENAME (replacing ``path2``)."""
        self.client.rename(self._strip_protocol(path1), self._strip_protocol(path2))

    rename = mv


def register() -> None:
    """Make fsspec (and so DCP's FsspecWriter/FsspecReader) resolve ``nfs://`` URLs here."""
    register_implementation("nfs", NFSFileSystem, clobber=True)


# Importing this module registers the protocol: a process that only unpickles an FsspecWriter holding
# an NFSFileSystem (DCP's process-based async save) imports it, and then resolves nfs:// URLs too.
register()
