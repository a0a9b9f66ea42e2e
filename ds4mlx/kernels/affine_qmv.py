"""Affine quantized mat-vec (MLX's `mx.quantize` packing) for decode, at bandwidth.

MLX's own quantized mat-vec takes about the same time at 2, 4 and 8 bits on a CUDA GPU
(docs/bench-history.md), so fewer bits bought nothing at decode.
This kernel reads each weight row in 16-byte loads, keeps x in threadgroup memory
(staged once per threadgroup with its 16-value sums, prescaled so that a level
becomes a float with one bitwise operation: see metal/affine_qmv.metal),
accumulates in float32 and reduces with warp sums.  `plan` sizes each launch
(split K over up to 8 warps where rows are few, several prefetched steps per warp
where they are many, about two threadgroups per SM).

Public API (each falls back to MLX's own op on the reference face, for shapes the
kernel does not take, and for more rows than decode has)
----------
``qmv(x, w, scales, biases, *, group_size, bits)``                      x [..., K] -> [..., N]
``gather_qmv(x, w, scales, biases, expert_ids, *, group_size, bits)``   x [n, K] or [n, k, K] -> [n, k, N]
``gather_swiglu(x, w, scales, biases, expert_ids, *, limit, ...)``      fused [gate; up] experts
                                                                        -> silu(clamp(g)) * clamp(u) [n, k, I]
``gather_down_sum(h, w, scales, biases, expert_ids, weights, ...)``     h [n, k, I] -> sum_j weights * down [n, H]
``gather_swiglu_shared(x, w, s, b, ids, shared, ...)``                  MODE 3: gather_swiglu and the same of a
                                                                        dense [gate; up] `shared` (another format)
                                                                        in one launch -> ([n, k, I], [n, I2])
``gather_down_sum_shared(h, w, s, b, ids, wts, hs, shared, ...)``       MODE 4: gather_down_sum + qmv(hs, *shared)
                                                                        in one launch -> [n, H]
``supported(k_dim, group_size, bits)``                                  the kernel takes this shape

`w`, `scales`, `biases` are what `mx.quantize(W, group_size, bits)` returns for W
[N, K] (dense) or [E, N, K] (experts); ids are read on the device (no host sync).

Several x rows (batched decode): ``qmv`` of 2..MAX_ROWS rows is one launch whose
threadgroups take XR x rows each (`rows_plan`: XR = min(rows, XR_MAX) where threadgroup
memory allows, grid z = ceil(rows / XR)), so each weight is read from memory once for XR rows
instead of once per row; x is staged in K slices (XR rows of the whole K do not fit: see the
.metal "Geometry").  Its first use on a GPU self-tests it ("affine_qmv.rows"); a failure falls
back to one row a threadgroup z slice, the one-row kernel (XR = 1, KSL = 1: the same code).
MODE 3 / 4 of n tokens (batched rows, a verify chain) take the shared expert (the dense bank B)
the same way: ceil(n / XR) slices of XR tokens each read its weights once (`twobank_rows_plan`),
self-tested at first use while unverified ("affine_qmv.twobank_rows": its CUDA face passed its GPU tests; a failure keeps one read per token).

Faces (`ds4mlx.kernels.dispatch`): reference = ``mx.quantized_matmul`` /
``mx.gather_qmm`` (+ the SwiGLU / weighted sum as MLX ops); Metal and CUDA from the
one text in metal/affine_qmv.metal.  Precision: float32 accumulation; the level
trick's rounding is stated in the .metal file: with float32 x about 4x a plain
float32 dot product's at 2 bits, with 16-bit x (8-bit slabs) ~2^-15 of the result,
far below the output's own rounding.

Why this layout (v3) and the predicted vs measured kernel times: docs/bench-history.md,
"affine_qmv v3 design notes".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import cache

import mlx.core as mx

from ds4mlx.kernels.activations import clamped_swiglu, rms_normed
from ds4mlx.kernels.dispatch import INDEX, METAL_DIR, Kernel, auto_face, close_enough, compact, sections, shared_sources

SOURCE = METAL_DIR / "affine_qmv.metal"
BITS = (2, 4, 8)
GROUP_SIZES = (32, 64, 128)
WARPS = 8  # SIMD groups per threadgroup
SMS = 132  # the H200's SMs: grids are sized for BLOCKS threadgroups (two per SM, ~100 registers a thread)
BLOCKS = 2 * SMS
LPT = 4  # 16-byte weight loads per lane and step (two steps in flight: 128 bytes a lane)
RPW = {2: 4, 4: 4, 8: 2}  # rows per warp and step by bit width: x read once from threadgroup memory for RPW rows
MAXIT = 16  # at most this many steps per warp (the epilogue's partial sums: MAXIT * WARPS * RPW floats)
MAX_ROWS = 8  # dense: x rows (tokens) up to this many use the kernel, more use mx.quantized_matmul
XR_MAX = 8  # dense: x rows per threadgroup (each weight read once for them); the kernel takes 1..8
RPW_ROWS = {2: 2, 4: 2, 8: 2}  # rows per warp and step with XR > 1 x rows (XR sums per row: registers)
MAX_PAIRS = 64  # gathered: (token, expert) pairs up to this many use the kernel
SHARED_BYTES = {"metal": 32768, "cuda": 49152}


# the plain kernel's text: these sections of the .metal file, in this order (MODE 3 / 4
# instantiate some of them once per weight bank: `twobank_sources`)
QMV_PARTS = ("qmv_consts", "qmv_shared", "qmv_main", "qmv_epilogue")


def qmv_text() -> str:
    """The plain kernel's body (modes 0-2) as written in the .metal file, before `compact`."""
    sec = sections(SOURCE)
    return "".join(sec[k] for k in QMV_PARTS)


@cache
def kernel_sources(face: str) -> tuple[str, str]:
    header, _ = shared_sources(SOURCE, face, QMV_PARTS[0])
    return compact(header), compact(INDEX[face] + qmv_text())


@cache
def _kernel() -> Kernel:
    return Kernel(
        "ds4mlx_affine_qmv",
        ["x", "w", "scales", "biases", "eids", "wts", "lim", "nw"],
        ["y"],
        metal=kernel_sources("metal"),
        cuda=kernel_sources("cuda"),
    )


@dataclass(frozen=True)
class Plan:
    """One launch's geometry (metal/affine_qmv.metal "Geometry"): KSPLIT warps share a
    row set along K (MODE 2: take KSPLIT experts at a time), each lane NIT chunks of
    RPW rows per step, MAXIT steps per warp, NBY x NZ threadgroups; SW the level slab
    width (8, or 4 for 2- / 4-bit levels with float32 x: the precise one).  Multi-row (MODE 0,
    one dense matrix): each threadgroup takes XR x rows, x staged in KSL slices of K (NIT
    chunks per lane and row each: XR rows of all K do not fit threadgroup memory)."""

    ksplit: int
    nit: int
    rpw: int
    maxit: int
    nby: int
    nz: int
    sw: int
    xr: int = 1
    ksl: int = 1

    def shared_bytes(self, bits: int, warps: int = WARPS) -> int:
        """x' (16 bytes per 4 values), its 16-value sums (8 bytes), the partial sums (of each
        slice, of each x row), the ids (XR > 1, one dense matrix: the NORM's XR sums a warp instead)."""
        vpl = 128 // bits
        x_bytes = self.ksplit * self.nit * vpl * (128 + 16) * self.xr
        return x_bytes + self.maxit * warps * self.rpw * 4 * self.xr + 2 * 4 * MAX_PAIRS


def _pow2_floor(v: float) -> int:
    p = 1
    while 2 * p <= v:
        p *= 2
    return p


def plan(
    mode: int,
    n_rows: int,
    k_dim: int,
    bits: int,
    groups: int,
    *,
    x_div: int = 1,
    ke: int = 1,
    x_dtype=mx.bfloat16,
    face: str = "cuda",
) -> Plan:
    """The geometry for `groups` threadgroup z slices (MODE 0 / 1: x rows, each shared by
    x_div matrices of n_rows rows; MODE 2: tokens, each summing ke experts).  Enough
    16-byte loads per lane that about BLOCKS threadgroups read the whole call (up to
    LPT per step); then as many rows per warp as RPW allows (x reuse), as few warps
    along K as cover a row in those loads, and steps per warp for what is left."""
    chunks = k_dim * bits // 128
    rows_read = n_rows * groups * (ke if mode == 2 else x_div)
    want = max(1, min(LPT, _pow2_floor(rows_read * chunks / (BLOCKS * 32 * WARPS) * 1.5)))
    limit = SHARED_BYTES.get(face, 32768)
    if mode == 2:
        ks = min(2, _pow2_floor(ke), WARPS)  # experts split K: 2 at a time
        nit = -(-chunks // 32)
        rpw = max(1, min(RPW[bits], _pow2_floor(want / nit)))
    else:
        rpw = min(RPW[bits], want)
        if mode == 1:
            rpw = max(2, rpw)  # a gate row and its up row
        nit_want = max(1, want // rpw)
        ks = 1
        while ks < WARPS and -(-chunks // (32 * ks)) > nit_want:
            ks *= 2
        nit = -(-chunks // (32 * ks))
    opw = rpw // 2 if mode == 1 else rpw
    units = (1 if mode == 2 else x_div) * -(-(n_rows // 2 if mode == 1 else n_rows) // opw)
    while True:
        wrows = WARPS // ks
        maxit = max(1, min(MAXIT, -(-groups * units // (wrows * BLOCKS))))
        nby = -(-units // (wrows * maxit))
        maxit = -(-units // (wrows * nby))
        sw = 8 if bits == 8 or x_dtype.size == 2 else 4
        p = Plan(ks, nit, rpw, maxit, nby, groups, sw)
        if p.shared_bytes(bits) <= limit or ks == 1:
            return p
        ks //= 2  # x too large for threadgroup memory split this way: fewer slots
        nit = -(-chunks // (32 * ks)) if mode != 2 else nit


def plan_rows(
    n_rows: int, k_dim: int, bits: int, groups: int, xr: int, *, x_dtype=mx.bfloat16, face: str = "cuda", mode: int = 0
) -> Plan | None:
    """The multi-row geometry of one dense matrix of n_rows rows (MODE 0; MODE 1: a [gate; up]
    matrix, its SwiGLU), `groups` threadgroup z slices of `xr` x rows each, or None when xr rows
    do not fit threadgroup memory.  `plan`'s MODE 0 choices for the weights (loads per lane and
    step, rows per warp, warps along K, steps), then x in K slices: chunks per lane and slice halved (more slices), then fewer warps along K,
    until XR rows of a slice fit (x' and its sums are 4.5 bytes a value and row: K = 4096 is 18 KB
    a row, so XR rows of the whole K never fit Metal's 32 KB).  Each weight unit is read once
    per threadgroup for its xr rows."""
    chunks = k_dim * bits // 128
    lpt = LPT if xr <= 4 else LPT // 2  # 8 rows' sums and x values: 4 loads a step took 136 registers (sm_90)
    want = max(1, min(lpt, _pow2_floor(n_rows * groups * chunks / (BLOCKS * 32 * WARPS) * 1.5)))
    rpw = min(RPW_ROWS[bits], want)
    if mode == 1:
        rpw = max(2, rpw)  # a gate row and its up row
    nit_want = max(1, want // rpw)
    ks = 1
    while ks < WARPS and -(-chunks // (32 * ks)) > nit_want:
        ks *= 2
    units = _units(mode, n_rows, rpw // 2 if mode == 1 else rpw, 1)
    limit = SHARED_BYTES.get(face, 32768)
    sw = _sw(bits, x_dtype)
    while True:
        nit_row = -(-chunks // (32 * ks))  # chunks per lane over the whole row
        nit = min(nit_row, nit_want)
        while True:
            ksl = -(-nit_row // nit)
            nit = -(-nit_row // ksl)  # the kernel's NIT for KSL slices
            wrows = WARPS // ks
            maxit = max(1, min(MAXIT, -(-groups * units // (wrows * BLOCKS))))
            nby = -(-units // (wrows * maxit))
            maxit = -(-units // (wrows * nby))
            p = Plan(ks, nit, rpw, maxit, nby, groups, sw, xr, ksl)
            if p.shared_bytes(bits) <= limit:
                return p
            if nit == 1:
                break
            nit = -(-nit // 2)
        if ks == 1:
            return None
        ks //= 2


def rows_plan(rows: int, n_rows: int, k_dim: int, bits: int, x_dtype, face: str) -> Plan:
    """The plan of a `rows`-row dense call: the fewest threadgroup z slices (XR = ceil(rows / NZ)
    x rows each, XR <= XR_MAX) whose rows fit; XR = 1 (one x row a slice, `plan`) where none does.
    Cached per shape and per value of the module's knobs (tests and the bench's sweep set them)."""
    knobs = (WARPS, BLOCKS, LPT, MAXIT, XR_MAX, RPW_ROWS[bits], SHARED_BYTES.get(face, 32768))
    return _rows_plan(rows, n_rows, k_dim, bits, x_dtype, face, knobs)


@cache
def _rows_plan(rows: int, n_rows: int, k_dim: int, bits: int, x_dtype, face: str, knobs: tuple) -> Plan:
    for nz in range(-(-rows // XR_MAX), rows):
        xr = -(-rows // nz)
        p = plan_rows(n_rows, k_dim, bits, -(-rows // xr), xr, x_dtype=x_dtype, face=face)
        if p is not None:
            return p
    return plan(0, n_rows, k_dim, bits, rows, x_dtype=x_dtype, face=face)


def supported(k_dim: int, group_size: int, bits: int, face: str = "cuda") -> bool:
    if bits not in BITS or group_size not in GROUP_SIZES or k_dim <= 0:
        return False
    if k_dim % group_size or (k_dim * bits) % 128:
        return False
    chunks = k_dim * bits // 128
    one_slot = Plan(1, -(-chunks // 32), max(RPW.values()), MAXIT, 1, 1, 8)
    return one_slot.shared_bytes(bits) <= SHARED_BYTES.get(face, 32768)


@cache
def const_input(kind: str, n: int = 1) -> mx.array:
    a = mx.zeros((n,), mx.int32) if kind == "ids" else mx.ones((n,), mx.float32)
    mx.eval(a)
    return a


@cache
def lim_input(limit: float, eps: float = 0.0) -> mx.array:
    """lim[0] the SwiGLU clamp (0: none), lim[1] = 1.0 (the level trick's bits, read from
    memory so the compiler keeps them in a register), lim[2] the folded RMSNorm's eps."""
    a = mx.array([limit, 1.0, eps], dtype=mx.float32)
    mx.eval(a)
    return a


def _face(backend: str | None) -> str:
    return auto_face("affine_qmv", _self_test) if backend is None else backend


def _moe_face(backend: str | None) -> str:
    """The fused MoE modes (gate_up + SwiGLU, down + weighted sum) have their own
    self-test, run at first use while dispatch.UNVERIFIED_KERNELS lists them."""
    if backend is not None:
        return backend
    face = _face(None)
    if face == "reference":
        return face
    return auto_face("affine_qmv.moe", _moe_self_test)


def kernel_face(k_dim: int, group_size: int, bits: int, moe: bool = False, twobank: bool = False) -> str | None:
    """The GPU face an automatic call would run for this shape (`moe`: the fused MoE
    modes; `twobank`: MODE 3 / 4, a bank of this shape), or None (the reference face, i.e.
    MLX's own op, runs): lets a module pick its fused path."""
    face = twobank_face(None) if twobank else _moe_face(None) if moe else _face(None)
    return face if face != "reference" and supported(k_dim, group_size, bits, face) else None


def template(
    mode,
    pl: Plan,
    x_dtype,
    s_dtype,
    *,
    n_rows,
    k_dim,
    group_size,
    bits,
    x_div=1,
    ke=1,
    dense=False,
    norm=False,
    x_rows=0,
) -> list:
    """The launch's template constants; `x_rows`: the x rows of a multi-row launch (pl.xr > 1)."""
    return [
        ("T", x_dtype),
        ("TS", s_dtype),
        ("N_ROWS", n_rows),
        ("K_DIM", k_dim),
        ("BITS", bits),
        ("GS", group_size),
        ("WARPS", WARPS),
        ("KSPLIT", pl.ksplit),
        ("RPW", pl.rpw),
        ("MAXIT", pl.maxit),
        ("NBY", pl.nby),
        ("X_DIV", x_div),
        ("MODE", mode),
        ("KE", ke),
        ("SW", pl.sw),
        ("DENSE", int(dense)),
        ("NORM", int(norm)),
        ("XR", pl.xr),
        ("KSL", pl.ksl),
        ("XROWS", x_rows if pl.xr > 1 else 0),  # XR = 1: not read (no instance per row count)
    ]


def _launch(
    face,
    mode,
    x2,
    w,
    scales,
    biases,
    eids,
    wts,
    lim,
    *,
    p,
    n_rows,
    k_dim,
    group_size,
    bits,
    x_div=1,
    ke=1,
    nw=None,
    out_shape=None,
    pl=None,
):
    """p pairs (MODE 2: tokens, ke experts each); pairs x_div at a time share an x row; a 2-D
    w is one dense matrix (no expert ids read); `nw` (MODE 0): x is RMS-normed with this
    weight (eps in lim[2]) inside the launch.  The kernel reads x2 and the ids as flat rows
    and writes flat rows: `out_shape` (default [p, rows]) is the caller's shape, so that
    no reshape node comes before or after the launch (each costs host time per token).
    `pl`: the caller's plan (a multi-row one: `rows_plan`), else `plan`'s."""
    if pl is None:
        groups = p if mode == 2 else p // x_div
        pl = plan(mode, n_rows, k_dim, bits, groups, x_div=x_div, ke=ke, x_dtype=x2.dtype, face=face)
    out_rows = n_rows // 2 if mode == 1 else n_rows
    return _kernel()(
        face,
        inputs=[x2, w, scales, biases, eids, wts, lim, wts if nw is None else nw],
        template=template(
            mode,
            pl,
            x2.dtype,
            scales.dtype,
            n_rows=n_rows,
            k_dim=k_dim,
            group_size=group_size,
            bits=bits,
            x_div=x_div,
            ke=ke,
            dense=w.ndim == 2,
            norm=nw is not None,
            x_rows=p,
        ),
        grid=(32 * WARPS, pl.nby, pl.nz),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[out_shape or (p, out_rows)],
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
    norm: tuple | None = None,
) -> mx.array:
    """``x @ dequantize(w).T``: x [..., K] -> [..., N] in x.dtype (mx.quantized_matmul's result).
    `norm` = (weight, eps): of ``mx.fast.rms_norm(x, weight, eps)`` instead, the norm inside
    the launch on a GPU face (one launch less per use: the decode step's q_a norm).  2..MAX_ROWS
    rows: one launch, XR rows a threadgroup (`rows_plan`), each weight read once for XR rows."""
    k_dim = x.shape[-1]
    rows = x.size // max(k_dim, 1)
    face = _face(backend)
    if rows > MAX_ROWS or rows == 0 or w.ndim != 2 or not _usable(face, k_dim, group_size, bits, biases):
        x = rms_normed(x, norm)
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
    if norm is not None and backend is None and auto_face("affine_qmv.norm", _norm_self_test) != face:
        x, norm = rms_normed(x, norm), None  # the norm's own launch
    n_rows = w.shape[0]
    pl = None  # one x row per threadgroup z slice
    if rows > 1 and (backend is not None or auto_face("affine_qmv.rows", _rows_self_test) == face):
        pl = rows_plan(rows, n_rows, k_dim, bits, x.dtype, face)  # XR rows a slice: each weight read once for them
    return _launch(
        face,
        0,
        x,  # [..., K] read as `rows` flat rows
        w,
        scales,
        biases,
        const_input("ids", rows),
        const_input("wts"),
        lim_input(0.0, 0.0 if norm is None else float(norm[1])),
        p=rows,
        n_rows=n_rows,
        k_dim=k_dim,
        group_size=group_size,
        bits=bits,
        nw=None if norm is None else norm[0].astype(x.dtype),
        out_shape=(*x.shape[:-1], n_rows),
        pl=pl,
    )


# --------------------------------------------------------------------------- gathered (experts)


def _pairs(x: mx.array, expert_ids: mx.array):
    if expert_ids.ndim != 2:
        raise ValueError("expert_ids must be [n_tok, k]")
    n, k = expert_ids.shape
    if x.ndim == 2 and x.shape[0] == n:
        return x, k  # one vector per token, shared by its k experts
    if x.ndim >= 3 and x.size == n * k * x.shape[-1] and (x.ndim > 3 or x.shape[:2] == (n, k)):
        return x, 1  # read as n * k flat rows ([n, k, K], or any shape of them: no reshape node)
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
    out_shape: tuple | None = None,
) -> mx.array:
    """``out[t, j] = dequantize(w[expert_ids[t, j]]) @ x[t(, j)]`` -> [n, k, N] in x.dtype
    (`out_shape`: the same values in another shape of n * k * N, written as such by the
    launch)."""
    face = _face(backend)
    k_dim = x.shape[-1]
    n, k = expert_ids.shape
    if n * k > MAX_PAIRS or not _usable(face, k_dim, group_size, bits, biases):
        xr = x.reshape(n, k, k_dim) if x.ndim > 3 else x
        y = _gather_ref(xr, w, scales, biases, expert_ids, group_size, bits)
        return y if out_shape is None else y.reshape(out_shape)
    x2, x_div = _pairs(x, expert_ids)
    y = _launch(
        face,
        0,
        x2,
        w,
        scales,
        biases,
        expert_ids.astype(mx.int32),  # read flat
        const_input("wts"),
        lim_input(0.0),
        p=n * k,
        n_rows=w.shape[1],
        k_dim=k_dim,
        group_size=group_size,
        bits=bits,
        x_div=x_div,
        out_shape=out_shape or (n, k, w.shape[1]),
    )
    return y


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
        const_input("wts"),
        lim_input(float(limit) if limit else 0.0),
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
        lim_input(0.0),
        p=n,
        n_rows=w.shape[1],
        k_dim=k_dim,
        group_size=group_size,
        bits=bits,
        ke=k,
    )
    return y


# --------------------------------------------------------------------------- two weight banks, one launch

# a bank's template constants (suffixed _A / _B in MODE 3 / 4; T, WARPS and NBY are common)
BANK_CONSTS = ("TS", "N_ROWS", "K_DIM", "BITS", "GS", "KSPLIT", "RPW", "MAXIT", "X_DIV", "MODE", "KE", "SW", "DENSE")
BANK_CONSTS += ("NORM", "XR", "KSL", "XROWS")
# bank B's buffers (MODE 4: `red2`, its partial sums next to bank A's)
BANK_B_BUFFERS = {"x": "x2", "w": "w2", "scales": "scales2", "biases": "biases2", "eids": "eids2", "lim": "lim2"}
BANK_B_BUFFERS |= {"y": "y2"}
TWOBANK_INPUTS = ["x", "w", "scales", "biases", "eids", "wts", "lim", "nw"] + [
    "x2",
    "w2",
    "scales2",
    "biases2",
    "eids2",
    "lim2",
]
_IDENT = re.compile(r"(?<![\w.])([A-Za-z_]\w*)")  # an identifier, not a member (`.x`) or a literal's suffix


def renamed(text: str, names: dict) -> str:
    return _IDENT.sub(lambda m: names.get(m.group(1), m.group(1)), text)


def _bank(text: str, bank: str, mode: int) -> str:
    """`text` (compacted) as bank `bank`'s instance: template constants, the constexprs of
    `qmv_consts` and tgz suffixed, bank B's buffers renamed (MODE 4: each bank's partial sums its
    own, bank A's per token of the slice: red_A[h_A])."""
    local = re.findall(r"constexpr\s+\w+\s+(\w+)\s*=", sections(SOURCE)["qmv_consts"])
    names = {n: f"{n}_{bank}" for n in (*BANK_CONSTS, *local, "tgz")}
    if bank == "B":
        names |= BANK_B_BUFFERS | ({"red": "red2"} if mode == 4 else {})
    elif mode == 4:
        names["red"] = "red_A[h_A]"
    return renamed(text, names)


@cache
def twobank_body(mode: int) -> str:
    """The face-independent body (after the face's INDEX) of MODE 3 (gate_up + SwiGLU of two
    banks) or MODE 4 (down + weighted sum of bank A plus the dense down of bank B): the plain
    kernel's sections instantiated per bank (metal/affine_qmv.metal "two weight banks")."""
    sec = sections(SOURCE)
    parts = {k: compact(sec[k]) for k in ("qmv_consts", "qmv_main", "qmv_epilogue")}
    glue = compact(sec["qmv2_gu" if mode == 3 else "qmv2_down"])
    for b in ("A", "B"):
        for k, macro in (("qmv_main", "DS4_QMV_MAIN"), ("qmv_epilogue", "DS4_QMV_EPILOGUE")):
            glue = glue.replace(f"{macro}({b})\n", _bank(parts[k], b, mode))
    assert "DS4_QMV" not in glue
    consts = _bank(parts["qmv_consts"], "A", mode) + _bank(parts["qmv_consts"], "B", mode)
    return consts + compact(sec["qmv2_shared"]) + glue


@cache
def twobank_sources(face: str, mode: int) -> tuple[str, str]:
    """(header, body) of MODE 3 / 4 on `face`: the plain kernel's header, INDEX + `twobank_body`."""
    header, _ = shared_sources(SOURCE, face, QMV_PARTS[0])
    return compact(header), compact(INDEX[face]) + twobank_body(mode)


@cache
def _twobank_kernel(mode: int) -> Kernel:
    name = {3: "ds4mlx_affine_qmv2_gu", 4: "ds4mlx_affine_qmv2_down"}[mode]
    return Kernel(
        name,
        TWOBANK_INPUTS,
        ["y", "y2"] if mode == 3 else ["y"],
        metal=twobank_sources("metal", mode),
        cuda=twobank_sources("cuda", mode),
    )


@dataclass(frozen=True)
class TwoBankPlan:
    """MODE 3 / 4's geometry: each bank's Plan (one NBY); `nz` threadgroup z slices in all.  Bank B
    multi-row (b.xr > 1: the shared expert's weights read once for b.xr tokens): MODE 3 has a.nz
    slices of bank A then b.nz of bank B, MODE 4 b.nz slices of b.xr tokens each."""

    a: Plan
    b: Plan
    nz: int

    def shared_bytes(self, bits_a: int, bits_b: int, mode: int) -> int:
        def x_bytes(p, bits):
            return p.ksplit * p.nit * (128 // bits) * (128 + 16) * p.xr

        red = lambda p: p.maxit * WARPS * p.rpw * 4 * p.xr  # noqa: E731
        # MODE 4: bank A's sums per token of bank B's XR (red_A), bank B's per x row
        reds = max(red(self.a), red(self.b)) if mode == 3 else red(self.a) * self.b.xr + red(self.b)
        return max(x_bytes(self.a, bits_a), x_bytes(self.b, bits_b)) + reds + 2 * 4 * MAX_PAIRS


def _units(mode: int, n_rows: int, opw: int, x_div: int) -> int:
    return (1 if mode == 2 else x_div) * -(-(n_rows // 2 if mode == 1 else n_rows) // opw)


def _with_nby(p: Plan, mode: int, n_rows: int, x_div: int, nby: int) -> Plan:
    """`p` on `nby` threadgroups per z slice (the other bank's): as many steps as that takes."""
    units = _units(mode, n_rows, p.rpw // 2 if mode == 1 else p.rpw, x_div)
    return replace(p, maxit=-(-units // ((WARPS // p.ksplit) * nby)), nby=nby)


def _sw(bits: int, x_dtype) -> int:
    return 8 if bits == 8 or x_dtype.size == 2 else 4


def plan_gu2(n, rows_a, k_a, bits_a, ke, rows_b, k_b, bits_b, *, x_dtype=mx.bfloat16, face="cuda", xr=1):
    """MODE 3: each bank planned as its own MODE 1 launch (bank A: n tokens of ke experts; bank
    B: n tokens, one matrix; xr > 1: `plan_rows`' ceil(n / xr) slices of xr tokens, each weight
    read once for them), then both on the larger NBY; None when threadgroup memory is short."""
    pa = plan(1, rows_a, k_a, bits_a, n, x_div=ke, x_dtype=x_dtype, face=face)
    if xr == 1:
        pb = plan(1, rows_b, k_b, bits_b, n, x_div=1, x_dtype=x_dtype, face=face)
    else:
        pb = plan_rows(rows_b, k_b, bits_b, -(-n // xr), xr, x_dtype=x_dtype, face=face, mode=1)
        if pb is None:
            return None
    nby = max(pa.nby, pb.nby)
    a, b = _with_nby(pa, 1, rows_a, ke, nby), _with_nby(pb, 1, rows_b, 1, nby)
    tp = TwoBankPlan(a, b, a.nz + b.nz)
    return tp if tp.shared_bytes(bits_a, bits_b, 3) <= SHARED_BYTES.get(face, 32768) else None


def plan_down2(n, rows, k_a, bits_a, ke, k_b, bits_b, *, x_dtype=mx.bfloat16, face="cuda", xr=1):
    """MODE 4: bank A planned as its MODE 2 launch; bank B (dense, K split over the same KSPLIT
    warps) takes its rows, steps and threadgroups, so each warp row's units are the same rows
    in both.  Fewer rows per warp where bank B's chunks per lane would exceed LPT loads a step.
    xr > 1: `_plan_down2_rows`."""
    if xr > 1:
        return _plan_down2_rows(n, rows, k_a, bits_a, ke, k_b, bits_b, xr, x_dtype, face)
    pa = plan(2, rows, k_a, bits_a, n, ke=ke, x_dtype=x_dtype, face=face)
    nit_b = -(-(k_b * bits_b // 128) // (32 * pa.ksplit))
    if nit_b * pa.rpw > LPT and pa.rpw > 1:
        rpw = max(1, _pow2_floor(LPT / nit_b))
        units, wrows = -(-rows // rpw), WARPS // pa.ksplit
        maxit = max(1, min(MAXIT, -(-n * units // (wrows * BLOCKS))))
        nby = -(-units // (wrows * maxit))
        pa = Plan(pa.ksplit, pa.nit, rpw, -(-units // (wrows * nby)), nby, n, pa.sw)
    tp = TwoBankPlan(pa, Plan(pa.ksplit, nit_b, pa.rpw, pa.maxit, pa.nby, n, _sw(bits_b, x_dtype)), n)
    return tp if tp.shared_bytes(bits_a, bits_b, 4) <= SHARED_BYTES.get(face, 32768) else None


def _plan_down2_rows(n, rows, k_a, bits_a, ke, k_b, bits_b, xr, x_dtype, face) -> TwoBankPlan | None:
    """MODE 4 multi-row: ceil(n / xr) slices of xr tokens; a slice runs bank A (MODE 2, as `plan`
    splits K for n tokens) token by token, then bank B once for its xr tokens (x in K slices of
    NIT chunks a lane, halved until they fit threadgroup memory, as `plan_rows` does), so the
    shared expert's weights are read once per slice.  About BLOCKS threadgroups in all."""
    nz = -(-n // xr)
    pa = plan(2, rows, k_a, bits_a, n, ke=ke, x_dtype=x_dtype, face=face)
    ks, limit = pa.ksplit, SHARED_BYTES.get(face, 32768)
    nit_row = -(-(k_b * bits_b // 128) // (32 * ks))  # bank B's chunks per lane over its whole row
    rpw = max(1, min(pa.rpw, RPW_ROWS[bits_b]))  # xr sums a row: registers
    nit = min(nit_row, max(1, (LPT if xr <= 4 else LPT // 2) // rpw))
    units, wrows = -(-rows // rpw), WARPS // ks
    maxit = max(1, min(MAXIT, -(-nz * units // (wrows * BLOCKS))))
    nby = -(-units // (wrows * maxit))
    maxit = -(-units // (wrows * nby))
    while True:
        ksl = -(-nit_row // nit)
        nit = -(-nit_row // ksl)  # the kernel's NIT for KSL slices
        a = Plan(ks, pa.nit, rpw, maxit, nby, nz, pa.sw)
        tp = TwoBankPlan(a, Plan(ks, nit, rpw, maxit, nby, nz, _sw(bits_b, x_dtype), xr, ksl), nz)
        if tp.shared_bytes(bits_a, bits_b, 4) <= limit:
            return tp
        if nit == 1:
            return None
        nit = -(-nit // 2)


def twobank_rows_plan(mode: int, n: int, shape: tuple, x_dtype, face: str) -> TwoBankPlan | None:
    """MODE 3 / 4 with bank B multi-row for n > 1 tokens: the fewest bank B slices (xr = ceil(n /
    slices) <= XR_MAX tokens each) whose plan fits; None where none with xr > 1 does.  `shape`:
    `plan_gu2` / `plan_down2`'s positional arguments after n.  Cached per value of the knobs."""
    knobs = (WARPS, BLOCKS, LPT, MAXIT, XR_MAX, tuple(RPW_ROWS.items()), SHARED_BYTES.get(face, 32768))
    return _twobank_rows_plan(mode, n, shape, x_dtype, face, knobs)


@cache
def _twobank_rows_plan(mode, n, shape, x_dtype, face, knobs) -> TwoBankPlan | None:
    planner = plan_gu2 if mode == 3 else plan_down2
    for nz in range(-(-n // XR_MAX), n):
        tp = planner(n, *shape, x_dtype=x_dtype, face=face, xr=-(-n // nz))
        if tp is not None:
            return tp
    return None


def _twobank_plan(mode: int, n: int, shape: tuple, x_dtype, face: str, backend: str | None) -> TwoBankPlan | None:
    """Bank B multi-row where n > 1 tokens and that form runs on this face (a caller's face, or
    the automatic one once it passed its first-use self-test); else the one-row form."""
    if n > 1 and (backend is not None or auto_face("affine_qmv.twobank_rows", _twobank_rows_self_test) == face):
        tp = twobank_rows_plan(mode, n, shape, x_dtype, face)
        if tp is not None:
            return tp
    return (plan_gu2 if mode == 3 else plan_down2)(n, *shape, x_dtype=x_dtype, face=face)


def twobank_template(mode, tp: TwoBankPlan, x_dtype, banks: tuple) -> list:
    """`banks`: per bank a dict of `template`'s keywords (s_dtype, n_rows, k_dim, group_size,
    bits, x_div, ke, dense, x_rows) and its mode."""
    nz_a = tp.a.nz if mode == 3 else tp.nz  # MODE 3: bank A's z slices, then bank B's
    out = [("T", x_dtype), ("WARPS", WARPS), ("NBY", tp.a.nby), ("MODE", mode), ("NZ_A", nz_a)]
    for tag, pl, kw in (("A", tp.a, banks[0]), ("B", tp.b, banks[1])):
        kw = dict(kw)
        m, s_dtype = kw.pop("mode"), kw.pop("s_dtype")
        out += [(f"{k}_{tag}", v) for k, v in template(m, pl, x_dtype, s_dtype, **kw) if k in BANK_CONSTS]
    return out


def twobank_face(backend: str | None = None) -> str:
    """The face MODE 3 / 4 run on: a caller's, or (automatic) the fused MoE modes' GPU face once
    the two-bank kernels pass their own first-use self-test (dispatch.UNVERIFIED_KERNELS)."""
    if backend is not None:
        return backend
    face = _moe_face(None)
    if face == "reference":
        return face
    return auto_face("affine_qmv.twobank", _twobank_self_test)


def _bank_ok(face, k_dim, group_size, bits, biases) -> bool:
    return _usable(face, k_dim, group_size, bits, biases)


def gather_swiglu_shared(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    expert_ids: mx.array,
    shared: tuple,
    *,
    limit: float | None,
    group_size: int,
    bits: int,
    shared_limit: float | None,
    shared_group_size: int,
    shared_bits: int,
    backend: str | None = None,
) -> tuple[mx.array, mx.array]:
    """``(gather_swiglu(x, w, scales, biases, expert_ids, ...), swiglu of the dense [gate; up]
    matrix `shared` = (w [2 I2, K/..], scales, biases) at x)`` -> ([n, k, I], [n, I2]): MODE 3,
    the routed experts' and the shared expert's gate_up + SwiGLU in one launch on a GPU face."""
    ws, ss, bs = shared
    n, k = expert_ids.shape
    face = twobank_face(backend)
    k_dim, two_i, two_i2 = x.shape[-1], w.shape[1], ws.shape[0]
    tp = None
    if (
        face != "reference"
        and n * k <= MAX_PAIRS
        and x.ndim == 2
        and x.shape[0] == n
        and two_i % 2 == 0
        and two_i2 % 2 == 0
        and _bank_ok(face, k_dim, group_size, bits, biases)
        and _bank_ok(face, k_dim, shared_group_size, shared_bits, bs)
    ):
        tp = _twobank_plan(3, n, (two_i, k_dim, bits, k, two_i2, k_dim, shared_bits), x.dtype, face, backend)
    if tp is None:
        h = gather_swiglu(
            x, w, scales, biases, expert_ids, limit=limit, group_size=group_size, bits=bits, backend="reference"
        )
        hs = gather_swiglu(
            x,
            ws[None],
            ss[None],
            bs[None],
            const_input("ids", n).reshape(n, 1),
            limit=shared_limit,
            group_size=shared_group_size,
            bits=shared_bits,
            backend="reference",
        )
        return h, hs.reshape(n, two_i2 // 2)
    shared_bank = dict(s_dtype=ss.dtype, n_rows=two_i2, k_dim=k_dim, group_size=shared_group_size, bits=shared_bits)
    banks = (
        dict(mode=1, s_dtype=scales.dtype, n_rows=two_i, k_dim=k_dim, group_size=group_size, bits=bits, x_div=k),
        shared_bank | dict(mode=1, dense=tp.b.xr > 1, x_rows=n),  # multi-row: the one matrix, no ids read
    )
    y, y2 = _twobank_kernel(3)(
        face,
        inputs=[
            x,
            w,
            scales,
            biases,
            expert_ids.reshape(-1).astype(mx.int32),
            const_input("wts"),
            lim_input(float(limit) if limit else 0.0),
            const_input("wts"),
            x,
            ws,
            ss,
            bs,
            const_input("ids", n),
            lim_input(float(shared_limit) if shared_limit else 0.0),
        ],
        template=twobank_template(3, tp, x.dtype, banks),
        grid=(32 * WARPS, tp.a.nby, tp.nz),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(n * k, two_i // 2), (n, two_i2 // 2)],
        output_dtypes=[x.dtype, x.dtype],
    )
    return y.reshape(n, k, two_i // 2), y2


@dataclass(frozen=True)
class TwoBankLaunch:
    """One MODE 3 / 4 launch's arguments (`down_sum_shared_launch`), for `_twobank_kernel` or a
    kernel that extends its text (kernels/qmv_hc.py)."""

    face: str
    plan: TwoBankPlan
    inputs: list
    template: list


def down_sum_shared_launch(
    h, w, scales, biases, expert_ids, weights, hs, shared, *, group_size, bits, shared_group_size, shared_bits, backend
) -> TwoBankLaunch | None:
    """MODE 4's launch for `gather_down_sum_shared`'s arguments on the face it runs (`backend`,
    or the automatic one), or None where the launch does not take them (the reference face,
    too many pairs, a shape or format the kernel does not take)."""
    ws, ss, bs = shared
    n, k = expert_ids.shape
    face = twobank_face(backend)
    k_dim, k2, rows = h.shape[-1], hs.shape[-1], w.shape[1]
    if not (
        face != "reference"
        and n * k <= MAX_PAIRS
        and h.shape[:-1] == (n, k)
        and hs.shape == (n, k2)
        and hs.dtype == h.dtype
        and ws.shape[0] == rows
        and _bank_ok(face, k_dim, group_size, bits, biases)
        and _bank_ok(face, k2, shared_group_size, shared_bits, bs)
    ):
        return None
    tp = _twobank_plan(4, n, (rows, k_dim, bits, k, k2, shared_bits), h.dtype, face, backend)
    if tp is None:
        return None
    shared_bank = dict(s_dtype=ss.dtype, n_rows=rows, k_dim=k2, group_size=shared_group_size, bits=shared_bits)
    banks = (
        dict(mode=2, s_dtype=scales.dtype, n_rows=rows, k_dim=k_dim, group_size=group_size, bits=bits, ke=k),
        shared_bank | dict(mode=0, dense=True, x_rows=n),
    )
    lim = lim_input(0.0)
    inputs = [h.reshape(n * k, k_dim), w, scales, biases, expert_ids.reshape(-1).astype(mx.int32)]
    inputs += [weights.reshape(-1).astype(mx.float32), lim, lim, hs, ws, ss, bs, const_input("ids", n), lim]
    return TwoBankLaunch(face, tp, inputs, twobank_template(4, tp, h.dtype, banks))


def gather_down_sum_shared(
    h: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    expert_ids: mx.array,
    weights: mx.array,
    hs: mx.array,
    shared: tuple,
    *,
    group_size: int,
    bits: int,
    shared_group_size: int,
    shared_bits: int,
    backend: str | None = None,
) -> mx.array:
    """``gather_down_sum(h, w, ...) + qmv(hs, *shared)`` -> [n, H] in h.dtype: MODE 4, the routed
    experts' down and weighted sum plus the shared expert's down (`shared` = (w [H, I2/..],
    scales, biases), weight 1) in one launch on a GPU face, the sum rounded once."""
    q = dict(group_size=group_size, bits=bits, shared_group_size=shared_group_size, shared_bits=shared_bits)
    call = down_sum_shared_launch(h, w, scales, biases, expert_ids, weights, hs, shared, **q, backend=backend)
    if call is None:
        y = gather_down_sum(
            h, w, scales, biases, expert_ids, weights, group_size=group_size, bits=bits, backend="reference"
        )
        ws, ss, bs = shared
        return y + qmv(hs, ws, ss, bs, group_size=shared_group_size, bits=shared_bits, backend="reference")
    n, rows = expert_ids.shape[0], w.shape[1]
    return _twobank_kernel(4)(
        call.face,
        inputs=call.inputs,
        template=call.template,
        grid=(32 * WARPS, call.plan.a.nby, call.plan.nz),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(n, rows)],
        output_dtypes=[h.dtype],
    )[0]


# --------------------------------------------------------------------------- first-use self-test


def _inputs(bits, gs, key, k_dim=512, dtype=mx.float32):
    rows, e = 6, 3
    wq, sc, bi = mx.quantize(mx.random.normal((e, rows, k_dim), key=key) * 0.05, gs, bits)
    ids = mx.array([[0, 2], [1, 1]], dtype=mx.int32)
    x = mx.random.normal((2, k_dim), key=key).astype(dtype)
    h = mx.random.normal((2, 2, k_dim), key=key).astype(dtype)
    return wq, sc.astype(dtype), bi.astype(dtype), ids, x, h


def _close(got, want, dtype) -> bool:
    """float32: summation order; 16-bit: an output rounding apart (results near 1)."""
    tol = 1e-3 if dtype == mx.float32 else 2e-2
    return close_enough(got, want, rtol=tol, atol=tol / 10 if dtype == mx.float32 else tol)


# (bits, group size, K, dtype): bfloat16 runs the decode path (8-bit slabs, 16-byte x loads);
# 4096 8-bit values split K over all 8 warps
_SELF_TEST_CASES = ((2, 32, 512, mx.bfloat16), (4, 64, 512, mx.float32), (8, 128, 4096, mx.bfloat16))


def _self_test(face: str) -> bool:
    """The plain mode (dense and gathered) at 2, 4 and 8 bits on tiny shapes (odd row
    counts, lanes past the row's end, split K) against the reference face."""
    key = mx.random.key(7)
    ok = True
    for bits, gs, k_dim, dt in _SELF_TEST_CASES:
        wq, sc, bi, ids, x, h = _inputs(bits, gs, key, k_dim, dt)
        d = (wq[0], sc[0], bi[0])
        ok = ok and _close(
            qmv(x[:1], *d, group_size=gs, bits=bits, backend=face),
            qmv(x[:1], *d, group_size=gs, bits=bits, backend="reference"),
            dt,
        )
        for xx in (x, h):
            ok = ok and _close(
                gather_qmv(xx, wq, sc, bi, ids, group_size=gs, bits=bits, backend=face),
                gather_qmv(xx, wq, sc, bi, ids, group_size=gs, bits=bits, backend="reference"),
                dt,
            )
    return ok


def _norm_self_test(face: str) -> bool:
    """The plain mode with the RMSNorm folded in (bfloat16, the decode step's q_a norm, and
    float32) against the reference face (mx.fast.rms_norm, then the mat-vec)."""
    key = mx.random.key(9)
    ok = True
    for bits, gs, k_dim, dt in _SELF_TEST_CASES:
        wq, sc, bi, _, x, _ = _inputs(bits, gs, key, k_dim, dt)
        nw = (1.0 + 0.2 * mx.random.normal((k_dim,), key=key)).astype(dt)
        d = (wq[0], sc[0], bi[0])
        kw = dict(group_size=gs, bits=bits, norm=(nw, 1e-6))
        ok = ok and _close(qmv(x[:1], *d, **kw, backend=face), qmv(x[:1], *d, **kw, backend="reference"), dt)
    return ok


# (bits, group size, K, dtype, x rows, NORM, weight rows): 8-bit K = 4096 bfloat16 (the decode path:
# 8 rows a threadgroup, K slices; 3000 weight rows: several steps a warp, the slices' sums in `red`),
# 2-bit (XR limited by threadgroup memory: z slices of 4 and 3 rows on CUDA, 3, 3 and 1 on Metal),
# 4-bit float32 with the norm folded in, 8-bit float32 with the norm (K slices, each warp's sums
# carried over them in registers)
_ROWS_SELF_TEST_CASES = (
    (8, 64, 4096, mx.bfloat16, 8, False, 3000),
    (2, 32, 4096, mx.bfloat16, 7, False, 37),
    (4, 64, 512, mx.float32, 5, True, 37),
    (8, 128, 4096, mx.float32, 3, True, 37),
)


def _float32_reference(x, wq, sc, bi, *, group_size, bits, norm):
    """The reference face computed in float32 on the same (16-bit) values, rounded to x's dtype
    once at the end: MLX's 16-bit quantized matmul accumulates in 16 bits, ~0.04 off the exact
    sum at K = 4096 (H100: this kernel was 0.005 off, MLX's bfloat16 op 0.04), so it is no
    reference for a kernel that accumulates in float32."""
    f32 = mx.float32
    nrm = None if norm is None else (norm[0].astype(f32), norm[1])
    y = qmv(
        x.astype(f32),
        wq,
        sc.astype(f32),
        bi.astype(f32),
        group_size=group_size,
        bits=bits,
        norm=nrm,
        backend="reference",
    )
    return y.astype(x.dtype)


def _rows_self_test(face: str) -> bool:
    """The multi-row plain mode (XR x rows a threadgroup, x in K slices; with and without the
    folded RMSNorm) against the float32 reference and against one launch per row (the verified
    one-row kernel: the same sums, only the x rows shared)."""
    keys = mx.random.split(mx.random.key(11), 3)  # independent w, x, norm (one key made x = w's rows)
    ok = True
    for bits, gs, k_dim, dt, rows, norm, n_rows in _ROWS_SELF_TEST_CASES:
        wq, sc, bi = mx.quantize(mx.random.normal((n_rows, k_dim), key=keys[0]) * 0.05, gs, bits)
        sc, bi = sc.astype(dt), bi.astype(dt)
        x = mx.random.normal((rows, k_dim), key=keys[1]).astype(dt)
        nw = (1.0 + 0.2 * mx.random.normal((k_dim,), key=keys[2])).astype(dt)
        kw = dict(group_size=gs, bits=bits, norm=(nw, 1e-6) if norm else None)
        got = qmv(x, wq, sc, bi, **kw, backend=face)
        each = mx.concatenate([qmv(x[i : i + 1], wq, sc, bi, **kw, backend=face) for i in range(rows)])
        ok = ok and _close(got, _float32_reference(x, wq, sc, bi, **kw), dt) and _close(got, each, dt)
    return ok


def _moe_self_test(face: str) -> bool:
    """The fused MoE modes at 2 bits (bfloat16, the decode path) and 4 bits (float32)
    against the reference."""
    key = mx.random.key(8)
    ok = True
    wts = mx.array([[0.25, 0.75], [0.5, 0.5]])
    for bits, gs, dt in ((2, 64, mx.bfloat16), (4, 32, mx.float32)):
        wq, sc, bi, ids, x, h = _inputs(bits, gs, key, 512, dt)
        ok = ok and _close(
            gather_swiglu(x, wq, sc, bi, ids, limit=1.0, group_size=gs, bits=bits, backend=face),
            gather_swiglu(x, wq, sc, bi, ids, limit=1.0, group_size=gs, bits=bits, backend="reference"),
            dt,
        )
        ok = ok and _close(
            gather_down_sum(h, wq, sc, bi, ids, wts, group_size=gs, bits=bits, backend=face),
            gather_down_sum(h, wq, sc, bi, ids, wts, group_size=gs, bits=bits, backend="reference"),
            dt,
        )
    return ok


def _twobank_pair(face: str, x, h, ids, wts, routed: tuple, sgu: tuple, sdn: tuple, kw: dict) -> tuple:
    """MODE 3 then MODE 4 on `face` -> (h [n, k, I], hs [n, I2], y [n, H]): the routed bank's one
    matrix is both the gate_up (at x) and the down (at h), the shared expert's gate_up `sgu` at
    x, its down `sdn` at h's first expert's rows."""
    got = gather_swiglu_shared(x, *routed, ids, sgu, limit=1.0, shared_limit=0.5, **kw, backend=face)
    return (*got, gather_down_sum_shared(h, *routed, ids, wts, h[:, 0], sdn, **kw, backend=face))


def _twobank_self_test(face: str) -> bool:
    """MODE 3 and 4 (2-bit experts with an 8-bit shared expert, bfloat16: the decode path; 4-bit
    with 8-bit, float32) against the reference (the two launches' expressions), one token a
    launch (the multi-row form has its own test)."""
    key = mx.random.key(10)
    ok = True
    wts = mx.array([[0.25, 0.75], [0.5, 0.5]])
    for bits, gs, bits2, gs2, dt in ((2, 64, 8, 64, mx.bfloat16), (4, 32, 8, 128, mx.float32)):
        wq, sc, bi, ids, x, h = _inputs(bits, gs, key, 512, dt)
        sq, ssc, sbi = mx.quantize(mx.random.normal((6, 512), key=key) * 0.05, gs2, bits2)
        sh = (sq, ssc.astype(dt), sbi.astype(dt))
        kw = dict(group_size=gs, bits=bits, shared_group_size=gs2, shared_bits=bits2)
        for t in range(2):
            one = (x[t : t + 1], h[t : t + 1], ids[t : t + 1], wts[t : t + 1], (wq, sc, bi), sh, sh, kw)
            ok = ok and all(
                _close(g, w, dt) for g, w in zip(_twobank_pair(face, *one), _twobank_pair("reference", *one))
            )
    return ok


# (routed bits, gs, shared bits, gs, dtype, tokens): V4 Flash's formats in bfloat16 (3 tokens: one
# slice of 3), 4-bit + 8-bit float32 at 8 tokens (K slices of the shared expert's x)
_TWOBANK_ROWS_SELF_TEST_CASES = ((2, 64, 8, 64, mx.bfloat16, 3), (4, 32, 8, 128, mx.float32, 8))


def _twobank_rows_self_test(face: str) -> bool:
    """MODE 3 and 4 with the shared expert multi-row (n tokens sharing each of its weight loads)
    against the reference and against one launch per token (the verified one-row form: the same
    sums, only the shared expert's weight loads shared)."""
    keys = mx.random.split(mx.random.key(12), 4)
    ok = True
    k_dim, e, k = 1024, 4, 2
    for bits, gs, bits2, gs2, dt, n in _TWOBANK_ROWS_SELF_TEST_CASES:
        wq, sc, bi = mx.quantize(mx.random.normal((e, k_dim, k_dim), key=keys[0]) * 0.03, gs, bits)
        sq, ssc, sbi = mx.quantize(mx.random.normal((2 * k_dim, k_dim), key=keys[1]) * 0.03, gs2, bits2)
        routed, sgu = (wq, sc.astype(dt), bi.astype(dt)), (sq, ssc.astype(dt), sbi.astype(dt))
        sdn = tuple(a[:k_dim] for a in sgu)
        ids = (mx.arange(n * k, dtype=mx.int32) * 3 % e).reshape(n, k)
        wts = mx.softmax(mx.random.normal((n, k), key=keys[2]), axis=-1)
        x = mx.random.normal((n, k_dim), key=keys[3]).astype(dt)
        h = mx.random.normal((n, k, k_dim), key=keys[2]).astype(dt)
        kw = dict(group_size=gs, bits=bits, shared_group_size=gs2, shared_bits=bits2)
        got = _twobank_pair(face, x, h, ids, wts, routed, sgu, sdn, kw)
        # the reference in float32 on the same values (MLX's 16-bit quantized matmul sums in 16 bits:
        # `_float32_reference`), rounded once
        f32 = lambda t: tuple(a if a.dtype == mx.uint32 else a.astype(mx.float32) for a in t)  # noqa: E731
        want = _twobank_pair("reference", *f32((x, h)), ids, wts, f32(routed), f32(sgu), f32(sdn), kw)
        want = [w.astype(dt) for w in want]
        rows = [(x[t : t + 1], h[t : t + 1], ids[t : t + 1], wts[t : t + 1]) for t in range(n)]
        each = [_twobank_pair(face, *r, routed, sgu, sdn, kw) for r in rows]
        for i, g in enumerate(got):
            ok = ok and _close(g, want[i], dt) and _close(g, mx.concatenate([o[i] for o in each]), dt)
    return ok
