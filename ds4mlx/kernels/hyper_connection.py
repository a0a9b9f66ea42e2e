"""Fused manifold-constrained hyper-connections (mHC): hc_pre / hc_head / hc_post.

The reference graph (`ds4mlx.kernels.hyper_connection_reference.hc_pre`) spends ~80 tiny launches per
call (RMS norm, the [(2+n)n, n*d] projection, sigmoids, 20 Sinkhorn iterations on
an n x n matrix, the collapse); at decode they dominate the token time.  The
kernel does the whole call in one launch: one threadgroup per token accumulates the
sum of squares and the (2+n)n dot products of the flattened streams, normalises
afterwards (``mix = (fn . x) * rsqrt(mean(x^2) + eps)``), applies the sigmoids,
runs Sinkhorn on one SIMD group and writes the collapsed vector.  `hc_post` is one
elementwise launch (instead of casts, a matmul, a product and a sum).  At decode (up to
SPLIT_TOKENS tokens) the projection is split over many threadgroups per token (hc_dots, or
hc_post_dots forming the new streams in the same pass); on CUDA the threadgroup of a token
that finishes last then does hc_pre's work in the same launch (the "tails" hc_dots_pre /
hc_post_dots_pre, a ticket per token: one launch per mHC site, bit-identical to the two
launches hc_dots + hc_pre it replaces).

Public API (all dispatch on ``backend`` / `ds4mlx.kernels.dispatch.backend()`)
----------
``hc_pre(x, fn, base, scale, *, sinkhorn_iters, hc_eps, norm_eps)`` -> (post, comb, collapsed)
``hc_mix(x, fn, base, scale, *, sinkhorn_iters, hc_eps, norm_eps)`` -> (pre, post, comb)  (V4.1)
``hc_head(x, fn, base, scale, *, hc_eps, norm_eps)``                 -> collapsed
``hc_post(x, out, post, comb)``                                     -> new streams
``hc_post_pre(x, out, post, comb, fn, base, scale, ...)``             -> (new streams, post', comb', collapsed')
with the shapes and dtypes of `ds4mlx.kernels.hyper_connection_reference` (the reference
face *is* those functions; ``hc_collapse`` has no kernel and is re-exported from there).

Bounds (tests/test_kernel_hyper_connection.py): mix differs from the reference by
at most ``(K + 8) * 2**-23 * sum_k |fn_k y_k|`` (K = n*d terms in another order,
the norm applied after the sum); post / comb / collapsed follow through the
sigmoids (slope <= 1/2 times |scale|) and the Sinkhorn loop (see the test for the
stated tolerances); hc_post rounds like the reference graph (within 1 ulp of T).

Verified: reference face against float64 math on CPU; the shared kernel text compiled
with g++ (threadgroups emulated with fibers); the GPU faces by ``pytest -m gpu
tests/test_kernel_hyper_connection.py`` (which faces are still self-tested at first use:
`dispatch.UNVERIFIED_FACES` / `UNVERIFIED_KERNELS`).  The tails need each launch's own ticket
buffer (dispatch.TICKET_RING); Metal keeps the two launches (its device-scope fence, MSL 3.2,
is unverified).
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from ds4mlx.kernels import hyper_connection_reference as reference
from ds4mlx.kernels.activations import rms_normed
from ds4mlx.kernels.dispatch import INDEX, METAL_DIR, PRELUDE, Kernel, auto_face, close_enough, sections, tickets
from ds4mlx.kernels.hyper_connection_reference import hc_collapse  # noqa: F401 (no kernel: the reference)

SOURCE = METAL_DIR / "hyper_connection.metal"
PRE_THREADS = 512  # threads per token in hc_pre (>= (2+n)n + 1)
POST_THREADS = 256  # threads per threadgroup in hc_post
MAX_HC = 5  # Sinkhorn runs on one SIMD group: n*n <= 32
SPLIT_TOKENS = 16  # up to this many tokens, the projection is split across threadgroups (hc_dots)
DOTS_THREADS = 256  # threads per hc_dots threadgroup
DOTS_PER = 2  # flat elements per hc_dots thread (a threadgroup takes DOTS_THREADS*DOTS_PER)

_CORE_IN = ["base", "scale", "eps", "nw"]  # what pre_core reads besides the streams and the parts
_KINDS = {  # kernel -> (its sections after the face's INDEX, inputs, outputs)
    "hc_pre": (("hc_pre", "pre_core"), ["x", "fn", "base", "scale", "eps", "part", "nw"], ["pre", "post", "comb", "y"]),
    "hc_dots": (("hc_dots",), ["x", "fn"], ["part"]),
    "hc_post_dots": (("hc_post_dots",), ["x", "o", "post", "comb", "fn", "o2"], ["y", "part"]),
    "hc_post": (("hc_post",), ["x", "o", "post", "comb", "o2"], ["y"]),
    # the decode split in one launch: the last threadgroup of a token runs hc_pre's work (pre_core)
    "hc_dots_pre": (
        ("hc_dots", "hc_last", "dots_glue", "pre_core"),
        ["x", "fn", *_CORE_IN, "tickets"],
        ["part", "pre", "post", "comb", "y"],
    ),
    "hc_post_dots_pre": (
        ("hc_post_dots", "hc_last", "post_dots_glue", "pre_core"),
        ["x", "o", "post", "comb", "fn", "o2", *_CORE_IN, "tickets"],
        ["y", "part", "pre", "post2", "comb2", "h"],
    ),
}
TICKETS = "hyper_connection.tail"  # the tails' ticket buffer (dispatch.tickets)


def kernel_sources(kind: str, face: str) -> tuple[str, str]:
    """(header, body) of a kernel of `_KINDS` for `face` ('metal' or 'cuda')."""
    sec = sections(SOURCE)
    return PRELUDE[face] + sec["common"], INDEX[face] + "".join(sec[s] for s in _KINDS[kind][0])


@cache
def _kernel(kind: str) -> Kernel:
    _, inputs, outputs = _KINDS[kind]
    return Kernel(
        f"ds4mlx_{kind}", inputs, outputs, metal=kernel_sources(kind, "metal"), cuda=kernel_sources(kind, "cuda")
    )


@cache
def _eps(hc_eps: float, norm_eps: float, rms_eps: float = 0.0) -> mx.array:
    return mx.array([hc_eps, norm_eps, rms_eps], dtype=mx.float32)


def _face(backend: str | None) -> str:
    """The caller's face, or the automatic one (self-tested where unverified)."""
    return auto_face("hyper_connection", _self_test) if backend is None else backend


def _tiny_site(seed: int):
    """The self-tests' mHC site: 4 streams of 64, 20 Sinkhorn iterations ->
    (n, d, key, fn, base, scale, keyword arguments)."""
    n, d = 4, 64
    key = mx.random.key(seed)
    fn = mx.random.normal(((2 + n) * n, n * d), key=key) * (n * d) ** -0.5
    base, scale = mx.random.normal(((2 + n) * n,), key=key) * 0.1, mx.array([0.5, 1.0, 2.0])
    return n, d, key, fn, base, scale, dict(sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6)


def _self_test(face: str) -> bool:
    """hc_pre / hc_mix / hc_head / hc_post on `face` against the reference on tiny
    inputs (4 streams of 64, 2 tokens), float32 and bfloat16 activations."""
    ref = _layers()
    n, d, key, fn, base, scale, kw = _tiny_site(5)
    hfn = fn[:n]
    for dt, tol in ((mx.float32, 1e-3), (mx.bfloat16, 2e-2)):
        x = (mx.random.normal((2, n, d), key=key) * 0.5).astype(dt)
        out = (mx.random.normal((2, d), key=key) * 0.5).astype(dt)
        pairs = [
            (hc_pre(x, fn, base, scale, **kw, backend=face), ref.hc_pre(x, fn, base, scale, **kw)),
            (hc_mix(x, fn, base, scale, **kw, backend=face), ref.hc_mix(x, fn, base, scale, **kw)),
            (
                (hc_head(x, hfn, base[:n], scale[:1], hc_eps=1e-6, norm_eps=1e-6, backend=face),),
                (ref.hc_head(x, hfn, base[:n], scale[:1], hc_eps=1e-6, norm_eps=1e-6),),
            ),
        ]
        post, comb, _ = pairs[0][1]
        pairs.append(((hc_post(x, out, post, comb, backend=face),), (ref.hc_post(x, out, post, comb),)))
        for got, want in pairs:
            if not all(close_enough(g, w, rtol=tol, atol=tol) for g, w in zip(got, want)):
                return False
    return True


def _layers():
    return reference  # the reference face


def _split(face: str, chosen: bool) -> bool:
    """Whether the decode split (hc_dots + hc_pre) runs: always for a caller-chosen face,
    for an automatic one once its self-test passed (dispatch.UNVERIFIED_KERNELS)."""
    return chosen or auto_face("hyper_connection.split", _self_test) == face


def _tail(face: str, chosen: bool) -> bool:
    """Whether the decode split runs as ONE launch (hc_dots_pre / hc_post_dots_pre: the
    threadgroup of a token that finishes last does hc_pre's work): on CUDA only (Metal's
    device-scope fence, MSL 3.2, has run nowhere), always for a caller-chosen face, for an
    automatic one once its self-test passed (dispatch.UNVERIFIED_KERNELS); else two launches."""
    return face == "cuda" and (chosen or auto_face("hyper_connection.tail", _tail_self_test) == face)


def _tail_self_test(face: str) -> bool:
    """The other self-tests on `face`: a chosen CUDA face runs them through the tails."""
    return _self_test(face) and _post_pre_self_test(face) and _fold_self_test(face)


def _core(x, base, scale, iters, hc_eps, norm_eps, mode: str, norm_in, part=None):
    """pre_core's inputs, template, output shapes and dtypes for x [..., n, d] in `mode`
    (`part`: hc_pre's partial sums, or None in a tail, which makes its own).  The outputs
    come out in x's leading shape: a reshape after the launch would be one more graph node
    per site and token (the kernels read and write flat rows)."""
    n, d = x.shape[-2], x.shape[-1]
    lead = tuple(x.shape[:-2])
    head = mode == "head"
    nw, rms_eps = (norm_in[0].astype(x.dtype), float(norm_in[1])) if norm_in is not None else (_eps(0.0, 0.0), 0.0)
    inputs = [base, scale, _eps(float(hc_eps), float(norm_eps), rms_eps), nw]
    if part is not None:
        inputs.insert(3, part)  # hc_pre's order: ..., eps, part, nw
    template = [
        ("TB", base.dtype),
        ("TS", scale.dtype),
        ("ITERS", int(iters)),
        ("HEAD", head),
        ("COLLAPSE", mode != "mix"),
        ("NORM", norm_in is not None),
    ]
    shapes = [(*lead, n), (*lead, n), (*lead, n, n)] if not head else [(1,), (1,), (1,)]
    shapes.append((*lead, d) if mode != "mix" else (1,))
    return inputs, template, shapes, [mx.float32, mx.float32, mx.float32, x.dtype]


def _results(mode, lead, n, d, pre, post, comb, y, norm, norm_in):
    """The public results of pre_core's outputs (see `_pre_launch`)."""
    if mode == "head":
        return y.reshape(*lead, d)
    post, comb = post.reshape(*lead, n), comb.reshape(*lead, n, n)
    if mode == "mix":
        return pre.reshape(*lead, n), post, comb
    y = y.reshape(*lead, d)
    return post, comb, y if norm_in is not None else rms_normed(y, norm)


def _pre_launch(
    face, x, fn, base, scale, iters, hc_eps, norm_eps, mode: str, chosen: bool = True, part=None, norm=None
):
    """mode 'pre' -> (post, comb, collapsed); 'mix' -> (pre, post, comb); 'head' -> collapsed.
    `norm` = (weight, eps): the collapsed vector comes out RMS-normed (mode 'pre'): inside
    the launch when `_folds` (a caller-chosen face, or the fold self-test passed), else
    by `mx.fast.rms_norm` after it."""
    norm_in = norm if norm is not None and _folds(face, chosen) else None
    n, d = x.shape[-2], x.shape[-1]
    lead = x.shape[:-2]
    nt = 1
    for v in lead:
        nt *= v
    head = mode == "head"
    m = n if head else (2 + n) * n
    if fn.shape != (m, n * d):
        raise ValueError(f"fn must be [{m}, {n * d}], got {fn.shape}")
    x3 = x  # the kernels read rows flat: no reshape node
    parts = 0 if part is None else part.shape[1]
    if part is None:
        part = _eps(0.0, 0.0)  # a dummy when hc_pre projects by itself
    if parts == 0 and nt <= SPLIT_TOKENS and _split(face, chosen):
        parts = -(-(n * d) // (DOTS_THREADS * DOTS_PER))
        dots = [
            ("T", x.dtype),
            ("TW", fn.dtype),
            ("HC", n),
            ("D", d),
            ("THREADS", DOTS_THREADS),
            ("PER", DOTS_PER),
            ("PARTS", parts),
        ]
        launch = dict(grid=(parts * DOTS_THREADS, nt, 1), threadgroup=(DOTS_THREADS, 1, 1))
        # hc_mix (V4.1) keeps the two launches: on a CUDA GPU its tail's `pre` came
        # out zero where the two launches' was right (test_gpu_tails_equal_two_launches)
        if mode != "mix" and _tail(face, chosen):
            inputs, template, shapes, dtypes = _core(x3, base, scale, iters, hc_eps, norm_eps, mode, norm_in)
            _, pre, post, comb, y = _kernel("hc_dots_pre")(
                face,
                inputs=[x3, fn, *inputs, tickets(TICKETS, nt, 64)],
                template=dots + template + [("VT", PRE_THREADS)],
                output_shapes=[(nt, parts, m + 1), *shapes],
                output_dtypes=[mx.float32, *dtypes],
                **launch,
            )
            return _results(mode, lead, n, d, pre, post, comb, y, norm, norm_in)
        part = _kernel("hc_dots")(
            face,
            inputs=[x3, fn],
            template=dots + [("HEAD", head)],
            output_shapes=[(nt, parts, m + 1)],
            output_dtypes=[mx.float32],
            **launch,
        )[0]
    inputs, template, shapes, dtypes = _core(x3, base, scale, iters, hc_eps, norm_eps, mode, norm_in, part)
    pre, post, comb, y = _kernel("hc_pre")(
        face,
        inputs=[x3, fn, *inputs],
        template=[("T", x.dtype), ("TW", fn.dtype), ("HC", n), ("D", d), ("THREADS", PRE_THREADS)]
        + template
        + [("PARTS", parts)],
        grid=(nt * PRE_THREADS, 1, 1),
        threadgroup=(PRE_THREADS, 1, 1),
        output_shapes=shapes,
        output_dtypes=dtypes,
    )
    return _results(mode, lead, n, d, pre, post, comb, y, norm, norm_in)


def _fusable(x: mx.array) -> bool:
    n = x.shape[-2]
    return 1 <= n <= MAX_HC and x.size > 0


def hc_pre(
    x: mx.array,
    fn: mx.array,
    base: mx.array,
    scale: mx.array,
    *,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    backend: str | None = None,
    norm: tuple | None = None,
):
    """`ds4mlx.kernels.hyper_connection_reference.hc_pre` in one launch on a GPU (same arguments and results).

    `norm` = (weight, eps): the collapsed vector is returned RMS-normed (`mx.fast.rms_norm`
    with the weight cast to its dtype, as `models.layers.RMSNorm`), inside the same launch
    on a GPU: the layer norm that follows every collapse costs no launch of its own."""
    face = _face(backend)
    if face == "reference" or not _fusable(x) or sinkhorn_iters < 1:
        post, comb, y = _layers().hc_pre(
            x, fn, base, scale, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, norm_eps=norm_eps
        )
        return post, comb, rms_normed(y, norm)
    return _pre_launch(
        face, x, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, "pre", backend is not None, norm=norm
    )


def _folds(face: str, chosen: bool) -> bool:
    """Whether the kernels apply the folds (the layer norm in hc_pre, `out2` added in hc_post
    / hc_post_dots): on a caller-chosen face, or an automatic one whose fold self-test
    passed (dispatch.UNVERIFIED_KERNELS); else the norm and the add run as their own ops."""
    return chosen or auto_face("hyper_connection.fold", _fold_self_test) == face


def _fold_self_test(face: str) -> bool:
    """hc_pre and hc_post_pre with the folded RMSNorm, hc_post_pre and hc_post with the
    folded second output, on `face` against the reference (the norm / the add as their
    own ops) on tiny inputs, float32 and bfloat16."""
    ref = _layers()
    n, d, key, fn, base, scale, kw = _tiny_site(7)
    w = 1.0 + 0.1 * mx.random.normal((d,), key=key)
    for dt, tol in ((mx.float32, 1e-3), (mx.bfloat16, 3e-2)):
        x = (mx.random.normal((2, n, d), key=key) * 0.5).astype(dt)
        out = (mx.random.normal((2, d), key=key) * 0.5).astype(dt)
        post, comb, y = ref.hc_pre(x, fn, base, scale, **kw)
        got = hc_pre(x, fn, base, scale, **kw, backend=face, norm=(w, 1e-6))
        if not close_enough(got[2], rms_normed(y, (w, 1e-6)), rtol=tol, atol=tol):
            return False
        y2 = ref.hc_post(x, out, post, comb)
        want = rms_normed(ref.hc_pre(y2, fn, base, scale, **kw)[2], (w, 1e-6))
        got = hc_post_pre(x, out, post, comb, fn, base, scale, **kw, backend=face, norm=(w, 1e-6))
        if not close_enough(got[3], want, rtol=tol, atol=tol):
            return False
        out2 = (mx.random.normal((2, d), key=key) * 0.5).astype(dt)
        want = ref.hc_post(x, out + out2, post, comb)
        got = hc_post_pre(x, out, post, comb, fn, base, scale, **kw, backend=face, out2=out2)
        if not close_enough(got[0], want, rtol=tol, atol=tol):
            return False
        if not close_enough(hc_post(x, out, post, comb, backend=face, out2=out2), want, rtol=tol, atol=tol):
            return False
    return True


def hc_mix(
    x: mx.array,
    fn: mx.array,
    base: mx.array,
    scale: mx.array,
    *,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    backend: str | None = None,
):
    """`ds4mlx.kernels.hyper_connection_reference.hc_mix` -> (pre, post, comb) in one launch on a GPU (no collapse)."""
    face = _face(backend)
    if face == "reference" or not _fusable(x) or sinkhorn_iters < 1:
        return _layers().hc_mix(x, fn, base, scale, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps, norm_eps=norm_eps)
    return _pre_launch(face, x, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, "mix", backend is not None)


def hc_head(
    x: mx.array,
    fn: mx.array,
    base: mx.array,
    scale: mx.array,
    *,
    hc_eps: float,
    norm_eps: float,
    backend: str | None = None,
) -> mx.array:
    """`ds4mlx.kernels.hyper_connection_reference.hc_head` in one launch on a GPU."""
    face = _face(backend)
    if face == "reference" or not _fusable(x):
        return _layers().hc_head(x, fn, base, scale, hc_eps=hc_eps, norm_eps=norm_eps)
    return _pre_launch(face, x, fn, base, scale, 1, hc_eps, norm_eps, "head", backend is not None)


def hc_post_pre(
    x: mx.array,
    out: mx.array,
    post: mx.array,
    comb: mx.array,
    fn: mx.array,
    base: mx.array,
    scale: mx.array,
    *,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    backend: str | None = None,
    norm: tuple | None = None,
    out2: mx.array | None = None,
):
    """``y = hc_post(x, out, post, comb, out2=out2)`` then ``hc_pre(y, fn, base, scale, ..., norm=norm)``:
    (y, post', comb', collapsed') -- the end of one mHC site and the start of the
    next.  At decode on a GPU, one launch instead of three: the new streams are formed
    and projected in the same pass (hc_post_dots) and the last threadgroup of each token
    adds the partial sums and does hc_pre's work (`_tail`; else hc_pre as a second launch)."""
    face = _face(backend)
    n, d = x.shape[-2], x.shape[-1]
    nt = x.size // max(n * d, 1)
    ok = (
        face != "reference"
        and out.dtype == x.dtype
        and _fusable(x)
        and sinkhorn_iters >= 1
        and nt <= SPLIT_TOKENS
        and fn.shape == ((2 + n) * n, n * d)
    )
    if ok and backend is None:
        ok = auto_face("hyper_connection.post_pre", _post_pre_self_test) == face
    if not ok:
        y = hc_post(x, out, post, comb, backend=backend, out2=out2)
        return (
            y,
            *hc_pre(
                y,
                fn,
                base,
                scale,
                sinkhorn_iters=sinkhorn_iters,
                hc_eps=hc_eps,
                norm_eps=norm_eps,
                backend=backend,
                norm=norm,
            ),
        )
    if out2 is not None and not _folds(face, backend is not None):
        out, out2 = out + out2, None
    lead = x.shape[:-2]
    m = (2 + n) * n
    parts = -(-(n * d) // (DOTS_THREADS * DOTS_PER))
    o2 = out2 if out2 is not None else post
    chosen = backend is not None
    inputs = [x, out, post, comb, fn, o2]  # read as flat rows: no reshape nodes
    template = [
        ("T", x.dtype),
        ("TP", post.dtype),
        ("TC", comb.dtype),
        ("TW", fn.dtype),
        ("HC", n),
        ("D", d),
        ("THREADS", DOTS_THREADS),
        ("PER", DOTS_PER),
        ("PARTS", parts),
        ("ADD2", out2 is not None),
    ]
    launch = dict(grid=(parts * DOTS_THREADS, nt, 1), threadgroup=(DOTS_THREADS, 1, 1))
    if _tail(face, chosen):
        norm_in = norm if norm is not None and _folds(face, chosen) else None
        core_in, core_t, shapes, dtypes = _core(
            inputs[0], base, scale, sinkhorn_iters, hc_eps, norm_eps, "pre", norm_in
        )
        y, _, pre, post2, comb2, h = _kernel("hc_post_dots_pre")(
            face,
            inputs=[*inputs, *core_in, tickets(TICKETS, nt, 64)],
            template=template + core_t + [("VT", PRE_THREADS)],
            output_shapes=[x.shape, (nt, parts, m + 1), *shapes],
            output_dtypes=[x.dtype, mx.float32, *dtypes],
            **launch,
        )
        return (y.reshape(*lead, n, d), *_results("pre", lead, n, d, pre, post2, comb2, h, norm, norm_in))
    y, part = _kernel("hc_post_dots")(
        face,
        inputs=inputs,
        template=template,
        output_shapes=[x.shape, (nt, parts, m + 1)],
        output_dtypes=[x.dtype, mx.float32],
        **launch,
    )
    y = y.reshape(*lead, n, d)
    # (with `part` given, _pre_launch reads it for the fold alone)
    return (y, *_pre_launch(face, y, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, "pre", chosen, part, norm))


def _post_pre_self_test(face: str) -> bool:
    """hc_post_pre on `face` against hc_post + hc_pre of the reference (4 streams of 64,
    2 tokens, float32 and bfloat16)."""
    ref = _layers()
    n, d, key, fn, base, scale, kw = _tiny_site(6)
    for dt, tol in ((mx.float32, 1e-3), (mx.bfloat16, 2e-2)):
        x = (mx.random.normal((2, n, d), key=key) * 0.5).astype(dt)
        out = (mx.random.normal((2, d), key=key) * 0.5).astype(dt)
        post, comb, _ = ref.hc_pre(x, fn, base, scale, **kw)
        y = ref.hc_post(x, out, post, comb)
        want = (y, *ref.hc_pre(y, fn, base, scale, **kw))
        got = hc_post_pre(x, out, post, comb, fn, base, scale, **kw, backend=face)
        if not all(close_enough(g, w, rtol=tol, atol=tol) for g, w in zip(got, want)):
            return False
    return True


def hc_post(
    x: mx.array,
    out: mx.array,
    post: mx.array,
    comb: mx.array,
    *,
    backend: str | None = None,
    out2: mx.array | None = None,
) -> mx.array:
    """`ds4mlx.kernels.hyper_connection_reference.hc_post` in one launch on a GPU.  `out2`:
    the site's output is ``out + out2`` (an MoE's routed and shared halves), added inside
    the launch."""
    face = _face(backend)
    if out2 is not None and (face == "reference" or not _folds(face, backend is not None)):
        out, out2 = out + out2, None
    if face == "reference" or out.dtype != x.dtype or x.size == 0:
        return _layers().hc_post(x, out, post, comb)
    n, d = x.shape[-2], x.shape[-1]
    lead = x.shape[:-2]
    nt = 1
    for v in lead:
        nt *= v
    bx = -(-d // POST_THREADS)
    y = _kernel("hc_post")(
        face,
        inputs=[x, out, post, comb, out2 if out2 is not None else post],  # flat rows: no reshape nodes
        # every input dtype is a template argument: MLX caches compiled kernels by name + template
        template=[
            ("T", x.dtype),
            ("TP", post.dtype),
            ("TC", comb.dtype),
            ("HC", n),
            ("D", d),
            ("THREADS", POST_THREADS),
            ("ADD2", out2 is not None),
        ],
        grid=(bx * POST_THREADS, n, nt),
        threadgroup=(POST_THREADS, 1, 1),
        output_shapes=[x.shape],
        output_dtypes=[x.dtype],
    )[0]
    return y
