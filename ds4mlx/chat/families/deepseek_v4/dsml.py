"""DSML: canonical rendering of tool calls and the final parser (V4's; V4.1 reuses it).

* Rendering (docs/chat-template.md §6, §7): `render_calls`, `escape_tool_result`.
* Final parse of a finished generation (docs/dsml.md §2-4, §6): `parse_output`.
* Forgiving structural recognizer for greedy sampling and stop-at-CLOSE
  (docs/dsml.md §5.1): `DecodeTracker`, which lives in dsml_tracker.py (whitespace,
  entities and attributes in dsml_lex.py) and is re-exported here.

Strings are Python `str`; positions are character indices.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional

from ... import markers as M

# The JSON text helpers (chat/jsontext.py), the lexical primitives (chat/dsml_lex.py) and the
# tracker (chat/dsml_tracker.py) are re-exported: output.py and the tests import them from here.
from ...dsml_lex import C_SPACE, attr, decode_entities, entity_modes, escape_tool_result, rstrip_ws, skip_ws  # noqa: F401
from ...dsml_tracker import (
    JSON_STRING,
    JSON_STRUCTURAL,
    OUTSIDE,
    STRING_BODY,
    STRUCTURAL,  # noqa: F401
    DecodeTracker,
    earliest_open,
    is_partial_marker,
    partial_open_at_tail,
    scan_block,
)
from ...jsontext import (  # noqa: F401
    call_input,
    dumps_canonical,
    dumps_compact,
    json_escape,
    json_escape_fragment,
    json_text,
    minify_json,
    parse_flat_object,
)
from ...markers import DsmlSyntax

__all__ = [
    "ParsedCall",
    "ParsedOutput",
    "parse_output",
    "render_calls",
    "escape_tool_result",
    "attr_escape",
    "strict_call_grammar",
    "param_text",
    "json_literal",
    "decode_entities",
    "json_escape",
    "json_escape_fragment",
    "dumps_compact",
    "dumps_canonical",
    "json_text",
    "parse_flat_object",
    "minify_json",
    "call_input",
    "DecodeTracker",
    "OUTSIDE",
    "STRUCTURAL",
    "STRING_BODY",
    "JSON_STRUCTURAL",
    "JSON_STRING",
]

# =============================================================================
# Rendering (docs/chat-template.md §6, §7)
# =============================================================================

_FULL = M.DSML_FULL


def attr_escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def param_text(s: str) -> str:
    """Parameter text: verbatim except the leading `<` of its own closing tag."""
    return s.replace(_FULL.param_close, M.PARAM_CLOSE_TEXT_ESCAPE + _FULL.param_close[1:])


def json_literal(s: str) -> str:
    """Minified JSON value text; the closing tag's `<` becomes \\u003c."""
    return s.replace(_FULL.param_close, M.PARAM_CLOSE_JSON_ESCAPE + _FULL.param_close[1:])


def _param_open(key: str, is_string: bool) -> str:
    return f'{_FULL.param} name="{attr_escape(key)}" string="{"true" if is_string else "false"}">'


def _param_line(key: str, is_string: bool, body: str) -> str:
    return f"{_param_open(key, is_string)}{body}{_FULL.param_close}\n"


def render_calls(calls: Sequence) -> str:
    """Canonical DSML block for the tool calls of one assistant message ("" if none).

    `calls` are objects with `.name` and `.arguments` (JSON text or free text)."""
    if not calls:
        return ""
    out = [M.DSML_BLOCK_SEPARATOR, _FULL.open, "\n"]
    for call in calls:
        out.append(f'{_FULL.invoke} name="{attr_escape(call.name)}">\n')
        members = parse_flat_object(call.arguments)
        if members is None:
            out.append(_param_line("arguments", True, param_text(call.arguments)))
        else:
            for key, value, is_string in members:
                out.append(_param_line(key, is_string, param_text(value) if is_string else json_literal(value)))
        out.append(_FULL.invoke_close + "\n")
    out.append(_FULL.close)
    return "".join(out)


def strict_call_grammar(tools: dict, named: str | None, literal, json_term) -> str:
    """The Lark grammar of a forced call after its forced head (`force_text`: up to the
    invoke's name, or past its tag when `named`): one invoke whose parameters are the
    schema's properties in order (the required ones present), each a `string="false"`
    JSON value held to its property's schema, then the block's close."""
    rules: list[str] = []

    def arguments(i: int, schema) -> str:
        schema = schema if isinstance(schema, dict) else {}
        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # what $refs point at
        required = set(schema.get("required") or ())
        out = []
        for j, (key, prop) in enumerate((schema.get("properties") or {}).items()):
            rule = f"arg_{i}_{j}"
            prop = {**prop, **defs} if isinstance(prop, dict) else {}
            open_, close = literal(_param_open(key, False)), literal(_FULL.param_close + "\n")
            rules.append(f"{rule}: {open_} {json_term(prop)} {close}")
            out.append(rule if key in required else f"{rule}?")
        return " ".join(out)

    end = literal(_FULL.invoke_close + "\n" + _FULL.close)
    if named is not None:
        start = f"start: {arguments(0, tools[named])} {end}"
    else:
        alternatives = [
            f"({literal(attr_escape(name) + chr(34) + '>' + chr(10))} {arguments(i, schema)} {end})"
            for i, (name, schema) in enumerate(tools.items())
        ]
        start = "start: " + " | ".join(alternatives)
    return "\n".join([start, *rules])


# =============================================================================
# Final parser (docs/dsml.md §2-4, §6)
# =============================================================================


@dataclass
class ParsedCall:
    name: str
    arguments_json: str  # OpenAI-style compact JSON object text (docs/dsml.md §6)
    raw_dsml: str = ""  # the invoke's exact text
    id: str = ""  # call_/toolu_ + 32 hex, assigned by OutputParser.finish

    @property
    def arguments(self) -> str:
        """Alias of `arguments_json` (the OpenAI `function.arguments` string)."""
        return self.arguments_json

    def input(self) -> dict:
        """Arguments as a JSON object (Anthropic `tool_use.input`, Responses tool_search_call)."""
        return call_input(self.arguments_json)


@dataclass
class ParsedOutput:
    content: str
    reasoning: str | None = None
    calls: list[ParsedCall] = field(default_factory=list)
    raw_dsml: str | None = None  # the whole block as sampled (or as repaired); tool memory stores it
    error: str | None = None  # "invalid tool call" / "unterminated tool call" when recovered as text
    finish: str = "stop"  # tool_calls | length | stop
    repaired: bool = False  # truncated block closed by the repair rule
    recovered: bool = False  # block inside an unclosed think block executed (forward recovery)


class ParseFail(Exception):
    def __init__(self, unterminated: bool):
        super().__init__("unterminated" if unterminated else "invalid")
        self.unterminated = unterminated


def value_json(members: list) -> str | None:
    """docs/dsml.md §6 re-serialization of parsed members; None if a JSON value is invalid."""
    parts = []
    for key, kind, value in members:
        if kind == "string":
            v = json_escape(value)
        elif kind == "object":
            v = value_json(value)
        else:
            v = "null" if not value.strip(C_SPACE) else minify_json(value)
        if v is None:
            return None
        parts.append(json_escape(key) + ":" + v)
    return "{" + ",".join(parts) + "}"


def _param_tag(text: str, pos: int) -> tuple[str, str | None, int]:
    """A parameter's open tag at `pos`: its name, its `string` attribute (None: absent) and
    where its value starts."""
    gt = text.find(">", pos)
    if gt < 0:
        raise ParseFail(True)
    tag = text[pos : gt + 1]
    name = attr(tag, "name")
    if name is None:
        raise ParseFail(False)
    return name, attr(tag, "string"), gt + 1


def parse_leaf(text: str, pos: int, syn: DsmlSyntax, entities: str) -> tuple[tuple[str, str, object], int]:
    name, kind, vstart = _param_tag(text, pos)
    vend = text.find(syn.param_close, vstart)
    if vend < 0:
        raise ParseFail(True)
    raw = text[vstart:vend]
    if (kind if kind is not None else "true") == "true":
        member = (name, "string", decode_entities(raw, entities, syn))
    else:
        member = (name, "json", raw)
    return member, vend + len(syn.param_close)


def parse_invoke(text: str, pos: int, syn: DsmlSyntax, entities: str) -> tuple[ParsedCall, int]:
    """Parse one invoke starting at `pos` (at the invoke prefix)."""
    n = len(text)
    start = pos
    gt = text.find(">", pos)
    if gt < 0:
        raise ParseFail(True)
    name = attr(text[pos : gt + 1], "name")
    if name is None:
        raise ParseFail(False)
    pos = gt + 1
    members: list = []
    while True:
        pos = skip_ws(text, pos)
        if text.startswith(syn.invoke_close, pos):
            pos += len(syn.invoke_close)
            break
        if not text.startswith(syn.param, pos):
            raise ParseFail(is_partial_marker(text[pos:], (syn.invoke_close, syn.param)) or pos >= n)
        pname, pkind, vstart = _param_tag(text, pos)
        if pkind is None and text.startswith(syn.param, skip_ws(text, vstart)):
            nested = []
            p = vstart
            while True:
                p = skip_ws(text, p)
                if not text.startswith(syn.param, p):
                    break
                member, p = parse_leaf(text, p, syn, entities)
                nested.append(member)
            members.append((pname, "object", nested))
            p2 = skip_ws(text, p)
            pos = p2 + len(syn.param_close) if text.startswith(syn.param_close, p2) else p
            continue
        member, pos = parse_leaf(text, pos, syn, entities)
        members.append((pname,) + member[1:])
    args = value_json(members)
    return ParsedCall(name=name, arguments_json=args if args is not None else "{}", raw_dsml=text[start:pos]), pos


def parse_block(text: str, pos: int, syn: DsmlSyntax, entities: str) -> tuple[list[ParsedCall], int]:
    """Parse invokes from `pos` (right after OPEN) through CLOSE; returns (calls, end)."""
    n = len(text)
    calls: list[ParsedCall] = []
    while True:
        pos = skip_ws(text, pos)
        if text.startswith(syn.close, pos):
            return calls, pos + len(syn.close)
        if not text.startswith(syn.invoke, pos):
            raise ParseFail(pos >= n or is_partial_marker(text[pos:], (syn.close, syn.invoke)))
        call, pos = parse_invoke(text, pos, syn, entities)
        calls.append(call)


# --- truncation repair (our extension, docs/dsml.md §12 / the issue) ----------------


def _close_json(value: str) -> str:
    """Best-effort completion of a truncated JSON value: close the string, then brackets."""
    stack = []
    in_str = esc = False
    for c in value:
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "[{":
            stack.append("]" if c == "[" else "}")
        elif c in "]}" and stack:
            stack.pop()
    out = value
    if in_str:
        if esc:
            out = out[:-1]
        out += '"'
    else:
        out = out.rstrip(C_SPACE + ",")
        if out.endswith(":"):
            out += "null"
    return out + "".join(reversed(stack))


def _strip_partial(s: str, lit: str) -> str:
    for k in range(len(lit) - 1, 1, -1):
        if s.endswith(lit[:k]):
            return s[:-k]
    return s


def repair_block(block: str, syn: DsmlSyntax) -> str | None:
    """Close a block truncated by the token limit: drop an incomplete trailing
    tag, finish an open value (and its JSON), then close the open parameter /
    invoke / block tags in reverse nesting order.  `block` starts with OPEN.
    None when the text is not DSML-shaped enough to repair."""
    n = len(block)
    pos = len(syn.open)
    stack: list[str] = []  # "invoke" | "outer" (loose nested parameter)

    def closing() -> str:
        tags = [syn.invoke_close if s == "invoke" else syn.param_close for s in reversed(stack)]
        return "\n".join(tags + [syn.close])

    while True:
        pos = skip_ws(block, pos)
        if pos >= n:
            return rstrip_ws(block) + "\n" + closing()
        if block.startswith(syn.close, pos):
            return None  # not truncated
        if block.startswith(syn.invoke_close, pos):
            while stack and stack.pop() != "invoke":
                pass
            pos += len(syn.invoke_close)
            continue
        if block.startswith(syn.param_close, pos) and stack and stack[-1] == "outer":
            stack.pop()
            pos += len(syn.param_close)
            continue
        is_param = block.startswith(syn.param, pos)
        if not is_param and not block.startswith(syn.invoke, pos):
            if is_partial_marker(block[pos:], (syn.close, syn.invoke_close, syn.param_close, syn.invoke, syn.param)):
                return rstrip_ws(block[:pos]) + "\n" + closing()
            return None
        gt = block.find(">", pos)
        if gt < 0:  # incomplete tag: drop it
            return rstrip_ws(block[:pos]) + "\n" + closing()
        if not is_param:
            stack.append("invoke")
            pos = gt + 1
            continue
        kind = attr(block[pos : gt + 1], "string")
        vstart = gt + 1
        after = skip_ws(block, vstart)
        if kind is None and (
            block.startswith(syn.param, after) or (after < n and is_partial_marker(block[after:], (syn.param,)))
        ):
            stack.append("outer")
            pos = vstart
            continue
        vend = block.find(syn.param_close, vstart)
        if vend >= 0:
            pos = vend + len(syn.param_close)
            continue
        value = _strip_partial(block[vstart:], syn.param_close)
        if (kind if kind is not None else "true") != "true":
            value = _close_json(value)
        return block[:vstart] + value + syn.param_close + "\n" + closing()


# --- block selection and the public entry point ----------------------------------


def _blocks(
    text: str, start: int, syntaxes: Sequence[DsmlSyntax] = M.DSML_SYNTAXES
) -> Iterator[tuple[int, DsmlSyntax, str, int]]:
    """The DSML blocks of text[start:] as the streaming tracker sees them, in
    order: earliest OPEN, scanned structurally to its CLOSE (complete), to text
    that is not DSML (stuck; scanning resumes there) or to the end (open).  An
    OPEN inside another block's parameter value is therefore not a block."""
    pos = start
    while True:
        found = earliest_open(text, pos, syntaxes=syntaxes)
        if found is None:
            return
        open_pos, syn = found
        status, end = scan_block(text, open_pos, syntaxes)
        yield open_pos, syn, status, end
        if status == "open":
            return
        pos = end


_SPELLING_RANK = {syn.name: i for i, syn in enumerate(M.DSML_SYNTAXES)}


def _choose_block(text: str, start: int, truncated: bool, syntaxes: Sequence[DsmlSyntax] = M.DSML_SYNTAXES):
    """The block the final parse reads: among the complete blocks, ds4's search
    order (docs/dsml.md §2: full, short, plain spelling; per spelling "\n\n"+OPEN
    before a bare OPEN; then position).  With none complete: the unterminated
    last block when truncated (repair), else ds4's first candidate (which fails).
    With other `syntaxes` their order is the spelling rank."""
    blocks = list(_blocks(text, start, syntaxes))
    rank = _SPELLING_RANK if syntaxes is M.DSML_SYNTAXES else {syn.name: i for i, syn in enumerate(syntaxes)}
    if not blocks:
        return None
    sep = M.DSML_BLOCK_SEPARATOR

    def with_sep(open_pos: int) -> bool:
        return open_pos - len(sep) >= start and text.startswith(sep, open_pos - len(sep))

    def order(b):
        return rank[b[1].name], 0 if with_sep(b[0]) else 1, b[0]

    complete = [b for b in blocks if b[2] == "complete"]
    if complete:
        pick = min(complete, key=order)
    elif truncated and blocks[-1][2] == "open":
        pick = blocks[-1]
    else:
        pick = min(blocks, key=order)
    open_pos, syn = pick[0], pick[1]
    return (open_pos - len(sep) if with_sep(open_pos) else open_pos), open_pos, syn


def reasoning_end(text: str, start: int, syntaxes: Sequence[DsmlSyntax] = M.DSML_SYNTAXES) -> int | None:
    """Position of the `</think>` that ends the reasoning: the first one that is
    not inside a DSML block written in the reasoning (None if there is none)."""
    pos = start
    close = M.THINK_CLOSE
    while True:
        t = text.find(close, pos)
        if t < 0:
            return None
        o = earliest_open(text, pos, t, syntaxes)
        if o is None:
            return t
        status, end = scan_block(text, o[0], syntaxes)
        if status == "open":
            return None
        pos = end


def _finish(truncated: bool) -> str:
    return "length" if truncated else "stop"


def _failed(text: str, truncated: bool, unterminated: bool) -> ParsedOutput:
    return ParsedOutput(
        content=text,
        reasoning=None,
        calls=[],
        raw_dsml=None,
        error=M.PARSE_UNTERMINATED_TOOL_CALL if unterminated else M.PARSE_INVALID_TOOL_CALL,
        finish=_finish(truncated),
    )


def _parse_at(text: str, start: int, open_pos: int, syn: DsmlSyntax, truncated: bool, entities: str):
    """Parse the block at open_pos; returns (calls, raw_dsml, repaired) or a failure ParsedOutput."""
    try:
        calls, end = parse_block(text, open_pos + len(syn.open), syn, entities)
        return calls, text[start:end], False
    except ParseFail as f:
        if not (f.unterminated and truncated):
            return _failed(text, truncated, f.unterminated)
        fixed = repair_block(text[open_pos:], syn)
        if fixed is None:
            return _failed(text, truncated, True)
        try:
            calls, end = parse_block(fixed, len(syn.open), syn, entities)
        except ParseFail:
            return _failed(text, truncated, True)
        return calls, text[start:open_pos] + fixed[:end], True


def _plain(text: str, thinking: bool, truncated: bool) -> ParsedOutput:
    """No DSML handling: only the reasoning split (thinking) or the raw text."""
    if not thinking:
        return ParsedOutput(content=text, finish=_finish(truncated))
    body = len(M.THINK_OPEN) if text.startswith(M.THINK_OPEN) else 0
    t = text.find(M.THINK_CLOSE, body)
    if t < 0:
        return ParsedOutput(content=text, finish=_finish(truncated))
    return ParsedOutput(content=text[t + len(M.THINK_CLOSE) :], reasoning=text[body:t], finish=_finish(truncated))


def parse_output(
    text: str,
    *,
    thinking: bool,
    tools_active: bool = True,
    truncated: bool = False,
    think_recovery: bool = True,
    entities: str = "all",
    syntaxes: Sequence[DsmlSyntax] = M.DSML_SYNTAXES,
) -> ParsedOutput:
    """Final parse of a whole generation into content, reasoning and tool calls.

    `thinking`: the prompt ended with `<think>` (reasoning comes first).
    `tools_active`: the request had active tools; without them no DSML is
    parsed (ds4 parses anyway; see the module report).  `truncated`: generation
    hit the token limit (enables the repair of an unterminated block).
    `think_recovery`: a complete block inside a never-closed think block is
    executed as if `</think>` preceded it.  `entities`: "all" (ds4) or "close"
    (decode only the escaped closing parameter tag in string values).
    `syntaxes`: the block spellings, in search-priority order (default V4's)."""
    if not tools_active:
        return _plain(text, thinking, truncated)
    body = len(M.THINK_OPEN) if thinking and text.startswith(M.THINK_OPEN) else 0
    rend = None
    if thinking:
        rend = reasoning_end(text, body, syntaxes)
        if rend is None:
            if think_recovery:
                rec = _recover_in_think(text, body, truncated, entities, syntaxes)
                if rec is not None:
                    return rec
            return ParsedOutput(content=text, reasoning=None, finish=_finish(truncated))
        region = rend + len(M.THINK_CLOSE)
    else:
        region = 0
    cand = _choose_block(text, region, truncated, syntaxes)
    if cand is None:
        if thinking:
            return ParsedOutput(content=text[region:], reasoning=text[body:rend], finish=_finish(truncated))
        return ParsedOutput(content=text, finish=_finish(truncated))
    start, open_pos, syn = cand
    got = _parse_at(text, start, open_pos, syn, truncated, entities)
    if isinstance(got, ParsedOutput):
        return got
    calls, raw, repaired = got
    content = rstrip_ws(text[region:start])
    return ParsedOutput(
        content=content,
        reasoning=text[body:rend] if thinking else None,
        calls=calls,
        raw_dsml=raw,
        finish="tool_calls" if calls else _finish(truncated),
        repaired=repaired,
    )


def _recover_in_think(
    text: str, body: int, truncated: bool, entities: str, syntaxes: Sequence[DsmlSyntax] = M.DSML_SYNTAXES
) -> ParsedOutput | None:
    """Forward recovery: the first complete block with calls inside an unclosed
    think block (or, when truncated, an unterminated last one) is parsed as if
    `</think>` had been written right before it."""
    sep = M.DSML_BLOCK_SEPARATOR
    for open_pos, syn, status, _end in _blocks(text, body, syntaxes):
        if status == "stuck":
            continue
        if status == "open" and not truncated:
            return None
        start = (
            open_pos - len(sep)
            if open_pos - len(sep) >= body and text.startswith(sep, open_pos - len(sep))
            else open_pos
        )
        got = _parse_at(text, start, open_pos, syn, truncated, entities)
        if not isinstance(got, ParsedOutput) and got[0]:
            calls, raw, repaired = got
            return ParsedOutput(
                content="",
                reasoning=rstrip_ws(text[body:start]),
                calls=calls,
                raw_dsml=raw,
                finish="tool_calls",
                repaired=repaired,
                recovered=True,
            )
        if status == "open":
            return None
    return None
