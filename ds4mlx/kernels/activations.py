"""Activation references shared by the model graphs and the fused kernels' reference faces
(kernels import nothing from models/, so the SwiGLU both need lives here)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def clamped_swiglu(gate: mx.array, up: mx.array, limit: float | None) -> mx.array:
    """silu(min(gate, limit)) * clip(up, -limit, limit); no clamp when limit is None/0."""
    if limit:
        gate = mx.minimum(gate, limit)
        up = mx.clip(up, -limit, limit)
    return nn.silu(gate) * up


def rms_normed(x: mx.array, norm: tuple | None) -> mx.array:
    """``mx.fast.rms_norm(x, weight, eps)`` for norm = (weight, eps), the weight in x's dtype (as
    `models.layers.RMSNorm` runs it); x itself for None.  The reference face of every launch
    that folds an RMSNorm in (hc_pre, affine_qmv's NORM)."""
    return x if norm is None else mx.fast.rms_norm(x, norm[0].astype(x.dtype), norm[1])
