"""What every family's `ModelArgs` and `Model` (models/<family>.py) have in common.

* `BaseModelArgs.from_dict(config)`: a family's `ModelArgs` dataclass built from a
  Hugging Face `config.json` dict, keys it does not know ignored.  A family whose hub
  config nests the text model (`text_config`) overrides `from_dict` to pick that part,
  then calls this one.
* `CausalLM`: the family's backbone (`self.model`, holding `embed_tokens` and `layers`)
  plus the output head, `lm_head` or, with `tie_word_embeddings`, the embedding used as
  a linear layer.  `model(ids [1, T] or [T], cache) -> logits [1, T, V]`; the family
  defines `make_cache()` and `sanitize(weights)` (`drop_tied_head` is its last step).
* `ContextForward`: for a family with one `forward(ids, ctx, last_only=False)` over every
  context kind (docs/forward.md §2), `model(ids, cache)` as its PREFILL context and the
  stepper's `static_forward` as its DECODE / CHAIN contexts.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from ..runtime.forward_context import StepContext


class BaseModelArgs:
    """Mixin for a family's `@dataclass class ModelArgs`."""

    @classmethod
    def from_dict(cls, config: dict):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names})


class ContextForward:
    """Mixin (before `CausalLM`) for a family `Model` with one `forward(ids, ctx, last_only=False)`
    over every context kind (runtime/forward_context.py): `model(ids, cache)` is its PREFILL
    context, the stepper's `static_forward` its DECODE / CHAIN contexts."""

    def __call__(self, ids: mx.array, cache: list | None = None, last_only: bool = False) -> mx.array:
        """`CausalLM.__call__`: a PREFILL forward of ids [1, T] after the state in `cache`."""
        ids = ids if ids.ndim == 2 else ids[None]
        cache = self.make_cache() if cache is None else cache
        return self.forward(ids, StepContext.prefill(cache[0].offset if cache else 0, cache), last_only)

    def static_forward(self, ids: mx.array, ctx) -> tuple:
        """Pure: `forward` of a DECODE or CHAIN context (the stepper's entry)."""
        return self.forward(ids, ctx)


class CausalLM(nn.Module):
    """Base of a family's `Model`: `super().__init__(args, Backbone(args))`."""

    def __init__(self, args, backbone: nn.Module):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = backbone
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, ids: mx.array, cache: list | None = None, last_only: bool = False) -> mx.array:
        """Forward `ids` [1, T] after the state in `cache` (a fresh one when None).

        `last_only=True` returns only the last position's logits ([1, 1, V])."""
        if ids.ndim == 1:
            ids = ids[None]
        if cache is None:
            cache = self.make_cache()
        h = self.model(ids, cache)
        if last_only:
            h = h[:, -1:]
        return self.head(h)

    def head(self, h: mx.array) -> mx.array:
        """Final hidden states -> logits (lm_head, or the tied embedding)."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def make_cache(self) -> list:
        """One session-state object per layer (the family's cache types)."""
        raise NotImplementedError

    @property
    def layers(self):
        return self.model.layers

    def drop_tied_head(self, weights: dict) -> dict:
        """`weights` without `lm_head.weight` when the head is the tied embedding."""
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights
