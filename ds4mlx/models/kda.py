"""Kimi delta attention (KDA): the gated delta rule with a per-channel forget gate, in MLX.

Family-agnostic pieces of a KDA linear-attention layer (GLM 5.3 Flash, Kimi Linear):

* `short_conv(x, weight, state)`: depthwise causal convolution along time with a carried
  left context of `K-1` inputs (zeros at the start) and SiLU, for prefill chunks and
  1-token decode alike (`gated_delta.causal_conv1d` computed in float32);
* `l2norm(x, eps)`: `x / sqrt(sum(x^2) + eps)` (the FLA / transformers KDA convention);
* the recurrence, per head, with `S` a [Dk, Dv] matrix and `g_t` a per-key-channel log decay:

      S_t = diag(exp(g_t)) S_{t-1}
      S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T
      o_t = S_t^T q_t

  `kda_recurrent` runs it one token at a time (decode); `kda_chunked` runs the equivalent
  chunked ("WY") form used for prefill: inside a chunk of n tokens everything is dense
  matrix algebra (the n x n unit-triangular intra-chunk system is solved by forward
  substitution, batched over heads and chunks), only the state is carried from chunk to
  chunk.  The per-channel decay makes the intra-chunk products [n, n, Dk] tensors;
  chunks are processed in groups to bound that memory;
* `LinearCache`: the per-layer session state (conv context + recurrent state).

A scalar (per-head) gate, as in Gated DeltaNet, is the special case `g [B, T, H, 1]`.
Everything is computed in float32; q and k must already be normalised and q scaled.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .gated_delta import causal_conv1d

CHUNK = 64  # tokens per chunk of the chunked form


def l2norm(x: mx.array, eps: float = 1e-6) -> mx.array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32."""
    x = x.astype(mx.float32)
    return x / mx.sqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def short_conv(x: mx.array, weight: mx.array, state: mx.array | None) -> tuple[mx.array, mx.array]:
    """Depthwise causal conv (computed in float32) + SiLU.

    x [B, C, Ch], weight [Ch, 1, K] (torch Conv1d layout), state [B, K-1, Ch] (the
    previous K-1 inputs, None = zeros).  Returns (silu(conv) [B, C, Ch] in x.dtype,
    the new state [B, K-1, Ch])."""
    Ch, K = x.shape[-1], weight.shape[-1]
    out, new_state = causal_conv1d(x, weight.reshape(Ch, K), state, dtype=mx.float32)
    return nn.silu(out).astype(x.dtype), new_state


def kda_recurrent(q, k, v, g, beta, state):
    """Token-by-token recurrence.

    q, k [B, T, H, Dk] (normalised; q scaled), v [B, T, H, Dv], g [B, T, H, Dk or 1] (log
    decay), beta [B, T, H], state [B, H, Dk, Dv] float32 or None.
    Returns (o [B, T, H, Dv] float32, state [B, H, Dk, Dv] float32)."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    S = mx.zeros((B, H, Dk, Dv), mx.float32) if state is None else state.astype(mx.float32)
    q, k, v, g, beta = (a.astype(mx.float32) for a in (q, k, v, g, beta))
    decay = mx.exp(g)
    outs = []
    for t in range(T):
        S = S * decay[:, t, :, :, None]
        kt = k[:, t, :, :, None]  # [B, H, Dk, 1]
        delta = (v[:, t] - (S * kt).sum(axis=-2)) * beta[:, t, :, None]  # [B, H, Dv]
        S = S + kt * delta[:, :, None, :]
        outs.append((S * q[:, t, :, :, None]).sum(axis=-2))
    return mx.stack(outs, axis=1), S


def _unit_lower_inverse(A: mx.array) -> mx.array:
    """(I + A)^-1 for strictly lower-triangular A [..., n, n], by forward substitution one row
    at a time (batched over the leading axes).  Stable where power series are not: with
    strongly correlated keys the entries of A^m grow like binomial coefficients."""
    n = A.shape[-1]
    N = -A
    T = N  # strictly lower; row i is final once updated (it only reads rows < i)
    for i in range(1, n):
        row = N[..., i : i + 1, :]
        T[..., i : i + 1, :] = row + row @ T
    return T + mx.eye(n, dtype=A.dtype)


GROUP_ELEMS = 1 << 26  # chunks are solved in groups of at most this many decay-tensor floats


def kda_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The chunked form of `kda_recurrent` (same arguments and results).

    The sequence is cut into chunks of `chunk` tokens (zero-padded at the end: padded
    tokens have beta = 0 and no decay, so they change nothing); the intra-chunk systems of
    a group of chunks are solved together, then the state is carried chunk by chunk."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    S = mx.zeros((B, H, Dk, Dv), mx.float32) if state is None else state.astype(mx.float32)
    n = min(chunk, T)
    pad = -T % n
    Dg = g.shape[-1]

    def prep(a, d):  # [B, T, H, d] -> [B, H, nc, n, d] float32, zero-padded
        a = a.astype(mx.float32)
        if pad:
            a = mx.concatenate([a, mx.zeros((B, pad, H, d), mx.float32)], axis=1)
        return a.swapaxes(1, 2).reshape(B, H, -1, n, d)

    q, k, v, g = prep(q, Dk), prep(k, Dk), prep(v, Dv), prep(g, Dg)
    beta = prep(beta[..., None], 1)
    nc = q.shape[2]
    i = mx.arange(n)
    incl = i[:, None] >= i[None, :]  # j <= i
    strict = i[:, None] > i[None, :]
    step = max(1, GROUP_ELEMS // (B * H * n * n * max(Dk, Dg)))
    outs = []
    for c0 in range(0, nc, step):
        sl = slice(c0, min(nc, c0 + step))
        qc, kc, vc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl]
        G = mx.cumsum(g[:, :, sl], axis=3)  # [B, H, c, n, Dk or 1]
        diff = mx.where(incl[:, :, None], G[..., :, None, :] - G[..., None, :, :], -mx.inf)
        decay = mx.exp(diff)  # [B, H, c, n(i), n(j), Dk or 1]
        kbeta = kc * bc
        A_kk = mx.where(strict, ((kbeta[..., :, None, :] * decay) * kc[..., None, :, :]).sum(axis=-1), 0.0)
        Tm = _unit_lower_inverse(A_kk)
        u = Tm @ (vc * bc)  # [B, H, c, n, Dv]
        w = Tm @ (kbeta * mx.exp(G))  # [B, H, c, n, Dk]
        A_qk = mx.where(incl, ((qc[..., :, None, :] * decay) * kc[..., None, :, :]).sum(axis=-1), 0.0)
        q_decay = qc * mx.exp(G)
        G_last = G[..., n - 1 :, :]  # [B, H, c, 1, Dk or 1]
        k_decay = kc * mx.exp(G_last - G)
        last = mx.exp(G_last).swapaxes(-1, -2)  # [B, H, c, Dk or 1, 1]
        for j in range(qc.shape[2]):
            v_new = u[:, :, j] - w[:, :, j] @ S
            outs.append(q_decay[:, :, j] @ S + A_qk[:, :, j] @ v_new)
            S = S * last[:, :, j] + k_decay[:, :, j].swapaxes(-1, -2) @ v_new
    o = mx.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]  # [B, H, nc*n, Dv]
    return o[:, :, :T].swapaxes(1, 2), S


def kda(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Recurrent form for a single token (decode), chunked form otherwise (prefill)."""
    if q.shape[1] == 1:
        return kda_recurrent(q, k, v, g, beta, state)
    return kda_chunked(q, k, v, g, beta, state, chunk)


class LinearCache:
    """Session state of one linear-attention layer.

    conv       [1, K-1, conv_dim]  the last K-1 inputs of the short conv (model dtype)
    recurrent  [1, H, Dk, Dv]      the delta-rule state (float32)
    Both are None until the first token; `offset` counts the tokens seen."""

    kind = "linear"

    def __init__(self):
        self.offset = 0
        self.conv = None
        self.recurrent = None

    # -- static decode layout (the compiled step, ds4mlx/runtime/stepper.py) ---------------------
    def static_state(self, dtype, ahead: int = 1) -> list[mx.array]:
        """[conv, recurrent]: fixed-size already, whatever positions ahead; the family
        creates them (zeros, what None means) before the first step."""
        if self.conv is None:
            raise ValueError("linear-attention state not created yet")
        return [self.conv, self.recurrent]

    def static_mark(self) -> tuple:
        """(recurrent state, offset): as `MLACache.static_mark` (`Session.keep_verified`)."""
        return self.recurrent, self.offset

    def commit_static(self, arrays, advance: int = 1) -> None:
        self.conv, self.recurrent = next(arrays), next(arrays)
        self.offset += advance

    @property
    def state(self) -> dict:
        if self.conv is None:
            return {}
        return {"conv": self.conv, "recurrent": self.recurrent}

    @property
    def meta_state(self) -> dict:
        return {"type": self.kind, "offset": self.offset}

    def load(self, meta: dict, arrays: dict) -> None:
        if meta.get("type") != self.kind:
            raise ValueError("layer cache layout mismatch")
        if set(arrays) not in (set(), {"conv", "recurrent"}):
            raise ValueError(f"unexpected linear-attention cache arrays {sorted(arrays)}")
        self.offset = int(meta["offset"])
        self.conv = arrays.get("conv")
        self.recurrent = arrays.get("recurrent")
        if (self.conv is None) != (self.offset == 0):
            raise ValueError("linear-attention cache state does not match its offset")

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state.values())
