"""A parsed request body -> an engine `Job` (validated, rendered, tokenized).

Runs off the event loop (tokenizing a long prompt takes a while).  Every
refusal is an `APIError` (4xx) raised before the job is queued: request shape
(each API's parser: serve/openai.py, anthropic.py, responses.py, completions.py), model name, sampling controls, tool_choice, live
tool-continuation ids, and the context check (docs/http-api.md §1.6).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

from ..chat import markers as M
from ..chat.images import ImageError, conversation_images
from ..chat.messages import Conversation, ToolCall, live_tail
from ..chat.protocol import ChatProtocol, EffortError, get_protocol, request_effort
from ..chat.requests import RequestError
from ..engine import Job, LiveBinding
from ..vision.prompt import ERR_IMAGE_HISTORY, ImagePromptError
from ..vision.prompt import attach as attach_images
from . import errors as E
from .anthropic import parse_anthropic
from .completions import echo_of, parse_completion
from .grammar import grammar_of, strict_call_grammar_of
from .openai import parse_chat
from .params import parse_controls
from .responses import parse_responses
from .validate import validate_body

REQUEST_API = {"chat": "openai", "completions": "completions", "anthropic": "anthropic", "responses": "responses"}
CONTEXT_PARAM = {"chat": "messages", "completions": "prompt", "anthropic": "messages", "responses": "input"}


def live_binding(api: str, summary: bool = False) -> LiveBinding | None:
    """The live tool state a request of `api` keeps on the engine (docs/kv-cache.md §2
    steps 1-4): Responses remembers each turn's visible transcript, Anthropic a tool
    turn's call ids; the engine asks neither by name."""
    if api == "responses":
        return LiveBinding(api, visible=True, summary=summary, missing=E.RESPONSES_STATE_GONE)
    if api == "anthropic":
        return LiveBinding(api, missing=E.ANTHROPIC_STATE_GONE)
    return None


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


# --- continuation validation (docs/http-api.md §1.6) --------------------------------------


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


@dataclass
class ServeConfig:
    ctx: int = 32768
    tokens: int = 393216  # default max output tokens (--tokens)
    model_id: str = ""  # "" = the loaded family's id (chat/protocol.py)
    model_name: str = ""  # "" = the loaded family's display name
    aliases: tuple = ()  # extra accepted model names (fnmatch patterns)
    family: str | None = None  # chat protocol family; None = the engine's (set by make_app)
    chat_template: str | None = None  # --chat-template; None = the engine's (set by make_app)
    think_level: int | None = None  # default level 0..100 for numeric-effort families (--think-level)
    think: str = "high"  # --think / --think-max / --nothink: the mode of requests that set none
    system: str = ""  # -sys: the system prompt of chat requests that bring none
    prefix: tuple = ()  # --prefix-file turns (chat.messages.Message), after the system prompt
    cors: bool = False
    keepalive_s: float = 5.0  # ": prefill" comment interval while a streamed prefill runs
    max_body_mb: int = 64
    replay: bool = True  # exact DSML tool replay (--disable-exact-dsml-tool-replay turns it off)
    trace: str | None = None
    strict: bool = True  # 400 for empty messages / unknown roles (our issue; ds4 accepts them)
    # 404 for a model name that is not the loaded model's (--strict-model); by default any
    # name is served by the loaded model, as ds4 does (clients left on their default id)
    strict_model: bool = False
    api_keys: tuple = ()  # --api-key / --api-key-file: required on every route but /health (serve/auth.py)
    root_path: str = ""  # --root-path: the prefix a reverse proxy serves us under (serve/transport.py)


@dataclass
class Prepared:
    api: str
    job: Job
    model: str
    stream: bool
    include_usage: bool
    thinking: str
    reasoning_summary: bool = False
    tool_aliases: dict = field(default_factory=dict)
    prompt_tokens: int = 0
    sampling_overridden: tuple = ()  # serve/params.SAMPLING_OVERRIDDEN_HEADER


def protocol_of(cfg: ServeConfig) -> ChatProtocol:
    return get_protocol(cfg.family, cfg.chat_template)


def model_known(cfg: ServeConfig, name: str) -> bool:
    """Any name, unless `strict_model`: then the loaded family's id or aliases,
    `cfg.model_id`, or an --alias pattern."""
    if not cfg.strict_model or name == cfg.model_id or protocol_of(cfg).knows_model(name):
        return True
    return any(fnmatch.fnmatchcase(name, pat) for pat in cfg.aliases)


def _tool_names(api: str, body: dict) -> set[str]:
    names: set[str] = set()
    tools = body.get("tools")
    if not isinstance(tools, list):
        return names
    for t in tools:
        if not isinstance(t, dict):
            continue
        fn = t.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
        elif isinstance(t.get("name"), str):
            names.add(t["name"])
    return names


def _check_tool_choice(api: str, body: dict, proto: ChatProtocol | None = None) -> str | None:
    """Validate tool_choice and return the text to force at the start of the
    answer: "required" / Anthropic "any" open a DSML block and an invoke tag
    (the model picks the tool), a named tool also writes the name (it must be
    declared, else 400).  auto / none force nothing (none disables tools)."""
    tc = body.get("tool_choice")
    if tc is None or api not in ("chat", "anthropic", "responses"):
        return None
    name = None
    required = (api in ("chat", "responses") and tc == "required") or (
        api == "anthropic" and isinstance(tc, dict) and tc.get("type") == "any"
    )
    if isinstance(tc, dict):
        if api == "responses":  # {"type": "function", "name": X}
            name = tc.get("name")
            if not isinstance(name, str):
                raise E.APIError(400, E.INVALID_JSON, param="tool_choice")
        elif api == "chat":
            fn = tc.get("function")
            if tc.get("type") == "function" and isinstance(fn, dict):
                name = fn.get("name")
                if not isinstance(name, str):
                    raise E.APIError(400, E.INVALID_JSON, param="tool_choice")
        elif tc.get("type") == "tool":
            name = tc.get("name")
            if not isinstance(name, str):
                raise E.APIError(400, E.INVALID_JSON, param="tool_choice")
    if name is not None and name not in _tool_names(api, body):
        raise E.APIError(400, E.unknown_tool(name), param="tool_choice")
    proto = proto or get_protocol()
    if name is not None:
        if not _has_parameters(api, body, name):  # nothing for the model to choose: force the whole call
            whole = proto.render_calls([ToolCall("", name, "{}")])
            head = proto.force_text(name)
            if whole.startswith(head):
                return whole
        return proto.force_text(name)
    return proto.force_text(None) if required else None


def _has_parameters(api: str, body: dict, name: str) -> bool:
    """The named tool declares at least one parameter (an unreadable schema counts as yes)."""
    for t in body.get("tools") or []:
        if not isinstance(t, dict):
            continue
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        if fn.get("name") != name:
            continue
        schema = fn.get("input_schema" if api == "anthropic" else "parameters")
        if schema is None:
            return False
        if not isinstance(schema, dict):
            return True
        props = schema.get("properties")
        return not (props is None or props == {}) or bool(schema.get("required"))
    return True


def _single_tool_call(api: str, body: dict) -> bool:
    """At most one tool call per turn: `parallel_tool_calls: false` (OpenAI), or
    `tool_choice.disable_parallel_tool_use: true` (Anthropic)."""
    if api == "anthropic":
        tc = body.get("tool_choice")
        return isinstance(tc, dict) and tc.get("disable_parallel_tool_use") is True
    return body.get("parallel_tool_calls") is False


def force_text(name: str | None, proto: ChatProtocol | None = None) -> str:
    """The tool-call opening forced by tool_choice required (name=None) or a
    named tool (DeepSeek V4 DSML unless another family's protocol is given)."""
    return (proto or get_protocol()).force_text(name)


def _thinking(cfg: ServeConfig, proto: ChatProtocol, body: dict, mode: str, effort, model: str) -> str:
    """The family's thinking mode (chat/protocol.py) from the shared parser's mode."""
    if effort is None and cfg.think_level is not None and proto.numeric_effort and mode != "none":
        effort = cfg.think_level
    explicit = isinstance(body, dict) and ("thinking" in body or "think" in body)
    if (
        cfg.think != "high"
        and not explicit
        and effort is None
        and mode == "high"
        and model not in proto.chat_aliases + proto.reasoner_aliases
    ):
        from ..cli.think_flags import resolve  # the server's --nothink / --think-max default

        return resolve(proto, cfg.think, cfg.ctx).mode
    try:
        return proto.resolve_thinking(mode, effort, explicit=explicit, model=model, ctx=cfg.ctx)
    except EffortError as e:
        raise E.APIError(400, str(e), param="reasoning_effort") from None


def _attach_images(engine, job: Job, conv) -> bool:
    """The request's images as token blocks in job.prompt_ids (docs/vision.md §1); False
    without images.  Refusals are 400s in the API's shape."""
    images = conversation_images(conv.messages)
    if not images:
        return False
    if job.requires_live:  # the image blocks must be in the prompt, not behind a live state
        raise E.APIError(400, ERR_IMAGE_HISTORY, param=CONTEXT_PARAM[job.api])
    try:
        attach_images(job, engine, images)
    except (ImagePromptError, ImageError) as e:
        raise E.APIError(400, e.message, param=CONTEXT_PARAM[job.api]) from None
    return True


def prepare(cfg: ServeConfig, engine, tool_memory, api: str, body: dict) -> Prepared:
    # every known field of the wrong type: a 400 naming it (image parts only with --vision)
    validate_body(api, body, vision=getattr(engine, "vision", None) is not None)
    proto = protocol_of(cfg)
    parser_body, effort = request_effort(api, body, numeric=proto.numeric_effort)
    try:
        req = parse_request(REQUEST_API[api], parser_body, ctx=cfg.ctx, strict=cfg.strict)
    except RequestError as e:
        if e.message == E.INVALID_JSON:  # the JSON was valid: name the field the parser refused
            field = e.param or CONTEXT_PARAM[api]
            raise E.APIError(e.status, E.invalid_field(field), param=field, code="invalid_value") from None
        raise E.APIError(e.status, e.message, param=e.param) from None
    if not isinstance(body.get("model"), str):
        req.model = cfg.model_id or proto.model_id  # no model named: the loaded one
    model = req.model
    if not model_known(cfg, model):
        raise E.APIError(404, E.unknown_model(model), param="model", code="model_not_found")
    req.thinking = _thinking(cfg, proto, body, req.thinking, effort, model)
    vocab = getattr(engine.tokenizer, "vocab_size", None)  # logit_bias ids are checked against it
    ctl = parse_controls(api, body, req.thinking, vocab)
    job = Job(
        prompt_text="",
        api=api,
        thinking=req.thinking,
        params=ctl.params,
        max_tokens=ctl.max_tokens,
        stop=list(req.stop),
        ignore_eos=ctl.ignore_eos,
        tool_id_prefix=M.ANTHROPIC_TOOL_ID_PREFIX if api == "anthropic" else M.OPENAI_TOOL_ID_PREFIX,
        family=proto.family,
        logprobs=ctl.logprobs,
    )
    job.grammar = grammar_of(api, body)  # structured output: a 400 for a grammar that does not compile
    prep = Prepared(api, job, model, ctl.stream, ctl.include_usage, req.thinking)
    prep.sampling_overridden = ctl.overridden
    if api == "completions":
        job.raw = True
        job.prompt_text = proto.render_completion(req.prompt, req.thinking)
        job.echo = req.prompt if echo_of(body) else None
    else:
        conv = req
        if cfg.system or cfg.prefix:
            from ..cli.prefix_file import with_head

            conv.messages = with_head(conv.messages, cfg.system, cfg.prefix)
        forced = _check_tool_choice(api, body, proto)
        memory = tool_memory if cfg.replay else None
        if memory is not None:
            memory.attach(conv)
        job.prompt_text = proto.render(conv, memory)
        job.tools_active = bool(conv.tools_active and conv.tool_schemas)
        job.tool_schemas = tuple(conv.tool_schemas) if job.tools_active else ()
        job.force_text = forced if job.tools_active else None
        if job.tools_active:  # strict tools: a forced call's arguments held to their schemas
            job.tool_grammar = strict_call_grammar_of(api, body, forced, proto, engine.tokenizer)
        job.single_tool_call = job.tools_active and _single_tool_call(api, body)
        job.preserves_reasoning = proto.uses_tool_context(conv)
        job.binding = live_binding(api, conv.reasoning_summary)
        prep.reasoning_summary = conv.reasoning_summary
        prep.tool_aliases = dict(conv.tool_aliases)
        if api in ("anthropic", "responses"):
            tail = live_tail(conv, api)
            if tail is not None:
                start, ids = tail
                job.continuation_tail = proto.render_continuation_tail(conv, start, memory)
                if job.continuation_tail is not None:
                    job.continuation_ids = frozenset(ids)
            unreplayed = unreplayed_tool_result_ids(conv)
            if unreplayed:
                live = engine.live_call_ids(api)
                for i in unreplayed:
                    if i not in live:
                        msg = E.responses_unknown_call(i) if api == "responses" else E.anthropic_unknown_tool_use(i)
                        raise E.APIError(400, msg, param=CONTEXT_PARAM[api])
                job.requires_live = True
    if api != "completions" and _attach_images(engine, job, conv):
        if len(job.prompt_ids) >= cfg.ctx:
            raise E.context_error(len(job.prompt_ids), cfg.ctx, CONTEXT_PARAM[api])
        prep.prompt_tokens = len(job.prompt_ids)
        return prep
    # Refuse what cannot fit before tokenizing: BPE over tens of MiB costs seconds
    # and gigabytes for a request that is refused anyway.
    floor = engine.min_tokens(job.prompt_text)
    if floor >= cfg.ctx:
        raise E.context_error(floor, cfg.ctx, CONTEXT_PARAM[api], at_least=True)
    ids, complete = engine.tokenize_prefix(job.prompt_text, cfg.ctx)
    if len(ids) >= cfg.ctx:
        raise E.context_error(len(ids), cfg.ctx, CONTEXT_PARAM[api], at_least=not complete)
    job.prompt_ids = ids
    prep.prompt_tokens = len(ids)
    return prep
