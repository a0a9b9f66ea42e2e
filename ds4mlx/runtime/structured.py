"""Structured output: a grammar over the answer's tokens, through llguidance.

A request's constraint (`Grammar`: a JSON schema, any JSON object, a regex, a choice of
strings, a Lark or GBNF grammar) becomes one `Constraint` per job: `mask()` is the
tokens the grammar allows next (bool [V], computed on the host by llguidance's matcher),
`consume(token)` advances it.  The engine applies the mask to the logits on the device
before sampling, only while the answer is written (after `</think>` when thinking:
the reasoning stays free), and a grammar that is complete allows only the end of the
turn.  A job without tools samples with `GrammarSampler` on the pipelined decode
loop (the mask from the reasoning's closing token on).  Strict tool calls are grammars too: a family protocol writes one
with `lark_literal` (special strings as token references) and `lark_json`.  Why
llguidance and not xgrammar, measured at this vocabulary (129,280 tokens) on the CPU, in
docs/http-api.md §10.7.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

# JSON with no free whitespace: a model (a random-weight demo one above all) could
# otherwise fill the answer with spaces; the separators are json.dumps' defaults.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def lark_literal(text: str, tokenizer) -> str:
    """`text` as a Lark term: quoted strings, with the tokenizer's special strings (a DSML
    marker, ...) as references to their token ids (a special token never matches text)."""
    specials = getattr(tokenizer, "special_ids", {}) or {}
    terms, rest = [], text
    while rest:
        at = min(((rest.find(s), s) for s in specials if s in rest), default=None)
        if at is None:
            terms.append(json.dumps(rest))
            break
        i, special = at
        if i:
            terms.append(json.dumps(rest[:i]))
        terms.append(f"<[{specials[special]}]>")
        rest = rest[i + len(special) :]
    return " ".join(terms) or '""'


def lark_json(schema: dict) -> str:
    """A JSON schema as a Lark term (llguidance's %json), written as the answers are."""
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS})


class GrammarError(ValueError):
    """The request's grammar does not compile (the HTTP layer's 400)."""


@dataclass(frozen=True)
class Grammar:
    kind: str  # json_schema | json_object | regex | choice | lark | gbnf
    source: Any  # the schema (dict), the pattern, the choices (list of str), the grammar text

    def llguidance(self) -> str:
        """This grammar in llguidance's grammar format (validated)."""
        import llguidance

        m = llguidance.LLMatcher
        try:
            text = self._text(m)
        except (ValueError, TypeError) as e:
            raise GrammarError(str(e)) from None
        is_error, messages = m.validate_grammar_with_warnings(text)
        if is_error:
            raise GrammarError(messages[0] if messages else "does not compile")
        return text

    def _text(self, m) -> str:
        if self.kind in ("json_schema", "json_object"):
            schema = self.source if self.kind == "json_schema" else {"type": "object"}
            text = m.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS)
        elif self.kind == "regex":
            text = m.grammar_from_regex(self.source)
        elif self.kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in self.source)
            text = m.grammar_from_lark(f"start: {alternatives}")
        elif self.kind == "lark":
            text = m.grammar_from_lark(self.source)
        elif self.kind == "gbnf":
            from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

            try:
                text = m.grammar_from_lark(gbnf_to_lark(self.source))
            except GbnfToLarkError as e:
                raise GrammarError(str(e)) from None
        else:
            raise GrammarError(f"unknown grammar kind {self.kind}")
        return text


_TOKENIZERS: dict[int, Any] = {}
_LOCK = threading.Lock()


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads of a tokenizer (tokenizer.py's API)."""

    def __init__(self, tokenizer):
        self._tk = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        specials = tokenizer.special_ids
        self.special_token_ids = sorted(specials.values() if isinstance(specials, dict) else specials)

    def __call__(self, s):
        return self._tk.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s)


def ll_tokenizer(tokenizer):
    """llguidance's view of a tokenizer, built once (about a second at 129,280 tokens)."""
    import llguidance

    with _LOCK:
        key = id(tokenizer)
        if key not in _TOKENIZERS:
            _TOKENIZERS[key] = (tokenizer, llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer))))
        return _TOKENIZERS[key][1]


class Constraint:
    """One job's grammar state: the mask of the next token, advanced token by token."""

    def __init__(self, grammar: Grammar, tokenizer, vocab: int | None = None):
        import llguidance
        import llguidance.numpy as lnp

        self._lnp = lnp
        self.tokenizer = tokenizer
        self.vocab = int(vocab or tokenizer.vocab_size)  # the model's logits may be padded past the tokenizer
        self.eos = tokenizer.eos_id
        self.matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar.llguidance())
        self._bits = lnp.allocate_token_bitmask(1, tokenizer.vocab_size)

    def mask(self) -> np.ndarray:
        """bool [vocab]: the tokens the grammar allows next (only the end of the turn once
        the grammar is complete)."""
        out = np.zeros(self.vocab, dtype=bool)
        if self.matcher.is_stopped() or self.matcher.is_error():
            out[self.eos] = True
            return out
        self._lnp.fill_next_token_bitmask(self.matcher, self._bits, 0)
        bits = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")
        n = min(self.vocab, self.tokenizer.vocab_size)
        out[:n] = bits[:n].astype(bool)
        return out

    def apply(self, logits):
        """The logits [V] (an mx.array) with every token the grammar forbids at -inf."""
        import mlx.core as mx

        return mx.where(mx.array(self.mask()), logits.reshape(-1), -np.inf)

    def consume(self, token: int) -> None:
        if not self.matcher.is_stopped():
            self.matcher.consume_token(int(token))

    @property
    def complete(self) -> bool:
        return self.matcher.is_accepting() or self.matcher.is_stopped()


class GrammarSampler:
    """A lookahead sampler (runtime/decode.py) under a grammar: `sample` (a lazy device
    sampler) applied to the logits with the grammar's mask.

    The loop hands it step t+1's lazy logits before the host has read token t: it starts
    that step on the device, reads token t (its own previous draw, computed before the
    step), advances the grammar and computes the next mask on the host while the step
    runs, then returns the masked draw, still lazy.  Every token it draws is consumed
    before the next draw, so the tokens are those of the synchronous host path.  With
    `opens_at` (the reasoning's closing token) the draws are free up to and including
    that token: the grammar holds the answer after it."""

    def __init__(self, constraint: Constraint, sample, opens_at: int | None = None):
        self.constraint, self.sample = constraint, sample
        self.opens_at = opens_at
        self._active = opens_at is None
        self._drawn = None  # the last token drawn, lazy until the next call

    def __call__(self, logits):
        import mlx.core as mx

        mx.async_eval(logits)
        if self._drawn is not None:
            last = int(self._drawn.item())
            if self._active:
                self.constraint.consume(last)
            self._active = self._active or last == self.opens_at
        self._drawn = self.sample(self.constraint.apply(logits) if self._active else logits)
        return self._drawn
