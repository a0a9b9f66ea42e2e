"""GLM 5.2 (`glm_moe_dsa`) and GLM 5.3 Flash (`glm5_next`): `[gMASK]<sop>` role
tags, a `Reasoning Effort:` system line, `<tool_call>name<arg_key>k</arg_key>
<arg_value>v</arg_value></tool_call>` calls (seed: ds4's `glm_tool_syntax`; the
templates are tests/data/chat_templates/glm5_next.jinja and glm_moe_dsa.jinja).

Prompt (the template's output; no end-of-turn marker, the next role tag ends a turn):

    [gMASK]<sop><|system|>Reasoning Effort: Max[<|system|>\\n# Tools ... </tool_call>]
    <|system|>SYSTEM<|user|>USER<|assistant|><think>REASONING</think>CONTENT<tool_call>NAME
    <arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call><|observation|>
    <tool_response>RESULT</tool_response><|assistant|><think>

(shown wrapped; no newlines are written between the pieces).  System messages
stay where they are; content is stripped; a string argument is written
verbatim, any other value as JSON.  The two templates differ in four places:

* GLM 5.3 Flash: effort Low / High / Max; every assistant turn keeps its
  reasoning (`clear_thinking` defaults to false); a run of tool results is
  ordered like the calls of the assistant turn before it when every id matches
  one call.  Thinking off renders `<think></think>` after the last
  `<|assistant|>` (the template variants that take `enable_thinking`; the pinned
  5.3 template always opens `<think>`) and keeps the effort line.
* GLM 5.2: effort High / Max only (a request below `high` gets High, the
  lowest rung the template has); only assistant turns after the last user
  message keep their reasoning, earlier ones render `<think></think>`
  (`clear_thinking` undefined); tool results stay in the given order; thinking
  off (`enable_thinking` false) drops the effort line and renders
  `<think></think>` after the last `<|assistant|>`.
"""

from __future__ import annotations

from typing import Any

from .. import markers as M
from ..messages import Conversation
from ..protocol import ChatProtocol, EffortError, register
from . import common as C
from .xmlcalls import CallSyntax, Scan, ThinkStyle, XmlCalls, is_partial, skip_ws

GMASK = "[gMASK]<sop>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
OBSERVATION = "<|observation|>"
ENDOFTEXT = "<|endoftext|>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
ARG_KEY_OPEN = "<arg_key>"
ARG_KEY_CLOSE = "</arg_key>"
ARG_VALUE_OPEN = "<arg_value>"
ARG_VALUE_CLOSE = "</arg_value>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
EFFORT_LINE = "Reasoning Effort: "
TOOLS_HEAD = (
    "\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_TAIL = (
    "</tools>\n\nFor each function call, output the function name and arguments within the following "
    "XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}"
    "</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
)
_SKIPPED_TOOL_KEYS = ("defer_loading", "strict")

_EFFORTS = {
    "low": "low",
    "high": "high",
    "max": "max",
    "xhigh": "max",
    "medium": "max",
    "minimal": "max",
    "none": "none",
}
# GLM 5.2's template knows 'high' and 'max' only (anything else renders Max): the
# requests below max take the lower rung, so a smaller effort never thinks more.
_EFFORTS_52 = {
    "minimal": "high",
    "low": "high",
    "medium": "high",
    "high": "high",
    "max": "max",
    "xhigh": "max",
    "none": "none",
}


class GlmCallSyntax(CallSyntax):
    value_close = ARG_VALUE_CLOSE

    def scan(self, text: str, pos: int) -> Scan:
        n = len(text)
        i = pos + len(TOOL_CALL_OPEN)
        if i < n and text[i] in " \t":  # the name follows the tag directly (a newline at most)
            return Scan("invalid", i)
        k = text.find("<", i)
        if k < 0:  # the name is still being written
            bad = any(c in text[i:].strip() for c in " \t\n\r\v\f>")
            return Scan("invalid" if bad else "partial", n)
        name = text[i:k].strip()
        if not name or any(c in name for c in " \t\n\r\v\f>"):
            return Scan("invalid", k)
        s = Scan("partial", k, name=name)
        i = k
        while True:
            i = skip_ws(text, i)
            s.end = i
            if i >= n:
                return s
            if text.startswith(ARG_KEY_OPEN, i):
                ke = text.find(ARG_KEY_CLOSE, i + len(ARG_KEY_OPEN))
                if ke < 0:
                    lt = text.find("<", i + len(ARG_KEY_OPEN))
                    if lt >= 0 and not is_partial(text[lt:], (ARG_KEY_CLOSE,)):
                        s.status = "invalid"
                    return s
                key = text[i + len(ARG_KEY_OPEN) : ke]
                if "<" in key:
                    s.status = "invalid"
                    return s
                j = skip_ws(text, ke + len(ARG_KEY_CLOSE))
                if j >= n or is_partial(text[j:], (ARG_VALUE_OPEN,)):
                    return s
                if not text.startswith(ARG_VALUE_OPEN, j):
                    s.status = "invalid"
                    return s
                vs = j + len(ARG_VALUE_OPEN)
                ve = text.find(ARG_VALUE_CLOSE, vs)
                if ve < 0:
                    s.in_value, s.value_start = True, vs
                    return s
                s.params.append((key, self.unescape_value(text[vs:ve])))
                i = ve + len(ARG_VALUE_CLOSE)
                continue
            if text.startswith(TOOL_CALL_CLOSE, i):
                s.status, s.end = "complete", i + len(TOOL_CALL_CLOSE)
                return s
            if not is_partial(text[i : i + 16], (ARG_KEY_OPEN, TOOL_CALL_CLOSE)):
                s.status = "invalid"
            return s

    def render_call(self, name: str, args: dict | None, raw_arguments: str) -> str:
        body = "".join(
            ARG_KEY_OPEN + k + ARG_KEY_CLOSE + ARG_VALUE_OPEN + v + ARG_VALUE_CLOSE
            for k, v in self.argument_items(args, raw_arguments)
        )
        return TOOL_CALL_OPEN + name + body + TOOL_CALL_CLOSE


SYNTAX = GlmCallSyntax()
THINK = ThinkStyle(open=M.THINK_OPEN, close=M.THINK_CLOSE, strip_reasoning=False, inline=False)


def _tool_json(schema: str) -> str:
    """The template's `tool_to_json`: the function object's members, `strict` and
    `defer_loading` left out (a tool with `defer_loading` set is not listed)."""
    objs = C.schema_objects([schema])
    if not objs or not isinstance(objs[0], dict):
        return schema
    obj = objs[0]
    return "{" + ", ".join(f'"{k}": {C.tojson(v)}' for k, v in obj.items() if k not in _SKIPPED_TOOL_KEYS) + "}"


def _listed(schema: str) -> bool:
    objs = C.schema_objects([schema])
    return not (objs and isinstance(objs[0], dict) and objs[0].get("defer_loading"))


def _ordered_results(run: list, calls: list) -> list:
    """The template's sort: only when every result id names exactly one call
    and neither side repeats an id; else the given order."""
    ids = [c.id for c in calls]
    rids = [t.tool_id for t in run]
    if (
        not calls
        or not all(ids)
        or len(set(ids)) != len(ids)
        or not all(rids)
        or len(set(rids)) != len(rids)
        or not all(r in ids for r in rids)
    ):
        return run
    by_id = {t.tool_id: t for t in run}
    return [by_id[i] for i in ids if i in by_id]


class GlmProtocol(ChatProtocol):
    family = "glm5_next"
    model_id = "glm-5.3-flash"
    model_name = "GLM 5.3 Flash"
    aliases = ()
    bos = GMASK
    eos = ENDOFTEXT
    stop_strings = (ENDOFTEXT, USER, OBSERVATION)
    special_strings = (
        GMASK,
        SYSTEM,
        USER,
        ASSISTANT,
        OBSERVATION,
        ENDOFTEXT,
        M.THINK_OPEN,
        M.THINK_CLOSE,
        TOOL_CALL_OPEN,
        TOOL_CALL_CLOSE,
        ARG_KEY_OPEN,
        ARG_KEY_CLOSE,
        ARG_VALUE_OPEN,
        ARG_VALUE_CLOSE,
    )
    turn_end = ""
    default_mode = "max"
    call_format = XmlCalls(SYNTAX, THINK)
    efforts = _EFFORTS
    effort_rungs = ("low", "high")  # rendered as given; any other mode renders Max
    thinking_switch = False  # thinking off drops the effort line (5.2's enable_thinking)
    clear_thinking = False  # reasoning only on assistant turns after the last user turn
    sort_results = True  # tool results follow the order of the calls

    def __init__(self, family: str | None = None, model_id: str | None = None, model_name: str | None = None):
        if family:
            self.family = family
        if model_id:
            self.model_id = model_id
        if model_name:
            self.model_name = model_name

    # --- thinking --------------------------------------------------------------------
    def resolve_thinking(
        self, mode: str, effort: Any = None, *, explicit: bool = False, model: str | None = None, ctx: int = 32768
    ) -> str:
        if mode == "none":
            return "none"
        if effort is None:
            return self.default_mode
        if not isinstance(effort, str) or effort not in self.efforts:
            raise EffortError(f"reasoning effort {effort!r} is not supported by {self.model_id}")
        return self.efforts[effort]

    # --- prompts -----------------------------------------------------------------------
    def _head(self, conv: Conversation) -> str:
        mode = conv.thinking
        level = mode if mode in self.effort_rungs else "max"
        out = [GMASK]
        if not (self.thinking_switch and mode == "none"):
            out += [SYSTEM, EFFORT_LINE, level.capitalize()]
        schemas = C.active_schemas(conv)
        if schemas:
            out.append(SYSTEM + TOOLS_HEAD)
            out.extend(_tool_json(s) + "\n" for s in schemas if _listed(s))
            out.append(TOOLS_TAIL)
        return "".join(out)

    def _calls(self, t: C.Turn) -> str:
        if not t.tool_calls:
            return ""
        if t.replay:
            return t.replay
        return SYNTAX.render_calls(t.tool_calls)

    def render_prompt(self, conv: Conversation, tool_memory, generation: bool) -> str:
        ts = C.turns(conv, tool_memory)
        out = [self._head(conv)]
        last_user = max((k for k, t in enumerate(ts) if t.role == "user"), default=-1)
        i = 0
        while i < len(ts):
            t = ts[i]
            if t.role == "user":
                out.append(USER + t.content)
            elif t.role == "system":
                out.append(SYSTEM + t.content)
            elif t.role == "assistant":
                reasoning = t.reasoning if not self.clear_thinking or i > last_user else ""
                out.append(ASSISTANT + M.THINK_OPEN + reasoning + M.THINK_CLOSE + t.content.strip())
                out.append(self._calls(t))
            elif t.role == "tool":
                j = i
                while j < len(ts) and ts[j].role == "tool":
                    j += 1
                prev_calls = ts[i - 1].tool_calls if i > 0 and ts[i - 1].role == "assistant" else []
                out.append(OBSERVATION)
                run = _ordered_results(ts[i:j], prev_calls) if self.sort_results else ts[i:j]
                for r in run:
                    out.append(TOOL_RESPONSE_OPEN + r.content + TOOL_RESPONSE_CLOSE)
                i = j
                continue
            i += 1
        if generation:
            out.append(ASSISTANT + (M.THINK_OPEN + M.THINK_CLOSE if conv.thinking == "none" else M.THINK_OPEN))
        return "".join(out)

    def render_completion(self, prompt: str, thinking: str = "max") -> str:
        from ..messages import Message

        return self.render(Conversation(messages=[Message(role="user", content=prompt)], thinking=thinking))

    # --- tool calls ---------------------------------------------------------------------
    def force_text(self, name: str | None) -> str:
        return TOOL_CALL_OPEN if name is None else TOOL_CALL_OPEN + name


class Glm52Protocol(GlmProtocol):
    """GLM 5.2's template (tests/data/chat_templates/glm_moe_dsa.jinja): two effort
    rungs, an `enable_thinking` switch, `clear_thinking` undefined, no result sort."""

    efforts = _EFFORTS_52
    effort_rungs = ("high",)
    thinking_switch = True
    clear_thinking = True
    sort_results = False


GLM52 = register(Glm52Protocol("glm_moe_dsa", "glm-5.2", "GLM 5.2"))
GLM53 = register(GlmProtocol("glm5_next", "glm-5.3-flash", "GLM 5.3 Flash"))
