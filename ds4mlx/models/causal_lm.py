"""What every family's `ModelArgs` and `Model` (models/<family>.py) have in common.

* `BaseModelArgs.from_dict(config)`: a family's `ModelArgs` dataclass built from a
  Hugging Face `config.json` dict, keys it does not know ignored.  A family whose hub
  config nests the text model (`text_config`) overrides `from_dict` to pick that part,
  then calls this one.
* `CausalLM`: the family's backbone (`self.model`, holding `embed_tokens` and `layers`)
  plus the output head, `lm_head` or, with `tie_word_embeddings`, the embedding used as
  a linear layer.  `model(ids [1, T] or [T], cache) -> logits [1, T, V]`; the family
  defines `make_cache()` and `sanitize(weights)` (`drop_tied_head` is its last step).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn


class BaseModelArgs:
    """Mixin for a family's `@dataclass class ModelArgs`."""

    @classmethod
    def from_dict(cls, config: dict):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names})


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
