"""DeepSeek V4 prompts as DeepSeek's own encoder writes them (`--chat-template official`).

The release's `encoding_dsv4.py` (`encode_messages`), driven the way SGLang drives it: the
tools ride on the leading system message (an empty one is put first when the conversation
does not start with a system message), thinking mode "thinking" for high / max (max adds
the Think-Max prefix) and "chat" for none, `drop_thinking` on.  docs/chat-template.md §11
lists every difference from ds4's renderer (template.py), which stays the default.

The steps are the encoder's:

1. the request as template turns (families/common.py: developer -> system, function ->
   tool, Anthropic tool_result blocks -> tool turns, the Anthropic system first);
2. tool results and user text merged into one user turn per run, its blocks joined by a
   blank line, tool results put in the order of the calls of the assistant turn before;
3. without tools, in thinking mode, reasoning dropped from assistant turns before the last
   user turn;
4. each turn rendered; `<｜Assistant｜>` + `<think>` / `</think>` opens after a user turn
   followed by an assistant turn or ending the conversation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ... import markers as M
from ...messages import Conversation
from ..common import Turn, active_schemas, turns

__all__ = ["render", "keeps_reasoning", "tools_block", "dsml_block"]

_FULL = M.DSML_FULL
_SEP = M.OFFICIAL_SECTION_SEPARATOR


@dataclass
class _Block:
    """One piece of a merged user turn: user text, or a tool result and the call it answers."""

    text: str
    tool_id: str | None = None  # None: user text


@dataclass
class _Entry:
    """One message of the encoder's list after its preprocessing."""

    role: str  # system | user | assistant
    text: str = ""  # system: content; assistant: content
    reasoning: str = ""  # assistant
    calls: list = field(default_factory=list)  # assistant: ToolCall
    blocks: list[_Block] = field(default_factory=list)  # user
    tools: list[str] = field(default_factory=list)  # system: rendered schema lines


def _to_json(value: Any) -> str:
    """The encoder's `to_json`: Python's default separators, UTF-8 kept."""
    return json.dumps(value, ensure_ascii=False)


def tools_block(schemas: list[str]) -> str:
    """The encoder's tools text for the request's schema lines (re-serialised)."""
    lines = []
    for s in schemas:
        try:
            lines.append(_to_json(json.loads(s)))
        except ValueError:
            lines.append(s)  # a line that is not JSON (never from the request parsers) stays as sent
    return M.OFFICIAL_TOOLS_BLOCK_HEAD + "\n".join(lines) + M.OFFICIAL_TOOLS_BLOCK_TAIL


def _arguments(text: str) -> dict:
    """A call's arguments as the encoder reads them; text that is not a JSON object is one
    string parameter named `arguments` (the encoder fails on a JSON non-object)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {M.OFFICIAL_RAW_ARGUMENTS_KEY: text}


def dsml_block(calls) -> str:
    """The encoder's DSML for one assistant turn's calls: names, keys and string values
    verbatim (no escapes), other values re-serialised with `json.dumps`."""
    invokes = []
    for call in calls:
        params = []
        for key, value in _arguments(call.arguments).items():
            is_string = isinstance(value, str)
            body = value if is_string else _to_json(value)
            params.append(
                f'{_FULL.param} name="{key}" string="{"true" if is_string else "false"}">{body}{_FULL.param_close}'
            )
        invokes.append(f'{_FULL.invoke} name="{call.name}">\n' + "\n".join(params) + f"\n{_FULL.invoke_close}")
    return M.DSML_BLOCK_SEPARATOR + _FULL.open + "\n" + "\n".join(invokes) + "\n" + _FULL.close


def _entries(ts: list[Turn], schemas: list[str]) -> list[_Entry]:
    """Step 2: the turns as the encoder's message list (tools on the leading system
    message, each run of tool results and user text merged into one user turn)."""
    out: list[_Entry] = []
    if not ts or ts[0].role != "system":
        out.append(_Entry("system"))
    for t in ts:
        if t.role in ("user", "tool"):
            block = _Block(t.content, t.tool_id if t.role == "tool" else None)
            if out[-1].role == "user":
                out[-1].blocks.append(block)
            else:
                out.append(_Entry("user", blocks=[block]))
        elif t.role == "assistant":
            out.append(_Entry("assistant", t.content, t.reasoning, list(t.tool_calls)))
        else:
            out.append(_Entry("system", t.content))
    out[0].tools = schemas
    return out


def _sort_results(entries: list[_Entry]) -> None:
    """Tool results of each user turn in the order of the calls of the last assistant turn
    with calls before it (an unknown id ranks first; a stable sort); text blocks keep
    their places."""
    order: dict[str, int] = {}
    for e in entries:
        if e.role == "assistant" and e.calls:
            order = {c.id: i for i, c in enumerate(e.calls) if c.id}
        elif e.role == "user" and order:
            results = [b for b in e.blocks if b.tool_id is not None]
            if len(results) > 1:
                it = iter(sorted(results, key=lambda b: order.get(b.tool_id, 0)))
                e.blocks = [next(it) if b.tool_id is not None else b for b in e.blocks]


def _last_user(entries: list[_Entry]) -> int:
    return max((i for i, e in enumerate(entries) if e.role == "user"), default=-1)


def keeps_reasoning(conv: Conversation) -> bool:
    """Every assistant turn keeps its reasoning: the encoder's `drop_thinking` is off when
    tools are given."""
    return bool(active_schemas(conv))


def _render_entry(e: _Entry, i: int, entries: list[_Entry], think: bool, drop: bool, last_user: int) -> str:
    if e.role == "system":
        out = e.text + (_SEP + tools_block(e.tools) if e.tools else "")
    elif e.role == "user":
        out = M.USER + _SEP.join(
            b.text if b.tool_id is None else M.TOOL_RESULT_OPEN + b.text + M.TOOL_RESULT_CLOSE for b in e.blocks
        )
    else:
        reasoning = ""
        if think and (not drop or i > last_user):
            reasoning = e.reasoning + M.THINK_CLOSE
        out = reasoning + e.text + (dsml_block(e.calls) if e.calls else "") + M.EOS
    if i + 1 < len(entries) and entries[i + 1].role != "assistant":
        return out
    if e.role == "user":  # the assistant turn that follows (or the generation prompt) opens
        out += M.ASSISTANT + (M.THINK_OPEN if think and (not drop or i >= last_user) else M.THINK_CLOSE)
    return out


def render(conv: Conversation) -> str:
    """The prompt `encode_messages` writes for this request (docs/chat-template.md §11)."""
    schemas = active_schemas(conv)
    entries = _entries(turns(conv), schemas)
    _sort_results(entries)
    think = conv.thinking in ("high", "max")
    drop = not schemas  # without tools, reasoning before the last user turn is dropped
    last_user = _last_user(entries)
    out = [M.BOS, M.THINK_MAX_PREFIX if conv.thinking == "max" else ""]
    out += (_render_entry(e, i, entries, think, drop, last_user) for i, e in enumerate(entries))
    return "".join(out)
