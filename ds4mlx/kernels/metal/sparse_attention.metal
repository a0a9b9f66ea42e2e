// ds4mlx sparse attention kernels for DeepSeek V4 compressed layers (CSA / HCA):
// lightning-indexer scoring, top-k selection, and attention over the sliding
// window plus the selected (CSA) or all causal (HCA) compressed rows, with the
// per-head sink.
//
// This file is a set of `// @@ name` sections assembled by
// ds4mlx/kernels/sparse_attention.py into mx.fast.metal_kernel and
// mx.fast.cuda_kernel sources: the same `common`, `index_score`, `topk` and
// `attend` text for both faces, after the face's prelude and index block
// (ds4mlx/kernels/dispatch.py PRELUDE / INDEX).
//
// Positions: the chunk's queries sit at positions s .. s+C-1.  Query t sees
// compressed row w iff w < (s+t+1) / RATIO (the causal limit, at most N live rows).
// Run-time values travel in a small int32 `meta` array (no recompilation per step).
//
// index_score  grid (ceil(N/THREADS)*THREADS, C, 1); one thread per (row, query):
//   q [NH, C, DI] TQ, w [C, NH] TW, keys [>=N, DI] TK, prm [1] f32 = weight scale,
//   meta [3] int32 = (s, N, C)  ->  scores [C, N] f32
//   scores[t, r] = sum_h (w[t,h] * scale) * max(q[h,t] . keys[r], 0) for r below the
//   causal limit, -inf above it.  q is staged per HG heads in threadgroup memory.
//   (Prefill chunks: many queries fill the GPU.)
//
// index_score_heads  grid (ceil(N/ROWS)*THREADS, C, 1); one threadgroup per ROWS rows of a
//   query, same inputs and result as index_score.  SIMD group g takes heads g, g + WARPS, ...
//   (their q and weights in registers, lane l holding channels l, l+32, ...), each row's dot
//   products are SIMD-group sums, the groups' head sums meet in threadgroup memory.  For
//   decode: ceil(N/ROWS) threadgroups where index_score launches ceil(N/THREADS).
//
// topk  grid (THREADS, C, 1); one threadgroup per query:
//   scores [C, N] f32, meta [3] = (s, N, C)  ->  idx [C, TOPK] int32, cnt [C] int32
//   If the causal limit L <= TOPK: idx = 0..L-1, cnt = L.  Otherwise a radix select
//   (4 passes of 8 bits over order-preserving uint32 keys, histogram in threadgroup
//   atomics) finds the TOPK-th largest key, and a deterministic compaction (each
//   thread a contiguous segment, exclusive scans of the counts) writes the chosen
//   row indices in ascending order; ties at the threshold go to the lowest indices.
//   Entries past cnt are 0.
//
// index_topk  grid (ceil(N/ROWS)*THREADS, C, 1) (decode, CUDA: one launch where
//   index_score_heads + topk take two): index_score_heads (its names that topk declares
//   again renamed by `index_topk_names`), then `index_topk_last`: each threadgroup counts
//   itself done in tickets[t] (a device atomic after a device fence; tickets [>= C] u32 is
//   zero at launch and zero again after it: the last resets it) and the one that counts
//   ceil(N/ROWS) runs topk for query t on the scores row the others wrote (after a second
//   fence).  Inputs q, w, keys, prm, meta as index_score_heads, then tickets; outputs
//   scores, idx, cnt.  THREADS is index_score_heads's (the scores are bit-identical to its
//   launch); topk's result does not depend on its thread count (the k-th largest key, every
//   larger one and the lowest-index equal ones, ascending), so idx / cnt equal the separate
//   topk launch's.  Needs DS4_DEVICE_TICKETS (asserted): Metal keeps the two launches.
//   index_topk_rows: R sessions' decode queries (C = 1) in one launch, grid (G*THREADS, R, 1),
//   G for the row with the most indexer rows: row r reads q_r, w_r, keys_r, meta_r and writes
//   scores_r and row r of idx [R, TOPK] / cnt [R]; its ticket is tickets[r]; a threadgroup past
//   its row's ceil(N_r/ROWS) returns at once (sparse_attention.py writes that prologue).
//
// attend  grid (NH*THREADS, C, SPLIT); one threadgroup per (head, query, key split):
//   q [NH, C, D] T, keys [L, D] TK (the window: W ring slots, then the chunk's own
//   rows in prefill), rows [>=N, D] TK (compressed rows), idx [C, TOPK] int32,
//   cnt [C] int32 (SELECTED; dummies otherwise), sinks [NH] TS, rope [max(RD/2, 1)] f32
//   (output rope periods), prm [2] f32 = (softmax scale, rope mscale),
//   meta [5] int32 = (s, ring_last, L, N, C), tickets [>= NH*C] u32 (SPLIT > 1: zero at
//   launch, and zero again after it: the last split of (head, query) resets its ticket)
//   ->  o [NH, C, D] T, part [NH*C*SPLIT*(D+2)] f32 (SPLIT > 1; a dummy otherwise)
//   Ring slot j holds position ring_last - ((ring_last - j) mod W) (ring_last = s in
//   decode, where the ring already holds the query's row; s-1 in prefill); chunk row
//   W+c holds position s+c.  A window key is used iff its position p satisfies
//   0 <= p <= s+t and p > s+t-W.  Compressed keys: rows[idx[t, 0..cnt[t])] (SELECTED)
//   or rows[0 .. causal limit).  K = V (shared-KV MQA).
//   Each SIMD group takes KB keys at a time (lane l holds dims l, l+32, ...), keeps an
//   online softmax (max, sum, accumulator); the groups are merged through threadgroup
//   memory together with the sink: o = sum_j e^(l_j - M) k_j / (sum_j e^(l_j - M) + e^(sink - M)).
//   SPLIT > 1 (decode: 64 heads alone leave half the GPU idle): split `sp` takes the
//   candidate keys [sp * chunk, (sp + 1) * chunk), writes its partial (max, sum,
//   accumulator) to `part`, and the last split of (head, query) to finish (a device-wide
//   ticket) merges the SPLIT partials, in split order, as above.
//   RD > 0: the output's trailing RD channels get the inverse rope at the query position
//   (pair i turns by -t_abs / rope[i], times mscale: models/layers.RoPE with scale -1),
//   so the model launches no rope after the attention.
//   attend_rows (the header defines DS4_ATTEND_ROWS = R > 1, DS4_ATTEND_HEADS = NH and
//   DS4_ATTEND_SELECT): R sessions' decode queries in one launch, grid (NH*THREADS, R,
//   SPLIT); row r reads q_r [NH, 1, D], keys_r, rows_r, idx_r, cnt_r, meta_r (each as
//   above, C = 1) and writes o [R, NH, 1, D] at row r; part and tickets are indexed by
//   (r, head).  attend is the R = 1 case (DS4_ATTEND_SELECT empty).

// @@ common
// the query scored / selected for: the grid's y index, but 0 in index_topk_rows, whose grid
// y is the session row (its header defines DS4_QY first)
#ifndef DS4_QY
#define DS4_QY tgy
#endif
DS4_FN uint32_t ds4_order_key(float f) {
    const uint32_t u = ds4_float_bits(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// @@ index_score
DS4_SHARED float qs[HG * DI];
const int s0 = meta[0];
const int n_rows = meta[1];
const int n_q = meta[2];
const uint32_t t = tgy;
int limit = (s0 + int(t) + 1) / RATIO;
if (limit > n_rows) {
    limit = n_rows;
}
const uint32_t r = tgx * uint32_t(THREADS) + tid;
const bool live = int(r) < limit;
const bool any_live = int(tgx * uint32_t(THREADS)) < limit;
const float wscale = prm[0];
float score = 0.0f;
if (any_live) {
    for (int hg = 0; hg < NH; hg += HG) {
        ds4_tg_barrier();
        for (uint32_t e = tid; e < uint32_t(HG * DI); e += uint32_t(THREADS)) {
            const int h = hg + int(e / uint32_t(DI));
            const uint32_t c = e % uint32_t(DI);
            qs[e] = h < NH ? static_cast<float>(q[(uint64_t(h) * uint64_t(n_q) + t) * uint64_t(DI) + c]) : 0.0f;
        }
        ds4_tg_barrier();
        if (live) {
            float acc[HG];
            for (int h = 0; h < HG; ++h) {
                acc[h] = 0.0f;
            }
            const DS4_DEV TK* kr = keys + uint64_t(r) * uint64_t(DI);
            for (int c = 0; c < DI; ++c) {
                const float kv = static_cast<float>(kr[c]);
                for (int h = 0; h < HG; ++h) {
                    acc[h] += qs[h * DI + c] * kv;
                }
            }
            for (int h = 0; h < HG; ++h) {
                if (hg + h < NH) {
                    const float wh = static_cast<float>(w[uint64_t(t) * uint64_t(NH) + uint32_t(hg + h)]) * wscale;
                    score += wh * ds4_fmax(acc[h], 0.0f);
                }
            }
        }
    }
}
if (int(r) < n_rows) {
    scores[uint64_t(t) * uint64_t(n_rows) + r] = live ? score : DS4_NEG_INF;
}

// @@ index_score_heads
constexpr int WARPS = THREADS / 32;
constexpr int HPW = (NH + WARPS - 1) / WARPS;  // heads per SIMD group
constexpr int DPL = (DI + 31) / 32;  // channels per lane
DS4_SHARED float part[WARPS * ROWS];
const int s0 = meta[0];
const int n_rows = meta[1];
const int n_q = meta[2];
const uint32_t t = DS4_QY;
int limit = (s0 + int(t) + 1) / RATIO;
if (limit > n_rows) {
    limit = n_rows;
}
const int r0 = int(tgx) * ROWS;
const float wscale = prm[0];
if (r0 < limit) {
    float qv[HPW][DPL];
    float wv[HPW];
    for (int j = 0; j < HPW; ++j) {
        const int h = int(warp) + WARPS * j;
        wv[j] = h < NH ? static_cast<float>(w[uint64_t(t) * uint64_t(NH) + uint32_t(h)]) * wscale : 0.0f;
        for (int i = 0; i < DPL; ++i) {
            const int c = int(lane) + 32 * i;
            qv[j][i] = (h < NH && c < DI)
                ? static_cast<float>(q[(uint64_t(h) * uint64_t(n_q) + t) * uint64_t(DI) + uint32_t(c)])
                : 0.0f;
        }
    }
    for (int k = 0; k < ROWS; ++k) {
        const int r = r0 + k;
        float sc = 0.0f;
        if (r < limit) {  // the same for the whole threadgroup: every lane joins the sums
            const DS4_DEV TK* kr = keys + uint64_t(r) * uint64_t(DI);
            float kv[DPL];
            for (int i = 0; i < DPL; ++i) {
                const int c = int(lane) + 32 * i;
                kv[i] = c < DI ? static_cast<float>(kr[c]) : 0.0f;
            }
            for (int j = 0; j < HPW; ++j) {
                float dot = 0.0f;
                for (int i = 0; i < DPL; ++i) {
                    dot += qv[j][i] * kv[i];
                }
                sc += wv[j] * ds4_fmax(ds4_warp_sum(dot), 0.0f);
            }
        }
        if (lane == 0u) {
            part[warp * uint32_t(ROWS) + uint32_t(k)] = sc;
        }
    }
}
ds4_tg_barrier();
if (tid < uint32_t(ROWS)) {
    const int r = r0 + int(tid);
    if (r < n_rows) {
        float sc = 0.0f;
        for (int g = 0; g < WARPS; ++g) {
            sc += part[uint32_t(g) * uint32_t(ROWS) + tid];
        }
        scores[uint64_t(t) * uint64_t(n_rows) + uint32_t(r)] = r < limit ? sc : DS4_NEG_INF;
    }
}

// @@ topk
constexpr int WARPS = THREADS / 32;
DS4_SHARED_ATOMIC hist[256];
DS4_SHARED uint32_t chunk_sum[32];
DS4_SHARED uint32_t sel[2];
DS4_SHARED uint32_t sc_a[THREADS];
DS4_SHARED uint32_t sc_b[THREADS];
DS4_SHARED uint32_t tot_a[WARPS];
DS4_SHARED uint32_t tot_b[WARPS];
const int s0 = meta[0];
const int n_rows = meta[1];
const uint32_t t = DS4_QY;
int limit = (s0 + int(t) + 1) / RATIO;
if (limit > n_rows) {
    limit = n_rows;
}
DS4_DEV int* out = idx + uint64_t(t) * uint64_t(TOPK);
if (limit <= TOPK) {
    for (uint32_t i = tid; i < uint32_t(TOPK); i += uint32_t(THREADS)) {
        out[i] = int(i) < limit ? int(i) : 0;
    }
    if (tid == 0u) {
        cnt[t] = limit;
    }
    return;
}
const DS4_DEV float* row = scores + uint64_t(t) * uint64_t(n_rows);
const uint32_t n = uint32_t(limit);
uint32_t prefix = 0u;
uint32_t pmask = 0u;
uint32_t want = uint32_t(TOPK);
for (int pass = 0; pass < 4; ++pass) {
    const uint32_t shift = uint32_t(24 - 8 * pass);
    for (uint32_t b = tid; b < 256u; b += uint32_t(THREADS)) {
        ds4_atomic_store(&hist[b], 0u);
    }
    ds4_tg_barrier();
    if (tid == 0u) {  // (after the barrier: every thread has read the previous pass's sel)
        sel[0] = 0u;
        sel[1] = want;
    }
    for (uint32_t i = tid; i < n; i += uint32_t(THREADS)) {
        const uint32_t key = ds4_order_key(row[i]);
        if ((key & pmask) == prefix) {
            ds4_atomic_add(&hist[(key >> shift) & 255u], 1u);
        }
    }
    ds4_tg_barrier();
    if (warp == 0u) {
        // lane l owns bins 255-8l down to 248-8l; find the bin holding the want-th largest
        uint32_t sum = 0u;
        for (uint32_t q = 0; q < 8u; ++q) {
            sum += ds4_atomic_load(&hist[255u - 8u * lane - q]);
        }
        chunk_sum[lane] = sum;
        ds4_warp_barrier();
        uint32_t above = 0u;
        for (uint32_t q = 0; q < lane; ++q) {
            above += chunk_sum[q];
        }
        if (above < want && want <= above + sum) {
            uint32_t cum = above;
            for (uint32_t q = 0; q < 8u; ++q) {
                const uint32_t b = 255u - 8u * lane - q;
                const uint32_t h = ds4_atomic_load(&hist[b]);
                if (cum + h >= want) {
                    sel[0] = b;
                    sel[1] = want - cum;
                    break;
                }
                cum += h;
            }
        }
    }
    ds4_tg_barrier();
    prefix |= sel[0] << shift;
    pmask |= 255u << shift;
    want = sel[1];
}
// prefix is the TOPK-th largest key; take every larger key and the first `want` equal ones
const uint32_t seg = (n + uint32_t(THREADS) - 1u) / uint32_t(THREADS);
const uint32_t lo = tid * seg < n ? tid * seg : n;
const uint32_t hi = lo + seg < n ? lo + seg : n;
uint32_t n_gt = 0u;
uint32_t n_eq = 0u;
for (uint32_t i = lo; i < hi; ++i) {
    const uint32_t key = ds4_order_key(row[i]);
    n_gt += key > prefix ? 1u : 0u;
    n_eq += key == prefix ? 1u : 0u;
}
sc_a[tid] = n_gt;
sc_b[tid] = n_eq;
ds4_tg_barrier();
uint32_t gt_before = 0u;
uint32_t eq_before = 0u;
for (uint32_t q = 0; q < lane; ++q) {
    gt_before += sc_a[warp * 32u + q];
    eq_before += sc_b[warp * 32u + q];
}
if (lane == 31u) {
    tot_a[warp] = gt_before + n_gt;
    tot_b[warp] = eq_before + n_eq;
}
ds4_tg_barrier();
for (uint32_t q = 0; q < warp; ++q) {
    gt_before += tot_a[q];
    eq_before += tot_b[q];
}
uint32_t pos = gt_before + (eq_before < want ? eq_before : want);
for (uint32_t i = lo; i < hi; ++i) {
    const uint32_t key = ds4_order_key(row[i]);
    if (key > prefix) {
        out[pos++] = int(i);
    } else if (key == prefix) {
        if (eq_before < want) {
            out[pos++] = int(i);
        }
        eq_before += 1u;
    }
}
if (tid == 0u) {
    cnt[t] = TOPK;
}

// @@ index_topk_names
// (index_topk) index_score_heads's top-level names that topk declares again, renamed while
// the scores' section runs (topk then declares its own)
#define WARPS ds4it_WARPS
#define s0 ds4it_s0
#define n_rows ds4it_n_rows
#define t ds4it_t
#define limit ds4it_limit

// @@ index_topk_last
// (index_topk) this threadgroup's scores are written: count query tgy's threadgroups; the
// last one goes on to topk over the scores row the others left in global memory.
#undef WARPS
#undef s0
#undef n_rows
#undef t
#undef limit
static_assert(DS4_DEVICE_TICKETS, "no device-wide ticket on this face: launch index_score_heads, then topk");
DS4_SHARED uint32_t it_last[1];
ds4_device_fence();  // each thread: its score writes visible device-wide before the count below
ds4_tg_barrier();
if (tid == 0u) {
    const uint32_t groups = uint32_t((meta[1] + ROWS - 1) / ROWS);  // the grid's threadgroups per query
    const bool last = ds4_device_ticket(tickets + tgy) == groups - 1u;
    if (last) {
        ds4_ticket_reset(tickets + tgy);  // all of them have counted: zero for the next launch
    }
    it_last[0] = last ? 1u : 0u;
}
ds4_tg_barrier();
if (it_last[0] == 0u) {
    return;
}
ds4_device_fence();  // (each reading thread) the other threadgroups' scores before topk reads them

// @@ attend
constexpr int WARPS = THREADS / 32;
constexpr int DPL = (D + 31) / 32;
static_assert(SPLIT >= 1 && SPLIT <= WARPS, "the merging split reuses the SIMD groups' slots");
static_assert(SPLIT == 1 || DS4_DEVICE_TICKETS, "no device-wide ticket on this face: SPLIT must be 1");
DS4_SHARED float sm_m[WARPS];
DS4_SHARED float sm_l[WARPS];
DS4_SHARED float sm_acc[WARPS * D];
DS4_SHARED uint32_t sm_last[1];
// attend_rows (DS4_ATTEND_ROWS > 1): grid (NH*THREADS, ROWS, SPLIT), one decode query per
// session row, each row's q / keys / rows / idx / cnt / meta its own input; DS4_ATTEND_SELECT
// (sparse_attention.py writes it per launch) declares them for this row, and o as the row's
// part of a stacked output [ROWS, NH, 1, D]
const uint32_t row = DS4_ATTEND_ROWS > 1 ? tgy : 0u;
DS4_ATTEND_SELECT
const int s0 = meta[0];
const int ring_last = meta[1];
const int n_keys = meta[2];
const int n_rows = meta[3];
const int n_q = meta[4];
const uint32_t h = tgx;
const uint32_t t = DS4_ATTEND_ROWS > 1 ? 0u : tgy;
const int t_abs = s0 + int(t);
const float scale = prm[0];

float qv[DPL];
const DS4_DEV T* qp = q + (uint64_t(h) * uint64_t(n_q) + t) * uint64_t(D);
for (int i = 0; i < DPL; ++i) {
    const uint32_t c = lane + 32u * uint32_t(i);
    qv[i] = c < uint32_t(D) ? static_cast<float>(qp[c]) : 0.0f;
}
// candidate keys: W ring slots, the chunk rows c_lo .. c_hi-1, then n_comp compressed rows
const int n_ring = n_keys < W ? n_keys : W;
const int n_chunk = n_keys - n_ring;
const int c_lo = int(t) - W + 1 > 0 ? int(t) - W + 1 : 0;
const int c_hi = int(t) + 1 < n_chunk ? int(t) + 1 : n_chunk;
const int n_win = n_ring + (c_hi > c_lo ? c_hi - c_lo : 0);
int n_comp;
if (SELECTED) {
    n_comp = cnt[t];
} else {
    n_comp = (t_abs + 1) / RATIO;
    if (n_comp > n_rows) {
        n_comp = n_rows;
    }
}
const int n_virt = n_win + n_comp;
// this threadgroup's share of them: [v_lo, v_hi)
const int chunk = (n_virt + SPLIT - 1) / SPLIT;
const int v_lo = int(tgz) * chunk;
const int v_hi = v_lo + chunk < n_virt ? v_lo + chunk : n_virt;

float m_run = DS4_NEG_INF;
float l_run = 0.0f;
float acc[DPL];
for (int i = 0; i < DPL; ++i) {
    acc[i] = 0.0f;
}
for (int base = v_lo + int(warp) * KB; base < v_hi; base += WARPS * KB) {
    float kv[KB][DPL];
    float sc[KB];
    bool ok[KB];
    for (int u = 0; u < KB; ++u) {
        const int v = base + u;
        const DS4_DEV TK* kp = keys;
        ok[u] = false;
        if (v >= v_hi) {
        } else if (v < n_ring) {
            int mod = (ring_last - v) % W;
            if (mod < 0) {
                mod += W;
            }
            const int p = ring_last - mod;
            ok[u] = p >= 0 && p <= t_abs && p > t_abs - W;
            kp = keys + uint64_t(v) * uint64_t(D);
        } else if (v < n_win) {
            ok[u] = true;
            kp = keys + uint64_t(n_ring + c_lo + (v - n_ring)) * uint64_t(D);
        } else {
            const int j = v - n_win;
            const int rr = SELECTED ? idx[uint64_t(t) * uint64_t(TOPK) + uint32_t(j)] : j;
            ok[u] = true;
            kp = rows + uint64_t(rr) * uint64_t(D);
        }
        float part_dot = 0.0f;
        for (int i = 0; i < DPL; ++i) {
            const uint32_t c = lane + 32u * uint32_t(i);
            kv[u][i] = (ok[u] && c < uint32_t(D)) ? static_cast<float>(kp[c]) : 0.0f;
            part_dot += qv[i] * kv[u][i];
        }
        sc[u] = part_dot;
    }
    float m_new = m_run;
    for (int u = 0; u < KB; ++u) {
        sc[u] = ds4_warp_sum(sc[u]) * scale;
        if (!ok[u]) {
            sc[u] = DS4_NEG_INF;
        }
        m_new = ds4_fmax(m_new, sc[u]);
    }
    if (m_new > DS4_NEG_INF) {
        const float corr = ds4_exp(m_run - m_new);
        l_run *= corr;
        for (int i = 0; i < DPL; ++i) {
            acc[i] *= corr;
        }
        for (int u = 0; u < KB; ++u) {
            const float pu = ds4_exp(sc[u] - m_new);
            l_run += pu;
            for (int i = 0; i < DPL; ++i) {
                acc[i] += pu * kv[u][i];
            }
        }
        m_run = m_new;
    }
}
for (int i = 0; i < DPL; ++i) {
    const uint32_t c = lane + 32u * uint32_t(i);
    if (c < uint32_t(D)) {
        sm_acc[warp * uint32_t(D) + c] = acc[i];
    }
}
if (lane == 0u) {
    sm_m[warp] = m_run;
    sm_l[warp] = l_run;
}
ds4_tg_barrier();
int n_src = WARPS;  // partial softmaxes in sm_m / sm_l / sm_acc to merge with the sink
if (SPLIT > 1) {
    // this split's partial (max, sum, accumulator) to `part`; the last split to finish merges
    const uint64_t ht = (uint64_t(row) * uint64_t(DS4_ATTEND_HEADS) + uint64_t(h)) * uint64_t(n_q) + t;
    float m_tg = DS4_NEG_INF;
    for (int g = 0; g < WARPS; ++g) {
        m_tg = ds4_fmax(m_tg, sm_m[g]);
    }
    DS4_DEV float* pp = part + (ht * uint64_t(SPLIT) + tgz) * uint64_t(D + 2);
    for (uint32_t c = tid; c < uint32_t(D); c += uint32_t(THREADS)) {
        float a = 0.0f;
        for (int g = 0; g < WARPS; ++g) {
            if (sm_m[g] > DS4_NEG_INF) {
                a += ds4_exp(sm_m[g] - m_tg) * sm_acc[uint32_t(g) * uint32_t(D) + c];
            }
        }
        pp[2 + c] = a;
    }
    if (tid == 0u) {
        float l = 0.0f;
        for (int g = 0; g < WARPS; ++g) {
            if (sm_m[g] > DS4_NEG_INF) {
                l += ds4_exp(sm_m[g] - m_tg) * sm_l[g];
            }
        }
        pp[0] = m_tg;
        pp[1] = l;
    }
    ds4_device_fence();
    ds4_tg_barrier();
    if (tid == 0u) {
        const bool last = ds4_device_ticket(tickets + ht) == uint32_t(SPLIT - 1);
        if (last) {
            ds4_ticket_reset(tickets + ht);  // every split has counted: zero for the next launch
        }
        sm_last[0] = last ? 1u : 0u;
    }
    ds4_tg_barrier();
    if (sm_last[0] == 0u) {
        return;
    }
    ds4_device_fence();
    const DS4_DEV float* p0 = part + ht * uint64_t(SPLIT) * uint64_t(D + 2);
    for (uint32_t e = tid; e < uint32_t(SPLIT * D); e += uint32_t(THREADS)) {
        sm_acc[e] = ds4_load_cg(p0 + (e / uint32_t(D)) * uint32_t(D + 2) + 2u + e % uint32_t(D));
    }
    if (tid < uint32_t(SPLIT)) {
        sm_m[tid] = ds4_load_cg(p0 + tid * uint32_t(D + 2));
        sm_l[tid] = ds4_load_cg(p0 + tid * uint32_t(D + 2) + 1u);
    }
    ds4_tg_barrier();
    n_src = SPLIT;
}
const float sink = static_cast<float>(sinks[h]);
float m_all = sink;
for (int g = 0; g < n_src; ++g) {
    m_all = ds4_fmax(m_all, sm_m[g]);
}
float z = ds4_exp(sink - m_all);
for (int g = 0; g < n_src; ++g) {
    z += ds4_exp(sm_m[g] - m_all) * sm_l[g];
}
const float inv_z = 1.0f / z;
DS4_DEV T* op = o + (uint64_t(h) * uint64_t(n_q) + t) * uint64_t(D);
constexpr int NOPE = D - RD;  // channels before the rotated ones
for (uint32_t c = tid; c < uint32_t(NOPE); c += uint32_t(THREADS)) {
    float a = 0.0f;
    for (int g = 0; g < n_src; ++g) {
        a += ds4_exp(sm_m[g] - m_all) * sm_acc[uint32_t(g) * uint32_t(D) + c];
    }
    op[c] = static_cast<T>(a * inv_z);
}
const float ang = -float(t_abs);  // the inverse rotation at the query's position
const float mscale = prm[1];
for (uint32_t i = tid; i < uint32_t(RD / 2); i += uint32_t(THREADS)) {
    const uint32_t c = uint32_t(NOPE) + 2u * i;
    float a0 = 0.0f;
    float a1 = 0.0f;
    for (int g = 0; g < n_src; ++g) {
        const float f = ds4_exp(sm_m[g] - m_all);
        a0 += f * sm_acc[uint32_t(g) * uint32_t(D) + c];
        a1 += f * sm_acc[uint32_t(g) * uint32_t(D) + c + 1u];
    }
    a0 *= inv_z;
    a1 *= inv_z;
    const float th = ang * (1.0f / rope[i]);
    const float cs = ds4_cos(th);
    const float sn = ds4_sin(th);
    op[c] = static_cast<T>((a0 * cs - a1 * sn) * mscale);
    op[c + 1u] = static_cast<T>((a0 * sn + a1 * cs) * mscale);
}
