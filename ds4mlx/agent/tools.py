"""The agent's file tools and the tool table.

Names, parameters and defaults follow ds4-agent (antirez/ds4 ds4_agent.c, the
"Available Tool Schemas" of its tool prompt): read (bounded: 500 lines by
default, `continue_offset=N`), more, write, edit, search, list, and bash /
bash_status / bash_stop (bashjobs.py).  Results are plain text for the model;
a failing tool returns "Tool error: ..." instead of raising.

Concurrent modification: every read / write / edit remembers the file's
fingerprint (size, mtime_ns, SHA-1); write and edit refuse a file that changed
on disk since the agent last saw it, so an edit never silently overwrites
someone else's change.  Writes replace atomically (temp file + os.replace).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..atomic_file import atomic_write
from .bashjobs import BashJobs
from .errors import ToolError
from .paths import PathEscape, ProjectRoot

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
}
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


def _fingerprint(path: str) -> tuple | None:
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            digest = hashlib.sha1(f.read()).hexdigest()
        return (st.st_size, st.st_mtime_ns, digest)
    except FileNotFoundError:
        return None


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


def _text_of(path: str) -> str:
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise ToolError(f"no such file: {path}") from None
    if os.path.isdir(path):
        raise ToolError(f"{path} is a directory (use list)")
    if size > FILE_MAX_BYTES:
        raise ToolError(f"{path} is {size} bytes, over the {FILE_MAX_BYTES} byte limit")
    with open(path, "rb") as f:
        data = f.read()
    if b"\0" in data[:8192]:
        raise ToolError(f"{path} looks binary")
    return data.decode("utf-8", "replace")


class ToolBox:
    """The tools of one agent session, confined to `root`."""

    def __init__(self, root: str, *, edit_upto: bool = False, stop_requested: Callable[[], bool] = lambda: False):
        self.project = ProjectRoot(root)
        self.edit_upto = edit_upto
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
        }

    @property
    def root(self) -> str:
        return self.project.root

    def names(self) -> list[str]:
        return list(SCHEMAS)

    def schemas(self) -> list[dict]:
        return [SCHEMAS[n] for n in self.names()]

    def call(self, name: str, arguments: str | dict) -> str:
        """Run one tool call; errors come back as "Tool error: ..." text."""
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments or {})
            if not isinstance(args, dict):
                raise ToolError("arguments must be a JSON object")
            fn = self._handlers.get(name)
            if fn is None:
                raise ToolError(f"unknown tool {name!r}; available: {', '.join(self.names())}")
            return fn(args)
        except (ToolError, PathEscape, json.JSONDecodeError) as e:
            return f"Tool error: {e}"
        except OSError as e:
            return f"Tool error: {e.strerror or e} ({getattr(e, 'filename', '') or ''})"

    def close(self) -> None:
        self.bash.close()

    # -- read / more ---------------------------------------------------------------
    def read(self, args: dict) -> str:
        path = self.project.resolve(args.get("path", ""))
        text = _text_of(path)
        self._seen[path] = _fingerprint(path)
        start = max(1, _int(args, "start_line", 1))
        whole = _bool(args, "whole")
        count = 1 << 30 if whole else max(1, _int(args, "max_lines", READ_DEFAULT_LINES))
        return self._chunk(path, text, start, count, raw=_bool(args, "raw"), whole=whole)

    def more(self, args: dict) -> str:
        cur = self._cursor
        if cur is None:
            raise ToolError("nothing to continue: call read first")
        text = _text_of(cur.path)
        return self._chunk(cur.path, text, cur.next_line, max(1, _int(args, "count", READ_DEFAULT_LINES)))

    def _chunk(self, path: str, text: str, start: int, count: int, raw: bool = False, whole: bool = False) -> str:
        lines = text.splitlines()
        total = len(lines)
        rel = self.project.relative(path)
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
            self._cursor = _ReadCursor(path, end + 1)
            return (
                f"{head}\n{body}\n[{total - end} more lines available: call more with count=500; "
                f"continue_offset={end + 1}]"
            )
        self._cursor = None
        return f"{head}\n{body}" if body else head

    # -- write / edit --------------------------------------------------------------
    def _check_unchanged(self, path: str) -> None:
        seen = self._seen.get(path)
        now = _fingerprint(path)
        if seen is not None and now is not None and now != seen:
            raise ToolError(
                f"{self.project.relative(path)} changed on disk since you last read it; "
                "read it again before changing it"
            )

    def _replace(self, path: str, content: str) -> None:
        """Atomic replace: the file is either the old or the new text, never half."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            mode = os.stat(path).st_mode & 0o7777
        except FileNotFoundError:
            mode = _NEW_FILE_MODE
        with atomic_write(
            path,
            "w",
            temp_prefix=".ds4mlx-agent-",
            fsync=True,
            permissions=mode,
            encoding="utf-8",
            newline="",
            before_replace=lambda: self._check_unchanged(path),  # last look before the rename
        ) as f:
            f.write(content)
        self._seen[path] = _fingerprint(path)

    def write(self, args: dict) -> str:
        path = self.project.resolve(args.get("path", ""))
        content = args.get("content")
        if not isinstance(content, str):
            raise ToolError("content must be a string")
        if os.path.isdir(path):
            raise ToolError(f"{self.project.relative(path)} is a directory")
        existed = os.path.exists(path)
        self._check_unchanged(path)
        self._replace(path, content)
        n = content.count("\n") + (0 if content.endswith("\n") or not content else 1)
        return f"{'overwrote' if existed else 'created'} {self.project.relative(path)} ({n} lines, {len(content.encode())} bytes)"

    def edit(self, args: dict) -> str:
        path = self.project.resolve(args.get("path", ""))
        old, new = args.get("old"), args.get("new")
        if not isinstance(old, str) or not old:
            raise ToolError("old must be the exact non-empty text to replace")
        if not isinstance(new, str):
            raise ToolError("new must be a string")
        text = _text_of(path)
        self._check_unchanged(path)
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
                raise ToolError(
                    f"old text occurs {n} times in {self.project.relative(path)}; it must occur exactly once"
                )
            i = text.index(old)
            span = (i, i + len(old))
        line = text.count("\n", 0, span[0]) + 1
        self._replace(path, text[: span[0]] + new + text[span[1] :])
        return (
            f"edited {self.project.relative(path)} at line {line}: replaced {span[1] - span[0]} bytes with {len(new)}"
        )

    # -- list / search -------------------------------------------------------------
    def list(self, args: dict) -> str:
        path = self.project.resolve(args.get("path") or ".")
        if not os.path.isdir(path):
            raise ToolError(f"{self.project.relative(path)} is not a directory")
        rows = []
        for e in sorted(os.scandir(path), key=lambda e: e.name):
            if len(rows) >= LIST_MAX_ENTRIES:
                rows.append("[... more entries]")
                break
            if e.is_dir(follow_symlinks=False):
                rows.append(e.name + "/")
            elif e.is_symlink():
                rows.append(f"{e.name} -> {os.readlink(e.path)}")
            else:
                rows.append(f"{e.name} ({e.stat().st_size} B)")
        return f"{self.project.relative(path)}/\n" + ("\n".join(rows) if rows else "(empty)")

    def search(self, args: dict) -> str:
        query = args.get("query")
        if not isinstance(query, str) or not query:
            raise ToolError("query is required")
        base = self.project.resolve(args.get("path") or ".")
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
        for path in self._walk(base):
            rel = self.project.relative(path)
            if glob and not (fnmatch.fnmatch(rel, glob) or fnmatch.fnmatch(os.path.basename(rel), glob)):
                continue
            try:
                lines = _text_of(path).splitlines()
            except ToolError:
                continue
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

    def _walk(self, base: str):
        if os.path.isfile(base):
            yield base
            return
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for name in sorted(filenames):
                p = os.path.join(dirpath, name)
                if not os.path.islink(p):
                    yield p
