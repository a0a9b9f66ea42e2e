"""The acceptance model (docs/speculative.md): when does a round of k drafts beat k + 1 plain steps?

A round drafts k tokens (k draft costs) and verifies them with the token before them in
one target forward of k + 1 tokens.  With a per-draft acceptance rate a (each draft kept
with probability a while the ones before it were), a round yields on average
E(a, k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a) tokens, so it pays when
E(a, k) * step >= verify_k + k * draft.  `break_even` solves that for a: the acceptance a
user's drafter must reach at k for speculation to pay, from costs measured on their
machine (`measure`: one plain step and a verify of k + 1 tokens, on the live session,
which is left as it was).  ds4mlx generate / chat print it with `--mtp-timing`, bench
writes it to its CSV, tools/spec_bench.py to its table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

MAX_K = 4  # the widths the model reports: k = 1 .. MAX_K


def tokens_per_round(a: float, k: int) -> float:
    """E(a, k): the tokens a round of k drafts yields at per-draft acceptance a."""
    return float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


def break_even(step_ms: float, verify_ms: float, draft_ms: float, k: int) -> float | None:
    """The smallest acceptance rate at which a round of k drafts (verify_ms + k * draft_ms)
    is no slower than the plain steps it replaces; 0.0 when even a fully rejected round
    pays, None when not even acceptance 1 pays."""
    cost = verify_ms + k * draft_ms
    if tokens_per_round(1.0, k) * step_ms < cost:
        return None
    if step_ms >= cost:
        return 0.0
    lo, hi = 0.0, 1.0  # E is increasing in a: bisect
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_round(mid, k) * step_ms < cost else (lo, mid)
    return hi


@dataclass
class Costs:
    """Measured costs: one plain decode step, a verify of k + 1 tokens per k (ms), and the
    drafter's mean cost per draft token in the run (ms; 0 when unknown)."""

    step_ms: float
    verify_ms: dict = field(default_factory=dict)  # k -> ms of a verify of k + 1 tokens
    draft_ms: float = 0.0

    def ratio(self, k: int) -> float:
        """The verify of k + 1 tokens in plain steps."""
        return self.verify_ms[k] / self.step_ms if self.step_ms > 0 else 0.0

    def break_even(self, k: int) -> float | None:
        return break_even(self.step_ms, self.verify_ms[k], self.draft_ms, k)

    def as_dict(self) -> dict:
        out = {"step_ms": round(self.step_ms, 3), "draft_ms": round(self.draft_ms, 3)}
        for k in sorted(self.verify_ms):
            be = self.break_even(k)
            out[f"verify_ms_k{k}"] = round(self.verify_ms[k], 3)
            out[f"breakeven_k{k}"] = None if be is None else round(be, 3)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Costs:
        """The costs of an `as_dict()` (SpecStats.costs)."""
        ks = sorted(int(key[len("verify_ms_k") :]) for key in d if key.startswith("verify_ms_k"))
        return cls(float(d["step_ms"]), {k: float(d[f"verify_ms_k{k}"]) for k in ks}, float(d.get("draft_ms", 0.0)))

    def lines(self) -> list[str]:
        """One line per k: the verify cost and the acceptance it takes to pay."""
        out = []
        for k in sorted(self.verify_ms):
            be = self.break_even(k)
            need = "never pays" if be is None else f"pays above acceptance {be:.2f}"
            draft = f" with {self.draft_ms:.2f} ms per draft" if self.draft_ms > 0 else ""
            out.append(
                f"k={k}: verify of {k + 1} tokens {self.verify_ms[k]:.2f} ms = {self.ratio(k):.2f} plain steps "
                f"({self.step_ms:.2f} ms),{draft} {need}"
            )
        return out


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def measure(session, token: int, ks=range(1, MAX_K + 1), reps: int = 3, draft_ms: float = 0.0) -> Costs | None:
    """Costs measured on `session` (left as it was: every forward is rolled back): one plain
    decode step of `token`, and a verify of `token` plus k copies of it for each k (the cost
    of a verify does not depend on which tokens it checks).  The first of reps + 1 calls of
    each kind warms up (a trace, a bucket) and is not counted.  None without room in the
    context for the widest verify."""
    ks = [int(k) for k in ks]
    if not ks or session.ctx - len(session) < max(ks) + 2:
        return None
    tok = int(token)

    def timed(run) -> float:
        times = []
        for r in range(reps + 1):
            cp = session.checkpoint()
            t0 = time.perf_counter()
            out = run()
            mx.eval(out, session.cache_arrays())
            dt = time.perf_counter() - t0
            session.rollback(cp)
            if r:
                times.append(dt)
        return 1e3 * _median(times)

    costs = Costs(step_ms=timed(lambda: session.step(tok)), draft_ms=float(draft_ms))
    for k in ks:
        costs.verify_ms[k] = timed(lambda k=k: session.verify([tok] * (k + 1)))
    mx.eval(session.cache_arrays())
    return costs


def summary_lines(speculation: dict | None) -> list[str]:
    """The end-of-run lines of a job's counters (a Finish's `speculation`): drafted,
    accepted, acceptance rate and verify cost; with `--mtp-timing` the measured verify
    cost per k and its break-even acceptance.  Empty when the job did not speculate."""
    from .options import SpecStats

    if not speculation:
        return []
    st = SpecStats.from_dict(speculation)
    lines = [st.summary()]
    if st.costs:
        lines += Costs.from_dict(st.costs).lines()
    return lines
