"""API request bodies -> `Conversation` (docs/chat-template.md §2, §3, §4.3).

Input is the already-parsed JSON body (a dict).  Every invalid shape raises
`RequestError(message, status=400, param=None)` with ds4's message; the HTTP
layer maps it onto each API's error shape.

JSON that ds4 copies into the prompt as the client's exact source bytes
(tool schemas, raw tool outputs) is re-serialized from the parsed value, in one
of two styles (the `json_style` argument):
  * "canonical" (default, our issue): key order kept, Python's default
    separators (", " / ": "), raw UTF-8 instead of \\u escapes, so semantically
    equal requests give byte-equal prompts;
  * "compact": no spaces, raw UTF-8; reproduces ds4's verbatim copy whenever the
    client sent compact JSON without \\u escapes.
Tool-call arguments given as JSON values (not strings) are always kept in the
compact form (canonical DSML rendering minifies them anyway).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import markers as M
from .families.deepseek_v4.dsml import dumps_compact, escape_tool_result, json_text
from .families.deepseek_v4.template import render_completion
from .messages import Conversation, Message, ToolAlias, ToolCall

__all__ = [
    "RequestError",
    "parse_chat",
    "parse_anthropic",
    "parse_responses",
    "parse_completion",
    "parse_request",
    "CompletionRequest",
    "parse_stop",
    "resolve_thinking",
    "flatten_content",
    "parse_tools",
    "unreplayed_tool_result_ids",
    "VALID_ROLES",
    "DEFAULT_MODEL",
]

DEFAULT_MODEL = "deepseek-v4-flash"
VALID_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# "minimal" is OpenAI's way of saying (almost) no reasoning: off (#17)
_EFFORTS = {
    "max": "max",
    "xhigh": "high",
    "high": "high",
    "medium": "high",
    "low": "high",
    "minimal": "none",
    "none": "none",
}
_DEFAULT_PARAMETERS = {"type": "object", "properties": {}}
_SUMMARY_OPT_IN = ("auto", "concise", "detailed")
_ITEM_STATUSES = ("completed", "incomplete")  # what the server emits
_RESPONSES_TEXT_TYPES = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_HOSTED_CALLS = {
    "local_shell_call": "local_shell",
    "web_search_call": "web_search_call",
    "tool_search_call": "tool_search",
    "image_generation_call": "image_generation_call",
}
_HOSTED_OUTPUTS = (
    "local_shell_call_output",
    "web_search_call_output",
    "tool_search_output",
    "tool_search_call_output",
    "image_generation_call_output",
)


class RequestError(Exception):
    """A request the server refuses (HTTP 4xx)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


def _bad() -> RequestError:
    return RequestError(M.ERR_INVALID_JSON)


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise _bad()
    return v


def _check_role(role: str) -> str:
    if role not in VALID_ROLES:
        raise RequestError(M.ERR_UNKNOWN_ROLE.format(role=role), param="messages")
    return role


# --- content ---------------------------------------------------------------------


def flatten_content(v: Any) -> str:
    """docs/chat-template.md §2.1: string; null -> ""; array -> strings and every
    object's "text" (must be a string) concatenated; any other value -> ""."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        parts = []
        for e in v:
            if isinstance(e, str):
                parts.append(e)
            elif isinstance(e, dict) and "text" in e:
                parts.append(_str(e["text"]))
        return "".join(parts)
    return ""


def _responses_content(v: Any) -> str:
    """Strict Responses content (docs/chat-template.md §2.3)."""
    if isinstance(v, str):
        return v
    if v is None:
        return ""
    if not isinstance(v, list):
        raise _bad()
    parts = []
    for e in v:
        if isinstance(e, str):
            parts.append(e)
            continue
        if not isinstance(e, dict):
            raise _bad()
        typ = e.get("type")
        if typ is not None and not isinstance(typ, str):
            raise _bad()
        if typ not in _RESPONSES_TEXT_TYPES or "text" not in e:
            raise _bad()
        text = e["text"]
        parts.append("" if text is None else _str(text))
    return "".join(parts)


# --- thinking (docs/chat-template.md §3) ----------------------------------------------------


@dataclass
class _Thinking:
    enabled: bool = True
    explicit: bool = False
    effort: str = "high"

    def control(self, v: Any) -> None:
        """`thinking`: bool, null, {"type": "enabled"|"disabled", ...} or anything (explicit)."""
        self.explicit = True
        if isinstance(v, bool):
            self.enabled = v
        elif isinstance(v, dict) and "type" in v:
            typ = _str(v["type"])
            if typ in ("enabled", "adaptive"):
                self.enabled = True
            elif typ == "disabled":
                self.enabled = False
            budget = v.get("budget_tokens")
            if isinstance(budget, int) and not isinstance(budget, bool) and budget <= 0:
                self.enabled = False  # a thinking budget of 0 is off

    def think(self, v: Any) -> None:
        if not isinstance(v, bool):
            raise _bad()
        self.explicit = True
        self.enabled = v

    def set_effort(self, v: Any, field: str = "reasoning_effort") -> bool:
        """reasoning_effort-style value; returns True if it carried a value."""
        if v is None:
            return False
        if not isinstance(v, str) or v not in _EFFORTS:
            raise RequestError(M.ERR_INVALID_JSON, param=field)
        self.effort = _EFFORTS[v]
        return True

    def resolve(self, model: str, ctx: int) -> str:
        return resolve_thinking(self.enabled, self.effort, explicit=self.explicit, model=model, ctx=ctx)


def resolve_thinking(
    enabled: bool = True, effort: str = "high", *, explicit: bool = False, model: str | None = None, ctx: int = 32768
) -> str:
    """Final mode none | high | max (docs/chat-template.md §3 steps 4-5)."""
    if not explicit:
        if model == "deepseek-chat":
            enabled = False
        elif model == "deepseek-reasoner":
            enabled = True
    if not enabled or effort == "none":
        return "none"
    if effort == "max":
        return "max" if ctx >= M.THINK_MAX_MIN_CONTEXT else "high"
    return "high"


# --- stop -------------------------------------------------------------------------


def parse_stop(v: Any) -> list[str]:
    """`stop` / `stop_sequences`: a string or an array of strings; non-strings and
    empty strings are skipped, any other value means no stops."""
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list):
        return [s for s in v if isinstance(s, str) and s]
    return []


# --- tools (docs/chat-template.md §2.4) --------------------------------------------------------


def _opt_str(d: dict, key: str) -> str | None:
    """Member as string; None if absent; raises _Skip if present but not a string."""
    if key not in d:
        return None
    v = d[key]
    if not isinstance(v, str):
        raise _Skip()
    return v


class _Skip(Exception):
    pass


def _namespace_schemas(tool: dict, style: str, aliases: dict) -> list[str]:
    try:
        typ = _opt_str(tool, "type")
        ns = _opt_str(tool, "name")
    except _Skip:
        return []
    inner = tool.get("tools")
    if typ != "namespace" or ns is None or not isinstance(inner, list):
        return []
    out = []
    for t in inner:
        if not isinstance(t, dict):
            continue
        try:
            ttyp = _opt_str(t, "type")
            name = _opt_str(t, "name")
            desc = _opt_str(t, "description")
        except _Skip:
            continue
        params = _DEFAULT_PARAMETERS
        for key in ("parameters", "input_schema"):  # last one present wins, as in ds4
            if key in t:
                params = t[key]
        if (ttyp is None or ttyp == "function") and name:
            out.append(json_text({"name": ns + name, "description": desc or "", "parameters": params}, style))
            aliases[ns + name] = ToolAlias(name=name, namespace=ns)
    return out


def _tool_search_schema(tool: dict, style: str) -> str | None:
    try:
        typ = _opt_str(tool, "type")
        desc = _opt_str(tool, "description")
    except _Skip:
        return None
    if typ != "tool_search":
        return None
    params = tool.get("parameters", _DEFAULT_PARAMETERS)
    return json_text(
        {
            "name": "tool_search",
            "description": desc if desc is not None else "Search available tools.",
            "parameters": params,
        },
        style,
    )


def parse_tools(v: Any, style: str = "canonical") -> tuple[list[str], dict[str, ToolAlias]]:
    """`tools` -> (schema lines, DSML-name aliases).  null -> no tools."""
    if v is None:
        return [], {}
    if not isinstance(v, list):
        raise _bad()
    schemas: list[str] = []
    aliases: dict[str, ToolAlias] = {}
    for tool in v:
        if isinstance(tool, dict) and "function" in tool:
            schemas.append(json_text(tool["function"], style))
            continue
        if isinstance(tool, dict):
            inner = _namespace_schemas(tool, style, aliases)
            if inner:
                schemas.extend(inner)
                continue
            special = _tool_search_schema(tool, style)
            if special is not None:
                schemas.append(special)
                aliases["tool_search"] = ToolAlias(name="tool_search", hosted_tool_search=True)
                continue
        schemas.append(json_text(tool, style))
    return [s for s in schemas if s], aliases


# --- OpenAI chat (docs/chat-template.md §2.1) -------------------------------------------------


def _chat_tool_calls(v: Any) -> list[ToolCall]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise _bad()
    calls = []
    for e in v:
        if not isinstance(e, dict):
            raise _bad()
        cid = ""
        name = args = None
        for k, val in e.items():
            if k == "id":
                cid = _str(val)
            elif k == "function":
                if not isinstance(val, dict):
                    raise _bad()
                for fk, fv in val.items():
                    if fk == "name":
                        name = _str(fv)
                    elif fk == "arguments":
                        args = fv if isinstance(fv, str) else dumps_compact(fv)
        if name is not None and args is not None:
            calls.append(ToolCall(id=cid, name=name, arguments=args))
    return calls


def _add_id(ids: list[str], i: str | None) -> None:
    if i and i not in ids:
        ids.append(i)


def _chat_message(obj: Any) -> Message:
    if not isinstance(obj, dict):
        raise _bad()
    m = Message(role="user")
    for k, v in obj.items():
        if k == "role":
            m.role = _str(v)
        elif k == "content":
            m.content = flatten_content(v)
        elif k == "reasoning_content":
            m.reasoning = flatten_content(v)
        elif k == "tool_call_id":
            _add_id(m.tool_call_ids, _str(v))
        elif k == "tool_calls":
            m.tool_calls = _chat_tool_calls(v)
    return m


def _messages(v: Any, parse_one) -> list[Message]:
    if not isinstance(v, list):
        raise _bad()
    return [parse_one(e) for e in v]


def _finish(conv: Conversation, model: str, th: _Thinking, ctx: int) -> Conversation:
    conv.model = model
    conv.thinking = th.resolve(model, ctx)
    conv.tools_active = conv.tools_active and bool(conv.tool_schemas)
    return conv


def _require_messages(msgs: list[Message] | None, strict: bool) -> list[Message]:
    if msgs is None:
        raise RequestError(M.ERR_MISSING_MESSAGES, param="messages")
    if strict:
        if not msgs:
            raise RequestError(M.ERR_EMPTY_MESSAGES, param="messages")
        for m in msgs:
            _check_role(m.role)
    return msgs


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise _bad()
    return body


def parse_chat(body: Any, *, ctx: int = 32768, json_style: str = "canonical", strict: bool = True) -> Conversation:
    """POST /v1/chat/completions body -> Conversation.

    `strict` (our issue): empty `messages` and unknown roles are 400s; with
    strict=False they are accepted like ds4 (unknown roles render nothing)."""
    body = _object(body)
    th = _Thinking()
    msgs = None
    schemas: list[str] = []
    aliases: dict = {}
    tool_choice_none = False
    model = DEFAULT_MODEL
    stop: list[str] = []
    for k, v in body.items():
        if k == "messages":
            msgs = _messages(v, _chat_message)
        elif k == "tools":
            schemas, aliases = parse_tools(v, json_style)
        elif k == "tool_choice":
            tool_choice_none = isinstance(v, str) and v == "none"
        elif k == "model":
            model = _str(v)
        elif k == "thinking":
            th.control(v)
        elif k == "think":
            th.think(v)
        elif k == "reasoning_effort":
            th.set_effort(v)
        elif k == "stop":
            stop = parse_stop(v)
    conv = Conversation(
        messages=_require_messages(msgs, strict),
        tool_schemas=schemas,
        tools_active=not tool_choice_none,
        api="openai",
        stop=stop,
        tool_aliases=aliases,
    )
    return _finish(conv, model, th, ctx)


# --- Anthropic (docs/chat-template.md §2.2) ---------------------------------------------------


def _anthropic_block(b: dict, m: Message) -> None:
    typ = text = thinking = bid = name = result = None
    has_input = False
    inp = None
    for k, v in b.items():
        if k == "type":
            typ = _str(v)
        elif k == "text":
            text = flatten_content(v)
        elif k == "thinking":
            thinking = flatten_content(v)
        elif k in ("id", "tool_use_id"):
            bid = _str(v)
        elif k == "name":
            name = _str(v)
        elif k == "input":
            has_input, inp = True, v
        elif k == "content":
            result = flatten_content(v)
    if typ == "tool_use":
        m.tool_calls.append(
            ToolCall(id=bid or "", name=name or "", arguments=dumps_compact(inp) if has_input else "{}")
        )
    elif typ == "tool_result":
        _add_id(m.tool_call_ids, bid)
        start = len(m.content)
        m.content += M.TOOL_RESULT_OPEN + escape_tool_result(result or "") + M.TOOL_RESULT_CLOSE
        m.result_spans.append((start, len(m.content), bid or ""))
    else:
        if text:
            m.content += text
        if thinking:
            m.reasoning += thinking


def _anthropic_message(obj: Any) -> Message:
    if not isinstance(obj, dict):
        raise _bad()
    m = Message(role="user")
    for k, v in obj.items():
        if k == "role":
            m.role = _str(v)
        elif k == "content":
            m.content, m.reasoning, m.tool_calls, m.tool_call_ids, m.result_spans = "", "", [], [], []
            if isinstance(v, str):
                m.content = v
            elif isinstance(v, list):
                for e in v:
                    if isinstance(e, str):
                        m.content += e
                    elif isinstance(e, dict):
                        _anthropic_block(e, m)
    return m


def _anthropic_system(v: Any) -> str:
    parts: list[str] = []

    def add(s: str) -> None:
        if not s or s.startswith("x-anthropic-"):
            return
        if parts and not parts[-1].endswith("\n"):
            parts.append("\n")
        parts.append(s)

    if isinstance(v, str):
        add(v)
    elif isinstance(v, list):
        for e in v:
            if isinstance(e, str):
                add(e)
            elif isinstance(e, dict) and "text" in e:
                add(_str(e["text"]))
    return "".join(parts)


def parse_anthropic(body: Any, *, ctx: int = 32768, json_style: str = "canonical", strict: bool = True) -> Conversation:
    """POST /v1/messages body -> Conversation (the system text becomes a trailing system message).
    Thinking is off unless `thinking` turns it on or an effort is named (Anthropic's
    default is off; Claude Code with MAX_THINKING_TOKENS=0 sends neither; #17)."""
    body = _object(body)
    th = _Thinking(enabled=False)
    effort_named = False
    msgs = None
    system = ""
    schemas: list[str] = []
    aliases: dict = {}
    tool_choice_none = False
    model = DEFAULT_MODEL
    stop: list[str] = []
    for k, v in body.items():
        if k == "messages":
            msgs = _messages(v, _anthropic_message)
        elif k == "system":
            system = _anthropic_system(v)
        elif k == "tools":
            schemas, aliases = parse_tools(v, json_style)
        elif k == "tool_choice":
            if isinstance(v, dict):
                tool_choice_none = "type" in v and _str(v["type"]) == "none"
        elif k == "model":
            model = _str(v)
        elif k == "thinking":
            th.control(v)
        elif k == "output_config":
            if isinstance(v, dict) and "effort" in v:
                effort_named = th.set_effort(v["effort"], "output_config.effort") or effort_named
        elif k == "reasoning_effort":
            effort_named = th.set_effort(v) or effort_named
        elif k == "stop_sequences":
            stop = parse_stop(v)
    if effort_named and "thinking" not in body:
        th.enabled = True
    msgs = _require_messages(msgs, strict)
    if system:
        msgs.append(Message(role="system", content=system))
    conv = Conversation(
        messages=msgs,
        tool_schemas=schemas,
        tools_active=not tool_choice_none,
        api="anthropic",
        stop=stop,
        tool_aliases=aliases,
    )
    return _finish(conv, model, th, ctx)


# --- Responses (docs/chat-template.md §2.3) ---------------------------------------------------


def _assistant_for_call(msgs: list[Message], pending: list[str]) -> Message:
    last = msgs[-1] if msgs else None
    if last is not None and last.role == "assistant":
        if pending and not last.reasoning:
            last.reasoning = "\n".join(pending)
            pending.clear()
        return last
    m = Message(role="assistant", content="")
    if pending:
        m.reasoning = "\n".join(pending)
        pending.clear()
    msgs.append(m)
    return m


def _responses_input(items: list, style: str, loaded: list[str], aliases: dict, strict: bool) -> list[Message]:
    msgs: list[Message] = []
    pending: list[str] = []
    for item in items:
        if not isinstance(item, dict):
            raise _bad()
        f: dict[str, Any] = {}
        for k, v in item.items():
            if k in ("type", "role", "name", "namespace", "call_id", "id", "status"):
                f[k] = _str(v)
            elif k in ("content", "summary"):
                f[k] = _responses_content(v)
            elif k in ("arguments", "input", "action"):
                f[k] = v if isinstance(v, str) and k != "action" else dumps_compact(v)
            elif k == "output":
                if isinstance(v, list):
                    f[k] = _responses_content(v)
                else:
                    f[k] = v if isinstance(v, str) else json_text(v, style)
            elif k == "result":
                f[k] = v if isinstance(v, str) else json_text(v, style)
            elif k == "tools":
                f[k] = v
        t = f.get("type", "message")
        status = f.get("status")
        if status and status not in _ITEM_STATUSES:  # the server's own items replay as they were emitted
            raise _bad()
        consumes = (
            (t == "message" and f.get("role") == "assistant")
            or t in ("function_call", "custom_tool_call")
            or t in _HOSTED_CALLS
        )
        bookkeeping = t in ("compaction", "context_compaction")
        if not consumes and not bookkeeping and pending:
            msgs.append(Message(role="assistant", content="", reasoning="\n".join(pending)))
            pending.clear()
        if t == "message":
            role = f.get("role", "user")
            m = Message(role=_check_role(role) if strict else role, content=f.get("content", ""))
            if m.role == "assistant" and pending:
                m.reasoning = "\n".join(pending)
                pending.clear()
            msgs.append(m)
        elif t in ("function_call", "custom_tool_call") or t in _HOSTED_CALLS:
            cid = f.get("call_id", f.get("id", ""))
            if t in _HOSTED_CALLS:
                name = _HOSTED_CALLS[t]
                args = next((f[k] for k in ("action", "arguments", "input") if k in f), "{}")
            else:
                name = f.get("name", "")
                ns = f.get("namespace")
                if t == "function_call" and ns and name:
                    name = ns + name
                args = next((f[k] for k in ("arguments", "input") if k in f), "{}")
            _assistant_for_call(msgs, pending).tool_calls.append(ToolCall(id=cid, name=name, arguments=args))
        elif t == "reasoning":
            for key in ("summary", "content"):
                if f.get(key):
                    pending.append(f[key])
        elif t in ("function_call_output", "custom_tool_call_output") or t in _HOSTED_OUTPUTS:
            m = Message(role="tool")
            if t in _HOSTED_OUTPUTS:
                if t == "tool_search_output" and "tools" in f:
                    more, more_aliases = parse_tools(f["tools"], style)
                    loaded.extend(more)
                    aliases.update(more_aliases)
                if "output" in f:
                    m.content = f["output"]
                elif "result" in f:
                    m.content = f["result"]
                elif "tools" in f:
                    m.content = json_text(f["tools"], style)
            else:
                m.content = f.get("output", "")
            _add_id(m.tool_call_ids, f.get("call_id", f.get("id")))
            msgs.append(m)
        elif not bookkeeping:
            raise _bad()
    if pending:
        msgs.append(Message(role="assistant", content="", reasoning="\n".join(pending)))
    return msgs


def parse_responses(body: Any, *, ctx: int = 32768, json_style: str = "canonical", strict: bool = True) -> Conversation:
    """POST /v1/responses body -> Conversation."""
    body = _object(body)
    th = _Thinking()
    msgs = None
    instructions = ""
    schemas: list[str] = []
    loaded: list[str] = []
    aliases: dict = {}
    loaded_aliases: dict = {}
    tool_choice_none = False
    model = DEFAULT_MODEL
    summary = False
    stop: list[str] = []
    for k, v in body.items():
        if k == "input":
            loaded, loaded_aliases = [], {}
            if isinstance(v, str):
                msgs = [Message(role="user", content=v)]
            elif isinstance(v, list):
                msgs = _responses_input(v, json_style, loaded, loaded_aliases, strict)
            else:
                raise _bad()
        elif k == "instructions":
            instructions = "" if v is None else _str(v)
        elif k == "tools":
            schemas, aliases = parse_tools(v, json_style)
        elif k == "tool_choice":
            if isinstance(v, str):
                if v == "none":
                    tool_choice_none = True
                elif v not in ("auto", "required"):  # required: serve/build.py forces the call
                    raise RequestError(M.ERR_TOOL_CHOICE.format(value=v), param="tool_choice")
            elif isinstance(v, dict) and v.get("type") != "function":
                raise RequestError(M.ERR_FORCED_TOOL_CHOICE, param="tool_choice")
        elif k == "stop":  # not an OpenAI Responses field: a ds4mlx extension, as on chat
            stop = parse_stop(v)
        elif k == "model":
            model = _str(v)
        elif k == "reasoning":
            if isinstance(v, dict):
                for rk, rv in v.items():
                    if rk == "effort":
                        if th.set_effort(rv, "reasoning.effort"):
                            th.explicit = True
                            if th.effort == "none":
                                th.enabled = False
                    elif rk == "summary":
                        if isinstance(rv, str) and rv in _SUMMARY_OPT_IN:
                            summary = True
        elif k in ("previous_response_id", "conversation"):
            if v is not None:
                raise RequestError(M.ERR_DURABLE_STATE.format(field=k), param=k)
    if msgs is None:
        raise RequestError(M.ERR_MISSING_INPUT, param="input")
    if instructions:
        msgs.insert(0, Message(role="system", content=instructions))
    all_aliases = dict(aliases)
    all_aliases.update(loaded_aliases)
    conv = Conversation(
        messages=msgs,
        tool_schemas=schemas + loaded,
        tools_active=not tool_choice_none,
        api="responses",
        tool_aliases=all_aliases,
        reasoning_summary=summary,
        stop=stop,
    )
    return _finish(conv, model, th, ctx)


# --- legacy completions (docs/chat-template.md §4.3) -------------------------------------------


@dataclass
class CompletionRequest:
    prompt: str
    thinking: str = "high"
    model: str = DEFAULT_MODEL
    stop: list[str] = field(default_factory=list)

    def render(self) -> str:
        return render_completion(self.prompt, self.thinking)


def parse_completion(body: Any, *, ctx: int = 32768) -> CompletionRequest:
    """POST /v1/completions body -> CompletionRequest."""
    body = _object(body)
    th = _Thinking()
    prompt = None
    model = DEFAULT_MODEL
    stop: list[str] = []
    for k, v in body.items():
        if k == "prompt":
            if isinstance(v, str):
                prompt = v
            elif isinstance(v, list):
                prompt = v[0] if v and isinstance(v[0], str) else ""
            else:
                prompt = ""
        elif k == "model":
            model = _str(v)
        elif k == "thinking":
            th.control(v)
        elif k == "think":
            th.think(v)
        elif k == "reasoning_effort":
            th.set_effort(v)
        elif k == "stop":
            stop = parse_stop(v)
    if prompt is None:
        raise RequestError(M.ERR_MISSING_PROMPT, param="prompt")
    return CompletionRequest(prompt=prompt, thinking=th.resolve(model, ctx), model=model, stop=stop)


def parse_request(api: str, body: Any, *, ctx: int = 32768, json_style: str = "canonical", strict: bool = True):
    """Dispatch on api: openai | anthropic | responses | completions."""
    if api == "openai":
        return parse_chat(body, ctx=ctx, json_style=json_style, strict=strict)
    if api == "anthropic":
        return parse_anthropic(body, ctx=ctx, json_style=json_style, strict=strict)
    if api == "responses":
        return parse_responses(body, ctx=ctx, json_style=json_style, strict=strict)
    if api == "completions":
        return parse_completion(body, ctx=ctx)
    raise ValueError(f"unknown api {api!r}")


# --- continuation validation helpers (docs/http-api.md §1.6) ------------------------------------


def unreplayed_tool_result_ids(conv: Conversation) -> list[str]:
    """Tool-result ids with no earlier assistant call of that id in the request.

    Each must belong to the live tool-call turn, otherwise the HTTP layer answers
    400 (`ERR_RESPONSES_UNKNOWN_CALL` / `ERR_ANTHROPIC_UNKNOWN_CALL`).  Responses
    checks tool messages, Anthropic user messages carrying tool_result ids."""
    out: list[str] = []
    seen_calls: set[str] = set()
    for m in conv.messages:
        carries = (
            (m.role in ("tool", "function"))
            if conv.api == "responses"
            else (m.role == "user" if conv.api == "anthropic" else False)
        )
        if carries:
            for i in m.tool_call_ids:
                if i not in seen_calls and i not in out:
                    out.append(i)
        if m.role == "assistant":
            seen_calls.update(c.id for c in m.tool_calls if c.id)
    return out
