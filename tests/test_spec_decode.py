"""Speculative decoding loop (issue #21 step 2): greedy exact, sampled = the target's distribution.

Greedy: with speculation the tokens equal plain decoding token for token over >= 200
tokens (crossing the tiny V4's sliding window of 16 many times), with a self-draft
(acceptance 1.0), a scripted drafter that is wrong at every depth, and another model as
the draft; stop ids and the limit end the loop where plain decoding ends, and the session
then holds exactly the yielded tokens (`settle` after the consumer leaves mid-round).
Sampled: exact math on the acceptance rule (the output distribution of one speculative
step equals p) and a statistical check on a tiny vocabulary.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.runtime.decode import decode_tokens, greedy
from ds4mlx.runtime.sampling import SamplingParams
from ds4mlx.speculative.acceptance import GreedyRule, SampledRule, distribution
from ds4mlx.speculative.drafter import ModelDrafter, ScriptedDrafter
from ds4mlx.speculative.loop import SpeculativeLoop

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import load_case  # noqa: E402
from spec_helpers import compiled_small_buckets  # noqa: E402, F401  (autouse)
from spec_helpers import plain_greedy as _plain  # noqa: E402

N = 210


@pytest.fixture(scope="module")
def v4(oracle):
    _, lm, ref, _ = load_case(oracle, "make_tiny_deepseek_v4.py", "long")
    return lm, ref["input_ids"][0].tolist()[:8]


@pytest.fixture(scope="module")
def other(oracle):
    return load_case(oracle, "make_tiny_deepseek_v4.py", None)[1]


def _spec(lm, prompt, n, drafter, depth, stop_ids=(), margin=0.0):
    s = lm.new_session(ctx=len(prompt) + n + 8)
    logits = s.prefill(prompt)
    loop = SpeculativeLoop(
        s, logits, drafter, GreedyRule(lm.vocab_size), depth=depth, margin=margin, stop_ids=stop_ids, limit=n
    )
    return list(loop), s, loop


def test_self_draft_accepts_everything_and_matches_plain(v4):
    lm, prompt = v4
    want, plain = _plain(lm, prompt, N)
    got, s, loop = _spec(lm, prompt, N, ModelDrafter(lm, ctx=len(prompt) + N + 8), depth=3)
    assert got == want and len(got) == N
    assert s.tokens == plain.tokens
    assert loop.stats.drafted > 0 and loop.stats.accepted == loop.stats.drafted
    assert loop.stats.rounds < N / 3  # ~ N / (depth + 1) verify forwards


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_wrong_drafts_at_every_depth_still_match_plain(v4, depth):
    lm, prompt = v4
    want, plain = _plain(lm, prompt, N)
    full = prompt + want

    def corrupt(ctx, k):  # the right continuation, wrong at a position cycling over the depth
        at = len(ctx) % (k + 2)
        return [(t + 1) % lm.vocab_size if i == at else t for i, t in enumerate(full[len(ctx) : len(ctx) + k])]

    got, s, loop = _spec(lm, prompt, N, ScriptedDrafter(corrupt), depth=depth)
    assert got == want
    assert s.tokens == plain.tokens
    np.testing.assert_allclose(s.last_logits, plain.last_logits, atol=1e-4)
    assert 0 < loop.stats.accepted < loop.stats.drafted and loop.stats.rollbacks > 0


@pytest.mark.slow  # ~20 s of CPU: a second model drafting a whole generation
def test_another_model_as_draft_matches_plain(v4, other):
    lm, prompt = v4
    want, _ = _plain(lm, prompt, N)
    got, _, loop = _spec(lm, prompt, N, ModelDrafter(other, ctx=len(prompt) + N + 8), depth=2, margin=0.5)
    assert got == want and loop.stats.rounds > 0


def test_stop_id_and_consumer_stop_leave_the_session_at_the_yielded_tokens(v4):
    lm, prompt = v4
    ref, _ = _plain(lm, prompt, 60)
    stop = ref[37]
    want, plain = _plain(lm, prompt, 60, stop_ids=[stop])
    got, s, loop = _spec(lm, prompt, 60, ModelDrafter(lm, ctx=200), depth=4, stop_ids=[stop])
    assert got == want and loop.stopped_by == stop and s.tokens == plain.tokens

    s = lm.new_session(ctx=200)
    loop = SpeculativeLoop(s, s.prefill(prompt), ModelDrafter(lm, ctx=200), GreedyRule(lm.vocab_size), depth=4)
    taken = []
    for t in loop:  # leave in the middle of a round (self-draft: 5 tokens a round)
        taken.append(t)
        if len(taken) == 13:
            break
    loop.settle()
    assert taken == ref[:13] and s.tokens == prompt + ref[:13]
    np.testing.assert_allclose(s.last_logits, _plain(lm, prompt, 13)[1].last_logits, atol=1e-4)
    snap = s.snapshot()  # snapshot / restore mid-speculation: the same continuation
    fresh = lm.new_session(ctx=200)
    fresh.restore(snap)
    cont = list(decode_tokens(fresh, fresh.last_logits, greedy(lm.vocab_size), limit=10))
    assert cont == ref[13:23]


# ------------------------------------------------------------------ sampled: exact distribution
def _one_step_distribution(p, q):
    """P(first output token = y) of one speculative step with one draft token, exactly:
    q(y) min(1, p/q) + (1 - sum_z q(z) min(1, p(z)/q(z))) * norm(max(0, p - q))(y)."""
    accept = np.minimum(q, p)
    residual = np.maximum(p - q, 0)
    return accept + (1 - accept.sum()) * (residual / residual.sum() if residual.sum() else p)


def test_speculative_sampling_math_and_statistics():
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.ones(6))
    q = rng.dirichlet(np.ones(6))
    np.testing.assert_allclose(_one_step_distribution(p, q), p, atol=1e-12)

    rule = SampledRule(6, SamplingParams(temperature=1.0, min_p=0.0), seed=11)
    counts = np.zeros(6)
    trials = 40000
    draws = rng.choice(6, size=trials, p=q)  # the draft samples from q
    pp = np.stack([p, p])
    for d in draws:
        n, nxt = rule.accept_probs(pp, [int(d)], q[None])
        counts[d if n == 1 else nxt] += 1
    freq = counts / trials
    # 5 sigma of a binomial frequency
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / trials))


def test_distribution_is_what_the_sampler_draws():
    from ds4mlx.runtime.sampling import Sampler

    x = mx.array(np.random.default_rng(5).standard_normal(12).astype(np.float32) * 2)
    for params in (
        SamplingParams(temperature=0.7, min_p=0.0),
        SamplingParams(temperature=1.0, top_k=5, min_p=0.0),
        SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
    ):
        p = np.array(distribution(x[None], params))[0]
        sampler = Sampler(7)
        trials = 6000
        counts = np.bincount([int(sampler.draw(x, params).item()) for _ in range(trials)], minlength=12)
        freq = counts / trials
        assert np.all((p == 0) <= (counts == 0))  # never draws what p excludes
        assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / trials) + 1e-3)


# ------------------------------------------------------------------ host-driven loop (ds4-eval)
def test_stepper_serves_verified_rows_and_rolls_back_on_a_different_pick(v4):
    from ds4mlx.speculative.stepper import SpeculativeStepper

    lm, prompt = v4
    n = 60

    def run(step_fn, logits):
        rng = np.random.default_rng(9)
        out = []
        for i in range(n):
            x = np.array(logits, np.float64).reshape(-1)
            if i % 3 == 2:  # every third pick sampled: a pick the greedy draft does not expect
                p = np.exp(x - x.max())
                tok = int(rng.choice(len(p), p=p / p.sum()))
            else:
                tok = int(x.argmax())
            out.append(tok)
            logits = step_fn(tok)
        return out

    s = lm.new_session(ctx=200)
    want = run(s.step, s.prefill(prompt))
    t = lm.new_session(ctx=200)
    first = t.prefill(prompt)
    st = SpeculativeStepper(t, ModelDrafter(lm, ctx=200), depth=3)
    got = run(st.step, first)
    st.settle()
    assert got == want and t.tokens == s.tokens
    np.testing.assert_allclose(t.last_logits, s.last_logits, atol=1e-4)
    assert st.stats.accepted > 0 and st.stats.rounds < n and st.stats.rollbacks > 0


def test_sampled_self_draft_accepts_everything(v4):
    lm, prompt = v4
    s = lm.new_session(ctx=120)
    rule = SampledRule(lm.vocab_size, SamplingParams(temperature=0.9, top_p=0.9, min_p=0.0), seed=4)
    loop = SpeculativeLoop(s, s.prefill(prompt), ModelDrafter(lm, ctx=120), rule, depth=3, limit=40)
    got = list(loop)
    assert len(got) == 40 and s.tokens == prompt + got
    # q == p at every position: min(1, p/q) = 1 (up to the float noise of the two forwards)
    assert loop.stats.accepted >= loop.stats.drafted - 1


def test_a_draft_without_distribution_is_a_point_mass_and_stays_exact():
    rng = np.random.default_rng(8)
    p = rng.dirichlet(np.ones(5))
    rule = SampledRule(5, SamplingParams(temperature=1.0, min_p=0.0), seed=12)
    trials, counts = 30000, np.zeros(5)
    for _ in range(trials):
        n, nxt = rule.accept_probs(np.stack([p, p]), [2], None)  # the drafter always says 2
        counts[2 if n == 1 else nxt] += 1
    freq = counts / trials
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / trials))
