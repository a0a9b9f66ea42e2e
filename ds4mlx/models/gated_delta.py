"""Gated delta rule (Gated DeltaNet linear attention) and the causal depthwise conv in MLX.

Family-agnostic pieces of the linear-attention layers (Qwen3-Next / Qwen3.8 style):

* `l2_normalize(x, eps)`: `x * rsqrt(sum(x^2) + eps)` over the last axis (the FLA /
  transformers convention, eps inside the square root, added to the *sum*);
* `gated_delta(q, k, v, g, beta, state)`: the recurrence, per value head h,

      S_t = exp(g_t) * S_{t-1}
      S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T
      o_t = S_t^T q_t

  with grouped heads (value head h reads key/query head h // (Hv/Hk), as
  `repeat_interleave`).  It runs `mx.fast.gated_delta_update` (MLX >= 0.32; CPU, Metal
  and CUDA) and falls back to `gated_delta_reference` (plain ops, one step per token)
  when that is missing.  The state layout is the fast op's: [B, Hv, Dv, Dk], float32.
  q and k are taken as given: normalise and scale them before the call;
* `causal_conv1d(x, weight, state, dilation)`: depthwise causal convolution along time
  with a carried left context (the last `(K-1)*dilation` inputs), zero-initialised,
  exactly what a cached conv layer needs for both prefill chunks and 1-token decode
  (also KDA's short conv: `kda.short_conv`).
"""

from __future__ import annotations

import mlx.core as mx


def l2_normalize(x: mx.array, eps: float = 1e-6) -> mx.array:
    """x / sqrt(sum(x^2) + eps) over the last axis, computed in float32."""
    x = x.astype(mx.float32)
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def gated_delta_reference(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """The recurrence with plain ops (see module doc); shapes as `gated_delta`."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    if Hv != Hk:
        q = mx.repeat(q, Hv // Hk, axis=2)
        k = mx.repeat(k, Hv // Hk, axis=2)
    S = mx.zeros((B, Hv, Dv, Dk), mx.float32) if state is None else state.astype(mx.float32)
    decay = mx.exp(g.astype(mx.float32))
    outs = []
    for t in range(T):
        S = S * decay[:, t, :, None, None]
        kt = k[:, t].astype(mx.float32)[:, :, None, :]  # [B, Hv, 1, Dk]
        delta = (v[:, t].astype(mx.float32) - (S * kt).sum(-1)) * beta[:, t, :, None].astype(mx.float32)
        S = S + delta[..., None] * kt
        outs.append((S * q[:, t].astype(mx.float32)[:, :, None, :]).sum(-1))
    return mx.stack(outs, axis=1), S


def gated_delta(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """Gated delta rule over a chunk.

    q, k [B, T, Hk, Dk] (already normalised / scaled), v [B, T, Hv, Dv],
    g [B, T, Hv] log-decay (<= 0), beta [B, T, Hv], state [B, Hv, Dv, Dk] float32 or None.
    Returns (out [B, T, Hv, Dv] float32, new state [B, Hv, Dv, Dk] float32).
    """
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), mx.float32)
    fast = getattr(mx.fast, "gated_delta_update", None)
    if fast is None:
        return gated_delta_reference(q, k, v, g, beta, state)
    f32 = mx.float32
    out, new_state = fast(
        q.astype(f32), k.astype(f32), v.astype(f32), mx.exp(g.astype(f32)), beta.astype(f32), state.astype(f32)
    )
    return out, new_state


def causal_conv1d(
    x: mx.array, weight: mx.array, state: mx.array | None = None, dilation: int = 1, dtype=None
) -> tuple[mx.array, mx.array]:
    """Depthwise causal conv along time with a carried left context.

    x [B, T, C], weight [C, K] (tap 0 is the oldest input), state [B, (K-1)*dilation, C]
    (the previous inputs, zeros when None).  y_t = sum_j weight[:, j] * in[t - (K-1-j)*dilation],
    computed in `dtype` (x's dtype when None).
    Returns (y [B, T, C] in that dtype, new state: the last (K-1)*dilation inputs, x's dtype).
    """
    B, T, C = x.shape
    K = weight.shape[-1]
    S = (K - 1) * dilation
    if state is None:
        state = mx.zeros((B, S, C), x.dtype)
    full = mx.concatenate([state.astype(x.dtype), x], axis=1) if S else x
    dtype = x.dtype if dtype is None else dtype
    inp = full if full.dtype == dtype else full.astype(dtype)
    w = weight.astype(dtype)
    y = inp[:, 0:T] * w[:, 0]
    for j in range(1, K):
        y = y + inp[:, j * dilation : j * dilation + T] * w[:, j]
    return y, full[:, full.shape[1] - S :]
