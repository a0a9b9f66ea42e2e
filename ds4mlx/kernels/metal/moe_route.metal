// ds4mlx MoE router kernels (DeepSeek V4 decode): score function, top-k or hash lookup,
// and the renormalised, scaled weights of one token in one threadgroup, one launch for
// all tokens.
//
// This file is a set of `// @@ name` sections assembled by ds4mlx/kernels/moe_route.py
// into mx.fast.metal_kernel and mx.fast.cuda_kernel sources: the same text for both
// faces, after the face's prelude and index block (ds4mlx/kernels/dispatch.py PRELUDE /
// INDEX).  A kernel body is `route` + `core` or `fold` + `core`.
//
// route  grid (THREADS, n, 1); one threadgroup per token t:
//   logits [n, E] TL, bias [E] TB (BIAS), table [V, K] int32 + ids [n] int32 (HASH),
//   prm [1] f32 = routed scaling factor  ->  idx [n, K] int32, wts [n, K] f32
// fold   grid (NB*THREADS, n, 1); the router mat-vec in the same launch:
//   x [n, H] f32 or bf16 (XB bytes each: bf16 x rounds each logit to bf16, as x @ w.T in
//   bf16 does), w [E, H] TW (f32 or bf16, WB bytes each; WB == 2 with XB == 2) and the inputs of `route`
//   and tickets [>= n] u32 (zero at launch, zero again after it: the threadgroup that
//   counts NB resets token t's)  -> idx, wts, scratch [n, E] f32.
//   Threadgroup (b, t) computes logits b*RPT .. b*RPT+RPT-1 of token t (WARPS/RPT warps
//   per row along H, 8 values per lane step, float32 sums), stores them in scratch[t],
//   and counts itself done in tickets[t] (a device atomic after a device
//   fence); the threadgroup that counts NB routes token t from scratch (the CUDA
//   "last block" pattern: no threadgroup ever waits for another).
// core   the routing of token t by one threadgroup (reads ROUTE_LOGIT(e)):
//   score s_e = sqrt(softplus(l_e)) (SCORE 0), sigmoid(l_e) (1) or softmax(l)_e (2), as
//   MLX computes them (softplus = logaddexp(l, 0)); selection value c_e = s_e + bias[e]
//   (BIAS) or s_e.  Top-k: expert e's rank is the number of experts j with
//   (c_j, -j) > (c_e, -e) (order-preserving uint32 keys: a total order, so the K slots
//   are always filled with K distinct experts); slot r holds the expert of rank r, i.e.
//   descending c, ties to the lowest index.  HASH: slot j holds table[ids[t], j] (the
//   scores of ids outside [0, E) read as 0).  wts = s / (sum of the K s + 1e-20) (NORM)
//   or s, times prm[0]; the sum runs over the slots in order.
//
//   Group-limited top-k (GLM 5.x, DeepSeek V3: GROUPS > 1, TOPG < GROUPS): group g's value
//   is the sum of its two largest c; only the TOPG groups of largest value (ties to the
//   lowest group) stay eligible, the others' experts rank as c = -inf.
//
// Template constants: E experts (<= THREADS * 2), K slots (<= E), SCORE, BIAS, HASH, NORM,
// GROUPS (dividing E, <= THREADS; 1: none), TOPG, THREADS (a power of two >= 32 and >= K);
// fold also H (a multiple of 8), RPT rows per threadgroup (dividing THREADS / 32),
// NB = ceil(E / RPT), WB (2: bf16, 4: f32).

// @@ common
// Face-specific pieces.  The fold's fence and device counter are macros: they are only
// compiled where the fold uses them (Metal's needs MSL 3.2; `route` must not depend on it).
#if defined(__METAL_VERSION__)
#define DS4R_VOLATILE
#define ds4r_fence() atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device)
#define ds4r_count(p) atomic_fetch_add_explicit((device atomic_uint*)(p), 1u, memory_order_relaxed)
#define ds4r_reset(p) atomic_store_explicit((device atomic_uint*)(p), 0u, memory_order_relaxed)
DS4_FN float ds4r_sqrt(float x) { return metal::precise::sqrt(x); }
DS4_FN float ds4r_log1p(float x) {  // as MLX's Metal log1p
    const float xp1 = 1.0f + x;
    if (xp1 == 1.0f) {
        return x;
    }
    return x * (metal::precise::log(xp1) / (xp1 - 1.0f));
}
#elif defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define DS4R_VOLATILE volatile
#define ds4r_fence() __threadfence()
#define ds4r_count(p) atomicAdd((unsigned int*)(p), 1u)  // (an input: MLX declares it const)
#define ds4r_reset(p) atomicExch((unsigned int*)(p), 0u)
DS4_FN float ds4r_sqrt(float x) { return sqrtf(x); }
DS4_FN float ds4r_log1p(float x) { return log1pf(x); }
#else  // the g++ emulation of the tests
#define DS4R_VOLATILE volatile
#define ds4r_fence() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#define ds4r_count(p) __atomic_fetch_add((uint32_t*)(p), 1u, __ATOMIC_SEQ_CST)
#define ds4r_reset(p) __atomic_store_n((uint32_t*)(p), 0u, __ATOMIC_SEQ_CST)
DS4_FN float ds4r_sqrt(float x) { return sqrtf(x); }
DS4_FN float ds4r_log1p(float x) { return log1pf(x); }
#endif

// sigmoid (kind 1) or sqrt(softplus) (kind 0) of one logit
DS4_FN float ds4r_score(float l, int kind) {
    const float a = l < 0.0f ? -l : l;
    if (kind == 1) {
        const float y = 1.0f / (1.0f + ds4_exp(-a));
        return l < 0.0f ? 1.0f - y : y;
    }
    const float hi = l > 0.0f ? l : 0.0f;
    const float lo = l > 0.0f ? 0.0f : l;
    const float sp = (lo == DS4_NEG_INF || hi == -DS4_NEG_INF) ? hi : hi + ds4r_log1p(ds4_exp(lo - hi));
    return ds4r_sqrt(sp);
}

// order-preserving key of a float (larger float, larger key; NaN above +inf)
DS4_FN uint32_t ds4r_key(float f) {
    const uint32_t u = ds4_float_bits(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// float of a bf16 in the low / high half of a 32-bit word
DS4_FN float ds4r_bf_lo(uint32_t u) { return ds4_as_float(u << 16); }
DS4_FN float ds4r_bf_hi(uint32_t u) { return ds4_as_float(u & 0xffff0000u); }
// v rounded to bfloat16 (nearest, ties to even), as a float: a bf16 matmul's output
DS4_FN float ds4r_round_bf(float v) {
    const uint32_t u = ds4_float_bits(v);
    return ds4_as_float((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}

// @@ route
const uint32_t t = tgy;
const DS4_DEV TL* lrow = logits + uint64_t(t) * uint64_t(E);
#define ROUTE_LOGIT(e) static_cast<float>(lrow[e])

// @@ fold
constexpr int FWARPS = THREADS / 32;
constexpr int KS = FWARPS / RPT;  // warps per logit, along H
constexpr int CHUNKS = H / 8;  // 8 values per lane step
DS4_SHARED float f_part[FWARPS];
DS4_SHARED uint32_t f_last[1];
const uint32_t t = tgy;
const uint32_t f_row = tgx * uint32_t(RPT) + warp / uint32_t(KS);
float f_acc = 0.0f;
if (f_row < uint32_t(E)) {
    const DS4_DEV float4* xr = (const DS4_DEV float4*)(x) + uint64_t(t) * uint64_t(H / 4);
    const DS4_DEV uint4* xh = (const DS4_DEV uint4*)(x) + uint64_t(t) * uint64_t(H / 8);  // XB == 2
    const DS4_DEV uint4* wr = (const DS4_DEV uint4*)(w) + uint64_t(f_row) * uint64_t(H * WB / 16);
    for (uint32_t c = (warp % uint32_t(KS)) * 32u + lane; c < uint32_t(CHUNKS); c += uint32_t(KS * 32)) {
        if (XB == 2) {  // (then WB == 2)
            const uint4 v = xh[c];
            const uint4 u = wr[c];
            f_acc += ds4r_bf_lo(v.x) * ds4r_bf_lo(u.x) + ds4r_bf_hi(v.x) * ds4r_bf_hi(u.x) +
                     ds4r_bf_lo(v.y) * ds4r_bf_lo(u.y) + ds4r_bf_hi(v.y) * ds4r_bf_hi(u.y);
            f_acc += ds4r_bf_lo(v.z) * ds4r_bf_lo(u.z) + ds4r_bf_hi(v.z) * ds4r_bf_hi(u.z) +
                     ds4r_bf_lo(v.w) * ds4r_bf_lo(u.w) + ds4r_bf_hi(v.w) * ds4r_bf_hi(u.w);
            continue;
        }
        const float4 xa = xr[2u * c];
        const float4 xb = xr[2u * c + 1u];
        if (WB == 2) {
            const uint4 u = wr[c];
            f_acc += xa.x * ds4r_bf_lo(u.x) + xa.y * ds4r_bf_hi(u.x) + xa.z * ds4r_bf_lo(u.y) + xa.w * ds4r_bf_hi(u.y);
            f_acc += xb.x * ds4r_bf_lo(u.z) + xb.y * ds4r_bf_hi(u.z) + xb.z * ds4r_bf_lo(u.w) + xb.w * ds4r_bf_hi(u.w);
        } else {
            const uint4 u0 = wr[2u * c];
            const uint4 u1 = wr[2u * c + 1u];
            f_acc += xa.x * ds4_as_float(u0.x) + xa.y * ds4_as_float(u0.y) + xa.z * ds4_as_float(u0.z) +
                     xa.w * ds4_as_float(u0.w);
            f_acc += xb.x * ds4_as_float(u1.x) + xb.y * ds4_as_float(u1.y) + xb.z * ds4_as_float(u1.z) +
                     xb.w * ds4_as_float(u1.w);
        }
    }
}
f_acc = ds4_warp_sum(f_acc);
if (lane == 0u) {
    f_part[warp] = f_acc;
}
ds4_tg_barrier();
DS4_DEV float* srow = scratch + uint64_t(t) * uint64_t(E);
if (tid < uint32_t(RPT)) {
    const uint32_t r = tgx * uint32_t(RPT) + tid;
    if (r < uint32_t(E)) {
        float s = 0.0f;
        for (int q = 0; q < KS; ++q) {
            s += f_part[tid * uint32_t(KS) + uint32_t(q)];
        }
        srow[r] = XB == 2 ? ds4r_round_bf(s) : s;  // bf16 x: the logits of a bf16 matmul
    }
    ds4r_fence();  // each writer: its logit is visible before the count below
}
ds4_tg_barrier();
if (tid == 0u) {
    const bool last = ds4r_count(tickets + t) == uint32_t(NB - 1);
    if (last) {
        ds4r_reset(tickets + t);  // all NB groups have counted: zero for the next launch
    }
    f_last[0] = last ? 1u : 0u;
}
ds4_tg_barrier();
if (f_last[0] == 0u) {
    return;
}
ds4r_fence();
#define ROUTE_LOGIT(e) (((DS4R_VOLATILE DS4_DEV float*)srow)[e])

// @@ core
constexpr bool GROUPED = GROUPS > 1 && TOPG < GROUPS && !HASH;
DS4_SHARED float r_sc[GROUPED ? 2 * E : E];  // the scores, then (GROUPED) the selection values
DS4_SHARED uint32_t r_key[E];
DS4_SHARED float r_red[THREADS];
DS4_SHARED int r_keep[GROUPS];
DS4_SHARED int r_idx[K];
DS4_SHARED float r_sel[K];
float r_max = 0.0f;
float r_sum = 1.0f;
if (SCORE == 2) {  // softmax: the row's max and sum first
    float m = DS4_NEG_INF;
    for (uint32_t e = tid; e < uint32_t(E); e += uint32_t(THREADS)) {
        m = ds4_fmax(m, ROUTE_LOGIT(e));
    }
    r_red[tid] = m;
    ds4_tg_barrier();
    for (uint32_t h = uint32_t(THREADS) / 2u; h > 0u; h >>= 1) {
        if (tid < h) {
            r_red[tid] = ds4_fmax(r_red[tid], r_red[tid + h]);
        }
        ds4_tg_barrier();
    }
    r_max = r_red[0];
    ds4_tg_barrier();
    float z = 0.0f;
    for (uint32_t e = tid; e < uint32_t(E); e += uint32_t(THREADS)) {
        z += ds4_exp(ROUTE_LOGIT(e) - r_max);
    }
    r_red[tid] = z;
    ds4_tg_barrier();
    for (uint32_t h = uint32_t(THREADS) / 2u; h > 0u; h >>= 1) {
        if (tid < h) {
            r_red[tid] += r_red[tid + h];
        }
        ds4_tg_barrier();
    }
    r_sum = r_red[0];
}
for (uint32_t e = tid; e < uint32_t(E); e += uint32_t(THREADS)) {
    const float l = ROUTE_LOGIT(e);
    const float s = SCORE == 2 ? ds4_exp(l - r_max) / r_sum : ds4r_score(l, SCORE);
    r_sc[e] = s;
    if (!HASH) {
        const float c = BIAS ? s + static_cast<float>(bias[e]) : s;
        r_key[e] = ds4r_key(c);
        if (GROUPED) {
            r_sc[E + e] = c;
        }
    }
}
ds4_tg_barrier();
if (GROUPED) {  // group-limited: only the TOPG groups with the largest sum of their top two stay eligible
    constexpr int GS = E / GROUPS;
    if (tid < uint32_t(GROUPS)) {
        float m1 = DS4_NEG_INF;
        float m2 = DS4_NEG_INF;
        for (int j = 0; j < GS; ++j) {
            const float c = r_sc[E + int(tid) * GS + j];
            if (c > m1) {
                m2 = m1;
                m1 = c;
            } else if (c > m2) {
                m2 = c;
            }
        }
        r_red[tid] = m2 + m1;
    }
    ds4_tg_barrier();
    if (tid < uint32_t(GROUPS)) {
        const uint32_t key = ds4r_key(r_red[tid]);
        int rank = 0;
        for (uint32_t g = 0; g < uint32_t(GROUPS); ++g) {
            const uint32_t kg = ds4r_key(r_red[g]);
            rank += (kg > key || (kg == key && g < tid)) ? 1 : 0;
        }
        r_keep[tid] = rank < TOPG ? 1 : 0;
    }
    ds4_tg_barrier();
    for (uint32_t e = tid; e < uint32_t(E); e += uint32_t(THREADS)) {
        if (r_keep[e / uint32_t(GS)] == 0) {
            r_key[e] = ds4r_key(DS4_NEG_INF);
        }
    }
    ds4_tg_barrier();
}
if (HASH) {
    if (tid < uint32_t(K)) {
        const int ex = table[uint64_t(ids[t]) * uint64_t(K) + tid];
        r_idx[tid] = ex;
        r_sel[tid] = (ex >= 0 && ex < E) ? r_sc[ex] : 0.0f;
    }
} else {
    for (uint32_t e = tid; e < uint32_t(E); e += uint32_t(THREADS)) {
        const uint32_t key = r_key[e];
        int rank = 0;
        for (uint32_t j = 0; j < uint32_t(E) && rank < K; ++j) {
            const uint32_t kj = r_key[j];
            rank += (kj > key || (kj == key && j < e)) ? 1 : 0;
        }
        if (rank < K) {
            r_idx[rank] = int(e);
            r_sel[rank] = r_sc[e];
        }
    }
}
ds4_tg_barrier();
if (tid < uint32_t(K)) {
    float tot = 0.0f;
    for (int j = 0; j < K; ++j) {
        tot += r_sel[j];
    }
    const float v = NORM ? r_sel[tid] / (tot + 1e-20f) : r_sel[tid];
    idx[uint64_t(t) * uint64_t(K) + tid] = r_idx[tid];
    wts[uint64_t(t) * uint64_t(K) + tid] = v * prm[0];
}
