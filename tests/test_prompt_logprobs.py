"""engine/prompt_logprobs.py on a real tiny model (deepseek_v4 oracle, weights as stored: the
GPU policy, and float32): each echoed token's log-prob equals a numpy log-softmax of the
model's full-forward logits at the position before it, and the last one equals the
log-softmax of the session's own prefill logits (the served path)."""

from __future__ import annotations

import numpy as np
import pytest

import ds4mlx
from ds4mlx.engine.prompt_logprobs import prompt_logprobs


class _CharTokenizer:
    """One id per character (ids below the tiny model's vocabulary)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 200 + 1 for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i + 64) for i in ids)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_prompt_logprobs_match_the_models_logits(oracle, dtype):
    lm, _ = ds4mlx.load(str(oracle("make_tiny_deepseek_v4.py", "long")), dtype=dtype, verbose=False)
    tok = _CharTokenizer()
    head, prompt = [0, 7, 9], "hello there"
    ids = head + tok.encode(prompt) + [3, 5]  # the template around the caller's text
    got = prompt_logprobs(lm, tok, ids, prompt, 3)
    n = len(prompt)
    assert [t.token for t in got] == tok.encode(prompt)
    assert got[0].logprob is None and got[0].top == ()
    full = lm.logits(ids)
    for j, t in enumerate(got[1:], start=1):
        row = _log_softmax(full[len(head) + j - 1])
        assert t.logprob == pytest.approx(row[t.token], abs=1e-4)
        want = np.argsort(-row, kind="stable")[:3]
        assert [i for i, _, _ in t.top] == want.tolist()
        assert [v for _, _, v in t.top] == pytest.approx(row[want].tolist(), abs=1e-4)
    s = lm.new_session(ctx=len(ids) + 4)
    served = _log_softmax(np.asarray(s.prefill(ids[: len(head) + n - 1])).reshape(-1))
    assert got[-1].logprob == pytest.approx(served[got[-1].token], abs=1e-3 if dtype is None else 1e-4)
