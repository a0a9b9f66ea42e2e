"""Row buffers in the static decode layout: capacity grows in power-of-two buckets.

The compiled decode step (ds4mlx/runtime/stepper.py) is traced once per combination of input
shapes.  A growing buffer (compressed rows, KV rows) therefore keeps its capacity in a
few buckets, MIN_BUCKET rows doubling, so a decode run retraces only when a buffer
crosses into the next bucket; the rows past the live count are padding that the step
masks out.  Every family's row buffers use these helpers.
"""

from __future__ import annotations

import mlx.core as mx

from ..runtime.forward_context import PREFILL, StepContext
from .causal_lm import ContextForward

MIN_BUCKET = 256  # rows; tests lower it to cross a bucket boundary with tiny models


_IOTAS: dict[int, mx.array] = {}


def iota(n: int) -> mx.array:
    """`mx.arange(n)` (int32) made once and kept: inside a compiled step a constant is an
    input, not a launch per token (an arange in the trace is replayed every step)."""
    a = _IOTAS.get(n)
    if a is None:
        a = mx.arange(n, dtype=mx.int32)
        mx.eval(a)  # depends on no step input, so allowed even while a step is traced
        _IOTAS[n] = a
    return a


def iota_rows(n: int, g: int) -> mx.array:
    """[n, g] int32 rows of `mx.arange(g)`, made once and kept (as `iota`)."""
    a = _IOTAS.get((n, g))
    if a is None:
        a = mx.broadcast_to(iota(g), (n, g))
        a = mx.contiguous(a)
        mx.eval(a)
        _IOTAS[(n, g)] = a
    return a


def bucket(n: int) -> int:
    """The capacity (MIN_BUCKET * 2**k rows) that holds n rows."""
    cap = MIN_BUCKET
    while cap < n:
        cap *= 2
    return cap


def grow_rows(rows: mx.array, n_live: int, want: int, axis: int = 1) -> mx.array:
    """`rows` with capacity bucket(want) along `axis`: the live rows kept, zeros after.

    Returns `rows` itself when it is already large enough."""
    cap = rows.shape[axis]
    if cap >= want:
        return rows
    new = bucket(want)
    shape = list(rows.shape)
    shape[axis] = new - n_live
    live = rows if n_live == cap else mx.take(rows, mx.arange(n_live), axis=axis)
    return mx.concatenate([live, mx.zeros(shape, rows.dtype)], axis=axis)


class StaticDecode:
    """Mixin for a family `Model` whose per-layer caches have `static_state(dtype) ->
    list` and `commit_static(iterator, advance)`: the stepper's (ds4mlx/runtime/stepper.py)
    `static_state` / `commit_static` / `rewind_static` over the whole cache list.  The
    family defines `static_step(ids, pos, state) -> (logits, new state)`."""

    def static_dtype(self):
        """The dtype buffers are created in: the residual stream's (dtype_policy: float32
        activations keep float32 caches, as the full forward's), else the model's float type."""
        act = getattr(self.model, "activation_dtype", None)
        return act if act is not None else self.model.norm.weight.dtype

    def static_state(self, cache: list, ahead: int = 1) -> list:
        """The flat step state of `cache` for its next position (buffers grown to fit), or
        for its next `ahead` positions (a chained step: families with `static_rows_chain`)."""
        dtype = self.static_dtype()
        if ahead == 1:
            return [a for c in cache for a in c.static_state(dtype)]
        return [a for c in cache for a in c.static_state(dtype, ahead)]

    def commit_static(self, cache: list, state: list, advance: int = 1) -> None:
        it = iter(state)
        for c in cache:
            c.commit_static(it, advance)

    def rewind_static(self, cache: list, old_state: list) -> None:
        self.commit_static(cache, old_state, -1)


class StaticForward(StaticDecode):
    """A `StaticDecode` family whose static step is one forward over a context (docs/forward.md
    §2): it defines `static_forward(ids [1, T], ctx) -> (logits [T, V], the rows' new states)`
    (runtime/forward_context.py `StepContext`); the one-token `static_step` is that forward
    of one row."""

    def static_step(self, ids: mx.array, pos: mx.array, state: list) -> tuple[mx.array, list]:
        """Pure: (logits [V] of token ids [1, 1] at position pos, the new state)."""
        logits, news = self.static_forward(ids, StepContext.one(pos, state))[:2]
        return logits.squeeze(0), news[0]


class BackboneForward(ContextForward, StaticForward):
    """A `ContextForward` family whose backbone has one `forward(ids, ctx) -> hidden [1, T, H]`
    for every context kind (docs/forward.md §2) and whose Model adds only the head."""

    def forward(self, ids: mx.array, ctx, last_only: bool = False):
        """The one forward of ids [1, T] over `ctx` (runtime/forward_context.py `StepContext`).
        PREFILL (a chunk over the live caches, advanced) -> logits [1, T, V] (`last_only`: the
        last token's, [1, 1, V]).  DECODE / CHAIN (pure: T sessions' next tokens, or one
        session's next T as a chain) -> (logits [T, V], the rows' new states[, the normed
        hidden states [1, T, H] where ctx.streams: the MTP head's input])."""
        h = self.model.forward(ids, ctx)
        if ctx.kind == PREFILL:
            return self.head(h[:, -1:] if last_only else h)
        logits = self.head(h).squeeze(0)
        news = [v.new for v in ctx.views]
        return (logits, news, h) if ctx.streams else (logits, news)
