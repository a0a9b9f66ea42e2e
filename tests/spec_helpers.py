"""What the speculative-decoding tests share: the compiled step with small buckets, greedy
speculation next to plain decoding, and a rule whose drafts are mostly right (so rounds keep
several drafts)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from ds4mlx.models import cache as row_cache
from ds4mlx.runtime import stepper
from ds4mlx.runtime.decode import decode_tokens, greedy
from ds4mlx.speculative.acceptance import GreedyRule
from ds4mlx.speculative.loop import SpeculativeLoop


@pytest.fixture(autouse=True)
def compiled_small_buckets(monkeypatch):
    """The compiled static step, row buffers growing every 4 rows (the tiny models' runs
    cross a bucket); autouse in every module that imports it."""
    monkeypatch.setattr(row_cache, "MIN_BUCKET", 4)
    monkeypatch.setenv(stepper.MODE_ENV, "compiled")


_PLAIN: dict = {}


def plain_greedy(lm, prompt: list, n: int, stop_ids=()):
    """(tokens, session) of plain greedy decoding, `n` tokens after `prompt`, run once per
    model, prompt, length and stop ids: several tests (a test's depths) compare with the same
    run; they read its session, never step it."""
    key = (id(lm), tuple(prompt), n, tuple(stop_ids))
    if key not in _PLAIN:
        s = lm.new_session(ctx=len(prompt) + n + 8)
        tokens = list(decode_tokens(s, s.prefill(prompt), greedy(lm.vocab_size), stop_ids=stop_ids, limit=n))
        _PLAIN[key] = (lm, tokens, s)  # lm kept: its id stays unique
    _, tokens, s = _PLAIN[key]
    return list(tokens), s


def plain_and_speculative(lm, prompt: list, n: int, drafter, depth: int, rule=None):
    """(plain greedy tokens, speculative tokens, the loop) for `n` tokens after `prompt`;
    the drafter is closed afterwards."""
    want, _ = plain_greedy(lm, prompt, n)
    try:
        s = lm.new_session(ctx=len(prompt) + n + 8)
        rule = GreedyRule(lm.vocab_size) if rule is None else rule
        loop = SpeculativeLoop(s, s.prefill(prompt), drafter, rule, depth=depth, margin=0, limit=n)
        got = list(loop)
    finally:
        drafter.close()
    return want, got, loop


class ScriptedPicks(GreedyRule):
    """Greedy acceptance, but the drafter's picks are the plain greedy continuation `script`
    (every third one off by one): most drafts get accepted, so rounds add several positions.
    A drafter sets `at` to the position of its first pick."""

    def __init__(self, vocab, script):
        super().__init__(vocab)
        self.vocab, self.script, self.at = vocab, script, 0

    def draft(self, logits):
        tok = self.script[self.at] if self.at < len(self.script) else 0
        tok = (tok + 1) % self.vocab if self.at % 3 == 0 else tok
        self.at += 1
        return mx.array(tok, mx.int32), None
