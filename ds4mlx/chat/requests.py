"""What every API's request parser shares (docs/chat-template.md §2, §3).

Each HTTP API parses its own body in its serve/ module (serve/openai.py,
serve/anthropic.py, serve/responses.py, serve/completions.py); this module holds
the API-neutral pieces they (and the agent, which builds tool schemas the same
way) use: the request error, content flattening, thinking resolution, stop
sequences, the `tools` array, and the checks every body gets.

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

from dataclasses import dataclass
from typing import Any

from . import images as chat_images
from . import markers as M
from .jsontext import json_text
from .messages import Conversation, Message, ToolAlias
from .protocol import DEFAULT_FAMILY, get_protocol

__all__ = [
    "RequestError",
    "invalid_json",
    "as_str",
    "check_role",
    "flatten_content",
    "Thinking",
    "resolve_thinking",
    "parse_stop",
    "parse_tools",
    "add_id",
    "message_list",
    "finish_conversation",
    "require_messages",
    "body_object",
    "VALID_ROLES",
    "CHAT_THINKING_FIELDS",
    "DEFAULT_MODEL",
]

# a request that names no model gets the default family's id (serve/prepare.py then puts the loaded one)
DEFAULT_MODEL = get_protocol(DEFAULT_FAMILY).model_id
# the thinking controls of a Chat Completions / legacy completions body (`Thinking.chat_field`)
CHAT_THINKING_FIELDS = ("thinking", "think", "reasoning_effort")
VALID_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# "minimal" is OpenAI's way of saying (almost) no reasoning: off
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


class RequestError(Exception):
    """A request the server refuses (HTTP 4xx)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


def invalid_json() -> RequestError:
    """ds4's answer to a value of the wrong JSON type."""
    return RequestError(M.ERR_INVALID_JSON)


def as_str(v: Any) -> str:
    """The value if it is a string, else `invalid_json()`."""
    if not isinstance(v, str):
        raise invalid_json()
    return v


def check_role(role: str) -> str:
    """The role if it is one of VALID_ROLES, else a 400 naming it."""
    if role not in VALID_ROLES:
        raise RequestError(M.ERR_UNKNOWN_ROLE.format(role=role), param="messages")
    return role


# --- content ---------------------------------------------------------------------


def flatten_content(v: Any, images: list | None = None) -> str:
    """docs/chat-template.md §2.1: string; null -> ""; array -> strings and every
    object's "text" (must be a string) concatenated; any other value -> "".
    An image part becomes its marker, the image appended to `images`; where no image
    may go (`images` None) it is refused (docs/vision.md §1), never dropped."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        parts = []
        for e in v:
            if isinstance(e, str):
                parts.append(e)
            elif chat_images.is_image_part(e):
                parts.append(image_marker(e, images))
            elif isinstance(e, dict) and "text" in e:
                parts.append(as_str(e["text"]))
        return "".join(parts)
    return ""


class ImagePartError(RequestError):
    """A refused image part, named within its message ("image 2"); the message list names
    the message (`named`)."""

    def named(self, where: str) -> RequestError:
        return RequestError(f"{where}, {self.message}", self.status, param=where)


def image_marker(part: dict, images: list | None) -> str:
    """An image part (chat/images.py) -> its marker, the image appended to `images`."""
    if images is None:
        raise RequestError(chat_images.ERR_ROLE)
    try:
        image = chat_images.parse_part(part)
    except chat_images.ImageError as e:
        raise ImagePartError(f"image {len(images) + 1}: {e.message}") from None
    images.append(image)
    return image.marker


def check_image_role(m: Message) -> Message:
    """Images only in user messages and tool results (ds4 refuses the others)."""
    if m.images:
        try:
            chat_images.check_role(m.role)
        except chat_images.ImageError as e:
            raise RequestError(e.message) from None
    return m


# --- thinking (docs/chat-template.md §3) ----------------------------------------------------


@dataclass
class Thinking:
    """The thinking controls one request sets, resolved to none | high | max at the end."""

    enabled: bool = True
    explicit: bool = False
    effort: str = "high"

    def control(self, v: Any) -> None:
        """`thinking`: bool, null, {"type": "enabled"|"disabled", ...} or anything (explicit)."""
        self.explicit = True
        if isinstance(v, bool):
            self.enabled = v
        elif isinstance(v, dict) and "type" in v:
            typ = as_str(v["type"])
            if typ in ("enabled", "adaptive"):
                self.enabled = True
            elif typ == "disabled":
                self.enabled = False
            budget = v.get("budget_tokens")
            if isinstance(budget, int) and not isinstance(budget, bool) and budget <= 0:
                self.enabled = False  # a thinking budget of 0 is off

    def think(self, v: Any) -> None:
        if not isinstance(v, bool):
            raise invalid_json()
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

    def chat_field(self, key: str, v: Any) -> None:
        """One of CHAT_THINKING_FIELDS, as Chat Completions and legacy completions read it."""
        if key == "thinking":
            self.control(v)
        elif key == "think":
            self.think(v)
        else:
            self.set_effort(v)

    def resolve(self, model: str, ctx: int) -> str:
        return resolve_thinking(self.enabled, self.effort, explicit=self.explicit, model=model, ctx=ctx)


def resolve_thinking(
    enabled: bool = True, effort: str = "high", *, explicit: bool = False, model: str | None = None, ctx: int = 32768
) -> str:
    """Final mode none | high | max (docs/chat-template.md §3 steps 4-5)."""
    if not explicit and model is not None:
        # the default family's chat / reasoner aliases; the loaded family refines the
        # mode with its own (ChatProtocol.resolve_thinking, serve/prepare.py)
        default = get_protocol(DEFAULT_FAMILY)
        if model in default.chat_aliases:
            enabled = False
        elif model in default.reasoner_aliases:
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
        raise invalid_json()
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


# --- what every API parser shares ------------------------------------------------------


def add_id(ids: list[str], i: str | None) -> None:
    """Append a tool-call id once."""
    if i and i not in ids:
        ids.append(i)


def message_list(v: Any, parse_one, where=lambda i: f"messages[{i}]") -> list[Message]:
    """A JSON array of messages, each through the API's `parse_one`; a refused image part
    is named by its message (`where(i)`) and its place among the message's images."""
    if not isinstance(v, list):
        raise invalid_json()
    out = []
    for i, e in enumerate(v):
        try:
            out.append(parse_one(e))
        except ImagePartError as err:
            raise err.named(where(i)) from None
    return out


def finish_conversation(conv: Conversation, model: str, th: Thinking, ctx: int) -> Conversation:
    """Set the model and the resolved thinking mode; tools are active only if any were given."""
    conv.model = model
    conv.thinking = th.resolve(model, ctx)
    conv.tools_active = conv.tools_active and bool(conv.tool_schemas)
    return conv


def require_messages(msgs: list[Message] | None, strict: bool) -> list[Message]:
    """`messages` must be present; with `strict`, non-empty and of known roles."""
    if msgs is None:
        raise RequestError(M.ERR_MISSING_MESSAGES, param="messages")
    if strict:
        if not msgs:
            raise RequestError(M.ERR_EMPTY_MESSAGES, param="messages")
        for m in msgs:
            check_role(m.role)
    return msgs


def body_object(body: Any) -> dict:
    """The body must be a JSON object."""
    if not isinstance(body, dict):
        raise invalid_json()
    return body
