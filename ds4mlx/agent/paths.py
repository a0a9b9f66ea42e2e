"""Keep file tools inside the project directory, with no check-then-use race.

The project directory is opened once; every tool path is then walked one
component at a time from that descriptor (`openat` with `O_NOFOLLOW`), so the
kernel never follows a symbolic link on the agent's behalf.  A link met on the
way is read (`readlinkat`) and its target walked the same way: a target inside
the project is followed, one that leads out is an escape like `../x`.  A
second process swapping links while a tool runs can only make the walk fail;
it can never make it open a file outside the project, because what was checked
(a component in a directory held by descriptor) is what is opened.  The opened
file's own path is checked once more through its descriptor (`/proc/self/fd`
or `F_GETPATH`) in case a directory was renamed out from under the walk.

Writes go through a temporary file created by descriptor in the target's
directory and renamed there (`renameat`): a link swapped in at the last moment
is replaced, never written through.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
from dataclasses import dataclass

PATH_MAX = 4096  # bytes in a tool path (Linux PATH_MAX; macOS has 1024 but its components are checked too)
NAME_MAX = 255  # bytes in one component
MAX_LINKS = 40  # links followed in one walk (the kernel's MAXSYMLINKS)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # a FIFO never blocks
_F_GETPATH = 50  # macOS fcntl: the path of an open descriptor


class PathEscape(ValueError):
    """A tool path is refused: it resolves outside the project, or is malformed."""


@dataclass
class Resolved:
    """A tool path walked to its last component: `parent` (an open descriptor of
    the directory holding it; the caller closes it via `close()`), `name` (the
    last component; "." for the project root itself) and `rel` (its path from the
    project root, links resolved)."""

    parent: int
    name: str
    rel: str

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.parent)


def fd_path(fd: int) -> str | None:
    """The path the kernel has for an open descriptor, or None where it cannot say."""
    if sys.platform == "darwin":
        import fcntl

        try:
            raw = fcntl.fcntl(fd, _F_GETPATH, b"\0" * 1024)
        except OSError:
            return None
        return os.fsdecode(raw.split(b"\0", 1)[0])
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _is_link_error(e: OSError) -> bool:
    # O_NOFOLLOW on a link: ELOOP (Linux, macOS); EMLINK on FreeBSD; O_DIRECTORY|O_NOFOLLOW may say ENOTDIR
    return e.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR)


class ProjectRoot:
    def __init__(self, root: str):
        self.given = os.path.abspath(root)
        self.root = os.path.realpath(self.given)
        self.fd = os.open(self.root, _DIR_FLAGS)

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    # ------------------------------------------------------------------ checks
    def _escape(self, path: str, where: str) -> PathEscape:
        return PathEscape(f"path {path!r} resolves outside the project directory {self.root} ({where}): refused")

    def _inside(self, absolute: str) -> list[str] | None:
        """The components below the root of an absolute path, or None when it is not under it."""
        norm = os.path.normpath(absolute)
        for base in (self.root, self.given):
            if norm == base:
                return []
            if norm.startswith(base.rstrip(os.sep) + os.sep):
                return norm[len(base.rstrip(os.sep)) + 1 :].split(os.sep)
        return None

    @staticmethod
    def check_text(path) -> str:
        """A tool path's text is a non-empty string without NUL bytes, within the length limits."""
        if not isinstance(path, str) or not path:
            raise PathEscape("path is required")
        if "\0" in path:
            raise PathEscape("path contains a NUL byte: refused")
        raw = os.fsencode(path)
        if len(raw) >= PATH_MAX:
            raise PathEscape(f"path is {len(raw)} bytes, over the {PATH_MAX} byte limit: refused")
        for part in raw.split(b"/"):
            if len(part) > NAME_MAX:
                raise PathEscape(f"a path component is {len(part)} bytes, over the {NAME_MAX} byte limit: refused")
        return path

    # ------------------------------------------------------------------ the walk
    def walk(self, path: str, *, create_dirs: bool = False) -> Resolved:
        """Walk `path` (relative to the root, or absolute inside it) to its last
        component; links in it are resolved (the last one too).  `create_dirs`
        makes missing directories on the way (write).  Raises PathEscape, or
        OSError (a missing directory, a component that is not one)."""
        self.check_text(path)
        if os.path.isabs(path):
            parts = self._inside(path)
            if parts is None:
                raise self._escape(path, os.path.normpath(path))
        else:
            parts = path.split("/")
        todo = [p for p in parts if p not in ("", ".")]
        todo.reverse()  # a stack: the next component on top
        stack: list[tuple[str, int]] = []  # (name, descriptor) of each directory walked below the root
        links = 0

        def here() -> int:
            return stack[-1][1] if stack else self.fd

        def pop() -> None:
            os.close(stack.pop()[1])

        try:
            while todo:
                name = todo.pop()
                if name == "..":
                    if not stack:
                        raise self._escape(path, "above the root")
                    pop()
                    continue
                last = not todo
                try:
                    st = os.lstat(name, dir_fd=here())
                except FileNotFoundError:
                    if last:
                        break
                    if not create_dirs:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o777, dir_fd=here())
                    st = os.lstat(name, dir_fd=here())
                if stat.S_ISLNK(st.st_mode):
                    links += 1
                    if links > MAX_LINKS:
                        raise PathEscape(f"path {path!r}: too many levels of symbolic links")
                    target = os.readlink(name, dir_fd=here())
                    if os.path.isabs(target):
                        inside = self._inside(target)
                        if inside is None:
                            raise self._escape(path, f"{name} -> {target}")
                        while stack:
                            pop()
                        todo.extend(reversed([p for p in inside if p not in ("", ".")]))
                    else:
                        todo.extend(reversed([p for p in target.split("/") if p not in ("", ".")]))
                    continue
                if last:
                    break
                try:
                    fd = os.open(name, _DIR_FLAGS, dir_fd=here())
                except OSError as e:
                    if _is_link_error(e) and not stat.S_ISDIR(st.st_mode):
                        raise NotADirectoryError(errno.ENOTDIR, "not a directory", name) from None
                    if _is_link_error(e):  # swapped for a link since the lstat: walk again from here
                        todo.append(name)
                        links += 1
                        if links > MAX_LINKS:
                            raise PathEscape(f"path {path!r}: too many levels of symbolic links") from None
                        continue
                    raise
                stack.append((name, fd))
            else:
                name = "."
            parent = os.dup(here())
            rel = "/".join([n for n, _ in stack] + ([] if name == "." else [name])) or "."
        finally:
            while stack:
                pop()
        return Resolved(parent, name, rel)

    def verify(self, fd: int, path: str) -> None:
        """The opened descriptor's own path lies in the project (where the OS can say)."""
        real = fd_path(fd)
        if real is not None and self._inside(real) is None:
            raise self._escape(path, real)

    def open(self, path: str, *, directory: bool = False) -> tuple[int, str]:
        """-> (descriptor, rel) of an existing file (`directory`: a directory), opened
        without following a link; the caller closes the descriptor."""
        for _ in range(MAX_LINKS):
            r = self.walk(path)
            try:
                flags = _DIR_FLAGS if directory else _FILE_FLAGS
                try:
                    fd = os.open(r.name, flags, dir_fd=r.parent)
                except OSError as e:
                    if e.errno == errno.ENOENT:
                        raise FileNotFoundError(errno.ENOENT, "no such file", r.rel) from None
                    if directory and e.errno == errno.ENOTDIR:
                        st = os.lstat(r.name, dir_fd=r.parent)
                        if not stat.S_ISLNK(st.st_mode):
                            raise NotADirectoryError(errno.ENOTDIR, "not a directory", r.rel) from None
                        continue  # a link swapped in after the walk: walk again
                    if _is_link_error(e):
                        continue
                    raise
            finally:
                r.close()
            try:
                self.verify(fd, path)
            except BaseException:
                os.close(fd)
                raise
            return fd, r.rel
        raise PathEscape(f"path {path!r} keeps changing into a symbolic link: refused")

    def relative(self, rel: str) -> str:
        return rel or "."
