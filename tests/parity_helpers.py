"""Plumbing shared by the tests/test_*_parity.py files (an MLX graph against its oracle).

* `maxdiff(a, b)`: the largest absolute difference, compared in float32;
* `load_case(oracle, script, config)`: (folder, model, reference arrays, summary) of one
  oracle build (conftest.py's `oracle` fixture builds it);
* `split_logits(lm, ids, bounds)` / `chunked_logits(lm, ids, chunk)`: every position's
  logits [T, V] from a cached forward fed in pieces (cut at `bounds`, or every `chunk`).

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
