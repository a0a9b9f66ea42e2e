"""The MTP head as a drafter (`--mtp`): DeepSeek V4's next-n layer proposes the draft.

`mtp_drafter(model, ctx)` builds the head (models/deepseek_v4_mtp.py) from the tensors the
loader kept in `model.mtp_weights` (the main file's `mtp.*`, or ds4's MTP support GGUF
given as `--mtp FILE`); a demo model without them gets a random head (seeded), so `--mtp`
runs with nothing downloaded.  `random_mtp_drafter` does the same for any V4 model
(tools/spec_bench.py).
On a DeepSeek V4.1 model both build the DSpark block drafter instead (dspark.py).

The head drafts from the target's residual streams: the backbone's `stream_hook` hands
over the streams of every multi-token forward (prefill chunks and speculative verifies;
speculation decodes only through those).  Per round, the head first catches up over the
positions the target evaluated since its last round (one forward over the real streams,
the last one giving draft token 1), then drafts tokens 2..k recursively from its own
streams.  Those speculative positions are rolled back at the next round.  Positions whose
streams it never saw (a session restored from a checkpoint) are skipped: the drafts get
worse, the output does not change (the target verifies every token).
"""

from __future__ import annotations

import mlx.core as mx

from ..loader import materialize
from .drafter import settle_drafts, top2_gap
from .options import SpecUsageError

RANDOM_SEED = 20261201


# DeepSeek V4.1's config keeps num_nextn_predict_layers (3) but its mtp.0..2 tensors are a
# DSpark block drafter, not V4's next-n layer (DeepSeek's V4.1 inference/model.py:
# DSparkBlock, forward_spec): `--mtp` on a V4.1 model builds that drafter (dspark.py).
V41 = "deepseek_v41"


def _model_type(model):
    return getattr(getattr(model, "model", model), "model_type", None)


def _v4_backbone(model):
    inner = getattr(model, "model", model)  # LanguageModel -> family Model
    backbone = getattr(inner, "model", None)
    kind = getattr(inner, "model_type", None)
    if kind not in ("deepseek_v4",) or not hasattr(backbone, "stream_hook"):
        raise SpecUsageError(f"--mtp: no MTP head for {kind or type(inner).__name__} models yet")
    return inner, backbone


def random_head(args, seed: int = RANDOM_SEED, std: float = 0.02, dtype=None):
    """A V4 MTP head with random weights (norms ~1, matrices N(0, std)), drawn on the
    device (a full-size head is 13 GB of bfloat16 experts: no host round trip)."""
    from mlx.utils import tree_flatten, tree_unflatten

    from ..models.deepseek_v4_mtp import MTPHead

    head = MTPHead(args)
    key = mx.random.key(seed)
    params = []
    for name, p in tree_flatten(head.parameters()):
        key, sub = mx.random.split(key)
        want = dtype if dtype is not None and mx.issubdtype(p.dtype, mx.floating) else p.dtype
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            v = 1.0 + 0.1 * mx.random.normal(p.shape, key=sub)
        elif "e_score_correction_bias" in name or name.endswith("hc_base"):
            v = 0.1 * mx.random.normal(p.shape, key=sub)
        elif name.endswith("hc_scale"):
            v = mx.ones(p.shape)
        else:  # drawn in the target dtype: no float32 copy of a 13 GB expert tensor
            v = mx.random.normal(p.shape, dtype=want, key=sub) * mx.array(std, want)
        params.append((name, v.astype(want)))
        mx.eval(params[-1][1])  # one tensor at a time
    head.update(tree_unflatten(params))
    materialize(head)  # rope tables too: the engine's worker thread cannot evaluate lazy arrays
    return head


def loaded_head(args, tensors: dict, dtype=None):
    """The head from `mtp.0.*` tensors (float or packed: the target's quantized install)."""
    from ..models.deepseek_v4_mtp import MTPHead, head_param_name
    from ..models.quantized import install_quantized, needs_install

    head = MTPHead(args)
    weights = {}
    for k, v in tensors.items():
        name = head_param_name(k)
        if name is not None:
            weights[name] = v
    owned = {}
    if needs_install(weights):
        weights, owned = install_quantized(head, weights, dtype)
    try:
        head.load_weights(list(weights.items()) + list(owned.items()), strict=True)
    except ValueError as e:
        # e.g. the hub checkpoint's own layout (mtp.0.attn.wq_a, per-expert w1/w2/w3):
        # only the GGUF layout (transformers layer names, ds4's head names) is mapped
        raise SpecUsageError(f"--mtp: the MTP tensors do not form a V4 MTP head: {e}") from None
    materialize(head)
    return head


class MTPDrafter:
    name = "MTP head"

    def __init__(self, model, head):
        self.model, self.backbone = _v4_backbone(model)
        self.head = head
        self.cache = head.make_cache()
        self.done = 0  # MTP positions evaluated with real streams: 0 .. done-1
        self._chunks: list = []  # (first position, streams [1, T, hc, H]) since `done`
        self._before = None  # the MTP cache before the last round's recursive (speculative) positions
        self.window = int(head.args.sliding_window)
        self.backbone.stream_hook = self._collect

    def close(self) -> None:
        if self.backbone.stream_hook == self._collect:
            self.backbone.stream_hook = None

    def _collect(self, streams: mx.array, start: int) -> None:
        # a re-verify after a rollback recomputes positions: the newest streams win
        kept = []
        for s, x in self._chunks:
            if s + x.shape[1] <= start:
                kept.append((s, x))
            elif s < start:
                kept.append((s, x[:, : start - s]))
        kept.append((start, streams))
        # only the last window matters (below): a long prefill keeps W positions, not all
        floor = start + streams.shape[1] - self.window
        self._chunks = [(max(s, floor), x[:, max(0, floor - s) :]) for s, x in kept if s + x.shape[1] > floor]

    def _streams(self, lo: int, hi: int):
        """Streams of positions lo..hi-1 (None if some are missing), and forget older ones."""
        parts, at = [], lo
        for s, x in self._chunks:
            end = s + x.shape[1]
            if end <= at or s > at:
                continue
            parts.append(x[:, at - s : min(end, hi) - s])
            at = min(end, hi)
            if at >= hi:
                break
        self._chunks = [(s, x) for s, x in self._chunks if s + x.shape[1] > hi]
        if at < hi:
            return None
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)

    def _rewind(self) -> None:
        if self._before is not None:
            meta, arrays, done = self._before
            cache = self.head.make_cache()
            cache.load(meta, {k: mx.array(v) for k, v in arrays.items()})
            self.cache, self.done, self._before = cache, done, None

    def _restart(self, at: int) -> None:
        self.cache = self.head.make_cache()
        self.cache.offset = at  # positions before `at` were never seen: an empty window
        self.done = at

    def propose(self, context, x0: int, k: int, rule, margin: float = 0.0):
        n = len(context)
        self._rewind()
        if self.done > n:  # the target went back (a new request on a shorter prefix)
            self._restart(0)
        if self.done < n - self.window:
            # the MTP layer attends to a sliding window: starting W positions back gives the
            # last position (the one that drafts) its exact window and rows
            self._restart(n - self.window)
        streams = self._streams(self.done, n)
        if streams is None:  # positions without streams: start from the newest ones seen
            first = max((s for s, _ in self._chunks if s < n), default=n - 1)
            self._restart(max(first, self.done))
            streams = self._streams(self.done, n)
            if streams is None:
                return [], None
        if streams.shape[1] == 0:
            return [], None
        nxt = list(context[self.done + 1 :]) + [int(x0)]
        x, hid = self.head(streams, mx.array([nxt], mx.int32), self.backbone.embed_tokens, self.cache)
        self.done = n
        self._before = (dict(self.cache.meta_state), {kk: mx.array(v) for kk, v in self.cache.state.items()}, n)
        toks, qs, gaps = [], [], []
        for i in range(k):
            logits = self.model.head(hid[:, -1:])[0, -1]
            tok, q = rule.draft(logits)
            toks.append(tok)
            if q is not None:
                qs.append(q)
            if margin > 0 and getattr(rule, "greedy_drafts", rule.greedy):
                gaps.append(top2_gap(logits))
            if i + 1 < k:  # recursive: the head's own streams are the next position's
                x, hid = self.head(x[:, -1:], tok.reshape(1, 1), self.backbone.embed_tokens, self.cache)
        return settle_drafts(toks, qs, gaps, margin)


def random_mtp_drafter(model, ctx: int = 0, seed: int = RANDOM_SEED):
    if _model_type(model) == V41:
        from ..models.deepseek_v41_dspark import DSparkArgs
        from ..models.deepseek_v41_dspark import random_head as random_dspark_head
        from .dspark import DSparkBlockDrafter, default_dspark_config

        inner = model.model
        dspark = DSparkArgs.from_config(default_dspark_config(inner.args))
        return DSparkBlockDrafter(model, random_dspark_head(inner.args, dspark, seed, dtype=inner.static_dtype()))
    inner, _ = _v4_backbone(model)
    return MTPDrafter(model, random_head(inner.args, seed, dtype=inner.static_dtype()))


def mtp_drafter(model, ctx: int):
    if _model_type(model) == V41:
        from .dspark import dspark_drafter

        return dspark_drafter(model, ctx)
    inner, _ = _v4_backbone(model)
    tensors = getattr(model, "mtp_weights", None) or {}
    if tensors:
        dtype = getattr(getattr(model, "dtype_policy", None), "weights", None)
        return MTPDrafter(model, loaded_head(inner.args, tensors, dtype))
    if getattr(model, "is_demo", False) or getattr(model, "random_weights", False):  # demo / synthetic: random
        return random_mtp_drafter(model, ctx)
    raise SpecUsageError("--mtp: this model file carries no MTP tensors (mtp.*); pass ds4's MTP GGUF: --mtp FILE")
