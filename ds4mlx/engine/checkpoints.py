"""In-memory checkpoints of the live session.

The live session can only grow: a request whose prompt shares a shorter prefix
with it (a retry, a new turn after a long generation) would re-prefill
everything.  The engine keeps `session.snapshot()`s, shared by every slot:

* `prompt`: at the end of each long enough prompt (a retry of the same prompt);
* `tail`: `tail` tokens before that end (a retry that rewrites the prompt's last
  tokens re-prefills about `tail` of them, not the whole prompt);
* `frontier`: while generating, at the absolute positions that are multiples of
  `every` (a new turn whose common prefix ends inside the previous answer);
* `evicted`: a live session another request is about to replace (its client's
  next turn continues it: two clients sharing a slot do not evict each other
  while memory lasts).

A later request whose tokens start with a checkpoint's restores the longest such
one and prefills only the rest.  Bounded by entries and bytes
(`DS4MLX_MEMORY_CHECKPOINT_MB`, default 2048; 0 turns them off); the oldest go
first, except that the newest prompt-end and tail checkpoints (a retry's) go last.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_BUDGET_MB = 2048
DEFAULT_ENTRIES = 8
DEFAULT_MIN_TOKENS = 512  # a shorter prompt is cheaper to prefill again than to snapshot
DEFAULT_EVERY_TOKENS = 2048  # generation frontiers: the disk cache's default alignment
DEFAULT_TAIL_TOKENS = 256  # a prompt's tail checkpoint sits this many tokens before its end

PROMPT, TAIL, FRONTIER, EVICTED = "prompt", "tail", "frontier", "evicted"
SPARED = (PROMPT, TAIL)  # the newest of these kinds go last (a retry's)


def budget_from_env() -> int:
    raw = os.environ.get("DS4MLX_MEMORY_CHECKPOINT_MB")
    try:
        mb = int(raw) if raw is not None else DEFAULT_BUDGET_MB
    except ValueError:
        mb = DEFAULT_BUDGET_MB
    return max(0, mb) * 1024 * 1024


@dataclass
class Checkpoint:
    tokens: tuple
    blob: bytes
    kind: str = PROMPT  # prompt | tail | frontier | evicted (see the module doc)

    @property
    def frontier(self) -> bool:
        """Taken while generating, not at the end of a prompt."""
        return self.kind == FRONTIER


class MemoryCheckpoints:
    def __init__(
        self,
        budget_bytes: int | None = None,
        entries: int = DEFAULT_ENTRIES,
        min_tokens: int = DEFAULT_MIN_TOKENS,
        every: int = DEFAULT_EVERY_TOKENS,
        tail: int = DEFAULT_TAIL_TOKENS,
    ):
        self.budget = budget_from_env() if budget_bytes is None else max(0, int(budget_bytes))
        self.entries = max(0, int(entries))
        self.min_tokens = max(1, int(min_tokens))
        self.every = max(0, int(every))  # 0: no generation frontiers
        self.tail = max(0, int(tail))  # 0: no tail checkpoints
        self._items: list[Checkpoint] = []  # oldest first
        self.saved = 0
        self.restored = 0

    @property
    def nbytes(self) -> int:
        return sum(len(c.blob) for c in self._items)

    def wants(self, n_tokens: int, evaluated: int) -> bool:
        """Worth a snapshot: enabled, long enough, and not already kept."""
        if not self.budget or not self.entries or n_tokens < self.min_tokens or evaluated <= 0:
            return False
        return not any(len(c.tokens) == n_tokens for c in self._items[-1:])

    def due(self, n_tokens: int) -> bool:
        """A generation frontier: the session holds an aligned number of tokens."""
        return bool(self.every) and n_tokens % self.every == 0 and self.wants(n_tokens, 1)

    def tail_point(self, n_tokens: int, cached: int) -> int:
        """Where the prefill of an `n_tokens` prompt, reusing `cached`, stops for its tail
        checkpoint (0 = none): `tail` tokens before the end, past the reused part."""
        p = n_tokens - self.tail
        return p if self.tail and p > cached and self.wants(p, 1) else 0

    def save(self, tokens: Sequence[int], session, frontier: bool = False, kind: str | None = None) -> None:
        blob = session.snapshot()
        if len(blob) > self.budget:
            return
        key = tuple(tokens)
        self._items = [c for c in self._items if c.tokens != key]
        self._items.append(Checkpoint(key, blob, kind or (FRONTIER if frontier else PROMPT)))
        while self._items and (len(self._items) > self.entries or self.nbytes > self.budget):
            self._items.pop(self._eviction_index())
        self.saved += 1

    def _eviction_index(self) -> int:
        """The oldest, sparing the newest prompt-end and tail checkpoints while others are left."""
        newest = {c.kind: i for i, c in enumerate(self._items)}
        spared = {newest[k] for k in SPARED if k in newest}
        return next((i for i in range(len(self._items)) if i not in spared), 0)

    def best(self, ids: Sequence[int], longer_than: int = 0) -> Checkpoint | None:
        """The longest checkpoint whose tokens start `ids` (and are longer than `longer_than`)."""
        best = None
        for c in self._items:
            n = len(c.tokens)
            if longer_than < n <= len(ids) and (best is None or n > len(best.tokens)) and tuple(ids[:n]) == c.tokens:
                best = c
        return best
