"""Atomic file replacement: a reader sees the old file or the new one, never half.

The new content goes to a temporary file in the destination's own folder (so the
rename stays on one file system), which then replaces the destination with
`os.replace`.  On any exception before the rename the temporary is removed and
the old file is left as it was.  Folder fsync (for durability of the rename
itself) stays with the callers that need it."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import IO, Any


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike,
    mode: str = "wb",
    *,
    temp_prefix: str = ".tmp-",
    temp_path: str | os.PathLike | None = None,
    fsync: bool = False,
    permissions: int | None = None,
    encoding: str | None = None,
    newline: str | None = None,
    before_replace: Callable[[], None] | None = None,
) -> Iterator[IO[Any]]:
    """Yield an open temporary file; when the block ends cleanly, replace `path` with it.

    The temporary is a fresh `mkstemp` file named `temp_prefix`... next to `path`,
    or `temp_path` when a caller's cleanup looks for a fixed name (created like
    `open` does, or with `permissions` as its creation mode).  `fsync` makes the
    data durable before the rename; `permissions` is set exactly (mkstemp's 0600
    would surprise next to a user's files); `before_replace` runs after the file is
    closed, as the last step before the rename (a final check, or moving the old
    file aside)."""
    if temp_path is None:
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix, dir=os.path.dirname(os.path.abspath(path)))
    else:
        tmp = os.fspath(temp_path)
        create_mode = 0o666 if permissions is None else permissions
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, create_mode)
    try:
        with os.fdopen(fd, mode, encoding=encoding, newline=newline) as f:
            if permissions is not None:
                os.fchmod(f.fileno(), permissions)
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_bytes_atomic(path: str | os.PathLike, data: bytes, **options: Any) -> None:
    """Replace `path` with `data` atomically; `options` as for `atomic_write`."""
    with atomic_write(path, "wb", **options) as f:
        f.write(data)
