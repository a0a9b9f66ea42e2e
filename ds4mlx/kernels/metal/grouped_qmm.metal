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

// @@ helpers_mma
// The tensor-core variant (grouped_qmm.py's `mma=True`): the same tiles of GQ_TM tokens x 128
// output rows of one batch, the product on the face's matrix tiles (kernels/mma_tile.py:
// DS4_MMA_*, 16 x 16 x 16 PTX mma.sync on CUDA, 8 x 8 simdgroup matrices on Metal) in MT (bfloat16
// for bfloat16 x, else float16), float32 accumulation.  Template constants: those above, but
// GQ_TM (tokens per tile: 16, 32, 48 or 64) in place of GQ_RM, and MT.
// Per step of 64 values of K (two chunks): each of the 256 threads decodes one chunk of one
// weight row (rows tid % 128, chunk 2 s + tid / 128; DS4_CHUNK, bit-identical to the
// reference) and rounds it to MT into shared memory, row-major by weight row (ws[n][k], the
// B tile n-major), then all threads stage the tile's x as MT (xs[t][k]); rows are GQM_LD =
// 72 values apart (64 + 8: a 16-byte row segment per bank group, no conflict in the tile
// loads).  SIMD group g then owns output columns of GQM_NF tiles (g, g + 8, ...) for every
// token tile that holds a live token: per DS4_MMA_K of K, GQM_NF B loads, GQ_TM / DS4_MMA_M
// A loads and their products.  At the end each SIMD group stores its accumulators one tile
// at a time into its slice of the x area (now free) and its lanes write y (T), padding rows
// as zeros.  Why: the FMAs of the float32 variant are ~all of its time once the decode is
// shared by a tile; on tensor cores they cost little, so the decode (every thread decodes
// now, one chunk per step) and the loads bound the kernel.
// Shared memory: (128 + 64) x 72 MT = 27 KB (Metal's limit is 32 KB).
// Grid: (256, ceil(N_ROWS / 128), B * ceil(M_ROWS / GQ_TM)), thread group (256, 1, 1).
#define GQM_THREADS 256
#define GQM_TN 128
#define GQM_KS 64
#define GQM_LD 72
#define GQM_MF (GQ_TM / DS4_MMA_M)
#define GQM_NF (GQM_TN / (8 * DS4_MMA_N))

// @@ grouped_qmm_mma
// inputs and output as grouped_qmm's
DS4_SHARED uint4 gqm_smem[(GQM_TN + 64) * GQM_LD / 8];  // ws [128][LD] MT, xs [64][LD] MT
{
    SHR MT* ws = (SHR MT*)gqm_smem;
    SHR MT* xs = ws + GQM_TN * GQM_LD;
    // after the K loop: this SIMD group's [DS4_MMA_M][DS4_MMA_N] float32 scratch, in the x area
    SHR float* scratch = (SHR float*)xs + warp * uint32_t(DS4_MMA_M * DS4_MMA_N);
    const uint32_t m_tiles = (uint32_t(M_ROWS) + uint32_t(GQ_TM) - 1u) / uint32_t(GQ_TM);
    const uint32_t b = tgz / m_tiles;
    const uint32_t m0 = (tgz - b * m_tiles) * uint32_t(GQ_TM);
    const uint32_t n0 = tgy * uint32_t(GQM_TN);
    const uint32_t live = uint32_t(lens[b]) < uint32_t(M_ROWS) ? uint32_t(lens[b]) : uint32_t(M_ROWS);
    // token tiles holding a live token (uniform over the thread group; 0: a tile of padding only)
    const uint32_t live_tiles = m0 >= live ? 0u
        : ((live - m0 + uint32_t(DS4_MMA_M) - 1u) / uint32_t(DS4_MMA_M) < uint32_t(GQM_MF)
            ? (live - m0 + uint32_t(DS4_MMA_M) - 1u) / uint32_t(DS4_MMA_M) : uint32_t(GQM_MF));
    const DEV uint8_t* we = w + uint64_t(eids[b]) * uint64_t(N_ROWS) * uint64_t(ROW_BYTES);
    const DEV T* xb = x + uint64_t(b) * uint64_t(M_ROWS) * uint64_t(K_DIM);
    const uint32_t chunks = uint32_t(K_DIM / 32);
    // this thread's weight row (rows past N_ROWS decode the last row: computed, not written)
    const uint32_t wr = tid & uint32_t(GQM_TN - 1);
    const uint32_t r = n0 + wr < uint32_t(N_ROWS) ? n0 + wr : uint32_t(N_ROWS) - 1u;
    // this thread's 32 values of a step: 4 stores of 8 MT (16 bytes; 8 lanes' rows 144 bytes
    // apart cover the 32 banks once)
    SHR uint4* wdst = (SHR uint4*)(ws + wr * uint32_t(GQM_LD) + (tid / uint32_t(GQM_TN)) * 32u);
    DS4_MMA_C acc[GQM_MF][GQM_NF];
    for (int i = 0; i < GQM_MF; ++i) {
        for (int j = 0; j < GQM_NF; ++j) {
            ds4_mma_zero(acc[i][j]);
        }
    }
    for (uint32_t s = 0; s < (live_tiles > 0u ? (chunks + 1u) / 2u : 0u); ++s) {
        ds4_tg_barrier();  // every SIMD group is done with the previous step's tiles
        const uint32_t c = 2u * s + tid / uint32_t(GQM_TN);
        float buf[32];
        if (c < chunks) {
            DS4_CHUNK(we + uint64_t(r) * uint64_t(ROW_BYTES), c, buf);
        } else {  // an odd number of chunks: the last step's second half is zeros
            for (int i = 0; i < 32; ++i) {
                buf[i] = 0.0f;
            }
        }
        for (int g = 0; g < 4; ++g) {
            uint4 v;
            v.x = ds4_mma_bits(buf[8 * g]) | (ds4_mma_bits(buf[8 * g + 1]) << 16);
            v.y = ds4_mma_bits(buf[8 * g + 2]) | (ds4_mma_bits(buf[8 * g + 3]) << 16);
            v.z = ds4_mma_bits(buf[8 * g + 4]) | (ds4_mma_bits(buf[8 * g + 5]) << 16);
            v.w = ds4_mma_bits(buf[8 * g + 6]) | (ds4_mma_bits(buf[8 * g + 7]) << 16);
            wdst[g] = v;
        }
        // padding tokens and K past K_DIM stage zeros (their outputs are written as zeros)
        for (uint32_t q = tid; q < uint32_t(GQ_TM * GQM_KS); q += uint32_t(GQM_THREADS)) {
            const uint32_t t = q / uint32_t(GQM_KS);
            const uint32_t k = uint32_t(GQM_KS) * s + (q & uint32_t(GQM_KS - 1));
            const float v = m0 + t < live && k < uint32_t(K_DIM) ? static_cast<float>(xb[uint64_t(m0 + t) * uint64_t(K_DIM) + k]) : 0.0f;
            xs[t * uint32_t(GQM_LD) + (q & uint32_t(GQM_KS - 1))] = static_cast<MT>(v);
        }
        ds4_tg_barrier();
        for (uint32_t kk = 0; kk < uint32_t(GQM_KS); kk += uint32_t(DS4_MMA_K)) {
            DS4_MMA_B bt[GQM_NF];
            for (int j = 0; j < GQM_NF; ++j) {
                ds4_mma_load_b(bt[j], ws + (warp + 8u * uint32_t(j)) * uint32_t(DS4_MMA_N * GQM_LD) + kk, GQM_LD);
            }
            for (int i = 0; i < GQM_MF; ++i) {
                if (uint32_t(i) < live_tiles) {
                    DS4_MMA_A at;
                    ds4_mma_load_a(at, xs + uint32_t(i) * uint32_t(DS4_MMA_M * GQM_LD) + kk, GQM_LD);
                    for (int j = 0; j < GQM_NF; ++j) {
                        ds4_mma(acc[i][j], at, bt[j]);
                    }
                }
            }
        }
    }
    ds4_tg_barrier();  // the x area becomes the SIMD groups' scratch
    for (int i = 0; i < GQM_MF; ++i) {
        for (int j = 0; j < GQM_NF; ++j) {
            const uint32_t mb = m0 + uint32_t(i * DS4_MMA_M);
            const uint32_t nb = n0 + (warp + 8u * uint32_t(j)) * uint32_t(DS4_MMA_N);
            if (uint32_t(i) < live_tiles) {
                ds4_mma_store(scratch, acc[i][j], DS4_MMA_N);
            }
            ds4_mma_barrier();
            for (uint32_t e = lane; e < uint32_t(DS4_MMA_M * DS4_MMA_N); e += 32u) {
                const uint32_t m = mb + e / uint32_t(DS4_MMA_N);
                const uint32_t n = nb + e % uint32_t(DS4_MMA_N);
                if (m < uint32_t(M_ROWS) && n < uint32_t(N_ROWS)) {
                    y[(uint64_t(b) * uint64_t(M_ROWS) + m) * uint64_t(N_ROWS) + n] = static_cast<T>(m < live ? scratch[e] : 0.0f);
                }
            }
            ds4_mma_barrier();  // every lane has read the scratch before the next tile's store
        }
    }
}
