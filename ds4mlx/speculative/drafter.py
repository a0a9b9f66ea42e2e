"""Where the draft tokens come from.

A drafter has `propose(context, x0, k, rule, margin) -> (drafts, q)`: up to k tokens that
follow `context + [x0]` (`context` = the target session's tokens), and, for sampled rules,
the draft distributions q [len(drafts), V] they were drawn from.  It never touches the
target session.

`ModelDrafter` (`--draft-model PATH`) runs another model (same tokenizer) in its own
session, which follows the target's context: tokens the target accepted are prefilled,
rejected ones rolled back (a checkpoint taken before each proposal).  The draft's steps
are enqueued lazily (each token fed to the next step on the device); the host reads the
k tokens once.  `margin` (ds4's `--mtp-margin`; argmax drafts only: greedy and
opportunistic sampling) prunes the recursive part of a draft: token i >= 2 is proposed
only while the draft's top-1 logit leads its top-2 by at least `margin` (a low-confidence
guess costs verify width and is rarely accepted).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np


def top2_gap(logits: mx.array) -> mx.array:
    top = mx.topk(logits.reshape(-1).astype(mx.float32), 2)
    return mx.max(top) - mx.min(top)


def settle_drafts(toks: list, qs: list, gaps: list, margin: float) -> tuple[list[int], np.ndarray | None]:
    """Evaluate a round's lazy draft tokens, draft distributions and top-2 gaps; keep the
    first draft and each next one while its gap is at least `margin` (no gaps: all).
    -> (draft ids, their distributions [n, V] or None)."""
    mx.eval(toks, qs, gaps)
    drafts = [int(t.item()) for t in toks]
    if gaps:
        keep = 1
        while keep < len(drafts) and float(gaps[keep].item()) >= margin:
            keep += 1
        drafts = drafts[:keep]
    q = np.stack([np.array(x) for x in qs[: len(drafts)]]) if qs else None
    return drafts, q


class DraftRound:
    """One round's drafts as a drafter samples them: each token, its distribution (a
    sampling rule's) and, with a margin under greedy drafting, its top-2 gap; `settle()`
    keeps the confident prefix (settle_drafts)."""

    def __init__(self, rule, margin: float):
        self.rule, self.margin = rule, margin
        self.gapped = margin > 0 and getattr(rule, "greedy_drafts", rule.greedy)
        self.toks: list = []
        self.qs: list = []
        self.gaps: list = []

    def draft(self, logits: mx.array) -> mx.array:
        tok, q = self.rule.draft(logits)
        self.toks.append(tok)
        if q is not None:
            self.qs.append(q)
        if self.gapped:
            self.gaps.append(top2_gap(logits))
        return tok

    def settle(self) -> tuple[list[int], np.ndarray | None]:
        return settle_drafts(self.toks, self.qs, self.gaps, self.margin)


class ModelDrafter:
    def __init__(self, model, ctx: int, chunk: int = 512):
        """`model`: a LanguageModel (models/base.py) or a family Model."""
        self.lm = model
        self.name = f"draft model {getattr(model, 'path', type(model).__name__)}"
        self.ctx, self.chunk = int(ctx), int(chunk)
        self.session = None
        self._before = None  # the draft session's checkpoint at the last proposal's start

    def _new_session(self):
        if hasattr(self.lm, "new_session"):
            return self.lm.new_session(ctx=self.ctx, chunk=self.chunk)
        from ..runtime.session import Session

        return Session(self.lm, ctx=self.ctx, chunk=self.chunk)

    def sync(self, context: Sequence[int]) -> None:
        """Make the draft session hold exactly `context`."""
        if self.session is None:
            self.session = self._new_session()
        s = self.session
        have = s.tokens
        n = len(have)
        if not (n <= len(context) and have == list(context[:n])):
            cp = self._before
            if cp is not None and len(cp) <= len(context) and list(cp.tokens) == list(context[: len(cp)]):
                s.rollback(cp)
            else:
                s.reset()
            n = len(s)
        if n < len(context):
            s.prefill(context[n:])
        self._before = None

    def propose(self, context: Sequence[int], x0: int, k: int, rule, margin: float = 0.0):
        self.sync(context)
        s = self.session
        k = min(int(k), s.ctx - len(s) - 1)
        if k <= 0:
            return [], None
        self._before = s.checkpoint()
        round_, tok = DraftRound(rule, margin), x0
        for _ in range(k):
            tok = round_.draft(s.step(tok))
        return round_.settle()


class ScriptedDrafter:
    """Test drafter: the tokens a function of the context returns (an oracle's, corrupted)."""

    def __init__(self, fn):
        self.fn = fn

    def propose(self, context, x0, k, rule, margin: float = 0.0):
        return [int(t) for t in self.fn(list(context) + [int(x0)], int(k))][:k], None
