"""Plumbing shared by the tests/test_*_parity.py files (an MLX graph against its oracle).

* `maxdiff(a, b)`: the largest absolute difference, compared in float32;
* `load_case(oracle, script, config)`: (folder, model, reference arrays, summary) of one
  oracle build (conftest.py's `oracle` fixture builds it);
* `split_logits(lm, ids, bounds)` / `chunked_logits(lm, ids, chunk)`: every position's
  logits [T, V] from a cached forward fed in pieces (cut at `bounds`, or every `chunk`);
* `rows_and_alone(lm, ids, lengths, rounds)`: sessions stepped together (one forward of
  B rows) against the same sessions stepped alone.

The bounds (TOL, MIN_MARGIN) and every assertion stay in the test files.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np

from ds4mlx.models.base import LanguageModel, load_hf_dir


def maxdiff(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


def load_case(oracle, script: str, config: str | None) -> tuple:
    """(folder, LanguageModel, reference.npz as a dict, summary.json as a dict)."""
    folder = oracle(script, config)
    ref = dict(np.load(folder / "reference.npz"))
    summary = json.loads((folder / "summary.json").read_text())
    return folder, load_hf_dir(str(folder)), ref, summary


def split_logits(lm: LanguageModel, ids: list[int], bounds) -> np.ndarray:
    """Logits [T, V] of `ids` fed through one cache in pieces cut at `bounds` (empty pieces skipped)."""
    cache = lm.model.make_cache()
    arr = mx.array([ids], dtype=mx.int32)
    edges = [0, *bounds, len(ids)]
    return np.concatenate([np.array(lm.model(arr[:, a:b], cache)[0]) for a, b in zip(edges, edges[1:]) if b > a])


def chunked_logits(lm: LanguageModel, ids: list[int], chunk: int) -> np.ndarray:
    """Logits [T, V] of `ids` fed through one cache `chunk` tokens at a time."""
    return split_logits(lm, ids, range(chunk, len(ids), chunk))


def rows_and_alone(lm: LanguageModel, ids: list[int], lengths: list[int], rounds: int) -> tuple[float, bool]:
    """Sessions after ids[:n] for each n in `lengths`, fed `rounds` more tokens each, once
    alone (`Session.step`; the first step is the model's check) and once together
    (`session.step_together`, which must accept them): (the largest logit difference, whether
    every round's greedy tokens and the sessions' tokens agree)."""
    from ds4mlx.runtime.session import can_step_together, step_together

    alone = [lm.new_session(ctx=len(ids) + rounds + 8) for _ in lengths]
    rows = [lm.new_session(ctx=len(ids) + rounds + 8) for _ in lengths]
    for a, r, n in zip(alone, rows, lengths):
        a.prefill(ids[:n])
        r.prefill(ids[:n])
    worst, same = 0.0, True
    for k in range(rounds):
        toks = [ids[(n + k) % len(ids)] for n in lengths]
        want = [np.asarray(a.step(t)) for a, t in zip(alone, toks)]
        if not can_step_together(rows):
            raise AssertionError("the sessions cannot be stepped together")
        got = [np.asarray(lg) for lg in step_together(rows, toks)]
        worst = max([worst] + [maxdiff(w, g) for w, g in zip(want, got)])
        same &= all(int(w.argmax()) == int(g.argmax()) for w, g in zip(want, got))
    same &= all(list(r.tokens) == list(a.tokens) for r, a in zip(rows, alone))
    return worst, same
