"""A dense affine mat-vec whose output ends an mHC site, and the next site's start, in one launch.

At decode the output projection of a V4 attention (o_b) is followed by `hc_post_pre`: the
hyper-connection post of that site and the next site's pre (one launch on CUDA, the tail
`hc_post_dots_pre`).  Both read the mat-vec's output o elementwise (hc_post) and reduce
over it (the next site's dot products), so the mat-vec's threadgroups can do that work for
the rows they computed: each writes its rows of the new streams and its partial dot products,
and the threadgroup of a token that counts itself last runs the site's hc_pre work
(hyper_connection.metal `pre_core`).  One launch per layer instead of two.

``qmv_hc_post_pre(x, w, scales, biases, streams, post, comb, fn, base, scale, *, group_size,
bits, sinkhorn_iters, hc_eps, norm_eps, norm=None)``
    = ``hc_post_pre(streams, qmv(x, w, ...), post, comb, fn, base, scale, ..., norm=norm)``:
    (new streams, post', comb', collapsed' [through `norm`]).

The text: affine_qmv.metal's plain kernel (MODE 0, one dense matrix, its multi-row plan for
several tokens), then its `qmv_hc` section with hyper_connection.metal's `pre_core` inside.
The mat-vec and hc_post round as the two kernels they replace; the dot products of the next
site add in another order (per threadgroup over its strided rows, then over the threadgroups).
CUDA only, as the mHC tails (`hyper_connection._tail`: Metal's device-scope fence has run
nowhere, and the read-back of the threadgroup's own output rows relies on CUDA's block
barrier ordering device memory).  The reference face, and every case the launch does not
take, is the two calls.

Verified: the shared text compiled with g++ (emulated threadgroups) against the reference,
and the CUDA translation unit with nvcc (tests/test_kernel_qmv_hc.py).  Its GPU face has not
run yet: "qmv_hc" is in `dispatch.UNVERIFIED_KERNELS` and self-tests at first use.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from ds4mlx.kernels import affine_qmv as aq
from ds4mlx.kernels import hyper_connection as hck
from ds4mlx.kernels.dispatch import INDEX, PRELUDE, Kernel, auto_face, close_enough, compact, sections, tickets

TICKETS = "qmv_hc.tail"
INPUTS = ["x", "w", "scales", "biases", "eids", "wts", "lim", "nw", "hx", "post", "comb", "fn", "base", "scale"]
INPUTS += ["eps", "tickets"]
OUTPUTS = ["y", "ys", "part", "pre", "post2", "comb2", "hn"]


def shared_text() -> tuple[str, str]:
    """(header, body) without the face's prelude and index block: both files' `common`
    sections; the plain mat-vec, then `qmv_hc` with `pre_core` in its place."""
    q, h = sections(aq.SOURCE), sections(hck.SOURCE)
    body = aq.qmv_text() + q["qmv_hc"].replace("DS4_QMV_HC_PRE_CORE", h["pre_core"])
    return compact(q["common"] + h["common"]), compact(body)


def kernel_sources(face: str) -> tuple[str, str]:
    header, body = shared_text()
    return PRELUDE[face] + header, INDEX[face] + body


@cache
def _kernel() -> Kernel:
    return Kernel("ds4mlx_affine_qmv_hc", INPUTS, OUTPUTS, metal=kernel_sources("metal"), cuda=kernel_sources("cuda"))


@cache
def _eps(hc_eps: float, norm_eps: float, rms_eps: float) -> mx.array:
    """pre_core's eps input (hc_eps, norm_eps, the folded norm's eps): a constant, evaluated
    once (a lazy one would be replayed inside every compiled step)."""
    a = mx.array([hc_eps, norm_eps, rms_eps], dtype=mx.float32)
    mx.eval(a)
    return a


def _two_calls(x, w, scales, biases, streams, post, comb, fn, base, scale, *, group_size, bits, backend, **site):
    o = aq.qmv(x, w, scales, biases, group_size=group_size, bits=bits, backend=backend)
    return hck.hc_post_pre(streams, o, post, comb, fn, base, scale, backend=backend, **site)


def _takes(face: str, x, w, biases, streams, fn, group_size: int, bits: int) -> bool:
    n, d = streams.shape[-2], streams.shape[-1]
    rows = x.size // max(x.shape[-1], 1)
    return (
        face == "cuda"
        and biases is not None
        and w.ndim == 2
        and w.shape[0] == d
        and x.dtype == streams.dtype
        and 1 <= rows <= min(aq.MAX_ROWS, hck.SPLIT_TOKENS)
        and streams.size == rows * n * d
        and 1 <= n <= hck.MAX_HC
        and fn.shape == ((2 + n) * n, n * d)
        and aq.supported(x.shape[-1], group_size, bits, face)
    )


def qmv_hc_post_pre(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    streams: mx.array,
    post: mx.array,
    comb: mx.array,
    fn: mx.array,
    base: mx.array,
    scale: mx.array,
    *,
    group_size: int,
    bits: int,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    norm: tuple | None = None,
    backend: str | None = None,
):
    """``hc_post_pre(streams, qmv(x, w, scales, biases), post, comb, fn, base, scale, ...)``
    -> (new streams [..., n, d], post', comb', collapsed' (through `norm` = (weight, eps)));
    x [..., K] one row per token of streams [..., n, d].  One launch on CUDA (see the module)."""
    site = dict(sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, norm_eps=norm_eps, norm=norm)
    args = (x, w, scales, biases, streams, post, comb, fn, base, scale)
    face = backend if backend is not None else auto_face("qmv_hc", _self_test)
    if not (_takes(face, x, w, biases, streams, fn, group_size, bits) and sinkhorn_iters >= 1):
        return _two_calls(*args, group_size=group_size, bits=bits, backend=backend, **site)
    return _launch(face, *args, group_size=group_size, bits=bits, **site)


def fused_face(x, w, biases, streams, fn, *, group_size: int, bits: int) -> str | None:
    """The face an automatic `qmv_hc_post_pre` of these arguments launches as one kernel, or
    None (it would run the two calls): lets a caller keep its own mat-vec otherwise."""
    face = auto_face("qmv_hc", _self_test)
    return face if _takes(face, x, w, biases, streams, fn, group_size, bits) else None


def _launch(face, x, w, scales, biases, streams, post, comb, fn, base, scale, *, group_size, bits, **site):
    sinkhorn_iters, hc_eps, norm_eps, norm = (site[k] for k in ("sinkhorn_iters", "hc_eps", "norm_eps", "norm"))
    n, d = streams.shape[-2], streams.shape[-1]
    lead = streams.shape[:-2]
    k_dim, rows = x.shape[-1], x.size // x.shape[-1]
    pl = aq.rows_plan(rows, d, k_dim, bits, x.dtype, face) if rows > 1 else None
    if pl is None:
        pl = aq.plan(0, d, k_dim, bits, rows, x_dtype=x.dtype, face=face)
    m = (2 + n) * n
    nw = norm[0].astype(x.dtype) if norm is not None else aq.const_input("wts")
    eps = _eps(float(hc_eps), float(norm_eps), float(norm[1]) if norm is not None else 0.0)
    qmv_t = aq.template(
        0, pl, x.dtype, scales.dtype, n_rows=d, k_dim=k_dim, group_size=group_size, bits=bits, dense=True, x_rows=rows
    )
    hc_t = [("TP", post.dtype), ("TC", comb.dtype), ("TW", fn.dtype), ("TB", base.dtype), ("TSC", scale.dtype)]
    hc_t += [("HC", n), ("ITERS", int(sinkhorn_iters)), ("HEAD", False), ("COLLAPSE", True)]
    hc_t += [("HC_NORM", norm is not None), ("VT", hck.PRE_THREADS), ("PARTS", pl.nby)]
    _, ys, _, _, post2, comb2, hn = _kernel()(
        face,
        inputs=[x, w, scales, biases, aq.const_input("ids", rows), aq.const_input("wts"), aq.lim_input(0.0), nw]
        + [streams, post, comb, fn, base, scale, eps, tickets(TICKETS, rows, 64)],
        template=qmv_t + hc_t,
        grid=(32 * aq.WARPS, pl.nby, pl.nz),
        threadgroup=(32 * aq.WARPS, 1, 1),
        output_shapes=[(rows, d), streams.shape, (rows, pl.nby, m + 1), (*lead, n), (*lead, n), (*lead, n, n), (*lead, d)],
        output_dtypes=[x.dtype, x.dtype, mx.float32, mx.float32, mx.float32, mx.float32, x.dtype],
    )
    return ys, post2, comb2, hn


def _self_test(face: str) -> bool:
    """The launch on `face` against the two calls on the reference face: 4 streams of 256, a
    4-bit [256, 512] matrix, 1 and 3 tokens, float32 and bfloat16, with and without the norm."""
    if face != "cuda":
        return True  # nothing to test: other faces run the two calls
    key = mx.random.key(11)
    n, d, k_dim = 4, 256, 512
    wq, sc, bi = mx.quantize(mx.random.normal((d, k_dim), key=key) * 0.05, group_size=64, bits=4)
    fn = mx.random.normal(((2 + n) * n, n * d), key=key) * (n * d) ** -0.5
    base, scale = mx.random.normal(((2 + n) * n,), key=key) * 0.1, mx.array([0.5, 1.0, 2.0])
    kw = dict(group_size=64, bits=4, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6)
    for dt, tol in ((mx.float32, 1e-3), (mx.bfloat16, 2e-2)):
        for rows, norm in ((1, True), (3, False)):
            x = mx.random.normal((1, rows, k_dim), key=key).astype(dt)
            st = (mx.random.normal((1, rows, n, d), key=key) * 0.5).astype(dt)
            post = mx.random.uniform(shape=(1, rows, n), key=key) * 2
            comb = mx.random.uniform(shape=(1, rows, n, n), key=key)
            nrm = ((1.0 + 0.2 * mx.random.normal((d,), key=key)).astype(dt), 1e-6) if norm else None
            args = (x, wq, sc, bi, st, post, comb, fn, base, scale)
            got = qmv_hc_post_pre(*args, **kw, norm=nrm, backend=face)
            want = qmv_hc_post_pre(*args, **kw, norm=nrm, backend="reference")
            if not all(close_enough(g, w_, rtol=tol, atol=tol) for g, w_ in zip(got, want)):
                return False
    return True
