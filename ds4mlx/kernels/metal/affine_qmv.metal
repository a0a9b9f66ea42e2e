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
// matrix is E = 1, DENSE = 1, and eids is not read), wts [P] float32 (MODE 2), lim [3] float32
// (lim[0]: MODE 1's SwiGLU clamp, <= 0 for none; lim[1] = 1.0, see "levels"; lim[2] NORM's
// eps), nw [K_DIM] T (NORM, MODE 0: x is RMS-normed with this weight first; else a dummy).
// MODE 0: y [P, N_ROWS]; pair p multiplies x row p / X_DIV by W[eids[p]].  One dense matrix
//         may take XR > 1 x rows a threadgroup ("multi-row" below; XROWS = P of them).
// MODE 1: W holds [gate; up] (N_ROWS = 2I rows); y [P, I] = silu(min(g, lim)) *
//         clip(u, -lim, lim) of the two halves (the routed experts' gate_up).
// MODE 2: y [NT, N_ROWS] = sum_j wts[t*KE+j] * W[eids[t*KE+j]] . x[t*KE+j]
//         (the routed experts' down projection and their weighted sum).
// MODE 3 / 4 (the end of this file): two weight banks of different formats in one launch,
//         the routed experts' and the shared expert's gate_up + SwiGLU (3), their down
//         projections summed (4); the sections qmv_consts .. qmv_epilogue instantiated per bank.
//         The plain kernel is those four sections in order (affine_qmv.py QMV_PARTS).
//
// Geometry (grid (32*WARPS, NBY, NZ) threads, threadgroup (32*WARPS, 1, 1);
// affine_qmv.py `plan` picks the numbers per shape):
//   * a "chunk" is 16 bytes of a weight row (4 words, VPL = 128/BITS values).  A
//     warp reads RPW rows, lane l chunks l, l + LANES_X, ...  (NIT of them): one
//     16-byte load per row and chunk, 512 contiguous bytes per warp and load;
//   * MODE 0 / 1: threadgroup z = one x row (the X_DIV = NPAIR pairs that share it:
//     the k experts of a token's gate_up, or one dense matrix).  KSPLIT warps
//     share a row set along K (a "warp row"); a "unit" is (pair, RPW rows);
//     warp row g of NBY*WROWS takes units g, g + NBY*WROWS, ... (MAXIT steps), so
//     few rows still fill the GPU (KSPLIT up to 8, NBY threadgroups) and many
//     rows do not re-stage x (one staging per threadgroup);
//   * multi-row (MODE 0 or 1, DENSE, XR > 1): threadgroup z = XR x rows (z = ceil(XROWS / XR); the
//     last slice's rows past XROWS read the last row and write nothing), so each weight unit
//     is loaded once for XR rows: a level is made once and multiplies XR x values (decode
//     is memory-bound: N rows cost about one row's weight reads, not N).  Threadgroup memory
//     holds x in KSL slices of K: x' and its sums take 4.5 bytes a value and row (K = 4096 is
//     18 KB a row), so XR rows of the whole K do not fit Metal's 32 KB (nor CUDA's 48 KB of
//     static shared memory); a slice is NIT chunks per lane (NIT * LANES_X chunks a row),
//     XR * KSPLIT * NIT * VPL * 144 bytes, with the partial sums red (MAXIT * WARPS * RPW *
//     XR floats) within the face's limit (affine_qmv.py `plan_rows` picks XR, KSPLIT, NIT).
//     Steps run slice by slice (JSTEPS = KSL: x re-staged at each slice's first step, as
//     MODE 2 re-stages between expert steps); a warp's sums of one unit add up over the
//     slices in registers where the warp has one unit (CARRY: MAXIT = 1, one warp sum at the
//     end), else in `red` (a warp sum per step).  XR = 1, KSL = 1 is the one-row kernel;
//   * MODE 2: threadgroup z = one token; its KSPLIT warps of a warp row take KSPLIT
//     of its KE experts at a time (the experts split K), JSTEPS = KE/KSPLIT steps,
//     re-staging the KSPLIT x vectors between steps;
//   * each warp loads step s+1's weights, scales and biases while it computes step
//     s (two register sets): loads stay in flight through the compute;
//   * x is staged in threadgroup memory as float32 once per x vector, transposed
//     (xs[slot][it][q][lane]: a lane's float4s are one conflict-free access), and
//     prescaled (below), with the sums of x' and x over every 16 values (ps);
//   * per-row partial sums go through a warp sum to `red`; the epilogue adds the
//     KSPLIT warps of a warp row (and MODE 2's experts) and writes y.
//
// Levels (no conversion instruction): the SW-bit slab that holds a level (SW = 8,
// or 4 for 2- / 4-bit levels with float32 x) is shifted to bits 23-SW..22 (one
// shift per slab, shared by its SW/BITS levels), and OR-ing the level's bits (at
// p = 23 - SW + o, o its offset in the slab) into 1.0f (`one`, read from lim[1] so
// the mask-and-or is one LOP3 on CUDA) gives 1 + q*2^(o-SW).  With x' =
// x*2^(SW-o) staged, t = (1 + q*2^(o-SW)) * x' = x' + q*x, so over a segment (the
// values of one chunk in one group) sum q*x = sum t - sum x', and the row gets
// scale * (sum t - sum x') + bias * sum x.  Error: the float32 sum of t runs over
// terms up to 2^SW |x|, so a segment's sum q*x carries about (SEG + 8) * 2^-23 *
// 2^SW * sum|x| of rounding: at SW = 4 (float32 x) 4x a plain float32 dot product's
// at 2 bits; at SW = 8 with 2-bit levels (bfloat16 / float16 x) ~2^-15 of the
// result, far below the 2^-9 rounding of a 16-bit output.

// @@ common
DS4_FN float ds4_silu(float v) {
    return v / (1.0f + ds4_exp(-v));
}

// @@ qmv_consts
constexpr int VPL = 128 / BITS;                   // values per 16-byte chunk
constexpr int CHUNKS = K_DIM / VPL;               // chunks per row
constexpr int WPR = K_DIM * BITS / 32;            // words per row
constexpr int GPR = K_DIM / GS;                   // groups per row
constexpr int SEG = VPL < GS ? VPL : GS;          // values of one segment (chunk within one group)
constexpr int NSEG = VPL / SEG;                   // segments per chunk
constexpr int WPS = 4 / NSEG;                     // words per segment
constexpr int SUBS = VPL / 16;                    // 16-value staging items per chunk
constexpr int SPS = SEG / 16;                     // staging items per segment
constexpr int VPW = 32 / BITS;                    // values per word
static_assert(SW == 4 || SW == 8, "a slab is 4 or 8 bits");
static_assert(SW % BITS == 0, "a slab holds whole levels");
constexpr int LPS = SW / BITS;                    // levels per slab
constexpr int SPW = 32 / SW;                      // slabs per word
constexpr int THREADS = 32 * WARPS;
constexpr int WROWS = WARPS / KSPLIT;             // warp rows per threadgroup
constexpr int LANES_X = MODE == 2 ? 32 : 32 * KSPLIT;   // lanes along one x vector
constexpr int NIT = ((CHUNKS + LANES_X - 1) / LANES_X + KSL - 1) / KSL;   // chunks per lane, row and step
constexpr int SCH = KSL > 1 ? NIT * LANES_X : CHUNKS;  // chunks of an x vector staged at once (a K slice)
constexpr int OPW = MODE == 1 ? RPW / 2 : RPW;    // output rows per unit
constexpr int OUT_ROWS = MODE == 1 ? N_ROWS / 2 : N_ROWS;
constexpr int TILES = (OUT_ROWS + OPW - 1) / OPW; // units of one matrix
constexpr int NPAIR = MODE == 2 ? 1 : X_DIV;      // matrices sharing a block's x
constexpr int UNITS = NPAIR * TILES;              // units per grid z slice
constexpr int JSTEPS = MODE == 2 ? (KE + KSPLIT - 1) / KSPLIT : KSL;   // MODE 2: expert steps; else K slices
constexpr int NSTEP = JSTEPS * MAXIT;
constexpr int NXV = MODE == 2 ? KSPLIT : XR;      // x vectors staged together
constexpr int ITEMS = NXV * SCH * SUBS;           // 16-value staging items
constexpr int XSLOT = NIT * (VPL / 4) * 32;       // float4s per slot
constexpr int PSLOT = NIT * SUBS * 32;            // float2s per slot
constexpr uint32_t LMASK = (1u << BITS) - 1u;
constexpr uint32_t GW = uint32_t(NBY * WROWS);    // warp rows per grid z slice
constexpr int NIDS = MODE == 2 ? KE : NPAIR;      // expert ids of one grid z slice
static_assert(!DENSE || MODE != 2, "a dense matrix is the plain mode's or a one-matrix gate_up's");
static_assert(!NORM || MODE == 0, "the folded RMSNorm is the plain mode's");
static_assert(XR == 1 || (MODE != 2 && DENSE), "x rows share a threadgroup's weights: one dense matrix");
static_assert(KSL == 1 || MODE != 2, "K slices: MODE 0 / 1's (MODE 2's steps are its experts)");
// a warp's one unit (MAXIT 1) over KSL slices: consecutive steps, its sums stay in registers
constexpr bool CARRY = MODE != 2 && KSL > 1 && MAXIT == 1;
// @@ qmv_shared
DS4_SHARED float4 xs[KSPLIT * XR * XSLOT];
DS4_SHARED float nred[WARPS * XR];
DS4_SHARED float2 ps[KSPLIT * XR * PSLOT];
DS4_SHARED float red[MAXIT * WARPS * RPW * XR];
DS4_SHARED int sid[NIDS];
DS4_SHARED float swt[MODE == 2 ? KE : 1];

// @@ qmv_main
const uint32_t ks = warp % uint32_t(KSPLIT);
const uint32_t wr = warp / uint32_t(KSPLIT);
const uint32_t g0 = tgy * uint32_t(WROWS) + wr;
const uint32_t one = ds4_float_bits(lim[1]);

uint32_t wv[NIT][RPW][4];   // the step being computed
float sv[NIT][RPW][NSEG];
float bv[NIT][RPW][NSEG];
uint32_t wn[NIT][RPW][4];   // the next step, in flight (scales and biases as loaded: a
TS sn[NIT][RPW][NSEG];      // conversion here would wait for the loads)
TS bn[NIT][RPW][NSEG];

// the slice's expert ids (and MODE 2's weights) once: a step's loads then wait for no other
// load (DENSE: one matrix, no ids: the first weight loads wait for nothing)
if (!DENSE) {
    for (uint32_t i = tid; i < uint32_t(NIDS); i += uint32_t(THREADS)) {
        sid[i] = eids[tgz * uint32_t(NIDS) + i];
        if (MODE == 2) {
            swt[i] = wts[tgz * uint32_t(NIDS) + i];
        }
    }
    ds4_tg_barrier();
}

// NORM: x is RMS-normed on the way into the staging, as mx.fast.rms_norm rounds it:
// T(nw * T(x * rsqrt(mean(x^2) + eps))), the sum of squares in float32 over the block's x
// (XR > 1: each x row's per-warp sums stay in nred, the staging adds them per row)
float qn_inv = 1.0f;
if (NORM) {
    #pragma unroll
    for (int h = 0; h < XR; ++h) {
        const uint32_t hr = tgz * uint32_t(XR) + uint32_t(h);   // rows past XROWS: the last row again
        const uint64_t xr = uint64_t(XR > 1 ? (hr < uint32_t(XROWS) ? hr : uint32_t(XROWS - 1)) : tgz) * uint64_t(K_DIM);
        float q2 = 0.0f;
        for (uint32_t k = tid; k < uint32_t(K_DIM); k += uint32_t(THREADS)) {
            const float v = static_cast<float>(x[xr + k]);
            q2 += v * v;
        }
        q2 = ds4_warp_sum(q2);
        if (lane == 0u) {
            nred[h * WARPS + int(warp)] = q2;
        }
    }
    ds4_tg_barrier();
    float tot = 0.0f;
    for (int g = 0; g < WARPS; ++g) {
        tot += nred[g];
    }
    qn_inv = ds4_rsqrt(tot / float(K_DIM) + lim[2]);
}

float acc[RPW][XR];   // a step's sums (CARRY: a unit's, over its K slices)
#pragma unroll 1
for (int s = -1; s < NSTEP; ++s) {
    // step s: unit, expert, validity (uniform across the warp)
    const uint32_t s0 = s < 0 ? 0u : uint32_t(s);
    const uint32_t it = s0 % uint32_t(MAXIT);
    const uint32_t js = s0 / uint32_t(MAXIT);
    const uint32_t u = it * GW + g0;
    const uint32_t j = MODE == 2 ? js * uint32_t(KSPLIT) + ks : 0u;
    const bool valid = s >= 0 && u < uint32_t(UNITS) && (MODE != 2 || j < uint32_t(KE));
    if (s >= 0) {
        if (it == 0u && (MODE == 2 || KSL > 1 || js == 0u)) {
            if (s > 0) {
                ds4_tg_barrier();   // every warp is done with the previous x
            }
            // stage x' = x * 2^(SW - o) transposed, and the sums of x' and x per 16 values
            // (KSL > 1: K slice js of each of the XR x rows, slot xv * KSPLIT + ks for row xv)
            #pragma unroll
            for (int r = 0; r < (ITEMS + THREADS - 1) / THREADS; ++r) {
                const uint32_t n = uint32_t(r * THREADS) + tid;
                const uint32_t xv = n / uint32_t(SCH * SUBS);
                const uint32_t rem = n % uint32_t(SCH * SUBS);
                const uint32_t cl = rem % uint32_t(SCH);   // the chunk in the slice
                const uint32_t sub = rem / uint32_t(SCH);
                const uint32_t c = KSL > 1 ? js * uint32_t(SCH) + cl : cl;   // in the row
                const uint32_t jx = js * uint32_t(KSPLIT) + xv;
                if (n < uint32_t(ITEMS) && (MODE != 2 || jx < uint32_t(KE)) && (KSL == 1 || c < uint32_t(CHUNKS))) {
                    const uint32_t slot = MODE == 2 ? xv : (XR > 1 ? xv * uint32_t(KSPLIT) : 0u) + (cl % uint32_t(LANES_X)) / 32u;
                    const uint32_t at = ((slot * uint32_t(NIT) + cl / uint32_t(LANES_X)) * uint32_t(VPL / 4) + sub * 4u) * 32u + cl % 32u;
                    const uint32_t pat = ((slot * uint32_t(NIT) + cl / uint32_t(LANES_X)) * uint32_t(SUBS) + sub) * 32u + cl % 32u;
                    const uint32_t hr = tgz * uint32_t(XR) + xv;   // XR > 1: rows past XROWS read the last row
                    const uint32_t xrow = MODE == 2 ? tgz * uint32_t(KE) + jx
                        : XR > 1 ? (hr < uint32_t(XROWS) ? hr : uint32_t(XROWS - 1)) : tgz;
                    const uint64_t x0 = uint64_t(xrow) * uint64_t(K_DIM) + uint64_t(c * uint32_t(VPL) + sub * 16u);
                    float qn = qn_inv;
                    if (NORM && XR > 1) {   // row xv's: its per-warp sums, in the order of XR = 1
                        float tot = 0.0f;
                        for (int g = 0; g < WARPS; ++g) {
                            tot += nred[xv * uint32_t(WARPS) + uint32_t(g)];
                        }
                        qn = ds4_rsqrt(tot / float(K_DIM) + lim[2]);
                    }
                    // one value at a time: a row-contiguous x may still start anywhere (an MLX view)
                    float v[16];
                    #pragma unroll
                    for (int a = 0; a < 16; ++a) {
                        v[a] = static_cast<float>(x[x0 + uint64_t(a)]);
                        if (NORM) {
                            const float y = static_cast<float>(static_cast<T>(v[a] * qn));
                            const uint32_t kk = c * uint32_t(VPL) + sub * 16u + uint32_t(a);
                            v[a] = static_cast<float>(static_cast<T>(static_cast<float>(nw[kk]) * y));
                        }
                    }
                    float sxp = 0.0f;
                    float sx = 0.0f;
                    #pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        // value a = 4q + e is level (a % LPS) of its slab (items start on a word, LPS divides a word)
                        float4 t;
                        t.x = v[4 * q + 0] * float(1 << (SW - ((4 * q + 0) % LPS) * BITS));
                        t.y = v[4 * q + 1] * float(1 << (SW - ((4 * q + 1) % LPS) * BITS));
                        t.z = v[4 * q + 2] * float(1 << (SW - ((4 * q + 2) % LPS) * BITS));
                        t.w = v[4 * q + 3] * float(1 << (SW - ((4 * q + 3) % LPS) * BITS));
                        xs[at + uint32_t(q) * 32u] = t;
                        sxp += (t.x + t.y) + (t.z + t.w);
                        sx += (v[4 * q + 0] + v[4 * q + 1]) + (v[4 * q + 2] + v[4 * q + 3]);
                    }
                    float2 pp;
                    pp.x = sxp;
                    pp.y = sx;
                    ps[pat] = pp;
                }
            }
            ds4_tg_barrier();
        }
        // the next step's registers become the current ones
        #pragma unroll
        for (int a = 0; a < NIT; ++a) {
            #pragma unroll
            for (int i = 0; i < RPW; ++i) {
                #pragma unroll
                for (int q = 0; q < 4; ++q) {
                    wv[a][i][q] = wn[a][i][q];
                }
                #pragma unroll
                for (int g = 0; g < NSEG; ++g) {
                    sv[a][i][g] = static_cast<float>(sn[a][i][g]);
                    bv[a][i][g] = static_cast<float>(bn[a][i][g]);
                }
            }
        }
    }
    // issue step s+1's loads: in flight while step s computes
    if (s + 1 < NSTEP) {
        const uint32_t it1 = uint32_t(s + 1) % uint32_t(MAXIT);
        const uint32_t js1 = uint32_t(s + 1) / uint32_t(MAXIT);
        const uint32_t u1 = it1 * GW + g0;
        const uint32_t j1 = MODE == 2 ? js1 * uint32_t(KSPLIT) + ks : 0u;
        if (u1 < uint32_t(UNITS) && (MODE != 2 || j1 < uint32_t(KE))) {
            const uint32_t tile = MODE == 2 ? u1 : u1 % uint32_t(TILES);
            const uint32_t e1 = DENSE ? 0u : uint32_t(sid[MODE == 2 ? j1 : u1 / uint32_t(TILES)]);
            const uint64_t ebase = uint64_t(e1) * uint64_t(N_ROWS);
            #pragma unroll
            for (int a = 0; a < NIT; ++a) {
                const uint32_t c = MODE == 2 ? uint32_t(a) * 32u + lane
                    : (KSL > 1 ? js1 * uint32_t(SCH) : 0u) + uint32_t(a * LANES_X) + ks * 32u + lane;
                const uint32_t cc = c < uint32_t(CHUNKS) ? c : uint32_t(CHUNKS - 1);   // past the row: a real chunk, unused
                #pragma unroll
                for (int i = 0; i < RPW; ++i) {
                    uint32_t o = tile * uint32_t(OPW) + uint32_t(MODE == 1 ? (i % OPW) : i);
                    o = o < uint32_t(OUT_ROWS) ? o : uint32_t(OUT_ROWS - 1);   // rows past the end: read a real row, write nothing
                    const uint64_t r = ebase + uint64_t((MODE == 1 && i >= OPW) ? o + uint32_t(OUT_ROWS) : o);
                    const uint4 ld = ((const DS4_DEV uint4*)(w + r * uint64_t(WPR)))[cc];
                    wn[a][i][0] = ld.x;
                    wn[a][i][1] = ld.y;
                    wn[a][i][2] = ld.z;
                    wn[a][i][3] = ld.w;
                    #pragma unroll
                    for (int g = 0; g < NSEG; ++g) {
                        const uint64_t gi = r * uint64_t(GPR) + uint64_t((cc * uint32_t(VPL) + uint32_t(g * SEG)) / uint32_t(GS));
                        sn[a][i][g] = scales[gi];
                        bn[a][i][g] = biases[gi];
                    }
                }
            }
        }
    }
    if (!valid) {
        continue;
    }
    if (!CARRY || js == 0u) {
        #pragma unroll
        for (int i = 0; i < RPW; ++i) {
            #pragma unroll
            for (int h = 0; h < XR; ++h) {
                acc[i][h] = 0.0f;
            }
        }
    }
    #pragma unroll
    for (int a = 0; a < NIT; ++a) {
        const uint32_t c = MODE == 2 ? uint32_t(a) * 32u + lane
            : (KSL > 1 ? js * uint32_t(SCH) : 0u) + uint32_t(a * LANES_X) + ks * 32u + lane;
        if (c < uint32_t(CHUNKS)) {
            const uint32_t xb = (ks * uint32_t(NIT) + uint32_t(a)) * uint32_t(VPL / 4) * 32u + lane;
            const uint32_t pb = (ks * uint32_t(NIT) + uint32_t(a)) * uint32_t(SUBS) * 32u + lane;
            #pragma unroll
            for (int g = 0; g < NSEG; ++g) {
                float sxp[XR];   // sum of x' over the segment (x row h: slot h * KSPLIT + ks)
                float sx[XR];    // sum of x
                #pragma unroll
                for (int h = 0; h < XR; ++h) {
                    sxp[h] = 0.0f;
                    sx[h] = 0.0f;
                    #pragma unroll
                    for (int m = 0; m < SPS; ++m) {
                        const float2 pp = ps[pb + uint32_t(h * KSPLIT * PSLOT) + uint32_t(g * SPS + m) * 32u];
                        sxp[h] += pp.x;
                        sx[h] += pp.y;
                    }
                }
                float t0[RPW][XR];   // two chains per row (even / odd slabs; XR > 1: the rows are the chains)
                float t1[RPW][XR];
                #pragma unroll
                for (int i = 0; i < RPW; ++i) {
                    #pragma unroll
                    for (int h = 0; h < XR; ++h) {
                        t0[i][h] = 0.0f;
                        t1[i][h] = 0.0f;
                    }
                }
                #pragma unroll
                for (int ww = 0; ww < WPS; ++ww) {
                    const int wi = g * WPS + ww;   // word of the chunk
                    float xq[XR][VPW];
                    #pragma unroll
                    for (int h = 0; h < XR; ++h) {
                        #pragma unroll
                        for (int q = 0; q < VPW / 4; ++q) {
                            const float4 f4 = xs[xb + uint32_t(h * KSPLIT * XSLOT) + uint32_t(wi * (VPW / 4) + q) * 32u];
                            xq[h][4 * q + 0] = f4.x;
                            xq[h][4 * q + 1] = f4.y;
                            xq[h][4 * q + 2] = f4.z;
                            xq[h][4 * q + 3] = f4.w;
                        }
                    }
                    #pragma unroll
                    for (int i = 0; i < RPW; ++i) {
                        const uint32_t word = wv[a][i][wi];
                        #pragma unroll
                        for (int b = 0; b < SPW; ++b) {
                            // slab b (bits b*SW .. b*SW+SW-1) to bits 23-SW .. 22
                            const int sh = (23 - SW) - b * SW;
                            const uint32_t slab = sh >= 0 ? (word << uint32_t(sh)) : (word >> uint32_t(-sh));
                            #pragma unroll
                            for (int f = 0; f < LPS; ++f) {
                                // one level, XR rows: each weight unit is read once for the block's XR x rows
                                const float lv = ds4_as_float((slab & (LMASK << uint32_t(23 - SW + f * BITS))) | one);
                                #pragma unroll
                                for (int h = 0; h < XR; ++h) {
                                    if (b % 2 == 0 || XR > 1) {
                                        t0[i][h] += lv * xq[h][b * LPS + f];
                                    } else {
                                        t1[i][h] += lv * xq[h][b * LPS + f];
                                    }
                                }
                            }
                        }
                    }
                }
                #pragma unroll
                for (int i = 0; i < RPW; ++i) {
                    #pragma unroll
                    for (int h = 0; h < XR; ++h) {
                        acc[i][h] += sv[a][i][g] * ((XR > 1 ? t0[i][h] : t0[i][h] + t1[i][h]) - sxp[h]) + bv[a][i][g] * sx[h];
                    }
                }
            }
        }
    }
    const float wj = MODE == 2 ? swt[j] : 1.0f;
    if (!CARRY || js == uint32_t(JSTEPS - 1)) {
        #pragma unroll
        for (int i = 0; i < RPW; ++i) {
            #pragma unroll
            for (int h = 0; h < XR; ++h) {
                const float v = ds4_warp_sum(acc[i][h]);
                if (lane == 0u) {
                    const uint32_t at = ((it * uint32_t(WARPS) + warp) * uint32_t(RPW) + uint32_t(i)) * uint32_t(XR) + uint32_t(h);
                    red[at] = (CARRY || js == 0u) ? wj * v : red[at] + wj * v;   // KSL > 1: over the slices
                }
            }
        }
    }
}

// @@ qmv_epilogue
// epilogue: the KSPLIT warps of a warp row (MODE 2: its experts), then y
ds4_tg_barrier();
for (uint32_t lo = tid; lo < uint32_t(MAXIT * XR * WROWS * OPW); lo += uint32_t(THREADS)) {
    const uint32_t it = lo / uint32_t(XR * WROWS * OPW);
    const uint32_t h = (lo / uint32_t(WROWS * OPW)) % uint32_t(XR);   // x row of the block (y rows written contiguously)
    const uint32_t wr2 = (lo / uint32_t(OPW)) % uint32_t(WROWS);
    const uint32_t i = lo % uint32_t(OPW);
    const uint32_t u = it * GW + tgy * uint32_t(WROWS) + wr2;
    if (u >= uint32_t(UNITS) || (XR > 1 && tgz * uint32_t(XR) + h >= uint32_t(XROWS))) {
        continue;
    }
    const uint32_t tile = MODE == 2 ? u : u % uint32_t(TILES);
    const uint32_t orow = tile * uint32_t(OPW) + i;
    if (orow >= uint32_t(OUT_ROWS)) {
        continue;
    }
    float a = 0.0f;
    float up = 0.0f;
    #pragma unroll
    for (int k = 0; k < KSPLIT; ++k) {
        if (MODE != 2 || k < KE) {
            const uint32_t base = (it * uint32_t(WARPS) + wr2 * uint32_t(KSPLIT) + uint32_t(k)) * uint32_t(RPW);
            a += red[(base + i) * uint32_t(XR) + h];
            if (MODE == 1) {
                up += red[(base + uint32_t(OPW) + i) * uint32_t(XR) + h];
            }
        }
    }
    if (MODE == 1) {
        const float l = lim[0];
        if (l > 0.0f) {
            a = a < l ? a : l;
            up = up < l ? (up > -l ? up : -l) : l;
        }
        a = ds4_silu(a) * up;
    }
    const uint32_t yrow = MODE == 2 ? tgz : (tgz * uint32_t(XR) + h) * uint32_t(NPAIR) + u / uint32_t(TILES);
    y[uint64_t(yrow) * uint64_t(OUT_ROWS) + orow] = static_cast<T>(a);
}

// ------------------------------------------------------------------ two weight banks in one launch
//
// MODE 3 and MODE 4 (ds4mlx/kernels/affine_qmv.py `twobank_sources`): the `qmv_consts` and
// `qmv_main` (MODE 3: and `qmv_epilogue`) text above, instantiated once per weight bank with
// every template constant and every constexpr of `qmv_consts` renamed NAME_A / NAME_B (the
// banks' own bits, group size, rows, K and plan; T, WARPS and NBY are common), bank B's
// buffers renamed (x2, w2, scales2, biases2, eids2, lim2, y2) and tgz read as tgz_A / tgz_B.
// The lines DS4_QMV_CONSTS(A|B) / DS4_QMV_MAIN(A|B) / DS4_QMV_EPILOGUE(A|B) below stand for
// those instances; the threadgroup arrays are declared once, sized for the larger bank.
//   MODE 3: grid z = NZ_A slices of bank A (the routed experts' gate_up + SwiGLU: MODE_A 1, a
//           token's KE experts sharing its x, y [NZ_A * X_DIV_A, I_A]), then the slices of
//           bank B (the shared expert's gate_up + SwiGLU: MODE_B 1 over a one-matrix bank,
//           y2 [NZ_A, I_B]): NZ_A of them, or (multi-row: DENSE_B, XR_B > 1 tokens a slice, x in
//           KSL_B slices of K) ceil(NZ_A / XR_B), each shared-expert weight read once for XR_B
//           tokens; a threadgroup runs its bank's instance (a uniform branch).
//   MODE 4: grid z = XR_B tokens (one, or multi-row XR_B > 1 of the XROWS_B tokens); bank A's
//           instance per token (MODE_A 2: the routed experts' down and their weighted sum into
//           red_A[token], a barrier between tokens: each reads its own experts), a barrier, bank
//           B's (MODE_B 0, DENSE: the shared expert's down of x2 into `red2`, XR_B rows sharing
//           each weight load: the same KSPLIT, RPW, MAXIT and NBY, so a warp row's units are the
//           same rows in both), then one epilogue writes y = routed + shared per token.

// @@ qmv2_shared
constexpr int XS_A = KSPLIT_A * XSLOT_A;
constexpr int XS_B = KSPLIT_B * XSLOT_B;
constexpr int PS_A = KSPLIT_A * PSLOT_A;
constexpr int PS_B = KSPLIT_B * PSLOT_B;
constexpr int RED_A = MAXIT_A * WARPS * RPW_A;
constexpr int RED_B = MAXIT_B * WARPS * RPW_B * XR_B;
DS4_SHARED float4 xs[XS_A > XS_B * XR_B ? XS_A : XS_B * XR_B];
DS4_SHARED float nred[WARPS];
DS4_SHARED float2 ps[PS_A > PS_B * XR_B ? PS_A : PS_B * XR_B];
DS4_SHARED float red[MODE != 3 ? 1 : RED_B > RED_A ? RED_B : RED_A];   // MODE 3: either bank's
DS4_SHARED float red_A[MODE == 4 ? XR_B : 1][MODE == 4 ? RED_A : 1];   // MODE 4: bank A's per token
DS4_SHARED float red2[MODE == 4 ? RED_B : 1];                          // MODE 4: bank B's
DS4_SHARED int sid[NIDS_A > NIDS_B ? NIDS_A : NIDS_B];
DS4_SHARED float swt[MODE_A == 2 ? KE_A : 1];

// @@ qmv2_gu
static_assert(MODE == 3 && MODE_A == 1 && MODE_B == 1, "gate_up + SwiGLU of both banks");
static_assert(XR_A == 1 && KSL_A == 1, "bank A: one x vector a slice, staged whole");
static_assert(XR_B == 1 || DENSE_B, "bank B's XR_B tokens a slice: its one matrix");
if (tgz < uint32_t(NZ_A)) {
    const uint32_t tgz_A = tgz;
    DS4_QMV_MAIN(A)
    DS4_QMV_EPILOGUE(A)
} else {
    const uint32_t tgz_B = tgz - uint32_t(NZ_A);
    DS4_QMV_MAIN(B)
    DS4_QMV_EPILOGUE(B)
}

// @@ qmv2_down
static_assert(MODE == 4 && MODE_A == 2 && MODE_B == 0 && DENSE_B, "routed down + sum, then the dense down");
static_assert(KSPLIT_A == KSPLIT_B && RPW_A == RPW_B && MAXIT_A == MAXIT_B, "the banks' units are the same rows");
static_assert(OUT_ROWS_A == OUT_ROWS_B, "both banks write the same output rows");
static_assert(XR_A == 1 && KSL_A == 1, "bank A: one token at a time, its experts' x staged whole");
static_assert(XR_B == 1 || XROWS_B > 0, "multi-row: XROWS_B tokens in all");
// tokens past XROWS_B (the last slice's): skipped (a uniform branch), their y not written
constexpr uint32_t NTOK = XR_B > 1 ? uint32_t(XROWS_B) : 0xffffffffu;
const uint32_t tgz_B = tgz;
#pragma unroll 1
for (uint32_t h_A = 0u; h_A < uint32_t(XR_B); ++h_A) {
    const uint32_t tgz_A = tgz * uint32_t(XR_B) + h_A;
    if (tgz_A < NTOK) {
        if (h_A > 0u) {
            ds4_tg_barrier();   // every warp is done with the previous token's x and ids
        }
        DS4_QMV_MAIN(A)
    }
}
ds4_tg_barrier();   // every warp is done with bank A's x before bank B stages its own
{
    DS4_QMV_MAIN(B)
}
// epilogue: a warp row's KSPLIT warps of both banks (bank A: its experts, weighted; bank B: K
// split), the sum rounded once
ds4_tg_barrier();
for (uint32_t lo = tid; lo < uint32_t(MAXIT_A * XR_B * WROWS_A * RPW_A); lo += uint32_t(THREADS_A)) {
    const uint32_t it = lo / uint32_t(XR_B * WROWS_A * RPW_A);
    const uint32_t h = (lo / uint32_t(WROWS_A * RPW_A)) % uint32_t(XR_B);   // the slice's token
    const uint32_t wr2 = (lo / uint32_t(RPW_A)) % uint32_t(WROWS_A);
    const uint32_t i = lo % uint32_t(RPW_A);
    const uint32_t u = it * GW_A + tgy * uint32_t(WROWS_A) + wr2;
    const uint32_t orow = u * uint32_t(RPW_A) + i;
    const uint32_t tok = tgz * uint32_t(XR_B) + h;
    if (u >= uint32_t(UNITS_A) || orow >= uint32_t(OUT_ROWS_A) || tok >= NTOK) {
        continue;
    }
    float a = 0.0f;
    float b = 0.0f;
    #pragma unroll
    for (int k = 0; k < KSPLIT_A; ++k) {
        const uint32_t base = (it * uint32_t(WARPS) + wr2 * uint32_t(KSPLIT_A) + uint32_t(k)) * uint32_t(RPW_A);
        if (k < KE_A) {
            a += red_A[h][base + i];
        }
        b += red2[(base + i) * uint32_t(XR_B) + h];
    }
    y[uint64_t(tok) * uint64_t(OUT_ROWS_A) + orow] = static_cast<T>(a + b);
}

// ------------------------------------------------------------------ the next mHC site in the same launch
//
// affine_qmv_hc (ds4mlx/kernels/qmv_hc.py): the plain kernel (MODE 0, one dense matrix, XR x rows a
// threadgroup) whose output o = y [XROWS, OUT_ROWS] is the output of an mHC site, followed in
// the same launch by hyper_connection's hc_post_dots_pre for that site (CUDA only, as the mHC
// tails): each threadgroup, once its y rows are written, forms the new streams ys[t, k, c]
// = T(T(post[t,k]) * o[t,c]) + T(sum_j T(comb[t,j,k]) * hx[t,j,c]) for its own rows c (the
// rows its warps computed: a strided set, `qmv_epilogue`'s), writes them, and leaves its
// M = (2+HC)*HC dot products of fn with those elements and their sum of squares in its row of
// part [XROWS, PARTS = NBY, M+1]; the threadgroup of token t that counts itself last in
// tickets[t] runs hyper_connection.metal's `pre_core` for t (names below: its K, D, M, the
// streams st, the outputs pre / post2 / comb2 / hn).  The mat-vec and the hc_post roundings
// are those of the two kernels it replaces; the dot products add in another order (per
// threadgroup over a strided row set, then over the NBY threadgroups).
// Template: the plain kernel's (NORM false: `nw` is the site's folded RMSNorm weight),
// HC, ITERS, HEAD (false), COLLAPSE (true), HC_NORM, VT (pre_core's virtual threads), PARTS.

// affine_qmv2_down_hc: the same after MODE 4 (the routed experts' down + weighted sum + the shared
// expert's down, y = their sum): this section with bank A's names (its rows, steps and warp rows)
// and bank B's tokens per slice (XR_B, XROWS_B).
// @@ qmv_hc_plain
static_assert(MODE == 0 && DENSE && !NORM && PARTS == NBY, "one dense matrix, no x norm; a part per threadgroup y");
// @@ qmv_hc_down
static_assert(MODE == 4 && PARTS == NBY, "MODE 4's y; a part per threadgroup y");
// @@ qmv_hc
constexpr int D = OUT_ROWS;
constexpr int K = HC * D;
constexpr int M = (2 + HC) * HC;
DS4_SHARED float hred[WARPS * (M + 1)];
DS4_SHARED uint32_t hlast[XR];
ds4_tg_barrier();   // this threadgroup's y rows are written (read back below by other threads)
#pragma unroll 1
for (int hh = 0; hh < XR; ++hh) {
    const uint32_t t = tgz * uint32_t(XR) + uint32_t(hh);
    if (XR > 1 && t >= uint32_t(XROWS)) {
        break;   // uniform: the last slice's rows past XROWS
    }
    const DS4_DEV T* xt = hx + uint64_t(t) * uint64_t(K);
    float acc[M];
    for (int r = 0; r < M; ++r) {
        acc[r] = 0.0f;
    }
    float ss = 0.0f;
    for (uint32_t lo = tid; lo < uint32_t(MAXIT * WROWS * OPW); lo += uint32_t(THREADS)) {
        const uint32_t it = lo / uint32_t(WROWS * OPW);
        const uint32_t wr2 = (lo / uint32_t(OPW)) % uint32_t(WROWS);
        const uint32_t i = lo % uint32_t(OPW);
        const uint32_t u = it * GW + tgy * uint32_t(WROWS) + wr2;
        const uint32_t c = (u % uint32_t(TILES)) * uint32_t(OPW) + i;
        if (u >= uint32_t(UNITS) || c >= uint32_t(OUT_ROWS)) {
            continue;
        }
        const float ov = static_cast<float>(y[uint64_t(t) * uint64_t(OUT_ROWS) + c]);
        for (int k = 0; k < HC; ++k) {
            float m = 0.0f;
            for (int j = 0; j < HC; ++j) {
                const float cj = static_cast<float>(static_cast<T>(comb[(uint64_t(t) * uint64_t(HC) + uint32_t(j)) * uint64_t(HC) + uint32_t(k)]));
                m += cj * static_cast<float>(xt[uint32_t(j) * uint32_t(D) + c]);
            }
            const float pk = static_cast<float>(static_cast<T>(post[uint64_t(t) * uint64_t(HC) + uint32_t(k)]));
            const float p = static_cast<float>(static_cast<T>(pk * ov));
            const T yv = static_cast<T>(p + static_cast<float>(static_cast<T>(m)));
            const uint32_t kk = uint32_t(k) * uint32_t(D) + c;
            ys[uint64_t(t) * uint64_t(K) + kk] = yv;
            const float xv = static_cast<float>(yv);
            ss += xv * xv;
            for (int r = 0; r < M; ++r) {
                acc[r] += static_cast<float>(fn[uint64_t(r) * uint64_t(K) + kk]) * xv;
            }
        }
    }
    for (int r = 0; r < M; ++r) {
        const float v = ds4_warp_sum(acc[r]);
        if (lane == 0u) {
            hred[warp * uint32_t(M + 1) + uint32_t(r)] = v;
        }
    }
    ss = ds4_warp_sum(ss);
    if (lane == 0u) {
        hred[warp * uint32_t(M + 1) + uint32_t(M)] = ss;
    }
    ds4_tg_barrier();
    if (tid < uint32_t(M + 1)) {
        float v = 0.0f;
        for (int w = 0; w < WARPS; ++w) {
            v += hred[uint32_t(w) * uint32_t(M + 1) + tid];
        }
        part[(uint64_t(t) * uint64_t(PARTS) + uint64_t(tgy)) * uint64_t(M + 1) + tid] = v;
    }
    ds4_tg_barrier();   // hred is the next token's
}
DS4_QMV_HC_ROUTE_PART
// this threadgroup's streams and parts are written: count each of its tokens' threadgroups
ds4h_fence();
ds4_tg_barrier();
if (tid == 0u) {
    for (int hh = 0; hh < XR; ++hh) {
        const uint32_t t = tgz * uint32_t(XR) + uint32_t(hh);
        bool last = false;
        if (XR == 1 || t < uint32_t(XROWS)) {
            last = ds4h_count(tickets + t) == uint32_t(PARTS - 1);
            if (last) {
                ds4h_reset(tickets + t);   // all PARTS have counted: zero for the next launch
            }
        }
        hlast[hh] = last ? 1u : 0u;
    }
}
ds4_tg_barrier();
ds4h_fence();
#define HC_LD(p) ds4h_load(p)
#define red hred
#define NORM HC_NORM
#pragma unroll 1
for (int hh = 0; hh < XR; ++hh) {
    if (hlast[hh] == 0u) {
        continue;   // uniform: another threadgroup finishes this token
    }
    const uint32_t t = tgz * uint32_t(XR) + uint32_t(hh);
    const DS4_DEV T* st = ys + uint64_t(t) * uint64_t(K);
    DS4_DEV T* yo = hn;
    DS4_DEV float* pre_o = pre;
    DS4_DEV float* post_o = post2;
    DS4_DEV float* comb_o = comb2;
    DS4_QMV_HC_PRE_CORE
    DS4_QMV_HC_ROUTE_TAIL
}
#undef NORM
#undef red

// affine_qmv_hc_route (kernels/qmv_hc_route.py): the plain qmv_hc for one token whose next site
// feeds an MoE router, which runs in the same launch.  The site's normed output is
// nw * rs * sum_k pre_k * streams_k (rs the norm's rsqrt, pre_k its mixing weights: scalars the
// tail knows), so a router logit is rs * sum_k pre_k * (sum_c rw[e, c] * nw[c] * streams_k[c]):
// each threadgroup adds the inner sums over the rows it wrote into rpart [PARTS, HC, RE] f32
// (the route_part section), and the tail adds the PARTS shares, scales them and routes the token
// with moe_route.metal's `core` (names prefixed R / r: the route_tail section) -> ridx [RK] int32,
// rwts [RK] f32.  T float32 or bfloat16 (then each logit is rounded to bf16, as moe_route's fold
// does; the collapsed and normed vectors are not rounded to T first, as the two launches do).
// @@ qmv_hc_route_part
static_assert(XR == 1 && HC_NORM, "the router's share: one token, after the site's folded norm");
for (uint32_t e = tid; e < uint32_t(RE); e += uint32_t(THREADS)) {
    float racc[HC];
    for (int k = 0; k < HC; ++k) {
        racc[k] = 0.0f;
    }
    for (uint32_t lo = 0; lo < uint32_t(MAXIT * WROWS * OPW); ++lo) {
        const uint32_t it = lo / uint32_t(WROWS * OPW);
        const uint32_t wr2 = (lo / uint32_t(OPW)) % uint32_t(WROWS);
        const uint32_t i = lo % uint32_t(OPW);
        const uint32_t u = it * GW + tgy * uint32_t(WROWS) + wr2;
        const uint32_t c = (u % uint32_t(TILES)) * uint32_t(OPW) + i;
        if (u >= uint32_t(UNITS) || c >= uint32_t(OUT_ROWS)) {
            continue;
        }
        // rw in T first, as the model's x @ w.T in x's dtype
        const float wv = static_cast<float>(static_cast<T>(rw[uint64_t(e) * uint64_t(D) + c])) * static_cast<float>(nw[c]);
        for (int k = 0; k < HC; ++k) {
            racc[k] += wv * static_cast<float>(ys[uint64_t(tgz) * uint64_t(K) + uint32_t(k) * uint32_t(D) + c]);
        }
    }
    for (int k = 0; k < HC; ++k) {
        rpart[(uint64_t(tgy) * uint64_t(HC) + uint32_t(k)) * uint64_t(RE) + e] = racc[k];
    }
}
// @@ qmv_hc_route_tail
ds4_tg_barrier();
{
DS4_SHARED float r_logit[RE];
float rtot = 0.0f;
for (int w = 0; w < VT / 32; ++w) {
    rtot += red[w];  // the norm's per-warp sums, as pre_core added them
}
const float rrs = ds4_rsqrt(rtot / float(D) + eps[2]);
for (uint32_t e = tid; e < uint32_t(RE); e += uint32_t(THREADS)) {
    float l = 0.0f;
    for (int k = 0; k < HC; ++k) {
        float sk = 0.0f;
        for (int p = 0; p < PARTS; ++p) {
            sk += HC_LD(rpart + (uint64_t(p) * uint64_t(HC) + uint32_t(k)) * uint64_t(RE) + e);
        }
        l += pre_sh[k] * sk;
    }
    r_logit[e] = sizeof(T) == 2 ? ds4r_round_bf(l * rrs) : l * rrs;  // bf16: the logits of a bf16 matmul
}
ds4_tg_barrier();
#define ROUTE_LOGIT(e) (r_logit[e])
