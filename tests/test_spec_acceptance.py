"""Sampled speculation's two acceptance rules (issue #21): ds4's `--mtp-exact-sampling`.

ds4 (its documentation, Speculative Decoding, "Sampling and reproducibility"; ds4.h on
`ds4_session_eval_speculative`): at temperature > 0 the default is opportunistic, matching
greedy drafts are accepted directly and sampling resumes where the proposed suffix does
not match; `--mtp-exact-sampling` keeps the target distribution.  Here, on crafted logits:
the opportunistic rule keeps exactly the drafts that are the target's argmax (bans
applied) and draws the next token from the ordinary p of the first unmatched row (not the
residual); the flag picks the rule (on by default here, issue #21: opportunistic only when asked; ds4
defaults to off), and with it on the sampled
rule is the standard one (its distribution tests: tests/test_spec_decode.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.runtime.sampling import SamplingParams
from ds4mlx.speculative import cli as spec_cli
from ds4mlx.speculative.acceptance import GreedyRule, OpportunisticRule, SampledRule, distribution, rule_for
from ds4mlx.speculative.drafter import ModelDrafter, ScriptedDrafter
from ds4mlx.speculative.loop import SpeculativeLoop, loop_for_job
from ds4mlx.speculative.options import SpecConfig

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import load_case  # noqa: E402
from spec_helpers import compiled_small_buckets  # noqa: E402, F401  (autouse)

HOT = SamplingParams(temperature=1.0, min_p=0.0)


def _rows(*argmaxes, vocab=6, seed=0):
    """Logits [len, vocab]: random, then each row's argmax lifted to the given token."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((len(argmaxes), vocab)).astype(np.float32)
    for i, a in enumerate(argmaxes):
        x[i, a] = x[i].max() + 0.5
    return x


def _freq(draws, vocab):
    return np.bincount(draws, minlength=vocab) / len(draws)


def _close(freq, p, trials):
    return np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / trials) + 1e-9)


def test_drafts_kept_while_they_are_the_targets_argmax():
    x = _rows(3, 1, 4, 0)
    rule = OpportunisticRule(6, HOT, seed=1)
    for drafts, kept in (([3, 1, 4], 3), ([3, 1, 5], 2), ([3, 2, 4], 1), ([2, 1, 4], 0), ([], 0)):
        rows = mx.array(x[: len(drafts) + 1])
        n, nxt = rule.accept(rows, drafts)
        assert n == kept and 0 <= nxt < 6
        p = np.array(distribution(rows, HOT), np.float64)
        assert rule.accept_probs(p, drafts)[0] == kept  # the host form agrees


def test_the_token_after_the_kept_prefix_is_drawn_from_p_not_the_residual():
    x = _rows(3, 1)  # row 0's argmax is 3; the draft says 2: rejected at 0
    p0 = np.array(distribution(mx.array(x[:1]), HOT), np.float64)[0]
    rule = OpportunisticRule(6, HOT, seed=2)
    trials = 20000
    draws = []
    for _ in range(trials):
        n, nxt = rule.accept(mx.array(x), [2])
        assert n == 0
        draws.append(nxt)
    freq = _freq(draws, 6)
    assert _close(freq, p0, trials)
    assert freq[2] > 0  # the rejected draft itself is drawn as often as p says (the residual never would)

    # every draft kept: the next token is p of the last row
    p1 = np.array(distribution(mx.array(x[1:]), HOT), np.float64)[0]
    draws = [rule.accept(mx.array(x), [3])[1] for _ in range(trials)]
    assert _close(_freq(draws, 6), p1, trials)


def test_bans_and_filters_apply_to_the_argmax_and_to_the_draw():
    x = _rows(3, 1)
    rule = OpportunisticRule(6, HOT, banned=[3], seed=3)
    second = int(np.argsort(-x[0])[1])  # with 3 banned the target's argmax is the runner-up
    assert rule.accept(mx.array(x), [3])[0] == 0
    assert rule.accept(mx.array(x), [second])[0] == 1
    other = next(t for t in range(6) if t not in (second, 3))
    assert all(rule.accept(mx.array(x), [other])[1] != 3 for _ in range(200))
    top1 = OpportunisticRule(6, SamplingParams(temperature=1.0, top_k=1, min_p=0.0), seed=4)
    assert top1.accept(mx.array(x), [2]) == (0, 3)  # top-k 1: the draw is the argmax


def test_drafts_are_the_drafts_argmax_and_margin_pruning_applies():
    x = mx.array(_rows(4)[0])
    rule = OpportunisticRule(6, HOT, seed=5)
    tok, q = rule.draft(x)
    assert int(tok.item()) == 4 and q is None
    assert rule.greedy_drafts and GreedyRule(6).greedy_drafts and not SampledRule(6, HOT).greedy_drafts


def test_the_flag_picks_the_rule_and_is_on_by_default():
    p = argparse.ArgumentParser()
    spec_cli.add_arguments(p)
    assert p.parse_args([]).mtp_exact_sampling is True  # opportunistic only when asked (issue #21)
    assert p.parse_args(["--mtp-exact-sampling"]).mtp_exact_sampling is True
    assert p.parse_args(["--no-mtp-exact-sampling"]).mtp_exact_sampling is False
    assert SpecConfig(object()).exact_sampling is True
    assert isinstance(rule_for(HOT, 6, exact_sampling=False), OpportunisticRule)
    assert type(rule_for(HOT, 6, exact_sampling=True)) is SampledRule
    assert type(rule_for(SamplingParams(temperature=0.0), 6, exact_sampling=False)) is GreedyRule
    logits = mx.zeros((6,))
    for exact, kind in ((False, OpportunisticRule), (True, SampledRule)):
        loop = loop_for_job(SpecConfig(object(), exact_sampling=exact), None, logits, HOT)
        assert type(loop.rule) is kind
    assert "opportunistic" in SpecConfig(object(), exact_sampling=False).describe()
    assert "exact" in SpecConfig(object()).describe()
    assert "exact" in SpecConfig(object(), exact_sampling=True).describe()


# ------------------------------------------------------------------ on the tiny V4
@pytest.fixture(scope="module")
def v4(oracle):
    _, lm, ref, _ = load_case(oracle, "make_tiny_deepseek_v4.py", "long")
    return lm, ref["input_ids"][0].tolist()[:8]


def test_loop_keeps_every_argmax_draft_and_samples_the_rest(v4):
    """An oracle drafter (the target's own argmax after each context) is always accepted;
    every round then emits its x0, the drafts and nothing else (the next x0 sampled)."""
    lm, prompt = v4
    s = lm.new_session(ctx=120)
    rule = OpportunisticRule(lm.vocab_size, SamplingParams(temperature=0.9, min_p=0.0), seed=6)
    loop = SpeculativeLoop(s, s.prefill(prompt), ModelDrafter(lm, ctx=120), rule, depth=3, limit=60)
    got = list(loop)
    assert len(got) == 60 and s.tokens == prompt + got
    assert loop.stats.accepted >= loop.stats.drafted - 1  # self-draft: the argmax, up to float noise
    # replay: every accepted draft is the target's argmax after its context
    ref = lm.new_session(ctx=120)
    logits = ref.prefill(prompt)
    argmax_hits = 0
    for t in got:
        argmax_hits += int(t == int(np.argmax(np.asarray(logits, np.float32))))
        logits = ref.step(t)
    assert argmax_hits >= loop.stats.accepted


def test_margin_prunes_the_argmax_drafts_of_the_opportunistic_rule(v4):
    lm, prompt = v4
    hot = SamplingParams(temperature=0.9, min_p=0.0)
    for rule, most in (
        (OpportunisticRule(lm.vocab_size, hot, seed=8), 1),
        (SampledRule(lm.vocab_size, hot, seed=8), 3),
    ):
        drafts, _ = ModelDrafter(lm, ctx=120).propose(prompt, 5, 3, rule, margin=1e9)
        assert len(drafts) == most  # ds4's --mtp-margin gates argmax drafts only


def test_a_wrong_drafter_is_never_accepted(v4):
    lm, prompt = v4
    s = lm.new_session(ctx=120)
    ref = lm.new_session(ctx=120)
    ref.prefill(prompt)

    def wrong(ctx, k):  # the target's argmax + 1: never its argmax
        out = []
        r = lm.new_session(ctx=120)
        logits = r.prefill(ctx)
        for _ in range(k):
            t = (int(np.argmax(np.asarray(logits, np.float32))) + 1) % lm.vocab_size
            out.append(t)
            logits = r.step(t)
        return out

    rule = OpportunisticRule(lm.vocab_size, SamplingParams(temperature=0.9, min_p=0.0), seed=7)
    loop = SpeculativeLoop(s, s.prefill(prompt), ScriptedDrafter(wrong), rule, depth=2, limit=20)
    got = list(loop)
    assert len(got) == 20 and s.tokens == prompt + got
    # every round with a draft rolls back (the last round has no room to draft)
    assert loop.stats.accepted == 0 and loop.stats.rollbacks >= loop.stats.rounds - 1
