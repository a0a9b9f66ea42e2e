"""DeepSeek V4.1's DSpark drafter as `--mtp`: one block of drafts per round.

`dspark_drafter(model, ctx)` builds the head (models/deepseek_v41_dspark.py) from the
`mtp.*` tensors the loader kept in `model.mtp_weights` and the config's `dspark_*` keys;
a demo / random-weight model without them gets a random head (seeded) under
`DEFAULT_DSPARK`, so `--mtp` runs with nothing downloaded.

The head drafts from the target's captured states: the V4.1 backbone's `capture_hook`
hands over, for every multi-token forward (prefill chunks, speculative verifies), the
mean over the hc streams entering each of `dspark_target_layer_ids`, with the positions
and token ids they were computed for.  Per round the drafter observes the positions the
context gained since its last round (only those whose recorded token is the context's:
rows of rejected drafts are never used), then drafts one block after x0 and proposes its
first k tokens.  The head's window holds only context positions, so nothing is rolled
back; a context that no longer matches what it saw (a new request) restarts it one
window back.  Positions it has no states for (fed by a single-token decode step, or
restored from a checkpoint) are skipped: the drafts get worse, the output does not
change (the target verifies every token).  Two prunings, both optional: `--mtp-margin`
on the top-2 logit gap as for V4's head, and `--dspark-confidence F` on the head's
confidences (raw logits, as DeepSeek's reference returns them): the longest prefix of
the block whose survival, the running product of sigmoid(confidence), stays >= F (the
rule of the public DSpark ports; ds4's own scheduler also weighs the verify cost per
token, which is not modelled here).
"""

from __future__ import annotations

import math

import mlx.core as mx

from ..io.loader import materialize
from .drafter import settle_drafts, top2_gap
from .options import SpecUsageError

# For a model whose config has no DSpark keys (the demo, tiny test models): V4.1 Flash's
# block size and stage count, its last three layers as targets, a small Markov rank.
DEFAULT_DSPARK = {"dspark_block_size": 5, "dspark_markov_rank": 16, "num_nextn_predict_layers": 3}


def default_dspark_config(args) -> dict:
    n = args.num_hidden_layers
    return {
        **DEFAULT_DSPARK,
        "dspark_noise_token_id": args.vocab_size - 1,
        "dspark_target_layer_ids": list(range(max(0, n - 3), n)),
    }


def _v41_backbone(model):
    inner = getattr(model, "model", model)  # LanguageModel -> family Model
    backbone = getattr(inner, "model", None)
    if getattr(inner, "model_type", None) != "deepseek_v41" or not hasattr(backbone, "capture_hook"):
        raise SpecUsageError(f"--mtp: the DSpark drafter needs a DeepSeek V4.1 model, not {type(inner).__name__}")
    return inner, backbone


def confident_prefix(confidences, threshold: float) -> int:
    """How many leading draft positions keep a survival (the running product of
    sigmoid(confidence)) of at least `threshold`; all of them for a threshold <= 0."""
    n = len(confidences)
    if threshold <= 0:
        return n
    survival = 1.0
    for i, c in enumerate(confidences):
        survival *= 1.0 / (1.0 + math.exp(-float(c)))
        if survival < threshold:
            return i
    return n


class DSparkBlockDrafter:
    name = "DSpark block drafter"
    confidence_threshold = 0.0  # --dspark-confidence (0: off)

    def __init__(self, model, head):
        self.model, self.backbone = _v41_backbone(model)
        self.head = head
        self.window = int(head.args.sliding_window)
        self.cache = head.make_cache()
        self._seen: list[int] = []  # the tokens of the positions in the head's window
        self._chunks: list = []  # (first position, states [1, T, F], token ids [T]), sorted, disjoint
        self.backbone.capture_layers = frozenset(head.dspark.dspark_target_layer_ids)
        self.backbone.capture_hook = self._collect

    def close(self) -> None:
        if self.backbone.capture_hook == self._collect:
            self.backbone.capture_hook = None
            self.backbone.capture_layers = frozenset()

    def _collect(self, states: mx.array, start: int, ids: mx.array) -> None:
        toks = [int(t) for t in ids.reshape(-1).tolist()]
        kept = []
        for s, x, t in self._chunks:  # a re-verify after a rollback recomputes positions: the newest win
            if s + len(t) <= start:
                kept.append((s, x, t))
            elif s < start:
                kept.append((s, x[:, : start - s], t[: start - s]))
        kept.append((start, states, toks))
        # a later round needs at most the window before the newest context position
        floor = start - self.window
        self._chunks = [(max(s, floor), x[:, max(0, floor - s) :], t[max(0, floor - s) :]) for s, x, t in kept]
        self._chunks = [c for c in self._chunks if c[2]]

    def _rows(self, lo: int, n: int, context) -> tuple[int, mx.array | None]:
        """(first, states of positions first..n-1): the longest run ending at n-1, from lo
        on, whose recorded tokens are the context's; (n, None) when n-1 has none."""
        pieces, pos = [], n
        for s, x, t in reversed(self._chunks):
            if s >= pos:
                continue
            if s + len(t) < pos:
                break  # a gap
            i, j = max(lo - s, 0), pos - s
            k = j
            while k > i and t[k - 1] == int(context[s + k - 1]):
                k -= 1
            if k < j:
                pieces.append(x[:, k:j])
                pos = s + k
            if k > i or pos <= lo:
                break
        if not pieces:
            return n, None
        pieces.reverse()
        return pos, pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=1)

    def _restart(self, at: int) -> None:
        self.cache = self.head.make_cache()
        self.cache.offset = at
        self._seen = []

    def propose(self, context, x0: int, k: int, rule, margin: float = 0.0):
        n = len(context)
        c = self.cache
        seen_from = c.offset - len(self._seen)
        if c.offset > n or [int(t) for t in context[seen_from : c.offset]] != self._seen:
            self._restart(max(0, n - self.window))  # the target went back or elsewhere
        elif c.offset < n - self.window:
            self._restart(n - self.window)  # older positions would fall out of the window anyway
        first, rows = self._rows(self.cache.offset, n, context)
        if rows is None:
            return [], None
        if first > self.cache.offset:
            self._restart(first)
        qs = []

        def pick(row):
            tok, q = rule.draft(row)
            if q is not None:
                qs.append(q)
            return tok

        logits, confidences, toks = self.head.draft_block(
            rows, int(x0), self.cache, self.backbone.embed_tokens, self.model.head, pick
        )
        self._seen = (self._seen + [int(t) for t in context[first:n]])[-self.window :]
        k = min(int(k), self.head.dspark.dspark_block_size)
        if self.confidence_threshold > 0:
            k = min(k, confident_prefix(confidences[:k].tolist(), self.confidence_threshold))
        gaps = []
        if margin > 0 and getattr(rule, "greedy_drafts", rule.greedy):
            gaps = [top2_gap(logits[i]) for i in range(k)]
        return settle_drafts([toks[i] for i in range(k)], qs[:k], gaps, margin)


def loaded_head(args, dspark, tensors: dict):
    from ..models.deepseek_v41_dspark import DSparkHead, dspark_weights

    head = DSparkHead(args, dspark)
    try:
        head.load_weights(list(dspark_weights(tensors).items()), strict=True)
    except ValueError as e:
        raise SpecUsageError(f"--mtp: the mtp.* tensors do not form a DSpark drafter: {e}") from None
    materialize(head)
    return head


def dspark_drafter(model, ctx: int = 0) -> DSparkBlockDrafter:
    from ..models.deepseek_v41_dspark import DSparkArgs, random_head

    inner, _ = _v41_backbone(model)
    config = getattr(model, "config", None) or {}
    tensors = getattr(model, "mtp_weights", None) or {}
    try:
        if tensors:
            return DSparkBlockDrafter(model, loaded_head(inner.args, DSparkArgs.from_config(config), tensors))
        if getattr(model, "is_demo", False) or getattr(model, "random_weights", False):
            text = config.get("text_config", config)
            dspark = DSparkArgs.from_config(
                text if text.get("dspark_block_size") else default_dspark_config(inner.args)
            )
            return DSparkBlockDrafter(model, random_head(inner.args, dspark, dtype=inner.static_dtype()))
    except ValueError as e:  # a config the head refuses
        raise SpecUsageError(f"--mtp: {e}") from None
    raise SpecUsageError("--mtp: this model file carries no DSpark tensors (mtp.*)")
