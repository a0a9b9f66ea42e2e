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
// hc_dots_pre, hc_post_dots_pre (decode, one launch each): hc_dots / hc_post_dots, then
//   `hc_last`: each threadgroup counts itself done in tickets[t] (a device atomic after a
//   device fence; tickets [>= NT] u32 is zero at launch and zero again after it) and the
//   one that counts PARTS runs token t's hc_pre work (`pre_core`) on the parts (and, after
//   hc_post_dots, the new streams y) that the others left in device memory, read past the
//   L1 cache: no threadgroup ever waits for another, one launch less per mHC site.
//   hc_pre is `hc_pre` + `pre_core`; the tails run pre_core on THREADS (256) threads with
//   VT = hc_pre's thread count (512): the folded norm's sum of squares then adds its terms
//   in hc_pre's order (VT / THREADS virtual threads per thread), and every output is
//   bit-identical to the two-launch path (same part sums, same order).
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
// The tails' hand-off: macros, so that they are compiled only where a tail uses them
// (Metal's device-scope fence needs MSL 3.2; the other kernels must not depend on it).
// Tickets are an input (MLX declares inputs const): counted through a cast.
#if defined(__METAL_VERSION__)
#define ds4h_fence() atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device)
#define ds4h_count(p) atomic_fetch_add_explicit((device atomic_uint*)(p), 1u, memory_order_relaxed)
#define ds4h_reset(p) atomic_store_explicit((device atomic_uint*)(p), 0u, memory_order_relaxed)
#define ds4h_load(p) (*(p))
#elif defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define ds4h_fence() __threadfence()
#define ds4h_count(p) atomicAdd((unsigned int*)(p), 1u)
#define ds4h_reset(p) atomicExch((unsigned int*)(p), 0u)
#define ds4h_load(p) __ldcg(p)  // past L1: other SMs wrote it
#else  // the g++ emulation of the tests
#define ds4h_fence() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#define ds4h_count(p) __atomic_fetch_add((uint32_t*)(p), 1u, __ATOMIC_SEQ_CST)
#define ds4h_reset(p) __atomic_store_n((uint32_t*)(p), 0u, __ATOMIC_SEQ_CST)
#define ds4h_load(p) (*(p))
#endif

// @@ hc_pre
constexpr int K = HC * D;
constexpr int M = HEAD ? HC : (2 + HC) * HC;
constexpr int WARPS = THREADS / 32;
constexpr int VT = THREADS;  // pre_core's norm sums in this launch's own order
DS4_SHARED float red[WARPS * (M + 1)];

const uint32_t t = tgx;
const DS4_DEV T* xt = x + uint64_t(t) * uint64_t(K);

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
#define HC_LD(p) (*(p))
const DS4_DEV T* st = xt;
DS4_DEV T* yo = y;
DS4_DEV float* pre_o = pre;
DS4_DEV float* post_o = post;
DS4_DEV float* comb_o = comb;

// @@ pre_core
// hc_pre's work for token t (in one threadgroup), after `hc_pre` or a tail's `hc_last` and
// glue: the M+1 sums (red's per-warp sums, or the PARTS rows of part), norm, sigmoids,
// Sinkhorn, the collapse of the streams st, the folded norm; outputs through pre_o / post_o
// / comb_o / yo, loads of what this launch wrote through HC_LD.  The collapse and the norm
// run as VT threads would (thread tid plays tid, tid + THREADS, ... < VT).
constexpr int NV = VT / THREADS;
static_assert(NV * THREADS == VT && THREADS >= M + 1 && THREADS >= 32, "pre_core's thread layout");
static_assert(WARPS * (M + 1) >= VT / 32, "red holds the norm's per-warp sums");
DS4_SHARED float mix[M + 1];
DS4_SHARED float cm[32];
DS4_SHARED float pre_sh[HC];
const float hc_eps = eps[0];
const float norm_eps = eps[1];

if (tid < uint32_t(M + 1)) {
    float v = 0.0f;
    if (PARTS == 0) {
        for (int w = 0; w < WARPS; ++w) {
            v += red[uint32_t(w) * uint32_t(M + 1) + tid];
        }
    } else {
        // the projection was split across PARTS threadgroups (hc_dots): add their sums
        for (int p = 0; p < PARTS; ++p) {
            v += HC_LD(part + (uint64_t(t) * uint64_t(PARTS) + uint64_t(p)) * uint64_t(M + 1) + tid);
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
        pre_o[uint64_t(t) * uint64_t(HC) + tid] = pre_sh[tid];
        const float m1 = mix[HC + tid] * rs;
        post_o[uint64_t(t) * uint64_t(HC) + tid] =
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
    for (int u = 0; u < HC; ++u) {
        rmax = ds4_fmax(rmax, cm[i * uint32_t(HC) + uint32_t(u)]);
    }
    const float e = ds4_exp(v - rmax);
    ds4_warp_barrier();
    if (act) {
        cm[lane] = e;
    }
    ds4_warp_barrier();
    float sum = 0.0f;
    for (int u = 0; u < HC; ++u) {
        sum += cm[i * uint32_t(HC) + uint32_t(u)];
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
        for (int u = 0; u < HC; ++u) {
            s += cols ? cm[uint32_t(u) * uint32_t(HC) + j] : cm[i * uint32_t(HC) + uint32_t(u)];
        }
        v = v / (s + hc_eps);
    }
    if (act) {
        comb_o[uint64_t(t) * uint64_t(HC * HC) + lane] = v;
    }
}
ds4_tg_barrier();
float yss[NV];
for (int vt = 0; vt < NV; ++vt) {
    yss[vt] = 0.0f;
    for (uint32_t c = tid + uint32_t(vt * THREADS); COLLAPSE && c < uint32_t(D); c += uint32_t(VT)) {
        float a = 0.0f;
        for (int u = 0; u < HC; ++u) {
            a += pre_sh[u] * static_cast<float>(HC_LD(st + uint32_t(u) * uint32_t(D) + c));
        }
        const T yt = static_cast<T>(a);
        yo[uint64_t(t) * uint64_t(D) + c] = yt;
        yss[vt] += static_cast<float>(yt) * static_cast<float>(yt);
    }
}
if (NORM && COLLAPSE) {
    // each thread re-reads only the entries it wrote above: no barrier needed for them
    for (int vt = 0; vt < NV; ++vt) {
        const float v = ds4_warp_sum(yss[vt]);
        if (lane == 0u) {
            red[uint32_t(vt * (THREADS / 32)) + warp] = v;  // virtual thread tid + vt*THREADS's warp
        }
    }
    ds4_tg_barrier();
    float tot = 0.0f;
    for (int w = 0; w < VT / 32; ++w) {
        tot += red[w];
    }
    const float r = ds4_rsqrt(tot / float(D) + eps[2]);
    for (uint32_t c = tid; c < uint32_t(D); c += uint32_t(THREADS)) {
        const uint64_t o = uint64_t(t) * uint64_t(D) + c;
        const T yn = static_cast<T>(static_cast<float>(yo[o]) * r);
        yo[o] = static_cast<T>(static_cast<float>(nw[c]) * static_cast<float>(yn));
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

// @@ hc_last
// (a tail) this threadgroup's part row (and slice of y) are written: count token t's
// threadgroups; the last one goes on to pre_core, the others leave.
DS4_SHARED uint32_t last_sh[1];
ds4h_fence();  // each thread: its writes visible device-wide before the count below
ds4_tg_barrier();
if (tid == 0u) {
    const bool last = ds4h_count(tickets + t) == uint32_t(PARTS - 1);
    if (last) {
        ds4h_reset(tickets + t);  // all PARTS have counted: zero for the next launch
    }
    last_sh[0] = last ? 1u : 0u;
}
ds4_tg_barrier();
if (last_sh[0] == 0u) {
    return;
}
ds4h_fence();
#define HC_LD(p) ds4h_load(p)

// @@ dots_glue
// (hc_dots_pre) the collapse reads the input streams
const DS4_DEV T* st = xt;
DS4_DEV T* yo = y;
DS4_DEV float* pre_o = pre;
DS4_DEV float* post_o = post;
DS4_DEV float* comb_o = comb;

// @@ post_dots_glue
// (hc_post_dots_pre) the collapse reads the new streams y that all PARTS threadgroups wrote;
// post / comb are the previous site's inputs: this site's come out as post2 / comb2
const DS4_DEV T* st = y + uint64_t(t) * uint64_t(K);
DS4_DEV T* yo = h;
DS4_DEV float* pre_o = pre;
DS4_DEV float* post_o = post2;
DS4_DEV float* comb_o = comb2;

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
