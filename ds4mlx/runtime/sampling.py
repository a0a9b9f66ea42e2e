"""Logits -> token id, on MLX arrays.

`Sampler.sample(logits, params)` returns a lazy scalar `mx.array`; the caller's
`.item()` is the only host synchronisation per token.  Semantics follow ds4's
sampler (docs/dsml.md §5.1):

* temperature <= 0 -> argmax;
* top_k > 0 restricts to the top_k logits (capped at 1024), else the full
  vocabulary;
* probabilities = softmax(logits / temperature); tokens are kept in
  descending order while p >= min_p * p_max and until the kept mass reaches
  top_p (top_p outside (0, 1] means 1); the draw is proportional to the kept
  probabilities.

`keep_mask` is that filter, the one both `Sampler.draw` and speculative decoding's
`distribution` (speculative/acceptance.py) use, so speculation samples exactly the
distribution the sampler draws from.

Extras: a seed (None = time based; 0 is a seed like any other) making draws reproducible, banned ids (used by
`ignore_eos`, which bans the stop tokens under greedy decoding), and before the filter
(`Penalties`, the order of vLLM's sampler): `logit_bias` added to the logits (±100
clamp), then the repetition penalty (HF / vLLM: a seen token's positive logit divided
by it, a negative one multiplied; seen = the prompt and the generated tokens, or with
`repetition_window` > 0 only that many recent generated tokens), then OpenAI's
frequency (times the token's count in the generated text) and presence (once if it
occurs there) penalties subtracted.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

TOP_K_CAP = 1024

# ds4's fixed defaults (also what thinking mode forces).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0
DEFAULT_MIN_P = 0.05


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K
    min_p: float = DEFAULT_MIN_P
    seed: int | None = None  # None = time based (0 reproduces like any other seed)
    repetition_penalty: float = 1.0  # 1 = off; >1 penalises seen tokens
    repetition_window: int = 0  # 0: the prompt and every generated token; N > 0: the last N generated
    frequency_penalty: float = 0.0  # OpenAI: minus penalty x count in the generated tokens
    presence_penalty: float = 0.0  # OpenAI: minus penalty once a token was generated
    logit_bias: tuple = ()  # ((token id, bias), ...), bias clamped to ±100

    @property
    def penalised(self) -> bool:
        """Whether `Penalties` change the logits (the draw then depends on the history)."""
        return bool(
            self.logit_bias or self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return not (self.temperature > 0.0)  # NaN counts as greedy


GREEDY = SamplingParams(temperature=0.0)
THINKING_DEFAULTS = SamplingParams()


def _clean(p: SamplingParams) -> tuple[float, float, int, float]:
    t = float(p.temperature) if math.isfinite(p.temperature) else 0.0
    top_p = float(p.top_p)
    if not (0.0 < top_p <= 1.0):  # also catches NaN
        top_p = 1.0
    top_k = int(p.top_k) if p.top_k and p.top_k > 0 else 0
    min_p = float(p.min_p)
    if not (min_p > 0.0):
        min_p = 0.0
    return t, top_p, min(top_k, TOP_K_CAP), min(min_p, 1.0)


def keep_mask(x: mx.array, params: SamplingParams) -> mx.array:
    """The tokens a sampled draw may pick from logits x [..., N] (float32, bans and
    penalties applied), bool [..., N]: the top_k largest (when N > top_k), then of the
    softmax at the temperature those within min_p of the best and those before the
    kept mass reaches top_p (in descending order).  Rows are independent."""
    temperature, top_p, top_k, min_p = _clean(params)
    n = x.shape[-1]
    keep = x > -math.inf
    if 0 < top_k < n:
        top = mx.argpartition(-x, kth=top_k - 1, axis=-1)[..., :top_k]
        keep = mx.put_along_axis(mx.zeros_like(keep), top, mx.array(True), axis=-1)
    probs = mx.softmax(mx.where(keep, x / temperature, -math.inf), axis=-1)
    if min_p > 0.0:
        keep = keep & (probs >= min_p * mx.max(probs, axis=-1, keepdims=True))
    if top_p < 1.0:
        order = mx.argsort(-probs, axis=-1)
        sorted_p = mx.take_along_axis(probs, order, axis=-1)
        before = mx.cumsum(sorted_p, axis=-1) - sorted_p  # mass of strictly more likely tokens
        keep = keep & mx.put_along_axis(mx.zeros_like(keep), order, before < top_p, axis=-1)
    return keep


LOGIT_BIAS_LIMIT = 100.0


class Penalties:
    """logit_bias, the repetition penalty and the frequency / presence penalties of one
    job (module docstring), on the device: `apply(x, counts)` with `counts` [V] int32
    the generated tokens' counts (`counts_of` from a host list, or the device sampler's
    running counts).  Built only where `params.penalised`."""

    def __init__(self, params: SamplingParams, vocab: int, prompt: Sequence[int] = ()):
        self.params, self.vocab = params, int(vocab)
        self.bias = None
        if params.logit_bias:
            bias = [0.0] * self.vocab
            for tok, b in params.logit_bias:
                if 0 <= int(tok) < self.vocab:
                    bias[int(tok)] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(b)))
            self.bias = mx.array(bias, dtype=mx.float32)
        self.repetition = float(params.repetition_penalty)
        self.prompt_seen = None
        if self.repetition != 1.0 and params.repetition_window <= 0:
            self.prompt_seen = mx.zeros((self.vocab,), mx.bool_)
            ids = sorted({int(t) for t in prompt if 0 <= int(t) < self.vocab})
            if ids:
                self.prompt_seen[mx.array(ids, dtype=mx.int32)] = True

    def counts_of(self, generated: Sequence[int]) -> mx.array:
        ids = [int(t) for t in generated if 0 <= int(t) < self.vocab]
        return mx.array(np.bincount(np.asarray(ids, dtype=np.int64), minlength=self.vocab).astype(np.int32))

    def apply(self, x: mx.array, counts: mx.array) -> mx.array:
        p = self.params
        if self.bias is not None:
            x = x + self.bias
        if self.prompt_seen is not None:
            seen = self.prompt_seen | (counts > 0)
            x = mx.where(seen, mx.where(x > 0, x / self.repetition, x * self.repetition), x)
        if p.frequency_penalty:
            x = x - float(p.frequency_penalty) * counts.astype(mx.float32)
        if p.presence_penalty:
            x = x - float(p.presence_penalty) * (counts > 0).astype(mx.float32)
        return x


def _time_seed() -> int:
    return (time.time_ns() ^ (os.getpid() << 16) ^ id(object())) & 0xFFFFFFFF


class Sampler:
    """One per generation job: holds the PRNG key so seeded jobs are reproducible."""

    def __init__(self, seed: int | None = None):
        self.seed = int(seed) & 0xFFFFFFFFFFFFFFFF if seed is not None else _time_seed()
        self._key = mx.random.key(self.seed)

    def _next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    def sample(
        self,
        logits: mx.array,
        params: SamplingParams,
        recent: Sequence[int] | None = None,
        banned: Sequence[int] | None = None,
        penalties: Penalties | None = None,
    ) -> mx.array:
        """Lazy scalar token id (uint32/int32) for one row of logits; `recent` the generated
        tokens (the windowed repetition penalty, `penalties`' counts)."""
        x = logits.reshape(-1).astype(mx.float32)
        vocab = x.shape[0]
        if banned:
            ids = mx.array([b for b in banned if 0 <= b < vocab], dtype=mx.int32)
            if ids.size:
                x[ids] = -math.inf
        if recent and params.repetition_penalty != 1.0 and params.repetition_window > 0:
            window = [t for t in list(recent)[-params.repetition_window :] if 0 <= t < vocab]
            if window:
                ids = mx.array(sorted(set(window)), dtype=mx.int32)
                sel = x[ids]
                pen = float(params.repetition_penalty)
                x[ids] = mx.where(sel > 0, sel / pen, sel * pen)
        if penalties is not None:
            x = penalties.apply(x, penalties.counts_of(recent or ()))
        return self.draw(x, params)

    def draw(self, x: mx.array, params: SamplingParams) -> mx.array:
        """The token of float32 logits [V] after bans and penalties (argmax when greedy)."""
        temperature, _, top_k, _ = _clean(params)
        if temperature <= 0.0:
            return mx.argmax(x)
        key = self._next_key()
        idx: mx.array | None = None
        vals = x
        if 0 < top_k < x.shape[0]:  # the filter over the k best only: no full-vocabulary sort
            idx = mx.argpartition(-x, kth=top_k - 1)[:top_k]
            vals = x[idx]
        scaled = mx.where(keep_mask(vals, params), vals / temperature, -math.inf)
        choice = mx.random.categorical(scaled, key=key)
        return choice if idx is None else idx[choice]

    def __call__(self, logits, params, recent=None, banned=None, penalties=None) -> int:
        return int(self.sample(logits, params, recent, banned, penalties).item())


class DeviceSampler:
    """`Sampler.sample` with no host value per token, for the lookahead decode loop.

    The banned ids are a mask and the repetition window a ring of the last
    `params.repetition_window` sampled tokens, both on the device, so token t+1 can be
    drawn from lazy logits before the host has read token t.  The parameters are fixed
    for the job (they pick the graph, not per-token values).  Same draws as `Sampler`
    with the same seed, `recent` = the tokens this sampler drew.
    """

    def __init__(
        self,
        params: SamplingParams,
        vocab: int,
        banned: Sequence[int] | None = None,
        seed: int | None = None,
        penalties: Penalties | None = None,
    ):
        self.params, self.vocab = params, int(vocab)
        self._sampler = Sampler(params.seed if seed is None else seed)
        ban = [b for b in (banned or ()) if 0 <= b < vocab]
        self._ban = None
        if ban:
            self._ban = mx.zeros((vocab,), mx.bool_)
            self._ban[mx.array(ban, dtype=mx.int32)] = True
        window = params.repetition_window if params.repetition_penalty != 1.0 else 0
        self._recent = mx.full((window,), vocab, mx.int32) if window > 0 else None  # vocab = empty slot
        self._penalties = penalties
        self._counts = mx.zeros((vocab,), mx.int32) if penalties is not None else None  # generated, on device

    def __call__(self, logits: mx.array) -> mx.array:
        """Lazy int32 scalar token of logits [V]."""
        x = logits.reshape(-1).astype(mx.float32)
        if self._ban is not None:
            x = mx.where(self._ban, -math.inf, x)
        if self._recent is not None:
            seen = mx.zeros((self.vocab + 1,), mx.bool_)
            seen[self._recent] = True
            pen = float(self.params.repetition_penalty)
            x = mx.where(seen[: self.vocab], mx.where(x > 0, x / pen, x * pen), x)
        if self._penalties is not None:
            x = self._penalties.apply(x, self._counts)
        tok = self._sampler.draw(x, self.params).astype(mx.int32)
        if self._recent is not None:
            self._recent = mx.concatenate([self._recent[1:], tok.reshape(1)])
        if self._counts is not None:
            self._counts = self._counts + (mx.arange(self.vocab) == tok).astype(mx.int32)
        return tok
