"""A userspace NFS client: checkpoints written to an NFS export without a kernel NFS client.

``make bench --storage remote`` has the peers write their checkpoints where clusters write
them: to remote storage shared by the nodes. Its emulated cluster's storage host serves NFS
(nfs-ganesha, :mod:`experiments.bench.storage_host`). The machines this project runs on have
no NFS client filesystem in their kernel (``/proc/filesystems`` lists no ``nfs`` and no module
can be loaded), so nothing can *mount* the export; and no Python NFS client in the package
registries does the job (the ones listed there are protocol experiments, mocks or other
services' SDKs). This module is written here for that reason: a thin :mod:`ctypes` binding of
`libnfs <https://github.com/sahlberg/libnfs>`_ 4.0 (Debian's ``libnfs13``, installed by
``make setup``), the userspace NFS client library behind ``nfs-cp``, with

* :class:`NFSClient`: one connection (one libnfs context, mounted at an export), the file
  operations a checkpointer needs (open, stat, mkdir, rename, unlink, list), every call under
  one lock (a libnfs context is not thread-safe) and bounded by the client's timeout;
* :class:`NFSFile`: a binary file on the export (``torch.save(state, f)`` and ``torch.load(f)``
  take it as they take a local file; :meth:`NFSClient.open` buffers it as :func:`open` does);
  **a written file is durable when closed** (COMMIT before CLOSE), :meth:`NFSFile.fsync`
  makes it durable earlier; :func:`write_atomically` writes all or nothing (temporary file,
  COMMIT, RENAME);
* :class:`checkmate.nfs_fsspec.NFSFileSystem`: the ``nfs://`` protocol for :mod:`fsspec`, so
  that ``torch.distributed.checkpoint``'s ``FsspecWriter``/``FsspecReader`` use the export.

The protocol is **NFSv3** over TCP to fixed ports (``NFS_PORT``, ``MOUNT_PORT``: no portmapper
lookup): libnfs 4.0's own header marks its NFSv4 "not yet functional", and its NFSv4 WRITE of
more than 2 KiB fails to encode. One WRITE (READ) per call of at most the server's size: libnfs
4.0 splits larger ones itself but then loses the server's error.

URLs are ``nfs://SERVER/EXPORT/PATH``: the first path component names the export (the
server's ``/EXPORT``), the rest a path inside it. Every failure raises :class:`NFSError` (an
:class:`OSError` with the errno, the operation, the path and libnfs's message): an unreachable
server, a full export (``ENOSPC``), a server that does not answer within the timeout
(``ETIMEDOUT``; libnfs's own "Command was cancelled", errno 4, is reported as that timeout when
the call ran that long, else as a lost connection, ``ECONNABORTED``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import errno
import io
import logging
import os
import re
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LIBRARY_NAMES = ("libnfs.so.13", "libnfs.so.14", "libnfs.so")
"""Sonames tried in order (Debian's libnfs13 is libnfs 4.0 and 5.0's binary interface)."""
DEFAULT_TIMEOUT_S = 60.0
"""A call the server has not answered in this long fails with ETIMEDOUT."""
NFS_PORT = 2049
MOUNT_PORT = 20048
"""The server's MOUNT port: fixed, as the storage host's nfs-ganesha is configured, so no portmapper."""
SCHEME = "nfs://"
WRITE_CHUNK = 8 << 20
"""Bytes handed to libnfs per write call (it splits them into the server's WRITE size and pipelines)."""


_GARBLED = re.compile(r'failed with "([\x01-\x7f])"$')
_SERVER = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?")
"""A host name or dotted IPv4 address: what :class:`NFSURL` accepts as SERVER."""


class NFSError(OSError):
    """An NFS operation failed; ``errno`` is set, the message names the operation, path and cause."""


class NFSUnavailable(NFSError):
    """libnfs is not installed (``make setup`` installs Debian's libnfs13)."""


@dataclass(frozen=True)
class NFSURL:
    """``nfs://SERVER/EXPORT/PATH`` split: the server, the export (``/EXPORT``), the path in it."""

    server: str
    export: str
    path: str

    @classmethod
    def parse(cls, url: str) -> NFSURL:
        if not url.startswith(SCHEME):
            raise ValueError(f"not an NFS URL (nfs://SERVER/EXPORT/PATH): {url!r}")
        server, _, rest = url[len(SCHEME) :].partition("/")
        export, _, path = rest.partition("/")
        if not server or not export:
            raise ValueError(f"an NFS URL names a server and an export (nfs://SERVER/EXPORT/PATH): {url!r}")
        if not _SERVER.fullmatch(server):
            raise ValueError(
                f"an NFS URL's SERVER is a host name or an IPv4 address ({server!r} is not; the ports are "
                f"fixed: NFS {NFS_PORT}, MOUNT {MOUNT_PORT}): {url!r}"
            )
        if "\x00" in rest:
            raise ValueError(f"an NFS URL's path holds no NUL byte: {url!r}")
        return cls(server, "/" + export, "/" + path.strip("/"))

    def __str__(self) -> str:
        return f"{SCHEME}{self.server}{self.export}{self.path if self.path != '/' else ''}"


def location_argument(text: str) -> Path | str:
    """An ``argparse`` type for a directory that may be remote: a local ``Path``, or an NFS URL kept as text.

    ``nfs:...`` must parse as ``nfs://SERVER/EXPORT/PATH`` (else a usage error naming the rule);
    a ``Path`` would fold the URL's ``//``, so a URL stays text.
    """
    if text.startswith("nfs:"):
        try:
            return str(NFSURL.parse(text))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return Path(text)


class _Stat64(ctypes.Structure):
    """libnfs's ``struct nfs_stat_64`` (every field a uint64)."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "dev", "ino", "mode", "nlink", "uid", "gid", "rdev", "size", "blksize", "blocks",
            "atime", "mtime", "ctime", "atime_nsec", "mtime_nsec", "ctime_nsec", "used",
        )
    ]  # fmt: skip


class _DirEnt(ctypes.Structure):
    """The leading fields of libnfs's ``struct nfsdirent`` (the rest is never read)."""


_DirEnt._fields_ = [("next", ctypes.POINTER(_DirEnt)), ("name", ctypes.c_char_p)]

_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def load_library() -> ctypes.CDLL:
    """libnfs with the prototypes this module calls; NFSUnavailable when it is not installed."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        found = ctypes.util.find_library("nfs")
        errors = []
        for name in (*LIBRARY_NAMES, *([found] if found else [])):
            try:
                lib = ctypes.CDLL(name, use_errno=True)
                break
            except OSError as exc:
                errors.append(str(exc))
        else:
            raise NFSUnavailable(
                errno.ENOENT, "libnfs is not installed (make setup installs libnfs13): " + "; ".join(errors)
            )
        vp, cp, u64, i32 = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint64, ctypes.c_int
        pp = ctypes.POINTER(ctypes.c_void_p)
        prototypes: dict[str, tuple[Any, list[Any]]] = {
            "nfs_init_context": (vp, []),
            "nfs_destroy_context": (None, [vp]),
            "nfs_get_error": (cp, [vp]),
            "nfs_set_timeout": (None, [vp, i32]),
            "nfs_parse_url_dir": (vp, [vp, cp]),
            "nfs_destroy_url": (None, [vp]),
            "nfs_mount": (i32, [vp, cp, cp]),
            "nfs_umount": (i32, [vp]),
            "nfs_open": (i32, [vp, cp, i32, pp]),
            "nfs_open2": (i32, [vp, cp, i32, i32, pp]),
            "nfs_close": (i32, [vp, vp]),
            "nfs_pwrite": (i32, [vp, vp, u64, u64, vp]),
            "nfs_pread": (i32, [vp, vp, u64, u64, vp]),
            "nfs_fsync": (i32, [vp, vp]),
            "nfs_ftruncate": (i32, [vp, vp, u64]),
            "nfs_stat64": (i32, [vp, cp, ctypes.POINTER(_Stat64)]),
            "nfs_mkdir": (i32, [vp, cp]),
            "nfs_mkdir2": (i32, [vp, cp, i32]),
            "nfs_rmdir": (i32, [vp, cp]),
            "nfs_unlink": (i32, [vp, cp]),
            "nfs_rename": (i32, [vp, cp, cp]),
            "nfs_opendir": (i32, [vp, cp, pp]),
            "nfs_readdir": (ctypes.POINTER(_DirEnt), [vp, vp]),
            "nfs_closedir": (None, [vp, vp]),
            "nfs_get_writemax": (u64, [vp]),
            "nfs_get_readmax": (u64, [vp]),
        }
        for name, (restype, argtypes) in prototypes.items():
            function = getattr(lib, name)
            function.restype, function.argtypes = restype, argtypes
        _lib = lib
        return lib


def available() -> str | None:
    """None when libnfs can be loaded, else why not."""
    try:
        load_library()
    except NFSUnavailable as exc:
        return str(exc)
    return None


class NFSClient:
    """One connection to ``server``'s ``export`` (NFSv3); use as a context manager or :meth:`close`.

    Connecting fails with NFSError within ``timeout`` when the server does not answer.
    """

    def __init__(
        self,
        server: str,
        export: str,
        timeout: float = DEFAULT_TIMEOUT_S,
        nfs_port: int = NFS_PORT,
        mount_port: int = MOUNT_PORT,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"an NFS client needs a positive timeout, not {timeout}")
        self.server, self.export, self.timeout = server, export, timeout
        self._lib = load_library()
        self._lock = threading.RLock()
        self._call_started = time.monotonic()
        self._ctx: int | None = self._lib.nfs_init_context()
        if not self._ctx:
            raise NFSError(errno.ENOMEM, "nfs_init_context failed")
        self._lib.nfs_set_timeout(self._ctx, int(timeout * 1000))
        # NFSv3 to fixed ports (no portmapper); libnfs sets them from URL arguments only
        options = f"nfs://{server}{export}?version=3&nfsport={nfs_port}&mountport={mount_port}"
        url = self._lib.nfs_parse_url_dir(self._ctx, options.encode())
        if not url:
            message = self._lib.nfs_get_error(self._ctx)
            self.close()
            raise NFSError(errno.EINVAL, f"libnfs refuses {options}: {message.decode() if message else '?'}")
        self._lib.nfs_destroy_url(url)
        try:
            self._call_started = time.monotonic()
            self._check(self._lib.nfs_mount(self._ctx, server.encode(), export.encode()), "mount", "")
        except NFSError:
            self.close()
            raise
        # one WRITE (READ) per call, at most the server's size: libnfs 4.0 splits a larger one itself but
        # then reports the server's error as EFAULT with a garbled message (a full export would not say so)
        self.write_max = min(int(self._lib.nfs_get_writemax(self._ctx)) or 1 << 20, WRITE_CHUNK)
        self.read_max = min(int(self._lib.nfs_get_readmax(self._ctx)) or 1 << 20, WRITE_CHUNK)
        logger.debug("mounted %s:%s (NFSv3, server WRITE size %d)", server, export, self.write_max)

    @classmethod
    def from_url(cls, url: str, timeout: float = DEFAULT_TIMEOUT_S) -> tuple[NFSClient, str]:
        """A client for ``url``'s server and export, and the path inside the export."""
        parsed = NFSURL.parse(url)
        return cls(parsed.server, parsed.export, timeout), parsed.path

    def __enter__(self) -> NFSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self.calling():
            if self._ctx:
                self._lib.nfs_destroy_context(self._ctx)
            self._ctx = None

    @property
    def context(self) -> int:
        if not self._ctx:
            raise NFSError(errno.EBADF, f"the NFS client of {self.server}:{self.export} is closed")
        return self._ctx

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        """Hold the client's lock for one libnfs call, noting when it began (see :meth:`_check`)."""
        with self._lock:
            self._call_started = time.monotonic()
            yield

    def _check(self, result: int, operation: str, path: str) -> int:
        """``result`` when >= 0; else NFSError with libnfs's errno (a negative result) and message."""
        if result >= 0:
            return result
        message = self._lib.nfs_get_error(self._ctx) if self._ctx else None
        detail = message.decode(errors="replace") if message else os.strerror(-result)
        code = -result
        garbled = _GARBLED.search(detail)
        if garbled and ord(garbled.group(1)) in errno.errorcode:
            # libnfs 4.0's pwrite hands its sync wrapper the server's errno where its message belongs
            # (a full export reads 'pwrite call failed with "\x1c"' and EFAULT): the errno it meant
            code = ord(garbled.group(1))
            detail = f"{detail[: garbled.start()]}failed: {os.strerror(code)}"
        if "timed out" in detail:  # libnfs reports its own timeout as EINTR
            code = errno.ETIMEDOUT
            detail = f"{detail} (no answer within {self.timeout:g} s)"
        elif "cancelled" in detail:
            # libnfs 4.0 fails every call in flight with EINTR "Command was cancelled" when it gives the
            # connection up: after the timeout (a server too slow or silent) or when the connection drops
            took = time.monotonic() - self._call_started
            if took >= 0.9 * self.timeout:
                code = errno.ETIMEDOUT
                detail = (
                    f"the server did not complete the call within the client's {self.timeout:g} s timeout "
                    f"(libnfs: {detail})"
                )
            else:
                code = errno.ECONNABORTED
                detail = f"the connection to the server was lost after {took:.1f} s (libnfs: {detail})"
        raise NFSError(code, f"NFS {operation} {self.server}:{self.export}{path}: {detail}")

    # ---- paths ----------------------------------------------------------------------------------
    def stat(self, path: str) -> os.stat_result:
        found = _Stat64()
        with self.calling():
            self._check(self._lib.nfs_stat64(self.context, path.encode(), ctypes.byref(found)), "stat", path)
        return os.stat_result(
            (found.mode, found.ino, found.dev, found.nlink, found.uid, found.gid, found.size,
             found.atime, found.mtime, found.ctime)
        )  # fmt: skip

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except NFSError as exc:
            if exc.errno == errno.ENOENT:
                return False
            raise
        return True

    def isdir(self, path: str) -> bool:
        try:
            return stat.S_ISDIR(self.stat(path).st_mode)
        except NFSError as exc:
            if exc.errno == errno.ENOENT:
                return False
            raise

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        with self.calling():
            self._check(self._lib.nfs_mkdir2(self.context, path.encode(), mode), "mkdir", path)

    def makedirs(self, path: str, exist_ok: bool = True, mode: int = 0o755) -> None:
        """``path`` and every missing parent; FileExistsError-like NFSError unless ``exist_ok``."""
        parts = [p for p in path.split("/") if p]
        for depth in range(1, len(parts) + 1):
            partial = "/" + "/".join(parts[:depth])
            try:
                self.mkdir(partial, mode)
            except NFSError as exc:
                if exc.errno != errno.EEXIST or (depth == len(parts) and not exist_ok):
                    raise

    def listdir(self, path: str) -> list[str]:
        handle = ctypes.c_void_p()
        names: list[str] = []
        with self.calling():
            self._check(
                self._lib.nfs_opendir(self.context, path.encode(), ctypes.byref(handle)), "opendir", path
            )
            try:
                while True:
                    entry = self._lib.nfs_readdir(self.context, handle)
                    if not entry:
                        break
                    name = (entry.contents.name or b"").decode(errors="surrogateescape")
                    if name not in (".", ".."):
                        names.append(name)
            finally:
                self._lib.nfs_closedir(self.context, handle)
        return sorted(names)

    def unlink(self, path: str) -> None:
        with self.calling():
            self._check(self._lib.nfs_unlink(self.context, path.encode()), "unlink", path)

    def rmdir(self, path: str) -> None:
        with self.calling():
            self._check(self._lib.nfs_rmdir(self.context, path.encode()), "rmdir", path)

    def rmtree(self, path: str) -> None:
        """``path`` and everything under it (nothing when it does not exist)."""
        if not self.exists(path):
            return
        if not self.isdir(path):
            self.unlink(path)
            return
        for name in self.listdir(path):
            self.rmtree(f"{path.rstrip('/')}/{name}")
        self.rmdir(path)

    def rename(self, source: str, target: str) -> None:
        """Atomic on the server, replacing ``target`` (NFS RENAME)."""
        with self.calling():
            self._check(
                self._lib.nfs_rename(self.context, source.encode(), target.encode()), "rename", source
            )

    def open(self, path: str, mode: str = "rb", buffering: int = WRITE_CHUNK, file_mode: int = 0o644) -> Any:
        """A binary file, as :func:`open` gives: buffered (``io.BufferedReader``/``BufferedWriter`` over an
        :class:`NFSFile`, whole reads and large writes), or the :class:`NFSFile` itself with ``buffering=0``.

        ``mode``: ``rb``, ``wb`` (create or truncate), ``xb`` (create, not existing) or ``ab``;
        ``file_mode``: the permissions of a file it creates.
        """
        raw = NFSFile(self, path, mode, file_mode)
        if buffering <= 0:
            return raw
        return io.BufferedReader(raw, buffering) if raw.readable() else io.BufferedWriter(raw, buffering)

    def iter_files(self, path: str) -> Iterator[str]:
        """Every file path under ``path`` (depth first)."""
        for name in self.listdir(path):
            child = f"{path.rstrip('/')}/{name}"
            if self.isdir(child):
                yield from self.iter_files(child)
            else:
                yield child


_OPEN_FLAGS = {
    "rb": os.O_RDONLY,
    "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "xb": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "ab": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
}


class NFSFile(io.RawIOBase):
    """One open file on an export; written files are committed (COMMIT) before they are closed."""

    def __init__(self, client: NFSClient, path: str, mode: str = "rb", file_mode: int = 0o644) -> None:
        super().__init__()
        normal = mode.replace("t", "").replace("+", "")
        if normal not in _OPEN_FLAGS or "t" in mode or "+" in mode:
            raise ValueError(f"NFSFile opens binary files one way: rb, wb, xb or ab, not {mode!r}")
        self.client, self.path, self.mode = client, path, normal
        self._position = 0
        self._dirty = False
        handle = ctypes.c_void_p()
        flags = _OPEN_FLAGS[normal]
        lib = client._lib
        with client.calling():
            # libnfs may make O_CREAT a guarded create (EEXIST on an existing file), whatever O_EXCL
            # says: open what exists (truncating for wb), create only what does not
            result = -errno.ENOENT
            if not flags & os.O_EXCL:
                result = lib.nfs_open(
                    client.context, path.encode(), flags & ~os.O_CREAT, ctypes.byref(handle)
                )
            if result == -errno.ENOENT and flags & os.O_CREAT:
                result = lib.nfs_open2(client.context, path.encode(), flags, file_mode, ctypes.byref(handle))
            client._check(result, "open", path)
        self._handle: int | None = handle.value
        if normal == "ab":
            self._position = client.stat(path).st_size

    # ---- io.RawIOBase ---------------------------------------------------------------------------
    def readable(self) -> bool:
        return self.mode == "rb"

    def writable(self) -> bool:
        return self.mode != "rb"

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        raise io.UnsupportedOperation("an NFS file has no descriptor: it is durable when closed (or fsync())")

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            position = offset
        elif whence == io.SEEK_CUR:
            position = self._position + offset
        elif whence == io.SEEK_END:
            position = self.client.stat(self.path).st_size + offset
        else:
            raise ValueError(f"whence {whence} is not SEEK_SET, SEEK_CUR or SEEK_END")
        if position < 0:
            raise ValueError(f"negative seek position {position}")
        self._position = position
        return position

    def readinto(self, buffer: Any) -> int:
        if not self.readable():
            raise io.UnsupportedOperation(f"{self.path} is open for writing")
        view = memoryview(buffer).cast("B")[: self.client.read_max]
        if not len(view):
            return 0
        target = (ctypes.c_char * len(view)).from_buffer(view)
        with self.client.calling():
            got = self.client._check(
                self.client._lib.nfs_pread(
                    self.client.context, self._open_handle(), self._position, len(view), target
                ),
                "read",
                self.path,
            )
        self._position += got
        return got

    def write(self, data: Any) -> int:
        if not self.writable():
            raise io.UnsupportedOperation(f"{self.path} is open for reading")
        view = memoryview(data).cast("B")
        total = len(view)
        done = 0
        while done < total:
            part = view[done : done + self.client.write_max]
            if part.readonly:  # ctypes passes a bytes object's own buffer: one copy of a read-only view
                part_buffer: Any = part.tobytes()
            else:
                part_buffer = (ctypes.c_char * len(part)).from_buffer(part)
            with self.client.calling():
                wrote = self.client._check(
                    self.client._lib.nfs_pwrite(
                        self.client.context, self._open_handle(), self._position, len(part), part_buffer
                    ),
                    "write",
                    self.path,
                )
            if wrote == 0:
                raise NFSError(
                    errno.EIO, f"NFS write {self.client.server}:{self.path}: the server took 0 bytes"
                )
            self._position += wrote
            done += wrote
            self._dirty = True
        return total

    def truncate(self, size: int | None = None) -> int:
        size = self._position if size is None else size
        with self.client.calling():
            self.client._check(
                self.client._lib.nfs_ftruncate(self.client.context, self._open_handle(), size),
                "truncate",
                self.path,
            )
        return size

    def fsync(self) -> None:
        """Make what was written durable on the server (NFS COMMIT)."""
        with self.client.calling():
            self.client._check(
                self.client._lib.nfs_fsync(self.client.context, self._open_handle()), "fsync", self.path
            )
        self._dirty = False

    def _open_handle(self) -> int:
        if self._handle is None:
            raise ValueError(f"I/O on a closed NFS file {self.path}")
        return self._handle

    def close(self) -> None:
        """COMMIT what was written, then CLOSE; an error in either raises (the file is closed regardless)."""
        if self._handle is None:
            super().close()
            return
        handle = self._handle
        try:
            if self._dirty:
                self.fsync()
        finally:
            self._handle = None
            with self.client.calling():
                if self.client._ctx:
                    result = self.client._lib.nfs_close(self.client._ctx, handle)
                else:
                    result = 0
            super().close()
        self.client._check(result, "close", self.path)


def temporary_name(path: str) -> str:
    """A temporary name beside ``path``, unique to this writer: ``DIR/.NAME.tmp-PID-RANDOM``."""
    directory, _, name = path.rpartition("/")
    return f"{directory}/.{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def write_atomically(
    client: NFSClient, path: str, write: Callable[[io.BufferedWriter], object], file_mode: int = 0o644
) -> None:
    """Write ``path`` all or nothing: ``write`` fills a temporary file, committed, then renamed over it.

    When ``write`` or the server fails, the error propagates and ``path`` is as it was (the
    temporary file is removed when the server still answers, else left beside it as
    ``.NAME.tmp-PID-RANDOM``, never under the final name). Each call writes its own temporary
    file, so writers of the same path (shadows writing one step's ``global.json``) never write
    into each other's; the last rename wins whole.
    """
    temporary = temporary_name(path)
    try:
        with client.open(temporary, "wb", file_mode=file_mode) as stream:
            write(stream)
    except BaseException:
        try:
            client.unlink(temporary)
        except NFSError as exc:
            logger.warning("could not remove the partial %s: %s", temporary, exc)
        raise
    client.rename(temporary, path)
