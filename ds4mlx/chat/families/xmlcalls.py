"""Tag-based tool calls (GLM `<tool_call>name<arg_key>..`, Qwen
`<tool_call><function=..><parameter=..>`): the element scanner, the final
parse and the streaming parser with the `OutputParser` interface.

A call element is scanned structurally from its `<tool_call>`: a parameter
value ends only at the value's own closing tag, so literal `</tool_call>`,
`</think>` or `<tool_call>` inside a value are data.  The renderer writes a
value's own closing tag as `&lt;/...>` (ds4's only escape for tool text) and
the parser decodes exactly that.

Streaming (`XmlOutputParser`): reasoning and text are released as soon as no
tag can start in them (a partial `</thi` at the end is held back until it is
known not to be `</think>`); a call is projected as OpenAI argument fragments
(`{`, one `"key":value` per finished parameter, `}`); `.structural` is true
inside call structure (tags, names, between parameters) and false inside a
parameter value; `.stop_now` is set when text that is not another call
follows the last call.  `finish()` runs the final parse, which is
authoritative, and emits what the stream still owes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ...runtime.events import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
from .. import markers as M
from ..jsontext import json_escape, minify_json
from ..protocol import CallFormat
from .common import call_arguments, param_types, tojson
from .deepseek_v4.dsml import ParsedCall, ParsedOutput
from .deepseek_v4.output import StreamParser, finish_call_events, tool_id_for

_WS = " \t\n\v\f\r"


def skip_ws(s: str, i: int) -> int:
    n = len(s)
    while i < n and s[i] in _WS:
        i += 1
    return i


def rstrip_pos(s: str, end: int, floor: int) -> int:
    while end > floor and s[end - 1] in _WS:
        end -= 1
    return max(end, floor)


def is_partial(tail: str, lits: Sequence[str]) -> bool:
    """`tail` is a proper prefix of one of `lits`."""
    return any(len(tail) < len(lit) and lit.startswith(tail) for lit in lits)


def hold_partial(s: str, start: int, lits: Sequence[str]) -> int:
    """Where a trailing proper prefix of one of `lits` begins (>= start), else len(s)."""
    n = len(s)
    longest = max(len(x) for x in lits)
    lt = s.rfind("<", max(start, n - longest + 1))
    while lt >= 0:
        if is_partial(s[lt:], lits):
            return lt
        lt = s.rfind("<", max(start, n - longest + 1), lt)
    return n


@dataclass
class Scan:
    """Progress of one call element from its open tag."""

    status: str  # complete | partial | invalid
    end: int  # complete: after the close tag; else where scanning stopped
    name: str | None = None
    params: list = field(default_factory=list)  # (key, value text)
    in_value: bool = False
    value_start: int = 0


class CallSyntax:
    """One tag-based call spelling.  Subclasses implement `scan` and `render_call`."""

    open = "<tool_call>"
    close = "</tool_call>"
    value_close = ""
    call_separator = ""  # between two calls of one turn

    def scan(self, text: str, pos: int) -> Scan:
        raise NotImplementedError

    def render_call(self, name: str, args: dict | None, raw_arguments: str) -> str:
        raise NotImplementedError

    def render_calls(self, calls: Sequence) -> str:
        """A turn's tool calls (`ToolCall`s) in this spelling, `call_separator` between them."""
        return self.call_separator.join(self.render_call(c.name, call_arguments(c), c.arguments) for c in calls)

    def argument_items(self, args: dict | None, raw_arguments: str) -> list[tuple[str, str]]:
        """(key, value text) of one call's arguments: strings escaped, other values as
        JSON; arguments that are not a JSON object (args None) are one `arguments` value."""
        items = args.items() if args is not None else [("arguments", raw_arguments)]
        return [(k, self.escape_value(v) if isinstance(v, str) else tojson(v)) for k, v in items]

    # The one escape of tool text (ds4): the value's own closing tag is written
    # `&lt;/...>`.  To stay reversible a value that already holds that entity
    # form (`&lt;/...>`, `&amp;lt;/...>`, ...) gets one more `amp;`.
    def _escape_re(self):
        rx = self.__dict__.get("_rx")
        if rx is None:
            tail = re.escape(self.value_close[1:])
            rx = (
                re.compile(re.escape(self.value_close) + "|&((?:amp;)*)lt;" + tail),
                re.compile("&((?:amp;)*)lt;" + tail),
            )
            self.__dict__["_rx"] = rx
        return rx

    def escape_value(self, v: str) -> str:
        if self.value_close not in v and "lt;" + self.value_close[1:] not in v:
            return v
        tail = self.value_close[1:]
        return self._escape_re()[0].sub(
            lambda m: "&lt;" + tail if m.group(1) is None else "&amp;" + m.group(1) + "lt;" + tail, v
        )

    def unescape_value(self, v: str) -> str:
        if "lt;" + self.value_close[1:] not in v:
            return v
        tail = self.value_close[1:]
        return self._escape_re()[1].sub(
            lambda m: self.value_close if not m.group(1) else "&" + m.group(1)[4:] + "lt;" + tail, v
        )


# --- argument typing -------------------------------------------------------------------


def _is_string_type(t: Any) -> bool | None:
    if isinstance(t, str):
        return t == "string"
    if isinstance(t, list) and t:
        kinds = [x for x in t if x != "null"]
        if kinds == ["string"]:
            return True
        return False if "string" not in kinds else None
    return None


def value_json(raw: str, declared: Any) -> str:
    """JSON text of a parameter value: a declared string stays a string; a
    declared other type is JSON when the text is valid JSON; undeclared text is
    JSON when it parses as a non-string JSON value, else a string."""
    is_str = _is_string_type(declared)
    if is_str:
        return json_escape(raw)
    try:
        v = json.loads(raw)
    except (ValueError, RecursionError):
        return json_escape(raw)
    if is_str is None and isinstance(v, str):
        return json_escape(raw)
    out = minify_json(raw)
    return out if out is not None else json_escape(raw)


def arguments_json(name: str, params: Sequence[tuple[str, str]], types: dict) -> str:
    decl = types.get(name, {})
    return "{" + ",".join(json_escape(k) + ":" + value_json(v, decl.get(k)) for k, v in params) + "}"


def _fragment(first: bool, name: str, key: str, value: str, types: dict) -> str:
    return ("" if first else ",") + json_escape(key) + ":" + value_json(value, types.get(name, {}).get(key))


# --- final parse -------------------------------------------------------------------------


@dataclass
class _Layout:
    region: int = 0  # where the answer begins (after </think>)
    content_hi: int = 0  # end of the content text (before the calls, whitespace excluded)


@dataclass
class ThinkStyle:
    open: str = "<think>"
    close: str = "</think>"
    strip_reasoning: bool = False  # reasoning is stripped of surrounding whitespace (Qwen)
    inline: bool = False  # an answer may open with its own <think>...</think> (Qwen)


def _reasoning_bounds(text: str, thinking: bool, ts: ThinkStyle) -> tuple[bool, int]:
    """(reasoning first, where its body starts)."""
    if thinking:
        s = skip_ws(text, 0)
        return True, (s + len(ts.open) if text.startswith(ts.open, s) else 0)
    if ts.inline:
        s = skip_ws(text, 0)
        if text.startswith(ts.open, s):
            return True, s + len(ts.open)
    return False, 0


def parse_xml_output(
    text: str,
    *,
    thinking: bool,
    tools_active: bool,
    truncated: bool,
    syntax: CallSyntax,
    think: ThinkStyle,
    types: dict | None = None,
) -> tuple[ParsedOutput, _Layout]:
    finish = "length" if truncated else "stop"
    types = types or {}
    lay = _Layout()
    reasoning = None
    in_think, body = _reasoning_bounds(text, thinking, think)
    if in_think:
        t = text.find(think.close, body)
        if t < 0:  # never closed (ds4: the whole text is the content of the final parse)
            lay.content_hi = len(text)
            return ParsedOutput(content=text, reasoning=None, finish=finish), lay
        reasoning = text[body:t]
        if think.strip_reasoning:
            reasoning = reasoning.strip(_WS)
        lay.region = t + len(think.close)
    region = lay.region
    lo = skip_ws(text, region)
    if not tools_active:
        lay.content_hi = rstrip_pos(text, len(text), lo)
        return ParsedOutput(content=text[lo : lay.content_hi], reasoning=reasoning, finish=finish), lay
    p = text.find(syntax.open, region)
    skipped = False
    while p >= 0:  # an open tag whose element is not a call is text
        if syntax.scan(text, p).status != "invalid":
            break
        skipped = True
        p = text.find(syntax.open, p + 1)
    if p < 0:
        lay.content_hi = rstrip_pos(text, len(text), lo)
        err = M.PARSE_INVALID_TOOL_CALL if skipped else None
        return ParsedOutput(content=text[lo : lay.content_hi], reasoning=reasoning, error=err, finish=finish), lay
    calls: list[ParsedCall] = []
    pos = p
    last_end = p
    failure = None
    while True:
        s = syntax.scan(text, pos)
        if s.status == "complete":
            raw = text[pos : s.end]
            calls.append(
                ParsedCall(
                    name=s.name or "", arguments_json=arguments_json(s.name or "", s.params, types), raw_dsml=raw
                )
            )
            last_end = s.end
            q = skip_ws(text, s.end)
            if text.startswith(syntax.open, q):
                pos = q
                continue
            break
        if not calls:
            failure = s.status
        break
    if failure is not None:
        lay.content_hi = rstrip_pos(text, len(text), lo)
        content = text[lo : lay.content_hi]
        if failure == "partial" and truncated:  # cut by the token limit: plain text, no repair
            return ParsedOutput(content=content, reasoning=reasoning, finish=finish), lay
        err = M.PARSE_UNTERMINATED_TOOL_CALL
        return ParsedOutput(content=content, reasoning=reasoning, error=err, finish=finish), lay
    lay.content_hi = rstrip_pos(text, p, lo)
    return ParsedOutput(
        content=text[lo : lay.content_hi],
        reasoning=reasoning,
        calls=calls,
        raw_dsml=text[p:last_end],
        finish="tool_calls",
    ), lay


# --- streaming -------------------------------------------------------------------------------


class XmlOutputParser(StreamParser):
    """The `OutputParser` interface for tag-based tool calls (see the module docstring)."""

    def __init__(
        self,
        syntax: CallSyntax,
        think: ThinkStyle,
        thinking: bool,
        tools_active: bool,
        id_prefix: str = M.OPENAI_TOOL_ID_PREFIX,
        *,
        tool_memory=None,
        tool_schemas: Sequence[str] = (),
    ):
        super().__init__(thinking, tools_active, id_prefix, tool_memory)
        self.syntax = syntax
        self.think = think
        self.types = param_types(tool_schemas) if tools_active else {}
        self._head_checked = False  # the start checked for a think open (thinking or inline)
        self._body = 0
        self._r_emit = 0
        self._r_started = not think.strip_reasoning
        self._region = 0
        self._c_emit = 0
        self._c_started = False
        self._structural = False
        # calls
        self._call_pos = -1
        self._index = 0
        self._params_sent = 0
        self._last_end = -1
        self._failed = False
        self._ids: dict[int, str] = {}
        self._started: set[int] = set()
        self._ended: set[int] = set()
        self._sent: dict[int, tuple[str, str]] = {}  # index -> (name, arguments sent so far)
        self._cut_calls: list | None = None  # announced calls cut short (what the stream sent)
        self._r_out = ""  # reasoning and text as streamed
        self._t_out = ""

    # --- public state ---------------------------------------------------------------------
    @property
    def structural(self) -> bool:
        return self._structural and not self.stop_now and not self._finished

    def stop_after_call(self, events: list) -> None:
        """Stop generating here, after the calls announced so far (one tool call per turn:
        chat/protocol.FirstCallOnly)."""
        if self._cut_calls is None and not self.stop_now:
            self._cut(events, len(self.raw))

    def finish(self, truncated: bool = False) -> tuple[list, ParsedOutput]:
        events = self._end_feed()
        if self.phase == "tool" and self._cut_calls is None and (truncated or self._call_pos >= 0):
            # the output ended inside a call (EOS, the token limit): that call is not complete,
            # so it is not returned (the stream left it open), and no markup is text (docs/dsml.md §3.1)
            final = ParsedOutput(
                content=self._t_out,
                reasoning=self._r_out if self.thinking or self._r_out else None,
                calls=[ParsedCall(name=self._sent[i][0], arguments_json=self._sent[i][1]) for i in sorted(self._ended)],
                error=M.PARSE_LIMIT_TOOL_CALL if truncated else M.PARSE_UNTERMINATED_TOOL_CALL,
                finish="length" if truncated else "stop",
            )
            finish_call_events(events, final.calls, self._id_for, self._started, self._ended)
            self.result = final
            return events, final
        raw = self.text
        final, lay = parse_xml_output(
            raw,
            thinking=self.thinking,
            tools_active=self.tools_active,
            truncated=truncated,
            syntax=self.syntax,
            think=self.think,
            types=self.types,
        )
        if self.phase == "reasoning" and final.reasoning is None:
            self._emit_reasoning(events, len(raw))  # never closed: everything is reasoning, streamed and final alike
            final = replace(final, content="", reasoning=self._r_out)
        elif self._cut_calls is not None or (self._sent and not self._agrees(final)):
            if self._cut_calls is None:  # the final parse disowns an announced call: keep what was sent
                self._cut(events, len(raw))
            final = ParsedOutput(
                content=self._t_out,
                reasoning=final.reasoning if final.reasoning is not None else (self._r_out if self.thinking else None),
                calls=[ParsedCall(name=n, arguments_json=a) for n, a in self._cut_calls],
                error=M.PARSE_CUT_TOOL_CALL,
                finish="tool_calls",
            )
        elif self.phase == "tool" and not final.calls and not self._sent:
            # as ds4 with DSML: a call cut before its close (EOS, max_tokens) and never
            # announced stays out of the stream and, alike, of the answer
            final = replace(final, content=self._t_out)
        else:
            if self.phase == "reasoning":  # closed in the tail
                self._step(events)
            self._emit_text(events, lay.content_hi)
        finish_call_events(events, final.calls, self._id_for, self._started, self._ended)
        self.result = final
        return events, final

    # --- internals --------------------------------------------------------------------------
    def _agrees(self, final: ParsedOutput) -> bool:
        if final.content != self._t_out:
            return False
        for i, (name, sent) in self._sent.items():
            if (
                i >= len(final.calls)
                or final.calls[i].name != name
                or i not in self._ended
                or final.calls[i].arguments != sent
            ):
                return False
        return True

    def _send(self, events: list, i: int, text: str) -> None:
        events.append(ToolCallDelta(index=i, arguments=text))
        name, sent = self._sent[i]
        self._sent[i] = (name, sent + text)

    def _cut(self, events: list, at: int) -> None:
        """Close the announced, unfinished call with what was sent and stop generating."""
        i = self._index
        if i in self._started and i not in self._ended:
            self._send(events, i, "}")
            name, sent = self._sent[i]
            events.append(ToolCallEnd(index=i, id=self._id_for(i), name=name, arguments=sent))
            self._ended.add(i)
        self._cut_calls = [self._sent[k] for k in sorted(self._sent)]
        self._failed = True
        self._stop(at)

    def _id_for(self, index: int) -> str:
        return tool_id_for(self._ids, index, self.id_prefix, self.tool_memory)

    def _emit_reasoning(self, events: list, limit: int) -> None:
        if not self._r_started:  # stripped reasoning: its leading whitespace is never sent
            self._r_emit = skip_ws(self.raw, self._r_emit)
            if limit <= self._r_emit:
                return
            self._r_started = True
        if limit > self._r_emit:
            events.append(ReasoningDelta(self.raw[self._r_emit : limit]))
            self._r_out += self.raw[self._r_emit : limit]
            self._r_emit = limit

    def _skip_content_ws(self) -> None:
        if not self._c_started:
            self._c_emit = skip_ws(self.raw, max(self._c_emit, self._region))

    def _emit_text(self, events: list, limit: int) -> None:
        self._skip_content_ws()
        if limit > self._c_emit:
            self._c_started = True
            events.append(TextDelta(self.raw[self._c_emit : limit]))
            self._t_out += self.raw[self._c_emit : limit]
            self._c_emit = limit

    def _step(self, events: list) -> None:
        if self.phase == "reasoning":
            self._reasoning(events)
        if self.phase == "text":
            self._text(events)
        if self.phase == "tool":
            self._tool(events)

    def _head(self) -> bool | None:
        """Look for an opening <think> at the start: None = wait for more text."""
        raw = self.raw
        s = skip_ws(raw, 0)
        if s >= len(raw):
            return None
        if is_partial(raw[s:], (self.think.open,)):
            return None
        self._head_checked = True
        if raw.startswith(self.think.open, s):
            self._body = self._r_emit = s + len(self.think.open)
            return True
        return False

    def _reasoning(self, events: list) -> None:
        raw = self.raw
        if not self._head_checked:
            if self._head() is None:
                self._structural = False
                return
        ts = self.think
        t = raw.find(ts.close, self._body)
        if t >= 0:
            end = rstrip_pos(raw, t, self._r_emit) if ts.strip_reasoning else t
            self._emit_reasoning(events, end)
            self._r_emit = t + len(ts.close)
            self._region = self._c_emit = t + len(ts.close)
            self.phase = "text"
            return
        limit = hold_partial(raw, self._r_emit, (ts.close,))
        if ts.strip_reasoning:
            limit = rstrip_pos(raw, limit, self._r_emit)
        self._emit_reasoning(events, limit)
        self._structural = False

    def _text(self, events: list) -> None:
        raw = self.raw
        n = len(raw)
        self._structural = False
        if self.think.inline and not self.thinking and not self._head_checked:
            got = self._head()
            if got is None:
                return
            if got:
                self.phase = "reasoning"
                self._reasoning(events)
                if self.phase != "text":
                    return
                raw = self.raw
        self._head_checked = True
        self._skip_content_ws()
        if not self.tools_active:
            self._emit_text(events, rstrip_pos(raw, n, self._c_emit))
            return
        p = raw.find(self.syntax.open, self._c_emit)
        if p >= 0:
            self._emit_text(events, rstrip_pos(raw, p, self._c_emit))
            self.phase = "tool"
            self._call_pos = p
            self._params_sent = 0
            return
        limit = hold_partial(raw, self._c_emit, (self.syntax.open,))
        self._emit_text(events, rstrip_pos(raw, limit, self._c_emit))

    def _tool(self, events: list) -> None:
        raw = self.raw
        syn = self.syntax
        while self.phase == "tool":
            if self._call_pos < 0:  # between calls
                q = skip_ws(raw, self._last_end)
                self._structural = False
                if q >= len(raw) or is_partial(raw[q:], (syn.open,)):
                    return
                if raw.startswith(syn.open, q):
                    self._call_pos = q
                    self._params_sent = 0
                    continue
                self._stop(self._last_end)  # text after the calls: the turn is over
                return
            s = syn.scan(raw, self._call_pos)
            i = self._index
            # announced once certain: a first parameter (or the close) is parsed
            if (
                s.name is not None
                and i not in self._started
                and not self._failed
                and (s.params or s.status == "complete")
            ):
                events.append(ToolCallStart(index=i, id=self._id_for(i), name=s.name))
                self._started.add(i)
                self._sent[i] = (s.name, "")
                self._send(events, i, "{")
            if i in self._started and not self._failed:
                while self._params_sent < len(s.params):
                    k, v = s.params[self._params_sent]
                    self._send(events, i, _fragment(self._params_sent == 0, s.name, k, v, self.types))
                    self._params_sent += 1
            if s.status == "complete":
                if i in self._started and not self._failed:
                    self._send(events, i, "}")
                    events.append(ToolCallEnd(index=i, id=self._id_for(i), name=s.name, arguments=self._sent[i][1]))
                    self._ended.add(i)
                self._index += 1
                self._last_end = s.end
                self._call_pos = -1
                continue
            if s.status == "partial":
                if s.in_value:
                    close = syn.value_close
                    tail = hold_partial(raw, s.value_start, (close,))
                    self._structural = len(raw) - tail >= 2
                else:
                    self._structural = True
                return
            # invalid
            if self._index == 0 and i not in self._started:
                # not a call after all: it is text; look for the next open after it
                self.phase = "text"
                self._c_started = self._c_started or self._call_pos > self._c_emit
                self._text_from(events, self._call_pos)
                return
            if i in self._started:  # broke off after its announcement: cut it
                self._cut(events, s.end)
                return
            self._failed = True
            self._stop(self._last_end if self._last_end >= 0 else len(raw))
            return

    def _text_from(self, events: list, p: int) -> None:
        """The open tag at `p` was text: release up to past it and scan on."""
        raw = self.raw
        q = raw.find(self.syntax.open, p + 1)
        if q >= 0:
            self._emit_text(events, rstrip_pos(raw, q, self._c_emit))
            self.phase = "tool"
            self._call_pos = q
            self._params_sent = 0
            self._tool(events)
            return
        limit = hold_partial(raw, p + 1, (self.syntax.open,))
        self._emit_text(events, rstrip_pos(raw, limit, self._c_emit))

    def _stop(self, at: int) -> None:
        self.phase = "done"
        self.stop_now = True
        self._stop_at = at
        self._structural = False


class XmlCalls(CallFormat):
    """The `CallFormat` of a tag-based spelling (GLM, Qwen): `syntax` and the family's think tags."""

    def __init__(self, syntax: CallSyntax, think: ThinkStyle):
        self.syntax = syntax
        self.think = think

    def render(self, calls: Sequence) -> str:
        return self.syntax.render_calls(calls)

    def parser(self, thinking: bool, tools_active: bool, id_prefix: str, tool_memory, tool_schemas: Sequence[str]):
        return XmlOutputParser(
            self.syntax,
            self.think,
            thinking,
            tools_active,
            id_prefix,
            tool_memory=tool_memory,
            tool_schemas=tool_schemas,
        )

    def parse(self, text: str, thinking: bool, tools_active: bool, truncated: bool, tool_schemas: Sequence[str]):
        out, _ = parse_xml_output(
            text,
            thinking=thinking,
            tools_active=tools_active,
            truncated=truncated,
            syntax=self.syntax,
            think=self.think,
            types=param_types(tool_schemas),
        )
        return out
