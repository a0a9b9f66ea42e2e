"""Speculation under a host-driven token loop (ds4-eval's `</think>` budget controller).

`SpeculativeStepper(session, drafter, depth)` has the session's `step(tok) -> logits`
face for a loop that chooses every token on the host.  On a token it has no row for, it
asks the drafter for up to `depth` tokens after it and verifies them with the token in
one forward; while the loop then picks exactly the drafted tokens, their logits come
from that forward (no new target pass).  The first different pick rolls the session back
past the unconsumed drafts.  The loop still draws every token from the target's own
logits, so any sampler keeps its exact distribution; the drafts only decide how many
target forwards that costs.  Call `settle()` before using the session otherwise.
"""

from __future__ import annotations

import time

import mlx.core as mx

from .acceptance import GreedyRule
from .loop import keep_prefix
from .options import SpecStats


class SpeculativeStepper:
    def __init__(self, session, drafter, depth: int = 1, margin: float = 0.0, stats: SpecStats | None = None):
        self.session, self.drafter = session, drafter
        self.depth, self.margin = max(1, int(depth)), float(margin)
        self.stats = stats if stats is not None else SpecStats()
        self.rule = GreedyRule(0)  # the drafts: the draft's argmax (the loop picks the tokens)
        self._pending: list = []  # (draft token, its logits row), verified but not consumed
        self._round = None  # (checkpoint, verified ids, how many consumed)

    def step(self, tok: int) -> mx.array:
        tok = int(tok)
        if self._pending and self._pending[0][0] == tok:
            _, row = self._pending.pop(0)
            self._round[2] += 1
            self.stats.accepted += 1
            self.stats.emitted += 1
            return row
        self.settle()
        s = self.session
        k = min(self.depth, s.ctx - len(s) - 1)
        drafts = []
        t0 = time.perf_counter()
        if k > 0:
            drafts = [int(d) for d in self.drafter.propose(s.tokens, tok, k, self.rule, self.margin)[0][:k]]
        t1 = time.perf_counter()
        cp = s.checkpoint()
        ids = [tok, *drafts]
        rows = s.verify(ids)
        mx.eval(rows)
        self.stats.draft_seconds += t1 - t0
        self.stats.verify_seconds += time.perf_counter() - t1
        self.stats.rounds += 1
        self.stats.drafted += len(drafts)
        self.stats.emitted += 1
        self._round = [cp, ids, 1]
        self._pending = [(d, rows[i + 1]) for i, d in enumerate(drafts)]
        return rows[0]

    def settle(self) -> None:
        """Drop verified tokens the loop did not take: the session holds what it stepped."""
        r, self._round, pending = self._round, None, self._pending
        self._pending = []
        if r is None or not pending:
            return
        cp, ids, used = r
        t0 = time.perf_counter()
        self.stats.rollbacks += 1
        keep_prefix(self.session, cp, ids, used)
        mx.eval(self.session.cache_arrays())
        self.stats.verify_seconds += time.perf_counter() - t0  # the rollback is part of the verify cost

    def __len__(self) -> int:
        return len(self.session) - len(self._pending)
