// ds4mlx affine quantized mat-vec: MLX's own packing (mx.quantize, mode "affine",
// 2 / 4 / 8 bits, group size 32 / 64 / 128, scales and biases in any float type),
// for decode: one (or a few) x vectors against a weight matrix, or against the
// routed experts a token selected (expert ids read on the device).
//
// This file is a set of `// @@ name` sections assembled by
// ds4mlx/kernels/affine_qmv.py: the same `common` and `qmv` text for the Metal
// and the CUDA face, after the face's prelude and index block
// (ds4mlx/kernels/dispatch.py PRELUDE / INDEX: DS4_*, ds4_*, tid / lane / warp /
// tgx / tgy / tgz).
//
// Inputs: x [NX, K_DIM] T, w [E, N_ROWS, K_DIM*BITS/32] uint32, scales / biases
// [E, N_ROWS, K_DIM/GS] TS, eids [P] int32 (the expert of each pair; a dense
// matrix is E = 1 with eids all 0), wts [P] float32 (MODE 2), lim [1] float32
// (MODE 1: the SwiGLU clamp, <= 0 for none).
// MODE 0: y [P, N_ROWS]; pair p = tgz multiplies x row p / X_DIV by W[eids[p]].
// MODE 1: W holds [gate; up] (N_ROWS = 2I rows); y [P, I] = silu(min(g, lim)) *
//         clip(u, -lim, lim) of the two halves (the routed experts' gate_up).
// MODE 2: y [NT, N_ROWS] = sum_j wts[t*KE+j] * W[eids[t*KE+j]] . x[t*KE+j]
//         (the routed experts' down projection and their weighted sum; tgz = t).
//
// Layout (grid (32*WARPS, ceil(OUT_ROWS / (WROWS*OPW)), P or NT) threads,
// threadgroup (32*WARPS, 1, 1)):
//   * a "chunk" is 16 bytes of a weight row (4 words, VPL = 128/BITS values);
//     KSPLIT warps share the rows of a warp row, thread kl = (warp % KSPLIT)*32
//     + lane reads chunks kl, kl + 32*KSPLIT, ... of each of its RPW rows: one
//     16-byte load per row per step, coalesced across the warp;
//   * x is staged once per threadgroup in shared memory as float32, transposed
//     so that a thread's chunk values are one conflict-free float4 access per 4
//     values, and prescaled (below);
//   * a level becomes a float with no conversion instruction: the SW-bit slab
//     that holds it (SW = 4, or 8 at 8 bits) is shifted to bits 23-SW..22 (one
//     shift per slab, shared by its SW/BITS levels), and OR-ing the level's bits
//     (at p = 23 - SW + o, o its offset in the slab) into 1.0f gives
//     1 + q*2^(o-SW).  With x' = x*2^(SW-o) staged, t = (1 + q*2^(o-SW)) * x'
//     = x' + q*x, so over a segment (the values of one chunk in one group)
//     sum q*x = sum t - sum x', and the row gets scale * (sum t - sum x') +
//     bias * sum x.  The sums of x' and x of a segment are formed once per
//     thread for all its rows.  Error: the float32 sum of t runs over terms up to
//     2^SW |x| (2^SW >= 2^BITS, the size of q*x), so a segment's sum q*x carries
//     about (SEG + 8) * 2^-23 * 2^SW * sum|x| of rounding: at 4 and 8 bits the
//     order of a plain float32 dot product's, at 2 bits 4x that;
//   * per-thread partial sums are reduced by a warp sum, then across the KSPLIT
//     warps through shared memory.

// @@ common
DS4_FN float ds4_silu(float v) {
    return v / (1.0f + ds4_exp(-v));
}

// @@ qmv
constexpr int VPL = 128 / BITS;                   // values per 16-byte chunk
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
