"""Where eval gets its model output from.

A backend implements

* `name` (for the trace header) and `model` (model path / name),
* `count_tokens(prompt) -> int | None` (None: unknown, no context sizing),
* `open(ctx)`: load / connect once the context size is known,
* `generate(job: GenJob) -> GenResult` (the prompt, limit, seed, control, progress
  callbacks and think-close budgets of one case),
* `close()`.

`on_text` receives *raw* text (reasoning, then `</think>`, then the answer), the
same bytes ds4-eval writes to MODEL_OUTPUT.  `control.check()` raises
`Interrupted` to stop or switch a case; `control.wait_if_paused()` blocks while
paused.

Backends here: `FakeBackend` (scripted, for tests and `--backend fake`) and
`EndpointBackend` (any OpenAI-compatible chat server, streaming SSE).  The
in-process MLX backend lives in `inprocess.py` so that this module never imports MLX.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..chat.markers import DEEPSEEK_V4_MODEL_ID
from .endpoint_wire import message_of, short_error, sse_data, usage_of
from .prompts import Prompt
from .thinkclose import THINK_CLOSE, CloseEvent, GenResult, Interrupted, ThinkCloser, run_token_loop

Callback = Callable[..., None]


class Control:
    """Pause / quit / switch requests from the UI, checked by the backends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.paused = False
        self.quit = False
        self.switch_to: int | None = None  # case position requested with Enter
        self.running: int | None = None  # case position being generated
        self.paused_seconds = 0.0  # total time spent paused
        self.pause_started = 0.0  # monotonic start of the current pause

    def toggle_pause(self) -> None:
        with self._lock:
            self.paused = not self.paused
            if self.paused:
                self.pause_started = time.monotonic()

    def paused_total(self) -> float:
        """Time spent paused, the pause in progress included (speed figures)."""
        if self.paused and self.pause_started:
            return self.paused_seconds + max(0.0, time.monotonic() - self.pause_started)
        return self.paused_seconds

    def request_quit(self) -> None:
        with self._lock:
            self.quit = True
            self.paused = False

    def request(self, pos: int) -> None:
        with self._lock:
            if pos != self.running:
                self.switch_to = pos

    def wait_if_paused(self) -> None:
        if not self.paused:
            return
        t0 = time.monotonic()
        while self.paused and not self.quit:
            time.sleep(0.05)
        self.paused_seconds += time.monotonic() - t0

    def check(self) -> None:
        """Between steps: honour pause, then raise Interrupted for quit / switch."""
        self.wait_if_paused()
        if self.quit:
            raise Interrupted("STOPPED")
        if self.switch_to is not None and self.switch_to != self.running:
            raise Interrupted("SWITCHED")


class Backend(Protocol):
    name: str
    model: str

    def count_tokens(self, prompt: Prompt) -> int | None: ...

    def open(self, ctx: int) -> None: ...

    def generate(self, job: GenJob) -> GenResult: ...

    def close(self) -> None: ...


def noop(*_a: Any, **_k: Any) -> None:
    return None


@dataclass
class GenJob:
    """One generation asked of a backend.  `on_prefill(done, total)`, `on_started(prompt_tokens)`
    and `on_text(raw_text)` report progress; the budgets drive the forced `</think>`
    (thinkclose.py); `case_id` is a label only, never sent to the model."""

    prompt: Prompt
    max_tokens: int
    seed: int
    control: Control
    on_prefill: Callback = noop
    on_started: Callback = noop
    on_text: Callback = noop
    soft_budget: int = 1024
    hard_budget: int = 512
    soft_rank: int = 3
    case_id: str = ""

    def closer(self, close_ids: list) -> ThinkCloser:
        """The think-close controller of this job for the close sequence `close_ids`."""
        return ThinkCloser(
            close_ids,
            soft_budget=self.soft_budget,
            hard_budget=self.hard_budget,
            soft_rank=self.soft_rank,
            thinking=self.prompt.thinking,
        )


# ---------------------------------------------------------------- fake

_TOKEN_RE = re.compile(r"</think>|\s*[^\s<]+|\s+|<")


class FakeBackend:
    """Scripted outputs, streamed token by token through the real decode loop.

    script: {"default": TEXT, "cases": {CASE_ID: TEXT}, "delay": SECONDS_PER_TOKEN,
             "prefill_delay": SECONDS, "error": {CASE_ID: MESSAGE},
             "open_delay": SECONDS, "open_error": MESSAGE}
    A text is split into word-sized tokens (`</think>` is one token); the three
    plain tokens `</`, `think`, `>` form the close sequence used by hard closes.
    """

    name = "fake"

    def __init__(self, script: dict[str, Any] | None = None):
        self.script = script or {}
        self.model = self.script.get("model", "fake-script")
        self.ctx = 0
        self.calls: list[dict[str, Any]] = []

    def count_tokens(self, prompt: Prompt) -> int:
        return len(_TOKEN_RE.findall(prompt.text))

    def open(self, ctx: int) -> None:
        time.sleep(float(self.script.get("open_delay", 0.0)))  # a slow model load
        if self.script.get("open_error"):
            raise RuntimeError(self.script["open_error"])
        self.ctx = ctx

    def _output_for(self, case_id: str) -> str:
        return self.script.get("cases", {}).get(case_id, self.script.get("default", "I think.</think>\nAnswer: A"))

    def generate(self, job: GenJob) -> GenResult:
        prompt, control, case_id = job.prompt, job.control, job.case_id
        self.calls.append({"prompt": prompt, "max_tokens": job.max_tokens, "seed": job.seed, "case_id": case_id})
        total = self.count_tokens(prompt)
        result = GenResult(prompt_tokens=total)
        if case_id in self.script.get("error", {}):
            result.finish, result.error = "error", f"decode failed: {self.script['error'][case_id]}"
            return result
        delay = float(self.script.get("delay", 0.0))
        steps = 4
        for k in range(1, steps + 1):
            control.wait_if_paused()
            time.sleep(float(self.script.get("prefill_delay", 0.0)) / steps)
            job.on_prefill(total * k // steps, total)
        try:
            control.check()
        except Interrupted as e:
            result.finish = e.status.lower()
            return result
        job.on_started(total)
        text = self._output_for(case_id)
        tokens = _TOKEN_RE.findall(text if prompt.thinking else text.split(THINK_CLOSE, 1)[-1])
        it = iter(tokens)
        closer = job.closer(["</", "think", ">"])

        def advance(tok: str) -> str:
            if delay:
                time.sleep(delay)
            return tok

        return run_token_loop(
            limit=job.max_tokens,
            closer=closer,
            control=control,
            pick=lambda: next(it, None),
            rank_of=lambda _t: 0,
            is_eos=lambda t: t is None,
            advance=advance,
            on_text=job.on_text,
            result=result,
        )

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- OpenAI-compatible endpoint

CONTINUATIONS = ("none", "prefix")


class EndpointBackend:
    """Streams `POST {url}/v1/chat/completions` (SSE) from any OpenAI-compatible
    server: ds4mlx serve, ds4-server, llama.cpp, vLLM.  Reasoning arrives as
    `reasoning_content` (or `reasoning`) deltas and is written to the raw output
    followed by `</think>` once the answer starts.  The server owns tokenization,
    so there is no context sizing.  A forced `</think>` needs a server that can
    continue an assistant message: with `continuation="prefix"` a reasoning that
    reaches the think cap (budget - hard budget, counted in chunks) is cut there and
    a second request sends it back as a DeepSeek-style prefix message
    (`{"role": "assistant", "reasoning_content": ..., "prefix": true}`); with
    "none" (the default, what ds4mlx serve supports) nothing is forced and the
    trace / TUI say so (think_close `natural` or `none`)."""

    name = "endpoint"

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        model: str | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        min_p: float = 0.05,
        timeout: float = 3600.0,
        continuation: str = "none",
    ):
        if continuation not in CONTINUATIONS:
            raise ValueError(f"unknown continuation {continuation!r}")
        self.continuation = continuation
        self.forces_think_close = continuation != "none"
        url = url.rstrip("/")
        for suffix in ("/chat/completions", "/v1"):
            if url.endswith(suffix):
                url = url[: -len(suffix)]
        self.base = url
        self.api_key = api_key
        self.model = model or ""
        self.temperature, self.top_p, self.min_p = temperature, top_p, min_p
        self.timeout = timeout

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def count_tokens(self, prompt: Prompt) -> None:
        return None

    def open(self, ctx: int) -> None:
        if not self.model:
            self.model = asyncio.run(self._first_model()) or DEEPSEEK_V4_MODEL_ID

    async def _first_model(self) -> str | None:
        import aiohttp

        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
                async with s.get(self.base + "/v1/models", headers=self._headers()) as r:
                    if r.status != 200:
                        return None
                    data = await r.json(content_type=None)
                    models = data.get("data") or []
                    return models[0].get("id") if models else None
        except Exception:
            return None

    def body(self, prompt: Prompt, max_tokens: int, seed: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model or DEEPSEEK_V4_MODEL_ID,
            "messages": prompt.messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "min_p": self.min_p,
        }
        if seed:
            body["seed"] = seed
        if prompt.thinking and prompt.think_level is not None:
            body["reasoning_effort"] = prompt.think_level
        elif prompt.thinking and prompt.think_max:
            body["reasoning_effort"] = "max"
        if not prompt.thinking:
            body["think"] = False
            body["chat_template_kwargs"] = {"thinking": False, "enable_thinking": False}
        return body

    def generate(self, job: GenJob) -> GenResult:
        think_cap = job.max_tokens - job.hard_budget if (job.prompt.thinking and self.forces_think_close) else 0
        return asyncio.run(
            self._generate(job.prompt, job.max_tokens, job.seed, job.control, job.on_started, job.on_text, think_cap)
        )

    @property
    def chat_url(self) -> str:
        return self.base + "/v1/chat/completions"

    def continuation_body(self, prompt: Prompt, reasoning: str, max_tokens: int, seed: int) -> dict[str, Any]:
        """The second request of a forced `</think>`: the reasoning so far as a
        DeepSeek-style prefix assistant message (`prefix: true`), answer next."""
        body = self.body(prompt, max_tokens, seed)
        body["messages"] = list(body["messages"]) + [
            {"role": "assistant", "content": "", "reasoning_content": reasoning, "prefix": True}
        ]
        return body

    async def _generate(
        self,
        prompt: Prompt,
        max_tokens: int,
        seed: int,
        control: Control,
        on_started: Callback,
        on_text: Callback,
        think_cap: int = 0,
    ) -> GenResult:
        """One request, streamed (SSE) or, for a server that ignores `stream`, one
        JSON body; with `think_cap` a reasoning that reaches it is cut there and a
        second request continues after a forced `</think>`.  A stream that ends
        without a finish_reason or [DONE] is an ERROR (cut off), never a graded
        answer.  Every error names the URL."""
        import aiohttp

        res = GenResult()
        raw: list[str] = []
        reasoning: list[str] = []
        state = {
            "reasoning": False,
            "closed": not prompt.thinking,
            "chunks": 0,
            "started": False,
            "finished": False,
            "forced": False,
        }
        t0 = time.monotonic()
        paused0 = control.paused_seconds
        url = self.chat_url

        def emit(text: str) -> None:
            raw.append(text)
            on_text(text)

        def started() -> None:
            if not state["started"]:
                state["started"] = True
                on_started(res.prompt_tokens)

        def delta_text(think: str, content: str) -> None:
            if think and not state["closed"]:
                state["reasoning"] = True
                reasoning.append(think)
                emit(think)
                state["chunks"] += 1
            elif think:  # reasoning after a forced close: part of the answer now
                content = think + content
            if content:
                if state["reasoning"] and not state["closed"]:
                    state["closed"] = True
                    emit(THINK_CLOSE)
                    res.close = CloseEvent("natural", state["chunks"], 0, 0)
                emit(content)
                state["chunks"] += 1

        def finish(reason: str | None) -> None:
            if reason:
                state["finished"] = True
                res.finish = (
                    "stop" if reason in ("stop", "tool_calls") else ("length" if reason == "length" else "error")
                )
                if res.finish == "error":
                    res.error = f"POST {url}: server finish_reason {reason}"

        def fail(msg: str) -> GenResult:
            res.finish, res.error = "error", f"POST {url}: {msg}"
            return res

        def at_cap() -> bool:
            return bool(think_cap) and not state["closed"] and state["chunks"] >= think_cap

        async def request(s: Any, body: dict[str, Any]) -> str | None:
            """Read one response into the state; an error text, or None.  Sets
            state["tokens"]: the response's completion_tokens, else its chunk count."""
            c0, usage = state["chunks"], 0
            state["tokens"] = 0
            async with s.post(url, headers=self._headers(), json=body) as r:
                if r.status != 200:
                    return f"HTTP {r.status}: {short_error(await r.text(errors='replace'))}"
                if "text/event-stream" not in r.headers.get("Content-Type", ""):
                    text = await r.text(errors="replace")
                    try:
                        data = json.loads(text)
                    except ValueError:
                        return f"neither an event stream nor JSON: {short_error(text)}"
                    msg = message_of(data)
                    if msg is None:
                        err = data.get("error") if isinstance(data, dict) else None
                        return short_error(text) if err else "JSON body without choices"
                    p_tok, usage = usage_of(data)
                    res.prompt_tokens = res.prompt_tokens or p_tok
                    started()
                    delta_text(msg[0], msg[1])
                    finish(msg[2] or "stop")
                    state["tokens"] = usage or state["chunks"] - c0
                    return None
                buf = bytearray()
                done = False
                async for piece in r.content.iter_any():
                    buf += piece
                    for data in sse_data(buf):
                        if data == b"[DONE]":
                            done = True
                            break
                        chunk = json.loads(data)
                        if chunk.get("error"):
                            return short_error(json.dumps(chunk))
                        p_tok, g_tok = usage_of(chunk)
                        if p_tok or g_tok:
                            res.prompt_tokens = res.prompt_tokens or p_tok
                            usage = g_tok
                        for choice in chunk.get("choices") or []:
                            started()
                            delta = choice.get("delta") or {}
                            delta_text(
                                delta.get("reasoning_content") or delta.get("reasoning") or "",
                                delta.get("content") or "",
                            )
                            finish(choice.get("finish_reason"))
                        if at_cap():
                            state["tokens"] = state["chunks"] - c0
                            return None  # leaving the block drops the connection: the server stops
                    control.check()
                    if done:
                        break
                state["tokens"] = usage or state["chunks"] - c0
                if not (done or state["finished"]):
                    return (
                        f"stream ended before the answer finished (after {state['chunks']} chunks, "
                        "no finish_reason or [DONE])"
                    )
                return None

        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)) as s:
                err = await request(s, self.body(prompt, max_tokens, seed))
                res.generated_tokens = state["tokens"]
                if err is None and at_cap() and not state["finished"]:
                    # forced </think>: the reasoning so far, then the answer by a second request
                    used = state["chunks"]
                    state["closed"] = state["forced"] = True
                    emit(THINK_CLOSE)
                    res.close = CloseEvent("hard_forced", used + 1, max_tokens - used, 0)
                    body = self.continuation_body(prompt, "".join(reasoning), max_tokens - used, seed)
                    err = await request(s, body)
                    res.generated_tokens = used + state["tokens"]
                    if err:
                        err = f"continuation after the forced </think> ({self.continuation}): {err}"
                if err:
                    fail(err)
        except Interrupted as e:
            res.finish = e.status.lower()
        except json.JSONDecodeError as e:
            fail(f"bad JSON in the event stream: {e}")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            fail(f"{type(e).__name__}: {e}")
        finally:
            res.raw = "".join(raw)
            if not res.generated_tokens:
                res.generated_tokens = state["chunks"]
            res.elapsed = max(0.0, time.monotonic() - t0 - (control.paused_seconds - paused0))
        return res

    def close(self) -> None:
        pass
