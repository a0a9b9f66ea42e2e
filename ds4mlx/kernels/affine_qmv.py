"""Affine quantized mat-vec (MLX's `mx.quantize` packing) for decode, at bandwidth.

MLX's own quantized mat-vec takes the same time at 2, 4 and 8 bits on an H200
(~34 µs at 4096², 157-499 GB/s: issue #13), so fewer bits bought nothing at decode.
This kernel reads each weight row in 16-byte loads, keeps x in shared memory
(staged once per threadgroup, prescaled so that a level becomes a float with one
bitwise operation, see metal/affine_qmv.metal), accumulates in float32 and
reduces with warp sums.

Public API (each falls back to MLX's own op on the reference face, for shapes the
kernel does not take, and for more rows than decode has)
----------
``qmv(x, w, scales, biases, *, group_size, bits)``                      x [..., K] -> [..., N]
``gather_qmv(x, w, scales, biases, expert_ids, *, group_size, bits)``   x [n, K] or [n, k, K] -> [n, k, N]
``gather_swiglu(x, w, scales, biases, expert_ids, *, limit, ...)``      fused [gate; up] experts
                                                                        -> silu(clamp(g)) * clamp(u) [n, k, I]
``gather_down_sum(h, w, scales, biases, expert_ids, weights, ...)``     h [n, k, I] -> sum_j weights * down [n, H]
``supported(k_dim, group_size, bits)``                                  the kernel takes this shape

`w`, `scales`, `biases` are what `mx.quantize(W, group_size, bits)` returns for W
[N, K] (dense) or [E, N, K] (experts); ids are read on the device (no host sync).

Faces (`ds4mlx.kernels.dispatch`): reference = ``mx.quantized_matmul`` /
``mx.gather_qmm`` (+ the SwiGLU / weighted sum as MLX ops); Metal and CUDA from the
one text in metal/affine_qmv.metal.  Precision: float32 accumulation; the level
trick adds at most about 2^-16 * max|x| per segment sum (stated in the .metal file),
far below a bfloat16 activation's rounding.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from ds4mlx.kernels.activations import clamped_swiglu
from ds4mlx.kernels.dispatch import METAL_DIR, Kernel, auto_face, close_enough, shared_sources

SOURCE = METAL_DIR / "affine_qmv.metal"
BITS = (2, 4, 8)
GROUP_SIZES = (32, 64, 128)
WARPS = 8  # SIMD groups per threadgroup
RPW = 4  # weight rows per warp (MODE 1: 2 gate + 2 up rows)
KSPLIT_MAX = 8  # at most this many warps share a row set along K
MAX_ROWS = 8  # dense: x rows (tokens) up to this many use the kernel, more use mx.quantized_matmul
MAX_PAIRS = 64  # gathered: (token, expert) pairs up to this many use the kernel
SHARED_BYTES = {"metal": 32768, "cuda": 49152}


def kernel_sources(face: str) -> tuple[str, str]:
    return shared_sources(SOURCE, face, "qmv")


@cache
def _kernel() -> Kernel:
    return Kernel(
        "ds4mlx_affine_qmv",
        ["x", "w", "scales", "biases", "eids", "wts", "lim"],
        ["y"],
        metal=kernel_sources("metal"),
        cuda=kernel_sources("cuda"),
    )


def launch_shape(k_dim: int, bits: int) -> tuple[int, int, int]:
    """(KSPLIT, NIT, staged float4s) for a row of k_dim values: enough warps along K
    that a warp row covers the row in about one step of 16-byte loads."""
    vpl = 128 // bits
    chunks = k_dim // vpl
    ksplit = 1
    while ksplit < min(WARPS, KSPLIT_MAX) and 32 * ksplit < chunks:
        ksplit *= 2
    lanes = 32 * ksplit
    nit = -(-chunks // lanes)
    return ksplit, nit, nit * (vpl // 4) * lanes


def supported(k_dim: int, group_size: int, bits: int, face: str = "cuda") -> bool:
    if bits not in BITS or group_size not in GROUP_SIZES or k_dim <= 0:
        return False
    if k_dim % group_size or (k_dim * bits) % 128:
        return False
    _, _, nx4 = launch_shape(k_dim, bits)
    return nx4 * 16 + WARPS * RPW * 4 <= SHARED_BYTES.get(face, 32768)


@cache
def _const(kind: str, n: int = 1) -> mx.array:
    a = mx.zeros((n,), mx.int32) if kind == "ids" else mx.ones((n,), mx.float32)
    mx.eval(a)
    return a


def _face(backend: str | None) -> str:
    return auto_face("affine_qmv", _self_test) if backend is None else backend


def _moe_face(backend: str | None) -> str:
    """The fused MoE modes (gate_up + SwiGLU, down + weighted sum) have their own
    self-test: until their GPU test has run, dispatch.UNVERIFIED_KERNELS lists them."""
    if backend is not None:
        return backend
    face = _face(None)
    if face == "reference":
        return face
    return auto_face("affine_qmv.moe", _moe_self_test)


def kernel_face(k_dim: int, group_size: int, bits: int, moe: bool = False) -> str | None:
    """The GPU face an automatic call would run for this shape (`moe`: the fused MoE
    modes), or None (the reference face, i.e. MLX's own op, runs): lets a module pick
    its fused path."""
    face = _moe_face(None) if moe else _face(None)
    return face if face != "reference" and supported(k_dim, group_size, bits, face) else None


def _launch(face, mode, x2, w, scales, biases, eids, wts, lim, *, p, n_rows, k_dim, group_size, bits, x_div=1, ke=1):
    ksplit, _, _ = launch_shape(k_dim, bits)
    wrows = WARPS // ksplit
    out_rows = n_rows // 2 if mode == 1 else n_rows
    opw = RPW // 2 if mode == 1 else RPW
    blocks = -(-out_rows // (wrows * opw))
    return _kernel()(
        face,
        inputs=[x2, w, scales, biases, eids, wts, lim],
        template=[
            ("T", x2.dtype),
            ("TS", scales.dtype),
            ("N_ROWS", n_rows),
            ("K_DIM", k_dim),
            ("BITS", bits),
            ("GS", group_size),
            ("WARPS", WARPS),
            ("KSPLIT", ksplit),
            ("RPW", RPW),
            ("X_DIV", x_div),
            ("MODE", mode),
            ("KE", ke),
        ],
        grid=(32 * WARPS, blocks, p),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(p, out_rows)],
        output_dtypes=[x2.dtype],
    )[0]


def _usable(face: str, k_dim: int, group_size: int, bits: int, biases) -> bool:
    return face != "reference" and biases is not None and supported(k_dim, group_size, bits, face)


# --------------------------------------------------------------------------- dense


def qmv(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    *,
    group_size: int,
    bits: int,
    backend: str | None = None,
) -> mx.array:
    """``x @ dequantize(w).T``: x [..., K] -> [..., N] in x.dtype (mx.quantized_matmul's result)."""
    k_dim = x.shape[-1]
    rows = x.size // max(k_dim, 1)
    face = _face(backend)
    if rows > MAX_ROWS or rows == 0 or w.ndim != 2 or not _usable(face, k_dim, group_size, bits, biases):
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
    n_rows = w.shape[0]
    y = _launch(
        face,
        0,
        x.reshape(rows, k_dim),
        w,
        scales,
        biases,
        _const("ids", rows),
        _const("wts"),
        _const("wts"),
        p=rows,
        n_rows=n_rows,
        k_dim=k_dim,
        group_size=group_size,
        bits=bits,
    )
    return y.reshape(*x.shape[:-1], n_rows)


# --------------------------------------------------------------------------- gathered (experts)


def _pairs(x: mx.array, expert_ids: mx.array):
    if expert_ids.ndim != 2:
        raise ValueError("expert_ids must be [n_tok, k]")
    n, k = expert_ids.shape
    if x.ndim == 2 and x.shape[0] == n:
        return x, k  # one vector per token, shared by its k experts
    if x.ndim == 3 and x.shape[:2] == (n, k):
        return x.reshape(n * k, x.shape[-1]), 1
    raise ValueError(f"x must be [{n}, K] or [{n}, {k}, K], got {x.shape}")


def _gather_ref(x, w, scales, biases, expert_ids, group_size, bits):
    n, k = expert_ids.shape
    xs = x[:, None, None, :] if x.ndim == 2 else x[:, :, None, :]  # [n, 1|k, 1, K]
    y = mx.gather_qmm(
        xs, w, scales, biases, rhs_indices=expert_ids, transpose=True, group_size=group_size, bits=bits
    )  # [n, k, 1, N]
    return y.squeeze(-2)


def gather_qmv(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    expert_ids: mx.array,
    *,
    group_size: int,
    bits: int,
    backend: str | None = None,
) -> mx.array:
    """``out[t, j] = dequantize(w[expert_ids[t, j]]) @ x[t(, j)]`` -> [n, k, N] in x.dtype."""
    face = _face(backend)
    k_dim = x.shape[-1]
    n, k = expert_ids.shape
    if n * k > MAX_PAIRS or not _usable(face, k_dim, group_size, bits, biases):
        return _gather_ref(x, w, scales, biases, expert_ids, group_size, bits)
    x2, x_div = _pairs(x, expert_ids)
    y = _launch(
        face,
        0,
        x2,
        w,
        scales,
        biases,
        expert_ids.reshape(-1).astype(mx.int32),
        _const("wts"),
        _const("wts"),
        p=n * k,
        n_rows=w.shape[1],
        k_dim=k_dim,
        group_size=group_size,
        bits=bits,
        x_div=x_div,
    )
    return y.reshape(n, k, w.shape[1])


def _limit(limit) -> mx.array:
    return mx.array([float(limit) if limit else 0.0], dtype=mx.float32)


def gather_swiglu(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    expert_ids: mx.array,
    *,
    limit: float | None,
    group_size: int,
    bits: int,
    backend: str | None = None,
) -> mx.array:
    """Fused gate_up experts (w [E, 2I, K/..], gate rows first): ``silu(min(g, limit)) *
    clip(u, -limit, limit)`` of ``w[e] @ x`` -> [n, k, I] (no clamp for limit None / 0)."""
    face = _moe_face(backend)
    k_dim = x.shape[-1]
    n, k = expert_ids.shape
    two_i = w.shape[1]
    if n * k > MAX_PAIRS or two_i % 2 or not _usable(face, k_dim, group_size, bits, biases):
        gu = _gather_ref(x, w, scales, biases, expert_ids, group_size, bits)
        return clamped_swiglu(gu[..., : two_i // 2], gu[..., two_i // 2 :], limit)
    x2, x_div = _pairs(x, expert_ids)
    y = _launch(
        face,
        1,
        x2,
        w,
        scales,
        biases,
        expert_ids.reshape(-1).astype(mx.int32),
        _const("wts"),
        _limit(limit),
        p=n * k,
        n_rows=two_i,
        k_dim=k_dim,
        group_size=group_size,
        bits=bits,
        x_div=x_div,
    )
    return y.reshape(n, k, two_i // 2)


def gather_down_sum(
    h: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    expert_ids: mx.array,
    weights: mx.array,
    *,
    group_size: int,
    bits: int,
    backend: str | None = None,
) -> mx.array:
    """``sum_j weights[t, j] * dequantize(w[expert_ids[t, j]]) @ h[t, j]`` -> [n, N] in h.dtype
    (weights multiply the float32 per-expert sums; the reference rounds each expert's
    output to h.dtype first, as the unfused graph does)."""
    face = _moe_face(backend)
    k_dim = h.shape[-1]
    n, k = expert_ids.shape
    if n * k > MAX_PAIRS or not _usable(face, k_dim, group_size, bits, biases):
        y = _gather_ref(h, w, scales, biases, expert_ids, group_size, bits)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)
    y = _launch(
        face,
        2,
        h.reshape(n * k, k_dim),
        w,
        scales,
        biases,
        expert_ids.reshape(-1).astype(mx.int32),
        weights.reshape(-1).astype(mx.float32),
        _const("wts"),
        p=n,
        n_rows=w.shape[1],
        k_dim=k_dim,
        group_size=group_size,
        bits=bits,
        ke=k,
    )
    return y


# --------------------------------------------------------------------------- first-use self-test


def _inputs(bits, gs, key):
    k_dim, rows, e = 512, 6, 3
    wq, sc, bi = mx.quantize(mx.random.normal((e, rows, k_dim), key=key) * 0.05, gs, bits)
    ids = mx.array([[0, 2], [1, 1]], dtype=mx.int32)
    x = mx.random.normal((2, k_dim), key=key)
    h = mx.random.normal((2, 2, k_dim), key=key)
    return wq, sc, bi, ids, x, h


def _self_test(face: str) -> bool:
    """The plain mode (dense and gathered) at 2, 4 and 8 bits on tiny shapes (odd row
    counts, two steps along K) against the reference face."""
    key = mx.random.key(7)
    ok = True
    for bits, gs in ((2, 32), (4, 64), (8, 128)):
        wq, sc, bi, ids, x, h = _inputs(bits, gs, key)
        d = (wq[0], sc[0], bi[0])
        ok = ok and close_enough(
            qmv(x[:1], *d, group_size=gs, bits=bits, backend=face),
            qmv(x[:1], *d, group_size=gs, bits=bits, backend="reference"),
        )
        for xx in (x, h):
            ok = ok and close_enough(
                gather_qmv(xx, wq, sc, bi, ids, group_size=gs, bits=bits, backend=face),
                gather_qmv(xx, wq, sc, bi, ids, group_size=gs, bits=bits, backend="reference"),
            )
    return ok


def _moe_self_test(face: str) -> bool:
    """The fused MoE modes at 2 and 4 bits (the expert formats) against the reference."""
    key = mx.random.key(8)
    ok = True
    wts = mx.array([[0.25, 0.75], [0.5, 0.5]])
    for bits, gs in ((2, 64), (4, 32)):
        wq, sc, bi, ids, x, h = _inputs(bits, gs, key)
        ok = ok and close_enough(
            gather_swiglu(x, wq, sc, bi, ids, limit=1.0, group_size=gs, bits=bits, backend=face),
            gather_swiglu(x, wq, sc, bi, ids, limit=1.0, group_size=gs, bits=bits, backend="reference"),
        )
        ok = ok and close_enough(
            gather_down_sum(h, wq, sc, bi, ids, wts, group_size=gs, bits=bits, backend=face),
            gather_down_sum(h, wq, sc, bi, ids, wts, group_size=gs, bits=bits, backend="reference"),
        )
    return ok
