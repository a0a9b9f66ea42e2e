"""Agent sessions on disk.

A session is one JSON file (the conversation as `chat.messages` values, the
thinking mode, the project directory) written atomically.  Its KV state is not
in the file: with a disk KV cache (`--kv-disk-dir`) the worker stores the live
session as a checkpoint with reason "agent-session" (and the system prompt
once with "agent-system"), keyed by its rendered text; when the session is
reopened, even in a new process, the first render of its conversation starts
with that text and the engine restores the checkpoint instead of prefilling
(docs/kv-cache.md §2 step 9).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, replace

from ..chat.messages import Conversation, Message, ToolCall
from ..io.atomic_file import atomic_write

VERSION = 1
SUFFIX = ".json"


def default_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "ds4mlx", "agent-sessions")


def conversation_to_json(conv: Conversation) -> list[dict]:
    """The messages as JSON values; images stay out (their markers become plain text:
    a reopened session no longer shows them to the model)."""
    rows = []
    for m in conv.messages:
        row = asdict(replace(m, images=[]))
        row.pop("images")
        rows.append(row)
    return rows


def messages_from_json(rows: list) -> list[Message]:
    out = []
    for r in rows:
        calls = [ToolCall(**c) for c in r.get("tool_calls", [])]
        spans = [tuple(s) for s in r.get("result_spans", [])]
        out.append(
            Message(
                role=r["role"],
                content=r.get("content", ""),
                reasoning=r.get("reasoning", ""),
                tool_calls=calls,
                tool_call_ids=list(r.get("tool_call_ids", [])),
                result_spans=spans,
                raw_dsml=r.get("raw_dsml", ""),
            )
        )
    return out


def save(path: str, conv: Conversation, *, cwd: str, model: str = "") -> str:
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = {
        "version": VERSION,
        "saved_at": time.time(),
        "cwd": cwd,
        "model": model,
        "thinking": conv.thinking,
        "messages": conversation_to_json(conv),
    }
    with atomic_write(path, "w", temp_prefix=".session-", fsync=True, encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=1)
    return path


def load(path: str) -> dict:
    """-> {"messages": [Message], "thinking", "cwd", ...}; ValueError if unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read session {path}: {e}") from None
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("messages"), list):
        raise ValueError(f"{path} is not a ds4mlx agent session (version {VERSION})")
    data["messages"] = messages_from_json(data["messages"])
    return data


def session_id(path: str) -> str:
    """A saved session's id: the SHA-1 of its file (what /list shows, /del and /strip take)."""
    import hashlib

    with open(path, "rb") as f:
        return hashlib.sha1(f.read()).hexdigest()


MIN_ID_PREFIX = 4  # hex digits of an id that /del and /strip accept


class SessionDir:
    """Named sessions in one directory (/save NAME, /list, /switch NAME, /del and
    /strip NAME or id prefix)."""

    def __init__(self, directory: str | None = None):
        self.dir = directory or default_dir()

    def path(self, name: str) -> str:
        if os.sep in name or name.startswith("."):
            return os.path.abspath(name)  # an explicit file
        return os.path.join(self.dir, name if name.endswith(SUFFIX) else name + SUFFIX)

    def find(self, ref: str) -> str:
        """The file of a session named `ref`, or whose id starts with `ref`; ValueError if
        none or several match."""
        path = self.path(ref)
        if os.path.exists(path):
            return path
        ref = ref.lower()
        if len(ref) < MIN_ID_PREFIX or any(c not in "0123456789abcdef" for c in ref):
            raise ValueError(f"no saved session {ref!r} (a name, or at least {MIN_ID_PREFIX} hex digits of its id)")
        hits = [os.path.join(self.dir, n + SUFFIX) for n, _, _, sha in self.list() if sha.startswith(ref)]
        if not hits:
            raise ValueError(f"no saved session with id {ref}...")
        if len(hits) > 1:
            raise ValueError(f"id prefix {ref} matches {len(hits)} sessions: give more digits")
        return hits[0]

    def list(self) -> list[tuple[str, float, int, str]]:
        """(name, saved_at, messages, id), newest first."""
        rows = []
        if not os.path.isdir(self.dir):
            return rows
        for fn in os.listdir(self.dir):
            if not fn.endswith(SUFFIX) or fn.startswith("."):
                continue
            try:
                data = load(os.path.join(self.dir, fn))
            except ValueError:
                continue
            path = os.path.join(self.dir, fn)
            rows.append((fn[: -len(SUFFIX)], float(data.get("saved_at", 0)), len(data["messages"]), session_id(path)))
        return sorted(rows, key=lambda r: -r[1])
