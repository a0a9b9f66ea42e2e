"""A scripted model double implementing the Session interface.

Its logits force a chosen token sequence, so the engine's real sampler,
detokenizer, stop matcher and output parser all run on it.  The script is
chosen per prompt: `script(prompt_text) -> str | list[int] | list[Segment]`,
called whenever a prefill ends (the prompt is the decode of every token in
the session).  After the script the model forces ⟨EOS⟩.

* Hard tokens get one logit `margin` above all others: every sampler setting
  picks them.
* Soft segments (`Segment(text, soft=True)`) give a distractor token a logit
  just below the target, so a non-greedy sampler picks the distractor about
  half of the time while argmax still picks the target.  Tests use this to
  prove which positions are sampled greedily.

Counters (`prefill_tokens`, `prefill_calls`, `steps`) and gates (`step_gate`,
`prefill_gate`: block the worker until a test lets it go on) make cancellation
and keepalive tests deterministic without timing.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Union

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class Segment:
    text: str
    soft: bool = False


ScriptItem = Union[str, Sequence[int], Sequence[Segment]]


class Gate:
    """A budget of passes.  `None` budget = open.  `wait()` blocks while the
    budget is 0; each pass consumes one."""

    def __init__(self):
        self._cv = threading.Condition()
        self._budget: int | None = None
        self.waiting = 0  # how many callers are blocked right now
        self.passed = 0

    def close(self) -> None:
        with self._cv:
            self._budget = 0

    def allow(self, n: int = 1) -> None:
        with self._cv:
            self._budget = (self._budget or 0) + n
            self._cv.notify_all()

    def open(self) -> None:
        with self._cv:
            self._budget = None
            self._cv.notify_all()

    def wait(self, timeout: float = 60.0) -> None:
        with self._cv:
            self.waiting += 1
            try:
                ok = self._cv.wait_for(lambda: self._budget is None or self._budget > 0, timeout)
                if not ok:
                    raise TimeoutError("scripted model gate never opened")
                if self._budget is not None:
                    self._budget -= 1
                self.passed += 1
            finally:
                self.waiting -= 1

    def wait_for_waiters(self, n: int = 1, timeout: float = 30.0) -> bool:
        """Test helper: block until at least n callers are parked at the gate."""
        import time

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.waiting >= n:
                return True
            time.sleep(0.005)
        return False


class ScriptedModel:
    def __init__(
        self,
        tokenizer,
        script: ScriptItem | Callable[[str], ScriptItem] | None = None,
        *,
        margin: float = 30.0,
        soft_gap: float = 0.05,
        distractor: str = "x",
        vocab_size: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.script = script if script is not None else "Hello from the scripted model."
        self.vocab_size = int(vocab_size or tokenizer.vocab_size)
        self.margin = margin
        self.soft_gap = soft_gap
        self.distractor_id = tokenizer.encode(distractor)[0]
        self.eos_id = tokenizer.eos_id
        self.step_gate = Gate()
        self.prefill_gate = Gate()
        self.prefill_tokens = 0
        self.prefill_calls = 0
        self.steps = 0
        self.prompts: list[str] = []  # decoded session text at each script choice
        self._lock = threading.Lock()

    # -- script resolution -------------------------------------------------
    def plan_for(self, prompt_text: str) -> list[tuple[int, bool]]:
        item = self.script(prompt_text) if callable(self.script) else self.script
        if isinstance(item, str):
            return [(t, False) for t in self.tokenizer.encode(item)]
        item = list(item)
        if item and isinstance(item[0], Segment):
            out: list[tuple[int, bool]] = []
            for seg in item:
                out += [(t, seg.soft) for t in self.tokenizer.encode(seg.text)]
            return out
        return [(int(t), False) for t in item]

    def logits_for(self, target: int, soft: bool) -> np.ndarray:
        x = np.zeros(self.vocab_size, dtype=np.float32)
        x[target] = self.margin
        if soft and target != self.distractor_id:
            x[self.distractor_id] = self.margin - self.soft_gap
        return x

    def new_session(self, ctx: int = 4096) -> ScriptedSession:
        return ScriptedSession(self, ctx)

    def logits(self, ids) -> np.ndarray:
        """The public model wrapper's full forward, [T, V]: a pseudo-random row per position,
        seeded by the prefix it ends (what prompt log-probs read; the script drives decoding)."""
        rows = [np.random.default_rng(list(ids[: i + 1])).standard_normal(self.vocab_size) * 4 for i in range(len(ids))]
        return np.stack(rows).astype(np.float32)


class ScriptedSession:
    def __init__(self, model: ScriptedModel, ctx: int):
        self.model = model
        self.ctx = ctx
        self.tokens: list[int] = []
        self._plan: list[tuple[int, bool]] = []
        self._gen = 0  # tokens decoded since the last prefill
        self._last = None  # logits for the next token

    def __len__(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.tokens, self._plan, self._gen, self._last = [], [], 0, None

    @property
    def last_logits(self):
        return self._last

    def _next_logits(self) -> np.ndarray:
        m = self.model
        if self._gen < len(self._plan):
            target, soft = self._plan[self._gen]
        else:
            target, soft = m.eos_id, False
        self._last = m.logits_for(target, soft)
        return self._last

    def prefill(self, ids, progress=None, chunk=None) -> np.ndarray:
        ids = [int(i) for i in ids]
        if not ids:
            if self._last is None:
                raise ValueError("prefill of no tokens on an empty session")
            return self._last
        if len(self.tokens) + len(ids) > self.ctx:
            raise ValueError("prompt exceeds context")
        m = self.model
        m.prefill_gate.wait()
        with m._lock:
            m.prefill_calls += 1
            m.prefill_tokens += len(ids)
        self.tokens += ids
        if progress is not None:
            progress(len(ids), len(ids))
        text = m.tokenizer.decode(self.tokens)
        m.prompts.append(text)
        self._plan = m.plan_for(text)
        self._gen = 0
        return self._next_logits()

    def step(self, token_id: int) -> mx.array:
        m = self.model
        if len(self.tokens) >= self.ctx:
            raise ValueError("context full")
        token_id = int(token_id.item()) if isinstance(token_id, mx.array) else int(token_id)
        m.step_gate.wait()
        with m._lock:
            m.steps += 1
        self.tokens.append(int(token_id))
        self._gen += 1
        return mx.array(self._next_logits())

    def decode(self, token_id: int) -> np.ndarray:
        return np.array(self.step(token_id))

    def truncate(self, n: int) -> None:
        n = max(0, min(int(n), len(self.tokens)))
        if n == len(self.tokens):
            return
        keep = self.tokens[:n]
        self.reset()
        if keep:
            self.prefill(keep)

    def snapshot(self) -> bytes:
        return pickle.dumps((self.tokens, self._plan, self._gen, self._last))

    def restore(self, blob: bytes) -> None:
        self.tokens, self._plan, self._gen, self._last = pickle.loads(blob)


# ----------------------------------------------------------------------------- servers
class _Served:
    """A running server plus its engine and model (test helper)."""

    def __init__(self, server, engine, model, memory):
        self.server, self.engine, self.model, self.tool_memory = server, engine, model, memory
        self.url = server.url

    def wait(self, predicate, timeout: float = 30.0) -> bool:
        """Poll `predicate()` until true (waiting for an event, not timing it)."""
        import time

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate():
                return True
            time.sleep(0.005)
        return False

    def idle(self) -> bool:
        return self.engine._running is None and self.engine.queue_depth == 0


def serve(
    tokenizer,
    model,
    *,
    ctx: int = 2048,
    tokens: int = 393216,
    prefill_chunk: int = 512,
    replay: bool = True,
    slots: int = 1,
    **cfg,
):
    """Start `ds4mlx.serve` for `model` on 127.0.0.1 (random free port).  Use as a
    context manager; yields a `_Served`."""
    from contextlib import contextmanager

    from ds4mlx.chat.toolmemory import ToolMemory
    from ds4mlx.engine import Engine
    from ds4mlx.serve.app import BackgroundServer, make_app
    from ds4mlx.serve.prepare import ServeConfig

    @contextmanager
    def _cm():
        memory = ToolMemory() if replay else None
        engine = Engine(
            model,
            tokenizer,
            ctx=ctx,
            default_max_tokens=tokens,
            tool_memory=memory,
            prefill_chunk=prefill_chunk,
            slots=slots,
        )
        app = make_app(engine, ServeConfig(ctx=ctx, tokens=tokens, replay=replay, **cfg), memory)
        server = BackgroundServer(app).start()
        try:
            yield _Served(server, engine, model, memory)
        finally:
            server.stop()
            engine.close()

    return _cm()


def serve_demo(dtype="auto", **kw):
    """`serve` for the random-weight demo model (`ds4mlx.load("demo", dtype=dtype)`: None is
    the GPU weight policy, 16-bit weights as stored); the yielded server also carries its
    tokenizer as `.tok`."""
    from contextlib import contextmanager

    import ds4mlx

    @contextmanager
    def _cm():
        model, tok = ds4mlx.load("demo", dtype=dtype, verbose=False)
        with serve(tok, model, **kw) as s:
            s.tok = tok
            yield s

    return _cm()


def last_user_text(prompt: str) -> str:
    """The text of the last user turn of a rendered DeepSeek prompt."""
    user, asst = "<｜User｜>", "<｜Assistant｜>"
    i = prompt.rfind(user)
    if i < 0:
        return ""
    j = prompt.find(asst, i)
    return prompt[i + len(user) : j if j >= 0 else len(prompt)]
