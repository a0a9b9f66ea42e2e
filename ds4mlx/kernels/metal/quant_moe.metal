// ds4mlx quantized-MoE kernels: gathered mat-vec and gathered dequantization
// directly on GGUF blocks (Q8_0, Q2_K, Q4_K, IQ2_XXS).
//
// This file is a set of `// @@ name` sections assembled by
// ds4mlx/kernels/quant_moe.py into mx.fast.metal_kernel sources.  The sections
// `common`, `qmv`, `dequant`, `fused`, `qmv_swiglu` and `qmv_down_sum` (the fused MoE
// decode modes, at the end) are shared verbatim with the CUDA twin; only
// `prelude_metal` / `prelude_fused_metal` / `index_*_metal` are Metal-specific (their CUDA
// counterparts live in quant_moe.py).  The shared code is written in the subset
// of C++ both compilers accept and uses these names from the prelude:
//   DS4_FN           function qualifier (inline / __device__ inline)
//   DEV              address space of kernel buffers (device / nothing)
//   THR              address space of per-thread arrays (thread / nothing)
//   SHR              address space of pointers into group-shared arrays (threadgroup / nothing)
//   CONSTANT         address space of tables (constant / __constant__)
//   DS4_SHARED       declares a group-shared array in a kernel body (threadgroup / __shared__)
//   ds4_tg_barrier() barrier over the thread group, ordering its shared memory
//   ds4_f16(u16)     fp16 bits -> float
//   ds4_as_float(u)  float with bits u
//   ds4_flip(x, b)   x with its sign bit flipped where b (0 or 1) is 1
//   ds4_ld16(p), ds4_ld32(p)  one 16- / 32-bit little-endian load; p must be 2- / 4-byte aligned
//   ds4_magic_byte(v, i)  0x4B000000 | byte i of v (bits of the float 2^23 + byte)
//   ds4_warp_sum(f)  sum over the 32 lanes of a SIMD group / warp
//   ds4_popcount(u)  population count
//   DS4_IQ2XXS_GRID_VALUES  the 256 uint64 IQ2_XXS lattice rows
//   DS4_CHUNK        the chunk decoder of the kernel's type, e.g. ds4_chunk_q2_k
//   DS4_DOT16        the fused decode-and-dot of the kernel's type, e.g. ds4_dot16_q2_k
//   DS4_GRID_ROWS    rows of the IQ2_XXS lattice qmv copies to shared memory (256 or 1)
// Template constants: T (activation dtype), N_ROWS, K_DIM, ROW_BYTES; qmv also
// WARPS, RPW, X_DIV (below).
//
// Work units: a "chunk" is 32 consecutive values of one weight row (one Q8_0
// block, one Q4_K / IQ2_XXS sub-block, two Q2_K sub-blocks); a "slice" is 16
// (half a chunk).  DS4_CHUNK(row, c, out) decodes chunk c of a row into 32
// floats and DS4_DOT16(row, h, xv, grid) returns the dot product of slice h with
// xv[0..16); both form every weight with the same float operations as the numpy
// reference (ds4mlx.quant.dequantize), so decoded weights are bit-identical to it.
//
// qmv grid: (32*WARPS, ceil(N_ROWS / (WARPS*RPW)), P), thread group (32*WARPS, 1, 1):
// one group per (pair, WARPS*RPW consecutive rows).  The group first stages the
// pair's x as float32 in shared memory, then each SIMD group takes RPW rows:
// lane l handles slices l, l+32, ... (two K-quant blocks, or 16 Q8_0 blocks, per
// step of 32 slices), reads its 16 x values once for all RPW rows, accumulates
// in float32, and a warp sum reduces.  Why this shape (the first version, a SIMD
// group per row with lane l decoding chunk l into a local array and reading x
// element by element at a 64-byte stride across lanes, was 2.4-2.7x slower than
// MLX's affine gather_qmm on an H200 at any bit width: its x loads touched 16
// cache lines per instruction):
//   * lanes read consecutive slices, so a warp's weight load instruction covers
//     two blocks' bytes, in 16/32-bit words where the block layout keeps them
//     aligned;
//   * x is staged transposed (value 512s + 16l + i at 512s + 32i + l), so each of
//     a lane's 16 x reads is a conflict-free 32-lane shared-memory access, and x is
//     converted from T once per group instead of once per row;
//   * a slice's scales are decoded once for 16 values (per-lane instruction count
//     is what bounds this kernel, not bandwidth), levels become floats by a byte
//     permute and one add (ds4_byte_float), not conversion instructions, and no
//     branch depends on the lane;
//   * IQ2_XXS lattice rows come from a shared-memory copy: lanes index the table
//     divergently, which serialises __constant__ accesses.
// dequant grid: (K_DIM/32, N_ROWS, M) rounded up to whole threadgroups of (32, 4, 1); one
// thread per chunk, a warp per row and 32 consecutive chunks, whose values go through
// shared memory so that the warp's stores are contiguous (the first version
// wrote each thread's chunk directly, 32 values 64 bytes apart per store instruction,
// ~180 GB/s on an H200).

// @@ prelude_metal
#define DS4_FN inline
#define DEV device
#define THR thread
#define SHR threadgroup
#define CONSTANT constant
#define DS4_SHARED threadgroup
inline float ds4_f16(uint16_t h) { return float(as_type<half>(h)); }
inline float ds4_as_float(uint32_t u) { return as_type<float>(u); }
inline float ds4_flip(float x, uint32_t b) { return as_type<float>(as_type<uint32_t>(x) ^ (b << 31)); }
inline uint32_t ds4_ld16(const device uint8_t* p) { return uint32_t(*(const device uint16_t*)p); }
inline uint32_t ds4_ld32(const device uint8_t* p) { return *(const device uint32_t*)p; }
inline uint32_t ds4_magic_byte(uint32_t v, uint32_t i) { return 0x4B000000u | ((v >> (8u * i)) & 255u); }
inline float ds4_warp_sum(float v) { return simd_sum(v); }
inline void ds4_tg_barrier() { threadgroup_barrier(mem_flags::mem_threadgroup); }
inline uint32_t ds4_popcount(uint32_t v) { return popcount(v); }

// @@ common
CONSTANT uint64_t ds4_iq2xxs_grid[256] = { DS4_IQ2XXS_GRID_VALUES };

DS4_FN uint32_t ds4_u16(const DEV uint8_t* p) {
    return uint32_t(p[0]) | (uint32_t(p[1]) << 8);
}

DS4_FN uint32_t ds4_u32(const DEV uint8_t* p) {
    return ds4_u16(p) | (ds4_u16(p + 2) << 16);
}

DS4_FN float ds4_half_at(const DEV uint8_t* p) {
    return ds4_f16(uint16_t(ds4_u16(p)));
}

// Q8_0: 34-byte block = fp16 d, 32 x int8.  w = q * d.
DS4_FN void ds4_chunk_q8_0(const DEV uint8_t* row, uint32_t c, THR float* out) {
    const DEV uint8_t* b = row + c * 34u;
    const float d = ds4_half_at(b);
    for (int i = 0; i < 32; ++i) {
        out[i] = float(int8_t(b[2 + i])) * d;
    }
}

// Q4_K: 144-byte block of 256 = fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min)
// pairs, 128 bytes of nibbles (byte 32g+l: value 64g+l low, 64g+32+l high).
// w = (d * sc_j) * q - dmin * m_j for sub-block j = c % 8.
DS4_FN void ds4_chunk_q4_k(const DEV uint8_t* row, uint32_t c, THR float* out) {
    const DEV uint8_t* b = row + (c >> 3) * 144u;
    const uint32_t j = c & 7u;
    const float d = ds4_half_at(b);
    const float dmin = ds4_half_at(b + 2);
    const DEV uint8_t* s = b + 4;
    uint32_t sc, m;
    if (j < 4u) {
        sc = s[j] & 63u;
        m = s[j + 4] & 63u;
    } else {
        sc = (s[j + 4] & 15u) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    const float dl = d * float(sc);
    const float ml = dmin * float(m);
    const DEV uint8_t* qs = b + 16 + 32u * (j >> 1);
    const uint32_t shift = (j & 1u) * 4u;
    for (int i = 0; i < 32; ++i) {
        out[i] = dl * float((uint32_t(qs[i]) >> shift) & 15u) - ml;
    }
}

// Q2_K: 84-byte block of 256 = 16 bytes of 4-bit (scale, min) per 16 values,
// 64 bytes of 2-bit levels (byte 32h+l, bits 2s: value 128h+32s+l), fp16 d at 80,
// fp16 dmin at 82.  Chunk cc = c % 8 covers sub-blocks 2cc and 2cc+1.
DS4_FN void ds4_chunk_q2_k(const DEV uint8_t* row, uint32_t c, THR float* out) {
    const DEV uint8_t* b = row + (c >> 3) * 84u;
    const uint32_t cc = c & 7u;
    const float d = ds4_half_at(b + 80);
    const float dmin = ds4_half_at(b + 82);
    const DEV uint8_t* qs = b + 16 + 32u * (cc >> 2);
    const uint32_t shift = 2u * (cc & 3u);
    for (int h = 0; h < 2; ++h) {
        const uint32_t s = b[2u * cc + uint32_t(h)];
        const float dl = d * float(s & 15u);
        const float ml = dmin * float(s >> 4);
        for (int i = 0; i < 16; ++i) {
            out[16 * h + i] = dl * float((uint32_t(qs[16 * h + i]) >> shift) & 3u) - ml;
        }
    }
}

// IQ2_XXS: 66-byte block of 256 = fp16 d, then per 32 values 8 bytes: four
// lattice indices, then a uint32 holding four 7-bit sign masks and a 4-bit scale.
// w = (d * (0.5 + ls) * 0.25) * grid * sign.
DS4_FN void ds4_chunk_iq2_xxs(const DEV uint8_t* row, uint32_t c, THR float* out) {
    const DEV uint8_t* b = row + (c >> 3) * 66u;
    const DEV uint8_t* p = b + 2 + 8u * (c & 7u);
    const float d = ds4_half_at(b);
    const uint32_t aux = ds4_u32(p + 4);
    const float db = d * (0.5f + float(aux >> 28)) * 0.25f;
    for (int k = 0; k < 4; ++k) {
        const uint64_t g = ds4_iq2xxs_grid[p[k]];
        uint32_t s = (aux >> (7u * uint32_t(k))) & 127u;
        s |= (ds4_popcount(s) & 1u) << 7;
        for (int i = 0; i < 8; ++i) {
            const float v = db * float(uint32_t(g >> (8u * uint32_t(i))) & 255u);
            out[8 * k + i] = ((s >> uint32_t(i)) & 1u) ? -v : v;
        }
    }
}

// ---- fused decode-and-dot of one 16-value slice (qmv)
//
// Same weight arithmetic as the chunk decoders above, with the block scales taken out
// of the inner loop: a slice's levels are dotted with x first and scaled once
// (Q2_K / Q4_K: dl * sum(q x) - ml * sum(x)), so each value costs a level decode and
// one FMA (the GGUF decode was ALU-bound on a CUDA GPU: 18.1 ms a token against 13.1 ms
// with MLX 2-bit experts of about the same bytes).  A one-hot x still
// reads each weight exactly as the chunk decoder rounds it.  A slice is
// half a chunk: one Q2_K sub-block, half a Q8_0 block / Q4_K sub-block, two
// IQ2_XXS lattice rows, so its scales are decoded once per 16 values.  Loads:
// only 16-bit words in Q8_0 (34-byte) and IQ2_XXS (66-byte) blocks, which sit at
// 2-byte alignment in a row; 32-bit words in Q2_K (84) and Q4_K (144) blocks,
// whose fields used here sit at 4-byte offsets, rows being whole blocks (this
// assumes w itself starts 4-byte aligned, as MLX allocations and GGUF tensor
// data do).  Levels become floats through ds4_byte_float: float(byte i of v),
// exactly, as 2^23 + byte (the byte placed in the low mantissa bits, one byte
// permute) minus 2^23, which is cheaper than int->float conversion instructions
// (a fraction of the FMA rate on NVIDIA GPUs).

DS4_FN float ds4_byte_float(uint32_t v, uint32_t i) {
    return ds4_as_float(ds4_magic_byte(v, i)) - 8388608.0f;
}

DS4_FN float ds4_dot16_q8_0(const DEV uint8_t* row, uint32_t h, const THR float* xv, const SHR uint64_t* grid) {
    const DEV uint8_t* b = row + (h >> 1) * 34u;
    const float d = ds4_f16(uint16_t(ds4_ld16(b)));
    const DEV uint8_t* q = b + 2u + 16u * (h & 1u);
    float acc = 0.0f;
    for (int k = 0; k < 4; ++k) {
        // int8 -> float exactly: flipping the sign bits gives q + 128 in 0..255
        const uint32_t v = (ds4_ld16(q + 4 * k) | (ds4_ld16(q + 4 * k + 2) << 16)) ^ 0x80808080u;
        for (int i = 0; i < 4; ++i) {
            const float qf = ds4_as_float(ds4_magic_byte(v, uint32_t(i))) - 8388736.0f;  // 2^23 + 128
            acc += qf * xv[4 * k + i];
        }
    }
    return d * acc;
}

DS4_FN float ds4_dot16_q4_k(const DEV uint8_t* row, uint32_t h, const THR float* xv, const SHR uint64_t* grid) {
    const DEV uint8_t* b = row + (h >> 4) * 144u;
    const uint32_t j = (h >> 1) & 7u;
    const uint32_t dd = ds4_ld32(b);
    const float d = ds4_f16(uint16_t(dd & 0xFFFFu));
    const float dmin = ds4_f16(uint16_t(dd >> 16));
    // the chunk decoder's (sc, m) without its branch, which would split a warp (j < 4 in
    // lanes 0-15): bytes s[j], s[j + 4], s[j % 4] out of the three words every lane of
    // the block reads
    const uint32_t s0 = ds4_ld32(b + 4), s1 = ds4_ld32(b + 8), s2 = ds4_ld32(b + 12);
    const uint32_t sh = 8u * (j & 3u);
    const uint32_t a = ((j < 4u ? s0 : s1) >> sh) & 255u;       // s[j]
    const uint32_t e = ((j < 4u ? s1 : s2) >> sh) & 255u;       // s[j + 4]
    const uint32_t c = (s0 >> sh) & 255u;                       // s[j - 4] when j >= 4
    const uint32_t sc = j < 4u ? (a & 63u) : ((e & 15u) | ((c >> 6) << 4));
    const uint32_t m = j < 4u ? (e & 63u) : ((e >> 4) | ((a >> 6) << 4));
    const float dl = d * ds4_byte_float(sc, 0u);
    const float ml = dmin * ds4_byte_float(m, 0u);
    const DEV uint8_t* qs = b + 16u + 32u * (j >> 1) + 16u * (h & 1u);
    const uint32_t shift = (j & 1u) * 4u;
    float sq = 0.0f, sx = 0.0f;
    for (int k = 0; k < 4; ++k) {
        const uint32_t v = (ds4_ld32(qs + 4 * k) >> shift) & 0x0F0F0F0Fu;
        for (int i = 0; i < 4; ++i) {
            sq += ds4_byte_float(v, uint32_t(i)) * xv[4 * k + i];
            sx += xv[4 * k + i];
        }
    }
    return dl * sq - ml * sx;
}

DS4_FN float ds4_dot16_q2_k(const DEV uint8_t* row, uint32_t h, const THR float* xv, const SHR uint64_t* grid) {
    const DEV uint8_t* b = row + (h >> 4) * 84u;
    const uint32_t cc = (h >> 1) & 7u;
    const uint32_t dd = ds4_ld32(b + 80);
    const float d = ds4_f16(uint16_t(dd & 0xFFFFu));
    const float dmin = ds4_f16(uint16_t(dd >> 16));
    const uint32_t sb = b[h & 15u];                             // slice h % 16 is sub-block h % 16
    const float dl = d * ds4_byte_float(sb & 15u, 0u);
    const float ml = dmin * ds4_byte_float(sb >> 4, 0u);
    const DEV uint8_t* qs = b + 16u + 32u * (cc >> 2) + 16u * (h & 1u);
    const uint32_t shift = 2u * (cc & 3u);
    float sq = 0.0f, sx = 0.0f;
    for (int k = 0; k < 4; ++k) {
        const uint32_t v = (ds4_ld32(qs + 4 * k) >> shift) & 0x03030303u;
        for (int i = 0; i < 4; ++i) {
            sq += ds4_byte_float(v, uint32_t(i)) * xv[4 * k + i];
            sx += xv[4 * k + i];
        }
    }
    return dl * sq - ml * sx;
}

// A slice is lattice rows 2(h % 2) and 2(h % 2) + 1 of its chunk: index bytes and
// signs 7k..7k+6 of aux for those two k.
DS4_FN float ds4_dot16_iq2_xxs(const DEV uint8_t* row, uint32_t h, const THR float* xv, const SHR uint64_t* grid) {
    const DEV uint8_t* b = row + (h >> 4) * 66u;
    const DEV uint8_t* p = b + 2u + 8u * ((h >> 1) & 7u);
    const float d = ds4_f16(uint16_t(ds4_ld16(b)));
    const uint32_t aux = ds4_ld16(p + 4) | (ds4_ld16(p + 6) << 16);
    const float db = d * (0.5f + ds4_byte_float(aux >> 28, 0u)) * 0.25f;
    const uint32_t idx = ds4_ld16(p + 2u * (h & 1u));
    float acc = 0.0f;
    for (int t = 0; t < 2; ++t) {
        const uint32_t k = 2u * (h & 1u) + uint32_t(t);
        const uint64_t g = grid[(idx >> (8 * t)) & 255u];
        const uint32_t gw[2] = {uint32_t(g), uint32_t(g >> 32)};
        uint32_t s = (aux >> (7u * k)) & 127u;
        s |= (ds4_popcount(s) & 1u) << 7;
        for (int i = 0; i < 8; ++i) {
            // the sign flips x (its sign bit), not the level: no select, no multiply by db
            acc += ds4_byte_float(gw[i >> 2], uint32_t(i & 3)) * ds4_flip(xv[8 * t + i], (s >> uint32_t(i)) & 1u);
        }
    }
    return db * acc;
}

// @@ index_qmv_metal
const uint32_t tid = thread_position_in_threadgroup.x;
const uint32_t lane = tid & 31u;
const uint32_t warp = tid >> 5;
const uint32_t tgy = threadgroup_position_in_grid.y;
const uint32_t pair = threadgroup_position_in_grid.z;

// @@ qmv
// inputs: x [NX, K_DIM] T, w [E, N_ROWS, ROW_BYTES] uint8, eids [P] int32;
// output y [P, N_ROWS] T.  Pair p multiplies expert eids[p] with x row p / X_DIV
// (X_DIV = k when a token's k experts share its x, 1 for one x per pair).
// WARPS SIMD groups of RPW rows each per group; tid, lane, warp, tgy, pair from the index.
DS4_SHARED float xs[(K_DIM + 511) / 512 * 512];
DS4_SHARED uint64_t gs[DS4_GRID_ROWS];
{
    const uint32_t nthreads = 32u * uint32_t(WARPS);
    const DEV T* xp = x + uint64_t(pair / uint32_t(X_DIV)) * uint64_t(K_DIM);
    // position q holds value v = 512s + 16l + i where q = 512s + 32i + l (lane l's slice
    // of step s, value i); positions whose v >= K_DIM (a last, partial step) are never read
    for (uint32_t q = tid; q < uint32_t((K_DIM + 511) / 512 * 512); q += nthreads) {
        const uint32_t v = (q & ~511u) | ((q & 31u) << 4) | ((q >> 5) & 15u);
        if (v < uint32_t(K_DIM)) {
            xs[q] = static_cast<float>(xp[v]);
        }
    }
    for (uint32_t i = tid; i < uint32_t(DS4_GRID_ROWS); i += nthreads) {
        gs[i] = ds4_iq2xxs_grid[i];
    }
}
ds4_tg_barrier();
{
    const uint32_t row0 = (tgy * uint32_t(WARPS) + warp) * uint32_t(RPW);
    if (row0 < uint32_t(N_ROWS)) {
        const DEV uint8_t* we = w + uint64_t(eids[pair]) * uint64_t(N_ROWS) * uint64_t(ROW_BYTES);
        float acc[RPW];
        for (int r = 0; r < RPW; ++r) {
            acc[r] = 0.0f;
        }
        // step st: lane l takes slice 32st + l (no guard unless a row ends inside a step)
        for (uint32_t st = 0; st < uint32_t((K_DIM + 511) / 512); ++st) {
            const uint32_t h = 32u * st + lane;
            if (K_DIM % 512 != 0 && h >= uint32_t(K_DIM / 16)) {
                break;
            }
            float xv[16];
            for (int i = 0; i < 16; ++i) {
                xv[i] = xs[512u * st + 32u * uint32_t(i) + lane];     // value 16h + i
            }
            for (int r = 0; r < RPW; ++r) {
                // rows past N_ROWS redo the last row (keeps the loop free of branches); not written
                const uint32_t rr = row0 + uint32_t(r) < uint32_t(N_ROWS) ? row0 + uint32_t(r) : uint32_t(N_ROWS) - 1u;
                acc[r] += DS4_DOT16(we + uint64_t(rr) * uint64_t(ROW_BYTES), h, xv, gs);
            }
        }
        for (int r = 0; r < RPW; ++r) {
            const float tot = ds4_warp_sum(acc[r]);
            if (lane == 0u && row0 + uint32_t(r) < uint32_t(N_ROWS)) {
                y[uint64_t(pair) * uint64_t(N_ROWS) + row0 + uint32_t(r)] = static_cast<T>(tot);
            }
        }
    }
}

// @@ index_dequant_metal
const uint32_t c = thread_position_in_grid.x;
const uint32_t row = thread_position_in_grid.y;
const uint32_t m = thread_position_in_grid.z;

// @@ dequant
// inputs: w [E, N_ROWS, ROW_BYTES] uint8, eids [M] int32; output y [M, N_ROWS, K_DIM] T.
// Launched in whole thread groups of (32, 4, 1) (gather_dequantize rounds the grid up),
// so SIMD group / warp r of a group is one row (row % 4 == r) and its lane l decodes
// chunk c with c % 32 == l: a warp covers up to 32 consecutive chunks, 1,024 contiguous
// values of y.  Each lane decodes its chunk (DS4_CHUNK, as before) into shared memory,
// then after a barrier the warp writes the values in order, lane l value 32j + l at step
// j: every store instruction covers 32 consecutive T (64 bytes in 16-bit T), not 32
// values 64 bytes apart as when each thread wrote its own chunk.  Shared rows are 33
// floats apart, so both the staging writes (lane l, word 33l + i) and the reads (word
// 33j + l) touch 32 different banks.  Threads past the last chunk or row stage and
// write nothing but still reach the barrier.
DS4_SHARED float ds4_dq[4 * 32 * 33];
{
    const uint32_t lane = c & 31u;
    const uint32_t c0 = c - lane;  // the warp's first chunk
    SHR float* st = ds4_dq + (row & 3u) * (32u * 33u);
    const bool live = row < uint32_t(N_ROWS);
    if (live && c < uint32_t(K_DIM / 32)) {
        const DEV uint8_t* wrow = w + (uint64_t(eids[m]) * uint64_t(N_ROWS) + row) * uint64_t(ROW_BYTES);
        float buf[32];
        DS4_CHUNK(wrow, c, buf);
        for (int i = 0; i < 32; ++i) {
            st[33u * lane + uint32_t(i)] = buf[i];
        }
    }
    ds4_tg_barrier();
    if (live && c0 < uint32_t(K_DIM / 32)) {
        // chunks of this warp: 32, except in a row's last, partial group of 32
        const uint32_t n = (K_DIM / 32) % 32 == 0 ? 32u : (uint32_t(K_DIM / 32) - c0 < 32u ? uint32_t(K_DIM / 32) - c0 : 32u);
        DEV T* o = y + (uint64_t(m) * uint64_t(N_ROWS) + row) * uint64_t(K_DIM) + uint64_t(c0) * 32u;
        for (uint32_t j = 0; j < 32u; ++j) {
            if (j < n) {
                o[32u * j + lane] = static_cast<T>(st[33u * j + lane]);
            }
        }
    }
}
// @@ prelude_fused_metal
inline float ds4_exp(float x) { return metal::precise::exp(x); }

// @@ fused
// ---- the fused MoE decode modes (launches, not bytes, bound the decode step)
//
// qmv_swiglu: gate and up (two GGUF tensors of one type and shape) and the clamped
// SwiGLU in one launch; qmv_down_sum: the down projection of a token's k experts and
// their routing-weighted sum in one launch.  Both keep qmv's layout (x staged
// transposed in shared memory, lane l on slices l, l+32, ..., RPW rows per SIMD
// group, DS4_DOT16, float32 accumulation, a warp sum per row); their headers add the
// `fused` section (and, on Metal, `prelude_fused_metal`; its CUDA twin is in
// quant_moe.py) after the DS4_CHUNK / DS4_DOT16 defines.  Extra prelude name:
//   ds4_exp(f)       e^f (precise on Metal)
//
// Stage x row xp (k_dim values of type TX) in xs as float32, transposed as qmv stages it
// (value 512s + 16l + i at 512s + 32i + l); every thread of the group takes part.
template <typename TX>
DS4_FN void ds4_stage_x(SHR float* xs, const DEV TX* xp, uint32_t k_dim, uint32_t tid, uint32_t nthreads) {
    for (uint32_t q = tid; q < (k_dim + 511u) / 512u * 512u; q += nthreads) {
        const uint32_t v = (q & ~511u) | ((q & 31u) << 4) | ((q >> 5) & 15u);
        if (v < k_dim) {
            xs[q] = static_cast<float>(xp[v]);
        }
    }
}

// silu(min(g, lim)) * clip(u, -lim, lim), no clamp for lim <= 0: as the reference
// (activations.clamped_swiglu: g * sigmoid(g), then times u)
DS4_FN float ds4_swiglu(float g, float u, float lim) {
    if (lim > 0.0f) {
        g = g < lim ? g : lim;
        u = u < lim ? (u > -lim ? u : -lim) : lim;
    }
    return (g * (1.0f / (1.0f + ds4_exp(-g)))) * u;
}

// @@ qmv_swiglu
// inputs: x [NX, K_DIM] T, wg, wu [E, N_ROWS, ROW_BYTES] uint8 (gate, up), eids [P] int32,
// lim [1] float32 (the clamp, 0: none); output y [P, N_ROWS] T = swiglu(gate row . x, up row . x).
// Grid and staging as qmv (pair p reads x row p / X_DIV); a SIMD group takes RPW output rows,
// i.e. RPW gate rows and RPW up rows, whose dot products share each x read.
DS4_SHARED float xs[(K_DIM + 511) / 512 * 512];
DS4_SHARED uint64_t gs[DS4_GRID_ROWS];
ds4_stage_x(xs, x + uint64_t(pair / uint32_t(X_DIV)) * uint64_t(K_DIM), uint32_t(K_DIM), tid, 32u * uint32_t(WARPS));
for (uint32_t i = tid; i < uint32_t(DS4_GRID_ROWS); i += 32u * uint32_t(WARPS)) {
    gs[i] = ds4_iq2xxs_grid[i];
}
ds4_tg_barrier();
{
    const uint32_t row0 = (tgy * uint32_t(WARPS) + warp) * uint32_t(RPW);
    if (row0 < uint32_t(N_ROWS)) {
        const uint64_t base = uint64_t(eids[pair]) * uint64_t(N_ROWS) * uint64_t(ROW_BYTES);
        float ag[RPW], au[RPW];
        for (int r = 0; r < RPW; ++r) {
            ag[r] = 0.0f;
            au[r] = 0.0f;
        }
        for (uint32_t st = 0; st < uint32_t((K_DIM + 511) / 512); ++st) {
            const uint32_t h = 32u * st + lane;
            if (K_DIM % 512 != 0 && h >= uint32_t(K_DIM / 16)) {
                break;
            }
            float xv[16];
            for (int i = 0; i < 16; ++i) {
                xv[i] = xs[512u * st + 32u * uint32_t(i) + lane];
            }
            for (int r = 0; r < RPW; ++r) {
                // rows past N_ROWS redo the last row (no branch in the loop); not written
                const uint32_t rr = row0 + uint32_t(r) < uint32_t(N_ROWS) ? row0 + uint32_t(r) : uint32_t(N_ROWS) - 1u;
                const uint64_t off = base + uint64_t(rr) * uint64_t(ROW_BYTES);
                ag[r] += DS4_DOT16(wg + off, h, xv, gs);
                au[r] += DS4_DOT16(wu + off, h, xv, gs);
            }
        }
        const float lim0 = lim[0];
        for (int r = 0; r < RPW; ++r) {
            const float g = ds4_warp_sum(ag[r]);
            const float u = ds4_warp_sum(au[r]);
            if (lane == 0u && row0 + uint32_t(r) < uint32_t(N_ROWS)) {
                y[uint64_t(pair) * uint64_t(N_ROWS) + row0 + uint32_t(r)] = static_cast<T>(ds4_swiglu(g, u, lim0));
            }
        }
    }
}

// @@ qmv_down_sum
// inputs: x [NT * KE, K_DIM] T (token t's KE vectors, one per selected expert), w [E, N_ROWS,
// ROW_BYTES] uint8, eids [NT * KE] int32, wts [NT * KE] float32; output y [NT, N_ROWS] T:
// y[t, r] = sum_j wts[t KE + j] * (W[eids[t KE + j]] row r . x[t KE + j]).
// Grid (32*WARPS, ceil(N_ROWS / (WARPS*RPW)), NT): `pair` is the token.  The group stages the
// token's KE vectors one after another (the shared x of qmv, KE times); each lane adds its
// weighted partial dot products, one warp sum per row at the end.
DS4_SHARED float xs[(K_DIM + 511) / 512 * 512];
DS4_SHARED uint64_t gs[DS4_GRID_ROWS];
for (uint32_t i = tid; i < uint32_t(DS4_GRID_ROWS); i += 32u * uint32_t(WARPS)) {
    gs[i] = ds4_iq2xxs_grid[i];
}
{
    const uint32_t row0 = (tgy * uint32_t(WARPS) + warp) * uint32_t(RPW);
    float acc[RPW];
    for (int r = 0; r < RPW; ++r) {
        acc[r] = 0.0f;
    }
    for (uint32_t j = 0; j < uint32_t(KE); ++j) {
        const uint32_t p = pair * uint32_t(KE) + j;
        ds4_tg_barrier();  // every lane is done with the previous vector
        ds4_stage_x(xs, x + uint64_t(p) * uint64_t(K_DIM), uint32_t(K_DIM), tid, 32u * uint32_t(WARPS));
        ds4_tg_barrier();
        if (row0 < uint32_t(N_ROWS)) {
            const uint64_t base = uint64_t(eids[p]) * uint64_t(N_ROWS) * uint64_t(ROW_BYTES);
            const float wj = wts[p];
            float part[RPW];
            for (int r = 0; r < RPW; ++r) {
                part[r] = 0.0f;
            }
            for (uint32_t st = 0; st < uint32_t((K_DIM + 511) / 512); ++st) {
                const uint32_t h = 32u * st + lane;
                if (K_DIM % 512 != 0 && h >= uint32_t(K_DIM / 16)) {
                    break;
                }
                float xv[16];
                for (int i = 0; i < 16; ++i) {
                    xv[i] = xs[512u * st + 32u * uint32_t(i) + lane];
                }
                for (int r = 0; r < RPW; ++r) {
                    const uint32_t rr = row0 + uint32_t(r) < uint32_t(N_ROWS) ? row0 + uint32_t(r) : uint32_t(N_ROWS) - 1u;
                    part[r] += DS4_DOT16(w + base + uint64_t(rr) * uint64_t(ROW_BYTES), h, xv, gs);
                }
            }
            for (int r = 0; r < RPW; ++r) {
                acc[r] += wj * part[r];
            }
        }
    }
    if (row0 < uint32_t(N_ROWS)) {
        for (int r = 0; r < RPW; ++r) {
            const float tot = ds4_warp_sum(acc[r]);
            if (lane == 0u && row0 + uint32_t(r) < uint32_t(N_ROWS)) {
                y[uint64_t(pair) * uint64_t(N_ROWS) + row0 + uint32_t(r)] = static_cast<T>(tot);
            }
        }
    }
}
