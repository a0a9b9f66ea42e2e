"""Qwen3.8 Flash Next (`qwen4_exp`): ChatML turns, XML-style tool calls, inline
`<think>` (docs/chat-families.md §4; the template is tests/data/chat_templates/qwen4_exp.jinja).

Prompt (the official template's output):

    <|im_start|>system\\n[EFFORT\\n\\n][# Tools ... </IMPORTANT>][\\n\\n]SYSTEM<|im_end|>\\n
    <|im_start|>user\\nUSER<|im_end|>\\n
    <|im_start|>assistant\\n<think>\\nREASONING\\n</think>\\n\\nCONTENT[\\n\\n]<tool_call>\\n<function=NAME>\\n
    <parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\nRESULT\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n<think>\\n          (thinking off: <think>\\n\\n</think>\\n\\n)

Contents, reasoning and tool results are trimmed; every assistant turn keeps
its reasoning (`preserve_thinking` defaults to true); a string argument is
written verbatim, any other value as JSON.  Reasoning effort: xhigh
(default; `high`/`max` mean it too), medium, low -- the effort sentence opens
the system turn (medium has none).

Deviations where the template raises instead (ds4 behaviour): several system
or developer messages are merged ("\\n\\n") into the first system turn; a
history tool call whose arguments are not a JSON object is written as one
`arguments` parameter; a string argument that contains `</parameter>` is
written with `&lt;/parameter>` (the parser decodes it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import markers as M
from ..messages import Conversation
from ..protocol import ChatProtocol, EffortError, register
from . import common as C
from .xmlcalls import CallSyntax, Scan, ThinkStyle, XmlCalls, is_partial, skip_ws

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
# the image-token block of the Qwen3-VL / Qwen3.8 vocabulary (docs/vision.md §2)
VISION_START = "<|vision_start|>"
IMAGE_PAD = "<|image_pad|>"
VISION_END = "<|vision_end|>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAM_OPEN = "<parameter="
PARAM_CLOSE = "</parameter>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

EFFORT_XHIGH = (
    "Reasoning effort is set to xhigh. Please think carefully through the task, validate key "
    "assumptions, consider plausible alternatives, and prioritize correctness, consistency, and "
    "clarity in the final answer."
)
EFFORT_LOW = (
    "Reasoning effort is set to low. Keep your thinking brief and focused, moving directly to the "
    "conclusion without unnecessary elaboration."
)
TOOLS_HEAD = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_TAIL = (
    "\n</tools>"
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be "
    "nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function "
    "call, but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current knowledge "
    "and do not tell the user about function calls\n</IMPORTANT>"
)
THINK_PROMPT = "<think>\n"
NO_THINK_PROMPT = "<think>\n\n</think>\n\n"

_EFFORTS = {
    "xhigh": "xhigh",
    "high": "xhigh",
    "max": "xhigh",
    "medium": "medium",
    "low": "low",
    "minimal": "low",
    "none": "none",
}


class QwenCallSyntax(CallSyntax):
    value_close = PARAM_CLOSE
    call_separator = "\n"

    def scan(self, text: str, pos: int) -> Scan:
        n = len(text)
        i = skip_ws(text, pos + len(TOOL_CALL_OPEN))
        if i >= n or is_partial(text[i:], (FUNCTION_OPEN,)):
            return Scan("partial", i)
        if not text.startswith(FUNCTION_OPEN, i):
            return Scan("invalid", i)
        gt = text.find(">", i)
        nl = text.find("\n", i, gt if gt >= 0 else n)
        if nl >= 0 or text.find("<", i + 1, gt if gt >= 0 else n) >= 0:
            return Scan("invalid", i)
        if gt < 0:
            return Scan("partial", i)
        name = text[i + len(FUNCTION_OPEN) : gt].strip()
        if not name:
            return Scan("invalid", i)
        s = Scan("partial", gt + 1, name=name)
        i = gt + 1
        while True:
            i = skip_ws(text, i)
            s.end = i
            if i >= n:
                return s
            if text.startswith(PARAM_OPEN, i):
                gt = text.find(">", i)
                if gt < 0:
                    return s
                key = text[i + len(PARAM_OPEN) : gt]
                if "<" in key or "\n" in key:
                    s.status = "invalid"
                    return s
                vs = gt + 1
                ve = text.find(PARAM_CLOSE, vs)
                if ve < 0:
                    s.in_value, s.value_start = True, vs
                    return s
                value = text[vs:ve]
                if value.startswith("\n"):
                    value = value[1:]
                if value.endswith("\n"):
                    value = value[:-1]
                s.params.append((key, self.unescape_value(value)))
                i = ve + len(PARAM_CLOSE)
                continue
            if text.startswith(FUNCTION_CLOSE, i):
                j = skip_ws(text, i + len(FUNCTION_CLOSE))
                if j >= n or is_partial(text[j:], (TOOL_CALL_CLOSE,)):
                    s.end = j
                    return s
                if text.startswith(TOOL_CALL_CLOSE, j):
                    s.status, s.end = "complete", j + len(TOOL_CALL_CLOSE)
                    return s
                s.status, s.end = "invalid", j
                return s
            if text.startswith(TOOL_CALL_CLOSE, i):  # lenient: </function> left out
                s.status, s.end = "complete", i + len(TOOL_CALL_CLOSE)
                return s
            if not is_partial(text[i : i + 16], (PARAM_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE)):
                s.status = "invalid"
            return s

    def render_call(self, name: str, args: dict | None, raw_arguments: str) -> str:
        body = "".join(
            PARAM_OPEN + k + ">\n" + v + "\n" + PARAM_CLOSE + "\n" for k, v in self.argument_items(args, raw_arguments)
        )
        return TOOL_CALL_OPEN + "\n" + FUNCTION_OPEN + name + ">\n" + body + FUNCTION_CLOSE + "\n" + TOOL_CALL_CLOSE


SYNTAX = QwenCallSyntax()
THINK = ThinkStyle(open=M.THINK_OPEN, close=M.THINK_CLOSE, strip_reasoning=True, inline=True)


def _trim(s: str) -> str:
    return s.strip()  # jinja's |trim (Python str.strip)


class QwenProtocol(ChatProtocol):
    family = "qwen4_exp"
    model_id = "qwen3.8-flash-next"
    model_name = "Qwen3.8 Flash Next"
    aliases = ("qwen3.8-flash-next-chat", "qwen3.8-flash-next-reasoner")
    chat_aliases = ("qwen3.8-flash-next-chat",)
    reasoner_aliases = ("qwen3.8-flash-next-reasoner",)
    bos = ""
    eos = IM_END
    stop_strings = (IM_END, ENDOFTEXT)
    special_strings = (IM_START, IM_END, ENDOFTEXT, M.THINK_OPEN, M.THINK_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
    turn_end = IM_END + "\n"
    default_mode = "xhigh"
    call_format = XmlCalls(SYNTAX, THINK)

    # --- thinking ---------------------------------------------------------------------
    def resolve_thinking(
        self, mode: str, effort: Any = None, *, explicit: bool = False, model: str | None = None, ctx: int = 32768
    ) -> str:
        if mode == "none" or (not explicit and effort is None and model in self.chat_aliases):
            return "none"
        if effort is None:
            return self.default_mode
        if not isinstance(effort, str) or effort not in _EFFORTS:
            raise EffortError(f"reasoning effort {effort!r} is not supported by {self.model_id}")
        return _EFFORTS[effort]

    # --- prompts ------------------------------------------------------------------------
    def _system(self, system: str | None, schemas: Sequence[str], mode: str) -> str:
        mode = _EFFORTS.get(mode, mode)  # a generic "high" / "max" mode means xhigh
        instr = EFFORT_XHIGH if mode == "xhigh" else EFFORT_LOW if mode == "low" else ""
        sys_text = _trim(system) if system is not None else ""
        if schemas:
            out = [IM_START, "system\n"]
            if instr:
                out.append(instr + "\n\n")
            out.append(TOOLS_HEAD)
            for s in schemas:
                out.append("\n" + '{"type": "function", "function": ' + s + "}")
            out.append(TOOLS_TAIL)
            if sys_text:
                out.append("\n\n" + sys_text)
            out.append(IM_END + "\n")
            return "".join(out)
        if sys_text:
            return IM_START + "system\n" + (instr + "\n\n" if instr else "") + sys_text + IM_END + "\n"
        if instr:
            return IM_START + "system\n" + instr + IM_END + "\n"
        return ""

    def _calls(self, t: C.Turn, content: str) -> str:
        if not t.tool_calls:
            return ""
        lead = "\n\n" if content else ""
        if t.replay:
            return lead + t.replay
        return lead + SYNTAX.render_calls(t.tool_calls)

    def render_prompt(self, conv: Conversation, tool_memory, generation: bool) -> str:
        ts = C.turns(conv, tool_memory)
        system, rest = C.merge_leading_system(ts)
        # later system turns (the template raises on them) join the system turn too
        late = [t.content for t in rest if t.role == "system"]
        if late:
            system = "\n\n".join(([system] if system is not None else []) + late)
        rest = [t for t in rest if t.role != "system"]
        mode = conv.thinking
        out = [self._system(system, C.active_schemas(conv), mode)]
        # preserve_thinking defaults to true: every assistant turn keeps its reasoning
        for i, t in enumerate(rest):
            if t.role == "user":
                out.append(IM_START + "user\n" + _trim(t.content) + IM_END + "\n")
            elif t.role == "assistant":
                content = _trim(t.content)
                out.append(
                    IM_START
                    + "assistant\n"
                    + THINK_PROMPT
                    + _trim(t.reasoning)
                    + "\n"
                    + M.THINK_CLOSE
                    + "\n\n"
                    + content
                )
                out.append(self._calls(t, content))
                out.append(IM_END + "\n")
            elif t.role == "tool":
                if (rest[i - 1].role != "tool") if i > 0 else system is not None:
                    out.append(IM_START + "user")
                out.append("\n" + TOOL_RESPONSE_OPEN + "\n" + _trim(t.content) + "\n" + TOOL_RESPONSE_CLOSE)
                if i == len(rest) - 1 or rest[i + 1].role != "tool":
                    out.append(IM_END + "\n")
        if generation:
            out.append(IM_START + "assistant\n" + (NO_THINK_PROMPT if mode == "none" else THINK_PROMPT))
        return "".join(out)

    def render_completion(self, prompt: str, thinking: str = "xhigh") -> str:
        from ..messages import Message

        conv = Conversation(messages=[Message(role="user", content=prompt)], thinking=thinking)
        return self.render(conv)

    # --- tool calls ------------------------------------------------------------------------
    def force_text(self, name: str | None) -> str:
        head = TOOL_CALL_OPEN + "\n" + FUNCTION_OPEN
        return head if name is None else head + name + ">\n"


PROTOCOL = register(QwenProtocol())
