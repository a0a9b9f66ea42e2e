// ds4mlx grouped quantized matmul: prefill's per-expert GEMMs straight from GGUF blocks
// (Q8_0, Q2_K, Q4_K, IQ2_XXS).
//
// Sections `// @@ name`, assembled by ds4mlx/kernels/grouped_qmm.py.  The header is
// quant_moe.metal's (its prelude, the IQ2_XXS lattice and the `common` section: the block
// decoders DS4_CHUNK, written once there) plus `helpers` below; the index is
// dispatch.INDEX (tid, lane, warp, tgx, tgy, tgz); the body is `grouped_qmm`, shared
// verbatim by the Metal and CUDA faces (and compiled by g++ in the tests).  Extra names:
//   float4           a 4-float vector with members x, y, z, w (built in on Metal / CUDA)
// Template constants: T (x and y dtype), N_ROWS, K_DIM, ROW_BYTES, M_ROWS (rows of x per
// batch), GQ_RM (tokens per SIMD group, 1..8).
//
// Padding: batch b's rows from lens[b] on are padding (the grouped layout fills a batch's
// end with zero rows): their outputs are written as zeros without any product, a SIMD group
// whose tokens are all padding skips the FMAs, a thread group whose tile is all padding
// only writes its zeros (on V4 Flash's usual 48 pairs per expert in batches of 64, about a
// third of the rows).
//
// Tile: one thread group of 256 threads (8 SIMD groups) computes GQ_TM = 8 GQ_RM tokens of
// one batch (all of one expert) x GQ_TN = 128 output rows, over K in steps of 32 values (one
// chunk of every type: a Q8_0 block, a Q4_K / IQ2_XXS sub-block, two Q2_K sub-blocks).  Per
// step the group's first 128 threads each decode one chunk of one weight row (DS4_CHUNK,
// bit-identical to the reference decoding) into shared memory, k-major (ws[k][n]); the
// other 128 threads stage the tile's x values as float32 (xs[t][k]).  Then SIMD group g
// takes tokens g GQ_RM .. g GQ_RM + GQ_RM - 1 and lane l output rows 4l..4l+3: per 4 values
// of k, 4 float4 loads of W (a contiguous 512-byte row of ws per load: no bank conflict)
// and one broadcast float4 load of x per token feed 16 GQ_RM float32 FMAs.
// Why this shape:
//   * the weight bytes of a tile are read and decoded once for GQ_TM tokens (up to 64:
//     the grouped layout's usual cap on V4 Flash), where a mat-vec reads them per token;
//     decoding (a few instructions a value) is then ~1 / GQ_TM of the FMA work;
//   * 24 KB of shared memory (8 KB of x, 16 KB of W at GQ_TM = 64) stays under Metal's 32 KB;
//     a step of 64 values would need 48 KB;
//   * 128 rows x one chunk is one chunk per decoding thread (no thread decodes twice per
//     step), while the other half stages x, so both halves finish a step together;
//   * 16 GQ_RM FMAs per 4 + GQ_RM shared-memory loads (128 per 12 at GQ_RM = 8; float4
//     loads, the x loads broadcast): FMA-bound rather than bound by shared memory's 128
//     bytes per clock on NVIDIA GPUs;
//   * accumulation in float32 per output, K ascending, as the reference's sum of float32
//     products, in another order (a float32 summation bound, not bit-exact);
//   * IQ2_XXS lattice rows are read from the constant table (DS4_CHUNK as written): the
//     lookups diverge, but only the decoding threads make them, once per GQ_TM tokens.
// Known limits, for the measurement to judge: the FMAs are float32 on the SIMT units, not
// tensor cores / simdgroup matrices (the dequantized-slices path multiplies in 16 bits on
// tensor cores but writes and reads the dequantized experts); a decoding SIMD group's 32
// lanes read 32 different rows (DS4_CHUNK's byte loads), one cache line per lane.
// Grid: (256, ceil(N_ROWS / 128), B * ceil(M_ROWS / GQ_TM)), thread group (256, 1, 1).

// @@ helpers
#define GQ_THREADS 256
#define GQ_TN 128
#define GQ_TM (8 * GQ_RM)

// a[0..3] += s * v, one FMA per output row
DS4_FN void ds4_fma4(THR float* a, float s, float4 v) {
    a[0] += s * v.x;
    a[1] += s * v.y;
    a[2] += s * v.z;
    a[3] += s * v.w;
}

// @@ grouped_qmm
// inputs: x [B * M_ROWS, K_DIM] T, w [E, N_ROWS, ROW_BYTES] uint8, eids [B] int32, lens [B]
// int32; output y [B * M_ROWS, N_ROWS] T: row b M_ROWS + m of y is W[eids[b]] times row
// b M_ROWS + m of x for m < lens[b], else 0.
DS4_SHARED float4 gq_xs4[GQ_TM * 8];        // x tile [GQ_TM][32] float32
DS4_SHARED float4 gq_ws4[32 * GQ_TN / 4];   // W tile [32][GQ_TN] float32, k-major
{
    SHR float* xs = (SHR float*)gq_xs4;
    SHR float* ws = (SHR float*)gq_ws4;
    const uint32_t m_tiles = (uint32_t(M_ROWS) + uint32_t(GQ_TM) - 1u) / uint32_t(GQ_TM);
    const uint32_t b = tgz / m_tiles;
    const uint32_t m0 = (tgz - b * m_tiles) * uint32_t(GQ_TM);
    const uint32_t n0 = tgy * uint32_t(GQ_TN);
    const uint32_t live = uint32_t(lens[b]) < uint32_t(M_ROWS) ? uint32_t(lens[b]) : uint32_t(M_ROWS);
    // this SIMD group's tokens: m0 + warp GQ_RM + i; any of them live?
    const bool busy = m0 + warp * uint32_t(GQ_RM) < live;
    const DEV uint8_t* we = w + uint64_t(eids[b]) * uint64_t(N_ROWS) * uint64_t(ROW_BYTES);
    const DEV T* xb = x + uint64_t(b) * uint64_t(M_ROWS) * uint64_t(K_DIM);
    float acc[GQ_RM][4];
    for (int i = 0; i < GQ_RM; ++i) {
        for (int r = 0; r < 4; ++r) {
            acc[i][r] = 0.0f;
        }
    }
    // a tile of padding only (uniform over the thread group) skips the K loop and its barriers
    for (uint32_t c = 0; c < (m0 < live ? uint32_t(K_DIM / 32) : 0u); ++c) {
        ds4_tg_barrier();  // every lane is done with the previous step's tiles
        if (tid < uint32_t(GQ_TN)) {
            // rows past N_ROWS decode the last row (not written)
            const uint32_t r = n0 + tid < uint32_t(N_ROWS) ? n0 + tid : uint32_t(N_ROWS) - 1u;
            float buf[32];
            DS4_CHUNK(we + uint64_t(r) * uint64_t(ROW_BYTES), c, buf);
            for (int i = 0; i < 32; ++i) {
                ws[uint32_t(i) * uint32_t(GQ_TN) + tid] = buf[i];
            }
        } else {
            // padding tokens stage zeros (their outputs are written as zeros)
            for (uint32_t q = tid - uint32_t(GQ_TN); q < uint32_t(GQ_TM) * 32u; q += uint32_t(GQ_THREADS - GQ_TN)) {
                const uint32_t t = m0 + (q >> 5);
                xs[q] = t < live ? static_cast<float>(xb[uint64_t(t) * uint64_t(K_DIM) + 32u * c + (q & 31u)]) : 0.0f;
            }
        }
        ds4_tg_barrier();
        for (uint32_t k4 = 0; k4 < (busy ? 8u : 0u); ++k4) {
            float4 wv[4];
            for (uint32_t j = 0; j < 4u; ++j) {
                wv[j] = gq_ws4[(4u * k4 + j) * uint32_t(GQ_TN / 4) + lane];
            }
            for (int i = 0; i < GQ_RM; ++i) {
                const float4 xv = gq_xs4[(warp * uint32_t(GQ_RM) + uint32_t(i)) * 8u + k4];
                ds4_fma4(acc[i], xv.x, wv[0]);
                ds4_fma4(acc[i], xv.y, wv[1]);
                ds4_fma4(acc[i], xv.z, wv[2]);
                ds4_fma4(acc[i], xv.w, wv[3]);
            }
        }
    }
    for (int i = 0; i < GQ_RM; ++i) {
        const uint32_t m = m0 + warp * uint32_t(GQ_RM) + uint32_t(i);
        if (m < uint32_t(M_ROWS)) {
            DEV T* yrow = y + (uint64_t(b) * uint64_t(M_ROWS) + m) * uint64_t(N_ROWS);
            for (uint32_t r = 0; r < 4u; ++r) {
                const uint32_t n = n0 + 4u * lane + r;
                if (n < uint32_t(N_ROWS)) {
                    yrow[n] = static_cast<T>(m < live ? acc[i][r] : 0.0f);
                }
            }
        }
    }
}
