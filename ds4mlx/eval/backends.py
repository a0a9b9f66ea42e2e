"""Where eval gets its model output from.

A backend implements

* `name` (for the trace header) and `model` (model path / name),
* `count_tokens(prompt) -> int | None` (None: unknown, no context sizing),
* `open(ctx)`: load / connect once the context size is known,
* `generate(prompt, max_tokens, *, seed, control, on_prefill, on_started, on_text,
  soft_budget, hard_budget, soft_rank, case_id) -> GenResult` (`case_id` is a
  label only; it is never sent to the model),
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
from typing import Any, Callable, Optional, Protocol

from ..chat.markers import DEEPSEEK_V4_MODEL_ID
from .prompts import Prompt
from .thinkclose import (THINK_CLOSE, CloseEvent, GenResult, Interrupted, ThinkCloser,
                         run_token_loop)

Callback = Callable[..., None]


class Control:
    """Pause / quit / switch requests from the UI, checked by the backends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.paused = False
        self.quit = False
        self.switch_to: Optional[int] = None   # case position requested with Enter
        self.running: Optional[int] = None     # case position being generated
        self.paused_seconds = 0.0              # total time spent paused

    def toggle_pause(self) -> None:
        with self._lock:
            self.paused = not self.paused

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

    def count_tokens(self, prompt: Prompt) -> Optional[int]: ...

    def open(self, ctx: int) -> None: ...

    def generate(self, prompt: Prompt, max_tokens: int, *, seed: int, control: Control,
                 on_prefill: Callback, on_started: Callback, on_text: Callback,
                 soft_budget: int, hard_budget: int, soft_rank: int, case_id: str = "") -> GenResult: ...

    def close(self) -> None: ...


def noop(*_a: Any, **_k: Any) -> None:
    return None


# ---------------------------------------------------------------- fake

_TOKEN_RE = re.compile(r"</think>|\s*[^\s<]+|\s+|<")


class FakeBackend:
    """Scripted outputs, streamed token by token through the real decode loop.

    script: {"default": TEXT, "cases": {CASE_ID: TEXT}, "delay": SECONDS_PER_TOKEN,
             "prefill_delay": SECONDS, "error": {CASE_ID: MESSAGE}}
    A text is split into word-sized tokens (`</think>` is one token); the three
    plain tokens `</`, `think`, `>` form the close sequence used by hard closes.
    """

    name = "fake"

    def __init__(self, script: Optional[dict[str, Any]] = None):
        self.script = script or {}
        self.model = self.script.get("model", "fake-script")
        self.ctx = 0
        self.calls: list[dict[str, Any]] = []

    def count_tokens(self, prompt: Prompt) -> int:
        return len(_TOKEN_RE.findall(prompt.text))

    def open(self, ctx: int) -> None:
        self.ctx = ctx

    def _output_for(self, case_id: str) -> str:
        return self.script.get("cases", {}).get(case_id, self.script.get("default", "I think.</think>\nAnswer: A"))

    def generate(self, prompt: Prompt, max_tokens: int, *, seed: int, control: Control,
                 on_prefill: Callback = noop, on_started: Callback = noop, on_text: Callback = noop,
                 soft_budget: int = 1024, hard_budget: int = 512, soft_rank: int = 3,
                 case_id: str = "") -> GenResult:
        self.calls.append({"prompt": prompt, "max_tokens": max_tokens, "seed": seed, "case_id": case_id})
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
            on_prefill(total * k // steps, total)
        try:
            control.check()
        except Interrupted as e:
            result.finish = e.status.lower()
            return result
        on_started(total)
        text = self._output_for(case_id)
        tokens = _TOKEN_RE.findall(text if prompt.thinking else text.split(THINK_CLOSE, 1)[-1])
        it = iter(tokens)
        closer = ThinkCloser(["</", "think", ">"], soft_budget=soft_budget, hard_budget=hard_budget,
                             soft_rank=soft_rank, thinking=prompt.thinking)

        def advance(tok: str) -> str:
            if delay:
                time.sleep(delay)
            return tok

        return run_token_loop(limit=max_tokens, closer=closer, control=control,
                              pick=lambda: next(it, None), rank_of=lambda _t: 0,
                              is_eos=lambda t: t is None, advance=advance, on_text=on_text, result=result)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- OpenAI-compatible endpoint

class EndpointBackend:
    """Streams `POST {url}/v1/chat/completions` (SSE) from any OpenAI-compatible
    server: ds4mlx serve, ds4-server, llama.cpp, vLLM.  Reasoning arrives as
    `reasoning_content` (or `reasoning`) deltas and is written to the raw output
    followed by `</think>` once the answer starts.  The server owns tokenization,
    so there is no context sizing and no forced `</think>` (think_close is
    `natural` or `none`)."""

    name = "endpoint"

    def __init__(self, url: str, api_key: Optional[str] = None, model: Optional[str] = None,
                 temperature: float = 0.0, top_p: float = 1.0, min_p: float = 0.05,
                 timeout: float = 3600.0):
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

    async def _first_model(self) -> Optional[str]:
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
        if not prompt.thinking:
            body["think"] = False
            body["chat_template_kwargs"] = {"thinking": False, "enable_thinking": False}
        return body

    def generate(self, prompt: Prompt, max_tokens: int, *, seed: int, control: Control,
                 on_prefill: Callback = noop, on_started: Callback = noop, on_text: Callback = noop,
                 soft_budget: int = 1024, hard_budget: int = 512, soft_rank: int = 3,
                 case_id: str = "") -> GenResult:
        return asyncio.run(self._generate(prompt, max_tokens, seed, control, on_started, on_text))

    async def _generate(self, prompt: Prompt, max_tokens: int, seed: int, control: Control,
                        on_started: Callback, on_text: Callback) -> GenResult:
        import aiohttp

        res = GenResult()
        raw: list[str] = []
        state = {"reasoning": False, "closed": not prompt.thinking, "chunks": 0, "started": False}
        t0 = time.monotonic()
        paused0 = control.paused_seconds

        def emit(text: str) -> None:
            raw.append(text)
            on_text(text)

        def delta_text(delta: dict[str, Any]) -> None:
            reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
            content = delta.get("content") or ""
            if reasoning:
                state["reasoning"] = True
                emit(reasoning)
                state["chunks"] += 1
            if content:
                if state["reasoning"] and not state["closed"]:
                    state["closed"] = True
                    emit(THINK_CLOSE)
                    res.close = CloseEvent("natural", state["chunks"], 0, 0)
                emit(content)
                state["chunks"] += 1

        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)) as s:
                async with s.post(self.base + "/v1/chat/completions", headers=self._headers(),
                                  json=self.body(prompt, max_tokens, seed)) as r:
                    if r.status != 200:
                        text = (await r.text())[:500]
                        res.finish, res.error = "error", f"HTTP {r.status}: {text}"
                        return res
                    buf = b""
                    async for piece in r.content.iter_any():
                        buf += piece
                        while b"\n" in buf:
                            line, buf = buf.split(b"\n", 1)
                            line = line.strip()
                            if not line.startswith(b"data:"):
                                continue
                            data = line[5:].strip()
                            if data == b"[DONE]":
                                buf = b""
                                break
                            chunk = json.loads(data)
                            if chunk.get("error"):
                                res.finish, res.error = "error", str(chunk["error"])[:500]
                                return res
                            usage = chunk.get("usage")
                            if usage:
                                res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                                res.generated_tokens = int(usage.get("completion_tokens") or 0)
                            for choice in chunk.get("choices") or []:
                                if not state["started"]:
                                    state["started"] = True
                                    on_started(res.prompt_tokens)
                                delta_text(choice.get("delta") or {})
                                fr = choice.get("finish_reason")
                                if fr:
                                    res.finish = "stop" if fr in ("stop", "tool_calls") else (
                                        "length" if fr == "length" else "error")
                                    if res.finish == "error":
                                        res.error = f"server finish_reason {fr}"
                        control.check()
        except Interrupted as e:
            res.finish = e.status.lower()
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, OSError) as e:
            res.finish, res.error = "error", f"endpoint: {type(e).__name__}: {e}"
        finally:
            res.raw = "".join(raw)
            if not res.generated_tokens:
                res.generated_tokens = state["chunks"]
            res.elapsed = max(0.0, time.monotonic() - t0 - (control.paused_seconds - paused0))
        return res

    def close(self) -> None:
        pass
