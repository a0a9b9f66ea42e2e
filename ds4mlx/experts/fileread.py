"""Bounds-checked reads of streamed experts from the model file.

The loader hands routed-expert banks out as views of the file's mapping (GGUF).  Reading a
mapped page past the end of a file that was truncated under the server kills the process
(SIGBUS), so the streamed reads never touch the mapping: each read batch opens the file,
checks its identity (device, inode, size, mtime) against the one loaded, and copies the
rows with `os.preadv` into their destination arrays; a short read is an error, never a
signal.  A file whose identity changed is that batch's `FileChanged`; the store decides
what follows (docs/http-api.md §6: the request fails, the server lives).
"""

from __future__ import annotations

import hashlib
import os
import threading
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np

from ..io.mapped import memmap_of

HEAD_BYTES = 32 << 20  # the header region compared when a changed file is checked again


class Identity(NamedTuple):
    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Identity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def differs(self, other: Identity) -> str:
        """What changed, in words ('' when nothing did)."""
        what = []
        if (self.dev, self.ino) != (other.dev, other.ino):
            what.append("replaced (another inode)")
        if self.size != other.size:
            what.append(f"size {self.size} -> {other.size} bytes")
        if self.mtime_ns != other.mtime_ns:
            what.append("modified")
        return ", ".join(what)


class FileChanged(OSError):
    """The model file is not the one the experts were loaded from."""


def head_digest(fd: int, size: int) -> bytes:
    """sha256 of the file's first HEAD_BYTES (its header and tensor table)."""
    h = hashlib.sha256()
    off, end = 0, min(size, HEAD_BYTES)
    while off < end:
        chunk = os.pread(fd, min(1 << 20, end - off), off)
        if not chunk:
            break
        h.update(chunk)
        off += len(chunk)
    return h.digest()


class OpenFiles:
    """The model files of one read batch: opened once each, identity checked by `check`."""

    def __init__(self, check):
        self._check = check  # (filename, fd, Identity) -> None or raise FileChanged
        self._fds: dict[str, int] = {}

    def fd(self, filename: str) -> int:
        fd = self._fds.get(filename)
        if fd is None:
            fd = os.open(filename, os.O_RDONLY)
            try:
                self._check(filename, fd, Identity.of(os.fstat(fd)))
            except BaseException:
                os.close(fd)
                raise
            self._fds[filename] = fd
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


_local = threading.local()


@contextmanager
def reading(files: OpenFiles):
    """Within: `read_rows` copies mapped views' rows through `files` (this thread only)."""
    before = getattr(_local, "files", None)
    _local.files = files
    try:
        yield files
    finally:
        _local.files = before
        files.close()


def read_rows(arr: np.ndarray, ids: list[int]) -> np.ndarray | None:
    """Rows `ids` (axis 0) of a view of a file mapping, read with os.preadv inside a
    `reading` block; None outside one or for an array that is not such a view."""
    files = getattr(_local, "files", None)
    mm = memmap_of(arr) if files is not None else None
    if mm is None or not arr.flags.c_contiguous or arr.ndim == 0 or getattr(mm, "filename", None) is None:
        return None
    fd = files.fd(mm.filename)
    base = arr.ctypes.data - mm.ctypes.data + mm.offset  # file offset of row 0
    row = arr.strides[0]
    out = np.empty((len(ids), *arr.shape[1:]), arr.dtype)
    for j, i in enumerate(ids):
        if not 0 <= i < arr.shape[0]:
            raise IndexError(f"expert {i} of {arr.shape[0]}")
        dest = memoryview(out[j : j + 1]).cast("B")
        got = os.preadv(fd, [dest], base + i * row)
        if got != row:
            raise FileChanged(f"short read of {mm.filename} at byte {base + i * row}: {got} of {row} bytes")
    return out


__all__ = ["Identity", "FileChanged", "OpenFiles", "reading", "read_rows", "head_digest"]
