"""`--prefix-file FILE`: a conversation prefilled before the live prompt.

ds4's format (ds4_prompt_prefix.c, tests/ds4_prompt_prefix_test.c in antirez/ds4):
whole lines starting with `USER:` or `ASSISTANT:` open a turn; the turn runs to
the next such line (other lines, including ones where the marker is indented,
belong to it).  One space or tab after the marker is dropped, as are the line
end (`\\n` or `\\r\\n`) before the next turn.  Turns start with USER, alternate,
and end with ASSISTANT; none may be empty; a leading UTF-8 BOM is ignored.

The turns become ordinary `Message`s placed after the system prompt, so the
family's chat template renders them (ds4 appends each with
`ds4_chat_append_message`, EOS after assistant turns except on GLM, which is
what each family's template does for a history assistant turn).
"""

from __future__ import annotations

from ..chat.messages import Message

__all__ = ["PrefixError", "parse", "load", "with_head", "USER_MARK", "ASSISTANT_MARK"]

USER_MARK = "USER:"
ASSISTANT_MARK = "ASSISTANT:"
_ROLES = {USER_MARK: "user", ASSISTANT_MARK: "assistant"}
_BOM = "\ufeff"


class PrefixError(ValueError):
    """A malformed prefix file; the message names the line."""


def _marker(text: str, pos: int):
    for mark in (USER_MARK, ASSISTANT_MARK):
        if text.startswith(mark, pos):
            return mark
    return None


def parse(text: str) -> list[Message]:
    """The turns of a prefix file's text, as user / assistant messages."""
    if text.startswith(_BOM):
        text = text[1:]
    if not text:
        raise PrefixError("prefix file is empty")
    if "\0" in text:
        raise PrefixError(f"line {text.count(chr(10), 0, text.index(chr(0))) + 1} contains a NUL byte")
    turns: list[Message] = []
    last_line = 1
    pos, line, n = 0, 1, len(text)
    while pos < n:
        mark = _marker(text, pos)
        if mark is None:
            raise PrefixError(f"line {line} must start with {USER_MARK} or {ASSISTANT_MARK}")
        expected = USER_MARK if len(turns) % 2 == 0 else ASSISTANT_MARK
        if mark != expected:
            raise PrefixError(f"line {line}: expected {expected}")
        start = pos + len(mark)
        if start < n and text[start] in " \t":
            start += 1
        # the turn ends where a later line starts with a marker
        nxt, nxt_line, scan_line, i = n, line, line, text.find("\n", start)
        while i != -1:
            scan_line += 1
            if i + 1 < n and _marker(text, i + 1):
                nxt, nxt_line = i + 1, scan_line
                break
            i = text.find("\n", i + 1)
        end = nxt
        if end > start and text[end - 1] == "\n":
            end -= 1
            if end > start and text[end - 1] == "\r":
                end -= 1
        if end == start:
            raise PrefixError(f"line {line} has an empty {mark[:-1]} turn")
        turns.append(Message(_ROLES[mark], text[start:end]))
        last_line = line
        pos, line = nxt, nxt_line
    if turns[-1].role != "assistant":
        raise PrefixError(f"line {last_line}: prefix file must end with an {ASSISTANT_MARK[:-1]} turn")
    return turns


def load(path: str) -> list[Message]:
    """`parse` of a file (UTF-8); errors carry the path."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise PrefixError(f"cannot open prefix file {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise PrefixError(f"{path}: line {line} is not valid UTF-8") from None
    try:
        return parse(text)
    except PrefixError as e:
        raise PrefixError(f"{path}: {e}") from None


_SYSTEM_ROLES = ("system", "developer")


def with_head(messages: list, system: str, prefix) -> list:
    """A request's messages with the server's defaults: `system` when the request
    brings no system message, then the prefix turns after the leading system
    messages (`ds4mlx serve -sys ... --prefix-file ...`)."""
    lead = 0
    while lead < len(messages) and messages[lead].role in _SYSTEM_ROLES:
        lead += 1
    has_system = any(m.role in _SYSTEM_ROLES for m in messages)
    head = [] if has_system or not system else [Message("system", system)]
    return head + list(messages[:lead]) + [Message(m.role, m.content) for m in prefix] + list(messages[lead:])
