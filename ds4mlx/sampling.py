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

Extras: a seed (0 = time based) making draws reproducible, an optional
repetition penalty over a window of recent tokens, and banned ids (used by
`ignore_eos`, which bans the stop tokens under greedy decoding).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

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
    seed: int = 0  # 0 = time based
    repetition_penalty: float = 1.0  # 1 = off; >1 penalises recent tokens
    repetition_window: int = 0  # how many recent generated tokens are penalised

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


def _time_seed() -> int:
    return (time.time_ns() ^ (os.getpid() << 16) ^ id(object())) & 0xFFFFFFFF


class Sampler:
    """One per generation job: holds the PRNG key so seeded jobs are reproducible."""

    def __init__(self, seed: int = 0):
        self.seed = int(seed) & 0xFFFFFFFFFFFFFFFF if seed else _time_seed()
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
    ) -> mx.array:
        """Lazy scalar token id (uint32/int32) for one row of logits."""
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
        return self.draw(x, params)

    def draw(self, x: mx.array, params: SamplingParams) -> mx.array:
        """The token of float32 logits [V] after bans and penalties (argmax when greedy)."""
        vocab = x.shape[0]
        temperature, top_p, top_k, min_p = _clean(params)
        if temperature <= 0.0:
            return mx.argmax(x)
        key = self._next_key()
        idx: mx.array | None = None
        vals = x
        if 0 < top_k < vocab:
            idx = mx.argpartition(-x, kth=top_k - 1)[:top_k]
            vals = x[idx]
        sort = top_p < 1.0
        if sort:
            order = mx.argsort(-vals)
            vals = vals[order]
            idx = order if idx is None else idx[order]
        scaled = vals / temperature
        probs = mx.softmax(scaled)
        keep = None
        if min_p > 0.0:
            keep = probs >= min_p * mx.max(probs)
        if sort:
            before = mx.cumsum(probs) - probs  # mass of strictly more likely tokens
            in_mass = before < top_p
            keep = in_mass if keep is None else (keep & in_mass)
        if keep is not None:
            scaled = mx.where(keep, scaled, -math.inf)
        choice = mx.random.categorical(scaled, key=key)
        return choice if idx is None else idx[choice]

    def __call__(self, logits, params, recent=None, banned=None) -> int:
        return int(self.sample(logits, params, recent, banned).item())


class DeviceSampler:
    """`Sampler.sample` with no host value per token, for the lookahead decode loop.

    The banned ids are a mask and the repetition window a ring of the last
    `params.repetition_window` sampled tokens, both on the device, so token t+1 can be
    drawn from lazy logits before the host has read token t.  The parameters are fixed
    for the job (they pick the graph, not per-token values).  Same draws as `Sampler`
    with the same seed, `recent` = the tokens this sampler drew.
    """

    def __init__(
        self, params: SamplingParams, vocab: int, banned: Sequence[int] | None = None, seed: int | None = None
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
        tok = self._sampler.draw(x, self.params).astype(mx.int32)
        if self._recent is not None:
            self._recent = mx.concatenate([self._recent[1:], tok.reshape(1)])
        return tok
