"""The library's one decode loop (mlx-lm `generate_step` style).

`decode_tokens(session, logits, sample, ...)` yields the generated token ids, each one
already fed to the session (its step enqueued).  The engine, `bench`'s probe and the
profiler all run it; `generate` / `chat` / `serve` reach it through the engine.

Two ways to run, one loop:

* **lookahead** (`sample` is a lazy device function of the logits, e.g.
  `sampling.DeviceSampler`): token t+1 is drawn on the device from step t's lazy
  logits and step t+1 is enqueued (`mx.async_eval`) before the host reads token t, so
  the host's graph building, detokenising, stop strings and tool parsing overlap the
  device.  A token in `stop_ids` is read after its step was enqueued: that step is
  undone (`Session.undo_step`) so the session ends where the synchronous loop ends.
  Without stop ids (bench) any family runs it.
* **synchronous** (`sample` returns a host int, or the session cannot undo a step): each
  token is read before its step.  The engine uses it where the choice of a token depends
  on the host's reading of the previous one (forced tool text, greedy inside a tool call
  of a sampled job); with stop ids, families on the legacy step (no undo) run it.

The consumer stops the loop by leaving the `for` (stop string, cancel, max tokens); a
token drawn ahead but not yielded is never fed.  `loop.stopped_by` holds the stop id
that ended it (not fed), else None.

With `defer=True` (session batching) the loop does not run its steps itself: before
each step it yields a `StepRequest` and continues once someone ran it (`run_steps`:
the ready steps of several sessions in one forward where the model allows).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import mlx.core as mx

from .session import can_step_together, step_together


class StepRequest:
    """A step a deferred loop waits for: feed `token` to `session` (`Session.step`)."""

    __slots__ = ("session", "token", "undoable", "logits", "error")

    def __init__(self, session, token, undoable: bool):
        self.session, self.token, self.undoable = session, token, undoable
        self.logits = None
        self.error: BaseException | None = None

    def result(self) -> mx.array:
        if self.error is not None:
            raise self.error
        return self.logits


def run_steps(requests: list[StepRequest], together: bool = True) -> int:
    """Run the requested steps: the sessions that can go together in one forward
    (`session.step_together`; not with `together=False`), the others one by one in
    order.  Returns how many went in a shared forward.  A failure lands on its request(s)."""
    shared = 0
    groups: dict = {}
    for r in requests:
        groups.setdefault((id(r.session.model), r.undoable), []).append(r)
    for rs in groups.values():
        sessions = [r.session for r in rs]
        if together and can_step_together(sessions):
            try:
                for r, lg in zip(rs, step_together(sessions, [r.token for r in rs], rs[0].undoable)):
                    r.logits = lg
                shared += len(rs)
                continue
            except Exception as e:  # noqa: BLE001 - the rows' loops raise it
                for r in rs:
                    r.error = e
                continue
        for r in rs:
            try:
                r.logits = r.session.step(r.token, undoable=True) if r.undoable else r.session.step(r.token)
            except Exception as e:  # noqa: BLE001 - its loop raises it
                r.error = e
    return shared


class DecodeLoop:
    def __init__(
        self,
        session,
        logits,
        sample: Callable,
        *,
        stop_ids: Iterable[int] = (),
        lookahead: bool = True,
        limit: int | None = None,
        defer: bool = False,
    ):
        self.session = session
        self.defer = bool(defer)
        self.logits = logits if isinstance(logits, mx.array) else mx.array(logits)
        self.sample = sample
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        # a stop id read one step late needs its step undone: the static layout only
        self.lookahead = bool(lookahead) and (not self.stop_ids or getattr(session, "can_undo", False))
        self.limit = limit
        self.stopped_by: int | None = None
        # seconds the host spent blocked reading tokens (`.item()`): wall minus this is the host's
        # own work per token (bench --profile's host ms per token)
        self.wait_s = 0.0

    def __iter__(self) -> Iterator[int]:
        return self._lookahead() if self.lookahead else self._synchronous()

    def _room(self, n: int) -> bool:
        return self.limit is None or n < self.limit

    def _synchronous(self) -> Iterator[int]:
        s, n = self.session, 0
        while self._room(n):
            tok = self.sample(self.logits)
            if isinstance(tok, mx.array):
                t0 = time.perf_counter()
                tok = int(tok.item())
                self.wait_s += time.perf_counter() - t0
            tok = int(tok)
            if tok in self.stop_ids:
                self.stopped_by = tok
                return
            if self.defer:
                req = StepRequest(s, tok, False)
                yield req
                self.logits = req.result()
            else:
                self.logits = s.step(tok)
            mx.async_eval(self.logits)
            n += 1
            yield tok

    def _lookahead(self) -> Iterator[int]:
        s, n = self.session, 0
        tok = self.sample(self.logits)
        mx.async_eval(tok)
        while self._room(n):
            # step t, fed with the lazy token t
            if self.defer:
                req = StepRequest(s, tok, bool(self.stop_ids))
                yield req
                self.logits = req.result()
            else:
                self.logits = s.step(tok, undoable=True) if self.stop_ids else s.step(tok)
            nxt = self.sample(self.logits)  # token t+1, still on the device
            mx.async_eval(nxt)
            t0 = time.perf_counter()
            t = int(tok.item())  # waits for step t-1 only: step t is already queued behind it
            self.wait_s += time.perf_counter() - t0
            if t in self.stop_ids:
                s.undo_step()
                self.stopped_by = t
                return
            n += 1
            yield t
            tok = nxt


def decode_tokens(session, logits, sample: Callable, **kw) -> DecodeLoop:
    """`DecodeLoop(session, logits, sample, stop_ids=(), lookahead=True, limit=None)`."""
    return DecodeLoop(session, logits, sample, **kw)


def greedy(vocab: int, banned: Iterable[int] = ()) -> Callable[[mx.array], mx.array]:
    """A lazy argmax sampler with `banned` ids masked (bench's EOS-free probe)."""
    ban = [int(b) for b in banned if 0 <= int(b) < vocab]
    mask = None
    if ban:
        mask = mx.zeros((vocab,), mx.bool_)
        mask[mx.array(ban, dtype=mx.int32)] = True

    def pick(logits: mx.array) -> mx.array:
        x = logits.reshape(-1)
        if mask is not None:
            x = mx.where(mask, -mx.inf, x)
        return mx.argmax(x).astype(mx.int32)

    return pick
