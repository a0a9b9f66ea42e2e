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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import mlx.core as mx


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
    ):
        self.session = session
        self.logits = logits if isinstance(logits, mx.array) else mx.array(logits)
        self.sample = sample
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        # a stop id read one step late needs its step undone: the static layout only
        self.lookahead = bool(lookahead) and (not self.stop_ids or getattr(session, "can_undo", False))
        self.limit = limit
        self.stopped_by: int | None = None

    def __iter__(self) -> Iterator[int]:
        return self._lookahead() if self.lookahead else self._synchronous()

    def _room(self, n: int) -> bool:
        return self.limit is None or n < self.limit

    def _synchronous(self) -> Iterator[int]:
        s, n = self.session, 0
        while self._room(n):
            tok = self.sample(self.logits)
            tok = int(tok.item()) if isinstance(tok, mx.array) else int(tok)
            if tok in self.stop_ids:
                self.stopped_by = tok
                return
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
            self.logits = s.step(tok, undoable=True) if self.stop_ids else s.step(tok)
            nxt = self.sample(self.logits)  # token t+1, still on the device
            mx.async_eval(nxt)
            t = int(tok.item())  # waits for step t-1 only: step t is already queued behind it
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
