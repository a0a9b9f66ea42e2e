"""o_b, the FFN site's mHC work and the MoE router of one decode token in one launch.

At decode a V4 layer's o_b mat-vec runs with hc_post and the FFN site's hc_pre in one launch
(kernels/qmv_hc.py); the router (kernels/moe_route.py `fold`: mat-vec, score, top-k) was the
next launch, reading the site's normed output.  That output is nw * rs * sum_k pre_k * s_k
(s_k the new streams, pre_k and rs scalars of the tail), so a logit is
rs * sum_k pre_k * (sum_c rw[e, c] * nw[c] * s_k[c]): each threadgroup of the launch adds the
inner sums over the stream rows it wrote (its share, rpart), and the threadgroup that finishes
the token (qmv_hc's tail) adds the shares, scales them, and routes with moe_route.metal's
`core`.  No threadgroup waits for another (the last one to count itself does the rest); one
launch per layer less.

``qmv_hc_post_pre_route(x, w, scales, biases, streams, post, comb, fn, base, scale, router, *,
group_size, bits, sinkhorn_iters, hc_eps, norm_eps, norm, backend=None)``
    = ``qmv_hc_post_pre(...)`` (new streams, post', comb', normed') and then
    ``router.route(normed')`` (idx [..., k] int32, weights [..., k] float32).

The launch takes one token (float32 or bfloat16 activations) and the site's norm, on CUDA, as
qmv_hc.  The logits add in another order than the fold's (per threadgroup over its rows, then
over the streams), and with bfloat16 activations the collapsed and normed vectors are not
rounded to bfloat16 before the router's sum (each logit is, as the fold rounds it): a logit may
land a bfloat16 step away, and a near-tie between two experts may pick the other one.  The
reference face, and every case the launch does not take, is the two calls.

Verified: the shared text compiled with g++ (emulated threadgroups) against the reference, and
the CUDA translation unit with nvcc (tests/test_kernel_qmv_hc_route.py); on an H100 its GPU
tests' one-token cases (f32 and bf16, hashed and top-k routers) equal the reference.  The
3-row cases there, which take the unfused calls, fail in bfloat16 where qmv_hc's own rows do.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import mlx.core as mx

from ds4mlx.kernels import affine_qmv as aq
from ds4mlx.kernels import moe_route, qmv_hc
from ds4mlx.kernels.dispatch import INDEX, PRELUDE, Kernel, auto_face, close_enough, compact, f32_scalar, sections

INPUTS = [*qmv_hc.INPUTS, "rw", "rbias", "rtable", "rids", "rprm"]
OUTPUTS = [*qmv_hc.OUTPUTS, "ridx", "rwts", "rpart"]
# moe_route.metal `core`'s names inside this kernel (the mat-vec's own K, NORM, GS, wts differ)
_CORE_NAMES = {n: "R" + n for n in ("E", "K", "SCORE", "BIAS", "HASH", "NORM", "GROUPS", "TOPG", "GS", "GROUPED")}
_CORE_NAMES |= {n: "r" + n for n in ("bias", "table", "ids", "idx", "wts", "prm")}


@dataclass(frozen=True)
class SiteRouter:
    """An MoE router of the site's output: `moe_route.router`'s arguments (V4's: no groups).
    A model's site hands it to `HyperConnection.after_linear_post` (models/layers.py), which
    asks `fused_face` and runs `post_pre_route` where it is not None."""

    weight: mx.array
    k: int
    score: str
    scaling: float
    bias: mx.array | None = None
    table: mx.array | None = None
    ids: mx.array | None = None

    def route(self, x: mx.array, backend: str | None = None):
        sel = dict(bias=self.bias, table=self.table, ids=self.ids)
        return moe_route.router(
            x, self.weight, k=self.k, score=self.score, scaling=self.scaling, backend=backend, **sel
        )

    def fused_face(self, x, w, biases, streams, fn, norm, *, group_size: int, bits: int) -> str | None:
        """The face an automatic `post_pre_route` of these arguments launches as one kernel, or
        None (the caller keeps its own launches)."""
        face = auto_face("qmv_hc.route", _self_test)
        return face if _takes(face, x, w, biases, streams, fn, self, norm, group_size, bits) else None

    def post_pre_route(self, x, w, scales, biases, streams, post, comb, fn, base, scale, **kw):
        """`qmv_hc_post_pre_route` with this router."""
        return qmv_hc_post_pre_route(x, w, scales, biases, streams, post, comb, fn, base, scale, self, **kw)


def shared_text() -> tuple[str, str]:
    """(header, body) without the face's prelude and index block: qmv_hc's plain text with the
    router's share and tail in its places, moe_route.metal's `common` in the header."""
    q, r = sections(aq.SOURCE), sections(moe_route.SOURCE)
    tail = q["qmv_hc_route_tail"] + aq.renamed(compact(r["core"]), _CORE_NAMES) + "#undef ROUTE_LOGIT\n}\n"
    header, body = qmv_hc.shared_text("plain", q["qmv_hc_route_part"], tail)
    return header + compact(r["common"]), compact(body)


def kernel_sources(face: str) -> tuple[str, str]:
    header, body = shared_text()
    return PRELUDE[face] + header, INDEX[face] + body


@cache
def _kernel() -> Kernel:
    return Kernel(
        "ds4mlx_affine_qmv_hc_route", INPUTS, OUTPUTS, metal=kernel_sources("metal"), cuda=kernel_sources("cuda")
    )


def _takes(face: str, x, w, biases, streams, fn, router: SiteRouter, norm, group_size: int, bits: int) -> bool:
    e = router.weight.shape[0]
    threads = 32 * aq.WARPS
    return (
        qmv_hc.takes(face, x, w, biases, streams, fn, group_size, bits)
        and x.size == x.shape[-1]  # one token
        and streams.dtype in (mx.float32, mx.bfloat16)
        and norm is not None
        and router.weight.dtype in (mx.float32, mx.bfloat16)
        and router.weight.shape == (e, streams.shape[-1])
        and 1 <= router.k <= min(e, threads)
        and e <= moe_route.MAX_EXPERTS
        and threads & (threads - 1) == 0  # `core`'s tree sums
    )


def qmv_hc_post_pre_route(
    x,
    w,
    scales,
    biases,
    streams,
    post,
    comb,
    fn,
    base,
    scale,
    router: SiteRouter,
    *,
    group_size,
    bits,
    backend=None,
    **site,
):
    """(new streams, post', comb', normed', idx, weights): see the module."""
    args = (x, w, scales, biases, streams, post, comb, fn, base, scale)
    q = dict(group_size=group_size, bits=bits)
    face = backend if backend is not None else auto_face("qmv_hc.route", _self_test)
    if not _takes(face, x, w, biases, streams, fn, router, site.get("norm"), group_size, bits):
        out = qmv_hc.qmv_hc_post_pre(*args, **q, **site, backend=backend)
        return (*out, *router.route(out[3], backend=backend))
    lead = streams.shape[:-2]
    e, n, k = router.weight.shape[0], streams.shape[-2], router.k
    bias, table, ids = moe_route.selection_inputs(router.bias, router.table, router.ids)
    tmpl = moe_route.launch_template(e, k, router.score, True, router.bias, router.table, 1, 1)
    tmpl = [("R" + name, v) for name, v in tmpl if name not in ("THREADS", "TB")]

    def extra(parts: int):
        ins = [router.weight, bias, table, ids, f32_scalar(float(router.scaling))]
        shapes = [(*lead, k), (*lead, k), (parts, n, e)]
        return _kernel(), ins, tmpl, shapes, [mx.int32, mx.float32, mx.float32]

    ys, post2, comb2, hn, idx, wts, _ = qmv_hc.launch_dense(face, *args, **q, extra=extra, **site)
    return ys, post2, comb2, hn, idx, wts


def self_test_problem(dtype=mx.float32, seed: int = 0, n: int = 4, d: int = 256, e: int = 64, k: int = 6, hashed=False):
    """A small site (4-bit [d, 512] o_b, n streams of d, the norm) and a router of e experts."""
    keys = mx.random.split(mx.random.key(seed), 12)
    wq, sc, bi = mx.quantize(mx.random.normal((d, 512), key=keys[0]) * 0.05, group_size=64, bits=4)
    x = mx.random.normal((1, 1, 512), key=keys[1]).astype(dtype)
    st = (mx.random.normal((1, 1, n, d), key=keys[2]) * 0.5).astype(dtype)
    post = mx.random.uniform(shape=(1, 1, n), key=keys[3]) * 2
    comb = mx.random.uniform(shape=(1, 1, n, n), key=keys[4])
    fn = (mx.random.normal(((2 + n) * n, n * d), key=keys[5]) * (n * d) ** -0.5).astype(dtype)
    base, scale = mx.random.normal(((2 + n) * n,), key=keys[6]) * 0.1, mx.array([0.5, 1.0, 2.0])
    norm = ((1.0 + 0.2 * mx.random.normal((d,), key=keys[7])).astype(dtype), 1e-6)
    rw = mx.random.normal((e, d), key=keys[8]) * d**-0.5
    if hashed:
        table = mx.random.randint(0, e, (32, k), key=keys[9]).astype(mx.int32)
        router = SiteRouter(rw, k, "sqrtsoftplus", 1.5, table=table, ids=mx.array([[7]], mx.int32))
    else:
        router = SiteRouter(rw, k, "sqrtsoftplus", 1.5, bias=mx.random.uniform(shape=(e,), key=keys[10]) * 0.1)
    args = (x, wq, sc.astype(dtype), bi.astype(dtype), st, post, comb, fn, base, scale, router)
    return args, dict(group_size=64, bits=4, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6, norm=norm)


def same_result(got, want, tol: float = 1e-3) -> bool:
    """The site's four outputs close, the routing the same (`moe_route.same_routing`)."""
    site = all(close_enough(g, w, rtol=tol, atol=tol) for g, w in zip(got[:4], want[:4]))
    return site and moe_route.same_routing(got[4:], want[4:], atol=tol, rtol=tol)


def _self_test(face: str) -> bool:
    """The launch on `face` against the two calls on the reference face: a top-k router (bias)
    and a hashed one, float32."""
    if face != "cuda":
        return True  # nothing to test: other faces run the two calls
    for hashed in (False, True):
        args, kw = self_test_problem(hashed=hashed)
        got = qmv_hc_post_pre_route(*args, **kw, backend=face)
        want = qmv_hc_post_pre_route(*args, **kw, backend="reference")
        if not same_result(got, want):
            return False
    return True
