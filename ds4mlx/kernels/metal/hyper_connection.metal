// ds4mlx fused hyper-connection (mHC) kernels: hc_pre (and hc_head) in one
// threadgroup per token, hc_post elementwise.
//
// This file is a set of `// @@ name` sections assembled by
// ds4mlx/kernels/hyper_connection.py into mx.fast.metal_kernel and
// mx.fast.cuda_kernel sources: the same `common`, `hc_pre` and `hc_post` text for
// both faces, after the face's prelude and index block (ds4mlx/kernels/dispatch.py
// PRELUDE / INDEX, which define DS4_*, ds4_* and tid / lane / warp / tgx / tgy / tgz).
//
// hc_pre (one threadgroup of THREADS threads per token, grid (NT*THREADS, 1, 1)):
//   x [NT, HC, D] T, fn [M, HC*D] TW, base [M] TB, scale [3] (hc_head: [1]) TS,
//   eps [3] float32 = (hc_eps, norm_eps, rms_eps), nw [D] T (NORM) or a dummy
//   -> pre [NT, HC] f32, post [NT, HC] f32, comb [NT, HC, HC] f32, y [NT, D] T
//   (hc_head: HEAD = true, M = HC, pre / post / comb are 1-element dummies, not written;
//   hc_mix: COLLAPSE = false, y is a 1-element dummy, not written)
//   1. every thread accumulates, over k = tid, tid+THREADS, ... < HC*D, the
//      sum of squares of flat x and the M dot products fn[r] . x (float32);
//      warp sums, then a threadgroup sum over the warps;
//   2. mix[r] = dot[r] * rsqrt(sumsq / (HC*D) + norm_eps) (the RMS norm applied
//      after the projection: the same value as projecting the normed vector);
//   3. pre = sigmoid(mix * scale0 + base) + hc_eps, post = 2 sigmoid(...);
//      warp 0 runs the Sinkhorn projection of the HC x HC comb logits, lane
//      i*HC+j holding entry (i, j), rows / columns summed through threadgroup
//      memory between SIMD-group barriers;
//   4. (COLLAPSE) y[c] = sum_i pre_i * x[i, c] (float32, rounded once to T);
//   5. (NORM) y = RMSNorm(y) with weight nw and rms_eps, rounded as MLX's rms_norm
//      rounds (T(y * rsqrt(mean(y^2) + eps)) times T(nw), in T): the layer norm that
//      follows the collapse, saving its launch.
//
//   With PARTS > 0 (decode: few tokens), step 1 ran in hc_dots instead and hc_pre
//   adds its PARTS partial sums: one threadgroup alone reading the whole
//   [M, HC*D] projection was most of a decode call's time.
//
// hc_dots (grid (PARTS*THREADS, NT, 1)): threadgroup q of token t takes the flat
//   indices k = (q*PER + e)*THREADS + tid, e < PER, and writes its M dot products
//   and its sum of squares to part [NT, PARTS, M+1] float32.
//
// hc_post (grid (ceil(D/THREADS)*THREADS, HC, NT)): one thread per output
//   y[t, k, c] = T(T(post[t,k]) * o[t,c]) + T(sum_j T(comb[t,j,k]) * x[t,j,c])
//   (ADD2, also in hc_post_dots: o[t,c] is T(o[t,c] + o2[t,c]), the sum of two outputs)
//   with the roundings of the reference graph (post and comb cast to T first,
//   the two terms rounded to T, then the sum).

// @@ common
DS4_FN float ds4_sigmoid(float v) {
    return 1.0f / (1.0f + ds4_exp(-v));
}

// @@ hc_pre
constexpr int K = HC * D;
constexpr int M = HEAD ? HC : (2 + HC) * HC;
constexpr int WARPS = THREADS / 32;
DS4_SHARED float red[WARPS * (M + 1)];
DS4_SHARED float mix[M + 1];
DS4_SHARED float cm[32];
DS4_SHARED float pre_sh[HC];

const uint32_t t = tgx;
const DS4_DEV T* xt = x + uint64_t(t) * uint64_t(K);
const float hc_eps = eps[0];
const float norm_eps = eps[1];

if (PARTS == 0) {
    float acc[M];
    for (int r = 0; r < M; ++r) {
        acc[r] = 0.0f;
    }
    float ss = 0.0f;
    for (uint32_t k = tid; k < uint32_t(K); k += uint32_t(THREADS)) {
        const float xv = static_cast<float>(xt[k]);
        ss += xv * xv;
        for (int r = 0; r < M; ++r) {
            acc[r] += static_cast<float>(fn[uint64_t(r) * uint64_t(K) + k]) * xv;
        }
    }
    for (int r = 0; r < M; ++r) {
        const float v = ds4_warp_sum(acc[r]);
        if (lane == 0u) {
            red[warp * uint32_t(M + 1) + uint32_t(r)] = v;
        }
    }
    ss = ds4_warp_sum(ss);
    if (lane == 0u) {
        red[warp * uint32_t(M + 1) + uint32_t(M)] = ss;
    }
}
ds4_tg_barrier();
if (tid < uint32_t(M + 1)) {
    float v = 0.0f;
    if (PARTS == 0) {
        for (int w = 0; w < WARPS; ++w) {
            v += red[uint32_t(w) * uint32_t(M + 1) + tid];
        }
    } else {
        // the projection was split across PARTS threadgroups (hc_dots): add their sums
        for (int q = 0; q < PARTS; ++q) {
            v += part[(uint64_t(t) * uint64_t(PARTS) + uint64_t(q)) * uint64_t(M + 1) + tid];
        }
    }
    mix[tid] = v;
}
ds4_tg_barrier();
const float rs = ds4_rsqrt(mix[M] / float(K) + norm_eps);

if (tid < uint32_t(HC)) {
    const float m0 = mix[tid] * rs;
    pre_sh[tid] = ds4_sigmoid(m0 * static_cast<float>(scale[0]) + static_cast<float>(base[tid])) + hc_eps;
    if (!HEAD) {
        pre[uint64_t(t) * uint64_t(HC) + tid] = pre_sh[tid];
        const float m1 = mix[HC + tid] * rs;
        post[uint64_t(t) * uint64_t(HC) + tid] =
            2.0f * ds4_sigmoid(m1 * static_cast<float>(scale[1]) + static_cast<float>(base[HC + tid]));
    }
}
if (!HEAD && warp == 0u) {
    // Sinkhorn on warp 0: lane l < HC*HC holds entry (i, j) = (l / HC, l % HC).
    const bool act = lane < uint32_t(HC * HC);
    const uint32_t i = act ? lane / uint32_t(HC) : 0u;
    const uint32_t j = act ? lane % uint32_t(HC) : 0u;
    const uint32_t src = uint32_t(2 * HC) + (act ? lane : 0u);
    float v = 0.0f;
    if (act) {
        v = (mix[src] * rs) * static_cast<float>(scale[2]) + static_cast<float>(base[src]);
        cm[lane] = v;
    }
    ds4_warp_barrier();
    // softmax over the row (precise: subtract the row max), then + eps
    float rmax = DS4_NEG_INF;
    for (int q = 0; q < HC; ++q) {
        rmax = ds4_fmax(rmax, cm[i * uint32_t(HC) + uint32_t(q)]);
    }
    const float e = ds4_exp(v - rmax);
    ds4_warp_barrier();
    if (act) {
        cm[lane] = e;
    }
    ds4_warp_barrier();
    float sum = 0.0f;
    for (int q = 0; q < HC; ++q) {
        sum += cm[i * uint32_t(HC) + uint32_t(q)];
    }
    v = e / sum + hc_eps;
    // column normalisation, then ITERS-1 times (rows, columns)
    for (int it = 0; it < 2 * ITERS - 1; ++it) {
        const bool cols = (it & 1) == 0;
        ds4_warp_barrier();
        if (act) {
            cm[lane] = v;
        }
        ds4_warp_barrier();
        float s = 0.0f;
        for (int q = 0; q < HC; ++q) {
            s += cols ? cm[uint32_t(q) * uint32_t(HC) + j] : cm[i * uint32_t(HC) + uint32_t(q)];
        }
        v = v / (s + hc_eps);
    }
    if (act) {
        comb[uint64_t(t) * uint64_t(HC * HC) + lane] = v;
    }
}
ds4_tg_barrier();
float yss = 0.0f;
for (uint32_t c = tid; COLLAPSE && c < uint32_t(D); c += uint32_t(THREADS)) {
    float a = 0.0f;
    for (int q = 0; q < HC; ++q) {
        a += pre_sh[q] * static_cast<float>(xt[uint32_t(q) * uint32_t(D) + c]);
    }
    const T yt = static_cast<T>(a);
    y[uint64_t(t) * uint64_t(D) + c] = yt;
    yss += static_cast<float>(yt) * static_cast<float>(yt);
}
if (NORM && COLLAPSE) {
    // each thread re-reads only the entries it wrote above: no barrier needed for them
    yss = ds4_warp_sum(yss);
    if (lane == 0u) {
        red[warp] = yss;
    }
    ds4_tg_barrier();
    float tot = 0.0f;
    for (int w = 0; w < WARPS; ++w) {
        tot += red[w];
    }
    const float r = ds4_rsqrt(tot / float(D) + eps[2]);
    for (uint32_t c = tid; c < uint32_t(D); c += uint32_t(THREADS)) {
        const uint64_t o = uint64_t(t) * uint64_t(D) + c;
        const T yn = static_cast<T>(static_cast<float>(y[o]) * r);
        y[o] = static_cast<T>(static_cast<float>(nw[c]) * static_cast<float>(yn));
    }
}

// @@ hc_dots
constexpr int K = HC * D;
constexpr int M = HEAD ? HC : (2 + HC) * HC;
constexpr int WARPS = THREADS / 32;
DS4_SHARED float red[WARPS * (M + 1)];

const uint32_t t = tgy;
const uint32_t q = tgx;
const DS4_DEV T* xt = x + uint64_t(t) * uint64_t(K);
float acc[M];
for (int r = 0; r < M; ++r) {
    acc[r] = 0.0f;
}
float ss = 0.0f;
for (int e = 0; e < PER; ++e) {
    const uint32_t k = (q * uint32_t(PER) + uint32_t(e)) * uint32_t(THREADS) + tid;
    if (k < uint32_t(K)) {
        const float xv = static_cast<float>(xt[k]);
        ss += xv * xv;
        for (int r = 0; r < M; ++r) {
            acc[r] += static_cast<float>(fn[uint64_t(r) * uint64_t(K) + k]) * xv;
        }
    }
}
for (int r = 0; r < M; ++r) {
    const float v = ds4_warp_sum(acc[r]);
    if (lane == 0u) {
        red[warp * uint32_t(M + 1) + uint32_t(r)] = v;
    }
}
ss = ds4_warp_sum(ss);
if (lane == 0u) {
    red[warp * uint32_t(M + 1) + uint32_t(M)] = ss;
}
ds4_tg_barrier();
if (tid < uint32_t(M + 1)) {
    float v = 0.0f;
    for (int w = 0; w < WARPS; ++w) {
        v += red[uint32_t(w) * uint32_t(M + 1) + tid];
    }
    part[(uint64_t(t) * uint64_t(PARTS) + uint64_t(q)) * uint64_t(M + 1) + tid] = v;
}

// @@ hc_post_dots
// (ADD2: the site's output is o + o2 rounded to T, as the graph adds the two halves of
// an MoE (routed + shared) before hc_post: one launch less)
#define ds4_out(o, o2, i) (ADD2 ? static_cast<float>(static_cast<T>(static_cast<float>((o)[i]) + static_cast<float>((o2)[i]))) : static_cast<float>((o)[i]))
// hc_post, then hc_dots on its result, in one launch (grid (PARTS*THREADS, NT, 1)):
// each thread forms its flat elements k = i*D + c of the new streams exactly as
// hc_post does (same roundings), writes them to y and feeds the rounded value to
// the next hc_pre's dot products and sum of squares (part, as hc_dots).
constexpr int K = HC * D;
constexpr int M = (2 + HC) * HC;
constexpr int WARPS = THREADS / 32;
DS4_SHARED float red[WARPS * (M + 1)];

const uint32_t t = tgy;
const uint32_t q = tgx;
const DS4_DEV T* xt = x + uint64_t(t) * uint64_t(K);
float acc[M];
for (int r = 0; r < M; ++r) {
    acc[r] = 0.0f;
}
float ss = 0.0f;
for (int e = 0; e < PER; ++e) {
    const uint32_t k = (q * uint32_t(PER) + uint32_t(e)) * uint32_t(THREADS) + tid;
    if (k < uint32_t(K)) {
        const uint32_t i = k / uint32_t(D);
        const uint32_t c = k % uint32_t(D);
        float m = 0.0f;
        for (int j = 0; j < HC; ++j) {
            const float cj = static_cast<float>(static_cast<T>(comb[(uint64_t(t) * uint64_t(HC) + uint32_t(j)) * uint64_t(HC) + i]));
            m += cj * static_cast<float>(xt[uint32_t(j) * uint32_t(D) + c]);
        }
        const float pk = static_cast<float>(static_cast<T>(post[uint64_t(t) * uint64_t(HC) + i]));
        const float p = static_cast<float>(static_cast<T>(pk * ds4_out(o, o2, uint64_t(t) * uint64_t(D) + c)));
        const T yv = static_cast<T>(p + static_cast<float>(static_cast<T>(m)));
        y[uint64_t(t) * uint64_t(K) + k] = yv;
        const float xv = static_cast<float>(yv);
        ss += xv * xv;
        for (int r = 0; r < M; ++r) {
            acc[r] += static_cast<float>(fn[uint64_t(r) * uint64_t(K) + k]) * xv;
        }
    }
}
for (int r = 0; r < M; ++r) {
    const float v = ds4_warp_sum(acc[r]);
    if (lane == 0u) {
        red[warp * uint32_t(M + 1) + uint32_t(r)] = v;
    }
}
ss = ds4_warp_sum(ss);
if (lane == 0u) {
    red[warp * uint32_t(M + 1) + uint32_t(M)] = ss;
}
ds4_tg_barrier();
if (tid < uint32_t(M + 1)) {
    float v = 0.0f;
    for (int w = 0; w < WARPS; ++w) {
        v += red[uint32_t(w) * uint32_t(M + 1) + tid];
    }
    part[(uint64_t(t) * uint64_t(PARTS) + uint64_t(q)) * uint64_t(M + 1) + tid] = v;
}

// @@ hc_post
#define ds4_out(o, o2, i) (ADD2 ? static_cast<float>(static_cast<T>(static_cast<float>((o)[i]) + static_cast<float>((o2)[i]))) : static_cast<float>((o)[i]))
const uint32_t c = tgx * uint32_t(THREADS) + tid;
const uint32_t k = tgy;
const uint32_t t = tgz;
if (c < uint32_t(D)) {
    const DS4_DEV T* xt = x + uint64_t(t) * uint64_t(HC * D);
    float m = 0.0f;
    for (int j = 0; j < HC; ++j) {
        const float cj = static_cast<float>(static_cast<T>(comb[(uint64_t(t) * uint64_t(HC) + uint32_t(j)) * uint64_t(HC) + k]));
        m += cj * static_cast<float>(xt[uint32_t(j) * uint32_t(D) + c]);
    }
    const float pk = static_cast<float>(static_cast<T>(post[uint64_t(t) * uint64_t(HC) + k]));
    const float p = static_cast<float>(static_cast<T>(pk * ds4_out(o, o2, uint64_t(t) * uint64_t(D) + c)));
    const float mt = static_cast<float>(static_cast<T>(m));
    y[(uint64_t(t) * uint64_t(HC) + k) * uint64_t(D) + c] = static_cast<T>(p + mt);
}
