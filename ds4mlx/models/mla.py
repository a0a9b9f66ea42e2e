"""Multi-head latent attention (MLA) with DeepSeek sparse attention (DSA) indexers, in MLX.

Shared by GLM 5.2 (transformers `glm_moe_dsa`) and GLM 5.3 Flash (`glm5_next`).

MLA (transformers' `GlmMoeDsaAttention` / `Glm5NextTextAttention`):

    q_res  = q_a_layernorm(q_a_proj(x));  q = q_b_proj(q_res)      per head [nope | rope]
    kv     = kv_a_proj_with_mqa(x) = [latent (kv_lora_rank) | k_rope (qk_rope_head_dim)]
    latent = kv_a_layernorm(latent);  k_nope, v = kv_b_proj(latent) per head
    rope   = interleaved pairs on the trailing `qk_rope_head_dim` channels (0 = NoPE)

The cache holds only the normalised latent and the roped shared key slice per token.
Attention runs either "expanded" (kv_b_proj applied to every cached latent; cheaper for
long prefill chunks) or "absorbed" (kv_b_proj folded into the query and the output, so
one shared latent head of `kv_lora_rank + rope` is attended; cheaper for decode).  Both
give the same numbers up to float rounding.

Sparse attention: an indexer picks, per query, the keys the query may attend.  A
`Selection` describes the result for one PREFILL chunk of C queries over L = offset + C
keys: dense causal (`DENSE`), an explicit key mask [C, L], or (one query) a list of key
rows to gather; a static row's selection is (key rows or None, its mask).  "shared" layers
reuse the previous layer's.

* `DSAIndexer` (GLM 5.2, DeepSeek V3.2 style): per-token keys `k = LayerNorm(wk(x))`
  (with bias, eps 1e-6), rope on the *leading* `qk_rope_head_dim` channels of q and k,
  score(t, j) = sum_h w_h(x_t) ReLU(q_h . k_j / sqrt(d)), w = weights_proj(x)/sqrt(H);
  the top `index_topk` causal keys (all of them while there are no more than that).
* `KPoolIndexer` (GLM 5.3 Flash): the same scorer over *pools* of `index_kpool`
  consecutive keys, each pooled by a per-channel softmax over its tokens of
  `x @ index_kpool_compress_gate^T + index_kpool_compress_ape`; a query may pick among
  the pools whose last token it sees, keeps the best `index_topk / index_kpool`, and
  always attends the tokens of its own incomplete pool (the "tail").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..runtime.forward_context import PREFILL
from .cache import grow_rows, iota
from .layers import RMSNorm, RoPE, topk_indices

# ----------------------------------------------------------------------------- selection


@dataclass(frozen=True)
class Selection:
    """Which keys each query of a chunk attends: dense causal when both are None."""

    mask: mx.array | None = None  # [C, L] bool (causality included)
    index: mx.array | None = None  # [k] int32 key rows (a single query, all of them valid)


DENSE = Selection()


def causal_mask(s: int, C: int) -> mx.array:
    """[C, s+C] bool: query s+c sees keys 0..s+c."""
    return mx.arange(s + C)[None] <= (s + mx.arange(C))[:, None]


# ----------------------------------------------------------------------------- cache


class Rows:
    """A growable [1, cap, dim] row buffer; the first `n` rows are live."""

    # capacity grows in power-of-two buckets (models/cache.py): the compiled decode step
    # is traced once per bucket

    def __init__(self, dim: int):
        self.dim, self.buf, self.n = dim, None, 0

    @property
    def cap(self) -> int:
        return 0 if self.buf is None else self.buf.shape[1]

    def reserve(self, want: int, dtype) -> None:
        if self.buf is None:
            self.buf = mx.zeros((1, 0, self.dim), dtype)
        self.buf = grow_rows(self.buf, self.n, want)

    def append(self, new: mx.array) -> mx.array:
        k = new.shape[1]
        self.reserve(self.n + k, new.dtype)
        self.buf[:, self.n : self.n + k] = new.astype(self.buf.dtype)
        self.n += k
        return self.buf[:, : self.n]

    def live(self) -> mx.array:
        return self.buf[:, : self.n]

    def load(self, rows: mx.array | None, n: int, cap: int) -> None:
        if rows is None:
            if n:
                raise ValueError("cache rows missing")
            self.buf, self.n = None, 0
            return
        if rows.shape[1] != n or rows.shape[2] != self.dim or cap < n:
            raise ValueError("cache row count mismatch")
        self.buf = mx.concatenate([rows, mx.zeros((1, cap - n, self.dim), rows.dtype)], axis=1)
        self.n = n


class MLACache:
    """Session state of one MLA layer.

    latent [1, L, kv_lora_rank], k_rope [1, L, rope] (absent for NoPE) and, by indexer:
      "dsa":   index_k [1, L, index_head_dim]  roped, normalised indexer keys
      "kpool": pool_k / pool_gate [1, kpool, index_head_dim] the incomplete pool's keys and
               gate logits (the first offset % kpool rows are live), pools [1, P, index_head_dim]
      None:    nothing ("shared" layers reuse another layer's selection)."""

    kind = "mla"

    def __init__(
        self, kv_lora_rank: int, rope_dim: int, indexer: str | None = None, index_head_dim: int = 0, kpool: int = 0
    ):
        if indexer not in (None, "dsa", "kpool"):
            raise ValueError(f"unknown indexer kind {indexer!r}")
        self.offset = 0
        self.indexer, self.kpool = indexer, kpool
        self.rows = {"latent": Rows(kv_lora_rank)}
        if rope_dim:
            self.rows["k_rope"] = Rows(rope_dim)
        if indexer == "dsa":
            self.rows["index_k"] = Rows(index_head_dim)
        elif indexer == "kpool":
            self.rows["pools"] = Rows(index_head_dim)
        self.pool_k = self.pool_gate = None

    # -- static decode layout (the compiled step, ds4mlx/runtime/stepper.py) ---------------------
    def _rows_at(self, name: str, offset: int) -> int:
        """Live rows of buffer `name` after `offset` tokens (k-pool pools: complete pools)."""
        return offset // self.kpool if name == "pools" else offset

    def static_state(self, dtype, ahead: int = 1) -> list[mx.array]:
        """The row buffers (latent, k_rope, index_k or pools: `rows` order), grown so the
        next `ahead` positions' rows fit (a chained forward writes them all), then for a
        k-pool indexer the open pool's pool_k, pool_gate."""
        out = []
        for name, r in self.rows.items():
            r.reserve(self._rows_at(name, self.offset + ahead - 1) + 1, dtype)
            out.append(r.buf)
        if self.indexer == "kpool":
            if self.pool_k is None:
                self.pool_k = mx.zeros((1, self.kpool, self.rows["pools"].dim), dtype)
                self.pool_gate = mx.zeros((1, self.kpool, self.rows["pools"].dim), dtype)
            out += [self.pool_k, self.pool_gate]
        return out

    def static_mark(self) -> tuple:
        """(latent buffer, offset): what tells a session that this cache is still the state a
        chained verify committed (`Session.keep_verified`): every step and commit moves one."""
        return self.rows["latent"].buf, self.offset

    def commit_static(self, arrays, advance: int = 1) -> None:
        self.offset += advance
        for name, r in self.rows.items():
            r.buf, r.n = next(arrays), self._rows_at(name, self.offset)
        if self.indexer == "kpool":
            self.pool_k, self.pool_gate = next(arrays), next(arrays)

    @property
    def state(self) -> dict:
        out = {name: r.live() for name, r in self.rows.items() if r.buf is not None}
        if self.pool_k is not None:
            out["pool_k"], out["pool_gate"] = self.pool_k, self.pool_gate
        return out

    @property
    def meta_state(self) -> dict:
        return {
            "type": self.kind,
            "offset": self.offset,
            "indexer": self.indexer,
            "kpool": self.kpool,
            "rows": {name: [r.n, r.cap] for name, r in self.rows.items()},
        }

    def load(self, meta: dict, arrays: dict) -> None:
        if meta.get("type") != self.kind or meta.get("indexer") != self.indexer or meta.get("kpool") != self.kpool:
            raise ValueError("layer cache layout mismatch")
        rows_meta = meta.get("rows", {})
        if set(rows_meta) != set(self.rows):
            raise ValueError("layer cache layout mismatch")
        known = set(self.rows) | ({"pool_k", "pool_gate"} if self.indexer == "kpool" else set())
        if not set(arrays) <= known:
            raise ValueError(f"unexpected MLA cache arrays {sorted(set(arrays) - known)}")
        self.offset = int(meta["offset"])
        for name, r in self.rows.items():
            n, cap = (int(v) for v in rows_meta[name])
            r.load(arrays.get(name), n, cap)
        if self.rows["latent"].n != self.offset:
            raise ValueError("MLA cache rows do not match its offset")
        if self.indexer == "kpool":
            self.pool_k, self.pool_gate = arrays.get("pool_k"), arrays.get("pool_gate")
            if (self.pool_k is None) != (self.offset == 0) or self.rows["pools"].n != self.offset // self.kpool:
                raise ValueError("k-pool indexer cache does not match its offset")

    @property
    def nbytes(self) -> int:
        total = sum(r.buf.nbytes for r in self.rows.values() if r.buf is not None)
        if self.pool_k is not None:
            total += self.pool_k.nbytes + self.pool_gate.nbytes
        return total


# ----------------------------------------------------------------------------- indexers


SCORE_BLOCK_ELEMS = 1 << 26  # queries are scored in blocks of at most this many (query, head, key) floats


def indexer_types_from(pattern: Any, freq: int | None, skip_offset: int | None, n: int) -> list[str]:
    """Which of `n` layers run their own indexer ("full") and which reuse the layer before's
    selection ("shared"), from a hub config's spellings: a pattern ("FSS..." or a list), else
    every `freq`-th layer from `skip_offset` (default 2) on."""
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(freq or 1, 1)
    off = 2 if skip_offset is None else skip_offset
    return ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(n)]


def index_scores(q: mx.array, keys: mx.array, w: mx.array, scale: float) -> mx.array:
    """sum_h w[b,t,h] * ReLU(q[b,t,h] . keys[b,j] * scale) -> [B, C, N] float32.

    q [B, C, H, D], keys [B, N, D], w [B, C, H] (all float32)."""
    B, C, H, _ = q.shape
    N = keys.shape[1]
    kT = keys.astype(mx.float32).swapaxes(-1, -2)[:, None]  # [B, 1, D, N]
    w = w[:, :, None, :]  # [B, C, 1, H]
    step = max(1, SCORE_BLOCK_ELEMS // max(1, H * N))
    out = [
        (w[:, i : i + step] @ mx.maximum((q[:, i : i + step] @ kT) * scale, 0.0)).squeeze(2) for i in range(0, C, step)
    ]
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=1)


class DSAIndexer(nn.Module):
    """Token-level DSA indexer (transformers' `GlmMoeDsaIndexer`; parameter names as there)."""

    def __init__(
        self, hidden: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int, rope: RoPE | None, rope_dim: int
    ):
        super().__init__()
        if rope_dim > head_dim:
            raise ValueError("index_head_dim must be >= qk_rope_head_dim")
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)
        self._H, self._D, self._topk = n_heads, head_dim, topk
        self._rope, self._r = rope, rope_dim

    def _rotate(self, x: mx.array, s: int) -> mx.array:
        """Rope on the leading `rope_dim` channels of x [B, H, C, D] at positions s.."""
        if not self._r:
            return x
        rot = self._rope(x[..., : self._r], offset=s)
        return rot if self._r == x.shape[-1] else mx.concatenate([rot, x[..., self._r :]], axis=-1)

    def chunk(self, k: mx.array, q: mx.array, w: mx.array, cache: MLACache, s: int) -> Selection:
        """A PREFILL chunk's selection (its `project` outputs [1, C, ..]) at host position s,
        the chunk's keys appended to the cache: dense while every causal key fits in
        index_topk, else each query's top-k causal keys (a mask; one query: the key rows)."""
        B, C, _ = k.shape
        k = self._rotate(k[:, None], s)[:, 0]  # [B, C, D]
        keys = cache.rows["index_k"].append(k)
        L = s + C
        if L <= self._topk:
            return DENSE
        q = q.reshape(B, C, self._H, self._D).swapaxes(1, 2)
        q = self._rotate(q, s).swapaxes(1, 2).astype(mx.float32)  # [B, C, H, D]
        scores = index_scores(q, keys, w, self._D**-0.5)[0]  # [C, L]
        if C == 1:  # one query (a one-token chunk, an MTP draft): every cached key is causal; gather k rows
            return Selection(index=topk_indices(scores[0], self._topk))
        causal = causal_mask(s, C)
        idx = topk_indices(mx.where(causal, scores, -mx.inf), self._topk)
        chosen = mx.put_along_axis(mx.zeros((C, L), mx.bool_), idx, mx.array(True), axis=-1)
        return Selection(mask=chosen & causal)

    def project(self, x: mx.array, q_res: mx.array) -> tuple:
        """The projections of every query row at once (x, q_res [1, T, ..]), every kind: (normed
        keys before rope [1, T, D], queries [1, T, H * D], head weights [1, T, H])."""
        return self.k_norm(self.wk(x)), self.wq_b(q_res), self.weights_proj(x).astype(mx.float32) * self._H**-0.5

    def step(self, k: mx.array, q: mx.array, w: mx.array, pos: mx.array, view, valid: mx.array):
        """`chunk` for one query row of a static forward at `pos` (array; its `project` outputs
        [1, 1, ..]) over its view's capacity rows (runtime/forward_context.py `StateView`):
        (index [k] or None for all rows, valid [k or cap]).  Above index_topk capacity, the
        top-k of the scores with rows that are not live at -inf (so below index_topk live rows
        every live row is picked, as DENSE)."""
        k = self._rotate(k[:, None], pos)[:, 0]  # [1, 1, D]
        keys = next(view)
        keys = mx.slice_update(keys, k.astype(keys.dtype), pos.reshape(1), axes=(1,))
        view.put(keys)
        if keys.shape[1] <= self._topk:
            return None, valid
        q = q.reshape(1, 1, self._H, self._D).swapaxes(1, 2)
        q = self._rotate(q, pos).swapaxes(1, 2).astype(mx.float32)  # [1, 1, H, D]
        scores = mx.where(valid, index_scores(q, keys, w, self._D**-0.5)[0, 0], -mx.inf)
        idx = topk_indices(scores, self._topk)
        return idx, mx.take(valid, idx)


class KPoolIndexer(nn.Module):
    """GLM 5.3 Flash's k-pool DSA indexer (transformers' `Glm5NextTextIndexer`), NoPE."""

    def __init__(self, hidden: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int, kpool: int):
        super().__init__()
        if kpool < 1 or topk % kpool:
            raise ValueError("index_topk must be a positive multiple of index_kpool")
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)
        self.index_kpool_compress_ape = mx.zeros((kpool, head_dim))
        self.index_kpool_compress_gate = mx.ones((head_dim, hidden))
        self._H, self._D, self._kp, self._select = n_heads, head_dim, kpool, topk // kpool

    def _pool(self, k: mx.array, gate: mx.array, cache: MLACache, s: int) -> mx.array:
        """Feed a chunk's keys and gate logits [1, C, D] at positions s..; return every complete
        pool [1, P, D]."""
        kp, C = self._kp, k.shape[1]
        if cache.pool_k is None:
            cache.pool_k = mx.zeros((1, kp, self._D), k.dtype)
            cache.pool_gate = mx.zeros((1, kp, self._D), gate.dtype)
        b = s % kp
        if b:
            k = mx.concatenate([cache.pool_k[:, :b], k], axis=1)
            gate = mx.concatenate([cache.pool_gate[:, :b], gate], axis=1)
        n_new, rest = (b + C) // kp, (b + C) % kp
        if rest:
            cache.pool_k[:, :rest] = k[:, n_new * kp :]
            cache.pool_gate[:, :rest] = gate[:, n_new * kp :]
        pools = cache.rows["pools"]
        if n_new == 0:
            return pools.live() if pools.buf is not None else mx.zeros((1, 0, self._D), k.dtype)
        wk = k[:, : n_new * kp].reshape(1, n_new, kp, self._D)
        logits = gate[:, : n_new * kp].reshape(1, n_new, kp, self._D).astype(mx.float32)
        logits = logits + self.index_kpool_compress_ape.astype(mx.float32)
        p = mx.softmax(logits, axis=2, precise=True).astype(wk.dtype)
        return pools.append((p * wk).sum(axis=2))

    def project(self, x: mx.array, q_res: mx.array) -> tuple:
        """The projections of every query row at once (x, q_res [1, T, ..]), every kind: (normed
        keys [1, T, D], gate logits [1, T, D], queries [1, T, H * D], head weights [1, T, H])."""
        k = self.k_norm(self.wk(x))
        gate = x @ self.index_kpool_compress_gate.T.astype(x.dtype)
        return k, gate, self.wq_b(q_res), self.weights_proj(x).astype(mx.float32) * self._H**-0.5

    def step(self, k: mx.array, gate: mx.array, q: mx.array, w: mx.array, pos: mx.array, view, valid: mx.array):
        """`chunk` for one query row of a static forward at `pos` (array; its `project` outputs
        [1, 1, ..]) over its view: (None, token mask [cap]) over the latent capacity rows: the
        chosen pools' tokens plus the open pool's (the tail).  The open pool's row is written
        at pos // kpool whether complete or not."""
        kp = self._kp
        pools, pool_k, pool_gate = next(view), next(view), next(view)
        b = (pos % kp).reshape(1)
        pool_k = mx.slice_update(pool_k, k.astype(pool_k.dtype), b, axes=(1,))
        pool_gate = mx.slice_update(pool_gate, gate.astype(pool_gate.dtype), b, axes=(1,))
        logits = pool_gate[:, None].astype(mx.float32) + self.index_kpool_compress_ape.astype(mx.float32)
        p = mx.softmax(logits, axis=2, precise=True).astype(pool_k.dtype)
        row = (p * pool_k[:, None]).sum(axis=2)  # [1, 1, D]
        pools = mx.slice_update(pools, row.astype(pools.dtype), (pos // kp).reshape(1), axes=(1,))
        view.put(pools, pool_k, pool_gate)
        P = pools.shape[1]
        if P <= self._select:
            return None, valid
        q = q.reshape(1, 1, self._H, self._D).astype(mx.float32)
        visible = iota(P) < (pos + 1) // kp  # complete pools (iota: a kept constant, not a launch per token)
        scores = mx.where(visible, index_scores(q, pools, w, self._D**-0.5)[0, 0], -mx.inf)
        idx = topk_indices(scores, self._select)
        chosen = mx.put_along_axis(mx.zeros((P,), mx.bool_), idx, mx.take(visible, idx), axis=-1)
        tok = iota(valid.shape[0])
        pool_of = tok // kp
        in_chosen = mx.take(chosen, mx.minimum(pool_of, P - 1)) & (pool_of < P)
        tail = tok >= ((pos + 1) // kp) * kp
        return None, (in_chosen | tail) & valid

    def chunk(self, k: mx.array, gate: mx.array, q: mx.array, w: mx.array, cache: MLACache, s: int) -> Selection:
        """A PREFILL chunk's selection (its `project` outputs [1, C, ..]) at host position s, its
        keys pooled into the cache: dense while every visible pool fits in the selection, else
        each query's best pools plus its tail (a mask; one query: the key rows)."""
        B, C, _ = k.shape
        kp = self._kp
        pools = self._pool(k, gate, cache, s)
        P = pools.shape[1]
        if P <= self._select:  # every visible pool is picked, plus the tail: all causal keys
            return DENSE
        q = q.reshape(B, C, self._H, self._D).astype(mx.float32)
        scores = index_scores(q, pools, w, self._D**-0.5)[0]  # [C, P]
        if C == 1:  # one query (a one-token chunk): it sees every complete pool; gather their rows
            picked = topk_indices(scores[0], self._select)
            rows = (picked[:, None] * kp + mx.arange(kp)).reshape(-1)
            tail = mx.arange(P * kp, s + 1)
            return Selection(index=mx.concatenate([rows, tail]).astype(mx.int32))
        t = s + mx.arange(C)
        visible = mx.arange(P)[None] < ((t + 1) // kp)[:, None]  # [C, P]: the pool's last token is seen
        idx = topk_indices(mx.where(visible, scores, -mx.inf), self._select)
        chosen = mx.put_along_axis(mx.zeros((C, P), mx.bool_), idx, mx.array(True), axis=-1) & visible
        L = s + C
        tokens = mx.repeat(chosen, kp, axis=1)  # [C, P*kp]
        if L > P * kp:
            tokens = mx.concatenate([tokens, mx.zeros((C, L - P * kp), mx.bool_)], axis=1)
        j = mx.arange(L)[None]
        tail = (j >= (((t + 1) // kp) * kp)[:, None]) & (j <= t[:, None])
        return Selection(mask=tokens | tail)


# ----------------------------------------------------------------------------- attention


def absorbed_projections(layer: nn.Module, n_heads: int, nope: int):
    """kv_b_proj split per head for the absorbed form: (embed_q, unembed_out) with
    embed_q(x [.., nh, C, nope]) = x @ W_k[h]  -> [.., nh, C, lora] and
    unembed_out(y [.., nh, C, lora]) = y @ W_v[h]^T -> [.., nh, C, v],
    where kv_b_proj.weight = [W_k[h]; W_v[h]] per head.  A QuantizedLinear stays quantized
    (its groups run along lora, the contracted axis of both products or the kept one)."""
    if hasattr(layer, "scales"):
        kw = dict(group_size=layer.group_size, bits=layer.bits, mode=getattr(layer, "mode", "affine"))
        w = layer.weight.reshape(n_heads, -1, layer.weight.shape[-1])
        sc = layer.scales.reshape(n_heads, -1, layer.scales.shape[-1])
        b = getattr(layer, "biases", None)
        b = None if b is None else b.reshape(n_heads, -1, b.shape[-1])
        part = lambda a, lo, hi: None if a is None else a[:, lo:hi]
        n = w.shape[1]

        def embed_q(x):
            return mx.quantized_matmul(x, w[:, :nope], sc[:, :nope], part(b, 0, nope), transpose=False, **kw)

        def unembed_out(y):
            return mx.quantized_matmul(y, w[:, nope:], sc[:, nope:], part(b, nope, n), transpose=True, **kw)

        return embed_q, unembed_out
    W = layer.weight.reshape(n_heads, -1, layer.weight.shape[-1])
    return (lambda x: x @ W[:, :nope].astype(x.dtype)), (lambda y: y @ W[:, nope:].swapaxes(-1, -2).astype(y.dtype))


class MLAAttention(nn.Module):
    """MLA over an `MLACache`, sparse through `indexer` (None: a "shared" layer, or dense).

    `forward(x, ctx, prev, cache) -> (out, selection)` for every context kind: `prev` is the
    selection handed on by the previous layer (used when this layer has no indexer)."""

    # Chunks of more than this many queries use the expanded form (None: choose by cost).
    EXPAND_MIN_QUERIES: int | None = None

    def __init__(
        self,
        *,
        hidden: int,
        n_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        bias: bool,
        q_norm_eps: float,
        kv_norm_eps: float,
        scale: float,
        rope: RoPE | None,
        indexer: nn.Module | None,
    ):
        super().__init__()
        self._nh, self._lora = n_heads, kv_lora_rank
        self._nope, self._r, self._v = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self._scale, self._rope = scale, rope
        self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(q_lora_rank, q_norm_eps)
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * (qk_nope_head_dim + qk_rope_head_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, kv_norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(n_heads * v_head_dim, hidden, bias=bias)
        if indexer is not None:
            self.indexer = indexer
        self._has_indexer = indexer is not None

    def _expanded(self, C: int) -> bool:
        if self.EXPAND_MIN_QUERIES is not None:
            return C >= self.EXPAND_MIN_QUERIES
        nv, lora = self._nope + self._v, self._lora
        # per (query, key): absorbed ~ 2*lora + r, expanded ~ nope + r + v, plus nv*lora per key
        return C * max(1, 2 * lora - nv) > nv * lora

    def forward(self, x: mx.array, ctx, prev, cache: MLACache | None = None):
        """The attention of the query rows of `ctx` (runtime/forward_context.py `StepContext`;
        x [1, T, hidden]) -> (out [1, T, hidden], the selection handed on to the next layer).
        The projections, the indexer's too, run once for all rows.  PREFILL: one chunk of T
        queries at the host position cache.offset over the live `cache` (appended to), `prev`
        and the result a `Selection`.  DECODE / CHAIN: row t at ctx.row_pos[t] over the
        `MLACache.static_state` of ctx.views[t], branch-free in the positions; `prev` (None for
        none) and the result one selection (index [k] | None, valid) per row."""
        q_res = self.q_a_layernorm(self.q_a_proj(x))
        q, kv = self.q_b_proj(q_res), self.kv_a_proj_with_mqa(x)
        index_inputs = self.indexer.project(x, q_res) if self._has_indexer else ()
        if ctx.kind == PREFILL:
            out, sel = self._chunk(q, kv, index_inputs, cache, prev)
            return self.o_proj(out), sel
        prevs = [None] * ctx.rows if prev is None else prev
        outs, sels = [], []
        for row, pos, view, row_prev in zip(ctx.split(q, kv, *index_inputs), ctx.row_pos, ctx.views, prevs):
            out, sel = self._row(row[0], row[1], row[2:], pos, view, row_prev)
            outs.append(out)
            sels.append(sel)
        return self.o_proj(ctx.join(outs)), sels

    def _chunk(self, q, kv, index_inputs: tuple, cache: MLACache, prev: Selection | None):
        """A PREFILL chunk's attention (the q_b_proj / kv_a_proj outputs and the indexer's
        projections [1, C, ...]) over the live `cache`, its rows appended -> (out [1, C, nh * v]
        before o_proj, its selection)."""
        B, C, _ = kv.shape
        s = cache.offset
        nh, nope, r = self._nh, self._nope, self._r
        q = q.reshape(B, C, nh, nope + r).swapaxes(1, 2)  # [B, nh, C, nope+r]
        latents = cache.rows["latent"].append(self.kv_a_layernorm(kv[..., : self._lora]))  # [B, L, lora]
        q_rope = k_ropes = None
        if r:
            q_rope = self._rope(q[..., nope:], offset=s)
            k_ropes = cache.rows["k_rope"].append(self._rope(kv[..., self._lora :][:, None], offset=s)[:, 0])
        sel = self.indexer.chunk(*index_inputs, cache, s) if self._has_indexer else self._inherited(prev)
        mask = sel.mask
        if sel.index is None and mask is None and C > 1:
            mask = "causal" if s == 0 else causal_mask(s, C)
        return self._attend(q[..., :nope], q_rope, latents, k_ropes, sel.index, mask), sel

    def _row(self, q, kv, index_inputs: tuple, pos: mx.array, view, prev: tuple | None):
        """One query row's attention at `pos` (the q_b_proj / kv_a_proj outputs and the
        indexer's projections [1, 1, ...]) over its `view`, its rows written at `pos` -> (out
        [1, 1, nh * v] before o_proj, its selection)."""
        nh, nope, r = self._nh, self._nope, self._r
        at = pos.reshape(1)
        q = q.reshape(1, 1, nh, nope + r).swapaxes(1, 2)  # [1, nh, 1, nope+r]
        latents = next(view)
        latents = mx.slice_update(
            latents, self.kv_a_layernorm(kv[..., : self._lora]).astype(latents.dtype), at, axes=(1,)
        )
        view.put(latents)
        q_rope = k_ropes = None
        if r:
            q_rope = self._rope(q[..., nope:], offset=pos)
            k_ropes = next(view)
            k_new = self._rope(kv[..., self._lora :][:, None], offset=pos)[:, 0]
            k_ropes = mx.slice_update(k_ropes, k_new.astype(k_ropes.dtype), at, axes=(1,))
            view.put(k_ropes)
        valid = iota(latents.shape[1]) <= pos
        sel = self.indexer.step(*index_inputs, pos, view, valid) if self._has_indexer else self._inherited(prev)
        index, mask = sel
        return self._attend(q[..., :nope], q_rope, latents, k_ropes, index, mask[None]), sel

    def _inherited(self, prev):
        """A "shared" layer's selection: the previous layer's."""
        if prev is None:
            raise ValueError("a shared DSA layer needs the previous layer's selection")
        return prev

    def _attend(self, q_nope, q_rope, latents, k_ropes, index, mask):
        """The attention of queries q_nope [B, nh, C, nope] (q_rope [.., r] or None) over the
        latent rows [B, L, lora] and roped key rows, those at `index` only where given, under
        `mask` -> [B, C, nh * v]: expanded or absorbed by the query count (`_expanded`)."""
        B, nh, C, nope = q_nope.shape
        r = self._r
        if index is not None:
            latents = mx.take(latents, index, axis=1)
            if r:
                k_ropes = mx.take(k_ropes, index, axis=1)
        if self._expanded(C):
            L = latents.shape[1]
            kvb = self.kv_b_proj(latents).reshape(B, L, nh, nope + self._v).swapaxes(1, 2)
            keys, values = kvb[..., :nope], kvb[..., nope:]
            if r:
                keys = mx.concatenate([keys, mx.broadcast_to(k_ropes[:, None], (B, nh, L, r))], axis=-1)
                q_nope = mx.concatenate([q_nope, q_rope], axis=-1)
            out = mx.fast.scaled_dot_product_attention(q_nope, keys, values, scale=self._scale, mask=mask)
        else:  # absorbed: one shared latent head
            embed_q, unembed_out = absorbed_projections(self.kv_b_proj, nh, nope)
            queries = embed_q(q_nope)  # [B, nh, C, lora]
            keys = latents[:, None]
            if r:
                queries = mx.concatenate([queries, q_rope], axis=-1)
                keys = mx.concatenate([keys, k_ropes[:, None]], axis=-1)
            out = mx.fast.scaled_dot_product_attention(queries, keys, latents[:, None], scale=self._scale, mask=mask)
            out = unembed_out(out)  # [B, nh, C, v]
        if C == 1:  # [B, nh, 1, v] -> [B, 1, nh * v]: a reshape (MLX copies a transposed array it reshapes)
            return out.reshape(B, 1, nh * self._v)
        return out.swapaxes(1, 2).reshape(B, C, nh * self._v)
