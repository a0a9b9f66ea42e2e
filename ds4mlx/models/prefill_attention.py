"""Prefill attention of many queries: `mx.fast.scaled_dot_product_attention`,
or the same attention written as two batched GEMMs around a float32 softmax.

`DS4MLX_PREFILL_SDPA` picks it: `fast` calls MLX's fused op; `matmul` computes
``softmax([q k^T * scale | sink]) v`` with tensor-core GEMMs, for head dims and masks where
MLX's fused op has no fast kernel on a GPU (V4 Flash: head dim 512, a boolean band mask and
per-head sinks; one query per row over its own keys); `auto` (default): `matmul` on a GPU
(prefill at 8K / 32K 1.41x / 1.37x with the linears dequantized, docs/bench-history.md),
`fast` on the CPU.  Decode keeps its kernels.
"""

from __future__ import annotations

import os

import mlx.core as mx

ENV = "DS4MLX_PREFILL_SDPA"
MODES = ("auto", "fast", "matmul")


def mode() -> str:
    """The path this process takes ('fast' or 'matmul')."""
    m = os.environ.get(ENV, MODES[0]).strip().lower()
    if m not in MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(map(repr, MODES))}, not {m!r}")
    if m == "auto":
        return "fast" if mx.default_device().type == mx.DeviceType.cpu else "matmul"
    return m


def sdpa(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask=None, sinks=None) -> mx.array:
    """As `mx.fast.scaled_dot_product_attention(q, k, v, scale=, mask=, sinks=)` with a
    boolean (or absent) mask; q [..., H, Lq, D], k / v [..., Hk, Lk, D] with Hk 1 or H."""
    if mode() == "fast":
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
    return by_matmul(q, k, v, scale=scale, mask=mask, sinks=sinks)


def by_matmul(q, k, v, *, scale: float, mask=None, sinks=None) -> mx.array:
    heads_as_rows = q.ndim == 4 and q.shape[-2] == 1 and k.shape[-3] == 1
    if heads_as_rows:
        # one query per batch row over its own keys, one K=V head (V4's per-query prefill
        # attention): the H heads become the rows of one [H, D] x [D, Lk] GEMM per query,
        # not H mat-vecs that each read the keys (the fused op ran at 42 GB/s of keys)
        b, h, _, d = q.shape
        out = _softmax_attend(q.reshape(b, 1, h, d), k, v, scale, mask, sinks, (-1, 1))
        return out.reshape(b, h, 1, d)
    return _softmax_attend(q, k, v, scale, mask, sinks, (-1, 1, 1))


def _softmax_attend(q, k, v, scale, mask, sinks, sink_shape) -> mx.array:
    s = ((q * scale) @ k.swapaxes(-1, -2)).astype(mx.float32)  # [..., H, Lq, Lk]
    if mask is not None:
        s = mx.where(mask, s, -float("inf"))
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(mx.float32).reshape(sink_shape)  # one logit per head, no value
        m = mx.maximum(m, sink)
    p = mx.exp(s - m)
    den = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        den = den + mx.exp(sink - m)
    out = p.astype(v.dtype) @ v
    return (out.astype(mx.float32) / den).astype(q.dtype)
