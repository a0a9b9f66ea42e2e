"""Chat protocols: everything between a normalized request and prompt text, per
model family.

A `ChatProtocol` owns one family's conversation format: the model id and
aliases /v1/models reports, the special strings, the prompt renderer (chat,
legacy completion, live tool-continuation tail), the tool-call syntax (render,
forced opening for tool_choice, final parse) and the streaming output parser
(`make_parser`, the `OutputParser` interface: `feed`, `finish`, `.structural`,
`.stop_now`, `.phase`), plus the family's thinking-mode resolution.

Families (registry keys, the config `model_type` they serve):

* `deepseek_v4`  DeepSeek V4 Flash: chat/families/deepseek_v4/ (template, dsml, output).
* `deepseek_v41` DeepSeek V4.1 Flash: families/deepseek_v41.py.
* `glm_moe_dsa`  GLM 5.2, `glm5_next` GLM 5.3 Flash: families/glm.py.
* `qwen4_exp`    Qwen3.8 Flash Next: families/qwen.py.

Thinking modes are strings: "none" disables thinking everywhere; otherwise
the value is family-specific (V4: "high" | "max"; V4.1: a level "1".."100";
GLM: "low" | "high" | "max"; Qwen: "low" | "medium" | "xhigh").  The shared
request parser resolves none/high/max; `resolve_thinking` refines that with
the client's raw effort value (`request_effort`) for the loaded family.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from .. import registry
from ..runtime.events import ToolCallEnd
from . import markers as M
from .messages import Conversation

__all__ = [
    "CallFormat",
    "ChatProtocol",
    "register",
    "get_protocol",
    "families",
    "family_of",
    "protocol_for_model",
    "model_type_of",
    "request_effort",
    "EffortError",
    "DEFAULT_FAMILY",
    "TemplateError",
    "register_template",
    "chat_templates",
]

DEFAULT_FAMILY = registry.DEFAULT_FAMILY

# config `model_type` (or text_config.model_type) -> family key, family key -> the module
# that registers its protocol: both from the family registry (ds4mlx/registry.py)
_MODEL_TYPES = {t: f.key for t, f in registry.BY_MODEL_TYPE.items()}
_FAMILY_MODULES = {f.key: f.chat_module for f in registry.FAMILIES}


class TemplateError(ValueError):
    """A chat template the family does not have (`--chat-template`)."""


class EffortError(ValueError):
    """A reasoning effort value the loaded family does not accept (HTTP 400)."""


class CallFormat:
    """A family's tool-call spelling: calls written into a prompt, the streaming parser of a
    generation and its final parse.  A protocol holds one as `call_format`; the families
    with one spelling share one implementation (DSML, tag-based XML)."""

    def render(self, calls: Sequence) -> str:
        raise NotImplementedError

    def parser(self, thinking: bool, tools_active: bool, id_prefix: str, tool_memory, tool_schemas: Sequence[str]):
        raise NotImplementedError

    def parse(self, text: str, thinking: bool, tools_active: bool, truncated: bool, tool_schemas: Sequence[str]):
        raise NotImplementedError


class ChatProtocol:
    """One model family's chat protocol.  Subclasses set the attributes and
    implement the methods; see the module docstring."""

    family: str = ""
    model_id: str = ""
    model_name: str = ""
    aliases: tuple = ()
    # model names that, unless the request sets thinking explicitly, turn it off / on
    chat_aliases: tuple = ()
    reasoner_aliases: tuple = ()
    bos: str = ""
    eos: str = ""
    think_open: str = M.THINK_OPEN
    think_close: str = M.THINK_CLOSE
    # strings that end the assistant turn (their tokens stop generation like EOS)
    stop_strings: tuple = ()
    special_strings: tuple = ()
    # text that closes an assistant turn in the prompt (right after a tool call
    # it is what the live continuation tail starts with)
    turn_end: str = ""
    default_mode: str = "high"
    numeric_effort: bool = False  # reasoning_effort may be a number (V4.1 levels)
    # which of the family's prompt renderings this is (`--chat-template`, markers.CHAT_TEMPLATES)
    chat_template: str = M.CHAT_TEMPLATE_DS4
    call_format: CallFormat  # the tool-call spelling: render, streaming parser, final parse

    # --- identity ------------------------------------------------------------------
    @property
    def model_names(self) -> tuple:
        return (self.model_id,) + tuple(self.aliases)

    def knows_model(self, name: str) -> bool:
        return name in self.model_names

    # --- thinking -------------------------------------------------------------------
    def thinking_enabled(self, mode: str) -> bool:
        return mode != "none"

    def resolve_thinking(
        self, mode: str, effort: Any = None, *, explicit: bool = False, model: str | None = None, ctx: int = 32768
    ) -> str:
        """The family's mode from the shared parser's none/high/max `mode`, the
        raw client `effort` (None if absent) and the model name."""
        raise NotImplementedError

    def render_think_level(self, level: int) -> str:
        """CLI `--think-level N` as a mode (only numeric-effort families)."""
        raise EffortError(f"--think-level is not supported by {self.family}")

    # --- prompts --------------------------------------------------------------------
    def render(self, conv: Conversation, tool_memory=None) -> str:
        return self.render_prompt(conv, tool_memory, generation=True)

    def render_prompt(self, conv: Conversation, tool_memory, generation: bool) -> str:
        """`conv` as prompt text; `generation`: ending with the opening of the assistant's
        answer (`render`), else ending with the last turn (`render_history`)."""
        raise NotImplementedError

    def render_completion(self, prompt: str, thinking: str = "high") -> str:
        raise NotImplementedError

    def render_continuation_tail(self, conv: Conversation, start: int, tool_memory=None) -> str | None:
        """The text the live session (which ends right after the sampled tool
        calls) needs to reach `render(conv)`: the turn end, then messages[start:]
        and the generation prompt.  None when the live turn is not a prefix."""
        head = Conversation(
            messages=list(conv.messages[:start]),
            tool_schemas=conv.tool_schemas,
            tools_active=conv.tools_active,
            thinking=conv.thinking,
            api=conv.api,
            model=conv.model,
            tool_aliases=conv.tool_aliases,
        )
        full = self.render(conv, tool_memory)
        prefix = self.render_history(head, tool_memory)
        if not prefix.endswith(self.turn_end) or not full.startswith(prefix):
            return None
        return self.turn_end + full[len(prefix) :]

    def render_history(self, conv: Conversation, tool_memory=None) -> str:
        """`conv` rendered without a generation prompt (it ends with an assistant turn)."""
        return self.render_prompt(conv, tool_memory, generation=False)

    def uses_tool_context(self, conv: Conversation) -> bool:
        """The prompt renders old reasoning because of tools (engine bindings)."""
        return bool(conv.tools_active and conv.tool_schemas) or any(
            (m.role == "assistant" and m.tool_calls) or m.role in ("tool", "function") for m in conv.messages
        )

    # --- tool calls -------------------------------------------------------------------
    def render_calls(self, calls: Sequence) -> str:
        return self.call_format.render(calls)

    def force_text(self, name: str | None) -> str:
        """Text forced at the start of the answer by tool_choice required
        (name None: the model picks the tool) or a named tool."""
        raise NotImplementedError

    def strict_call_grammar(self, tools: dict, named: str | None, literal, json_term) -> str | None:
        """A Lark grammar of the rest of a forced tool call after `force_text(named)`, each
        tool's arguments held to its JSON schema (`tools`: name -> schema); `literal(text)`
        and `json_term(schema)` write Lark terms.  None: the family cannot constrain calls."""
        return None

    def make_parser(
        self,
        thinking: bool,
        tools_active: bool,
        id_prefix: str = M.OPENAI_TOOL_ID_PREFIX,
        tool_memory=None,
        *,
        tool_schemas: Sequence[str] = (),
    ):
        """The streaming output parser of one generation (the `OutputParser` interface)."""
        return self.call_format.parser(thinking, tools_active, id_prefix, tool_memory, tool_schemas)

    def parse(
        self,
        text: str,
        *,
        thinking: bool,
        tools_active: bool = True,
        truncated: bool = False,
        tool_schemas: Sequence[str] = (),
    ):
        """Final parse of a whole generation (a `dsml.ParsedOutput`)."""
        return self.call_format.parse(text, thinking, tools_active, truncated, tool_schemas)


class FirstCallOnly:
    """A family's output parser that stops the generation right after the first complete
    tool call (`parallel_tool_calls: false`, Anthropic `disable_parallel_tool_use`;
    docs/http-api.md §10): the parser's own cut, as for a block broken off after a call."""

    def __init__(self, parser):
        self._parser = parser

    def __getattr__(self, name: str):
        return getattr(self._parser, name)

    def feed(self, text):
        events = self._parser.feed(text)
        if not self._parser.stop_now and any(isinstance(e, ToolCallEnd) for e in events):
            self._parser.stop_after_call(events)
        return events

    def finish(self, truncated: bool = False):
        return self._parser.finish(truncated)


# =============================================================================
# Registry
# =============================================================================

_REGISTRY: dict[str, ChatProtocol] = {}


def register(protocol: ChatProtocol) -> ChatProtocol:
    _REGISTRY[protocol.family] = protocol
    return protocol


# (family, template) -> a protocol that renders prompts another way (same family otherwise)
_TEMPLATES: dict[tuple[str, str], ChatProtocol] = {}


def register_template(protocol: ChatProtocol) -> ChatProtocol:
    """Register a family's non-default chat template (`protocol.chat_template`)."""
    _TEMPLATES[(protocol.family, protocol.chat_template)] = protocol
    return protocol


def get_protocol(family: str | None = None, template: str | None = None) -> ChatProtocol:
    """The protocol of a family key or config model_type (None: DeepSeek V4), rendering
    with chat `template` (None or "ds4": the family's default; TemplateError when the
    family has no such template)."""
    family = _MODEL_TYPES.get(family or DEFAULT_FAMILY, family or DEFAULT_FAMILY)
    proto = _REGISTRY.get(family)
    if proto is None and family in _FAMILY_MODULES:
        importlib.import_module(_FAMILY_MODULES[family])
        proto = _REGISTRY.get(family)
    if proto is None:
        raise KeyError(f"no chat protocol for model family {family!r}")
    if template is None or template == proto.chat_template:
        return proto
    variant = _TEMPLATES.get((family, template))
    if variant is None:
        raise TemplateError(
            f"chat template {template!r} is not available for {proto.model_name or family} "
            f"(it has: {', '.join(chat_templates(family))})"
        )
    return variant


def chat_templates(family: str | None = None) -> tuple:
    """The chat template names a family renders with, its default first."""
    proto = get_protocol(family)
    return (proto.chat_template,) + tuple(t for (f, t) in _TEMPLATES if f == proto.family)


def families() -> tuple:
    return tuple(sorted(_FAMILY_MODULES))


def family_of(model_type: str | None) -> str | None:
    return _MODEL_TYPES.get(model_type) if model_type else None


def model_type_of(model) -> str | None:
    """`model_type` of a loaded model: `model.args.model_type`, then the config
    dict (`model_type`, else `text_config.model_type`); None if unknown."""
    for obj in (model, getattr(model, "model", None)):
        args = getattr(obj, "args", None)
        mt = getattr(args, "model_type", None)
        if isinstance(mt, str) and mt:
            return mt
    cfg = getattr(model, "config", None)
    if isinstance(cfg, dict):
        mt = cfg.get("model_type")
        if not (isinstance(mt, str) and mt in _MODEL_TYPES) and isinstance(cfg.get("text_config"), dict):
            mt = cfg["text_config"].get("model_type", mt)
        if isinstance(mt, str) and mt:
            return mt
    return None


def protocol_for_model(model) -> ChatProtocol:
    """The protocol of a loaded model's family (DeepSeek V4 when it says nothing)."""
    family = family_of(model_type_of(model))
    return get_protocol(family or DEFAULT_FAMILY)


# --- raw effort values of a request body ----------------------------------------------


def _numeric(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return True
    return isinstance(v, str) and v.isdigit() and v.isascii()


def request_effort(api: str, body: Any, numeric: bool = False) -> tuple[Any, Any]:
    """(body for the shared request parser, raw effort value or None).

    The effort is `reasoning_effort` (every API), Anthropic
    `output_config.effort` or Responses `reasoning.effort`.  With `numeric`
    (families with numeric levels) a numeric value — an integer or a string of
    ASCII digits — is taken out of the body, since the shared parser only
    knows named efforts; other values stay for the shared parser to validate."""
    if not isinstance(body, dict):
        return body, None
    found: Any = None
    out = body
    if "reasoning_effort" in body and body["reasoning_effort"] is not None:
        found = body["reasoning_effort"]
        if numeric and _numeric(found):
            out = {k: v for k, v in body.items() if k != "reasoning_effort"}
    for key in ("output_config", "reasoning"):
        sub = body.get(key)
        if isinstance(sub, dict) and sub.get("effort") is not None:
            found = sub["effort"]
            if numeric and _numeric(found):
                out = dict(out) if out is body else out
                out[key] = {k: v for k, v in sub.items() if k != "effort"}
    if api == "anthropic" and out is not body and "thinking" not in body:
        # a named effort turns Anthropic thinking on (its default is off); the family
        # resolves the level, 0 included
        out = {**out, "thinking": {"type": "enabled"}}
    return out, found
