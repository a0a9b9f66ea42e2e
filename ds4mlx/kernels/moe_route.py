"""The MoE router of a decode step in one launch: score function, top-k (or the hash
lookup), renormalised and scaled weights.

The plain graph (`Router.__call__` in models/deepseek_v4.py: `score_fn`, `topk_indices`,
`route_weights` of models/layers.py) is ~6-8 primitives per layer at decode (the score
function, the bias add, `argpartition`, `take_along_axis`, the sum, the division and
scaling; for a bfloat16 router weight also its float32 copy before the mat-vec), each
~16 µs of host time on the H200.  Here one threadgroup per token does the routing:

``route(logits, *, k, score, scaling, normalize, bias=None, table=None, ids=None)``
    logits [..., E] -> (idx [..., k] int32, weights [..., k] float32).  bias [E]: the
    top-k ranks score + bias (DeepSeek V4's e_score_correction_bias); table [V, k] +
    ids [...]: idx = table[ids] (V4's hash layers, the lookup folded in); neither: the
    top-k of the scores.  score: "sqrtsoftplus" | "sigmoid" | "softmax"; groups /
    topk_group: DeepSeek-V3-style group-limited top-k (GLM 5.x's sigmoid router,
    `group_limited`).
``router(x, weight, *, k, score, ...)``
    the same from x [..., H] and the router weight [E, H]: ``logits = x @ weight.T``
    (the model's expression).  On the CUDA face, for float32 x and a float32 / bfloat16
    weight, the mat-vec runs in the same launch (the `fold` kernel: many threadgroups
    compute the logits, the last one of each token routes it), so the router is ONE
    primitive; elsewhere MLX's mat-vec and then `route`.

Used by the decode steps' `Router.step` (models/deepseek_v4.py) and `TopkRouter.step`
(models/sigmoid_moe.py, GLM 5.x) for up to MAX_ROWS tokens on a GPU face (the reference
face keeps their plain graph; `python -m ds4mlx.bench.kernels` times the fold against the
route kernel after MLX's mat-vec).

Faces (`ds4mlx.kernels.dispatch`): reference = the models' MLX ops (what the CPU and
prefill run); Metal and CUDA from the one text in metal/moe_route.metal.  The fold is
used on CUDA only: its cross-threadgroup hand-off (device fence + atomic counter) is
the documented CUDA pattern; Metal's equivalent (MSL 3.2 `atomic_thread_fence`) has not
run anywhere.

Exactness: scores as MLX computes them in float32 (softplus = logaddexp(l, 0)), up to
the faces' exp / log rounding.  The chosen experts are those of `mx.argpartition` on
inputs without near-ties (two selection values within a few ulps at the k-th place may
be chosen differently; exact ties go to the lowest expert index).  The k slots come in
descending order of the selection value (argpartition's order is unspecified): every
consumer (SwitchGLU, affine_qmv.gather_swiglu / gather_down_sum, expert streaming, the
expert-parallel split) reads them as a set with its weight.  Weights differ from the
reference by the rounding of a k-term sum in another order (a few ulps).

Verified: reference face = the model's ops (CPU); the shared text compiled with g++
(emulated threadgroups) against float64 math; the CUDA face compiled by nvcc for sm_90.
Not yet run on a GPU: ``pytest -m gpu tests/test_kernel_moe_route.py`` (H200), until
then `dispatch.UNVERIFIED_KERNELS` self-tests both kernels at first use.
"""

from __future__ import annotations

import logging
from functools import cache

import mlx.core as mx

from ds4mlx.kernels.dispatch import (
    INDEX,
    METAL_DIR,
    PRELUDE,
    Kernel,
    auto_face,
    f32_scalar,
    placeholder,
    sections,
    tickets,
)
from ds4mlx.models.layers import route_weights, score_fn, topk_indices

_log = logging.getLogger(__name__)
SOURCE = METAL_DIR / "moe_route.metal"
SCORES = ("sqrtsoftplus", "sigmoid", "softmax")  # the kernel's SCORE template value is the index
THREADS = 256  # threads per token (one threadgroup)
MAX_EXPERTS = 2 * THREADS  # each thread scores at most two experts (the rank loop stays short)
MAX_ROWS = 16  # tokens per call up to which the decode step routes with the kernel
FOLD_RPT = 4  # logits per fold threadgroup (THREADS / 32 / FOLD_RPT warps each, along H)

_INPUTS = {
    "route": (["logits", "bias", "table", "ids", "prm"], ["idx", "wts"]),
    "fold": (["x", "w", "bias", "table", "ids", "prm", "tickets"], ["idx", "wts", "scratch"]),
}


def kernel_sources(kind: str, face: str) -> tuple[str, str]:
    """(header, body) of 'route' or 'fold' for `face`: the kernel's section, then `core`."""
    sec = sections(SOURCE)
    return PRELUDE[face] + sec["common"], INDEX[face] + sec[kind] + sec["core"]


@cache
def _kernel(kind: str) -> Kernel:
    inputs, outputs = _INPUTS[kind]
    return Kernel(
        f"ds4mlx_moe_{kind}", inputs, outputs, metal=kernel_sources(kind, "metal"), cuda=kernel_sources(kind, "cuda")
    )


# --------------------------------------------------------------------------- reference face


def group_limited(choice: mx.array, groups: int, topk_group: int) -> mx.array:
    """DeepSeek-V3-style group-limited routing (GLM 5.x): each of `groups` equal groups of
    experts scores the sum of its two largest selection values; the experts outside the
    `topk_group` best groups get -inf."""
    if groups <= 1 or topk_group >= groups:
        return choice
    grouped = choice.reshape(*choice.shape[:-1], groups, -1)
    top2 = mx.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)  # [..., G]
    keep = topk_indices(top2, topk_group)
    gmask = mx.put_along_axis(mx.zeros(top2.shape, mx.bool_), keep, mx.array(True), axis=-1)
    return mx.where(gmask[..., None], grouped, -mx.inf).reshape(choice.shape)


def reference(logits, *, k, score, scaling, normalize=True, bias=None, table=None, ids=None, groups=1, topk_group=1):
    """The models' ops: (idx [..., k], weights [..., k] float32)."""
    scores = score_fn(logits, score)
    if table is not None:
        idx = table[ids]
    else:
        choice = scores + bias.astype(mx.float32) if bias is not None else scores
        idx = topk_indices(group_limited(choice, groups, topk_group), k)
    return idx, route_weights(scores, idx, normalize, scaling)


def router_logits(x: mx.array, weight: mx.array) -> mx.array:
    """The model's router mat-vec: x @ weight.T in x's dtype."""
    return x @ weight.T.astype(x.dtype)


# --------------------------------------------------------------------------- launches


def _check(e: int, k: int, score: str, table, ids, groups: int = 1) -> None:
    if score not in SCORES:
        raise ValueError(f"unknown scoring_func {score!r}")
    if groups > 1 and (e % groups or e // groups < 2):
        raise ValueError(f"{e} experts do not split into {groups} groups of >= 2")
    if table is not None and (ids is None or table.shape[-1] != k):
        raise ValueError(f"hash routing needs ids and a [V, {k}] table, got {table.shape}")
    if not 1 <= k <= e:
        raise ValueError(f"k must be in [1, {e}], got {k}")


def kernel_takes(e: int, k: int, rows: int, groups: int = 1) -> bool:
    """Whether the kernel routes this shape (else the reference face runs)."""
    return 1 <= k <= min(e, THREADS) and e <= MAX_EXPERTS and 1 <= rows and groups <= THREADS


def selection_inputs(bias, table, ids):
    """The kernel's bias / table / ids inputs (dummies where unused).  Every array is read
    flat, row-major: no reshape (each one is a primitive of the traced step)."""
    bias_in = bias if bias is not None else placeholder(mx.float32)
    table_in = table.astype(mx.int32) if table is not None else placeholder(mx.int32)
    ids_in = ids.astype(mx.int32) if table is not None else placeholder(mx.int32)
    return bias_in, table_in, ids_in


def launch_template(e, k, score, normalize, bias, table, groups, topk_group, extra=()):
    """The template arguments of a launch (the kernel's constants; `extra`: the kernel's own)."""
    hashed = table is not None
    return [
        ("E", e),
        ("K", k),
        ("SCORE", SCORES.index(score)),
        ("BIAS", bias is not None and not hashed),
        ("HASH", hashed),
        ("NORM", bool(normalize)),
        ("GROUPS", max(int(groups), 1)),
        ("TOPG", max(int(topk_group), 1)),
        ("THREADS", THREADS),
        ("TB", bias.dtype if bias is not None else mx.float32),
        *extra,
    ]


def _launch_route(face, logits, k, score, scaling, normalize, bias, table, ids, groups=1, topk_group=1):
    e = logits.shape[-1]
    lead = logits.shape[:-1]
    n = logits.size // e
    bias_in, table_in, ids_in = selection_inputs(bias, table, ids)
    idx, w = _kernel("route")(
        face,
        inputs=[logits, bias_in, table_in, ids_in, f32_scalar(float(scaling))],
        template=launch_template(e, k, score, normalize, bias, table, groups, topk_group, [("TL", logits.dtype)]),
        grid=(THREADS, n, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(*lead, k), (*lead, k)],
        output_dtypes=[mx.int32, mx.float32],
    )
    return idx, w


def _launch_fold(face, x, weight, k, score, scaling, normalize, bias, table, ids, groups=1, topk_group=1):
    e, h = weight.shape
    lead = x.shape[:-1]
    n = x.size // h
    bias_in, table_in, ids_in = selection_inputs(bias, table, ids)
    nb = -(-e // FOLD_RPT)
    idx, w, _ = _kernel("fold")(
        face,
        inputs=[x, weight, bias_in, table_in, ids_in, f32_scalar(float(scaling)), tickets("moe_route.fold", n, 256)],
        template=launch_template(
            e,
            k,
            score,
            normalize,
            bias,
            table,
            groups,
            topk_group,
            [
                ("TW", weight.dtype),
                ("WB", weight.dtype.size),
                ("XB", x.dtype.size),
                ("H", h),
                ("RPT", FOLD_RPT),
                ("NB", nb),
            ],
        ),
        grid=(nb * THREADS, n, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(*lead, k), (*lead, k), (n, e)],
        output_dtypes=[mx.int32, mx.float32, mx.float32],
    )
    return idx, w


def fold_operands(x: mx.array, weight: mx.array) -> bool:
    """Whether the fold kernel takes these operands: float32 x [..., H] with a float32 or
    bfloat16 weight [E, H], or bfloat16 x with a bfloat16 weight (the decode step's: each
    logit rounded to bf16, as `router_logits` computes it); H a multiple of 8 (16-byte loads)."""
    return (
        (x.dtype == mx.float32 or (x.dtype == mx.bfloat16 and weight.dtype == mx.bfloat16))
        and weight.dtype in (mx.float32, mx.bfloat16)
        and weight.ndim == 2
        and x.shape[-1] == weight.shape[1]
        and weight.shape[1] % 8 == 0
    )


def fold_takes(face: str, x: mx.array, weight: mx.array) -> bool:
    """Whether an automatic `router` call runs the mat-vec inside the launch (CUDA only)."""
    return face == "cuda" and fold_operands(x, weight)


# --------------------------------------------------------------------------- public API


def route(
    logits: mx.array,
    *,
    k: int,
    score: str,
    scaling: float = 1.0,
    normalize: bool = True,
    bias: mx.array | None = None,
    table: mx.array | None = None,
    ids: mx.array | None = None,
    groups: int = 1,
    topk_group: int = 1,
    backend: str | None = None,
):
    """logits [..., E] -> (idx [..., k] int32 on a GPU face, weights [..., k] float32);
    groups / topk_group: group-limited top-k (`group_limited`)."""
    e = logits.shape[-1]
    _check(e, k, score, table, ids, groups)
    face = _face(backend)
    sel = dict(bias=bias, table=table, ids=ids, groups=groups, topk_group=topk_group)
    if face == "reference" or not kernel_takes(e, k, logits.size // max(e, 1), groups):
        return reference(logits, k=k, score=score, scaling=scaling, normalize=normalize, **sel)
    return _launch_route(face, logits, k, score, scaling, normalize, **sel)


def router(
    x: mx.array,
    weight: mx.array,
    *,
    k: int,
    score: str,
    scaling: float = 1.0,
    normalize: bool = True,
    bias: mx.array | None = None,
    table: mx.array | None = None,
    ids: mx.array | None = None,
    groups: int = 1,
    topk_group: int = 1,
    backend: str | None = None,
    fold: bool | None = None,
):
    """x [..., H], weight [E, H] -> `route(x @ weight.T, ...)`; `fold` (default: where it
    applies) computes the mat-vec inside the one launch."""
    e = weight.shape[0]
    _check(e, k, score, table, ids, groups)
    face = _face(backend)
    rows = x.size // max(x.shape[-1], 1)
    sel = dict(bias=bias, table=table, ids=ids, groups=groups, topk_group=topk_group)
    if face == "reference" or not kernel_takes(e, k, rows, groups):
        return reference(router_logits(x, weight), k=k, score=score, scaling=scaling, normalize=normalize, **sel)
    if fold is None:
        fold = fold_takes(face, x, weight) and (backend is not None or _fold_face() == face)
    elif fold and not fold_operands(x, weight):
        raise ValueError(f"no fold for x {x.dtype} {x.shape}, weight {weight.dtype} {weight.shape} (fold_operands)")
    if fold:
        return _launch_fold(face, x, weight, k, score, scaling, normalize, **sel)
    return _launch_route(face, router_logits(x, weight), k, score, scaling, normalize, **sel)


def decode_face(rows: int) -> str | None:
    """The GPU face the decode step routes `rows` tokens with, or None (reference ops):
    a GPU face whose self-test passed, and at most MAX_ROWS tokens (prefill keeps the
    plain graph)."""
    if rows > MAX_ROWS:
        return None
    face = _face(None)
    return None if face == "reference" else face


# --------------------------------------------------------------------------- self-tests


def _face(backend: str | None) -> str:
    return auto_face("moe_route", self_test) if backend is None else backend


def _fold_face() -> str:
    return auto_face("moe_route.fold", fold_self_test)


def _cases():
    """Small routing problems without near-ties: (name, x, weight, kwargs)."""
    key = mx.random.key(11)
    kx, kw, kb, kt = mx.random.split(key, 4)
    n, h, e, k = 3, 64, 72, 6
    x = mx.random.normal((n, h), key=kx)
    weight = mx.random.normal((e, h), key=kw) * h**-0.5
    bias = mx.random.normal((e,), key=kb) * 0.1
    table = mx.random.randint(0, e, (10, k), key=kt).astype(mx.int32)
    ids = mx.array([3, 0, 9], mx.int32)
    return [
        ("sqrtsoftplus+bias", x, weight, dict(k=k, score="sqrtsoftplus", scaling=1.5, bias=bias)),
        ("hash", x, weight, dict(k=k, score="sqrtsoftplus", scaling=1.5, table=table, ids=ids)),
        ("sigmoid", x, weight, dict(k=k, score="sigmoid", scaling=2.5, normalize=False, bias=bias)),
        ("softmax", x, weight, dict(k=k, score="softmax", scaling=1.0)),
        ("grouped", x, weight, dict(k=k, score="sigmoid", scaling=2.5, bias=bias, groups=8, topk_group=3)),
    ]


def same_routing(got, want, atol: float = 1e-5, rtol: float = 1e-4) -> bool:
    """Routings agree as sets: the same experts per token with the same weights (any slot order)."""
    gi, gw = got
    wi, ww = want
    gi, wi = gi.astype(mx.int32), wi.astype(mx.int32)
    og, ow = mx.argsort(gi, axis=-1), mx.argsort(wi, axis=-1)
    if not mx.array_equal(mx.take_along_axis(gi, og, axis=-1), mx.take_along_axis(wi, ow, axis=-1)).item():
        return False
    gws, wws = mx.take_along_axis(gw, og, axis=-1), mx.take_along_axis(ww, ow, axis=-1)
    return bool(mx.all(mx.isfinite(gws)).item()) and bool(mx.allclose(gws, wws, rtol=rtol, atol=atol).item())


def self_test(face: str) -> bool:
    """`route` on `face` against the reference on the small cases (float32 and bfloat16 logits)."""
    for _, x, weight, kw in _cases():
        logits = router_logits(x, weight)
        for lg in (logits, logits.astype(mx.bfloat16)):
            if not same_routing(route(lg, **kw, backend=face), reference(lg, **kw)):
                return False
    return True


def fold_self_test(face: str) -> bool:
    """`router` with the mat-vec folded in, on `face`, against the reference (float32 x with
    float32 and bfloat16 weights; bfloat16 x and weights, the decode step's)."""
    for name, x, weight, kw in _cases():
        wb = weight.astype(mx.bfloat16)
        for xs, wt in ((x, weight), (x, wb), (x.astype(mx.bfloat16), wb)):
            # the reference on the CPU: MLX CUDA's float32 matmuls are TF32 (~1e-3 off), the
            # likely reason this self-test failed on the H200 (sparse_attention's did the same)
            with mx.stream(mx.cpu):
                want = reference(router_logits(xs, wt), **kw)
                mx.eval(want)
            # bf16 x: each logit is rounded to bf16 after a float32 sum in the kernel's order,
            # the reference's matmul sums in its own: a logit may land one bf16 step away
            rtol = 1e-2 if xs.dtype == mx.bfloat16 else 1e-4
            if not same_routing(router(xs, wt, **kw, backend=face, fold=True), want, rtol=rtol):
                # which case (a silent refusal of the fold was once hard to tell apart)
                _log.warning("moe_route.fold self-test: case %s, x %s, weight %s differs", name, xs.dtype, wt.dtype)
                return False
    return True
