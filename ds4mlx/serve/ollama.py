"""The Ollama API, both directions (docs/http-api.md §9.5).

/api/chat and /api/generate bodies are translated into the Chat Completions (or, for
`raw` generate, legacy completions) body the other APIs' pipeline already validates,
renders and queues (serve/prepare.py), so an Ollama request becomes the same engine
job; `OllamaAdapter` prints that job's events as Ollama's objects: NDJSON lines when
streamed (Ollama streams by default), one object when not.  /api/tags, /api/show,
/api/ps and /api/version describe the loaded model.

Ollama's field names: `options.temperature|top_p|top_k|min_p|seed|stop`,
`options.num_predict` (max tokens; -1 / -2 = no limit but the context),
`options.num_ctx` (a smaller context for this request; larger than --ctx is a 400),
`think` (true / false / "low" | "medium" | "high"), `tools`, messages'
`thinking` / `tool_calls` / `tool_name` / `images`, `format` ("json" or a JSON schema:
the pipeline's `response_format`, structured output).  Every other field or option
is a 400 naming it, except `keep_alive`, which is accepted: the model stays loaded
for the server's life.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..runtime.events import Finish, ReasoningDelta, TextDelta, ToolCallEnd
from . import errors as E
from . import sse
from .common import RequestInfo, body_bytes, parsed_parts

# the Ollama API version this adapter speaks (clients compare it, e.g. for `think`)
OLLAMA_API_VERSION = "0.12.0"
TAG = ":latest"
COMMON_FIELDS = frozenset({"model", "format", "options", "stream", "keep_alive", "think"})
CHAT_FIELDS = COMMON_FIELDS | {"messages", "tools"}
GENERATE_FIELDS = COMMON_FIELDS | {"prompt", "suffix", "system", "template", "context", "raw", "images"}
MESSAGE_FIELDS = frozenset({"role", "content", "thinking", "images", "tool_calls", "tool_name"})
NUMBER_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "min_p": "min_p"}
INT_OPTIONS = {"top_k": "top_k", "seed": "seed"}
OPTIONS = frozenset(NUMBER_OPTIONS) | frozenset(INT_OPTIONS) | {"num_predict", "num_ctx", "stop"}
THINK_LEVELS = ("low", "medium", "high")
DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop", "cancelled": "stop", "error": "error"}
NEVER = "9999-12-31T23:59:59Z"  # /api/ps expires_at: the model is never unloaded


def timestamp(t: float | None = None) -> str:
    """RFC 3339 in UTC with microseconds, as Ollama's created_at."""
    d = datetime.fromtimestamp(time.time() if t is None else t, tz=timezone.utc)
    return d.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def model_name(name: str) -> str:
    """The name the rest of the server knows: Ollama's default tag dropped."""
    return name[: -len(TAG)] if name.endswith(TAG) else name


# --- request -----------------------------------------------------------------------------


@dataclass
class OllamaRequest:
    kind: str  # chat | generate
    api: str  # the pipeline's api: chat | completions
    body: dict  # the translated body
    model: str  # as the client wrote it (echoed)
    stream: bool
    num_ctx: int | None = None
    load_only: bool = False  # no prompt: Ollama's "load the model" request
    extra: dict = field(default_factory=dict)


def _bad_type(name: str, expected: str, v: Any) -> E.APIError:
    return E.APIError(400, E.invalid_type(name, expected, type(v).__name__), param=name, code="invalid_type")


def _unsupported(name: str) -> E.APIError:
    return E.APIError(400, E.unsupported_field(name), param=name, code="unsupported_parameter")


def _refuse_unknown(obj: dict, known: frozenset, where: str = "") -> None:
    for k in obj:
        if k not in known:
            raise _unsupported(where + k)


def _number(v: Any, name: str, integer: bool = False) -> float | int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and isinstance(v, float) and v != int(v)):
        raise _bad_type(name, "an integer" if integer else "a number", v)
    return int(v) if integer else v


def _options(opts: Any, out: dict) -> int | None:
    """options -> Chat Completions fields in `out`; returns num_ctx."""
    if opts is None:
        return None
    if not isinstance(opts, dict):
        raise _bad_type("options", "an object", opts)
    _refuse_unknown(opts, OPTIONS, "options.")
    num_ctx = None
    for k, v in opts.items():
        name = "options." + k
        if v is None:
            continue
        if k in NUMBER_OPTIONS:
            out[NUMBER_OPTIONS[k]] = _number(v, name)
        elif k in INT_OPTIONS:
            out[INT_OPTIONS[k]] = _number(v, name, integer=True)
        elif k == "num_predict":
            n = _number(v, name, integer=True)
            if n < -2:
                raise E.APIError(400, E.invalid_value(name, "-2, -1 or a count >= 0", v), param=name)
            if n >= 0:
                out["max_tokens"] = n  # -1: until the end, -2: until the context is full (both: no limit)
        elif k == "num_ctx":
            num_ctx = _number(v, name, integer=True)
            if num_ctx <= 0:
                raise E.APIError(400, E.invalid_value(name, "a positive integer", v), param=name)
        elif k == "stop":
            if isinstance(v, str):
                v = [v]
            if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
                raise _bad_type(name, "an array of strings", v)
            out["stop"] = v
    return num_ctx


def _think(v: Any, out: dict) -> None:
    if v is None:
        return
    if isinstance(v, bool):
        out["think"] = v
    elif isinstance(v, str) and v in THINK_LEVELS:
        out["reasoning_effort"] = v
    else:
        raise E.APIError(400, E.invalid_value("think", "true, false, 'low', 'medium' or 'high'", v), param="think")


def _images(v: Any, name: str) -> list[dict]:
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(i, str) for i in v):
        raise _bad_type(name, "an array of base64 strings", v)
    # Ollama sends bare base64: name the media type from the file's first bytes
    return [{"type": "image_url", "image_url": {"url": f"data:{_media_type(i)};base64,{i}"}} for i in v]


def _media_type(b64: str) -> str:
    return "image/jpeg" if b64.startswith("/9j/") else "image/png"  # JPEG's FF D8 FF; else PNG (or refused)


def _content(text: Any, images: list[dict], name: str) -> Any:
    if text is not None and not isinstance(text, str):
        raise _bad_type(name, "a string", text)
    if not images:
        return text or ""
    return ([{"type": "text", "text": text}] if text else []) + images


def _tool_calls(v: Any, name: str) -> list[dict]:
    if not isinstance(v, list):
        raise _bad_type(name, "an array", v)
    out = []
    for i, c in enumerate(v):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise E.APIError(400, E.missing_field(f"{name}[{i}].function.name"), param=f"{name}[{i}].function.name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            text = args
        elif isinstance(args, dict):
            text = json.dumps(args, ensure_ascii=False)
        else:
            raise _bad_type(f"{name}[{i}].function.arguments", "an object", args)
        out.append({"id": c.get("id") or "", "type": "function", "function": {"name": fn["name"], "arguments": text}})
    return out


def _message(m: Any, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad_type(where, "an object", m)
    _refuse_unknown(m, MESSAGE_FIELDS, where + ".")
    role = m.get("role")
    if not isinstance(role, str):
        raise E.APIError(400, E.missing_field(where + ".role"), param=where + ".role")
    out: dict = {
        "role": role,
        "content": _content(m.get("content"), _images(m.get("images"), where + ".images"), where),
    }
    if m.get("thinking") is not None:
        if not isinstance(m["thinking"], str):
            raise _bad_type(where + ".thinking", "a string", m["thinking"])
        out["reasoning_content"] = m["thinking"]
    if m.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(m["tool_calls"], where + ".tool_calls")
    if m.get("tool_name") is not None:
        if not isinstance(m["tool_name"], str):
            raise _bad_type(where + ".tool_name", "a string", m["tool_name"])
        out["name"] = m["tool_name"]
    return out


def translate(kind: str, body: Any) -> OllamaRequest:
    """An /api/chat (`kind` chat) or /api/generate body -> the pipeline's request."""
    if not isinstance(body, dict):
        raise _bad_type("body", "an object", body)
    _refuse_unknown(body, CHAT_FIELDS if kind == "chat" else GENERATE_FIELDS)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise E.APIError(400, E.missing_field("model"), param="model", code="missing_required_parameter")
    fmt = body.get("format")
    if fmt not in (None, "") and fmt != "json" and not isinstance(fmt, dict):
        raise _bad_type("format", '"json" or a JSON schema object', fmt)
    stream = body.get("stream", True)  # Ollama streams unless told not to
    if stream is None:
        stream = True
    if not isinstance(stream, bool):
        raise _bad_type("stream", "a boolean", stream)
    ka = body.get("keep_alive")
    if ka is not None and (isinstance(ka, bool) or not isinstance(ka, (str, int, float))):
        raise _bad_type("keep_alive", "a duration string or a number", ka)
    out: dict = {"model": model_name(model), "stream": stream}
    if fmt == "json":  # structured output (serve/grammar.py): any JSON object
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):  # a JSON schema the answer must validate against
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    num_ctx = _options(body.get("options"), out)
    _think(body.get("think"), out)
    req = OllamaRequest(kind, "chat", out, model, stream, num_ctx)
    if kind == "chat":
        msgs = body.get("messages")
        if msgs is None or msgs == []:
            req.load_only = True
            return req
        if not isinstance(msgs, list):
            raise _bad_type("messages", "an array", msgs)
        out["messages"] = [_message(m, i) for i, m in enumerate(msgs)]
        if body.get("tools") is not None:
            out["tools"] = body["tools"]  # Ollama's tools are Chat Completions' function tools
        return req
    for name in ("suffix", "template"):  # fill-in-the-middle and per-request templates
        if body.get(name) not in (None, ""):
            raise _unsupported(name)
    if body.get("context") not in (None, []):
        raise _unsupported("context")
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise _bad_type("prompt", "a string", prompt)
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise _bad_type("raw", "a boolean", raw)
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise _bad_type("system", "a string", system)
    images = _images(body.get("images"), "images")
    if not prompt and not images:
        req.load_only = True
        return req
    if raw:  # the prompt as it is: legacy completions
        if system or images:
            raise _unsupported("system" if system else "images")
        out.pop("think", None)
        out.pop("reasoning_effort", None)
        out["prompt"] = prompt
        req.api = "completions"
        return req
    out["messages"] = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": _content(prompt, images, "prompt")}
    ]
    return req


def num_ctx_limit(num_ctx: int | None, server_ctx: int, prompt_tokens: int, max_tokens: int | None, default: int):
    """options.num_ctx: refused above --ctx; else the prompt must fit it and the output is
    capped to what is left.  Returns the job's max_tokens."""
    if num_ctx is None:
        return max_tokens
    if num_ctx > server_ctx:
        raise E.APIError(
            400, E.invalid_value("options.num_ctx", f"at most the server's context ({server_ctx})", num_ctx)
        )
    if prompt_tokens >= num_ctx:
        raise E.context_error(prompt_tokens, num_ctx, "messages")
    room = num_ctx - prompt_tokens
    return min(default if max_tokens is None else max_tokens, room)


def load_body(req: OllamaRequest) -> bytes:
    """An empty chat / generate: the model is loaded (it always is)."""
    doc: dict = {"model": req.model, "created_at": timestamp()}
    if req.kind == "chat":
        doc["message"] = {"role": "assistant", "content": ""}
    else:
        doc["response"] = ""
    doc.update(done=True, done_reason="load")
    return body_bytes(doc)


# --- response ----------------------------------------------------------------------------


def _arguments(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except ValueError:  # the parser hands out JSON; keep the text rather than lose it
        return text


class OllamaAdapter:
    """Engine events -> Ollama chat / generate objects.  `timer` (serve/metrics.RequestTimer)
    gives the durations of the final object."""

    stream_class = sse.NDJSONStream

    def __init__(self, info: RequestInfo, kind: str, timer):
        self.info = info
        self.kind = kind
        self.timer = timer

    def _head(self) -> dict:
        return {"model": self.info.model, "created_at": timestamp()}

    def _piece(self, content: str = "", thinking: str | None = None, calls: list | None = None) -> dict:
        if self.kind == "chat":
            msg: dict = {"role": "assistant", "content": content}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = calls
            return {"message": msg}
        doc: dict = {"response": content}
        if thinking:
            doc["thinking"] = thinking
        return doc

    def _stats(self, fin: Finish) -> dict:
        t, u = self.timer, fin.usage
        ns = 1_000_000_000
        return {
            "done": True,
            "done_reason": DONE_REASONS.get(fin.reason, "stop"),
            "total_duration": int(t.total_s * ns),
            "load_duration": 0,  # loaded at server start
            "prompt_eval_count": u.prompt_tokens,
            "prompt_eval_duration": int(t.prefill_s * ns),
            "eval_count": u.completion_tokens,
            "eval_duration": int(t.decode_s * ns),
        }

    @staticmethod
    def _call(name: str, arguments: str) -> dict:
        return {"function": {"name": name, "arguments": _arguments(arguments)}}

    # -- streaming ----------------------------------------------------------------
    def start(self, started) -> list[bytes]:
        return []

    def event(self, ev) -> list[bytes]:
        if isinstance(ev, TextDelta) and ev.text:
            piece = self._piece(ev.text)
        elif isinstance(ev, ReasoningDelta) and ev.text:
            piece = self._piece("", ev.text)
        elif isinstance(ev, ToolCallEnd):  # Ollama sends each call whole
            piece = self._piece("", None, [self._call(ev.name, ev.arguments)])
        else:
            return []
        return [sse.ndjson({**self._head(), **piece, "done": False})]

    def finish(self, fin: Finish) -> list[bytes]:
        return [sse.ndjson({**self._head(), **self._piece(), **self._stats(fin)})]

    @staticmethod
    def error_chunk(message: str) -> bytes:
        return sse.ndjson(E.sse_error_payload("ollama", message))

    # -- non-streaming --------------------------------------------------------------
    def body(self, fin: Finish) -> bytes:
        content, reasoning, calls = parsed_parts(fin)
        piece = self._piece(content, reasoning, [self._call(c.name, c.arguments) for c in calls])
        return body_bytes({**self._head(), **piece, **self._stats(fin)})


# --- model routes ------------------------------------------------------------------------


def _details(family: str) -> dict:
    return {
        "parent_model": "",
        "format": "gguf",
        "family": family,
        "families": [family],
        "parameter_size": "",
        "quantization_level": "",
    }


def _digest(model_id: str) -> str:
    """An identifier for the loaded model (a hash of its id, not of its weights)."""
    return hashlib.sha256(model_id.encode("utf-8")).hexdigest()


def tags(model_id: str, family: str, started: float) -> dict:
    name = model_id + TAG
    return {
        "models": [
            {
                "name": name,
                "model": name,
                "modified_at": timestamp(started),
                "size": 0,
                "digest": _digest(model_id),
                "details": _details(family),
            }
        ]
    }


def ps(model_id: str, family: str, ctx: int) -> dict:
    name = model_id + TAG
    return {
        "models": [
            {
                "name": name,
                "model": name,
                "size": 0,
                "digest": _digest(model_id),
                "details": _details(family),
                "expires_at": NEVER,
                "size_vram": 0,
                "context_length": ctx,
            }
        ]
    }


SHOW_FIELDS = frozenset({"model", "name", "verbose"})


def show_model(body: Any) -> str:
    if not isinstance(body, dict):
        raise _bad_type("body", "an object", body)
    _refuse_unknown(body, SHOW_FIELDS)
    name = body.get("model", body.get("name"))
    if not isinstance(name, str) or not name:
        raise E.APIError(400, E.missing_field("model"), param="model")
    return name


def show(model_id: str, family: str, ctx: int, started: float, vision: bool) -> dict:
    caps = ["completion", "tools", "thinking"] + (["vision"] if vision else [])
    return {
        "modelfile": "",
        "parameters": "",
        "template": "",
        "details": _details(family),
        "model_info": {"general.architecture": family, f"{family}.context_length": ctx},
        "capabilities": caps,
        "modified_at": timestamp(started),
    }


def version() -> dict:
    return {"version": OLLAMA_API_VERSION}
