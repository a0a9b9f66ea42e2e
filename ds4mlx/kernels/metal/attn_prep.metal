// ds4mlx attention prep of one decode token of a DeepSeek V4 layer (kernels/attn_prep.py):
// the query heads' RMSNorm (no weight) and rope, the new K=V row's RMSNorm (kv_norm weight)
// and rope written into a copy of the sliding ring at slot pos % W, and the indexer query's
// rope (CSA layers), in one launch where the plain graph runs six to eight.
//
// This file is `// @@ name` sections assembled by ds4mlx/kernels/attn_prep.py into
// mx.fast.metal_kernel and mx.fast.cuda_kernel sources (the same text for both faces, after
// the face's prelude, ds4mlx/kernels/dispatch.py PRELUDE / INDEX, and attn_prep.TRIG).
//
// attn_prep  grid (TGS * THREADS, 1, 1), TGS = ROW_TGS + COPY_TGS:
//   threadgroups [0, ROW_TGS): one SIMD group per row.  Row r < NH is query head r (D values,
//     normed, roped), r == NH the K=V row (D values, normed with kv_w, roped, written to ring
//     slot pos % W), NH < r <= NH + NHI indexer query head r - NH - 1 (DI values, roped only);
//   threadgroups [ROW_TGS, TGS): the ring copy, PER elements per thread, every slot but pos % W.
//   q [NH*D] TQ, kv [D] TKV, kv_w [D] TWN, iq [NHI*DI] TI (a dummy when NHI == 0), ring [W*D] TR,
//   freqs [RD/2] f32 (the rope periods, a dummy when RD == 0), prm [2] f32 = (eps, mscale),
//   meta [1] int32 = pos  ->  q_out [NH*D] TQ, ring_out [W*D] TR, iq_out [NHI*DI] TI
// attn_prep_rows (the header defines AP_ROWS = R > 1, AP_POS, AP_ROW_SELECT): R sessions' tokens
//   of one layer in one launch, grid (TGS * THREADS, R, 1): row r reads q / kv / iq at row r of
//   stacked inputs q_rows [R, NH*D], kv_rows [R, D], iq_rows [R, NHI*DI], its own ring_r, its
//   position poss[r], and writes q_out / iq_out at row r of stacked outputs, its own ring_out_r.
//   attn_prep is the R = 1 case (AP_POS meta[0], AP_ROW_SELECT empty).
// attn_prep_chain (the header also defines AP_KV_FIRST, AP_KV_END, AP_KV_DST, AP_WRITTEN): one
//   session's next R tokens (a speculative verify) at consecutive positions poss[r] in one
//   launch, as attn_prep_rows but over the one input ring: ring_out_r is the ring after tokens
//   0..r, so row r's K=V row goes into ring_out_r .. ring_out_{R-1} and row r's copy groups skip
//   the slots of tokens 0..r (the host keeps R <= W: no two tokens share a slot).
// RMSNorm as mx.fast.rms_norm: x * rsqrt(mean(x^2) + eps) (* w, w rounded to TKV first).
// Rope as mx.fast.rope with `freqs`, traditional pairs, on the trailing RD channels of a row:
//   pair i of them turns by theta = pos * (1 / freqs[i]) and is scaled by mscale (transformers'
//   attention factor, models/layers.RoPE).  A lane holds channel pairs (2p, 2p+1),
//   p = lane + 32 i, so a pair never leaves its lane (the host checks D - RD, DI - RD even).

// @@ attn_prep
#ifndef AP_KV_DST  // one token's K=V row goes into its own ring only
#define AP_KV_FIRST 0u
#define AP_KV_END 1u
#define AP_KV_DST(t) ring_out
#define AP_WRITTEN(sl) ((sl) == uint64_t(slot))
#endif
constexpr int WARPS = THREADS / 32;
constexpr int N_ROWS = NH + 1 + NHI;
constexpr int ROW_TGS = (N_ROWS + WARPS - 1) / WARPS;
constexpr int PAIRS = (D > DI ? D : DI) / 2;
constexpr int PPL = (PAIRS + 31) / 32;  // channel pairs per lane
const uint32_t row = AP_ROWS > 1 ? tgy : 0u;  // attn_prep_rows: one session row per grid y
(void)row;
AP_ROW_SELECT
const int pos = AP_POS;
int slot = pos % W;
if (slot < 0) {
    slot += W;
}
if (tgx >= uint32_t(ROW_TGS)) {
    const uint64_t first = uint64_t(tgx - uint32_t(ROW_TGS)) * uint64_t(THREADS * PER);
    for (int k = 0; k < PER; ++k) {
        const uint64_t e = first + uint64_t(k * THREADS) + tid;
        if (e < uint64_t(W) * uint64_t(D) && !(AP_WRITTEN(e / uint64_t(D)))) {
            ring_out[e] = ring[e];
        }
    }
    return;
}
const int r = int(tgx) * WARPS + int(warp);
if (r >= N_ROWS) {
    return;  // (whole SIMD groups: no barrier below but the SIMD group's own sum)
}
const bool is_q = r < NH;
const bool is_kv = r == NH;
const int len = (is_q || is_kv) ? D : DI;
const uint64_t row0 = is_q ? uint64_t(r) * uint64_t(D) : (is_kv ? 0u : uint64_t(r - NH - 1) * uint64_t(DI));
float x0[PPL];
float x1[PPL];
float ss = 0.0f;
for (int i = 0; i < PPL; ++i) {
    const int c = 2 * (int(lane) + 32 * i);
    x0[i] = 0.0f;
    x1[i] = 0.0f;
    if (c < len) {
        if (is_q) {
            x0[i] = static_cast<float>(q[row0 + uint32_t(c)]);
            x1[i] = static_cast<float>(q[row0 + uint32_t(c + 1)]);
        } else if (is_kv) {
            x0[i] = static_cast<float>(kv[c]);
            x1[i] = static_cast<float>(kv[c + 1]);
        } else {
            x0[i] = static_cast<float>(iq[row0 + uint32_t(c)]);
            x1[i] = static_cast<float>(iq[row0 + uint32_t(c + 1)]);
        }
    }
    ss += x0[i] * x0[i] + x1[i] * x1[i];
}
float inv = 1.0f;
if (is_q || is_kv) {
    inv = ds4_rsqrt(ds4_warp_sum(ss) / float(len) + prm[0]);
}
const float fpos = float(pos);
const float mscale = prm[1];
const int rope0 = len - RD;  // first rotated channel
for (int i = 0; i < PPL; ++i) {
    const int c = 2 * (int(lane) + 32 * i);
    if (c >= len) {
        break;
    }
    float y0 = x0[i] * inv;
    float y1 = x1[i] * inv;
    if (is_kv) {
        y0 *= static_cast<float>(static_cast<TKV>(kv_w[c]));
        y1 *= static_cast<float>(static_cast<TKV>(kv_w[c + 1]));
    }
    if (c >= rope0) {
        const float th = fpos * (1.0f / freqs[(c - rope0) / 2]);
        const float cs = ds4_cos(th);
        const float sn = ds4_sin(th);
        const float z0 = (y0 * cs - y1 * sn) * mscale;
        y1 = (y0 * sn + y1 * cs) * mscale;
        y0 = z0;
    }
    if (is_q) {
        q_out[row0 + uint32_t(c)] = static_cast<TQ>(y0);
        q_out[row0 + uint32_t(c + 1)] = static_cast<TQ>(y1);
    } else if (is_kv) {
        for (uint32_t t = AP_KV_FIRST; t < AP_KV_END; ++t) {
            DS4_DEV TR* dst = AP_KV_DST(t);
            dst[uint64_t(slot) * uint64_t(D) + uint32_t(c)] = static_cast<TR>(y0);
            dst[uint64_t(slot) * uint64_t(D) + uint32_t(c + 1)] = static_cast<TR>(y1);
        }
    } else {
        iq_out[row0 + uint32_t(c)] = static_cast<TI>(y0);
        iq_out[row0 + uint32_t(c + 1)] = static_cast<TI>(y1);
    }
}
