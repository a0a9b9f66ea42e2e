"""Kimi delta attention (KDA): the gated delta rule with a per-channel forget gate, in MLX.

Family-agnostic pieces of a KDA linear-attention layer (GLM 5.3 Flash, Kimi Linear):

* `short_conv(x, weight, state)`: depthwise causal convolution along time with a carried
  left context of `K-1` inputs (zeros at the start) and SiLU, for prefill chunks and
  1-token decode alike;
* `l2norm(x, eps)`: `x / sqrt(sum(x^2) + eps)` (the FLA / transformers KDA convention);
* the recurrence, per head, with `S` a [Dk, Dv] matrix and `g_t` a per-key-channel log decay:

      S_t = diag(exp(g_t)) S_{t-1}
      S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T
      o_t = S_t^T q_t

  `kda_recurrent` runs it one token at a time (decode); `kda_chunked` runs the equivalent
  chunked ("WY") form used for prefill: inside a chunk of n tokens everything is dense
  matrix algebra (an n x n intra-chunk system solved by a product of log2(n) doublings),
  only the state is carried from chunk to chunk;
* `LinearCache`: the per-layer session state (conv context + recurrent state).

A scalar (per-head) gate, as in Gated DeltaNet, is the special case `g [B, T, H, 1]`.
Everything is computed in float32; q and k must already be normalised and q scaled.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

CHUNK = 64  # tokens per chunk of the chunked form


def l2norm(x: mx.array, eps: float = 1e-6) -> mx.array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32."""
    x = x.astype(mx.float32)
    return x / mx.sqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def short_conv(x: mx.array, weight: mx.array, state: mx.array | None) -> tuple[mx.array, mx.array]:
    """Depthwise causal conv + SiLU.

    x [B, C, Ch], weight [Ch, 1, K] (torch Conv1d layout), state [B, K-1, Ch] (the
    previous K-1 inputs, None = zeros).  Returns (silu(conv) [B, C, Ch] in x.dtype,
    the new state [B, K-1, Ch])."""
    B, C, Ch = x.shape
    K = weight.shape[-1]
    if state is None:
        state = mx.zeros((B, K - 1, Ch), x.dtype)
    full = mx.concatenate([state.astype(x.dtype), x], axis=1)  # [B, K-1+C, Ch]
    w = weight.reshape(Ch, K).astype(mx.float32)
    out = full[:, 0:C].astype(mx.float32) * w[:, 0]
    for j in range(1, K):
        out = out + full[:, j : j + C].astype(mx.float32) * w[:, j]
    new_state = full[:, full.shape[1] - (K - 1) :] if K > 1 else full[:, :0]
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


def _unit_lower_inverse(N: mx.array) -> mx.array:
    """(I - N)^-1 for strictly lower-triangular N [..., n, n]: the product
    (I + N)(I + N^2)(I + N^4)... (N is nilpotent, N^n = 0)."""
    n = N.shape[-1]
    eye = mx.eye(n, dtype=N.dtype)
    T = eye + N
    P = N
    span = 2
    while span < n:
        P = P @ P
        T = T + T @ P
        span *= 2
    return T


def kda_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The chunked form of `kda_recurrent` (same arguments and results)."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    S = mx.zeros((B, H, Dk, Dv), mx.float32) if state is None else state.astype(mx.float32)
    # [B, H, T, D] layout, float32
    q, k, v = (a.astype(mx.float32).swapaxes(1, 2) for a in (q, k, v))
    g = mx.broadcast_to(g.astype(mx.float32), (B, T, H, g.shape[-1])).swapaxes(1, 2)
    beta = beta.astype(mx.float32).swapaxes(1, 2)[..., None]  # [B, H, T, 1]
    outs = []
    for c0 in range(0, T, chunk):
        n = min(chunk, T - c0)
        qc, kc, vc, bc = q[:, :, c0 : c0 + n], k[:, :, c0 : c0 + n], v[:, :, c0 : c0 + n], beta[:, :, c0 : c0 + n]
        G = mx.cumsum(g[:, :, c0 : c0 + n], axis=2)  # [B, H, n, Dk or 1]
        i = mx.arange(n)
        incl = i[:, None] >= i[None, :]  # j <= i
        diff = mx.where(incl[:, :, None], G[:, :, :, None, :] - G[:, :, None, :, :], -mx.inf)
        decay = mx.exp(diff)  # [B, H, n(i), n(j), Dk or 1]
        kbeta = kc * bc
        A_kk = ((kbeta[:, :, :, None, :] * decay) * kc[:, :, None, :, :]).sum(axis=-1)
        A_kk = mx.where(i[:, None] > i[None, :], A_kk, 0.0)  # strictly lower
        Tm = _unit_lower_inverse(-A_kk)  # (I + A_kk)^-1
        u = Tm @ (vc * bc)  # [B, H, n, Dv]
        w = Tm @ (kbeta * mx.exp(G))  # [B, H, n, Dk]
        A_qk = ((qc[:, :, :, None, :] * decay) * kc[:, :, None, :, :]).sum(axis=-1)
        A_qk = mx.where(incl, A_qk, 0.0)
        v_new = u - w @ S
        outs.append((qc * mx.exp(G)) @ S + A_qk @ v_new)
        G_last = G[:, :, n - 1 : n]  # [B, H, 1, Dk or 1]
        S = S * mx.exp(G_last).swapaxes(-1, -2) + (kc * mx.exp(G_last - G)).swapaxes(-1, -2) @ v_new
    o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    return o.swapaxes(1, 2), S


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
