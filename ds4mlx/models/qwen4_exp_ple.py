"""Qwen3.8 Flash Next (transformers `qwen4_exp`) Per-Layer Embeddings: hashed n-gram
embeddings injected into every hyper-connection stream of a few linear-attention layers.

For PLE layer number p (0-based among `ple_layer_ids`) and n-gram orders 2..N
(`ngram_size` = N), each order has `heads_per_ngram` hash heads.  A token's n-gram of
order m is the token and its m-1 predecessors *within the current document*: the
context resets after an EOS token (a predecessor at or before an EOS in between is
replaced by EOS, and so is anything before the start of the sequence).  The hash is

    mix = tok_0 * mult_0  XOR  tok_1 * mult_1  XOR ... XOR  tok_{m-1} * mult_{m-1}   (int64)
    id  = mix mod size[head] + offset[head]

where the odd multipliers come from splitmix64 of (seed + 10007 p) and are small enough
(<= 2^63 / vocab) that no product wraps; `size[head]` is the next prime after
`ngram_vocab_size_base - 1`, continuing head after head and PLE layer after PLE layer.
The multipliers / sizes / offsets are derived from the config here (the checkpoint's
int64 buffers are checked against them and dropped by `Model.sanitize`).

The PLE block itself: per-stream gates from the normalised n-gram keys and the
normalised hidden streams, a shared value, then a dilated (dilation N) depthwise
causal conv over the normalised gated values with SiLU.

Cache state of a PLE layer: the last N-1 token ids (EOS-filled at the start) and the
conv's last (kernel-1)*N inputs.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from .gated_delta import causal_conv1d

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_LAYER_STRIDE = 10007


def splitmix64(x: int) -> int:
    """One splitmix64 output for the state `x` (Python ints, 64-bit wraparound)."""
    z = (x + _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The `ngram_size` odd hash multipliers of PLE layer `ple_index` (each <= 2^63 / vocab)."""
    bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _LAYER_STRIDE * ple_index
    return [2 * (splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % bound) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def head_tables(base: int, heads: int, ple_index: int) -> tuple[list[int], list[int]]:
    """(sizes, offsets) of the `heads` hash heads of PLE layer `ple_index`: consecutive
    primes after base-1, skipping the ones taken by the earlier PLE layers."""
    p, sizes = base - 1, []
    for i in range(ple_index * heads + heads):
        p += 1
        while not _is_prime(p):
            p += 1
        if i >= ple_index * heads:
            sizes.append(p)
    offsets = [sum(sizes[:i]) for i in range(heads)]
    return sizes, offsets


def shifted_context(full: mx.array, ngram_size: int, eos: int) -> list[mx.array]:
    """For `full` = [history (N-1 ids) | T current ids] (int64 [B, N-1+T]), the current ids
    shifted right by 0..N-1 within their document: entry s of position t is the id s
    tokens back, or EOS when an EOS lies strictly between (or that id is itself EOS)."""
    ctx = ngram_size - 1
    T = full.shape[1] - ctx
    cur = full[:, ctx:]
    out, clean = [cur], None  # clean: no EOS among the s-1 tokens just before t
    for s in range(1, ngram_size):
        prev = full[:, ctx - s : ctx - s + T]
        if s > 1:
            between = full[:, ctx - s + 1 : ctx - s + 1 + T] != eos
            clean = between if clean is None else clean & between
        out.append(prev if clean is None else mx.where(clean, prev, mx.array(eos, full.dtype)))
    return out


class NGramEmbedding(nn.Module):
    """Hashed n-gram ids -> concatenated head embeddings [..., ple_embed_dim]."""

    def __init__(self, args, ple_index: int):
        super().__init__()
        n, hpn = args.ngram_size, args.heads_per_ngram
        heads = (n - 1) * hpn
        sizes, offsets = head_tables(args.ngram_vocab_size_base, heads, ple_index)
        div = args.make_ngram_vocab_size_divisible_by
        rows = -(-sum(sizes) // div) * div
        if rows > 2**31 - 1:
            raise ValueError("n-gram table too large for int32 row ids")
        self.ngram_embedding = nn.Embedding(rows, args.ple_embed_dim // heads)
        self._n, self._hpn, self._eos = n, hpn, args.eos_id
        self._mult_list = layer_multipliers(args.vocab_size, n, ple_index, args.seed)
        self._sizes_list, self._offsets_list = sizes, offsets
        self._mult = mx.array(self._mult_list, mx.int64)
        self._sizes = mx.array(sizes, mx.int64)
        self._offsets = mx.array(offsets, mx.int64)

    def buffers(self) -> dict:
        """The checkpoint's int64 buffers (as transformers stores them) for this layer."""
        return {
            "layer_multipliers": self._mult_list,
            "ngram_heads_vocab_sizes": self._sizes_list,
            "ngram_heads_offsets": self._offsets_list,
        }

    def ids(self, full: mx.array) -> mx.array:
        """Row ids [B, T, heads] (int32) for `full` = [history | current] int64 ids."""
        toks = shifted_context(full, self._n, self._eos)
        mixed = toks[0] * self._mult[0]
        blocks = []
        for m in range(2, self._n + 1):
            mixed = mx.bitwise_xor(mixed, toks[m - 1] * self._mult[m - 1])
            hs = slice((m - 2) * self._hpn, (m - 1) * self._hpn)
            blocks.append(mx.remainder(mixed[..., None], self._sizes[hs]) + self._offsets[hs])
        return mx.concatenate(blocks, axis=-1).astype(mx.int32)

    def __call__(self, full: mx.array) -> mx.array:
        e = self.ngram_embedding(self.ids(full))  # [B, T, heads, d]
        return e.reshape(*e.shape[:-2], -1)


class DepthwiseConvWeight(nn.Module):
    """Holds a depthwise conv weight in transformers' nn.Conv1d layout [C, 1, K]."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = mx.zeros((channels, 1, kernel))

    @property
    def taps(self) -> mx.array:
        return self.weight[:, 0, :]


def grouped_rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """Per-stream RMSNorm of x [..., hc, H] with a (1 + w) weight w [hc*H] (float32 math)."""
    hc, H = x.shape[-2:]
    y = mx.fast.rms_norm(x.astype(mx.float32), None, eps) * (1.0 + weight.astype(mx.float32).reshape(hc, H))
    return y.astype(x.dtype)


class GroupedNorm(nn.Module):
    def __init__(self, hc: int, hidden: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((hc * hidden,))
        self._eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return grouped_rms_norm(x, self.weight, self._eps)


class PLELayer(nn.Module):
    """`ple` of a decoder layer: returns the [B, T, hc, H] addition to the streams."""

    def __init__(self, args, ple_index: int):
        super().__init__()
        hc, H, E = args.hc_count, args.hidden_size, args.ple_embed_dim
        self.ple_embedding = NGramEmbedding(args, ple_index)
        self.key_proj = nn.Linear(E, hc * H, bias=False)
        self.value_proj = nn.Linear(E, H, bias=False)
        self.norm_key = GroupedNorm(hc, H, args.rms_norm_eps)
        self.norm_query = GroupedNorm(hc, H, args.rms_norm_eps)
        self.norm_conv = GroupedNorm(hc, H, args.rms_norm_eps)
        self.conv1d = DepthwiseConvWeight(hc * H, args.ple_conv_kernel_size)
        self._hc, self._H, self._n = hc, H, args.ngram_size
        self._eos = args.eos_id

    def __call__(self, x: mx.array, ids: mx.array, cache) -> mx.array:
        B, T = ids.shape
        hist = cache.ngram
        if hist is None:
            hist = mx.full((B, self._n - 1), self._eos, mx.int32)
        full = mx.concatenate([hist.astype(mx.int32), ids.astype(mx.int32)], axis=1)
        cache.ngram = full[:, full.shape[1] - (self._n - 1) :]
        # [B, T, E] in the stream's dtype: a 16-bit table must not set the branch's (dtype_policy)
        emb = self.ple_embedding(full.astype(mx.int64)).astype(x.dtype)
        hc, H = self._hc, self._H
        key = self.norm_key(self.key_proj(emb).reshape(B, T, hc, H))
        value = self.value_proj(emb)  # [B, T, H]
        query = self.norm_query(x)
        gate = (key.astype(mx.float32) * query.astype(mx.float32)).sum(-1, keepdims=True) / math.sqrt(H)
        gate = mx.sqrt(mx.maximum(mx.abs(gate), 1e-6)) * mx.sign(gate)
        gated = (mx.sigmoid(gate).astype(x.dtype) * value[..., None, :]).astype(x.dtype)  # [B, T, hc, H]
        normed = self.norm_conv(gated).reshape(B, T, hc * H)
        conv, cache.ple_conv = causal_conv1d(normed, self.conv1d.taps, cache.ple_conv, dilation=self._n)
        return gated + nn.silu(conv).reshape(B, T, hc, H)
