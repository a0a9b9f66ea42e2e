// ds4mlx quantized-MoE kernels: gathered mat-vec and gathered dequantization
// directly on GGUF blocks (Q8_0, Q2_K, Q4_K, IQ2_XXS).
//
// This file is a set of `// @@ name` sections assembled by
// ds4mlx/kernels/quant_moe.py into mx.fast.metal_kernel sources.  The sections
// `common`, `qmv` and `dequant` are shared verbatim with the CUDA twin; only
// `prelude_metal` / `index_*_metal` are Metal-specific (their CUDA
// counterparts live in quant_moe.py).  The shared code is written in the subset
// of C++ both compilers accept and uses these names from the prelude:
//   DS4_FN           function qualifier (inline / __device__ inline)
//   DEV              address space of kernel buffers (device / nothing)
//   THR              address space of per-thread arrays (thread / nothing)
//   CONSTANT         address space of tables (constant / __constant__)
//   ds4_f16(u16)     fp16 bits -> float
//   ds4_warp_sum(f)  sum over the 32 lanes of a SIMD group / warp
//   ds4_popcount(u)  population count
//   DS4_IQ2XXS_GRID_VALUES  the 256 uint64 IQ2_XXS lattice rows
//   DS4_CHUNK        the chunk decoder of the kernel's type, e.g. ds4_chunk_q2_k
// Template constants: T (activation dtype), N_ROWS, K_DIM, ROW_BYTES.
//
// Work unit: a "chunk" is 32 consecutive values of one weight row (one Q8_0
// block, one Q4_K / IQ2_XXS sub-block, two Q2_K sub-blocks).  DS4_CHUNK(row, c,
// out) decodes chunk c of a row into 32 floats, with the same float operations
// as the numpy reference (ds4mlx.quant.dequantize), so decoded weights are
// bit-identical to it.
//
// qmv grid: (32, N_ROWS, P), threadgroup (32, QMV_ROWS, 1).  One SIMD group of
// 32 lanes per (pair, row); lane l handles chunks l, l+32, ...; a warp sum
// reduces.  dequant grid: (K_DIM/32, N_ROWS, M), threadgroup (32, 4, 1); one
// thread per chunk.

// @@ prelude_metal
#define DS4_FN inline
#define DEV device
#define THR thread
#define CONSTANT constant
inline float ds4_f16(uint16_t h) { return float(as_type<half>(h)); }
inline float ds4_warp_sum(float v) { return simd_sum(v); }
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

// @@ index_qmv_metal
const uint32_t lane = thread_position_in_threadgroup.x;
const uint32_t row = thread_position_in_grid.y;
const uint32_t pair = thread_position_in_grid.z;

// @@ qmv
// inputs: x [NX, K_DIM] T, w [E, N_ROWS, ROW_BYTES] uint8, eids [P] int32,
// xids [P] int32; output y [P, N_ROWS] T.
if (row >= uint32_t(N_ROWS)) {
    return;
}
{
    const DEV uint8_t* wrow = w + (uint64_t(eids[pair]) * uint64_t(N_ROWS) + row) * uint64_t(ROW_BYTES);
    const DEV T* xp = x + uint64_t(xids[pair]) * uint64_t(K_DIM);
    float buf[32];
    float acc = 0.0f;
    for (uint32_t c = lane; c < uint32_t(K_DIM / 32); c += 32u) {
        DS4_CHUNK(wrow, c, buf);
        const DEV T* xc = xp + c * 32u;
        float part = 0.0f;
        for (int i = 0; i < 32; ++i) {
            part += buf[i] * static_cast<float>(xc[i]);
        }
        acc += part;
    }
    acc = ds4_warp_sum(acc);
    if (lane == 0u) {
        y[uint64_t(pair) * uint64_t(N_ROWS) + row] = static_cast<T>(acc);
    }
}

// @@ index_dequant_metal
const uint32_t c = thread_position_in_grid.x;
const uint32_t row = thread_position_in_grid.y;
const uint32_t m = thread_position_in_grid.z;

// @@ dequant
// inputs: w [E, N_ROWS, ROW_BYTES] uint8, eids [M] int32; output y [M, N_ROWS, K_DIM] T.
if (c >= uint32_t(K_DIM / 32) || row >= uint32_t(N_ROWS)) {
    return;
}
{
    const DEV uint8_t* wrow = w + (uint64_t(eids[m]) * uint64_t(N_ROWS) + row) * uint64_t(ROW_BYTES);
    float buf[32];
    DS4_CHUNK(wrow, c, buf);
    DEV T* o = y + (uint64_t(m) * uint64_t(N_ROWS) + row) * uint64_t(K_DIM) + uint64_t(c) * 32u;
    for (int i = 0; i < 32; ++i) {
        o[i] = static_cast<T>(buf[i]);
    }
}
