"""What one static forward runs over (docs/forward.md §2, §3): its rows, their positions and
token counts, its kind, and each row's cache views.

Two halves.  `ForwardContext` is built on the host by the caller (runtime/stepper.py,
runtime/session.py) from host ints alone, before any trace: it decides the kind and gives
the trace's position argument.  `StepContext` is what the traced forward sees: the same
kind and row count (static under a trace), the positions as device arrays and the rows'
`StateView`s; the forward may branch on the kind and on the number of rows, never on a
position value.

Kinds:

* `PREFILL`: one session's chunk of tokens over its live caches, positions as host ints
  (the forward may branch on them: it is never traced);
* `DECODE`: B >= 1 independent rows (sessions) of one token each;
* `CHAIN`: one session's next T tokens (a speculative verify), row t over the state row
  t - 1 left, every row's new state kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

PREFILL = "prefill"
DECODE = "decode"
CHAIN = "chain"
KINDS = (PREFILL, DECODE, CHAIN)


@dataclass(frozen=True)
class ForwardContext:
    """A static forward as the host plans it: `starts[b]` row b's first position, `counts[b]`
    its tokens (one per row for DECODE; one row of T for CHAIN); `streams`: the residual
    streams after the last layer are an output too (the MTP head's input)."""

    kind: str
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    streams: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"forward kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if not self.starts or len(self.starts) != len(self.counts) or min(self.counts) < 1:
            raise ValueError(f"a forward needs rows of at least one token: {self.starts}, {self.counts}")
        if self.kind == DECODE and max(self.counts) != 1:
            raise ValueError("a decode forward runs one token per row")
        if self.kind in (CHAIN, PREFILL) and len(self.starts) != 1:
            raise ValueError(f"a {self.kind} runs one session's tokens")

    @classmethod
    def decode(cls, positions) -> ForwardContext:
        """B sessions' next tokens, row b at positions[b]."""
        return cls(DECODE, tuple(int(p) for p in positions), (1,) * len(positions))

    @classmethod
    def prefill(cls, start: int, count: int) -> ForwardContext:
        """One session's chunk of `count` tokens from position `start`."""
        return cls(PREFILL, (int(start),), (int(count),))

    @classmethod
    def chain(cls, start: int, count: int, streams: bool = False) -> ForwardContext:
        """One session's next `count` tokens from position `start`."""
        return cls(CHAIN, (int(start),), (int(count),), streams)

    @property
    def tokens(self) -> int:
        """T: the forward's tokens (its query rows), every row's together."""
        return sum(self.counts)

    def positions(self) -> list[int]:
        """Every token's position, in the order of the ids."""
        return [p for s, n in zip(self.starts, self.counts) for p in range(s, s + n)]

    def pos_array(self) -> mx.array:
        """The positions as the trace's int32 [T] argument (host data: no arange launch); one
        decode row's as an int32 scalar (the family's `static_step` takes it so)."""
        if self.kind == DECODE and self.tokens == 1:
            return mx.array(self.starts[0], mx.int32)
        return mx.array(self.positions(), mx.int32)


class StateView:
    """One query row's cache arrays inside a static forward, over today's flat state lists:
    read in the family's fixed order (`next`), the row's new arrays written in the same order
    (`put`, then `new`).  A chained row reads the list the row before it writes (a list
    iterator sees later appends), so a layer's new arrays of row t - 1 exist before row t
    reads them."""

    def __init__(self, arrays):
        self._it = iter(arrays)
        self.new: list = []

    def __iter__(self):
        return self

    def __next__(self) -> mx.array:
        return next(self._it)

    def put(self, *arrays) -> None:
        self.new.extend(arrays)


class LiveView:
    """A PREFILL's view of one live cache object, read and written as a `StateView` is: its
    attributes `names` in that order (`next`), the new arrays set back in the same order
    (`put`), so one per-row code path serves a chunk over the live cache and a static row."""

    def __init__(self, cache, names: tuple[str, ...]):
        self._cache = cache
        self._read, self._write = iter(names), iter(names)

    def __iter__(self):
        return self

    def __next__(self) -> mx.array:
        return getattr(self._cache, next(self._read))

    def put(self, *arrays) -> None:
        for a in arrays:
            setattr(self._cache, next(self._write), a)


class RowPositions(list):
    """The query rows' positions of a traced forward, each an int32 scalar view of `all` (the
    [T] array they come from): a kernel that needs a per-row value of every position can
    compute them in one launch over `all` (kernels/sparse_attention.py's metas)."""

    def __init__(self, all_pos: mx.array):
        super().__init__(all_pos[t : t + 1].squeeze(0) for t in range(all_pos.shape[0]))  # views, not gathers
        self.all = all_pos


@dataclass
class StepContext:
    """A forward as the model sees it.  DECODE or CHAIN (traced): `row_pos[b]` query row b's
    position (an int32 scalar array), `pos` all of them as one array ([T], or the scalar of a
    single row), `views[b]` row b's `StateView`.  PREFILL (eager): one row, `row_pos[0]` its
    first position (a host int), `pos` None, `views[0]` the session's live layer caches."""

    kind: str
    pos: mx.array
    row_pos: list
    views: list = field(default_factory=list)
    streams: bool = False

    @property
    def rows(self) -> int:
        return len(self.views)

    def split(self, *arrays) -> list[tuple]:
        """Per query row, its slice [:, t : t + 1] of each of `arrays` ([1, T, ...]; a slice
        is a view, an integer index a gather); one row gets the arrays themselves."""
        if self.rows == 1:
            return [arrays]
        return [tuple(a[:, t : t + 1] for a in arrays) for t in range(self.rows)]

    def join(self, outs: list) -> mx.array:
        """The rows' outputs [1, 1, ...] as one [1, T, ...] (`split`'s inverse)."""
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)

    @classmethod
    def prefill(cls, start: int, caches: list) -> StepContext:
        """A chunk at host position `start` over the session's layer caches (advanced by the
        forward)."""
        return cls(PREFILL, None, [int(start)], [caches])

    @classmethod
    def one(cls, pos: mx.array, state) -> StepContext:
        """One token at `pos` (an int32 scalar) over one state list."""
        return cls(DECODE, pos, [pos], [StateView(state)])

    @classmethod
    def of(cls, kind: str, pos: mx.array, flat: list, n_state: int, streams: bool = False) -> StepContext:
        """A forward of `kind` over the trace's arguments: `pos` a `ForwardContext.pos_array`
        [T] (T query rows: its shape, static under a trace), `flat` the rows' state lists one
        after another (DECODE, `n_state` arrays each) or the one session's (CHAIN: row t's
        view reads row t - 1's new arrays)."""
        T = pos.shape[0]
        row_pos = RowPositions(pos)
        if kind == CHAIN:
            views = [StateView(flat)]
            for _ in range(T - 1):
                views.append(StateView(views[-1].new))
        else:
            views = [StateView(flat[b * n_state : (b + 1) * n_state]) for b in range(T)]
        return cls(kind, pos, row_pos, views, streams)
