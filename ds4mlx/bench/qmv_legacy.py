"""The affine quantized mat-vec kernel as it was before the v3 rewrite (commit 3f36e47),
kept for the kernel bench's old-vs-new table only (`bench.kernels --qmv`): the same
inputs and results as `kernels.affine_qmv`, its own text and launch geometry (x staged
per threadgroup of 4-row warps, up to 8 warps along K, a mask and an or per level,
the sums of x recomputed by every lane).  Nothing else imports it."""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from ds4mlx.kernels.dispatch import INDEX, PRELUDE, Kernel

WARPS = 8
RPW = 4
KSPLIT_MAX = 8

COMMON = r"""DS4_FN float ds4_silu(float v) {
    return v / (1.0f + ds4_exp(-v));
}

"""

QMV = r"""constexpr int VPL = 128 / BITS;                   // values per 16-byte chunk
constexpr int CHUNKS = K_DIM / VPL;               // chunks per row
constexpr int WPR = K_DIM * BITS / 32;            // words per row
constexpr int GPR = K_DIM / GS;                   // groups per row
constexpr int SEG = VPL < GS ? VPL : GS;          // values of one segment (chunk within one group)
constexpr int NSEG = VPL / SEG;                   // segments per chunk
constexpr int WPS = 4 / NSEG;                     // words per segment
constexpr int VPW = 32 / BITS;                    // values per word
constexpr int SW = BITS == 8 ? 8 : 4;             // slab width: levels moved together below bit 23
constexpr int LPS = SW / BITS;                    // levels per slab
constexpr int SPW = 32 / SW;                      // slabs per word
constexpr int LANES = 32 * KSPLIT;                // threads along K
constexpr int NIT = (CHUNKS + LANES - 1) / LANES; // steps along K
constexpr int WROWS = WARPS / KSPLIT;             // warp rows per threadgroup
constexpr int OPW = MODE == 1 ? RPW / 2 : RPW;    // output rows per warp row
constexpr int OUT_ROWS = MODE == 1 ? N_ROWS / 2 : N_ROWS;
constexpr int NX4 = NIT * (VPL / 4) * LANES;      // staged float4s
constexpr int NJ = MODE == 2 ? KE : 1;            // x vectors (experts) per threadgroup
constexpr uint32_t LMASK = (1u << BITS) - 1u;
DS4_SHARED float4 xs[NX4];
DS4_SHARED float red[WARPS * RPW];

const uint32_t kl = (warp % uint32_t(KSPLIT)) * 32u + lane;
const uint32_t wrow = warp / uint32_t(KSPLIT);
const uint32_t orow0 = (tgy * uint32_t(WROWS) + wrow) * uint32_t(OPW);
const uint32_t nthreads = uint32_t(WARPS) * 32u;

float acc[RPW];
uint32_t prow[RPW];
#pragma unroll
for (int i = 0; i < RPW; ++i) {
    acc[i] = 0.0f;
    uint32_t o = orow0 + uint32_t(MODE == 1 ? (i % OPW) : i);
    o = o < uint32_t(OUT_ROWS) ? o : uint32_t(OUT_ROWS - 1);   // rows past the end: read a real row, write nothing
    prow[i] = (MODE == 1 && i >= OPW) ? o + uint32_t(OUT_ROWS) : o;
}

for (int j = 0; j < NJ; ++j) {
    const uint32_t pj = MODE == 2 ? tgz * uint32_t(KE) + uint32_t(j) : tgz;
    const uint32_t xrow = MODE == 2 ? pj : pj / uint32_t(X_DIV);
    const uint32_t e = uint32_t(eids[pj]);
    const float wj = MODE == 2 ? wts[pj] : 1.0f;
    const DS4_DEV T* xp = x + uint64_t(xrow) * uint64_t(K_DIM);
    // this thread's weights, scales and biases first: their loads are in flight
    // while the block stages x
    const uint64_t ebase = uint64_t(e) * uint64_t(N_ROWS);
    uint32_t wv[NIT][RPW][4];
    float sc[NIT][RPW][NSEG];
    float bi[NIT][RPW][NSEG];
    #pragma unroll
    for (int it = 0; it < NIT; ++it) {
        const uint32_t c = uint32_t(it) * uint32_t(LANES) + kl;
        const uint32_t cc = c < uint32_t(CHUNKS) ? c : uint32_t(CHUNKS - 1);   // past the row: a real chunk, unused
        #pragma unroll
        for (int i = 0; i < RPW; ++i) {
            const uint64_t r = ebase + uint64_t(prow[i]);
            const uint4 v = ((const DS4_DEV uint4*)(w + r * uint64_t(WPR)))[cc];
            wv[it][i][0] = v.x;
            wv[it][i][1] = v.y;
            wv[it][i][2] = v.z;
            wv[it][i][3] = v.w;
            #pragma unroll
            for (int s = 0; s < NSEG; ++s) {
                const uint64_t g = r * uint64_t(GPR) + uint64_t((cc * uint32_t(VPL) + uint32_t(s * SEG)) / uint32_t(GS));
                sc[it][i][s] = static_cast<float>(scales[g]);
                bi[it][i][s] = static_cast<float>(biases[g]);
            }
        }
    }
    if (j > 0) {
        ds4_tg_barrier();   // every thread is done with the previous expert's x
    }
    // stage x' = x * 2^(SW - o), transposed: values 4q..4q+3 of chunk c at
    // xs[((c / LANES) * (VPL/4) + q) * LANES + c % LANES]
    for (uint32_t i = tid; i < uint32_t(K_DIM / 4); i += nthreads) {
        const uint32_t k0 = 4u * i;
        const uint32_t c = k0 / uint32_t(VPL);
        const uint32_t q = (k0 % uint32_t(VPL)) / 4u;
        const uint32_t at = ((c / uint32_t(LANES)) * uint32_t(VPL / 4) + q) * uint32_t(LANES) + c % uint32_t(LANES);
        // value k0 + a is level (a % LPS) of its slab (k0 is a multiple of 4, LPS divides 4)
        xs[at].x = static_cast<float>(xp[k0 + 0u]) * float(1 << (SW - (0 % LPS) * BITS));
        xs[at].y = static_cast<float>(xp[k0 + 1u]) * float(1 << (SW - (1 % LPS) * BITS));
        xs[at].z = static_cast<float>(xp[k0 + 2u]) * float(1 << (SW - (2 % LPS) * BITS));
        xs[at].w = static_cast<float>(xp[k0 + 3u]) * float(1 << (SW - (3 % LPS) * BITS));
    }
    ds4_tg_barrier();

    #pragma unroll
    for (int it = 0; it < NIT; ++it) {
        const uint32_t c = uint32_t(it) * uint32_t(LANES) + kl;
        if (c >= uint32_t(CHUNKS)) {
            break;
        }
        const uint32_t xbase = uint32_t(it) * uint32_t(VPL / 4) * uint32_t(LANES) + kl;
        #pragma unroll
        for (int s = 0; s < NSEG; ++s) {
            float tsum[RPW];
            #pragma unroll
            for (int i = 0; i < RPW; ++i) {
                tsum[i] = 0.0f;
            }
            float sxp = 0.0f;   // sum of x' over the segment
            float sx = 0.0f;    // sum of x
            #pragma unroll
            for (int ww = 0; ww < WPS; ++ww) {
                const int wi = s * WPS + ww;      // word of the chunk
                float xv[VPW];
                #pragma unroll
                for (int q = 0; q < VPW / 4; ++q) {
                    const float4 a = xs[xbase + uint32_t(wi * (VPW / 4) + q) * uint32_t(LANES)];
                    xv[4 * q + 0] = a.x;
                    xv[4 * q + 1] = a.y;
                    xv[4 * q + 2] = a.z;
                    xv[4 * q + 3] = a.w;
                }
                #pragma unroll
                for (int v = 0; v < VPW; ++v) {
                    sxp += xv[v];
                    sx += xv[v] * (1.0f / float(1 << (SW - (v % LPS) * BITS)));
                }
                #pragma unroll
                for (int i = 0; i < RPW; ++i) {
                    const uint32_t word = wv[it][i][wi];
                    #pragma unroll
                    for (int b = 0; b < SPW; ++b) {
                        // slab b (bits b*SW .. b*SW+SW-1) to bits 23-SW .. 22
                        const int sh = (23 - SW) - b * SW;
                        const uint32_t slab = sh >= 0 ? (word << uint32_t(sh)) : (word >> uint32_t(-sh));
                        #pragma unroll
                        for (int f = 0; f < LPS; ++f) {
                            const uint32_t bits = 0x3F800000u | (slab & (LMASK << uint32_t(23 - SW + f * BITS)));
                            tsum[i] += ds4_as_float(bits) * xv[b * LPS + f];
                        }
                    }
                }
            }
            #pragma unroll
            for (int i = 0; i < RPW; ++i) {
                acc[i] += wj * (sc[it][i][s] * (tsum[i] - sxp) + bi[it][i][s] * sx);
            }
        }
    }
}

// reduce: lanes, then the KSPLIT warps of a warp row
#pragma unroll
for (int i = 0; i < RPW; ++i) {
    const float v = ds4_warp_sum(acc[i]);
    if (lane == 0u) {
        red[warp * uint32_t(RPW) + uint32_t(i)] = v;
    }
}
ds4_tg_barrier();
if (tid < uint32_t(WROWS * OPW)) {
    const uint32_t wr = tid / uint32_t(OPW);
    const uint32_t i = tid % uint32_t(OPW);
    const uint32_t orow = (tgy * uint32_t(WROWS) + wr) * uint32_t(OPW) + i;
    float a = 0.0f;
    float u = 0.0f;
    #pragma unroll
    for (int ks = 0; ks < KSPLIT; ++ks) {
        const uint32_t wsrc = wr * uint32_t(KSPLIT) + uint32_t(ks);
        a += red[wsrc * uint32_t(RPW) + i];
        if (MODE == 1) {
            u += red[wsrc * uint32_t(RPW) + uint32_t(OPW) + i];
        }
    }
    if (orow < uint32_t(OUT_ROWS)) {
        if (MODE == 1) {
            const float l = lim[0];
            if (l > 0.0f) {
                a = a < l ? a : l;
                u = u < l ? (u > -l ? u : -l) : l;
            }
            a = ds4_silu(a) * u;
        }
        y[uint64_t(tgz) * uint64_t(OUT_ROWS) + orow] = static_cast<T>(a);
    }
}
"""


@cache
def _kernel() -> Kernel:
    faces = {f: (PRELUDE[f] + COMMON, INDEX[f] + QMV) for f in ("metal", "cuda")}
    return Kernel("ds4mlx_legacy_qmv", ["x", "w", "scales", "biases", "eids", "wts", "lim"], ["y"], **faces)


def launch_shape(k_dim: int, bits: int) -> tuple[int, int, int]:
    vpl = 128 // bits
    chunks = k_dim // vpl
    ksplit = 1
    while ksplit < min(WARPS, KSPLIT_MAX) and 32 * ksplit < chunks:
        ksplit *= 2
    lanes = 32 * ksplit
    nit = -(-chunks // lanes)
    return ksplit, nit, nit * (vpl // 4) * lanes


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


@cache
def _ones(n: int, kind: str = "f") -> mx.array:
    a = mx.zeros((n,), mx.int32) if kind == "i" else mx.ones((n,), mx.float32)
    mx.eval(a)
    return a


def qmv(x, w, scales, biases, *, group_size, bits, face):
    """x [rows, K] @ dequantize(w [N, K]).T -> [rows, N]."""
    rows, k_dim = x.shape
    return _launch(
        face,
        0,
        x,
        w,
        scales,
        biases,
        _ones(rows, "i"),
        _ones(1),
        _ones(1),
        p=rows,
        n_rows=w.shape[0],
        k_dim=k_dim,
        group_size=group_size,
        bits=bits,
    )


def gather_qmv(x, w, scales, biases, expert_ids, *, group_size, bits, face):
    """x [n, K] (shared by a token's k experts) or [n, k, K] -> [n, k, N]."""
    n, k = expert_ids.shape
    x2, x_div = (x, k) if x.ndim == 2 else (x.reshape(n * k, x.shape[-1]), 1)
    y = _launch(
        face,
        0,
        x2,
        w,
        scales,
        biases,
        expert_ids.reshape(-1),
        _ones(1),
        _ones(1),
        p=n * k,
        n_rows=w.shape[1],
        k_dim=x.shape[-1],
        group_size=group_size,
        bits=bits,
        x_div=x_div,
    )
    return y.reshape(n, k, w.shape[1])


def gather_swiglu(x, w, scales, biases, expert_ids, *, limit, group_size, bits, face):
    """x [n, K], w [E, 2I, K] -> silu(min(g, limit)) * clip(u, -limit, limit) [n, k, I]."""
    n, k = expert_ids.shape
    lim = mx.array([float(limit) if limit else 0.0], dtype=mx.float32)
    y = _launch(
        face,
        1,
        x,
        w,
        scales,
        biases,
        expert_ids.reshape(-1),
        _ones(1),
        lim,
        p=n * k,
        n_rows=w.shape[1],
        k_dim=x.shape[-1],
        group_size=group_size,
        bits=bits,
        x_div=k,
    )
    return y.reshape(n, k, w.shape[1] // 2)


def gather_down_sum(h, w, scales, biases, expert_ids, weights, *, group_size, bits, face):
    """h [n, k, I] -> sum_j weights[:, j] * (w[ids[:, j]] @ h[:, j]) [n, N]."""
    n, k = expert_ids.shape
    return _launch(
        face,
        2,
        h.reshape(n * k, h.shape[-1]),
        w,
        scales,
        biases,
        expert_ids.reshape(-1),
        weights.reshape(-1).astype(mx.float32),
        _ones(1),
        p=n,
        n_rows=w.shape[1],
        k_dim=h.shape[-1],
        group_size=group_size,
        bits=bits,
        ke=k,
    )
