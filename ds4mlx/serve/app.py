"""The aiohttp application: routes, error shapes, CORS, streaming, trace.

One engine (one worker thread, FIFO) serves any number of connections.  A
generation handler validates and renders the request off the event loop,
queues the job, then either collects the events (non-streaming) or prints
them as SSE.  While a streamed job waits in the queue, the headers and
`: queued N` comments (N = its queue position) go out every `keepalive_s`
seconds; while its prefill runs, `: prefill` comments.  A client that disconnects (the handler is cancelled,
`handler_cancellation=True`) or whose stream write fails cancels its job at
the next prefill-chunk / token boundary, queued jobs included.

Around the routes (docs/http-api.md §9): API keys checked before any handler
(serve/auth.py), every request counted for GET /metrics (serve/metrics.py), the
operator endpoints (serve/ops.py) and the Ollama API (serve/ollama.py, NDJSON
streams instead of SSE).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
import uuid
from typing import Any

from aiohttp import web

from ..engine import Engine, Failed
from ..runtime.events import Finish, PrefillProgress, Started
from . import errors as E
from . import ollama, ops, sse
from .anthropic import AnthropicAdapter, refuse_threads
from .auth import APIKeys
from .common import RequestInfo, body_bytes, total_usage
from .completions import CompletionsAdapter, prompt_list
from .jsonin import parse_body
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import RequestTimer, ServerMetrics, stats_doc
from .openai import ChatAdapter
from .page import PAGE, page_file, wants_html
from .page import asset as page_asset
from .params import SAMPLING_OVERRIDDEN_HEADER, choice_count
from .prepare import ServeConfig, model_known, prepare, protocol_of
from .responses import ResponsesAdapter
from .transport import ROOT_PATH, make_runner

log = logging.getLogger("ds4mlx.serve")

ADAPTERS = {
    "chat": ChatAdapter,
    "completions": CompletionsAdapter,
    "anthropic": AnthropicAdapter,
    "responses": ResponsesAdapter,
}
OLLAMA_KINDS = {"ollama-chat": "chat", "ollama-generate": "generate"}
ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/messages": "anthropic",
    "/v1/responses": "responses",
    "/api/chat": "ollama-chat",
    "/api/generate": "ollama-generate",
}
CORS_HEADERS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
    "Access-Control-Allow-Headers": "*",
    "Access-Control-Expose-Headers": SAMPLING_OVERRIDDEN_HEADER,  # a browser client may read it
}
MODEL_CREATED = 1767225600
SUPPORTED_PARAMETERS = [
    "tools",
    "tool_choice",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "seed",
    "stream",
    "reasoning_effort",
    "ignore_eos",
]


class ServerState:
    def __init__(self, engine: Engine, cfg: ServeConfig, tool_memory=None):
        self.engine = engine
        self.cfg = cfg
        self.tool_memory = tool_memory
        self.seq = 0
        self.stopping = False
        self.requests = 0  # generation requests accepted into the queue
        self.keys = APIKeys(cfg.api_keys)
        self.metrics = ServerMetrics(engine)
        self.started = time.time()
        # slot index -> the text of its last job (prompt + output): GET /slots' cached prefix
        self.slot_text: dict[int, str] = {}
        self._trace_lock = threading.Lock()
        self._trace = open(cfg.trace, "a", encoding="utf-8") if cfg.trace else None

    def next_id(self, api: str) -> str:
        """A response id unique across restarts: each API's own prefix + random hex."""
        self.seq += 1
        prefix = {"completions": "cmpl-", "anthropic": "msg_", "responses": "resp_"}.get(api, "chatcmpl-")
        return prefix + uuid.uuid4().hex

    def submit(self, job, emit) -> tuple[Any, RequestTimer]:
        """Queue a job; its events are timed and its end counted for /metrics (on the
        engine thread, before the handler sees them: a scrape after the answer sees it)."""
        timer = RequestTimer()
        metrics = self.metrics
        handles: list = []

        def tracked(ev: Any) -> None:
            timer.see(ev)
            if isinstance(ev, (Finish, Failed)):
                metrics.finished(timer, ev)
                slot = handles[0].slot if handles else None
                if isinstance(ev, Finish) and slot is not None:
                    self.slot_text[slot] = job.prompt_text + ev.raw_text
            emit(ev)

        handle = self.engine.submit(job, tracked)
        handles.append(handle)
        self.requests += 1
        return handle, timer

    def trace(self, record: dict) -> None:
        if self._trace is None:
            return
        line = json.dumps(record, ensure_ascii=False, default=str)
        with self._trace_lock:
            self._trace.write(line + "\n")
            self._trace.flush()

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
            self._trace = None


STATE = web.AppKey("ds4mlx_state", ServerState)


def _api_of(path: str) -> str:
    return E.api_for_path(path)


def _cors(state: ServerState) -> dict:
    return dict(CORS_HEADERS) if state.cfg.cors else {}


def json_response(state: ServerState, status: int, payload: bytes) -> web.Response:
    return web.Response(status=status, body=payload, content_type="application/json", headers=_cors(state))


def error_response(state: ServerState, api: str, e: E.APIError) -> web.Response:
    resp = json_response(state, e.status, body_bytes(E.error_body(api, e)))
    if e.status == 413:
        resp.force_close()  # the unread body is not drained: this connection ends here
    if e.status == 401:
        resp.headers["WWW-Authenticate"] = "Bearer"
    return resp


def _handler_label(request: web.Request) -> str:
    """The route a request matched (its pattern: bounded label values), for /metrics."""
    route = getattr(request.match_info, "route", None)
    resource = getattr(route, "resource", None)
    canonical = getattr(resource, "canonical", None)
    return "unknown" if canonical is None or canonical == "/{tail}" else canonical


def _max_body(cfg: ServeConfig) -> int:
    return max(1, cfg.max_body_mb) * 1024 * 1024


@web.middleware
async def _middleware(request: web.Request, handler):
    state = request.app[STATE]
    resp = None
    try:
        resp = await _handle(request, handler, state)
        return resp
    finally:
        if resp is not None:
            state.metrics.count_http(_handler_label(request), request.method, resp.status)


async def _handle(request: web.Request, handler, state: ServerState):
    api = _api_of(request.path)
    try:
        if not state.keys.allows(request.method, request.path, request.headers):
            raise E.APIError(401, E.UNAUTHORIZED, code="invalid_api_key")
        return await handler(request)
    except E.APIError as e:
        return error_response(state, api, e)
    except web.HTTPException as e:
        if e.status == 413:
            msg = E.BODY_TOO_LARGE
        elif e.status == 404:
            msg = E.UNKNOWN_ENDPOINT
        elif e.status == 405:
            msg = E.METHOD_NOT_ALLOWED
        else:
            msg = E.BAD_HTTP
        return error_response(state, api, E.APIError(e.status if e.status >= 400 else 400, msg))
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as e:  # a bug: answer 500 and keep serving
        log.exception("request failed: %s %s", request.method, request.path)
        return error_response(state, api, E.APIError(500, E.internal_error(type(e).__name__)))


# -- routes ---------------------------------------------------------------------------------
def _model_object(cfg: ServeConfig) -> dict:
    maxc = min(cfg.tokens, cfg.ctx)
    proto = protocol_of(cfg)  # the loaded model's family
    return {
        "id": cfg.model_id or proto.model_id,
        "object": "model",
        "created": MODEL_CREATED,
        "owned_by": "ds4.c",
        "name": cfg.model_name or proto.model_name,
        "aliases": list(proto.aliases),
        "context_length": cfg.ctx,
        "top_provider": {"context_length": cfg.ctx, "max_completion_tokens": maxc, "is_moderated": False},
        "supported_parameters": SUPPORTED_PARAMETERS,
    }


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return json_response(state, 200, body_bytes({"object": "list", "data": [_model_object(state.cfg)]}))


async def model_one(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    if not model_known(state.cfg, name):
        raise E.APIError(404, E.unknown_model(name), param="model", code="model_not_found")
    return json_response(state, 200, body_bytes(_model_object(state.cfg)))


async def debug_stats(request: web.Request) -> web.Response:
    """GET /v1/ds4mlx/stats: engine counters (`prefill_tokens` = prompt tokens
    actually evaluated since start) and the disk KV cache's, for tests and debugging."""
    state = request.app[STATE]
    return json_response(state, 200, body_bytes(stats_doc(state.engine)))


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: the Prometheus text format (serve/metrics.py)."""
    state = request.app[STATE]
    resp = web.Response(status=200, body=state.metrics.render(), headers=_cors(state))
    resp.headers["Content-Type"] = METRICS_CONTENT_TYPE
    return resp


# -- operator endpoints (serve/ops.py) ---------------------------------------------------
async def slots(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return json_response(state, 200, body_bytes(ops.slots_view(state.engine, state.slot_text)))


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = parse_body(await request.read())
    text, body = ops.tokenize_text(body)
    if isinstance(body.get("model"), str) and not model_known(state.cfg, body["model"]):
        raise E.APIError(404, E.unknown_model(body["model"]), param="model", code="model_not_found")
    loop = asyncio.get_running_loop()
    if text is None:  # messages: the prompt the chat route renders for them
        chat = {k: body[k] for k in ("messages", "tools", "model") if k in body}
        prep = await loop.run_in_executor(None, prepare, state.cfg, state.engine, state.tool_memory, "chat", chat)
        ids = list(prep.job.prompt_ids or [])
    else:
        ids = await loop.run_in_executor(None, state.engine.tokenize, text)
    return json_response(state, 200, body_bytes(ops.tokenize_answer(state.engine.tokenizer, ids, body, state.cfg.ctx)))


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = parse_body(await request.read())
    return json_response(state, 200, body_bytes(ops.detokenize(state.engine.tokenizer, body)))


# -- the Ollama API's model routes (serve/ollama.py) ------------------------------------
def _ollama_model(state: ServerState) -> tuple[str, str]:
    proto = protocol_of(state.cfg)
    return state.cfg.model_id or proto.model_id, proto.family


async def ollama_version(request: web.Request) -> web.Response:
    return json_response(request.app[STATE], 200, body_bytes(ollama.version()))


async def ollama_tags(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model_id, family = _ollama_model(state)
    return json_response(state, 200, body_bytes(ollama.tags(model_id, family, state.started)))


async def ollama_ps(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model_id, family = _ollama_model(state)
    return json_response(state, 200, body_bytes(ollama.ps(model_id, family, state.cfg.ctx)))


async def ollama_show(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = ollama.show_model(parse_body(await request.read()))
    if not model_known(state.cfg, ollama.model_name(name)):
        raise E.APIError(404, E.ollama_model_not_found(name))
    model_id, family = _ollama_model(state)
    vision = getattr(state.engine, "vision", None) is not None
    return json_response(state, 200, body_bytes(ollama.show(model_id, family, state.cfg.ctx, state.started, vision)))


async def health(request: web.Request) -> web.Response:
    """GET /health (guidellm's backend check, load balancers) and GET/HEAD /."""
    state = request.app[STATE]
    if state.stopping:
        raise E.APIError(503, E.SHUTTING_DOWN)
    return json_response(state, 200, body_bytes({"status": "ok"}))


async def root(request: web.Request) -> web.Response:
    """GET/HEAD /: the chat page for a browser (docs/chat-page.md), the health body for the rest."""
    resp = page_file(PAGE) if wants_html(request) else await health(request)
    resp.headers["Vary"] = "Accept"  # one URL, two bodies: a cache must tell them apart
    return resp


COUNT_ROUTES = {"/v1/messages/count_tokens": "anthropic", "/v1/responses/input_tokens": "responses"}


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt tokens a generation request would have, without generating
    (Anthropic count_tokens, Responses input_tokens)."""
    state = request.app[STATE]
    api = COUNT_ROUTES[request.path]
    body = parse_body(await request.read())
    if api == "anthropic" and isinstance(body, dict) and "max_tokens" not in body:
        body = {**body, "max_tokens": 1}  # count_tokens bodies carry none
    loop = asyncio.get_running_loop()
    prep = await loop.run_in_executor(None, prepare, state.cfg, state.engine, state.tool_memory, api, body)
    if api == "anthropic":
        doc = {"input_tokens": prep.prompt_tokens}
    else:
        doc = {"object": "response.input_tokens", "input_tokens": prep.prompt_tokens}
    return json_response(state, 200, body_bytes(doc))


async def options(request: web.Request) -> web.Response:
    return web.Response(status=204, headers=_cors(request.app[STATE]))


async def unknown(request: web.Request) -> web.Response:
    raise E.APIError(404, E.UNKNOWN_ENDPOINT)


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    api = ROUTES[request.path]
    if state.stopping:
        raise E.APIError(503, E.SHUTTING_DOWN)
    if (request.content_length or 0) > _max_body(state.cfg):
        raise E.APIError(413, E.BODY_TOO_LARGE)  # refused before a byte of the body is read
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise E.APIError(413, E.BODY_TOO_LARGE) from None
    loop = asyncio.get_running_loop()
    body = await loop.run_in_executor(None, parse_body, raw)  # a big body must not block the loop
    if api == "anthropic":  # message threads: refused by name (anthropic.py)
        refuse_threads(body, request.headers.get("anthropic-beta", ""))
    prompts = prompt_list(body) if api == "completions" else None
    n = choice_count(api, body)
    if prompts is not None or n > 1:
        return await _choices(request, state, api, body, prompts, n)
    oreq = None  # an Ollama request: translated into the pipeline's body (serve/ollama.py)
    pipeline_api, pipeline_body = api, body
    if api in OLLAMA_KINDS:
        oreq = ollama.translate(OLLAMA_KINDS[api], body)
        if oreq.load_only:
            return json_response(state, 200, ollama.load_body(oreq))
        pipeline_api, pipeline_body = oreq.api, oreq.body
    prep = await loop.run_in_executor(
        None, prepare, state.cfg, state.engine, state.tool_memory, pipeline_api, pipeline_body
    )
    request[OVERRIDDEN] = prep.sampling_overridden
    if oreq is not None:
        prep.job.max_tokens = ollama.num_ctx_limit(
            oreq.num_ctx, state.cfg.ctx, prep.prompt_tokens, prep.job.max_tokens, state.cfg.tokens
        )
    info = RequestInfo(
        id=state.next_id(pipeline_api),
        model=oreq.model if oreq is not None else prep.model,
        created=int(time.time()),
        include_usage=prep.include_usage,
        thinking=prep.thinking,
        reasoning_summary=prep.reasoning_summary,
        tool_aliases=prep.tool_aliases,
    )
    queue: asyncio.Queue = asyncio.Queue()

    def emit(ev: Any) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ev)

    t0 = time.monotonic()
    handle, timer = state.submit(prep.job, emit)
    if oreq is not None:
        adapter = ollama.OllamaAdapter(info, oreq.kind, timer)
    else:
        adapter = ADAPTERS[api](info)
    result: dict = {"finish": None}
    try:
        if prep.stream:
            return await _stream(request, state, api, adapter, queue, handle, result)
        return await _collect(state, api, adapter, queue, result)
    finally:
        if not handle.done.is_set():
            handle.cancel()  # client gone (handler cancelled) or stream write failed
        fin = result.get("finish")
        state.trace(
            {
                "id": info.id,
                "time": time.time(),
                "route": request.path,
                "request": body,
                "prompt": prep.job.prompt_text,
                "stream": prep.stream,
                "cache_source": state.engine.stats.last_cache_source,
                "finish": getattr(fin, "reason", None),
                "error": getattr(fin, "error", None),
                "usage": getattr(fin, "usage", None).__dict__ if fin is not None else None,
                "raw_text": getattr(fin, "raw_text", None),
                "speculation": getattr(fin, "speculation", None),  # this request's speculative-decoding counters
                "response": result.get("body"),
                "seconds": round(time.monotonic() - t0, 3),
            }
        )


async def _choices(request, state, api: str, body: dict, prompts: list | None, n: int) -> web.StreamResponse:
    """Several choices in one response: /v1/completions with a list of prompts (one choice
    per prompt) and `n` choices per prompt on chat and completions (index = prompt x n +
    choice), generated in turn; a choice after the first reuses the prompt's KV (the
    engine's reuse ladder), so the prompt is prefilled once.  A seeded request's choice
    j samples with seed + j (the same seed would repeat the first choice)."""
    loop = asyncio.get_running_loop()
    preps = []
    for p in prompts or [None]:  # every prompt is validated before anything is queued
        one = body if p is None else {**body, "prompt": p}
        prep = await loop.run_in_executor(None, prepare, state.cfg, state.engine, state.tool_memory, api, one)
        preps += [prep] + [_another_choice(prep, j) for j in range(1, n)]
        request[OVERRIDDEN] = prep.sampling_overridden
    info = RequestInfo(
        id=state.next_id(api),
        model=preps[0].model,
        created=int(time.time()),
        include_usage=preps[0].include_usage,
        thinking=preps[0].thinking,
        tool_aliases=preps[0].tool_aliases,
    )
    out = sse.SSEStream(request, _cors(state)) if preps[0].stream else None
    fins: list = []
    for k, prep in enumerate(preps):
        adapter = ADAPTERS[api](info, index=k, last=k == len(preps) - 1)
        queue: asyncio.Queue = asyncio.Queue()
        handle, _ = state.submit(prep.job, lambda ev, q=queue: loop.call_soon_threadsafe(q.put_nowait, ev))
        try:
            while True:
                ev = await queue.get()
                if isinstance(ev, Failed):
                    if out is None or not out.started:
                        raise E.APIError(ev.status, ev.message)
                    await out.write(sse.event("error", E.sse_error_payload("openai", ev.message)))
                    await out.end()
                    return out.response
                if isinstance(ev, Started) and out is not None:
                    if not await out.write_all(adapter.start(ev)):
                        return out.response
                    continue
                if isinstance(ev, Finish):
                    fins.append(ev)
                    if out is not None:
                        await out.write_all(adapter.finish(ev, total_usage(fins)))
                    break
                if out is not None and not await out.write_all(adapter.event(ev)):
                    return out.response
        finally:
            if not handle.done.is_set():
                handle.cancel()
    if out is None:
        return json_response(state, 200, ADAPTERS[api](info).batch_body(fins))
    await out.end()
    return out.response


def _another_choice(prep, j: int):
    """Choice j of a prepared job: the same prompt, its own job (and seed when seeded)."""
    params = prep.job.params
    seed = (params.seed + j) & 0xFFFFFFFFFFFFFFFF if params.seed is not None else None
    job = dataclasses.replace(
        prep.job,
        params=dataclasses.replace(params, seed=seed),
        prompt_ids=None if prep.job.prompt_ids is None else list(prep.job.prompt_ids),
    )
    return dataclasses.replace(prep, job=job)


async def _collect(state, api, adapter, queue, result) -> web.Response:
    while True:
        ev = await queue.get()
        if isinstance(ev, Failed):
            result["finish"] = Finish("error", error=ev.message)
            raise E.APIError(ev.status, ev.message)
        if isinstance(ev, Finish):
            result["finish"] = ev
            payload = adapter.body(ev)
            result["body"] = payload.decode("utf-8", "replace")
            return json_response(state, 200, payload)


async def _stream(request, state, api, adapter, queue, handle, result) -> web.StreamResponse:
    out = getattr(adapter, "stream_class", sse.SSEStream)(request, _cors(state))
    in_prefill = False
    started = False  # the job left the queue (its first event came)
    keepalive = state.cfg.keepalive_s
    next_ping = 0.0  # while prefilling: a `: prefill` comment every keepalive_s, progress events or not
    while True:
        try:
            if in_prefill and out.started:
                ev = await asyncio.wait_for(queue.get(), timeout=max(0.0, next_ping - time.monotonic()))
            elif not started:
                ev = await asyncio.wait_for(queue.get(), timeout=keepalive)
            else:
                ev = await queue.get()
        except asyncio.TimeoutError:
            if in_prefill and out.started:
                if not await out.keepalive():
                    break
                next_ping = time.monotonic() + keepalive
                continue
            # still queued: headers now and a comment with the queue position, so a
            # client's first-byte timeout does not run out while others are served
            position = state.engine.queue_position(handle)
            if position and not await out.keepalive(sse.queued_comment(position)):
                break
            continue
        started = True
        if isinstance(ev, PrefillProgress):
            if not out.started and not await out.start():
                break
            if not in_prefill:
                next_ping = time.monotonic() + keepalive
            in_prefill = True
            if time.monotonic() >= next_ping:
                if not await out.keepalive():
                    break
                next_ping = time.monotonic() + keepalive
            continue
        if isinstance(ev, Failed):
            result["finish"] = Finish("error", error=ev.message)
            if not out.started:
                raise E.APIError(ev.status, ev.message)
            error_chunk = getattr(adapter, "error_chunk", None)
            await out.write(
                error_chunk(ev.message) if error_chunk else sse.event("error", E.sse_error_payload(api, ev.message))
            )
            break
        if isinstance(ev, Started):
            in_prefill = False
            if not await out.write_all(adapter.start(ev)):
                break
            continue
        if isinstance(ev, Finish):
            result["finish"] = ev
            await out.write_all(adapter.finish(ev))
            break
        if not await out.write_all(adapter.event(ev)):
            break
    if out.closed:
        handle.cancel()
    await out.end()
    return out.response


# request key: the fields thinking mode replaced (a typed key where aiohttp has them)
OVERRIDDEN = web.RequestKey("ds4mlx_sampling_overridden", tuple) if hasattr(web, "RequestKey") else "ds4mlx.overridden"


async def _say_overridden(request: web.Request, response: web.StreamResponse) -> None:
    """Thinking mode's fixed sampling replaced fields the client sent: the response says which
    (streamed or not), so a harness asking for temperature 0 is not sampled silently."""
    fields = request.get(OVERRIDDEN)
    if fields:
        response.headers[SAMPLING_OVERRIDDEN_HEADER] = ", ".join(fields)


def make_app(engine: Engine, cfg: ServeConfig | None = None, tool_memory=None) -> web.Application:
    cfg = cfg or ServeConfig(ctx=engine.ctx, tokens=engine.default_max_tokens)
    if cfg.family is None:  # serve the loaded model's chat protocol (and its --chat-template)
        proto = getattr(engine, "protocol", None)
        cfg.family = proto.family if proto is not None else None
        cfg.chat_template = proto.chat_template if proto is not None else None
    app = web.Application(middlewares=[_middleware], client_max_size=_max_body(cfg))
    app.on_response_prepare.append(_say_overridden)
    state = ServerState(engine, cfg, tool_memory)
    app[STATE] = state
    app[ROOT_PATH] = cfg.root_path
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model_one)
    app.router.add_get("/v1/ds4mlx/stats", debug_stats)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/slots", slots)
    app.router.add_get("/v1/ds4mlx/slots", slots)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/api/version", ollama_version)
    app.router.add_get("/api/tags", ollama_tags)
    app.router.add_get("/api/ps", ollama_ps)
    app.router.add_post("/api/show", ollama_show)
    app.router.add_get("/health", health)
    app.router.add_get("/", root)  # HEAD / too
    app.router.add_get("/ui/{name}", page_asset)
    for path in ROUTES:
        app.router.add_post(path, generate)
    for path in COUNT_ROUTES:
        app.router.add_post(path, count_tokens)
    app.router.add_route("OPTIONS", "/{tail:.*}", options)
    app.router.add_route("*", "/{tail:.*}", unknown)

    async def on_shutdown(app: web.Application) -> None:
        state.stopping = True

    async def on_cleanup(app: web.Application) -> None:
        state.close()

    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


class BackgroundServer:
    """Serve `app` on its own event loop in a daemon thread (tests, embedding).

    `port=0` picks a free port; `url` is the base address once started (https with
    an `ssl_context`, serve/cli.server_ssl_context)."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0, ssl_context=None):
        self.app, self.host, self.port = app, host, port
        self.ssl_context = ssl_context
        self.loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="ds4mlx-http", daemon=True)

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context is not None else 'http'}://{self.host}:{self.port}"

    def start(self) -> BackgroundServer:
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error
        return self

    def _main(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self._runner = make_runner(self.app)
            self.loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.ssl_context)
            self.loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self._runner.cleanup())
        self.loop.close()

    def stop(self) -> None:
        if self.loop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
