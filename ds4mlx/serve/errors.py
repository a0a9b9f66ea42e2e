"""HTTP errors in each API's own shape; the exact message strings live here.

OpenAI (chat, completions, Responses, models, unknown routes):
    {"error":{"message":MSG,"type":TYPE[,"param":P][,"code":C][,extra...]}}
Anthropic (/v1/messages):
    {"type":"error","error":{"type":TYPE,"message":MSG[,extra...]}}
Ollama (/api/...):
    {"error":MSG}
(docs/http-api.md §1.6; ds4 answers Anthropic requests in the OpenAI shape for most
errors — our issue asks for the API's own shape, so /v1/messages errors use
Anthropic's.)
"""

from __future__ import annotations

from typing import Any

# Exact protocol strings (docs/http-api.md §1.6).
BAD_HTTP = "bad HTTP request"
INVALID_JSON = "invalid JSON request"
MISSING_MESSAGES = "missing messages"
MISSING_INPUT = "missing input"
MISSING_PROMPT = "missing prompt"
UNKNOWN_ENDPOINT = "unknown endpoint"
SHUTTING_DOWN = "server shutting down"
PROMPT_EXCEEDS_CONTEXT = "prompt exceeds context"
GENERATION_FAILED = "generation failed"
BODY_TOO_LARGE = "request body too large"
IGNORE_EOS_NEEDS_GREEDY = "ignore_eos requires temperature 0"
EMPTY_MESSAGES = "messages must not be empty"
METHOD_NOT_ALLOWED = "method not allowed"
# 401 (docs/http-api.md §9.2); the same words whether the key was missing or wrong
UNAUTHORIZED = "invalid or missing API key (send Authorization: Bearer KEY or x-api-key: KEY)"

TOKENIZE_NEEDS_ONE = "give exactly one of 'content', 'prompt' or 'messages'"
TOKENIZE_TOOLS_NEED_MESSAGES = "'tools' only goes with 'messages'"


def ollama_model_not_found(name: str) -> str:
    return f"model '{name}' not found"


# A field of the wrong type or value (serve/validate.py); the same words on every API.
def invalid_type(field: str, expected: str, got: str) -> str:
    return f"Invalid type for '{field}': expected {expected}, but got {got} instead."


def invalid_value(field: str, expected: str, got) -> str:
    shown = repr(got)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"Invalid value for '{field}': expected {expected}, but got {shown} instead."


def missing_field(field: str) -> str:
    return f"Missing required parameter: '{field}'."


def unsupported_part(field: str, kind: str) -> str:
    return f"Invalid content part '{field}': {kind} input is not supported by this server."


def unsupported_field(field: str) -> str:
    return f"Unsupported parameter: '{field}' is not supported by this server."


def supported_only(field: str, condition: str) -> str:
    return f"Unsupported parameter: '{field}' is supported by this server only {condition}."


STRICT_NEEDS_FORCED_CALL = "on a call that tool_choice forces ('required' or a named tool)"
STRICT_NEEDS_EVERY_TOOL = "when every tool the call may use is strict"
STRICT_NEEDS_FAMILY = "for model families whose tool calls it can constrain (DeepSeek V4's DSML)"


def invalid_field(field: str) -> str:
    return f"Invalid value for '{field}'."


# Anthropic message threads: refused in the shape the anthropic SDK reads to go on without one
THREADS_UNSUPPORTED = (
    "Message threads are not supported by this server ({named}): send the full message history "
    "without a 'thread' field."
)
THREADS_UNSUPPORTED_DETAILS = {"error_code": "thread_unsupported_request", "unsupported": ["thread"]}


def internal_error(kind: str) -> str:
    return f"internal error: {kind}"


def api_for_path(path: str) -> str:
    """Whose error shape a path gets: /v1/messages and the paths under it (count_tokens, a
    mistyped one) Anthropic's, /api/... Ollama's, every other OpenAI's."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    return "ollama" if path.startswith("/api/") else "openai"


def unknown_model(name: str) -> str:
    return f"The model `{name}` does not exist"


def unknown_tool(name: str) -> str:
    return f"tool_choice names an unknown tool: {name}"


def context_exceeded(n_prompt: int, n_ctx: int) -> str:
    return f"Prompt has {n_prompt} tokens, but the configured context size is {n_ctx} tokens"


def context_exceeded_at_least(n_prompt: int, n_ctx: int) -> str:
    return f"Prompt has at least {n_prompt} tokens, but the configured context size is {n_ctx} tokens"


RESPONSES_FORCED_TOOL_CHOICE = "forced tool_choice not supported"
RESPONSES_PREVIOUS_ID = "previous_response_id is not supported; replay full input instead"
RESPONSES_CONVERSATION = "conversation is not supported; replay full input instead"


# 409: a tool-output-only request whose live state vanished before it ran (docs/http-api.md §1.6)
RESPONSES_STATE_GONE = "Responses continuation state is not available; retry by replaying the full input history"
ANTHROPIC_STATE_GONE = "Anthropic continuation state is not available; retry by replaying the full messages history"


def responses_unknown_call(call_id: str) -> str:
    return (
        f"Responses continuation state is not available for call_id {call_id}; "
        "retry by replaying the full input history"
    )


def anthropic_unknown_tool_use(tool_use_id: str) -> str:
    return (
        f"Anthropic continuation state is not available for tool_use_id {tool_use_id}; "
        "retry by replaying the full messages history"
    )


_OPENAI_TYPES = {401: "invalid_request_error", 500: "server_error", 503: "server_error"}
_OPENAI_CODES = {401: "invalid_api_key"}
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """Raised anywhere in request handling; the app turns it into a response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        extra: dict[str, Any] | None = None,
    ):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.code = code
        self.extra = dict(extra or {})


def openai_body(status: int, message: str, param=None, code=None, extra=None) -> dict:
    err: dict[str, Any] = {"message": message, "type": _OPENAI_TYPES.get(status, "invalid_request_error")}
    if param is not None:
        err["param"] = param
    code = code if code is not None else _OPENAI_CODES.get(status)
    if code is not None:
        err["code"] = code
    err.update(extra or {})
    return {"error": err}


def anthropic_body(status: int, message: str, extra=None) -> dict:
    err: dict[str, Any] = {"type": _ANTHROPIC_TYPES.get(status, "invalid_request_error"), "message": message}
    err.update(extra or {})
    return {"type": "error", "error": err}


def error_body(api: str, e: APIError) -> dict:
    if api == "ollama":
        return {"error": e.message}
    if api == "anthropic":
        return anthropic_body(e.status, e.message, e.extra)
    return openai_body(e.status, e.message, e.param, e.code, e.extra)


def context_error(n_prompt: int, n_ctx: int, param: str, *, at_least: bool = False) -> APIError:
    """`at_least`: n_prompt is a lower bound (the prompt was refused before tokenizing)."""
    message = (context_exceeded_at_least if at_least else context_exceeded)(n_prompt, n_ctx)
    return APIError(
        400, message, param=param, code="context_length_exceeded", extra={"n_prompt_tokens": n_prompt, "n_ctx": n_ctx}
    )


# SSE error events after the stream started (docs/http-api.md §1.6).
def sse_error_payload(api: str, message: str) -> dict:
    if api == "ollama":  # an NDJSON line
        return {"error": message}
    if api == "anthropic":
        return {"type": "error", "error": {"type": "api_error", "message": message}}
    return {"error": {"message": message, "type": "server_error"}}
