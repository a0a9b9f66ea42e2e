"""A stand-in model whose forward costs almost nothing: the host's work per token is the
whole wall time of a decode through it (bench/engine_host.py measures the engine's).

`stub_model(tokenizer, text_ids)` is a `LanguageModel` over the static decode layout
(models/cache.py `StaticForward`: `static_forward`, rows, undo), so every path the real
families take runs through it — bench's loop, the engine's lookahead, batched rows.  Its
logits at position p are one-hot at `text_ids[(p + 1) % len(text_ids)]`: a greedy decode
writes the text on, so the detokenizer, stop matcher and parser see real text.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..models.base import LanguageModel
from ..models.cache import StaticForward


@dataclass(frozen=True)
class StubArgs:
    vocab_size: int
    model_type: str = "deepseek_v4"  # the chat protocol the engine picks (docs/chat-template.md)


class StubCache:
    """One layer's cache: the last token fed, and how many positions it holds."""

    def __init__(self):
        self.last = mx.zeros((1,), mx.int32)
        self.offset = 0

    @property
    def state(self) -> dict:
        return {"last": self.last}

    @property
    def meta_state(self) -> dict:
        return {"offset": self.offset}

    def load(self, meta: dict, arrays: dict) -> None:
        if set(arrays) != {"last"}:
            raise ValueError(f"stub cache arrays {sorted(arrays)}")
        self.offset, self.last = int(meta["offset"]), arrays["last"]

    @property
    def nbytes(self) -> int:
        return self.last.nbytes

    def static_state(self, dtype, ahead: int = 1) -> list:
        return [self.last]

    def commit_static(self, arrays, advance: int = 1) -> None:
        self.last = next(arrays)
        self.offset += advance


class StubModel(StaticForward):
    def __init__(self, vocab: int, text_ids: list[int]):
        self.args = StubArgs(vocab)
        self.table = mx.array(text_ids, mx.int32)
        self.columns = mx.arange(vocab, dtype=mx.int32)
        mx.eval(self.table, self.columns)  # constants of the traces, not replayed per step

    def make_cache(self) -> list:
        return [StubCache()]

    def static_dtype(self):
        return mx.float32

    def _logits(self, pos: mx.array) -> mx.array:
        """[T, V]: one-hot at the text's next token after each position of pos [T]."""
        nxt = self.table[(pos + 1) % self.table.shape[0]]
        return (self.columns[None, :] == nxt[:, None]).astype(mx.float32)

    def __call__(self, ids: mx.array, cache: list, last_only: bool = True) -> mx.array:
        """The prefill forward: logits [1, 1, V] of the chunk's last position."""
        c = cache[0]
        c.offset += int(ids.shape[1])
        c.last = ids[0, -1:]
        return self._logits(mx.array([c.offset - 1], mx.int32))[None]

    def static_forward(self, ids: mx.array, ctx) -> tuple:
        news = []
        for t, view in enumerate(ctx.views):
            next(view)
            view.put(ids[0, t : t + 1])
            news.append(view.new)
        return self._logits(ctx.pos.reshape(-1)), news


def stub_model(tokenizer, text_ids: list[int]) -> LanguageModel:
    """The stand-in over the tokenizer's vocabulary, writing `text_ids` on (see the module doc)."""
    vocab = max(int(getattr(tokenizer, "vocab_size", 0) or 0), max(text_ids) + 1)
    return LanguageModel(StubModel(vocab, text_ids))
