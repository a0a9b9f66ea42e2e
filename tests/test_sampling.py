"""Sampler semantics (dsml.md §5.1): greedy, temperature, top-k, top-p, min-p,
seeds, banned ids, repetition penalty; penalties and logit_bias against a reference."""

from __future__ import annotations

import math
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.runtime.sampling import GREEDY, TOP_K_CAP, Sampler, SamplingParams

LOGITS = mx.array([0.0, 1.0, 2.0, 3.0, -5.0, 2.9])


def draws(params, n=400, seed=7, logits=LOGITS, **kw):
    s = Sampler(seed)
    return Counter(s(logits, params, **kw) for _ in range(n))


def test_greedy_is_argmax_for_zero_negative_and_nan_temperature():
    for t in (0.0, -1.0, float("nan")):
        assert set(draws(SamplingParams(temperature=t), n=20)) == {3}
    assert Sampler(1)(LOGITS, GREEDY) == 3


def test_returns_lazy_scalar_array():
    out = Sampler(3).sample(LOGITS, SamplingParams(min_p=0.0))
    assert isinstance(out, mx.array) and out.size == 1
    assert 0 <= int(out.item()) < LOGITS.size


def test_full_vocabulary_distribution_matches_softmax():
    c = draws(SamplingParams(temperature=1.0, min_p=0.0), n=3000)
    p = np.exp(np.array(LOGITS)) / np.exp(np.array(LOGITS)).sum()
    for tok in range(LOGITS.size):
        assert abs(c[tok] / 3000 - p[tok]) < 0.04, (tok, c[tok], p[tok])


def test_top_k_restricts_to_the_k_best():
    assert set(draws(SamplingParams(top_k=2, min_p=0.0))) == {3, 5}
    assert set(draws(SamplingParams(top_k=1, min_p=0.0), n=50)) == {3}


def test_top_k_is_capped():
    big = mx.array(np.linspace(0, 1, 5000, dtype=np.float32))
    seen = draws(SamplingParams(top_k=100000, min_p=0.0, temperature=50.0), n=300, logits=big)
    assert min(seen) >= 5000 - TOP_K_CAP


def test_top_p_keeps_tokens_until_the_mass_is_reached():
    # sorted probs: tok3 0.407, tok5 0.368, tok2 0.150, tok1 0.055, ...
    assert set(draws(SamplingParams(top_p=0.40, min_p=0.0))) == {3}
    assert set(draws(SamplingParams(top_p=0.70, min_p=0.0))) == {3, 5}
    assert set(draws(SamplingParams(top_p=0.90, min_p=0.0))) == {3, 5, 2}


def test_top_p_outside_unit_interval_means_off():
    for top_p in (0.0, -1.0, 1.5, float("nan")):
        assert len(draws(SamplingParams(top_p=top_p, min_p=0.0), n=600)) >= 4


def test_min_p_is_relative_to_the_best_token():
    # p(tok2)/p(tok3) = e^-1 ~ 0.37; p(tok1)/p(tok3) = e^-2 ~ 0.14
    assert set(draws(SamplingParams(min_p=0.3))) == {3, 5, 2}
    assert set(draws(SamplingParams(min_p=0.5))) == {3, 5}


def test_temperature_sharpens():
    cold = draws(SamplingParams(temperature=0.05, min_p=0.0))
    assert cold[3] > 0.8 * sum(cold.values())


def test_same_seed_same_draws_different_seed_differs():
    p = SamplingParams(min_p=0.0, temperature=2.0)
    a = [Sampler(42)(LOGITS, p) for _ in range(1)]
    s1, s2, s3 = Sampler(42), Sampler(42), Sampler(43)
    seq1 = [s1(LOGITS, p) for _ in range(50)]
    seq2 = [s2(LOGITS, p) for _ in range(50)]
    seq3 = [s3(LOGITS, p) for _ in range(50)]
    assert seq1 == seq2 and seq1 != seq3 and a[0] == seq1[0]


def test_seed_zero_is_a_seed_and_none_is_time_based(monkeypatch):
    import ds4mlx.runtime.sampling as sampling

    assert Sampler(0).seed == 0 and Sampler(7).seed == 7
    monkeypatch.setattr(sampling, "_time_seed", lambda: 12345)  # an absent seed is drawn from the clock
    assert Sampler(None).seed == 12345 and Sampler().seed == 12345


def test_banned_ids_are_never_drawn():
    assert Sampler(1)(LOGITS, GREEDY, banned=[3]) == 5
    assert 3 not in draws(SamplingParams(min_p=0.0), banned=[3, 5])


def test_repetition_penalty_over_window():
    p = SamplingParams(temperature=0.0, repetition_penalty=10.0, repetition_window=2)
    assert Sampler(1)(LOGITS, p, recent=[3]) == 5  # 3.0/10 < 2.9
    assert Sampler(1)(LOGITS, p, recent=[3, 1, 1]) == 3  # 3 fell out of the window
    neg = mx.array([-1.0, -1.2])
    assert Sampler(1)(neg, p, recent=[0]) == 1  # negative logits are multiplied


def test_input_logits_untouched():
    x = mx.array([1.0, 2.0, 3.0])
    Sampler(1)(x, GREEDY, banned=[2])
    assert x.tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_dtypes_and_2d_rows(dtype):
    x = mx.array([[0.0, 5.0, 1.0]]).astype(dtype)
    assert Sampler(1)(x, GREEDY) == 1
    assert Sampler(1)(x, SamplingParams(min_p=0.5)) == 1
    assert not math.isnan(float(Sampler(1).sample(x, SamplingParams()).item()))


# --- penalties and logit_bias (sampling.Penalties), against a reference ---------------------
from ds4mlx.runtime.sampling import DeviceSampler, Penalties, keep_mask  # noqa: E402


def reference_penalised(x, prompt, generated, p: SamplingParams):
    """vLLM's sampler order, written out: logit_bias (±100 clamp), the repetition penalty
    over prompt + generated (HF: positive logits divided, negative multiplied), then
    OpenAI's frequency (x count) and presence (x once) penalties over the generated."""
    x = np.array(x, np.float64)
    for tok, b in p.logit_bias:
        x[tok] += max(-100.0, min(100.0, b))
    for tok in set(prompt) | set(generated):
        x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    counts = np.bincount(generated, minlength=len(x))
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


PEN = SamplingParams(
    temperature=0.0,
    repetition_penalty=1.3,
    frequency_penalty=0.4,
    presence_penalty=-0.7,
    logit_bias=((3, 250.0), (7, -2.5), (11, -300.0)),
)


def test_penalties_match_the_reference():
    rng = np.random.default_rng(0)
    x = rng.normal(size=40).astype(np.float32) * 3
    prompt, generated = [1, 2, 2, 30], [5, 5, 5, 7, 30, 1]
    pen = Penalties(PEN, 40, prompt)
    got = np.array(pen.apply(mx.array(x), pen.counts_of(generated)))
    np.testing.assert_allclose(got, reference_penalised(x, prompt, generated, PEN), rtol=1e-6, atol=1e-5)


def _reference_tokens(x, prompt, p, n):
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(reference_penalised(x, prompt, out, p))))
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, frequency_penalty=0.3),
        SamplingParams(temperature=0.0, presence_penalty=0.25),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, frequency_penalty=0.2, logit_bias=((4, 0.5),)),
    ],
)
def test_device_and_host_penalised_sequences_follow_the_reference(params):
    x = np.array([3.0, 2.87, 2.73, 2.61, 2.49, -1.0], np.float32)  # no ties on the way
    prompt = [2]
    want = _reference_tokens(x, prompt, params, 8)
    assert len(set(want)) > 1  # the penalty did change the choice
    dev = DeviceSampler(params, 6, penalties=Penalties(params, 6, prompt))
    assert [int(dev(mx.array(x)).item()) for _ in range(8)] == want
    host, pen, got = Sampler(1), Penalties(params, 6, prompt), []
    for _ in range(8):
        got.append(host(mx.array(x), params, recent=got, penalties=pen))
    assert got == want


def test_logit_bias_shifts_the_sampled_distribution_exactly():
    p = SamplingParams(temperature=1.0, min_p=0.0, logit_bias=((0, 2.0), (3, -100.0)))
    pen = Penalties(p, LOGITS.size)
    biased = np.array(LOGITS, np.float64) + [2.0, 0, 0, -100.0, 0, 0]
    want = np.exp(biased) / np.exp(biased).sum()
    c = draws(p, n=3000, penalties=pen)
    assert c[3] == 0
    for tok in range(LOGITS.size):
        assert abs(c[tok] / 3000 - want[tok]) < 0.04, (tok, c[tok], want[tok])


def test_keep_mask_over_the_top_k_equals_over_the_row():
    """Sampler.draw filters the k best (argpartition), speculative decoding's distribution
    the whole row: the one keep_mask gives both the same set."""
    rng = np.random.default_rng(3)
    for params in (
        SamplingParams(top_k=7, top_p=0.6, min_p=0.05, temperature=0.8),
        SamplingParams(top_k=12, top_p=1.0, min_p=0.2, temperature=1.5),
        SamplingParams(top_k=0, top_p=0.5, min_p=0.0),
    ):
        x = mx.array(rng.normal(size=64).astype(np.float32))
        full = set(np.flatnonzero(np.array(keep_mask(x, params))).tolist())
        k = params.top_k or 64
        idx = np.array(mx.argpartition(-x, kth=k - 1)[:k])
        sub = np.array(keep_mask(x[mx.array(idx)], params))
        assert full == set(idx[sub].tolist()) and full
        rows = mx.stack([x, x * 0.5])
        assert np.array(keep_mask(rows, params))[0].tolist() == np.array(keep_mask(x, params)).tolist()
