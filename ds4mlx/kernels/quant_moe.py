"""Quantized MoE: selected-expert mat-vec / mat-mul straight from GGUF blocks.

ds4's routed experts are GGUF IQ2_XXS (gate, up) and Q2_K (down), or Q4_K in the
4-bit files; Q8_0 is supported as well.  An expert stack is an ``mx.array``
uint8 ``[E, rows, bytes_per_row]`` (the GGUF tensor ``[E, rows, K]`` in its
on-disk bytes; each row is K/256 (K/32 for Q8_0) consecutive blocks).

Public API
----------
``gather_qmv(x, w_blocks, qtype, expert_ids)``    decode: fused decode-and-dot, x staged in shared memory
``gather_qmm(x, w_blocks, qtype, expert_ids)``    prefill: pairs sorted by expert on the device,
                                                   the stack dequantized, one grouped GEMM (no host sync)
``gather_qmatmul(...)``                            picks one of the two by size
``gather_swiglu_blocks(x, gate, up, qtype, ids, *, limit)``  decode, one launch: ``silu(min(g, limit)) *
                                                   clip(u, -limit, limit)`` of two expert banks -> ``[n_tok, k, I]``
``gather_down_sum_blocks(h, down, qtype, ids, weights)``     decode, one launch: ``sum_j weights[t, j] *
                                                   down_{ids[t, j]} . h[t, j]`` -> ``[n_tok, H]``
``moe_face(qtype)``                                the GPU face those two run on by themselves, or None
``gather_dequantize(w_blocks, qtype, ids)``       ``[M, rows, K]`` weights of experts ``ids``
``dequantize_mx(blocks, qtype, k)``                MLX-ops decoding of ``[..., row_bytes]`` rows

``x`` is ``[n_tok, K]`` (every selected expert sees the token's vector: gate / up)
or ``[n_tok, k, K]`` (one vector per selected expert: down); ``expert_ids`` is
``[n_tok, k]``; the result is ``[n_tok, k, rows]`` in ``x.dtype``.

Three faces (see `ds4mlx.kernels.dispatch`): the reference face decodes blocks
with MLX ops (bit-identical to `ds4mlx.io.quant.dequantize`) and multiplies in
float32; the Metal face (``kernels/metal/quant_moe.metal``) and its CUDA twin (below,
sharing the file's ``common`` / ``qmv`` / ``dequant`` sections verbatim) decode
with the same float operations and accumulate in float32 per lane, then reduce
over the 32 lanes of a SIMD group / warp.  The qmv layout (16-value slices per
lane, x transposed in shared memory, QMV_ROWS_PER_WARP rows per SIMD group)
is explained at the top of the .metal file.

Verified: the reference face on CPU (tests/test_quant_moe.py); the shared kernel
text compiled with g++ (decoding bit-exact) and nvcc; the CUDA face by ``pytest -m gpu``
(qmv within the float32 bound, dequant bit-exact, prefill, bfloat16); which faces are still
self-tested at first use is `dispatch.UNVERIFIED_FACES` / `UNVERIFIED_KERNELS`.
Measured speeds: docs/bench-history.md, "Quantized-MoE decode kernel".
Its launch constants (QMV_WARPS, QMV_ROWS_PER_WARP) were reasoned, not swept,
and so is `QMV_MAX_PAIRS_AUTO`.

The two fused MoE modes (the decode step is bound by launches, not bytes: seven launches
per layer for GGUF experts became two) reuse qmv's layout in the file's `qmv_swiglu` /
`qmv_down_sum` sections (auto_face names `MOE_KERNELS`).

The dequant kernel (prefill) keeps its stores coalesced: a warp's lanes decode 32
consecutive chunks of a row into shared memory, then write them out contiguously
(auto_face names `DEQUANT_KERNELS`).
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import numpy as np

from ds4mlx.io.quant import (
    QT,
    as_qtype,
    grouped_gemm_rows,
    iq2xxs_grid,
    iq2xxs_grid_u64,
    iq2xxs_sign_table,
    random_gguf_blocks,
    row_bytes,
)
from ds4mlx.kernels.activations import clamped_swiglu
from ds4mlx.kernels.dispatch import METAL_DIR, Kernel, auto_face, close_enough, sections

SUPPORTED = (QT.Q8_0, QT.Q2_K, QT.Q4_K, QT.IQ2_XXS)
SOURCE = METAL_DIR / "quant_moe.metal"
QMV_WARPS = 8  # SIMD groups per threadgroup in the qmv kernel (all on one pair)
# Output rows per SIMD group: each x value read from shared memory serves this many
# rows, and their weight loads are in flight together.  4 rather than 2: for the V4
# Flash shapes nvcc (sm_90) then gives 48-64 registers, so the 3072 / 6144 SIMD groups
# of a gate-up / down call fit in about one wave of 32-40 resident groups per SM.
QMV_ROWS_PER_WARP = 4
# qmv stages x as float32 in threadgroup memory, plus 2 KB of IQ2_XXS lattice:
# (7680 + 512) * 4 bytes is Metal's 32 KB limit (CUDA's static limit is 48 KB).
QMV_MAX_K = 7680
MAX_PAIRS_QMV = 65535  # CUDA grid-z limit for the qmv launch
QMV_MAX_PAIRS_AUTO = 64  # gather_qmatmul: above this many (token, expert) pairs, use qmm
# Fused modes: output rows per SIMD group.  swiglu: 2 output rows = 4 weight rows in flight, as
# qmv's 4; down_sum: 2, so a token's H rows still make ~H / 16 groups (its k experts are a loop).
# Reasoned, not swept.
SWIGLU_RPW = 2
DOWN_SUM_RPW = 2
MOE_KERNELS = {t: f"quant_moe.moe.{t.name}" for t in SUPPORTED}  # their auto_face names
# The dequant kernel's thread group: a SIMD group / warp per row, its lanes on 32 consecutive
# chunks (the kernel text assumes this shape: it is not a tuning knob).
DEQUANT_GROUP = (32, 4, 1)
# auto_face names of the dequant kernel (coalesced stores), self-tested at first use while
# dispatch.UNVERIFIED_KERNELS lists them
DEQUANT_KERNELS = {t: f"quant_moe.dequant.{t.name}" for t in SUPPORTED}

# The CUDA face: prelude and index computation.  Everything else is the shared text.
CUDA_PRELUDE = r"""
#include <cuda_fp16.h>
#define DS4_FN __device__ __forceinline__
#define DEV
#define THR
#define SHR
#define CONSTANT __constant__
#define DS4_SHARED __shared__
__device__ __forceinline__ float ds4_f16(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ float ds4_as_float(uint32_t u) { return __uint_as_float(u); }
__device__ __forceinline__ float ds4_flip(float x, uint32_t b) { return __uint_as_float(__float_as_uint(x) ^ (b << 31)); }
__device__ __forceinline__ uint32_t ds4_ld16(const uint8_t* p) { return (uint32_t)*(const uint16_t*)p; }
__device__ __forceinline__ uint32_t ds4_ld32(const uint8_t* p) { return *(const uint32_t*)p; }
__device__ __forceinline__ uint32_t ds4_magic_byte(uint32_t v, uint32_t i) { return __byte_perm(v, 0x4B000000u, 0x7650u | i); }
__device__ __forceinline__ float ds4_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ void ds4_tg_barrier() { __syncthreads(); }
__device__ __forceinline__ uint32_t ds4_popcount(uint32_t v) { return (uint32_t)__popc(v); }
"""
CUDA_PRELUDE_FUSED = "__device__ __forceinline__ float ds4_exp(float x) { return expf(x); }\n"

CUDA_INDEX_QMV = r"""
const uint32_t tid = threadIdx.x;
const uint32_t lane = tid & 31u;
const uint32_t warp = tid >> 5;
const uint32_t tgy = blockIdx.y;
const uint32_t pair = blockIdx.z;
"""

CUDA_INDEX_DEQUANT = r"""
const uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;
const uint32_t row = blockIdx.y * blockDim.y + threadIdx.y;
const uint32_t m = blockIdx.z * blockDim.z + threadIdx.z;
"""


def _grid_define() -> str:
    vals = ", ".join(f"0x{int(v):016x}ull" for v in iq2xxs_grid_u64())
    return f"#define DS4_IQ2XXS_GRID_VALUES {vals}\n"


FUSED_KINDS = ("qmv_swiglu", "qmv_down_sum")


def block_header(qtype, face: str) -> str:
    """The header every kernel on `qtype`'s GGUF blocks starts with on `face`: the face's
    prelude, the IQ2_XXS lattice and the `common` section (the block decoders), with
    DS4_CHUNK / DS4_DOT16 / DS4_GRID_ROWS naming `qtype`'s (kernels/grouped_qmm.py uses it too)."""
    qtype = as_qtype(qtype)
    sec = sections(SOURCE)
    name = qtype.name.lower()
    return (
        (sec["prelude_metal"] if face == "metal" else CUDA_PRELUDE)
        + _grid_define()
        + sec["common"]
        + f"#define DS4_CHUNK ds4_chunk_{name}\n#define DS4_DOT16 ds4_dot16_{name}\n"
        + f"#define DS4_GRID_ROWS {256 if qtype == QT.IQ2_XXS else 1}\n"
    )


def kernel_sources(kind: str, qtype, face: str) -> tuple[str, str]:
    """(header, body) of kernel `kind` ('qmv', 'dequant' or one of FUSED_KINDS) for `qtype` on `face`."""
    sec = sections(SOURCE)
    if face == "metal":
        index = sec["index_dequant_metal" if kind == "dequant" else "index_qmv_metal"]
    else:
        index = CUDA_INDEX_DEQUANT if kind == "dequant" else CUDA_INDEX_QMV
    header = block_header(qtype, face)
    if kind in FUSED_KINDS:
        header += (sec["prelude_fused_metal"] if face == "metal" else CUDA_PRELUDE_FUSED) + sec["fused"]
    return header, index + sec[kind]


_INPUTS = {
    "qmv": ["x", "w", "eids"],
    "dequant": ["w", "eids"],
    "qmv_swiglu": ["x", "wg", "wu", "eids", "lim"],
    "qmv_down_sum": ["x", "w", "eids", "wts"],
}


@cache
def _kernel(kind: str, qtype: QT) -> Kernel:
    name = f"ds4mlx_{kind}_{qtype.name.lower()}"
    inputs = _INPUTS[kind]
    return Kernel(
        name, inputs, ["y"], metal=kernel_sources(kind, qtype, "metal"), cuda=kernel_sources(kind, qtype, "cuda")
    )


# --------------------------------------------------------------------------- reference decoding


def check_blocks(w_blocks: mx.array, qtype) -> tuple[QT, int, int, int]:
    """(qtype, experts, rows, K) of a uint8 [E, rows, row_bytes] bank of a SUPPORTED type; else ValueError."""
    qtype = as_qtype(qtype)
    if qtype not in SUPPORTED:
        raise ValueError(f"quantized MoE supports {[t.name for t in SUPPORTED]}, not {qtype.name}")
    if w_blocks.ndim != 3 or w_blocks.dtype != mx.uint8:
        raise ValueError("w_blocks must be a uint8 [E, rows, bytes_per_row] array")
    e, rows, rb = w_blocks.shape
    elems, nbytes = _block(qtype)
    if rb % nbytes:
        raise ValueError(f"{rb} bytes per row is not a whole number of {qtype.name} blocks")
    return qtype, e, rows, rb // nbytes * elems


def _block(qtype: QT) -> tuple[int, int]:
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qtype]


def _f16(lo: mx.array, hi: mx.array) -> mx.array:
    bits = lo.astype(mx.uint16) | (hi.astype(mx.uint16) << 8)
    return bits.view(mx.float16).astype(mx.float32)


def _u32(b: mx.array) -> mx.array:
    b = b.astype(mx.uint32)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


@cache
def _tables():
    return (mx.array(iq2xxs_grid().astype(np.float32)), mx.array(iq2xxs_sign_table()))


def q4k_scale_min(s: mx.array):
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = mx.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1)
    m = mx.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, m


def _decode_blocks(b: mx.array, qtype: QT) -> mx.array:
    """[..., nb, block_bytes] uint8 -> [..., nb, block_elems] float32."""
    lead = b.shape[:-1]
    if qtype == QT.Q8_0:
        d = _f16(b[..., 0], b[..., 1])[..., None]
        return b[..., 2:].view(mx.int8).astype(mx.float32) * d
    if qtype == QT.Q2_K:
        sc = b[..., 0:16]
        d = _f16(b[..., 80], b[..., 81])[..., None]
        dmin = _f16(b[..., 82], b[..., 83])[..., None]
        dl = (d * (sc & 15).astype(mx.float32))[..., None]
        ml = (dmin * (sc >> 4).astype(mx.float32))[..., None]
        qs = b[..., 16:80].reshape(*lead, 2, 1, 32)
        q = (qs >> mx.array([0, 2, 4, 6], dtype=mx.uint8).reshape(4, 1)) & 3
        q = q.reshape(*lead, 16, 16).astype(mx.float32)
        return (dl * q - ml).reshape(*lead, 256)
    if qtype == QT.Q4_K:
        d = _f16(b[..., 0], b[..., 1])[..., None]
        dmin = _f16(b[..., 2], b[..., 3])[..., None]
        sc, m = q4k_scale_min(b[..., 4:16])
        dl = (d * sc.astype(mx.float32))[..., None]
        ml = (dmin * m.astype(mx.float32))[..., None]
        qs = b[..., 16:144].reshape(*lead, 4, 1, 32)
        q = (qs >> mx.array([0, 4], dtype=mx.uint8).reshape(2, 1)) & 15
        q = q.reshape(*lead, 8, 32).astype(mx.float32)
        return (dl * q - ml).reshape(*lead, 256)
    if qtype == QT.IQ2_XXS:
        grid, signs = _tables()
        d = _f16(b[..., 0], b[..., 1])[..., None]
        qs = b[..., 2:66].reshape(*lead, 8, 8)
        aux = _u32(qs[..., 4:8])  # [..., 8]
        db = d * (0.5 + (aux >> 28).astype(mx.float32)) * 0.25
        g = grid[qs[..., 0:4].astype(mx.uint32)]  # [..., 8, 4, 8]
        sidx = (aux[..., None] >> mx.array([0, 7, 14, 21], dtype=mx.uint32)) & 127
        return (db[..., None, None] * g * signs[sidx]).reshape(*lead, 256)
    raise AssertionError(qtype)


def dequantize_mx(blocks: mx.array, qtype, k: int) -> mx.array:
    """MLX-ops decoding: uint8 ``[..., row_bytes]`` rows of `k` values -> float32
    ``[..., k]``, bit-identical to `ds4mlx.io.quant.dequantize`."""
    qtype = as_qtype(qtype)
    elems, nbytes = _block(qtype)
    if blocks.shape[-1] != row_bytes(qtype, k):
        raise ValueError(f"{blocks.shape[-1]} bytes do not hold {k} {qtype.name} values")
    lead = blocks.shape[:-1]
    out = _decode_blocks(blocks.reshape(*lead, k // elems, nbytes), qtype)
    return out.reshape(*lead, k)


# --------------------------------------------------------------------------- shared plumbing


def _pairs(x: mx.array, expert_ids: mx.array, k_dim: int):
    """Flatten to pairs: (x2 [NX, K], eids [P] int32, xids [P] int32, n_tok, k)."""
    if expert_ids.ndim != 2:
        raise ValueError("expert_ids must be [n_tok, k]")
    n_tok, k = expert_ids.shape
    eids = expert_ids.reshape(-1).astype(mx.int32)
    if x.ndim == 2:
        if x.shape != (n_tok, k_dim):
            raise ValueError(f"x must be [{n_tok}, {k_dim}], got {x.shape}")
        xids = mx.repeat(mx.arange(n_tok, dtype=mx.int32), k)
        return x, eids, xids, n_tok, k
    if x.ndim == 3:
        if x.shape != (n_tok, k, k_dim):
            raise ValueError(f"x must be [{n_tok}, {k}, {k_dim}], got {x.shape}")
        return x.reshape(n_tok * k, k_dim), eids, mx.arange(n_tok * k, dtype=mx.int32), n_tok, k
    raise ValueError("x must be [n_tok, K] or [n_tok, k, K]")


def _face(backend: str | None, qtype: QT) -> str:
    """The caller's face, or the automatic one (self-tested where unverified)."""
    if backend is not None:
        return backend
    return auto_face(f"quant_moe.{qtype.name}", lambda face: _self_test(face, qtype))


def _self_test(face: str, qtype: QT) -> bool:
    """Both kernels of `qtype` on `face` against the reference on a tiny expert bank:
    decode mat-vec (shared and per-pair x, an odd row count) and dequantization (exact)."""
    blocks = random_gguf_blocks(qtype, 3, 5, 512, seed=11)
    ids = mx.array([[0, 2], [1, 1]], dtype=mx.int32)
    ok = True
    for x in (mx.random.normal((2, 512), key=mx.random.key(1)), mx.random.normal((2, 2, 512), key=mx.random.key(2))):
        ok = ok and close_enough(
            gather_qmv(x, blocks, qtype, ids, backend=face), gather_qmv(x, blocks, qtype, ids, backend="reference")
        )
    want = gather_dequantize(blocks, qtype, [2, 0], backend="reference")
    return ok and bool(mx.array_equal(gather_dequantize(blocks, qtype, [2, 0], backend=face), want).item())


def _dequant_face(backend: str | None, qtype: QT) -> str:
    """The caller's face, or the automatic one for the dequant kernel: the plain kernels'
    face, then the dequant kernel's own first-use self-test while dispatch.UNVERIFIED_KERNELS
    lists it (its text changed after the GPU run that cleared the others)."""
    if backend is not None:
        return backend
    face = _face(None, qtype)
    if face == "reference":
        return face
    return auto_face(DEQUANT_KERNELS[qtype], lambda f: _dequant_self_test(f, qtype))


def _dequant_self_test(face: str, qtype: QT) -> bool:
    """The dequant kernel on `face` against the reference, bit for bit, float32 and bfloat16:
    5 rows (a thread group's last warp past the end) of 40 chunks (a full warp's 32 chunks,
    then a partial warp's 8), experts repeated and out of order."""
    blocks = random_gguf_blocks(qtype, 3, 5, 1280, seed=15)
    ids = [2, 0, 2]
    for dt in (mx.float32, mx.bfloat16):
        got = gather_dequantize(blocks, qtype, ids, dt, backend=face)
        want = gather_dequantize(blocks, qtype, ids, dt, backend="reference")
        if got.dtype != dt or got.shape != want.shape:
            return False
        if not bool(mx.array_equal(got.view(mx.uint16), want.view(mx.uint16)).item()):
            return False
    return True


# --------------------------------------------------------------------------- gathered dequantization


def gather_dequantize(w_blocks: mx.array, qtype, ids, dtype=mx.float32, *, backend=None) -> mx.array:
    """Weights of experts `ids` ([M] ints): ``[M, rows, K]`` in `dtype`."""
    qtype, _, rows, k_dim = check_blocks(w_blocks, qtype)
    ids = mx.array(ids).astype(mx.int32).reshape(-1)
    face = _dequant_face(backend, qtype)
    if face == "reference":
        return dequantize_mx(w_blocks[ids], qtype, k_dim).astype(dtype)
    m = ids.shape[0]
    gx, gy, _ = DEQUANT_GROUP
    return _kernel("dequant", qtype)(
        face,
        inputs=[w_blocks, ids],
        template=[("T", dtype), ("N_ROWS", rows), ("K_DIM", k_dim), ("ROW_BYTES", w_blocks.shape[2])],
        # whole thread groups: a warp's lanes write the chunks its lanes decoded (all must exist)
        grid=(-(-(k_dim // 32) // gx) * gx, -(-rows // gy) * gy, m),
        threadgroup=DEQUANT_GROUP,
        output_shapes=[(m, rows, k_dim)],
        output_dtypes=[dtype],
    )[0]


# --------------------------------------------------------------------------- decode: mat-vec


def gather_qmv(x: mx.array, w_blocks: mx.array, qtype, expert_ids: mx.array, *, backend=None) -> mx.array:
    """``out[t, j, r] = sum_h W[expert_ids[t, j]][r, h] * x[t(, j), h]`` -> ``[n_tok, k, rows]``."""
    qtype, _, rows, k_dim = check_blocks(w_blocks, qtype)
    x2, eids, xids, n_tok, k = _pairs(x, expert_ids, k_dim)
    face = _face(backend, qtype)
    if face == "reference":
        w = dequantize_mx(w_blocks[eids], qtype, k_dim)  # [P, rows, K]
        xs = x2[xids].astype(mx.float32)[..., None]  # [P, K, 1]
        out = (w @ xs)[..., 0]
    else:
        p = eids.shape[0]
        if p > MAX_PAIRS_QMV or k_dim > QMV_MAX_K:
            return gather_qmm(x, w_blocks, qtype, expert_ids, backend=face)
        rows_per_group = QMV_WARPS * QMV_ROWS_PER_WARP
        # xids is not passed: pair p reads x row p // X_DIV (x2 has n_tok rows when
        # 2-D, one per pair when 3-D), one gather op less per call
        out = _kernel("qmv", qtype)(
            face,
            inputs=[x2, w_blocks, eids],
            template=[
                ("T", x.dtype),
                ("N_ROWS", rows),
                ("K_DIM", k_dim),
                ("ROW_BYTES", w_blocks.shape[2]),
                ("WARPS", QMV_WARPS),
                ("RPW", QMV_ROWS_PER_WARP),
                ("X_DIV", k if x.ndim == 2 else 1),
            ],
            # whole threadgroups only: every thread of a group helps stage x
            grid=(32 * QMV_WARPS, -(-rows // rows_per_group), p),
            threadgroup=(32 * QMV_WARPS, 1, 1),
            output_shapes=[(p, rows)],
            output_dtypes=[x.dtype],
        )[0]
    return out.astype(x.dtype).reshape(n_tok, k, rows)


# --------------------------------------------------------------------------- prefill: mat-mul


# Dequantized weights gather_qmm holds at once: the V4 Flash stack of one projection
# (256 x 2048 x 4096) in float16 is 4 GiB, one block; a larger stack is done in blocks
# of output rows (every expert's rows r0..r1: each block is the same grouped GEMM over
# all pairs for those output columns, no work wasted).
MAX_DEQUANT_BYTES = 6 << 30
# On a GPU the dequantized weights (and the pairs' inputs) are float16 when x is
# float32: half the bytes of float32 and tensor-core GEMMs, with the 10-bit mantissa
# of the TF32 that MLX's CUDA float32 matmuls use anyway.  float32 on the CPU.
GPU_DEQUANT_DTYPE = mx.float16


def _dequant_dtype(x_dtype):
    if mx.default_device().type == mx.DeviceType.cpu:
        return mx.float32  # the CPU GatherMM kernel is float32-only
    return GPU_DEQUANT_DTYPE if x_dtype == mx.float32 else x_dtype


def gather_qmm(
    x: mx.array,
    w_blocks: mx.array,
    qtype,
    expert_ids: mx.array,
    *,
    backend=None,
    max_dequant_bytes: int = MAX_DEQUANT_BYTES,
    sorted_indices: bool = False,
) -> mx.array:
    """Same result as `gather_qmv`, for many tokens (prefill), with no host sync: the
    (token, expert) pairs are sorted by expert on the device, the expert stack is
    dequantized (in blocks of output rows of at most `max_dequant_bytes`, through
    `gather_dequantize`) and every block is one grouped GEMM,
    ``mx.gather_mm(..., sorted_indices=True)`` (MLX's grouped GEMM on CUDA).
    `sorted_indices`: the pairs are already in expert order (SwitchGLU sorts them).

    At prefill sizes (thousands of pairs) nearly every expert is used, so the whole
    stack is dequantized rather than the used experts found on the host.  Weights are
    dequantized to float32 on the CPU, float16 on a GPU (`GPU_DEQUANT_DTYPE`) when x
    is float32, else to x.dtype (float32 on the CPU, whose gather_mm is float32-only).
    """
    qtype, n_exp, rows, k_dim = check_blocks(w_blocks, qtype)
    x2, eids, xids, n_tok, k = _pairs(x, expert_ids, k_dim)
    face = _dequant_face(backend, qtype)
    wdt = _dequant_dtype(x.dtype)
    order = None
    if not sorted_indices:
        order = mx.argsort(eids)
        eids, xids = eids[order], xids[order]
    # [P, 1, K] by a reshape, not `[:, None, :]`: MLX's sorted gather_mm takes the row stride from
    # axis -2, which an inserted axis may give as 1 (wrong rows: ml-explore/mlx#4253, fixed for
    # Metal in #3960); a reshape of [P, K] gives K.  The suspected cause of the GPU failure of
    # test_gpu_dequant_bit_exact_and_qmm on MLX 0.32.4 CUDA.
    xs = (x2 if x.ndim == 3 and order is None else x2[xids]).astype(wdt).reshape(-1, 1, k_dim)
    per_row = n_exp * k_dim * wdt.size
    step = max(1, min(rows, int(max_dequant_bytes // max(per_row, 1))))
    # and each block's bank under the grouped GEMM's 32-bit byte offsets: a whole V4 Flash
    # stack (256 x 2048 x 4096) in float16 is 4 GiB (an illegal access, seen once)
    step = min(step, grouped_gemm_rows(n_exp, rows, k_dim, wdt.size))
    every = mx.arange(n_exp, dtype=mx.int32)
    outs = []
    for r0 in range(0, rows, step):
        part = w_blocks if step >= rows else w_blocks[:, r0 : r0 + step]  # GGUF rows are independent
        w = gather_dequantize(part, qtype, every, wdt, backend=face)  # [E, rows', K]
        outs.append(mx.gather_mm(xs, w.swapaxes(-1, -2), rhs_indices=eids, sorted_indices=True))  # [P, 1, rows']
    out = (outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1))[:, 0]
    if order is not None:
        out = out[mx.argsort(order)]  # back to (token, slot) order
    return out.astype(x.dtype).reshape(n_tok, k, rows)


def gather_qmm_host_grouped(
    x: mx.array, w_blocks: mx.array, qtype, expert_ids: mx.array, *, backend=None, max_dequant_bytes: int = 1 << 30
) -> mx.array:
    """The former prefill path, kept as the benchmark's baseline: the pairs are grouped
    by expert on the host (one synchronisation per call), each used expert is
    dequantized once and its rows are one plain matmul (one launch per used expert)."""
    qtype, _, rows, k_dim = check_blocks(w_blocks, qtype)
    x2, eids, xids, n_tok, k = _pairs(x, expert_ids, k_dim)
    face = _dequant_face(backend, qtype)
    wdt = mx.float32 if x.dtype == mx.float32 else x.dtype
    eids_np, xids_np = np.array(eids), np.array(xids)
    order = np.argsort(eids_np, kind="stable")
    used, starts, counts = np.unique(eids_np[order], return_index=True, return_counts=True)
    per_expert = rows * k_dim * (4 if wdt == mx.float32 else 2)
    chunk = max(1, int(max_dequant_bytes // max(per_expert, 1)))
    segs = []
    for c0 in range(0, len(used), chunk):
        ids = used[c0 : c0 + chunk]
        w = gather_dequantize(w_blocks, qtype, mx.array(ids.astype(np.int32)), wdt, backend=face)
        for j in range(len(ids)):
            sel = order[starts[c0 + j] : starts[c0 + j] + counts[c0 + j]]
            xe = x2[mx.array(xids_np[sel].astype(np.int32))].astype(wdt)  # [n_e, K]
            segs.append(xe @ w[j].T)  # [n_e, rows]
    if not segs:
        return mx.zeros((n_tok, k, rows), x.dtype)
    inv = np.empty_like(order)
    inv[order] = np.arange(order.size)
    out = mx.concatenate(segs, axis=0)[mx.array(inv.astype(np.int32))]
    return out.astype(x.dtype).reshape(n_tok, k, rows)


def gather_qmatmul(
    x: mx.array, w_blocks: mx.array, qtype, expert_ids: mx.array, *, backend=None, sorted_indices: bool = False
) -> mx.array:
    """`gather_qmv` for few (token, expert) pairs (decode), `gather_qmm` for many (prefill)."""
    pairs = expert_ids.shape[0] * expert_ids.shape[1]
    if pairs <= QMV_MAX_PAIRS_AUTO:
        return gather_qmv(x, w_blocks, qtype, expert_ids, backend=backend)
    return gather_qmm(x, w_blocks, qtype, expert_ids, backend=backend, sorted_indices=sorted_indices)


# --------------------------------------------------------------------------- decode: the fused MoE modes


def _moe_face(backend: str | None, qtype: QT) -> str:
    """The caller's face, or the automatic one: the plain kernels' face, then the fused
    modes' own first-use self-test while dispatch.UNVERIFIED_KERNELS lists them."""
    if backend is not None:
        return backend
    face = _face(None, qtype)
    if face == "reference":
        return face
    return auto_face(MOE_KERNELS[qtype], lambda f: _moe_self_test(f, qtype))


def moe_face(qtype) -> str | None:
    """The GPU face `gather_swiglu_blocks` / `gather_down_sum_blocks` run on by themselves,
    or None (the reference face): lets a module pick its fused path."""
    qtype = as_qtype(qtype)
    if qtype not in SUPPORTED:
        return None
    face = _moe_face(None, qtype)
    return None if face == "reference" else face


def _clamp(limit) -> float:
    return float(limit) if limit and limit > 0 else 0.0


def _moe_launchable(face: str, pairs: int, k_dim: int) -> bool:
    return face != "reference" and pairs <= QMV_MAX_PAIRS_AUTO and k_dim <= QMV_MAX_K


def gather_swiglu_blocks(
    x: mx.array,
    gate_blocks: mx.array,
    up_blocks: mx.array,
    qtype,
    expert_ids: mx.array,
    *,
    limit: float | None,
    backend=None,
) -> mx.array:
    """``silu(min(g, limit)) * clip(u, -limit, limit)`` with ``g``, ``u`` the gate and up
    experts (two banks of one type and shape) times x [n_tok, K] -> [n_tok, k, I] in x.dtype;
    no clamp for limit None / <= 0.  One launch at decode sizes on a GPU face; elsewhere
    today's unfused expression (two mat-vecs, `activations.clamped_swiglu`)."""
    qtype, _, rows, k_dim = check_blocks(gate_blocks, qtype)
    if up_blocks.shape != gate_blocks.shape:
        raise ValueError(f"gate {gate_blocks.shape} and up {up_blocks.shape} banks differ in shape")
    if x.ndim != 2:
        raise ValueError("x must be [n_tok, K]: a token's k experts share its vector")
    x2, eids, _, n_tok, k = _pairs(x, expert_ids, k_dim)
    lim = _clamp(limit)
    face = _moe_face(backend, qtype)
    if not _moe_launchable(face, eids.shape[0], k_dim):
        g = gather_qmatmul(x, gate_blocks, qtype, expert_ids, backend=face)
        u = gather_qmatmul(x, up_blocks, qtype, expert_ids, backend=face)
        return clamped_swiglu(g, u.astype(g.dtype), lim or None)
    p = eids.shape[0]
    y = _kernel("qmv_swiglu", qtype)(
        face,
        inputs=[x2, gate_blocks, up_blocks, eids, _lim(lim)],
        template=[
            ("T", x.dtype),
            ("N_ROWS", rows),
            ("K_DIM", k_dim),
            ("ROW_BYTES", gate_blocks.shape[2]),
            ("WARPS", QMV_WARPS),
            ("RPW", SWIGLU_RPW),
            ("X_DIV", k),
        ],
        grid=(32 * QMV_WARPS, -(-rows // (QMV_WARPS * SWIGLU_RPW)), p),
        threadgroup=(32 * QMV_WARPS, 1, 1),
        output_shapes=[(p, rows)],
        output_dtypes=[x.dtype],
    )[0]
    return y.reshape(n_tok, k, rows)


def gather_down_sum_blocks(
    h: mx.array, down_blocks: mx.array, qtype, expert_ids: mx.array, weights: mx.array, *, backend=None
) -> mx.array:
    """``sum_j weights[t, j] * down_{expert_ids[t, j]} . h[t, j]`` for h [n_tok, k, I] ->
    [n_tok, H] in h.dtype.  One launch at decode sizes on a GPU face (weights multiply the
    float32 dot products); elsewhere today's unfused expression (each expert's output in
    h.dtype, times its weight, summed over k)."""
    qtype, _, rows, k_dim = check_blocks(down_blocks, qtype)
    if h.ndim != 3:
        raise ValueError("h must be [n_tok, k, I]: one vector per selected expert")
    x2, eids, _, n_tok, k = _pairs(h, expert_ids, k_dim)
    if weights.shape != expert_ids.shape:
        raise ValueError(f"weights {weights.shape} must match expert_ids {expert_ids.shape}")
    face = _moe_face(backend, qtype)
    if not _moe_launchable(face, eids.shape[0], k_dim):
        y = gather_qmatmul(h, down_blocks, qtype, expert_ids, backend=face)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)
    return _kernel("qmv_down_sum", qtype)(
        face,
        inputs=[x2, down_blocks, eids, weights.reshape(-1).astype(mx.float32)],
        template=[
            ("T", h.dtype),
            ("N_ROWS", rows),
            ("K_DIM", k_dim),
            ("ROW_BYTES", down_blocks.shape[2]),
            ("WARPS", QMV_WARPS),
            ("RPW", DOWN_SUM_RPW),
            ("KE", k),
        ],
        grid=(32 * QMV_WARPS, -(-rows // (QMV_WARPS * DOWN_SUM_RPW)), n_tok),
        threadgroup=(32 * QMV_WARPS, 1, 1),
        output_shapes=[(n_tok, rows)],
        output_dtypes=[h.dtype],
    )[0]


@cache
def _lim(limit: float) -> mx.array:
    a = mx.array([limit], dtype=mx.float32)
    mx.eval(a)  # a constant: kept (not replayed) while a decode step is traced
    return a


def _moe_self_test(face: str, qtype: QT) -> bool:
    """Both fused modes on a tiny bank against the reference face: float32 and bfloat16
    activations, clamped and not, an odd row count (rows past the end of a SIMD group)."""
    gate = random_gguf_blocks(qtype, 3, 5, 512, seed=12)
    up = random_gguf_blocks(qtype, 3, 5, 512, seed=13)
    down = random_gguf_blocks(qtype, 3, 7, 512, seed=14)
    ids = mx.array([[0, 2], [1, 1]], dtype=mx.int32)
    wts = mx.array([[0.25, 0.75], [0.5, 0.5]])
    ok = True
    for dt, tol in ((mx.float32, 1e-3), (mx.bfloat16, 2e-2)):
        x = mx.random.normal((2, 512), key=mx.random.key(3)).astype(dt)
        h = mx.random.normal((2, 2, 512), key=mx.random.key(4)).astype(dt)
        for limit in (None, 0.5):
            ok = ok and close_enough(
                gather_swiglu_blocks(x, gate, up, qtype, ids, limit=limit, backend=face),
                gather_swiglu_blocks(x, gate, up, qtype, ids, limit=limit, backend="reference"),
                rtol=tol,
                atol=tol / 10,
            )
        ok = ok and close_enough(
            gather_down_sum_blocks(h, down, qtype, ids, wts, backend=face),
            gather_down_sum_blocks(h, down, qtype, ids, wts, backend="reference"),
            rtol=tol,
            atol=tol / 10,
        )
    return ok
