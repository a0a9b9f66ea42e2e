"""The MTP head as a drafter (`--mtp`): the model's next-n layer proposes the draft.

Families with a head (the registry's `mtp_head` column, models/<family>_mtp.py):
DeepSeek V4 (`mtp.*`), GLM 5.x `glm_moe_dsa` (`model.layers.{num_hidden_layers}.*`)
and Qwen3.8 Flash Next `qwen4_exp` (`mtp.*`); other families are refused in one line.
On a DeepSeek V4.1 model both builders make the DSpark block drafter instead (dspark.py).

`mtp_drafter(model, ctx)` builds the head from the tensors the loader kept in
`model.mtp_weights` (the main file's MTP tensors, or ds4's MTP support GGUF given as
`--mtp FILE` for V4); a demo model without them gets a random head (seeded), so `--mtp`
runs with nothing downloaded.  `random_mtp_drafter` does the same for any model of those
families (tools/spec_bench.py).  A head module exposes `make_head(args, names)`,
`head_weights(tensors, args)`, `init_kind(name)` and an `MTPHead` with `window` (its
attention window, None: every MTP position), `make_cache()` and
`__call__(carry, next_ids, embed, cache) -> (next carry, hidden for the lm_head)`.

The head drafts from what the backbone's `stream_hook` hands over for every multi-token
forward (prefill chunks and speculative verifies; speculation decodes only through
those): each family's MTP input (V4 and Qwen: the residual streams after the last layer;
GLM: the final hidden states).  Per round, the head first catches up over the positions
the target evaluated since its last round (one forward over the real states, the last
one giving draft token 1), then drafts tokens 2..k recursively from its own output.
Those speculative positions are rolled back at the next round.  Positions whose states
it never saw (a session restored from a checkpoint) are skipped by a windowed head and
fed as zeros to a full-attention one: the drafts get worse, the output does not change
(the target verifies every token).
"""

from __future__ import annotations

import mlx.core as mx

from .. import registry
from ..io.loader import materialize
from ..io.quant import EXPERTS_PER_LAUNCH, expert_spans
from .drafter import DraftRound
from .options import SpecUsageError

RANDOM_SEED = 20261201


# DeepSeek V4.1's config keeps num_nextn_predict_layers (3) but its mtp.0..2 tensors are a
# DSpark block drafter, not V4's next-n layer (DeepSeek's V4.1 inference/model.py:
# DSparkBlock, forward_spec): `--mtp` on a V4.1 model builds that drafter (dspark.py).
V41 = "deepseek_v41"


# model_type -> the module of its family's MTP head, and the head's name in messages
HEADS = {t: f.mtp_head for f in registry.FAMILIES if f.mtp_head for t in f.model_types}
LABELS = {t: f.mtp_label for f in registry.FAMILIES if f.mtp_head for t in f.model_types}


def _model_type(model):
    return getattr(getattr(model, "model", model), "model_type", None)


def head_module(kind: str | None):
    """The head module of family `kind` (SpecUsageError for a family without one)."""
    import importlib

    if kind not in HEADS:
        heads = ", ".join(f.mtp_label for f in registry.FAMILIES if f.mtp_head)
        raise SpecUsageError(f"--mtp: no MTP head for {kind} models yet (heads: {heads})")
    return importlib.import_module(HEADS[kind])


def _backbone(model):
    inner = getattr(model, "model", model)  # LanguageModel -> family Model
    backbone = getattr(inner, "model", None)
    kind = getattr(inner, "model_type", None) or type(inner).__name__
    head_module(kind)
    if not hasattr(backbone, "stream_hook"):
        raise SpecUsageError(f"--mtp: the {kind} backbone hands over no hidden states")
    return inner, backbone


def _float_dtype(inner):
    """The dtype a random head is drawn in: the model's static-step dtype, else its embedding's."""
    dt = inner.static_dtype() if hasattr(inner, "static_dtype") else None
    return dt if dt is not None else inner.model.embed_tokens.weight.dtype


def _normal_rows(shape, dtype, key):
    """N(0, 1) of `shape`; an expert bank (3-D, more than EXPERTS_PER_LAUNCH experts) is
    drawn a slice at a time (MLX CUDA fails with "cudaGraphAddKernelNode ... invalid
    argument" drawing a full-size bank whole)."""
    if len(shape) != 3 or shape[0] <= EXPERTS_PER_LAUNCH:
        return mx.random.normal(shape, dtype=dtype, key=key)
    spans = list(expert_spans(shape[0]))
    keys = mx.random.split(key, len(spans))
    parts = []
    for i, (_, e) in enumerate(spans):
        parts.append(mx.random.normal((e, *shape[1:]), dtype=dtype, key=keys[i]))
        mx.eval(parts[-1])
    return mx.concatenate(parts)


def random_head(args, seed: int = RANDOM_SEED, std: float = 0.02, dtype=None):
    """An MTP head of `args`' family with random weights (per the module's `init_kind`:
    norms ~1 or ~0 for (1 + w) norms, matrices N(0, std)), drawn on the device (a
    full-size V4 head is 13 GB of bfloat16 experts: no host round trip)."""
    from mlx.utils import tree_flatten, tree_unflatten

    mod = head_module(args.model_type)
    head = mod.make_head(args)
    key = mx.random.key(seed)
    params = []
    for name, p in tree_flatten(head.parameters()):
        key, sub = mx.random.split(key)
        want = dtype if dtype is not None and mx.issubdtype(p.dtype, mx.floating) else p.dtype
        kind = mod.init_kind(name)
        if kind == "unit":
            v = 1.0 + 0.1 * mx.random.normal(p.shape, key=sub)
        elif kind == "small":
            v = 0.1 * mx.random.normal(p.shape, key=sub)
        elif kind == "ones":
            v = mx.ones(p.shape)
        else:  # drawn in the target dtype: no float32 copy of a 13 GB expert tensor
            v = _normal_rows(p.shape, want, sub) * mx.array(std, want)
        params.append((name, v.astype(want)))
        mx.eval(params[-1][1])  # one tensor at a time
    head.update(tree_unflatten(params))
    materialize(head)  # rope tables too: the engine's worker thread cannot evaluate lazy arrays
    return head


def loaded_head(args, tensors: dict, dtype=None):
    """The head from the checkpoint's MTP tensors (float or packed: the target's quantized install)."""
    from ..models.quantized import install_quantized, needs_install

    mod = head_module(args.model_type)
    head = mod.make_head(args, list(tensors))
    weights = mod.head_weights(tensors, args)
    owned = {}
    if needs_install(weights):
        weights, owned = install_quantized(head, weights, dtype)
    try:
        head.load_weights(list(weights.items()) + list(owned.items()), strict=True)
    except ValueError as e:
        # e.g. V4's hub checkpoint layout (mtp.0.attn.wq_a, per-expert w1/w2/w3): only the
        # GGUF layout (transformers layer names, ds4's head names) is mapped for V4
        label = LABELS[args.model_type]
        raise SpecUsageError(f"--mtp: the MTP tensors do not form a {label} MTP head: {e}") from None
    materialize(head)
    return head


class MTPDrafter:
    name = "MTP head"

    def __init__(self, model, head):
        self.model, self.backbone = _backbone(model)
        self.head = head
        self.cache = head.make_cache()
        self.done = 0  # MTP positions evaluated with real states: 0 .. done-1
        self._chunks: list = []  # (first position, states [1, T, ...]) since `done`
        self._before = None  # the MTP cache before the last round's recursive (speculative) positions
        self.window = head.window  # None: the head attends every MTP position
        own = getattr(head, "lm_head", None)  # a checkpoint's own output head (GLM's shared_head.head)
        self.lm_head = self.model.head if own is None else own
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
        if self.window is None:  # a full-attention head needs every position since `done`
            self._chunks = [(s, x) for s, x in kept if s + x.shape[1] > self.done]
            return
        # only the last window matters (below): a long prefill keeps W positions, not all
        floor = start + streams.shape[1] - self.window
        self._chunks = [(max(s, floor), x[:, max(0, floor - s) :]) for s, x in kept if s + x.shape[1] > floor]

    def _streams(self, lo: int, hi: int, fill: bool = False):
        """States of positions lo..hi-1 (None if some are missing; zeros for them with
        `fill`, None if none was ever seen), and forget older ones."""
        if lo >= hi:
            return None
        parts, at = [], lo
        like = self._chunks[0][1] if self._chunks else None
        for s, x in self._chunks:
            end = s + x.shape[1]
            if end <= at:
                continue
            if s > at:
                if not fill or s >= hi:
                    break
                parts.append(mx.zeros((1, s - at, *x.shape[2:]), x.dtype))
                at = s
            parts.append(x[:, at - s : min(end, hi) - s])
            at = min(end, hi)
            if at >= hi:
                break
        self._chunks = [(s, x) for s, x in self._chunks if s + x.shape[1] > hi]
        if at < hi:
            if not fill or like is None:
                return None
            parts.append(mx.zeros((1, hi - at, *like.shape[2:]), like.dtype))
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
        if self.window is not None and self.done < n - self.window:
            # the MTP layer attends to a sliding window: starting W positions back gives the
            # last position (the one that drafts) its exact window and rows
            self._restart(n - self.window)
        # a full-attention head's cache cannot start past position 0: missing states are zeros
        streams = self._streams(self.done, n, fill=self.window is None)
        if streams is None and self.window is None:  # nothing seen yet (or nothing new)
            return [], None
        if streams is None:  # positions without streams: start from the newest ones seen
            first = max((s for s, _ in self._chunks if s < n), default=n - 1)
            self._restart(max(first, self.done))
            streams = self._streams(self.done, n)
            if streams is None:
                return [], None
        if streams.shape[1] == 0:
            return [], None
        nxt = list(context[self.done + 1 :]) + [int(x0)]
        step = getattr(self.head, "step", self.head)  # a head's static step where it has one
        x, hid = step(streams, mx.array([nxt], mx.int32), self.backbone.embed_tokens, self.cache)
        self.done = n
        self._before = (dict(self.cache.meta_state), {kk: mx.array(v) for kk, v in self.cache.state.items()}, n)
        round_ = DraftRound(rule, margin)
        for i in range(k):
            tok = round_.draft(self.lm_head(hid[:, -1:])[0, -1])
            if i + 1 < k:  # recursive: the head's own streams are the next position's
                x, hid = step(x[:, -1:], tok.reshape(1, 1), self.backbone.embed_tokens, self.cache)
        return round_.settle()


def random_mtp_drafter(model, ctx: int = 0, seed: int = RANDOM_SEED, quantized: bool = True):
    """A drafter with a random MTP head (V4.1: DSpark block) for `model`; `quantized`: its routed
    experts quantized as the target's (`_quantized_like`), else in the model's float dtype."""
    if _model_type(model) == V41:
        from ..models.deepseek_v41_dspark import DSparkArgs
        from ..models.deepseek_v41_dspark import random_head as random_dspark_head
        from .dspark import DSparkBlockDrafter, default_dspark_config

        inner = model.model
        dspark = DSparkArgs.from_config(default_dspark_config(inner.args))
        return DSparkBlockDrafter(model, random_dspark_head(inner.args, dspark, seed, dtype=inner.static_dtype()))
    inner, _ = _backbone(model)
    head = random_head(inner.args, seed, dtype=_float_dtype(inner))
    return MTPDrafter(model, _quantized_like(inner, head) if quantized else head)


def _quantized_like(inner, head):
    """The random head's routed experts quantized as the target's are (a synthetic model's
    2-bit banks): a float head at V4 Flash size is 13 GB of bfloat16 experts, read at 6 experts
    a token that is more than a target layer's bytes, which no real MTP file (ds4's MTP GGUF
    is quantized) costs.  (Its bfloat16 banks past 2^31 bytes once made the catch-up's grouped
    GEMM read before the bank: `layers.SwitchLinear` splits them, `quant.grouped_gemm_spans`.)"""
    from ..models.layers import QuantizedSwitchLinear, SwitchLinear, quantize_switch

    target = next((m for _, m in inner.named_modules() if isinstance(m, QuantizedSwitchLinear)), None)
    if target is None:
        return head
    for _, m in head.named_modules():
        for name in ("gate_up_proj", "down_proj"):  # a SwitchGLU's banks (a dense MLP's are Linear)
            bank = getattr(m, name, None)
            if isinstance(bank, SwitchLinear):
                setattr(m, name, quantize_switch(bank, target.bits, target.group_size))
    mx.clear_cache()
    return head


def mtp_drafter(model, ctx: int):
    if _model_type(model) == V41:
        from .dspark import dspark_drafter

        return dspark_drafter(model, ctx)
    inner, _ = _backbone(model)
    tensors = getattr(model, "mtp_weights", None) or {}
    if tensors:
        dtype = getattr(getattr(model, "dtype_policy", None), "weights", None)
        return MTPDrafter(model, loaded_head(inner.args, tensors, dtype))
    if getattr(model, "is_demo", False) or getattr(model, "random_weights", False):  # demo / synthetic: random
        return random_mtp_drafter(model, ctx)
    if inner.model_type == "deepseek_v4":
        raise SpecUsageError("--mtp: this model file carries no MTP tensors (mtp.*); pass ds4's MTP GGUF: --mtp FILE")
    raise SpecUsageError(f"--mtp: this model file carries no MTP tensors ({LABELS[inner.model_type]} next-n layer)")
