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
and the CUDA translation unit with nvcc (tests/test_kernel_qmv_hc.py).  On a GPU its one-row
cases pass and a several-row case does not yet (`AUTO_ROWS`); "qmv_hc" stays in
`dispatch.UNVERIFIED_KERNELS` and self-tests at first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import mlx.core as mx

from ds4mlx.kernels import affine_qmv as aq
from ds4mlx.kernels import hyper_connection as hck
from ds4mlx.kernels.dispatch import INDEX, PRELUDE, Kernel, auto_face, close_enough, compact, sections, tickets

TICKETS = "qmv_hc.tail"
SELF_TEST_DTYPES = ((mx.float32, 1e-3), (mx.bfloat16, 2e-2))  # (activation dtype, tolerance)
HC_INPUTS = ["hx", "post", "comb", "fn", "base", "scale", "eps", "tickets"]
INPUTS = ["x", "w", "scales", "biases", "eids", "wts", "lim", "nw", *HC_INPUTS]
DOWN_INPUTS = [*aq.TWOBANK_INPUTS, *HC_INPUTS]
OUTPUTS = ["y", "ys", "part", "pre", "post2", "comb2", "hn"]
# the qmv_hc section after MODE 4: bank A's rows, steps and warp rows, bank B's tokens per slice
_DOWN_NAMES = {n: n + "_A" for n in ("OUT_ROWS", "MAXIT", "WROWS", "OPW", "THREADS", "GW", "UNITS", "TILES")}
_DOWN_NAMES |= {"XR": "XR_B", "XROWS": "XROWS_B"}


def shared_text(variant: str = "plain", route_part: str = "", route_tail: str = "") -> tuple[str, str]:
    """(header, body) without the face's prelude and index block: both files' `common`
    sections; the plain mat-vec ("plain") or MODE 4 ("down"), then `qmv_hc` with `pre_core`
    in its place (and kernels/qmv_hc_route.py's router pieces in theirs, else nothing)."""
    q, h = sections(aq.SOURCE), sections(hck.SOURCE)
    if variant == "plain":
        body = aq.qmv_text() + q["qmv_hc_plain"] + q["qmv_hc"]
    else:
        tail = aq.renamed(compact(q["qmv_hc"]), _DOWN_NAMES)
        body = aq.twobank_body(4) + q["qmv_hc_down"] + "constexpr int THREADS = 32 * WARPS;\n" + tail
    body = body.replace("DS4_QMV_HC_PRE_CORE", h["pre_core"])
    body = body.replace("DS4_QMV_HC_ROUTE_PART", route_part).replace("DS4_QMV_HC_ROUTE_TAIL", route_tail)
    return compact(q["common"] + h["common"]), compact(body)


def kernel_sources(face: str, variant: str = "plain") -> tuple[str, str]:
    header, body = shared_text(variant)
    return PRELUDE[face] + header, INDEX[face] + body


@cache
def _kernel(variant: str = "plain") -> Kernel:
    name, inputs = (
        ("ds4mlx_affine_qmv_hc", INPUTS) if variant == "plain" else ("ds4mlx_affine_qmv2_down_hc", DOWN_INPUTS)
    )
    return Kernel(name, inputs, OUTPUTS, metal=kernel_sources("metal", variant), cuda=kernel_sources("cuda", variant))


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


# The most rows an automatic call launches fused.  The several-row cases have not passed on a
# GPU (bfloat16 at 4 rows differed from MLX's calls past an elementwise bar that MLX's own bf16
# dequantization likely explains, docs/device.md; one run of the down variant at 3 tokens hit an
# illegal address): batched rows and verify chains keep the two launches until they do.
AUTO_ROWS = 1


def _rows_cap(auto: bool) -> int:
    return AUTO_ROWS if auto else min(aq.MAX_ROWS, hck.SPLIT_TOKENS)


def takes(face: str, x, w, biases, streams, fn, group_size: int, bits: int, auto: bool = True) -> bool:
    """Whether the dense site's launch takes these arguments (`auto`: an automatic call's row cap)."""
    n, d = streams.shape[-2], streams.shape[-1]
    rows = x.size // max(x.shape[-1], 1)
    return (
        face == "cuda"
        and biases is not None
        and w.ndim == 2
        and w.shape[0] == d
        and x.dtype == streams.dtype
        and 1 <= rows <= _rows_cap(auto)
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
    if not (takes(face, x, w, biases, streams, fn, group_size, bits, backend is None) and sinkhorn_iters >= 1):
        return _two_calls(*args, group_size=group_size, bits=bits, backend=backend, **site)
    return launch_dense(face, *args, group_size=group_size, bits=bits, **site)


def fused_face(x, w, biases, streams, fn, *, group_size: int, bits: int) -> str | None:
    """The face an automatic `qmv_hc_post_pre` of these arguments launches as one kernel, or
    None (it would run the two calls): lets a caller keep its own mat-vec otherwise."""
    face = auto_face("qmv_hc", _self_test)
    return face if takes(face, x, w, biases, streams, fn, group_size, bits) else None


def _site_launch(
    face, variant, head_inputs, head_template, grid, streams, post, comb, fn, base, scale, extra=None, **site
):
    """Launch `variant` with the mat-vec's inputs and template (`head_*`, its `nw` left for the
    site's norm weight) and the site's: -> (new streams, post', comb', collapsed').  `extra`:
    (kernel, inputs, template, output shapes, output dtypes) a variant adds after the site's
    (kernels/qmv_hc_route.py), whose outputs follow the four."""
    n, d = streams.shape[-2], streams.shape[-1]
    lead, rows, nby = streams.shape[:-2], streams.size // (n * d), grid[1]
    norm = site["norm"]
    nw = norm[0].astype(streams.dtype) if norm is not None else aq.const_input("wts")
    eps = _eps(float(site["hc_eps"]), float(site["norm_eps"]), float(norm[1]) if norm is not None else 0.0)
    hc_t = [("TP", post.dtype), ("TC", comb.dtype), ("TW", fn.dtype), ("TB", base.dtype), ("TSC", scale.dtype)]
    hc_t += [("HC", n), ("ITERS", int(site["sinkhorn_iters"])), ("HEAD", False), ("COLLAPSE", True)]
    hc_t += [("HC_NORM", norm is not None), ("VT", hck.PRE_THREADS), ("PARTS", nby)]
    inputs = [*head_inputs[:7], nw, *head_inputs[8:], streams, post, comb, fn, base, scale, eps]
    kernel, more_in, more_t, more_shapes, more_dtypes = extra or (_kernel(variant), [], [], [], [])
    _, ys, _, _, post2, comb2, hn, *more = kernel(
        face,
        inputs=inputs + [tickets(TICKETS, rows, 64), *more_in],
        template=head_template + hc_t + more_t,
        grid=grid,
        threadgroup=(32 * aq.WARPS, 1, 1),
        output_shapes=[(rows, d), streams.shape, (rows, nby, (2 + n) * n + 1), (*lead, n), (*lead, n), (*lead, n, n)]
        + [(*lead, d), *more_shapes],
        output_dtypes=[streams.dtype, streams.dtype, mx.float32, mx.float32, mx.float32, mx.float32, streams.dtype]
        + list(more_dtypes),
    )
    return (ys, post2, comb2, hn, *more)


def launch_dense(
    face, x, w, scales, biases, streams, post, comb, fn, base, scale, *, group_size, bits, extra=None, **site
):
    """The dense mat-vec's site launch; `extra(parts)`: a variant's kernel, inputs, template,
    shapes and dtypes added to it (kernels/qmv_hc_route.py), given the threadgroups a token has."""
    d = streams.shape[-1]
    k_dim, rows = x.shape[-1], x.size // x.shape[-1]
    pl = aq.rows_plan(rows, d, k_dim, bits, x.dtype, face) if rows > 1 else None
    if pl is None:
        pl = aq.plan(0, d, k_dim, bits, rows, x_dtype=x.dtype, face=face)
    qmv_t = aq.template(
        0, pl, x.dtype, scales.dtype, n_rows=d, k_dim=k_dim, group_size=group_size, bits=bits, dense=True, x_rows=rows
    )
    head = [x, w, scales, biases, aq.const_input("ids", rows), aq.const_input("wts"), aq.lim_input(0.0), None]
    grid = (32 * aq.WARPS, pl.nby, pl.nz)
    extra = extra(pl.nby) if extra is not None else None  # a variant's additions, given the parts
    return _site_launch(face, "plain", head, qmv_t, grid, streams, post, comb, fn, base, scale, extra, **site)


@dataclass(frozen=True)
class DownSumShared:
    """An MoE's output not launched yet: `affine_qmv.gather_down_sum_shared`'s arguments (MODE 4,
    the routed experts' down + weighted sum + the shared expert's down) and the caller's shape.
    The next mHC site runs it inside its own launch (`hc_post_pre`); `value()` launches it alone."""

    args: tuple
    kwargs: dict
    shape: tuple

    def value(self, backend: str | None = None) -> mx.array:
        return aq.gather_down_sum_shared(*self.args, **self.kwargs, backend=backend).reshape(self.shape)

    def hc_post_pre(
        self, streams, post, comb, fn, base, scale, *, sinkhorn_iters, hc_eps, norm_eps, norm=None, backend=None
    ):
        """``hc_post(streams, value(), post, comb)`` then the next site's hc_pre (as
        `hyper_connection.hc_post_pre`): one launch on CUDA, the down's (kernels/qmv_hc.py)."""
        site = dict(sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, norm_eps=norm_eps, norm=norm)
        face = backend if backend is not None else auto_face("qmv_hc.down", _down_self_test)
        call = self._call(face, streams, fn, backend is None) if sinkhorn_iters >= 1 else None
        if call is None:
            return hck.hc_post_pre(streams, self.value(backend), post, comb, fn, base, scale, backend=backend, **site)
        grid = (32 * aq.WARPS, call.plan.a.nby, call.plan.nz)
        return _site_launch(
            face, "down", call.inputs, call.template, grid, streams, post, comb, fn, base, scale, **site
        )

    def _call(self, face: str, streams, fn, auto: bool = True):
        """MODE 4's launch where the down and the site fit one launch on `face`, else None."""
        n, d = streams.shape[-2], streams.shape[-1]
        h, w = self.args[0], self.args[1]
        tokens = self.args[4].shape[0]
        if not (
            face == "cuda"
            and h.dtype == streams.dtype
            and w.shape[1] == d
            and streams.size == tokens * n * d
            and tokens <= (AUTO_ROWS if auto else hck.SPLIT_TOKENS)
            and 1 <= n <= hck.MAX_HC
            and fn.shape == ((2 + n) * n, n * d)
        ):
            return None
        call = aq.down_sum_shared_launch(*self.args, **self.kwargs, backend=face)
        return call if call is not None and call.face == face else None


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
    for dt, tol in SELF_TEST_DTYPES:
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


def down_problem(dtype, tokens: int, seed: int = 0, n: int = 4, d: int = 256):
    """A small MoE down site (4 experts of [d, 128] and a [d, 128] shared down, 4-bit, 2 experts a
    token) and its mHC inputs -> (DownSumShared, (streams, post, comb, fn, base, scale), norm)."""
    k = mx.random.split(mx.random.key(seed), 12)
    inter, i2, experts, top = 128, 128, 4, 2
    wq, sc, bi = mx.quantize(mx.random.normal((experts, d, inter), key=k[0]) * 0.05, group_size=64, bits=4)
    ws, ss, bs = mx.quantize(mx.random.normal((d, i2), key=k[1]) * 0.05, group_size=64, bits=4)
    h = mx.random.normal((tokens, top, inter), key=k[2]).astype(dtype)
    hs = mx.random.normal((tokens, i2), key=k[3]).astype(dtype)
    ids = mx.argsort(mx.random.uniform(shape=(tokens, experts), key=k[4]), axis=-1)[:, :top].astype(mx.int32)
    wts = mx.random.uniform(shape=(tokens, top), key=k[5])
    shared = (ws, ss.astype(dtype), bs.astype(dtype))
    q = dict(group_size=64, bits=4, shared_group_size=64, shared_bits=4)
    down = DownSumShared((h, wq, sc.astype(dtype), bi.astype(dtype), ids, wts, hs, shared), q, (1, tokens, d))
    st = (mx.random.normal((1, tokens, n, d), key=k[6]) * 0.5).astype(dtype)
    post = mx.random.uniform(shape=(1, tokens, n), key=k[7]) * 2
    comb = mx.random.uniform(shape=(1, tokens, n, n), key=k[8])
    fn = (mx.random.normal(((2 + n) * n, n * d), key=k[9]) * (n * d) ** -0.5).astype(dtype)
    base, scale = mx.random.normal(((2 + n) * n,), key=k[10]) * 0.1, mx.array([0.5, 1.0, 2.0])
    norm = ((1.0 + 0.2 * mx.random.normal((d,), key=k[11])).astype(dtype), 1e-6)
    return down, (st, post, comb, fn, base, scale), norm


def _down_self_test(face: str) -> bool:
    """The MODE 4 + site launch on `face` against the two calls on the reference face: 1 token
    with the norm and 3 without (the shared expert multi-row), float32 and bfloat16."""
    if face != "cuda":
        return True  # nothing to test: other faces run the two calls
    site = dict(sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6)
    for dt, tol in SELF_TEST_DTYPES:
        for tokens, with_norm in ((1, True), (3, False)):
            down, args, norm = down_problem(dt, tokens, seed=tokens)
            norm = norm if with_norm else None
            got = down.hc_post_pre(*args, **site, norm=norm, backend=face)
            want = down.hc_post_pre(*args, **site, norm=norm, backend="reference")
            if not all(close_enough(g, w, rtol=tol, atol=tol) for g, w in zip(got, want)):
                return False
    return True
