"""DeepSeek V4.1 Flash (`deepseek_v41`): one merged `<｜System｜>` after BOS
holding the reasoning effort and the tools, user-side turns welded with
"\\n\\n" (tool results are `<tool_result>` blocks of the user turn, in call
order), the spaced DSML spelling, numeric reasoning effort 1..100 (docs/chat-families.md §2
and the think-level paragraph).  The bytes are those of DeepSeek's V4.1
`encoding.py` (`encode_messages`) as ds4 drives it; tests/test_protocol_deepseek_v41.py
checks them against golden prompts rendered by that encoder
(tests/data/chat_templates/SOURCES.md).

    <｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value,
    the more thorough the reasoning)\\n\\nSYSTEM\\n\\n## Tools ... tool calls.\\n
    <｜User｜>USER<｜Assistant｜><think>REASONING</think>CONTENT\\n\\n<｜DSML｜ calls>\\n
    <｜DSML｜ invoke name="NAME">\\n<｜DSML｜ parameter name="K" string="true">V</｜DSML｜ parameter>\\n
    </｜DSML｜ invoke>\\n</｜DSML｜ calls><｜end▁of▁sentence｜><｜User｜><tool_result>R</tool_result>
    <｜Assistant｜><think>

(shown wrapped).  Thinking modes: "none" (chat mode: `</think>` after each
`<｜Assistant｜>`, no effort line) or a level "1".."100" (`--think-level`;
named efforts: low 50, medium 62, high 75 = default, max/xhigh 100; low, high
and max are ds4's presets -- the encoder copy the tests use maps low 25, high 50,
xhigh 75).  With tool context (tools, tool calls or results: the encoder's
`drop_thinking=False`, as ds4 passes it) every assistant turn keeps
`<think>REASONING</think>`.  Without it old reasoning is dropped: a turn
before the last user (or later system) message renders `<｜Assistant｜></think>
CONTENT` -- the shape the engine's thinking checkpoint rebinds to.  A later
system message is a mid-conversation `<｜System｜>` turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import markers as M
from ..messages import Conversation, Message
from ..protocol import ChatProtocol, EffortError, register
from . import common as C
from .deepseek_v4.output import DsmlCalls

SYSTEM = "<｜System｜>"
SYN = M.DSML_SPACED
SYNTAXES = M.DSML_SYNTAXES_V41
EFFORT_TEXT = "Reasoning Effort: {level} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
DEFAULT_LEVEL = 75
NAMED_LEVELS = {"low": 50, "minimal": 50, "medium": 62, "high": 75, "xhigh": 100, "max": 100}
MAX_LEVEL = 100

TOOLS_TEXT = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing "
    f'a "{SYN.open}" block like the following:\n\n'
    f"{SYN.open}\n"
    f'{SYN.invoke} name="$TOOL_NAME">\n'
    f'{SYN.param} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{SYN.param_close}\n'
    "...\n"
    f"{SYN.invoke_close}\n"
    f'{SYN.invoke} name="$TOOL_NAME2">\n'
    "...\n"
    f"{SYN.invoke_close}\n"
    f"{SYN.close}\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)


def level_of(mode: str) -> int | None:
    """The numeric level of a thinking mode (None: thinking off)."""
    if mode == "none":
        return None
    if mode.isdigit():
        return int(mode)
    return NAMED_LEVELS.get(mode, DEFAULT_LEVEL)


def parse_level(value: Any) -> int:
    """A numeric reasoning effort / think level: 0..100 as int or digit string."""
    if isinstance(value, bool):
        raise EffortError(f"invalid reasoning effort {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and value.isascii() and value.isdigit():
        n = int(value)
    else:
        raise EffortError(f"invalid reasoning effort {value!r}: expected 0..100")
    if not 0 <= n <= MAX_LEVEL:
        raise EffortError(f"invalid reasoning effort {value!r}: expected 0..100")
    return n


def _tools_text(schemas: Sequence[str]) -> str:
    return TOOLS_TEXT.replace("{schemas}", "\n".join(schemas))


def _param_value(v: Any) -> tuple[bool, str]:
    if isinstance(v, str):
        return True, v.replace(SYN.param_close, M.PARAM_CLOSE_TEXT_ESCAPE + SYN.param_close[1:])
    return False, C.tojson(v)


def render_calls(calls: Sequence) -> str:
    """The V4.1 DSML block of one assistant message (with its "\\n\\n" separator)."""
    if not calls:
        return ""
    invokes = []
    for call in calls:
        args = C.call_arguments(call)
        items = args.items() if args is not None else [("arguments", call.arguments)]
        params = []
        for k, v in items:
            is_str, text = _param_value(v)
            params.append(f'{SYN.param} name="{k}" string="{"true" if is_str else "false"}">{text}{SYN.param_close}')
        invokes.append(f'{SYN.invoke} name="{call.name}">\n' + "\n".join(params) + f"\n{SYN.invoke_close}")
    return M.DSML_BLOCK_SEPARATOR + SYN.open + "\n" + "\n".join(invokes) + "\n" + SYN.close


class _Msg:
    """A turn in the encoder's shape: system | user (text and tool-result parts) | assistant."""

    __slots__ = ("role", "parts", "ids", "turn")

    def __init__(self, role: str, turn: C.Turn | None = None):
        self.role = role
        self.parts: list[str] = []
        self.ids: list[str | None] = []  # user: the call id of each tool-result part, None for text
        self.turn = turn


def _order_results(out: list[_Msg]) -> None:
    """Put the tool results of each user turn in the call order of the last
    assistant turn that made calls.  The encoder sorts them within the whole
    merged user turn, so text parts between results keep their places and the
    results move around them (stable; unknown ids rank as the first call)."""
    order: dict[str, int] = {}
    for m in out:
        if m.role == "assistant" and m.turn.tool_calls:
            order = {c.id: k for k, c in enumerate(m.turn.tool_calls) if c.id}
        elif m.role == "user" and order:
            slots = [k for k, i in enumerate(m.ids) if i is not None]
            if len(slots) > 1:
                ranked = sorted(slots, key=lambda k: order.get(m.ids[k], 0))
                parts = [m.parts[k] for k in ranked]
                for k, part in zip(slots, parts):
                    m.parts[k] = part


def _messages(conv: Conversation, tool_memory) -> list[_Msg]:
    system, rest = C.merge_leading_system(C.turns(conv, tool_memory))
    schemas = C.active_schemas(conv)
    out: list[_Msg] = []
    if system is not None or schemas:
        m = _Msg("system")
        text = system or ""
        if schemas:
            text += "\n\n" + _tools_text(schemas)
        m.parts.append(text)
        out.append(m)
    for t in rest:
        if t.role in ("user", "tool"):
            piece = t.content if t.role == "user" else M.TOOL_RESULT_OPEN + t.content + M.TOOL_RESULT_CLOSE
            if not (out and out[-1].role == "user"):
                out.append(_Msg("user"))
            out[-1].parts.append(piece)
            out[-1].ids.append(t.tool_id if t.role == "tool" else None)
        elif t.role == "system":
            m = _Msg("system")
            m.parts.append(t.content)
            out.append(m)
        else:
            out.append(_Msg("assistant", t))
    _order_results(out)
    return out


def _render(conv: Conversation, tool_memory, generation: bool, keep_reasoning: bool) -> str:
    level = level_of(conv.thinking)
    thinking = level is not None
    msgs = _messages(conv, tool_memory)
    # Without tool context the encoder drops the reasoning of every turn before
    # the last user message (a later system message counts as one): those
    # turns render without <think>...</think>, their prompts end in </think>.
    last_user = max((i for i, m in enumerate(msgs) if m.role == "user" or (m.role == "system" and i > 0)), default=-1)
    out = [M.BOS]
    effort = EFFORT_TEXT.format(level=level) if thinking else ""
    if effort or (msgs and msgs[0].role == "system"):
        out.append(SYSTEM)
    out.append(effort)
    for i, m in enumerate(msgs):
        if m.role == "system":
            if i > 0:
                out.append(SYSTEM)
            out.append(m.parts[0])
        elif m.role == "user":
            out.append(M.USER + "\n\n".join(m.parts))
        else:
            t = m.turn
            if thinking and (keep_reasoning or i > last_user):
                out.append(t.reasoning + M.THINK_CLOSE)
            out.append(t.content)
            if t.tool_calls:
                out.append(t.replay or render_calls(t.tool_calls))
            out.append(M.EOS)
        nxt = msgs[i + 1].role if i + 1 < len(msgs) else None
        if nxt not in (None, "assistant"):
            continue
        if nxt is None and not generation:
            continue
        if m.role == "user" or (m.role == "system" and i > 0):
            out.append(M.ASSISTANT)
            out.append(M.THINK_OPEN if thinking and (keep_reasoning or i >= last_user) else M.THINK_CLOSE)
    return "".join(out)


class DeepSeekV41Protocol(ChatProtocol):
    family = "deepseek_v41"
    model_id = "deepseek-v4.1-flash"
    model_name = "DeepSeek V4.1 Flash"
    aliases = ("deepseek-chat", "deepseek-reasoner")
    chat_aliases = ("deepseek-chat",)
    reasoner_aliases = ("deepseek-reasoner",)
    bos = M.BOS
    eos = M.EOS
    stop_strings = ()
    special_strings = M.SPECIAL_STRINGS + (SYSTEM,)
    turn_end = M.EOS
    default_mode = str(DEFAULT_LEVEL)
    numeric_effort = True
    call_format = DsmlCalls(SYNTAXES, render_calls)

    def resolve_thinking(
        self, mode: str, effort: Any = None, *, explicit: bool = False, model: str | None = None, ctx: int = 32768
    ) -> str:
        if mode == "none":  # thinking off, effort "none", or the deepseek-chat name
            return "none"
        if effort is not None and not (isinstance(effort, str) and not effort.isdigit()):
            n = parse_level(effort)  # a numeric level; 0 turns thinking off
            return "none" if n == 0 else str(n)
        if effort is None:
            return str(NAMED_LEVELS["max"]) if mode == "max" else self.default_mode
        if effort not in NAMED_LEVELS:
            raise EffortError(f"reasoning effort {effort!r} is not supported by {self.model_id}")
        return str(NAMED_LEVELS[effort])

    def render_think_level(self, level: int) -> str:
        n = parse_level(level)
        return "none" if n == 0 else str(n)

    def render_prompt(self, conv: Conversation, tool_memory, generation: bool) -> str:
        return _render(conv, tool_memory, generation, self.uses_tool_context(conv))

    def render_completion(self, prompt: str, thinking: str = "75") -> str:
        conv = Conversation(
            messages=[Message(role="system", content=M.COMPLETION_SYSTEM), Message(role="user", content=prompt)],
            thinking=thinking,
        )
        return self.render(conv)

    def force_text(self, name: str | None) -> str:
        head = M.DSML_BLOCK_SEPARATOR + SYN.open + "\n" + SYN.invoke + ' name="'
        return head if name is None else head + name + '">\n'


PROTOCOL = register(DeepSeekV41Protocol())

__all__ = ["PROTOCOL", "DeepSeekV41Protocol", "render_calls", "level_of", "parse_level"]
