"""Which draft tokens the target accepts, and the token after them.

Greedy (temperature <= 0): draft token i is accepted iff it is the target's argmax at its
position (bans applied), so the output is token for token the non-speculative one.

Sampled: standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023): with
target distribution p and draft distribution q at a position, the draft token d is kept
with probability min(1, p(d) / q(d)); at the first rejection the next token is drawn from
norm(max(0, p - q)); when all k are kept the next token is drawn from p at the last row.
Every output token is then distributed exactly as p.  p and q are the distributions the
job's sampler draws from (`distribution`: temperature, top-k, top-p, min-p and bans as
sampling.keep_mask, which Sampler.draw uses), so speculation changes the speed, not the distribution.  This is
ds4's `--mtp-exact-sampling`.

Sampled, opportunistic (ds4's default at temperature > 0, `--mtp-exact-sampling` off;
ds4 documentation, Speculative Decoding, "Sampling and reproducibility"; ds4.h on
ds4_session_eval_speculative: "Positive-temperature DSpark normally commits greedily
verified draft tokens"): the drafter proposes its argmax; draft token i is kept iff it is
the target's argmax at its position (bans applied), exactly the greedy rule; the token
after the kept prefix (and the first token of a round) is drawn from p, the job's
ordinary sampling.  Matching greedy drafts are accepted directly, so the output is more
deterministic than ordinary sampling: not the target distribution.

`greedy_drafts`: the drafter proposes its argmax (no q), and `--mtp-margin` prunes the
recursive draft (drafter.py); false only for exact speculative sampling (drafts drawn
from q).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ..runtime.sampling import SamplingParams, keep_mask


def ban_mask(vocab: int, banned: Sequence[int] | None) -> mx.array | None:
    ban = [int(b) for b in (banned or ()) if 0 <= int(b) < vocab]
    if not ban:
        return None
    mask = mx.zeros((vocab,), mx.bool_)
    mask[mx.array(ban, dtype=mx.int32)] = True
    return mask


def _masked(rows: mx.array, mask: mx.array | None) -> mx.array:
    x = rows.astype(mx.float32)
    return x if mask is None else mx.where(mask, -math.inf, x)


def argmax_rows(rows: mx.array, mask: mx.array | None = None) -> mx.array:
    """The greedy token of each row of logits [T, V] (lazy int32 [T])."""
    return mx.argmax(_masked(rows, mask), axis=-1).astype(mx.int32)


def distribution(rows: mx.array, params: SamplingParams, mask: mx.array | None = None) -> mx.array:
    """The probabilities [T, V] `Sampler.draw` samples each row of logits [T, V] from: the
    same filter (sampling.keep_mask), renormalised."""
    x = _masked(rows.reshape(-1, rows.shape[-1]), mask)
    t = float(params.temperature)
    return mx.softmax(mx.where(keep_mask(x, params), x / t, -math.inf), axis=-1)


class GreedyRule:
    """Exact argmax match (bans applied: ignore_eos)."""

    greedy = True
    greedy_drafts = True

    def __init__(self, vocab: int, banned: Sequence[int] | None = None):
        self.mask = ban_mask(vocab, banned)

    def first(self, logits: mx.array) -> int:
        return int(argmax_rows(logits.reshape(1, -1), self.mask)[0].item())

    def draft(self, logits: mx.array):
        """(lazy token, lazy distribution or None) the drafter feeds on."""
        return argmax_rows(logits.reshape(1, -1), self.mask)[0], None

    def accept(self, rows: mx.array, drafts: Sequence[int], q) -> tuple[int, int]:
        """(how many drafts are kept, the token after them)."""
        picks = argmax_rows(rows, self.mask).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == picks[n]:
            n += 1
        return n, int(picks[n])


class SampledRule:
    """Standard speculative sampling: every token distributed exactly as the target's p."""

    greedy = False
    greedy_drafts = False

    def __init__(self, vocab: int, params: SamplingParams, banned: Sequence[int] | None = None, seed: int = 0):
        self.params, self.mask = params, ban_mask(vocab, banned)
        seed = int(seed) & 0xFFFFFFFF
        self.rng = np.random.default_rng(seed)
        self._key = mx.random.key(seed ^ 0x5EC)

    def _p(self, rows: mx.array) -> np.ndarray:
        return np.array(distribution(rows, self.params, self.mask), dtype=np.float64)

    def _draw(self, p: np.ndarray) -> int:
        c = np.cumsum(p)
        return int(min(np.searchsorted(c, self.rng.random() * c[-1], side="right"), len(p) - 1))

    def first(self, logits: mx.array) -> int:
        return self._draw(self._p(logits.reshape(1, -1))[0])

    def draft(self, logits: mx.array):
        q = distribution(logits.reshape(1, -1), self.params, self.mask)[0]
        self._key, sub = mx.random.split(self._key)
        tok = mx.random.categorical(mx.log(q), key=sub).astype(mx.int32)
        return tok, q

    def accept(self, rows: mx.array, drafts: Sequence[int], q) -> tuple[int, int]:
        p = self._p(rows)
        return self.accept_probs(p, drafts, None if q is None else np.asarray(q, dtype=np.float64))

    def accept_probs(self, p: np.ndarray, drafts: Sequence[int], q: np.ndarray | None) -> tuple[int, int]:
        """The rule on host probabilities: p [k+1, V] target, q [k, V] draft (None: the
        drafter proposes without a distribution, i.e. q is the point mass on its token)."""
        if q is None:
            q = np.zeros((len(drafts), p.shape[-1]))
            q[np.arange(len(drafts)), list(drafts)] = 1.0
        for i, d in enumerate(drafts):
            pd, qd = p[i, d], q[i, d]
            if qd > 0 and self.rng.random() < min(1.0, pd / qd):
                continue
            residual = np.maximum(p[i] - q[i], 0.0)
            return i, self._draw(residual if residual.sum() > 0 else p[i])
        return len(drafts), self._draw(p[len(drafts)])


class OpportunisticRule(SampledRule):
    """ds4's default sampled acceptance (`--mtp-exact-sampling` off): argmax drafts, kept
    while each is the target's argmax; every other token drawn from the target's p."""

    greedy_drafts = True

    def draft(self, logits: mx.array):
        return argmax_rows(logits.reshape(1, -1), self.mask)[0], None

    def accept(self, rows: mx.array, drafts: Sequence[int], q=None) -> tuple[int, int]:
        n = 0
        if drafts:
            picks = argmax_rows(rows[: len(drafts)], self.mask).tolist()
            while n < len(drafts) and drafts[n] == picks[n]:
                n += 1
        return n, self._draw(self._p(rows[n : n + 1])[0])

    def accept_probs(self, p: np.ndarray, drafts: Sequence[int], q=None) -> tuple[int, int]:
        """The rule on host probabilities p [k+1, V]: the argmax of p is the argmax of the
        masked logits (temperature, top-k, top-p and min-p keep the most likely token)."""
        n = 0
        while n < len(drafts) and drafts[n] == int(np.argmax(p[n])):
            n += 1
        return n, self._draw(p[n])


def rule_for(
    params: SamplingParams,
    vocab: int,
    banned: Sequence[int] | None = None,
    seed: int = 0,
    exact_sampling: bool = True,
):
    """The acceptance rule of a job: greedy at temperature 0; sampled, standard speculative
    sampling with `exact_sampling` (ds4's --mtp-exact-sampling), else ds4's opportunistic
    acceptance."""
    if params.greedy:
        return GreedyRule(vocab, banned)
    if exact_sampling:
        return SampledRule(vocab, params, banned, seed)
    return OpportunisticRule(vocab, params, banned, seed)
