// ds4mlx compressor step: one decode token through one DeepSeek V4 compressor (the
// attention's or the indexer's of a CSA layer, or an HCA layer's) in one launch.
//
// This file is a set of `// @@ name` sections assembled by
// ds4mlx/kernels/compressor_step.py into mx.fast.metal_kernel and mx.fast.cuda_kernel
// sources: the same `common` and `compressor_step` text for both faces, after the
// face's prelude and index block (ds4mlx/kernels/dispatch.py PRELUDE / INDEX).
//
// compressor_step  grid (GROUPS*THREADS, 1, 1); threadgroup 0 pools, the others copy.
//   buf_kv, buf_gate [M, CC*D] T (CC = 2 with OVERLAP, else 1), ov_kv, ov_gate [M, D] T
//   (OVERLAP; else any 1-element dummies), rows [CAP, D] T, kv [CC*D] TK, gate [CC*D] TG
//   (this token's projections), bias [M, CC*D] TB (position_bias), weight [D] TW
//   (kv_norm), periods [ROPE/2] f32 (the compress rope's periods, 1 / inv_freq),
//   prm [2] f32 = (norm eps, attention factor rounded to T), meta [1] int32 = (CAP),
//   pos [] int32 (0-d)
//   -> buf_kv_out, buf_gate_out [M, CC*D] T, ov_kv_out, ov_gate_out [M, D] T (OVERLAP;
//      else 1-element dummies, not written), rows_out [CAP, D] T
//
//   With b = pos % M and w0 = pos / M: the new buffers are the old ones with row b
//   replaced by this token's kv / gate (cast to T); with OVERLAP, when the window is
//   complete (b == M-1) the new overlap state is the new buffers' "Ca" half (gate plus
//   position bias), else the old one.  rows_out is rows with row w0 replaced by the
//   pooled row of window w0 when this token completes it (b == M-1); else rows as they were.
//
//   Pooling, per channel j (threadgroup 0, channels j = tid, tid + THREADS, ...): the
//   window is the M new buffer rows (channels j), or with OVERLAP the M old overlap rows
//   then the M new buffer rows' "Cb" half (channels D + j); gate g = T(gate + T(bias))
//   (the overlap gate already holds its bias); p = exp(g - max) / sum in float32;
//   row_j = T(sum_e T(kv_e * T(p_e))) (float32 sum).  Then RMSNorm over the D channels
//   (float32 sum of squares, y = T(row * rsqrt(mean + eps)), T(y * T(weight))), then
//   the rope on the last ROPE channels, traditional pairs (NOPE + 2i, NOPE + 2i + 1),
//   angle float(M) * float(w0) * (1 / periods[i]), each result rounded to T and times
//   the attention factor (rounded to T again): the roundings of the MLX graph
//   (ds4mlx/models/deepseek_v4.py, Compressor.pool_step's reference face).
//
//   Copy groups g >= 1: 16-byte units u = (g-1)*THREADS*PER + e*THREADS + tid, e < PER,
//   over [rows | buf_kv | buf_gate]; the units of row w0 of rows and of row b of the
//   buffers are skipped (threadgroup 0 writes them: no two groups write one address).
//   The host keeps D * sizeof(T) a multiple of 16 bytes.
//
// compressor_step_rows  grid (GROUPS*THREADS, R, 1): R sessions' compressors of one layer
//   (session batching), row r with its own buffers (buf_kv_r, ... rows_r, kv_r, gate_r,
//   meta_r in; buf_kv_out_r, ... rows_out_r out) at position poss[r] (poss [R] int32 in
//   place of pos); bias, weight, periods, prm shared.  GROUPS covers the largest row.

// compressor_chain  grid (GROUPS*THREADS, R, 1): one session's next R tokens (a speculative
//   verify) at consecutive positions poss[0] .. poss[0] + R - 1 through one compressor, in one
//   launch (kernels/attn_prologue.py's attn_prologue_chain).  Grid row r writes the state after
//   tokens 0..r (buf_kv_out_r, ... rows_out_r: the header's CS_ROW_SELECT picks them) from the
//   state before the chain (buf_kv, buf_gate, ov_kv, ov_gate, rows) and token t's projections
//   CC_KV(t) [CC*D] TK, CC_GATE(t) [CC*D] TG (the header's picks of kv_t, gate_t), as
//   compressor_step run token after token would: no row
//   reads another's output.  Token s's buffer row is b_s = (poss[0] + s) % M; the buffers "at
//   token s" hold at row i the projection of the latest token s' <= s with b_s' == i, else the
//   old row (CC_KV_AT); the overlap state before token s is the Ca half of the buffers at the
//   latest window end c < s, else the old one.  Group 0 writes row r's buffer rows of tokens
//   0..r, its overlap state, and rows w0_0 .. w0_r of rows_out_r (each token that ends a
//   window pools it as compressor_step does; the others keep the old row); the copy groups
//   copy the rest.

// @@ common
// pos is a 0-d input: MLX's Metal face passes it by reference, the CUDA face by pointer
#if defined(__METAL_VERSION__)
#define CS_SCALAR(a) (a)
#else
#define CS_SCALAR(a) ((a)[0])
#endif
// one launch for one compressor (CS_ROWS 1); compressor_step_rows' header defines CS_ROWS > 1,
// CS_POS (poss[row]) and CS_ROW_SELECT (row r's buffers in, row r's buffers out)
#ifndef CS_ROWS
#define CS_ROWS 1
#define CS_POS CS_SCALAR(pos)
#define CS_ROW_SELECT
#endif
#if defined(__METAL_VERSION__)
DS4_FN float cs_cos(float x) { return metal::precise::cos(x); }
DS4_FN float cs_sin(float x) { return metal::precise::sin(x); }
#elif defined(__CUDACC__)
DS4_FN float cs_cos(float x) { return cosf(x); }
DS4_FN float cs_sin(float x) { return sinf(x); }
#else
DS4_FN float cs_cos(float x) { return std::cos(x); }
DS4_FN float cs_sin(float x) { return std::sin(x); }
#endif

// v rounded to T, as a float
template <typename T, typename U>
DS4_FN float cs_round(U v) {
    return static_cast<float>(static_cast<T>(static_cast<float>(v)));
}

// the new buffer's value at (row i, channel k): this token's projection at row b
template <typename T, typename TP>
DS4_FN float cs_new(const DS4_DEV T* buf, const DS4_DEV TP* proj, uint32_t i, uint32_t k, uint32_t b, uint32_t width) {
    return i == b ? cs_round<T>(proj[k]) : static_cast<float>(buf[i * width + k]);
}

// the new gate buffer plus the position bias at (row i, channel k), rounded to T
template <typename T, typename TG, typename TB>
DS4_FN float cs_gate(
    const DS4_DEV T* buf_gate,
    const DS4_DEV TG* gate,
    const DS4_DEV TB* bias,
    uint32_t i,
    uint32_t k,
    uint32_t b,
    uint32_t width) {
    return cs_round<T>(cs_new<T>(buf_gate, gate, i, k, b, width) + cs_round<T>(bias[i * width + k]));
}

// @@ compressor_step
constexpr int CC = OVERLAP ? 2 : 1;
constexpr uint32_t CD = uint32_t(CC * D);  // channels of one buffer row
constexpr uint32_t WIN = uint32_t(CC * M);  // rows of the pooling window
constexpr uint32_t NOPE = uint32_t(D - ROPE);
constexpr uint32_t ROW_UNITS = uint32_t(D * sizeof(T) / 16);  // 16-byte units of a row
constexpr uint32_t BUF_UNITS = uint32_t(CC) * ROW_UNITS;
DS4_SHARED float nrm[D];
DS4_SHARED float red[THREADS / 32];

const uint32_t row = CS_ROWS > 1 ? tgy : 0u;  // compressor_step_rows: one session row per grid y
(void)row;
CS_ROW_SELECT
const int32_t p = CS_POS;
const uint32_t b = uint32_t(p % M);
const uint32_t w0 = uint32_t(p / M);
const uint32_t cap = uint32_t(meta[0]);

if (tgx > 0u) {
    // copy groups: rows, buf_kv and buf_gate, skipping the rows group 0 writes
    const uint64_t rows_units = uint64_t(cap) * ROW_UNITS;
    const uint64_t buf_units = uint64_t(M) * BUF_UNITS;
    const uint64_t base = uint64_t(tgx - 1u) * uint64_t(THREADS * PER);
    for (int e = 0; e < PER; ++e) {
        uint64_t u = base + uint64_t(e) * uint64_t(THREADS) + tid;
        if (u < rows_units) {
            if (u / ROW_UNITS != uint64_t(w0)) {
                ((DS4_DEV uint4*)(rows_out))[u] = ((const DS4_DEV uint4*)(rows))[u];
            }
            continue;
        }
        u -= rows_units;
        const bool kv_half = u < buf_units;
        if (!kv_half) {
            u -= buf_units;
        }
        if (u >= buf_units || u / BUF_UNITS == uint64_t(b)) {
            continue;
        }
        if (kv_half) {
            ((DS4_DEV uint4*)(buf_kv_out))[u] = ((const DS4_DEV uint4*)(buf_kv))[u];
        } else {
            ((DS4_DEV uint4*)(buf_gate_out))[u] = ((const DS4_DEV uint4*)(buf_gate))[u];
        }
    }
} else {
    // this token's row of the new buffers
    for (uint32_t k = tid; k < CD; k += uint32_t(THREADS)) {
        buf_kv_out[b * CD + k] = static_cast<T>(static_cast<float>(kv[k]));
        buf_gate_out[b * CD + k] = static_cast<T>(static_cast<float>(gate[k]));
    }
    if (OVERLAP) {
        // a completed window's Ca half becomes the next window's overlap rows
        const bool complete = b == uint32_t(M - 1);
        for (uint32_t k = tid; k < uint32_t(M * D); k += uint32_t(THREADS)) {
            const uint32_t i = k / uint32_t(D);
            const uint32_t j = k % uint32_t(D);
            if (complete) {
                ov_kv_out[k] = static_cast<T>(cs_new<T>(buf_kv, kv, i, j, b, CD));
                ov_gate_out[k] = static_cast<T>(cs_gate<T>(buf_gate, gate, bias, i, j, b, CD));
            } else {
                ov_kv_out[k] = ov_kv[k];
                ov_gate_out[k] = ov_gate[k];
            }
        }
    }

    // an incomplete window's row is not live (the attention and the indexer read complete
    // windows only) and is rewritten when the window completes: keep row w0 as it was and
    // skip the pooling, which is serial over the window (ratio 128: ~200 us on the H200)
    if (b != uint32_t(M - 1)) {
        if (w0 < cap) {
            for (uint32_t j = tid; j < uint32_t(D); j += uint32_t(THREADS)) {
                rows_out[uint64_t(w0) * uint64_t(D) + j] = rows[uint64_t(w0) * uint64_t(D) + j];
            }
        }
        return;
    }

    // the gated pooling, one channel per thread at a time (three passes over the window:
    // max, sum, weighted sum, so that the weights round to T as the graph's do)
    float ss = 0.0f;
    for (uint32_t j = tid; j < uint32_t(D); j += uint32_t(THREADS)) {
        float gmax = DS4_NEG_INF;
        for (uint32_t e = 0; e < WIN; ++e) {
            const float g = (OVERLAP && e < uint32_t(M)) ? static_cast<float>(ov_gate[e * uint32_t(D) + j])
                                                        : cs_gate<T>(buf_gate, gate, bias, e % uint32_t(M),
                                                                     (OVERLAP ? uint32_t(D) : 0u) + j, b, CD);
            gmax = ds4_fmax(gmax, g);
        }
        float sum = 0.0f;
        for (uint32_t e = 0; e < WIN; ++e) {
            const float g = (OVERLAP && e < uint32_t(M)) ? static_cast<float>(ov_gate[e * uint32_t(D) + j])
                                                        : cs_gate<T>(buf_gate, gate, bias, e % uint32_t(M),
                                                                     (OVERLAP ? uint32_t(D) : 0u) + j, b, CD);
            sum += ds4_exp(g - gmax);
        }
        float acc = 0.0f;
        for (uint32_t e = 0; e < WIN; ++e) {
            float g, v;
            if (OVERLAP && e < uint32_t(M)) {
                g = static_cast<float>(ov_gate[e * uint32_t(D) + j]);
                v = static_cast<float>(ov_kv[e * uint32_t(D) + j]);
            } else {
                const uint32_t i = e % uint32_t(M);
                const uint32_t k = (OVERLAP ? uint32_t(D) : 0u) + j;
                g = cs_gate<T>(buf_gate, gate, bias, i, k, b, CD);
                v = cs_new<T>(buf_kv, kv, i, k, b, CD);
            }
            const float w = cs_round<T>(ds4_exp(g - gmax) / sum);
            acc += cs_round<T>(v * w);
        }
        const float r = cs_round<T>(acc);
        nrm[j] = r;
        ss += r * r;
    }

    // RMSNorm over the D channels
    ss = ds4_warp_sum(ss);
    if (lane == 0u) {
        red[warp] = ss;
    }
    ds4_tg_barrier();
    float tot = 0.0f;
    for (int q = 0; q < THREADS / 32; ++q) {
        tot += red[q];
    }
    const float rs = ds4_rsqrt(tot / float(D) + prm[0]);
    for (uint32_t j = tid; j < uint32_t(D); j += uint32_t(THREADS)) {
        const float y = cs_round<T>(nrm[j] * rs);
        nrm[j] = cs_round<T>(y * cs_round<T>(weight[j]));
    }
    ds4_tg_barrier();

    // the compress rope at position w0 * M on the last ROPE channels, then row w0
    const float at = float(M) * float(int32_t(w0));
    const float mscale = prm[1];
    for (uint32_t j = tid; j < uint32_t(D); j += uint32_t(THREADS)) {
        float v = nrm[j];
        if (j >= NOPE) {
            const uint32_t q = j - NOPE;
            const uint32_t first = NOPE + (q & ~1u);
            const float theta = at * (1.0f / periods[q >> 1]);
            const float c = cs_cos(theta);
            const float s = cs_sin(theta);
            const float x1 = nrm[first];
            const float x2 = nrm[first + 1u];
            v = (q & 1u) ? x1 * s + x2 * c : x1 * c - x2 * s;
            v = cs_round<T>(v) * mscale;
        }
        if (w0 < cap) {
            rows_out[uint64_t(w0) * uint64_t(D) + j] = static_cast<T>(v);
        }
    }
}

// @@ compressor_chain
constexpr int CC = OVERLAP ? 2 : 1;
constexpr uint32_t CD = uint32_t(CC * D);  // channels of one buffer row
constexpr uint32_t WIN = uint32_t(CC * M);  // rows of the pooling window
constexpr uint32_t NOPE = uint32_t(D - ROPE);
constexpr uint32_t ROW_UNITS = uint32_t(D * sizeof(T) / 16);  // 16-byte units of a row
constexpr uint32_t BUF_UNITS = uint32_t(CC) * ROW_UNITS;
DS4_SHARED float nrm[D];
DS4_SHARED float red[THREADS / 32];

const uint32_t row = tgy;  // this grid row's output: the state after chain tokens 0..row
CS_ROW_SELECT
// the latest chain token s' <= s whose buffer row is i (negative: none, the old row holds)
#define CC_LATEST(i, s) (int32_t(s) - int32_t((b0 + uint32_t(s) + uint32_t(M) - (i)) % uint32_t(M)))
// the buffers at chain token s, row i, channel k (CC_KV(t) / CC_GATE(t): token t's projections)
#define CC_KV_AT(i, k, s) (CC_LATEST(i, s) >= 0 ? cs_round<T>(CC_KV(CC_LATEST(i, s))[k]) \
                                                : static_cast<float>(buf_kv[(i) * CD + (k)]))
#define CC_GATE_AT(i, k, s)                                                                      \
    cs_round<T>((CC_LATEST(i, s) >= 0 ? cs_round<T>(CC_GATE(CC_LATEST(i, s))[k])              \
                                      : static_cast<float>(buf_gate[(i) * CD + (k)])) +      \
                cs_round<T>(bias[(i) * CD + (k)]))
// the chain token of the latest window end before token s (negative: none in the chain)
#define CC_LAST_END(s) (int32_t(s) - 1 - int32_t((b0 + uint32_t(s)) % uint32_t(M)))
const int32_t p0 = poss[0];
const uint32_t b0 = uint32_t(p0 % M);
const uint32_t w_first = uint32_t(p0 / M);
const uint32_t w_last = uint32_t((p0 + int32_t(row)) / M);
const uint32_t cap = uint32_t(meta[0]);

if (tgx > 0u) {
    // copy groups: rows, buf_kv and buf_gate, skipping the rows group 0 writes
    const uint64_t rows_units = uint64_t(cap) * ROW_UNITS;
    const uint64_t buf_units = uint64_t(M) * BUF_UNITS;
    const uint64_t base = uint64_t(tgx - 1u) * uint64_t(THREADS * PER);
    for (int e = 0; e < PER; ++e) {
        uint64_t u = base + uint64_t(e) * uint64_t(THREADS) + tid;
        if (u < rows_units) {
            const uint64_t w = u / ROW_UNITS;
            if (w < uint64_t(w_first) || w > uint64_t(w_last)) {
                ((DS4_DEV uint4*)(rows_out))[u] = ((const DS4_DEV uint4*)(rows))[u];
            }
            continue;
        }
        u -= rows_units;
        const bool kv_half = u < buf_units;
        if (!kv_half) {
            u -= buf_units;
        }
        if (u >= buf_units || (uint32_t(u / BUF_UNITS) + uint32_t(M) - b0) % uint32_t(M) <= row) {
            continue;
        }
        if (kv_half) {
            ((DS4_DEV uint4*)(buf_kv_out))[u] = ((const DS4_DEV uint4*)(buf_kv))[u];
        } else {
            ((DS4_DEV uint4*)(buf_gate_out))[u] = ((const DS4_DEV uint4*)(buf_gate))[u];
        }
    }
} else {
    // the buffer rows of tokens 0..row, in token order (a later token's replaces an earlier one's)
    for (uint32_t s = 0; s <= row; ++s) {
        const uint32_t bs = (b0 + s) % uint32_t(M);
        for (uint32_t k = tid; k < CD; k += uint32_t(THREADS)) {
            buf_kv_out[bs * CD + k] = static_cast<T>(static_cast<float>(CC_KV(s)[k]));
            buf_gate_out[bs * CD + k] = static_cast<T>(static_cast<float>(CC_GATE(s)[k]));
        }
    }
    if (OVERLAP) {
        // the overlap state after token row: the Ca half of the buffers at the latest window end
        const int32_t c = CC_LAST_END(row + 1u);
        for (uint32_t k = tid; k < uint32_t(M * D); k += uint32_t(THREADS)) {
            const uint32_t i = k / uint32_t(D);
            const uint32_t j = k % uint32_t(D);
            if (c >= 0) {
                ov_kv_out[k] = static_cast<T>(CC_KV_AT(i, j, c));
                ov_gate_out[k] = static_cast<T>(CC_GATE_AT(i, j, c));
            } else {
                ov_kv_out[k] = ov_kv[k];
                ov_gate_out[k] = ov_gate[k];
            }
        }
    }
    // rows w0_0 .. w0_row: a window that token s ends is pooled (as compressor_step pools it, over
    // the buffers at token s), an incomplete one keeps its old row
    for (uint32_t s = 0; s <= row; ++s) {
        const int32_t p = p0 + int32_t(s);
        const uint32_t w0 = uint32_t(p / M);
        if (uint32_t(p % M) != uint32_t(M - 1)) {
            if (w0 < cap) {
                for (uint32_t j = tid; j < uint32_t(D); j += uint32_t(THREADS)) {
                    rows_out[uint64_t(w0) * uint64_t(D) + j] = rows[uint64_t(w0) * uint64_t(D) + j];
                }
            }
            continue;
        }
        ds4_tg_barrier();  // an earlier pooling's readers of nrm and red are done
        const int32_t c = CC_LAST_END(s);  // the overlap rows' window end
        float ss = 0.0f;
        for (uint32_t j = tid; j < uint32_t(D); j += uint32_t(THREADS)) {
            float gmax = DS4_NEG_INF;
            for (uint32_t e = 0; e < WIN; ++e) {
                float g;
                if (OVERLAP && e < uint32_t(M)) {
                    g = c >= 0 ? CC_GATE_AT(e, j, c) : static_cast<float>(ov_gate[e * uint32_t(D) + j]);
                } else {
                    g = CC_GATE_AT(e % uint32_t(M), (OVERLAP ? uint32_t(D) : 0u) + j, s);
                }
                gmax = ds4_fmax(gmax, g);
            }
            float sum = 0.0f;
            for (uint32_t e = 0; e < WIN; ++e) {
                float g;
                if (OVERLAP && e < uint32_t(M)) {
                    g = c >= 0 ? CC_GATE_AT(e, j, c) : static_cast<float>(ov_gate[e * uint32_t(D) + j]);
                } else {
                    g = CC_GATE_AT(e % uint32_t(M), (OVERLAP ? uint32_t(D) : 0u) + j, s);
                }
                sum += ds4_exp(g - gmax);
            }
            float acc = 0.0f;
            for (uint32_t e = 0; e < WIN; ++e) {
                float g, v;
                if (OVERLAP && e < uint32_t(M)) {
                    if (c >= 0) {
                        g = CC_GATE_AT(e, j, c);
                        v = CC_KV_AT(e, j, c);
                    } else {
                        g = static_cast<float>(ov_gate[e * uint32_t(D) + j]);
                        v = static_cast<float>(ov_kv[e * uint32_t(D) + j]);
                    }
                } else {
                    const uint32_t i = e % uint32_t(M);
                    const uint32_t k = (OVERLAP ? uint32_t(D) : 0u) + j;
                    g = CC_GATE_AT(i, k, s);
                    v = CC_KV_AT(i, k, s);
                }
                const float w = cs_round<T>(ds4_exp(g - gmax) / sum);
                acc += cs_round<T>(v * w);
            }
            const float r = cs_round<T>(acc);
            nrm[j] = r;
            ss += r * r;
        }

        // RMSNorm over the D channels
        ss = ds4_warp_sum(ss);
        if (lane == 0u) {
            red[warp] = ss;
        }
        ds4_tg_barrier();
        float tot = 0.0f;
        for (int q = 0; q < THREADS / 32; ++q) {
            tot += red[q];
        }
        const float rs = ds4_rsqrt(tot / float(D) + prm[0]);
        for (uint32_t j = tid; j < uint32_t(D); j += uint32_t(THREADS)) {
            const float y = cs_round<T>(nrm[j] * rs);
            nrm[j] = cs_round<T>(y * cs_round<T>(weight[j]));
        }
        ds4_tg_barrier();

        // the compress rope at position w0 * M on the last ROPE channels, then row w0
        const float at = float(M) * float(int32_t(w0));
        const float mscale = prm[1];
        for (uint32_t j = tid; j < uint32_t(D); j += uint32_t(THREADS)) {
            float v = nrm[j];
            if (j >= NOPE) {
                const uint32_t q = j - NOPE;
                const uint32_t first = NOPE + (q & ~1u);
                const float theta = at * (1.0f / periods[q >> 1]);
                const float cth = cs_cos(theta);
                const float sth = cs_sin(theta);
                const float x1 = nrm[first];
                const float x2 = nrm[first + 1u];
                v = (q & 1u) ? x1 * sth + x2 * cth : x1 * cth - x2 * sth;
                v = cs_round<T>(v) * mscale;
            }
            if (w0 < cap) {
                rows_out[uint64_t(w0) * uint64_t(D) + j] = static_cast<T>(v);
            }
        }
    }
}
#undef CC_LATEST
#undef CC_KV_AT
#undef CC_GATE_AT
#undef CC_LAST_END
