"""The reference face of the manifold-constrained hyper-connections (mHC): plain MLX ops.

`hc_mix` / `hc_pre` / `hc_post` / `hc_head` with explicit parameters, `hc_collapse`,
and the Sinkhorn projection.  kernels/hyper_connection.py dispatches to these on the CPU
(and wherever its fused face does not apply); models call that module, never this one,
so every family gets the fused kernels on a GPU.  The tests and the kernel bench use
this module as the oracle.

Dtype policy: the mixing weights and Sinkhorn are float32; the collapse and `hc_post`
run in the streams' dtype.
"""

from __future__ import annotations

import mlx.core as mx

# Compile the Sinkhorn loop (shapeless) on GPUs, where its ~80 tiny ops are launch-bound.
# On the CPU backend mx.compile JIT-compiles C++ (seconds per new graph) for a <2x gain.
COMPILE_SINKHORN: bool | None = None  # None: only when the default device is a GPU
_compiled_sinkhorn: dict = {}


def sinkhorn(logits: mx.array, iters: int, eps: float) -> mx.array:
    """Doubly-stochastic projection of `[..., n, n]` (float32) as DeepSeek V4 does it.

    `softmax(rows) + eps`, then column-normalise, then `iters-1` times
    (row-normalise, column-normalise), each with `+eps` in the denominator.
    """
    use = COMPILE_SINKHORN
    if use is None:
        use = mx.default_device().type == mx.DeviceType.gpu
    if use:
        fn = _compiled_sinkhorn.get((iters, eps))
        if fn is None:
            fn = _compiled_sinkhorn[(iters, eps)] = mx.compile(
                lambda x: sinkhorn_reference(x, iters, eps), shapeless=True
            )
        return fn(logits)
    return sinkhorn_reference(logits, iters, eps)


def sinkhorn_reference(logits: mx.array, iters: int, eps: float) -> mx.array:
    """The plain-op Sinkhorn (see `sinkhorn`)."""
    comb = mx.softmax(logits, axis=-1, precise=True) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return comb


def hc_mix(
    x: mx.array,
    fn: mx.array,
    base: mx.array,
    scale: mx.array,
    *,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[mx.array, mx.array, mx.array]:
    """The mHC mixing weights of one block, all float32: (pre [..., n], post [..., n], comb [..., n, n]).

    x:     [..., n, d] residual streams (n = hc_mult)
    fn:    [(2+n)*n, n*d] projection, base: [(2+n)*n], scale: [3]
      mix = rms(flatten(x)) @ fn.T (float32)
      pre  = sigmoid(mix_pre  * scale0 + base_pre) + hc_eps
      post = 2 * sigmoid(mix_post * scale1 + base_post)
      comb = sinkhorn(mix_comb * scale2 + base_comb)
    """
    n = x.shape[-2]
    flat = x.reshape(*x.shape[:-2], -1).astype(mx.float32)
    mix = mx.fast.rms_norm(flat, None, norm_eps) @ fn.astype(mx.float32).T
    base = base.astype(mx.float32)
    scale = scale.astype(mx.float32)
    pre = mx.sigmoid(mix[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * mx.sigmoid(mix[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb_logits = mix[..., 2 * n :] * scale[2] + base[2 * n :]
    comb = sinkhorn(comb_logits.reshape(*comb_logits.shape[:-1], n, n), sinkhorn_iters, hc_eps)
    return pre, post, comb


def hc_collapse(x: mx.array, pre: mx.array) -> mx.array:
    """sum_i pre_i * x_i over the streams of x [..., n, d] (pre [..., n] float32), in x.dtype."""
    return (pre[..., None] * x).sum(axis=-2).astype(x.dtype)


def hc_pre(
    x: mx.array,
    fn: mx.array,
    base: mx.array,
    scale: mx.array,
    *,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[mx.array, mx.array, mx.array]:
    """Hyper-connection "pre" step (mHC) for one block: `hc_mix`, then collapse with its pre.

    returns (post [..., n] f32, comb [..., n, n] f32, collapsed [..., d] in x.dtype),
    collapsed = sum_i pre_i * x_i.
    """
    pre, post, comb = hc_mix(x, fn, base, scale, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, norm_eps=norm_eps)
    return post, comb, hc_collapse(x, pre)


def hc_post(x: mx.array, out: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """Hyper-connection "post" step: new_k = post_k * out + sum_j comb[j, k] * x_j.

    x: [..., n, d] streams entering the block, out: [..., d] block output.
    """
    dtype = x.dtype
    mixed = mx.swapaxes(comb.astype(dtype), -1, -2) @ x
    return post.astype(dtype)[..., None] * out[..., None, :] + mixed


def hc_head(x: mx.array, fn: mx.array, base: mx.array, scale: mx.array, *, hc_eps: float, norm_eps: float) -> mx.array:
    """Final collapse of the n streams: sum_i (sigmoid(mix_i*scale + base_i) + eps) * x_i."""
    flat = x.reshape(*x.shape[:-2], -1).astype(mx.float32)
    mix = mx.fast.rms_norm(flat, None, norm_eps) @ fn.astype(mx.float32).T
    pre = mx.sigmoid(mix * scale.astype(mx.float32) + base.astype(mx.float32)) + hc_eps
    return (pre[..., None] * x).sum(axis=-2).astype(x.dtype)
