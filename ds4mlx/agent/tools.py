"""The agent's file tools and the tool table.

Names, parameters and defaults follow ds4-agent (antirez/ds4 ds4_agent.c, the
"Available Tool Schemas" of its tool prompt): read (bounded: 500 lines by
default, `continue_offset=N`), more, write, edit, search, list, and bash /
bash_status / bash_stop (bashjobs.py).  Results are plain text for the model;
a failing tool returns "Tool error: ..." instead of raising.

Concurrent modification: every read / write / edit remembers the file's
fingerprint (size, mtime_ns, SHA-1); write and edit refuse a file that changed
on disk since the agent last saw it, so an edit never silently overwrites
someone else's change.

Every path is walked from a descriptor of the project directory without letting
the kernel follow a link (paths.py), so a link swapped in while a tool runs
cannot lead it out; writes replace atomically through a temporary made by
descriptor in the target's directory and renamed there.  A malformed path (a NUL
byte, too long) is a tool error the model reads, like any other refusal.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import re
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .bashjobs import BashJobs
from .errors import ToolError
from .paths import ProjectRoot

READ_DEFAULT_LINES = 500  # ds4_agent.c AGENT_READ_DEFAULT_LINES
READ_MAX_BYTES = 64 * 1024  # one read result at most (then continue_offset)
FILE_MAX_BYTES = 16 * 1024 * 1024  # ds4_agent.c AGENT_FILE_MAX_BYTES
SEARCH_MAX_RESULTS = 50
LIST_MAX_ENTRIES = 500
SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", ".venv", "node_modules", ".mypy_cache", ".pytest_cache"}
UPTO = "[upto]"  # anchored edit: old = "START[upto]END" replaces START..END (behind --edit-upto)


def _schema(name: str, description: str, props: dict, required: list[str]) -> dict:
    params: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        params["required"] = required
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


_S, _N, _B = {"type": "string"}, {"type": "number"}, {"type": "boolean"}
SCHEMAS = {
    "bash": _schema("bash", "Run a shell command.", {"command": _S, "timeout_sec": _N, "refresh_sec": _N}, ["command"]),
    "bash_status": _schema(
        "bash_status", "Report current status and new output for a bash job.", {"job": _N, "refresh_sec": _N}, ["job"]
    ),
    "bash_stop": _schema(
        "bash_stop", "Terminate a running bash job and report its final output.", {"job": _N}, ["job"]
    ),
    "read": _schema(
        "read",
        "Read a text file or a range of lines.",
        {"path": _S, "start_line": _N, "max_lines": _N, "whole": _B, "raw": _B},
        ["path"],
    ),
    "more": _schema("more", "Continue the previous read-like output.", {"count": _N}, []),
    "write": _schema("write", "Create or overwrite a text file.", {"path": _S, "content": _S}, ["path", "content"]),
    "edit": _schema(
        "edit",
        "Edit a file: replace the exact text old (it must occur exactly once) with new.",
        {"path": _S, "old": _S, "new": _S},
        ["path", "old", "new"],
    ),
    "search": _schema(
        "search",
        "Search files and return compact edit-friendly matches.",
        {"query": _S, "path": _S, "mode": _S, "glob": _S, "context": _N, "max_results": _N, "case_sensitive": _B},
        ["query"],
    ),
    "list": _schema("list", "List one directory compactly.", {"path": _S}, ["path"]),
    "view_image": _schema("view_image", "Look at a PNG or JPEG image file.", {"path": _S}, ["path"]),
}
VISION_TOOLS = frozenset({"view_image"})  # only with a vision encoder (--vision)
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}
# tools with side effects: they need an approval (approval.py)
SIDE_EFFECTS = frozenset({"write", "edit", "bash"})


@dataclass
class _ReadCursor:
    path: str
    next_line: int  # 1-based


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_NEW_FILE_MODE = 0o666 & ~_umask()  # what open() would give a new file (mkstemp makes 0600)


def _fingerprint(st: os.stat_result, data: bytes) -> tuple:
    return (st.st_size, st.st_mtime_ns, hashlib.sha1(data).hexdigest())


def _int(args: dict, key: str, default: int) -> int:
    v = args.get(key, default)
    if v is None or v == "":
        return default
    try:
        return int(float(v))
    except (TypeError, ValueError):
        raise ToolError(f"{key} must be a number, got {v!r}") from None


def _bool(args: dict, key: str) -> bool:
    v = args.get(key, False)
    return v is True or (isinstance(v, str) and v.lower() in ("true", "1", "yes"))


def _read_fd(fd: int, rel: str) -> tuple[bytes, tuple]:
    """The whole file behind an open descriptor (a regular file within the size limit)
    and its fingerprint."""
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        raise ToolError(f"{rel} is a directory (use list)")
    if not stat.S_ISREG(st.st_mode):
        raise ToolError(f"{rel} is not a regular file")
    if st.st_size > FILE_MAX_BYTES:
        raise ToolError(f"{rel} is {st.st_size} bytes, over the {FILE_MAX_BYTES} byte limit")
    chunks = []
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            break
        chunks.append(b)
    data = b"".join(chunks)
    return data, _fingerprint(st, data)


def _decode(data: bytes, rel: str) -> str:
    if b"\0" in data[:8192]:
        raise ToolError(f"{rel} looks binary")
    return data.decode("utf-8", "replace")


class ToolBox:
    """The tools of one agent session, confined to `root`."""

    def __init__(
        self,
        root: str,
        *,
        edit_upto: bool = False,
        vision: bool = False,
        stop_requested: Callable[[], bool] = lambda: False,
    ):
        self.project = ProjectRoot(root)
        self.edit_upto = edit_upto
        self.vision = vision
        self.images: list = []  # chat.images.ImageInput of the last view_image, taken by the worker
        self.bash = BashJobs(self.project.root, stop_requested)
        self._seen: dict[str, tuple] = {}  # real path -> fingerprint the agent last saw
        self._cursor: _ReadCursor | None = None
        self._handlers = {
            "read": self.read,
            "more": self.more,
            "write": self.write,
            "edit": self.edit,
            "list": self.list,
            "search": self.search,
            "bash": self.bash.run,
            "bash_status": self.bash.status,
            "bash_stop": self.bash.stop,
            "view_image": self.view_image,
        }

    @property
    def root(self) -> str:
        return self.project.root

    def names(self) -> list[str]:
        return [n for n in SCHEMAS if self.vision or n not in VISION_TOOLS]

    def schemas(self) -> list[dict]:
        return [SCHEMAS[n] for n in self.names()]

    def call(self, name: str, arguments: str | dict) -> str:
        """Run one tool call; errors come back as "Tool error: ..." text."""
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments or {})
            if not isinstance(args, dict):
                raise ToolError("arguments must be a JSON object")
            fn = self._handlers.get(name) if name in self.names() else None
            if fn is None:
                raise ToolError(f"unknown tool {name!r}; available: {', '.join(self.names())}")
            return fn(args)
        except (ToolError, ValueError) as e:  # PathEscape, bad JSON, a NUL byte the OS refuses
            return f"Tool error: {e}"
        except OSError as e:
            return f"Tool error: {e.strerror or e} ({getattr(e, 'filename', '') or ''})"

    def close(self) -> None:
        self.bash.close()
        self.project.close()

    # -- opening ------------------------------------------------------------------
    def _read(self, path: str) -> tuple[str, bytes, tuple]:
        """-> (rel, bytes, fingerprint) of a file in the project."""
        try:
            fd, rel = self.project.open(path)
        except FileNotFoundError:
            raise ToolError(f"no such file: {path}") from None
        except IsADirectoryError:
            raise ToolError(f"{path} is a directory (use list)") from None
        try:
            data, fp = _read_fd(fd, rel)
        finally:
            os.close(fd)
        return rel, data, fp

    def _load(self, path: str) -> tuple[str, str, tuple]:
        """-> (rel, text, fingerprint) of a text file in the project."""
        rel, data, fp = self._read(path)
        return rel, _decode(data, rel), fp

    def _current(self, parent: int, name: str) -> tuple | None:
        """The fingerprint of `name` in the directory `parent` now (None: absent)."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=parent)
        except FileNotFoundError:
            return None
        except OSError:
            return ("not a regular file",)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return ("not a regular file",)
            return _read_fd(fd, name)[1]
        finally:
            os.close(fd)

    # -- read / more ---------------------------------------------------------------
    def read(self, args: dict) -> str:
        rel, text, fp = self._load(args.get("path", ""))
        self._seen[rel] = fp
        start = max(1, _int(args, "start_line", 1))
        whole = _bool(args, "whole")
        count = 1 << 30 if whole else max(1, _int(args, "max_lines", READ_DEFAULT_LINES))
        return self._chunk(rel, text, start, count, raw=_bool(args, "raw"), whole=whole)

    def more(self, args: dict) -> str:
        cur = self._cursor
        if cur is None:
            raise ToolError("nothing to continue: call read first")
        rel, text, _ = self._load(cur.path)  # walked and checked again: the file may have moved since
        return self._chunk(rel, text, cur.next_line, max(1, _int(args, "count", READ_DEFAULT_LINES)))

    def _chunk(self, rel: str, text: str, start: int, count: int, raw: bool = False, whole: bool = False) -> str:
        lines = text.splitlines()
        total = len(lines)
        if start > max(total, 1):
            self._cursor = None
            return f"{rel}: {total} lines; start_line {start} is past the end"
        out, size, end = [], 0, start - 1
        for i in range(start - 1, min(total, start - 1 + count)):
            row = lines[i] if raw else f"{i + 1}: {lines[i]}"
            if size + len(row) + 1 > READ_MAX_BYTES and out and not whole:
                break
            out.append(row)
            size += len(row) + 1
            end = i + 1
        head = f"{rel} (lines {start}-{end} of {total})"
        body = "\n".join(out)
        if end < total:
            self._cursor = _ReadCursor(rel, end + 1)
            return (
                f"{head}\n{body}\n[{total - end} more lines available: call more with count=500; "
                f"continue_offset={end + 1}]"
            )
        self._cursor = None
        return f"{head}\n{body}" if body else head

    # -- write / edit --------------------------------------------------------------
    def _changed(self, rel: str) -> ToolError:
        return ToolError(f"{rel} changed on disk since you last read it; read it again before changing it")

    def _replace(self, path: str, content: str, expected: tuple | None) -> tuple[str, bool]:
        """Replace the file atomically: a temporary made by descriptor in the target's
        own directory, renamed over it there.  `expected`: the fingerprint the file
        must still have (None: no check).  -> (rel, existed)."""
        r = self.project.walk(path, create_dirs=True)
        try:
            if r.name == ".":
                raise ToolError(f"{r.rel} is a directory")
            self.project.verify(r.parent, path)
            try:
                st = os.lstat(r.name, dir_fd=r.parent)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISDIR(st.st_mode):
                raise ToolError(f"{r.rel} is a directory")
            mode = stat.S_IMODE(st.st_mode) if st is not None and stat.S_ISREG(st.st_mode) else _NEW_FILE_MODE

            def check() -> None:
                now = self._current(r.parent, r.name)
                if expected is not None and now is not None and now != expected:
                    raise self._changed(r.rel)

            check()
            tmp = f".ds4mlx-agent-{secrets.token_hex(6)}"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
            fd = os.open(tmp, flags, 0o600, dir_fd=r.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
                    os.fchmod(f.fileno(), mode)
                    f.write(content)
                    f.flush()
                    os.fsync(f.fileno())
                check()  # last look before the rename
                os.rename(tmp, r.name, src_dir_fd=r.parent, dst_dir_fd=r.parent)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=r.parent)
                raise
            self._seen[r.rel] = self._current(r.parent, r.name)
            return r.rel, st is not None
        finally:
            r.close()

    def write(self, args: dict) -> str:
        path = ProjectRoot.check_text(args.get("path", ""))
        content = args.get("content")
        if not isinstance(content, str):
            raise ToolError("content must be a string")
        rel, existed = self._replace(path, content, self._seen.get(self._rel_of(path)))
        n = content.count("\n") + (0 if content.endswith("\n") or not content else 1)
        return f"{'overwrote' if existed else 'created'} {rel} ({n} lines, {len(content.encode())} bytes)"

    def _rel_of(self, path: str) -> str | None:
        """The project path `path` names now (links resolved), or None."""
        try:
            r = self.project.walk(path)
        except (OSError, ValueError):
            return None
        r.close()
        return r.rel

    def edit(self, args: dict) -> str:
        path = args.get("path", "")
        old, new = args.get("old"), args.get("new")
        if not isinstance(old, str) or not old:
            raise ToolError("old must be the exact non-empty text to replace")
        if not isinstance(new, str):
            raise ToolError("new must be a string")
        rel, text, fp = self._load(path)
        seen = self._seen.get(rel)
        if seen is not None and seen != fp:
            raise self._changed(rel)
        if self.edit_upto and UPTO in old:
            a, b = old.split(UPTO, 1)
            i = text.find(a)
            j = text.find(b, i + len(a)) if i >= 0 and b else -1
            if i < 0 or (b and j < 0) or text.find(a, i + 1) >= 0:
                raise ToolError("anchored edit: the start anchor must occur exactly once and the end anchor after it")
            span = (i, j + len(b) if b else i + len(a))
        else:
            n = text.count(old)
            if n != 1:
                raise ToolError(f"old text occurs {n} times in {rel}; it must occur exactly once")
            i = text.index(old)
            span = (i, i + len(old))
        line = text.count("\n", 0, span[0]) + 1
        self._replace(path, text[: span[0]] + new + text[span[1] :], fp)  # the file must still be what was read
        return f"edited {rel} at line {line}: replaced {span[1] - span[0]} bytes with {len(new)}"

    # -- view_image -----------------------------------------------------------------
    def view_image(self, args: dict) -> str:
        """The image goes to the model with the result (its marker leads the text)."""
        from ..chat import images

        rel, data, _ = self._read(args.get("path", ""))
        media = IMAGE_TYPES.get(os.path.splitext(rel)[1].lower())
        if media is None:
            raise ToolError(f"{rel}: view_image reads PNG or JPEG files ({', '.join(IMAGE_TYPES)})")
        try:
            image = images.from_bytes(data, media)
        except images.ImageError as e:
            raise ToolError(f"{rel}: {e.message}") from None
        self.images = [image]
        return f"{image.marker}\n{rel}: {image.width}x{image.height} {media} image"

    def take_images(self) -> list:
        out, self.images = self.images, []
        return out

    # -- list / search -------------------------------------------------------------
    def list(self, args: dict) -> str:
        path = args.get("path") or "."
        try:
            fd, rel = self.project.open(path, directory=True)
        except NotADirectoryError:
            raise ToolError(f"{path} is not a directory") from None
        except FileNotFoundError:
            raise ToolError(f"no such directory: {path}") from None
        rows = []
        try:
            with os.scandir(fd) as it:
                entries = sorted(it, key=lambda e: e.name)
            for e in entries:
                if len(rows) >= LIST_MAX_ENTRIES:
                    rows.append("[... more entries]")
                    break
                try:
                    if e.is_dir(follow_symlinks=False):
                        rows.append(e.name + "/")
                    elif e.is_symlink():
                        rows.append(f"{e.name} -> {os.readlink(e.name, dir_fd=fd)}")
                    else:
                        rows.append(f"{e.name} ({e.stat(follow_symlinks=False).st_size} B)")
                except OSError:
                    continue  # gone since the listing
        finally:
            os.close(fd)
        return f"{rel}/\n" + ("\n".join(rows) if rows else "(empty)")

    def search(self, args: dict) -> str:
        query = args.get("query")
        if not isinstance(query, str) or not query:
            raise ToolError("query is required")
        base = args.get("path") or "."
        mode = args.get("mode") or "literal"
        flags = 0 if _bool(args, "case_sensitive") else re.IGNORECASE
        try:
            rx = re.compile(query if mode == "regex" else re.escape(query), flags)
        except re.error as e:
            raise ToolError(f"bad regex: {e}") from None
        glob = args.get("glob") or None
        ctx = max(0, min(_int(args, "context", 0), 10))
        limit = max(1, min(_int(args, "max_results", SEARCH_MAX_RESULTS), 500))
        out, hits = [], 0
        for rel, text in self._files(base):
            if glob and not (fnmatch.fnmatch(rel, glob) or fnmatch.fnmatch(os.path.basename(rel), glob)):
                continue
            lines = text.splitlines()
            for i, line in enumerate(lines):
                if not rx.search(line):
                    continue
                hits += 1
                if hits > limit:
                    out.append("[more matches: raise max_results or narrow the query]")
                    return "\n".join(out)
                lo, hi = max(0, i - ctx), min(len(lines), i + ctx + 1)
                for k in range(lo, hi):
                    out.append(f"{rel}:{k + 1}{':' if k == i else '-'} {lines[k]}")
                if ctx:
                    out.append("--")
        return "\n".join(out) if out else f"no matches for {query!r}"

    def _files(self, base: str):
        """(rel, text) of the text files under `base` (a file or a directory), walked by
        descriptor without following links."""
        try:
            fd, rel = self.project.open(base, directory=True)
        except NotADirectoryError:
            r, text, _ = self._load(base)
            yield r, text
            return
        try:
            for dirpath, dirnames, filenames, dfd in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
                dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
                for name in sorted(filenames):
                    try:
                        f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
                    except OSError:
                        continue  # a link, or gone
                    p = os.path.normpath(os.path.join(rel, dirpath, name))
                    try:
                        text = _decode(_read_fd(f, p)[0], p)
                    except ToolError:
                        continue
                    finally:
                        os.close(f)
                    yield p, text
        finally:
            os.close(fd)
