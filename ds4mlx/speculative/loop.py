"""The speculative decode loop, with decode.DecodeLoop's contract.

`SpeculativeLoop(session, logits, drafter, rule, ...)` yields token ids, each already in
the session, and stops (like DecodeLoop) at a stop id (not fed; `stopped_by`), at `limit`
tokens, or when the consumer leaves the `for`.  One round:

1. x0 = the target's token after the session (drawn by `rule` from the last logits, or
   the token the previous round's verification chose);
2. the drafter proposes d1..dk after x0 (k capped by `limit` and the context);
3. checkpoint, `session.verify([x0, d1..dk])`: one forward, k+1 rows of logits;
4. `rule.accept`: the kept prefix d1..dn and the token after it (the next round's x0);
   an accepted stop id ends the kept prefix (it is the next x0: the loop stops on it);
5. if n < k: the session keeps [x0, d1..dn]: the chained verify's state after them where it
   has one (`Session.keep_verified`, no forward), else a rollback and [x0, d1..dn] fed
   again (one token as a plain decode step);
6. yield x0, d1..dn.

The consumer may stop in the middle of step 6 (a stop string, a tool call, a cancel):
`settle()` then rolls the session back to the tokens it actually received, so the
session ends where token-by-token decoding ends.  The engine calls it after the loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import mlx.core as mx

from .options import SpecStats


class SpeculativeLoop:
    def __init__(
        self,
        session,
        logits,
        drafter,
        rule,
        *,
        depth: int = 1,
        margin: float = 0.0,
        stop_ids: Iterable[int] = (),
        limit: int | None = None,
        stats: SpecStats | None = None,
        timing: bool = False,
    ):
        self.session = session
        self.timing = bool(timing)  # --mtp-timing: `settle` measures the verify cost per k (cost.py)
        self.logits = logits if isinstance(logits, mx.array) else mx.array(logits)
        self.drafter, self.rule = drafter, rule
        self.depth, self.margin = max(1, int(depth)), float(margin)
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.limit = limit
        self.stopped_by: int | None = None
        self.stats = stats if stats is not None else SpecStats()
        self._round = None  # (checkpoint, kept ids, how many of them were yielded)

    def _room(self, n: int) -> bool:
        return self.limit is None or n < self.limit

    def __iter__(self) -> Iterator[int]:
        s, n = self.session, 0
        pending = self.rule.first(self.logits)
        while self._room(n):
            x0 = pending
            if x0 in self.stop_ids:
                self.stopped_by = x0
                return
            k = min(self.depth, s.ctx - len(s) - 1)
            if self.limit is not None:
                k = min(k, self.limit - n - 1)
            drafts, q = ([], None)
            t0 = time.perf_counter()
            if k > 0:
                drafts, q = self.drafter.propose(s.tokens, x0, k, self.rule, self.margin)
                drafts = [int(d) for d in drafts[:k]]
                q = None if q is None else q[: len(drafts)]
            t1 = time.perf_counter()
            cp = s.checkpoint()
            ids = [x0, *drafts]
            rows = s.verify(ids)
            kept, pending = self.rule.accept(rows, drafts, q)
            for i, d in enumerate(drafts[:kept]):
                if d in self.stop_ids:  # the stop id is the next token: not fed
                    kept, pending = i, d
                    break
            st = self.stats
            st.rounds += 1
            st.drafted += len(drafts)
            st.accepted += kept
            st.emitted += 1 + kept
            if kept < len(drafts):
                st.rollbacks += 1
                keep_prefix(s, cp, ids, 1 + kept)
            mx.eval(s.cache_arrays())
            st.draft_seconds += t1 - t0
            st.verify_seconds += time.perf_counter() - t1
            self._round = [cp, ids[: 1 + kept], 0]
            for t in ids[: 1 + kept]:
                n += 1
                self._round[2] += 1
                yield t
        # the limit: every kept token was yielded

    def settle(self) -> None:
        """Roll the session back to the tokens the consumer received (after it left the loop)."""
        r, self._round = self._round, None
        if r is not None:
            cp, kept, used = r
            if used < len(kept):
                keep_prefix(self.session, cp, kept, used)
                mx.eval(self.session.cache_arrays())
        if self.timing and self.stats.rounds and not self.stats.costs:
            from .cost import measure

            s = self.session
            costs = measure(s, s.tokens[-1] if len(s) else 0, draft_ms=self.stats.draft_ms_per_token)
            if costs is not None:
                self.stats.costs = costs.as_dict()


def keep_prefix(session, cp, ids, n: int) -> None:
    """Bring `session`, just past `session.verify(ids)` from checkpoint `cp`, back to cp's
    tokens + ids[:n]: the chained verify's row state when it is still there (no forward),
    else a rollback and the n tokens fed again."""
    keep = getattr(session, "keep_verified", None)  # (sessions of other kinds: rollback)
    if n > 0 and keep is not None and keep(n):
        return
    session.rollback(cp)
    refeed(session, ids[:n])


def refeed(session, ids) -> None:
    """Feed the kept prefix of a rolled-back verify again: one token as a plain (compiled)
    decode step, several as one verify forward."""
    if len(ids) == 1:
        session.step(int(ids[0]))
    elif ids:
        session.verify(ids)


def loop_for_job(spec, session, logits, params, *, banned=None, seed=0, stop_ids=(), limit=None, stats=None):
    """The engine's speculative loop for one job, or None where speculation does not apply:
    no `spec` (SpecConfig), or penalties or a logit bias (sampling.Penalties: the history
    would differ per draft position; such a job decodes token by token)."""
    if spec is None or params.penalised:
        return None
    from .acceptance import rule_for

    vocab = int(logits.shape[-1])
    exact = bool(getattr(spec, "exact_sampling", False))
    return SpeculativeLoop(
        session,
        logits,
        spec.drafter,
        rule_for(params, vocab, banned, seed, exact_sampling=exact),
        depth=spec.depth,
        margin=spec.margin,
        stop_ids=stop_ids,
        limit=limit,
        stats=stats,
        timing=bool(getattr(spec, "timing", False)),
    )
