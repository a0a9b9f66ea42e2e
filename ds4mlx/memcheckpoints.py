"""In-memory checkpoints of the live session (#17 item 5).

The live session can only grow: a request whose prompt shares a shorter prefix
with it (a retry, a new turn after a long generation) would re-prefill
everything.  The engine keeps a `session.snapshot()` taken at the end of each
long enough prompt; a later request whose tokens start with a checkpoint's
restores it and prefills only the rest.  Bounded by entries and bytes
(`DS4MLX_MEMORY_CHECKPOINT_MB`, default 2048; 0 turns them off); the newest win.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_BUDGET_MB = 2048
DEFAULT_ENTRIES = 2
DEFAULT_MIN_TOKENS = 512  # a shorter prompt is cheaper to prefill again than to snapshot


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


class MemoryCheckpoints:
    def __init__(
        self, budget_bytes: int | None = None, entries: int = DEFAULT_ENTRIES, min_tokens: int = DEFAULT_MIN_TOKENS
    ):
        self.budget = budget_from_env() if budget_bytes is None else max(0, int(budget_bytes))
        self.entries = max(0, int(entries))
        self.min_tokens = max(1, int(min_tokens))
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

    def save(self, tokens: Sequence[int], session) -> None:
        blob = session.snapshot()
        if len(blob) > self.budget:
            return
        key = tuple(tokens)
        self._items = [c for c in self._items if c.tokens != key]
        self._items.append(Checkpoint(key, blob))
        while self._items and (len(self._items) > self.entries or self.nbytes > self.budget):
            self._items.pop(0)
        self.saved += 1

    def best(self, ids: Sequence[int], longer_than: int = 0) -> Checkpoint | None:
        """The longest checkpoint whose tokens start `ids` (and are longer than `longer_than`)."""
        best = None
        for c in self._items:
            n = len(c.tokens)
            if longer_than < n <= len(ids) and (best is None or n > len(best.tokens)) and tuple(ids[:n]) == c.tokens:
                best = c
        return best
