"""One decode step of a model over a session's caches: the compiled static step, or not.

A family that supports the static decode layout gives its `Model`

* `static_state(cache) -> list[mx.array]`: the caches' arrays for the next position,
  buffers created or grown into their bucket (models/cache.py) first;
* `static_step(ids [1, 1], pos, state) -> (logits [V], new state)`: a pure function of
  arrays, `pos` an int32 scalar array, no branch on a position;
* `commit_static(cache, new_state)`: the new arrays back into the caches, counters
  advanced one position; `rewind_static(cache, old_state)` its inverse (undo);
* optionally `static_forward(ids [1, T], ctx) -> (logits [T, V], the rows' new states)`:
  the same step over a `forward_context.StepContext` of several rows: B sessions' tokens
  (`step_rows`) or, with `static_rows_chain`, one session's next T (`step_chain`).

Every step is planned as a `forward_context.ForwardContext` (its kind, rows, positions)
on the host; the compiled functions are kept per model and context kind.

`step(model, cache, ids, pos)` runs one token.  How is chosen by `DS4MLX_DECODE`:

* `compiled` (default): `static_step` traced once per input-shape signature (a bucket)
  by `mx.compile` and replayed: no per-layer Python per token;
* `eager`: the same static step without `mx.compile` (debugging; same numbers);
* `legacy`: the model's prefill forward of the one token (per-layer Python, host-side
  positions), the path before the static step: for before/after measurements.

A family without `static_step` always takes the legacy path, and so does a model whose
first static step raised (an op its backend lacks: logged once, then legacy).  A steered
model decodes eagerly where its family's static forward steers (`static_steers`), else on
the legacy path.
"""

from __future__ import annotations

import logging
import os
import weakref

import mlx.core as mx

from ..kernels import cuda_cache
from . import steering
from .forward_context import DECODE, ForwardContext, StepContext

MODE_ENV = "DS4MLX_DECODE"
MODES = ("compiled", "eager", "legacy")

# (id(model), kind, one row, state arrays per row, streams) -> its compiled forward (traces are per function)
_compiled: dict[tuple, object] = {}
_traces: dict[tuple, int] = {}  # same keys: how many times mx.compile traced that function
_checked: set[int] = set()  # models whose static step has run once
_refused: set[int] = set()  # models whose static step failed: legacy from then on
_watched: set[int] = set()  # models with a finalizer that drops their entries
log = logging.getLogger(__name__)


def mode() -> str:
    m = os.environ.get(MODE_ENV, "").strip().lower() or "compiled"
    if m not in MODES:
        raise ValueError(f"{MODE_ENV}={m!r}: expected one of {', '.join(MODES)}")
    return m


def supports_static(model) -> bool:
    return callable(getattr(model, "static_step", None))


def _pure(model, ctx: ForwardContext, n_state: int = 0):
    """The model's static forward of contexts like `ctx` as a pure function of arrays:
    (ids, positions, every row's state arrays) -> (logits, [streams,] every row's new state
    arrays).  One token (a single decode row): the family's `static_step`."""
    ref = weakref.ref(model)  # the compiled step is kept per model: it must not keep the model alive
    if ctx.kind == DECODE and ctx.tokens == 1:

        def run(ids, pos, *state):
            logits, new = ref().static_step(ids, pos, list(state))
            return (logits, *new)

        return run

    kind, streams = ctx.kind, ctx.streams  # the trace's static part: never a position nor a row count

    def run_rows(ids, pos, *flat):
        logits, news, *rest = ref().static_forward(ids, StepContext.of(kind, pos, list(flat), n_state, streams))
        return (logits, *rest, *[a for new in news for a in new])

    return run_rows


def _traced(model, ctx: ForwardContext, n_state: int, compiled: bool):
    """The function that runs `ctx`'s forward: with `compiled`, under `mx.compile` (one per
    model, context kind and layout, shared by its sessions; MLX retraces it per input-shape
    signature: a bucket, a row count); else the pure function itself (eager)."""
    _watch(model)  # its traces hold this model's weights: dropped with it (a new model may reuse the id)
    if not compiled:
        return _pure(model, ctx, n_state)
    key = (id(model), ctx.kind, ctx.tokens == 1, n_state, ctx.streams)
    fn = _compiled.get(key)
    if fn is None:
        fn = _compiled[key] = mx.compile(_counted(key, _pure(model, ctx, n_state)))
    return fn


def _counted(key: tuple, fn):
    """`fn` counting its calls in `_traces[key]`: under mx.compile the Python function runs
    only when MLX traces it (a new input-shape signature), never on a replay."""
    _traces[key] = 0

    def run(*args):
        _traces[key] += 1
        return fn(*args)

    return run


def trace_counts(model) -> dict[tuple[str, bool], int]:
    """How many times `model`'s compiled forwards were traced, per (kind, one row): a test
    pins that a decode retraces only per bucket or row count, never per position."""
    out: dict[tuple[str, bool], int] = {}
    for (mid, kind, one, _, _), n in _traces.items():
        if mid == id(model):
            out[kind, one] = out.get((kind, one), 0) + n
    return out


def _watch(model) -> None:
    """Forget a model's entries when it dies (its id may be reused by the next one)."""
    if id(model) not in _watched:
        _watched.add(id(model))
        weakref.finalize(model, _drop, id(model))


def _drop(key: int) -> None:
    for memo in (_checked, _refused, _watched):
        memo.discard(key)
    _drop_traces(key)


def _drop_traces(key: int) -> None:
    """The compiled functions of the model with id `key`: its step, rows and chains."""
    for k in [k for k in _compiled if k[0] == key]:
        _compiled.pop(k, None)
        _traces.pop(k, None)


def forget(model) -> None:
    """Drop what is remembered about `model`: its compiled step (whose traces hold the
    weights as constants: call this after changing them), its first-step check, the
    fused projections its modules built for the static step."""
    for memo in (_checked, _refused):
        memo.discard(id(model))
    _drop_traces(id(model))
    for _, m in model.named_modules():
        for name in FUSED_ATTRS:
            m.__dict__.pop(name, None)


def assume_checked(model) -> None:
    """Skip `model`'s first-step check: its next compiled step is traced and left lazy, not
    run eagerly first (bench/census.py reads the traced graph and evaluates nothing)."""
    _watch(model)
    _checked.add(id(model))


FUSED_ATTRS = ("_step_proj", "_step_q_b", "_step_shared")  # per-module caches of the static step


def _steered_static(model) -> bool:
    """A steered model whose static forward runs the steering edits (`static_steers`)."""
    return getattr(model, "static_steers", False) and steering.identity(model) is not None


def _steered_legacy(model) -> bool:
    """A steered model whose family edits each layer's outputs in its prefill forward only: it
    decodes there (correct, not compiled)."""
    return not getattr(model, "static_steers", False) and steering.identity(model) is not None


def can_undo(model) -> bool:
    """Whether `step(..., undoable=True)` can give an undo (static layout only)."""
    return supports_static(model) and mode() != "legacy" and id(model) not in _refused and not _steered_legacy(model)


def step(model, cache: list, ids: mx.array, pos: int, how: str | None = None, undoable: bool = False):
    """Lazy logits [V] of token ids [1, 1] (int32) at position `pos`; advances `cache`.

    With `undoable` (see `can_undo`) returns (logits, undo): calling `undo()` puts the
    caches back where they were before this step (the old arrays are kept alive for it,
    so the step cannot update them in place)."""
    how = how or mode()
    if how == "compiled" and getattr(getattr(model, "expert_store", None), "host_routing", False):
        how = "eager"  # streamed experts read the router's choice on the host: no trace
    if how == "compiled" and _steered_static(model):
        how = "eager"  # the directions would be constants of a trace
    if how == "legacy" or not supports_static(model) or _steered_legacy(model):
        if undoable:
            raise ValueError("the legacy decode path cannot undo a step")
        return model(ids, cache, last_only=True)[0, -1]
    if id(model) in _refused:
        return step(model, cache, ids, pos, "legacy", undoable)  # undoable: ValueError
    ctx = ForwardContext.decode([pos])
    state = model.static_state(cache)
    fn = _traced(model, ctx, len(state), how == "compiled")
    try:
        if how == "compiled" and id(model) not in _checked:
            # once per model, eagerly first: kernels self-test (and evaluate) at their first
            # use, which MLX refuses inside an mx.compile trace; the step is pure, so this
            # run's result is simply dropped; the CUDA kernels it is first to launch compile
            # side by side (cuda_cache), before anything is evaluated
            with cuda_cache.deferred():
                first = _pure(model, ctx)(ids, ctx.pos_array(), *state)
            mx.eval(first)
        out = fn(ids, ctx.pos_array(), *state)
        if id(model) not in _checked:  # once per model: a backend without one of the step's ops
            mx.eval(out)
            _watch(model)
            _checked.add(id(model))
    except Exception:
        log.warning(
            "the static decode step failed on %s; this model decodes on the legacy path",
            mx.default_device(),
            exc_info=True,
        )
        _watch(model)
        _refused.add(id(model))
        if undoable:  # the caller planned on an undo (engine lookahead): this one request fails
            raise
        return step(model, cache, ids, pos, "legacy")
    model.commit_static(cache, out[1:])
    if undoable:
        return out[0], lambda: model.rewind_static(cache, state)
    return out[0]


# -- several sessions in one forward (session batching, docs/kv-cache.md §11) --------------


def supports_rows(model) -> bool:
    """Whether `step_rows` runs B sessions of `model` in one forward: its family has
    `static_forward`, the static step has run once and not failed, no steering."""
    return (
        callable(getattr(model, "static_forward", None))
        and mode() != "legacy"
        and id(model) in _checked
        and id(model) not in _refused
        and steering.identity(model) is None
    )


def step_rows(model, caches: list, ids: mx.array, positions: list[int], undoable: bool = False) -> list:
    """One decode step of B sessions of one model in one forward (`supports_rows`):
    ids [1, B] int32, row b at position positions[b] over caches[b].  Returns per row
    the lazy logits [V] (with `undoable`: (logits, undo)), and advances every cache.
    The rows' logits are those of `step` on each alone."""
    ctx = ForwardContext.decode(positions)
    states = [model.static_state(c) for c in caches]
    n = len(states[0])
    fn = _traced(model, ctx, n, mode() == "compiled")
    out = fn(ids, ctx.pos_array(), *[a for st in states for a in st])
    logits = out[0]
    res = []
    for b, (cache, st) in enumerate(zip(caches, states)):
        model.commit_static(cache, list(out[1 + b * n : 1 + (b + 1) * n]))
        row = logits[b : b + 1].squeeze(0)  # a view (an integer index launches a gather)
        res.append((row, (lambda c=cache, s=st: model.rewind_static(c, s))) if undoable else row)
    return res


# -- several tokens of ONE session in one forward (speculative verification) --------------


def supports_chain(model) -> bool:
    """Whether `step_chain` runs T tokens of one session of `model` in one static forward:
    `supports_rows`, the family's rows can be chained (`static_rows_chain`: its
    `static_forward` takes a CHAIN context),
    and the router's choice stays on the device (not with streamed experts)."""
    return (
        supports_rows(model)
        and getattr(model, "static_rows_chain", False)
        and not getattr(getattr(model, "expert_store", None), "host_routing", False)
    )


def step_chain(model, cache: list, ids: mx.array, pos: int) -> tuple[mx.array, list]:
    """T consecutive tokens ids [1, T] (int32) of one session at positions pos.. in one
    forward over the static layout (`supports_chain`): `step_rows`' rows chained, row t
    over the state row t - 1 left, so it is T `step`s whose projections run once for the
    T tokens.  Returns (the lazy logits [T, V], every row's new state: row t's is the
    state after tokens 0..t) and advances `cache` T positions.  A caller that keeps only
    the first n tokens commits row n - 1's state (`keep_chain_row`) instead of a rollback
    and a second forward.  The backbone's `stream_hook` (the MTP head's input) gets the
    residual streams, as from the multi-token forward."""
    T = int(ids.shape[1])
    hook = getattr(getattr(model, "model", None), "stream_hook", None)
    ctx = ForwardContext.chain(pos, T, streams=hook is not None)
    state = model.static_state(cache, ahead=T)
    fn = _traced(model, ctx, len(state), mode() == "compiled")
    out = fn(ids, ctx.pos_array(), *state)  # every row's state: see below
    k = 1 if hook is None else 2
    if hook is not None:
        hook(out[1], pos)
    n = len(state)
    rows = [list(out[k + t * n : k + (t + 1) * n]) for t in range(T)]
    model.commit_static(cache, rows[-1], advance=T)
    return out[0], rows


def keep_chain_row(model, cache: list, rows: list, now: int, keep: int) -> None:
    """Move `cache`, holding `step_chain`'s row `now - 1` state, to row `keep - 1`'s (the
    state after the chain's first `keep` tokens; 1 <= keep <= len(rows))."""
    model.commit_static(cache, rows[keep - 1], advance=keep - now)
