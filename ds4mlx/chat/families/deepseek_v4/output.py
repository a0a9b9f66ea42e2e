"""Streaming projection of generated text into engine events (docs/dsml.md §7, docs/http-api.md §3).

The engine's decode loop feeds every sampled piece of text to an
`OutputParser` (after detok.StopMatcher, which cuts at stop sequences) and
forwards the returned events.  The parser also tells the loop how to sample the
next token (`structural`: greedy inside DSML structure, docs/dsml.md §5.1) and when
to stop (`stop_now`: right after the block CLOSE).  `finish()` runs the final
parse (docs/dsml.md §3), which stays authoritative, and emits whatever the stream
still owes so that the concatenated events agree with it.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Callable, Sequence
from dataclasses import replace

from ....runtime.events import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
from ... import markers as M
from ...protocol import CallFormat
from .dsml import (
    C_SPACE,
    JSON_STRUCTURAL,
    STRUCTURAL,
    DecodeTracker,
    ParsedCall,
    ParsedOutput,
    ParseFail,
    attr,
    decode_entities,
    entity_modes,
    is_partial_marker,
    json_escape,
    json_escape_fragment,
    parse_block,
    parse_invoke,
    parse_leaf,
    parse_output,
    partial_open_at_tail,
    skip_ws,
    value_json,
)

__all__ = ["DsmlCalls", "OutputParser", "StreamParser", "new_tool_id"]

_THINK_HOLD = len(M.THINK_CLOSE) - 1  # ds4 holds the last 7 bytes of reasoning (a possible partial </think>)
_TAIL = 64  # longer than any DSML tag


def _rstrip_pos(raw: str, end: int, floor: int) -> int:
    """`end` moved back over trailing C whitespace, not below `floor`."""
    while end > floor and raw[end - 1] in C_SPACE:
        end -= 1
    return max(end, floor)


def new_tool_id(prefix: str = M.OPENAI_TOOL_ID_PREFIX, taken: Callable[[str], bool] | None = None) -> str:
    """`prefix` + 32 lowercase hex from os.urandom, retried while `taken(id)` (docs/dsml.md §8)."""
    while True:
        tool_id = prefix + os.urandom(16).hex()
        if taken is None or not taken(tool_id):
            return tool_id


def tool_id_for(ids: dict, index: int, prefix: str, tool_memory=None) -> str:
    """The id of call `index` of one output: made once, unique within the output
    and unknown to the tool memory (`ids` maps index -> id)."""
    tool_id = ids.get(index)
    if tool_id is None:
        used = set(ids.values())
        tool_id = new_tool_id(prefix, lambda i: i in used or (tool_memory is not None and tool_memory.has(i)))
        ids[index] = tool_id
    return tool_id


def finish_call_events(events: list, calls, id_for, started, ended) -> None:
    """At the end of an output: give every final call its id and emit what the stream
    has not sent yet (whole calls never started, the end of calls still open)."""
    for i, call in enumerate(calls):
        call.id = id_for(i)
        if i not in started:
            events.append(ToolCallStart(index=i, id=call.id, name=call.name))
            events.append(ToolCallDelta(index=i, arguments=call.arguments))
            events.append(ToolCallEnd(index=i, id=call.id, name=call.name, arguments=call.arguments))
        elif i not in ended:
            events.append(ToolCallEnd(index=i, id=call.id, name=call.name, arguments=call.arguments))


class StreamParser:
    """What every family's streaming output parser shares: `feed` takes `str` or raw UTF-8
    `bytes` (an incremental decoder holds incomplete sequences) and appends it to `raw`.
    Subclasses implement `_step(events)` (advance over the new text) and `finish`."""

    def __init__(self, thinking: bool, tools_active: bool, id_prefix: str, tool_memory):
        self.thinking = thinking
        self.tools_active = tools_active
        self.id_prefix = id_prefix
        self.tool_memory = tool_memory
        self.raw = ""
        self.phase = "reasoning" if thinking else "text"  # reasoning | text | tool | done
        self.stop_now = False
        self.result: ParsedOutput | None = None
        self._decoder = None
        self._finished = False
        self._stop_at: int | None = None

    @property
    def text(self) -> str:
        """The generation as the final parse reads it: cut right after the block
        CLOSE that stopped it (bytes sampled past it in the same token are dropped)."""
        return self.raw if self._stop_at is None else self.raw[: self._stop_at]

    def feed(self, text: str | bytes) -> list:
        if isinstance(text, (bytes, bytearray)):
            if self._decoder is None:
                self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
            text = self._decoder.decode(bytes(text))
        if self._finished:
            raise RuntimeError(f"{type(self).__name__}.feed after finish")
        self._append(text)
        events: list = []
        if text and self.phase != "done":
            self._step(events)
        return events

    def _end_feed(self) -> list:
        """The events of what the UTF-8 decoder still held; nothing is fed after this."""
        events: list = []
        if self._decoder is not None:
            tail = self._decoder.decode(b"", final=True)
            if tail:
                self._append(tail)
                if self.phase != "done":
                    self._step(events)
        self._finished = True
        return events

    def _append(self, text: str) -> None:
        raw = self.raw
        self.raw = ""
        raw += text  # sole reference: CPython appends in place instead of copying the whole text
        self.raw = raw

    def _step(self, events: list) -> None:
        raise NotImplementedError


class OutputParser(StreamParser):
    """Incremental parser of one generation.

    `thinking`: the prompt ended with `<think>` (output starts in reasoning).
    `tools_active`: the request has active tools (DSML is tracked, projected and
    parsed; without tools nothing of DSML is interpreted).  `id_prefix`:
    `call_` (OpenAI chat, Responses) or `toolu_` (Anthropic).  `tool_memory`:
    fresh ids are also unique against it.  `think_recovery`, `entities`: see
    `dsml.parse_output`.  `syntaxes`: the DSML block spellings (default V4's;
    DeepSeek V4.1 passes its spaced spelling first).

    `feed(text)` accepts `str` or raw `bytes` (an incremental UTF-8 decoder
    holds incomplete sequences) and returns events; `finish(truncated)` returns
    (events, ParsedOutput)."""

    def __init__(
        self,
        thinking: bool,
        tools_active: bool,
        id_prefix: str = M.OPENAI_TOOL_ID_PREFIX,
        *,
        tool_memory=None,
        think_recovery: bool = True,
        entities: str = "all",
        syntaxes=M.DSML_SYNTAXES,
    ):
        super().__init__(thinking, tools_active, id_prefix, tool_memory)
        self.think_recovery = think_recovery
        self.entities = entities
        self.syntaxes = syntaxes
        self._think_checked = not thinking
        self._r_emit = 0  # reasoning emitted up to (index into raw)
        self._tscan = 0  # next position to search for </think>
        self._c_emit = 0  # content emitted up to
        self._content_start = 0  # where the content region begins (after </think>)
        self._tracker = DecodeTracker(0, syntaxes) if tools_active else None
        self._proj: _Projection | None = None
        self._ids: dict[int, str] = {}
        self._started: set[int] = set()
        self._ended: set[int] = set()
        self._r_begin = 0  # the reasoning body: raw[_r_begin:_r_end]
        self._r_end: int | None = None  # where </think> was found
        self._r_hold: int | None = None  # reasoning held from a block ds4 may recover (think never closed)
        self._invalid_at: int | None = None  # where an invalid block began (the turn ended there)

    # --- public state ------------------------------------------------------------------
    @property
    def structural(self) -> bool:
        """Sample the NEXT token greedily (inside DSML structure, docs/dsml.md §5.1)."""
        tr = self._tracker
        return tr is not None and not self.stop_now and not self._finished and tr.state in (STRUCTURAL, JSON_STRUCTURAL)

    @property
    def decode_state(self) -> str:
        """docs/dsml.md §5.1 decode state of the next token (outside when tools are inactive)."""
        tr = self._tracker
        return tr.state if tr is not None and not self.stop_now else "outside"

    # --- feeding ----------------------------------------------------------------------------
    def stop_after_call(self, events: list) -> None:
        """Stop generating here, the block cut after the calls announced so far (one tool
        call per turn: chat/protocol.FirstCallOnly)."""
        if self._proj is not None and self._proj.cut_calls is None and not self.stop_now:
            self._proj.cut(events, len(self.raw))

    def finish(self, truncated: bool = False) -> tuple[list, ParsedOutput]:
        """End of generation: the final parse, plus the events the stream still owes."""
        events = self._end_feed()
        proj = self._proj
        if self.phase == "tool" and (proj is None or proj.cut_calls is None):
            # the block never closed (EOS, the token limit): the call it was in is not complete,
            # so it is not returned (the stream left it open), and no markup is text (docs/dsml.md §3.1)
            done = [] if proj is None else [(proj.names[i], proj.sent[i]) for i in sorted(self._ended)]
            final = ParsedOutput(
                content=self._streamed_content(),
                reasoning=self._streamed_reasoning(),
                calls=[ParsedCall(name=n, arguments_json=a) for n, a in done],
                raw_dsml=None,
                error=M.PARSE_LIMIT_TOOL_CALL if truncated else M.PARSE_UNTERMINATED_TOOL_CALL,
                finish="length" if truncated else "stop",
            )
            finish_call_events(events, final.calls, self._id_for, self._started, self._ended)
            self.result = final
            return events, final
        if truncated and self.phase == "text" and self.tools_active:
            p = partial_open_at_tail(self.raw, self._c_emit, self.syntaxes)
            if p >= 0:  # the limit cut a block's OPEN: it is markup, not text
                self._stop_at = _rstrip_pos(self.raw, p, self._c_emit)
        raw = self.text
        final = parse_output(
            raw,
            thinking=self.thinking,
            tools_active=self.tools_active,
            truncated=truncated,
            # a block in a reasoning the limit cut is never executed (its calls may be cut too)
            think_recovery=self.think_recovery and not truncated,
            entities=self.entities,
            syntaxes=self.syntaxes,
        )
        if self.phase == "reasoning":
            if final.recovered and final.reasoning is not None:
                self._emit_reasoning(events, self._r_begin + len(final.reasoning))
            elif final.reasoning is not None:  # the final parse found a close the stream did not
                self._end_reasoning(events, self._r_begin + len(final.reasoning))
                self._emit_text(events, self._content_start + len(final.content))
            else:  # never closed: everything is reasoning, streamed and final alike
                self._emit_reasoning(events, len(raw))
                final = replace(final, content="", reasoning=raw[self._r_begin :])
        elif proj is not None and (
            proj.cut_calls is not None
            or (proj.started_any and not (proj.agrees(final.calls) and final.content == self._streamed_content()))
        ):
            if proj.cut_calls is None:  # the final parse disowns an announced call: keep what was sent
                proj.cut(events, len(raw))
            final = self._cut_result(proj.cut_calls)
        elif self.phase == "done" and (final.error is not None or self._invalid_at is not None):
            # a block that does not parse: its markup is never answer text; the engine
            # logs the reason (docs/dsml.md §3.1)
            final = replace(
                final,
                content=self._streamed_content(),
                reasoning=self._streamed_reasoning(),
                calls=[],
                raw_dsml=None,
                error=M.PARSE_INVALID_TOOL_CALL,
                finish="stop",
            )
        elif final.error is not None:  # the block was not DSML after all: the unstreamed tail is text
            self._emit_text(events, len(raw))
            if self._r_end is not None:  # the reasoning stays what was streamed as reasoning
                final = replace(final, content=raw[self._content_start :], reasoning=self._streamed_reasoning())
        elif final.reasoning is not None or not self.thinking:
            # whatever of the final content is still held (whitespace, a possible tag start)
            self._emit_text(events, self._content_start + len(final.content))
        if proj is not None and proj.cut_calls is None:
            proj.complete(events, final.calls)
        finish_call_events(events, final.calls, self._id_for, self._started, self._ended)
        self.result = final
        return events, final

    def _streamed_content(self) -> str:
        return self.raw[self._content_start : self._c_emit]

    def _streamed_reasoning(self) -> str | None:
        return self.raw[self._r_begin : self._r_end] if self._r_end is not None else None

    def _cut_result(self, calls: list) -> ParsedOutput:
        """The answer of a generation whose announced calls were cut short: what the stream sent."""
        return ParsedOutput(
            content=self._streamed_content(),
            reasoning=self._streamed_reasoning(),
            calls=[ParsedCall(name=n, arguments_json=a) for n, a in calls],
            raw_dsml=None,
            error=M.PARSE_CUT_TOOL_CALL,
            finish="tool_calls",
        )

    # --- internals ----------------------------------------------------------------------------
    def _id_for(self, index: int) -> str:
        return tool_id_for(self._ids, index, self.id_prefix, self.tool_memory)

    def _emit_reasoning(self, events: list, limit: int) -> None:
        if limit > self._r_emit:
            events.append(ReasoningDelta(self.raw[self._r_emit : limit]))
            self._r_emit = limit

    def _emit_text(self, events: list, limit: int) -> None:
        if limit > self._c_emit:
            events.append(TextDelta(self.raw[self._c_emit : limit]))
            self._c_emit = limit

    def _step(self, events: list) -> None:
        if self.phase == "reasoning":
            self._reasoning(events)
        if self.phase in ("text", "tool"):
            self._text(events)

    def _end_reasoning(self, events: list, t: int) -> None:
        self._emit_reasoning(events, t)
        self._r_end = t
        self._r_emit = t + len(M.THINK_CLOSE)
        self._c_emit = self._content_start = t + len(M.THINK_CLOSE)
        self.phase = "text"

    def _reasoning(self, events: list) -> None:
        raw = self.raw
        n = len(raw)
        if not self._think_checked:
            if n < len(M.THINK_OPEN) and M.THINK_OPEN.startswith(raw):
                return
            if raw.startswith(M.THINK_OPEN):
                self._r_emit = self._tscan = self._r_begin = len(M.THINK_OPEN)
            self._think_checked = True
            if self._tracker is not None:
                self._tracker.restart(self._r_emit)
        tr = self._tracker
        if tr is None:
            t = raw.find(M.THINK_CLOSE, self._tscan)
            if t >= 0:
                self._end_reasoning(events, t)
                return
            self._tscan = max(self._tscan, n - _THINK_HOLD)
            self._emit_reasoning(events, n - _THINK_HOLD)
            return
        while True:
            tr.update(raw)
            if tr.mode == "search":
                t = raw.find(M.THINK_CLOSE, self._tscan)
                if t >= 0:
                    self._end_reasoning(events, t)
                    tr.restart(self._c_emit)
                    return
                self._tscan = max(self._tscan, n - _THINK_HOLD)
                limit = n - _THINK_HOLD
                p = partial_open_at_tail(raw, self._r_emit, self.syntaxes)
                if p >= 0:
                    limit = min(limit, p)
                if self._r_hold is not None:
                    limit = min(limit, self._r_hold)
                self._emit_reasoning(events, _rstrip_pos(raw, limit, self._r_emit))
                return
            bs = tr.block_start
            t = raw.find(M.THINK_CLOSE, self._tscan, bs + len(M.THINK_CLOSE) - 1)
            if 0 <= t < bs:  # the block is in the answer region; the tracker keeps it
                self._end_reasoning(events, t)
                return
            if tr.mode == "stuck":  # not DSML after all: it is reasoning text
                self._tscan = max(self._tscan, tr.stuck_at)
                tr.restart(tr.stuck_at)
                continue
            if tr.mode == "done":
                # ds4 executes a block written in the reasoning only if the generation
                # ends without </think>: hold it (and what follows) until that is known
                if self.think_recovery and self._r_hold is None and self._has_calls(bs, tr):
                    self._r_hold = bs
                self._tscan = max(self._tscan, tr.block_end)
                tr.restart(tr.block_end)
                continue
            self._tscan = max(self._tscan, bs - _THINK_HOLD)
            limit = min(n - _THINK_HOLD, bs if self._r_hold is None else self._r_hold)
            self._emit_reasoning(events, _rstrip_pos(raw, limit, self._r_emit))
            return

    def _has_calls(self, bs: int, tr: DecodeTracker) -> bool:
        """The complete block at `bs` parses to at least one call (a recovery candidate)."""
        try:
            calls, _ = parse_block(self.raw, bs + len(tr.syn.open), tr.syn, self.entities)
        except ParseFail:
            return False
        return bool(calls)

    def _text(self, events: list) -> None:
        raw = self.raw
        n = len(raw)
        tr = self._tracker
        if tr is None:
            self._emit_text(events, n)
            return
        while True:
            tr.update(raw)
            if tr.mode == "stuck":
                proj = self._proj
                if proj is None and self.phase == "text":  # the block arrived at once: project it up to the garbage
                    self._emit_text(events, _rstrip_pos(raw, tr.block_start, self._c_emit))
                    proj = _Projection(self, tr.block_start, tr.syn)
                if proj is not None and proj.cut_calls is None and not proj.failed:
                    proj.update(raw[: tr.stuck_at], events)  # however the text was split into tokens
                if proj is not None and proj.started_any:  # garbage after an announced call: cut there
                    self._proj = proj
                    self.phase = "tool"
                    if proj.cut_calls is None:
                        proj.cut(events, tr.stuck_at)
                    return
                if tr.syn is M.DSML_PLAIN:  # prose may write `<tool_calls>`: not a block after all
                    self._proj = None
                    self.phase = "text"
                    tr.restart(tr.stuck_at)
                    continue
                # a DSML OPEN followed by what is not DSML: an invalid block, never answer text;
                # the turn ends at it and the final parse reports it (docs/dsml.md §3.1)
                if self.phase == "text":
                    self._emit_text(events, _rstrip_pos(raw, tr.block_start, self._c_emit))
                self._proj = None
                self._invalid_at = tr.block_start
                self.phase = "done"
                self.stop_now = True
                self._stop_at = tr.stuck_at
                return
            if tr.mode == "search":
                if self.phase == "text":
                    p = partial_open_at_tail(raw, self._c_emit, self.syntaxes)
                    self._emit_text(events, _rstrip_pos(raw, p if p >= 0 else n, self._c_emit))
                return
            if self.phase == "text":
                bs = tr.block_start
                self._emit_text(events, _rstrip_pos(raw, bs, self._c_emit))
                self.phase = "tool"
                self._proj = _Projection(self, bs, tr.syn)
            proj = self._proj
            if proj is not None and not proj.failed:
                proj.update(raw, events)
                if proj.cut_calls is not None:
                    return
            if tr.mode == "done":
                self.phase = "done"
                self.stop_now = True
                self._stop_at = tr.block_end
            return


class _Projection:
    """ds4's live tool-call projection (docs/dsml.md §7): OpenAI-style argument
    fragments emitted as the DSML arrives, but only what is certain.  A call is
    announced once its name and first parameter boundary (or its close) are
    parsed; string values stream as they arrive; other values (JSON, loose
    nested parameters) are sent whole once the final parser's rules read them
    the same way.  Before the announcement any unexpected structure stops it
    silently (the final parse decides); after it, `cut` closes the call with the
    arguments sent so far and stops generation, so no announced call is ever
    withdrawn and no markup is streamed as text."""

    def __init__(self, owner: OutputParser, open_pos: int, syn):
        self.o = owner
        self.syn = syn
        self.pos = open_pos + len(syn.open)
        self.state = "invokes"  # invokes | params | value | held | done
        self.index = 0
        self.failed = False
        self.cut_calls: list | None = None  # set by `cut`: the (name, arguments) the stream sent
        self.name = ""
        self.invoke_pos = 0
        self.first = True
        self.is_string = False
        self.held_pos = 0  # held value: its parameter tag
        self.sent: dict[int, str] = {}  # index -> arguments text sent so far
        self.names: dict[int, str] = {}
        self.entity_list = entity_modes(owner.entities, syn)
        self.max_entity = max(len(e) for e in self.entity_list)

    @property
    def started_any(self) -> bool:
        return bool(self.sent)

    def _announce(self, events: list) -> None:
        if self.index not in self.sent:
            o = self.o
            events.append(ToolCallStart(index=self.index, id=o._id_for(self.index), name=self.name))
            o._started.add(self.index)
            self.sent[self.index] = ""
            self.names[self.index] = self.name

    def _delta(self, events: list, text: str) -> None:
        if text:
            events.append(ToolCallDelta(index=self.index, arguments=text))
            self.sent[self.index] += text

    def _value(self, events: list, piece: str) -> None:
        if not piece:
            return
        if self.is_string:
            piece = json_escape_fragment(decode_entities(piece, self.o.entities, self.syn))
        self._delta(events, piece)

    def _end_call(self, events: list, args: str) -> None:
        o = self.o
        events.append(ToolCallEnd(index=self.index, id=o._id_for(self.index), name=self.name, arguments=args))
        o._ended.add(self.index)

    def _fail(self, events: list) -> None:
        """Unexpected structure: silent before any announcement, a cut after one."""
        if self.started_any:
            self.cut(events, len(self.o.raw))
        else:
            self.failed = True

    def cut(self, events: list, at: int) -> None:
        """Close the announced call with the arguments sent so far and stop generating."""
        i = self.index
        if i in self.sent and i not in self.o._ended:
            self._delta(events, ('"' if self.state == "value" and self.is_string else "") + "}")
            self._end_call(events, self.sent[i])
        self.cut_calls = [(self.names[k], self.sent[k]) for k in sorted(self.sent)]
        self.failed = True
        self.state = "done"
        o = self.o
        o.phase = "done"
        o.stop_now = True
        o._stop_at = at

    def agrees(self, calls) -> bool:
        """The final parse's calls extend exactly what the stream announced and sent."""
        for i, sent in self.sent.items():
            if i >= len(calls) or calls[i].name != self.names[i]:
                return False
            args = calls[i].arguments
            if not args.startswith(sent) or (i in self.o._ended and args != sent):
                return False
        return True

    def complete(self, events: list, calls) -> None:
        """At finish (the final parse agrees): send the rest of an announced, unfinished call."""
        for i, sent in self.sent.items():
            if i not in self.o._ended:
                events.append(ToolCallDelta(index=i, arguments=calls[i].arguments[len(sent) :]))
                self.sent[i] = calls[i].arguments

    def update(self, raw: str, events: list) -> None:
        syn = self.syn
        n = len(raw)
        o = self.o
        while not self.failed and self.state != "done":
            if self.state == "value":
                k = raw.find(syn.param_close, self.pos)
                if k >= 0:
                    self._value(events, raw[self.pos : k])
                    self._delta(events, '"')
                    self.pos = k + len(syn.param_close)
                    self.state = "params"
                    continue
                limit = n
                lt = raw.rfind("<", max(self.pos, n - len(syn.param_close) + 1))
                if lt >= 0 and syn.param_close.startswith(raw[lt:]):
                    limit = lt
                amp = raw.rfind("&", max(self.pos, limit - self.max_entity + 1), limit)
                if amp >= 0 and any(len(e) > limit - amp and e.startswith(raw[amp:limit]) for e in self.entity_list):
                    limit = amp
                if limit > self.pos:
                    self._value(events, raw[self.pos : limit])
                    self.pos = limit
                return
            if self.state == "held":
                if not self._held(raw, events):
                    return
                continue
            p = skip_ws(raw, self.pos)
            self.pos = p
            if p >= n:
                return
            if self.state == "invokes":
                if raw.startswith(syn.close, p):
                    self.pos = p + len(syn.close)
                    self.state = "done"
                    return
                if is_partial_marker(raw[p : p + _TAIL], (syn.close, syn.invoke)):
                    return
                if not raw.startswith(syn.invoke, p):
                    self._fail(events)
                    return
                gt = raw.find(">", p)
                if gt < 0:
                    return
                name = attr(raw[p : gt + 1], "name")
                if name is None:
                    self._fail(events)
                    return
                self.name = name
                self.invoke_pos = p
                self.first = True
                self.pos = gt + 1
                self.state = "params"
                continue
            # between parameters
            if raw.startswith(syn.invoke_close, p):
                try:
                    call, _ = parse_invoke(raw, self.invoke_pos, syn, o.entities)
                except ParseFail:
                    self._fail(events)
                    return
                sent = self.sent.get(self.index, "")
                if not call.arguments.startswith(sent):
                    self._fail(events)
                    return
                self._announce(events)
                self._delta(events, call.arguments[len(sent) :])
                self._end_call(events, call.arguments)
                self.index += 1
                self.pos = p + len(syn.invoke_close)
                self.state = "invokes"
                continue
            if is_partial_marker(raw[p : p + _TAIL], (syn.invoke_close, syn.param)):
                return
            if not raw.startswith(syn.param, p):
                self._fail(events)
                return
            gt = raw.find(">", p)
            if gt < 0:
                return
            tag = raw[p : gt + 1]
            pname = attr(tag, "name")
            pstr = attr(tag, "string")
            if pname is None:
                self._fail(events)
                return
            if pstr is None:  # string unless its value is loose nested parameters (as the final parse reads it)
                v = skip_ws(raw, gt + 1)
                if v >= n or is_partial_marker(raw[v : v + _TAIL], (syn.param,)):
                    return
                if raw.startswith(syn.param, v):
                    self.held_pos = p
                    self.state = "held"
                    continue
            if pstr not in (None, "true"):
                self.held_pos = p
                self.state = "held"
                continue
            self._announce(events)
            self.is_string = True
            self._delta(events, "{" if self.first else "")
            self._delta(events, ("" if self.first else ",") + json_escape(pname) + ':"')
            self.first = False
            self.pos = gt + 1
            self.state = "value"

    def _held(self, raw: str, events: list) -> bool:
        """A non-string value: send it once it is complete (False: wait for more text)."""
        syn = self.syn
        p = self.held_pos
        gt = raw.find(">", p)
        pname = attr(raw[p : gt + 1], "name")
        try:
            if attr(raw[p : gt + 1], "string") is None:  # loose nested parameters, read as parse_invoke does
                nested = []
                q = gt + 1
                while True:
                    q = skip_ws(raw, q)
                    if q >= len(raw) or is_partial_marker(raw[q : q + _TAIL], (syn.param, syn.param_close)):
                        return False
                    if not raw.startswith(syn.param, q):
                        break
                    member, q = parse_leaf(raw, q, syn, self.o.entities)
                    nested.append(member)
                value = value_json(nested)
                q2 = skip_ws(raw, q)
                end = q2 + len(syn.param_close) if raw.startswith(syn.param_close, q2) else q
            else:
                member, end = parse_leaf(raw, p, syn, self.o.entities)
                value = value_json([("", member[1], member[2])])
                value = None if value is None else value[len('{"":') : -1]
        except ParseFail as f:
            if f.unterminated:
                return False
            value = None
        if value is None:  # the final parse would not read this value: nothing more is certain
            self._fail(events)
            return False
        self._announce(events)
        self.is_string = False
        self._delta(events, "{" if self.first else "")
        self._delta(events, ("" if self.first else ",") + json_escape(pname) + ":")
        self._delta(events, value)
        self.first = False
        self.pos = end
        self.state = "params"
        return True


class DsmlCalls(CallFormat):
    """The `CallFormat` of DSML blocks: `syntaxes` the block spellings the parsers accept
    (the first is the family's own), `render_calls` the family's renderer."""

    def __init__(self, syntaxes: Sequence[M.DsmlSyntax], render_calls: Callable[[Sequence], str]):
        self.syntaxes = syntaxes
        self._render_calls = render_calls

    def render(self, calls: Sequence) -> str:
        return self._render_calls(calls)

    def parser(self, thinking: bool, tools_active: bool, id_prefix: str, tool_memory, tool_schemas: Sequence[str]):
        return OutputParser(thinking, tools_active, id_prefix, tool_memory=tool_memory, syntaxes=self.syntaxes)

    def parse(self, text: str, thinking: bool, tools_active: bool, truncated: bool, tool_schemas: Sequence[str]):
        return parse_output(
            text, thinking=thinking, tools_active=tools_active, truncated=truncated, syntaxes=self.syntaxes
        )
