"""Log-probs of a prompt's own tokens (legacy completions `echo` with `logprobs`).

One full forward of the rendered prompt (the model's `logits(ids)`, from an empty state),
log-softmax per position: token i's log-prob is read from the row of position i - 1.
Only the span of the caller's prompt text is reported (not the template around it);
its first token gets None, as OpenAI's shape has it."""

from __future__ import annotations

import numpy as np

from ..runtime.events import TokenLogprob


def prompt_span(tokenizer, ids: list[int], prompt: str) -> tuple[int, int]:
    """[start, end) of the prompt text's tokens inside the rendered ids (the template's
    markers are special tokens, so the text tokenizes alike alone and in place)."""
    own = tokenizer.encode(prompt)
    n = len(own)
    for start in range(len(ids) - n, -1, -1):  # the last match: the template comes first
        if ids[start : start + n] == own:
            return start, start + n
    raise ValueError("the prompt's tokens are not a span of the rendered prompt")


def prompt_logprobs(model, tokenizer, ids: list[int], prompt: str, k: int) -> tuple[TokenLogprob, ...]:
    """One TokenLogprob per token of `prompt` (the chosen one's and the top k's log-probs)."""
    start, end = prompt_span(tokenizer, ids, prompt)
    if end - start < 2:  # nothing to score: the first token has no log-prob
        return tuple(TokenLogprob(t, tokenizer.decode([t]), None, ()) for t in ids[start:end])
    logits = model.logits(ids[: end - 1])  # [end - 1, V] float32
    out = []
    decode = tokenizer.decode
    for i in range(start, end):
        tok = ids[i]
        if i == start:
            out.append(TokenLogprob(tok, decode([tok]), None, ()))
            continue
        row = _log_softmax(logits[i - 1])
        top = ()
        if k:
            idx = np.argpartition(-row, k - 1)[:k]
            idx = idx[np.argsort(-row[idx], kind="stable")]
            top = tuple((int(j), decode([int(j)]), float(row[j])) for j in idx)
        out.append(TokenLogprob(tok, decode([tok]), float(row[tok]), top))
    return tuple(out)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    """In float64, one row at a time: a float32 log-sum-exp over a 100k+ vocabulary drifts by
    ~1e-4 (loglikelihood callers sum these values), and a float64 copy of every row would
    double the host memory of a long prompt's logits."""
    x = np.asarray(x, dtype=np.float64)
    top = x.max()
    return x - top - np.log(np.exp(x - top).sum())
