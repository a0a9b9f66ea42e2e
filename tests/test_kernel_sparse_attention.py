"""Sparse attention kernels for compressed layers (ds4mlx/kernels/sparse_attention.py).

CPU: the reference faces against float64 math; the shared GPU kernel text compiled
with g++ (emulated threadgroups, test_kernel_emulation.py) against the same math; and
the model's fused path (run with the reference faces) against the transformers oracle
and the plain graph on the tiny oracle models (CSA with top-k selection, HCA, sliding).
GPU (``-m gpu``): each GPU kernel against the reference face run on the CPU, at toy
and V4 Flash shapes, decode and prefill; and the tiny models with kernels on vs off.

Stated bounds (float32 math, u = 2**-23):
  scores   |d| <= (DI + NH + 4) u sum_h |w_h scale| sum_c |q_hc k_c|
  top-k    the chosen set equals float64 top-k on inputs without ties (ties: lowest
           indices, checked separately on the kernel)
  attend   logits l_j = scale q.k_j are within e = (D + 2) u scale sum_c |q_c k_jc|;
           |d out_c| <= (2.2 max_j e_j + (n_keys + 32) u) sum_j (p_j / Z) |k_jc|
           (+1 ulp of the output dtype; 32: exp, the online rescaling and the merge of the SIMD groups)
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
from test_kernel_attn_prep import CPU_TRIG, make_rope  # noqa: E402
from test_kernel_emulation import run_on_cpu  # noqa: E402  (tests/ is on sys.path under pytest)
from test_kernel_selftest import fake_launches

from ds4mlx.kernels import dispatch
from ds4mlx.kernels import sparse_attention as sa

U = 2.0**-23


# exactness claims are about MLX's CPU kernels; `gpu` tests keep the default device
pytestmark = pytest.mark.usefixtures("cpu_unless_gpu_test")


# ------------------------------------------------------------------ float64 oracles


def limits(s, c, ratio, n):
    return np.minimum((s + np.arange(c) + 1) // ratio, n)


def scores64(q, w, keys, n, s, ratio, scale):
    """q [NH, C, DI], w [C, NH], keys [>=n, DI] -> (scores [C, n], bound [C, n])."""
    nh, c, di = q.shape
    q64, k64, w64 = q.astype(np.float64), keys[:n].astype(np.float64), w.astype(np.float64) * scale
    dots = q64 @ k64.T  # [NH, C, n]
    sc = (w64[:, None, :] @ np.maximum(dots, 0).transpose(1, 0, 2))[:, 0]  # [C, n]
    mag = (np.abs(w64)[:, None, :] @ (np.abs(q64) @ np.abs(k64).T).transpose(1, 0, 2))[:, 0]
    live = np.arange(n)[None] < limits(s, c, ratio, n)[:, None]
    return np.where(live, sc, -np.inf), np.where(live, (di + nh + 4) * U * mag, 0.0)


def topk64(scores, k, s, ratio):
    """Expected (sorted index lists) per query: all causal rows, or the k largest."""
    c, n = scores.shape
    out = []
    for t, lim in enumerate(limits(s, c, ratio, n)):
        if lim <= k:
            out.append(list(range(lim)))
        else:
            order = np.argsort(-scores[t, :lim], kind="stable")
            out.append(sorted(order[:k].tolist()))
    return out


def window_pos(length, s, ring_last, w):
    j = np.arange(length)
    return np.where(j < w, ring_last - ((ring_last - j) % w), s + (j - w))


def attend64(q, keys, rows, sel, sinks, s, ring_last, w, scale):
    """sel: per query, the list of compressed rows it attends.  -> (out, bound) [NH, C, D]."""
    nh, c, d = q.shape
    pos = window_pos(keys.shape[0], s, ring_last, w)
    out = np.zeros((nh, c, d))
    bound = np.zeros((nh, c, d))
    for t in range(c):
        ta = s + t
        win = np.nonzero((pos >= 0) & (pos <= ta) & (pos > ta - w))[0]
        kk = np.concatenate([keys[win], rows[sel[t]] if len(sel[t]) else np.zeros((0, d))]).astype(np.float64)
        for h in range(nh):
            qh = q[h, t].astype(np.float64)
            lg = scale * kk @ qh
            e = (d + 2) * U * scale * (np.abs(kk) @ np.abs(qh))
            m = max(lg.max(initial=-np.inf), float(sinks[h]))
            p = np.exp(lg - m)
            z = p.sum() + np.exp(float(sinks[h]) - m)
            out[h, t] = (p / z) @ kk
            a = (p / z) @ np.abs(kk)
            bound[h, t] = (2.2 * e.max(initial=0.0) + (len(kk) + 32) * U) * a + 1e-30
    return out, bound


def rotate64(out, bnd, t_abs, rope):
    """The inverse rope at each query's position t_abs[t] on out [NH, C, D] (float64), and the
    error bound through it: the input's bound on both channels of a pair, plus the float32
    angle (2u |theta|) and the rotation's and scale's roundings."""
    if rope is None:
        return out, bnd
    d, rd, ms = out.shape[-1], rope.dims, float(rope.attention_factor)
    periods = np.array(rope.periods).astype(np.float64)
    o, b = out.copy(), bnd.copy()
    a, z = slice(d - rd, d, 2), slice(d - rd + 1, d, 2)
    for t, pos in enumerate(t_abs):
        th = -float(pos) * (1.0 / periods)
        cs, sn = np.cos(th), np.sin(th)
        x0, x1 = out[:, t, a], out[:, t, z]
        o[:, t, a], o[:, t, z] = (x0 * cs - x1 * sn) * ms, (x0 * sn + x1 * cs) * ms
        e = ms * (bnd[:, t, a] + bnd[:, t, z] + (np.abs(x0) + np.abs(x1)) * (2 * U * np.abs(th) + 8 * U))
        b[:, t, a], b[:, t, z] = e, e
    return o, b


def check(name, got, want, bound):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    fin = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), fin), name
    err = np.abs(got[fin] - want[fin])
    assert np.all(err <= bound[fin]), (name, float(np.max(err / np.maximum(bound[fin], 1e-300))))


def selection_lists(idx, cnt):
    idx, cnt = np.asarray(idx), np.asarray(cnt)
    return [idx[t, : cnt[t]].tolist() for t in range(len(cnt))]


# ------------------------------------------------------------------ random problems


def index_problem(nh, di, n, c, s, seed, cap=None):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((nh, c, di)).astype(np.float32)
    w = rng.standard_normal((c, nh)).astype(np.float32)
    keys = rng.standard_normal((cap or n, di)).astype(np.float32)
    return q, w, keys


def attn_problem(nh, d, w, c, n, s, seed, decode):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((nh, c, d)).astype(np.float32)
    length = w if decode else w + c
    keys = rng.standard_normal((length, d)).astype(np.float32)
    rows = rng.standard_normal((max(n, 1) + 3, d)).astype(np.float32)  # a buffer past the n live rows
    sinks = rng.standard_normal(nh).astype(np.float32)
    return q, keys, rows, sinks


# ------------------------------------------------------------------ reference faces vs float64


@pytest.mark.parametrize(
    "nh,di,n,c,s,ratio", [(4, 16, 40, 1, 163, 4), (6, 10, 33, 7, 100, 3), (64, 128, 700, 2, 2800, 4)]
)
def test_reference_index_scores(nh, di, n, c, s, ratio):
    q, w, keys = index_problem(nh, di, n, c, s, seed=n)
    want, bound = scores64(q, w, keys, n, s, ratio, 0.3)
    got = sa.index_scores(
        mx.array(q), mx.array(w), mx.array(keys), n=n, s=s, ratio=ratio, scale=0.3, backend="reference"
    )
    check("scores", np.array(got), want, bound)


@pytest.mark.parametrize(
    "n,k,c,s,ratio", [(50, 7, 1, 203, 4), (50, 7, 9, 20, 3), (12, 20, 3, 40, 4), (600, 512, 2, 2400, 4)]
)
def test_reference_topk(n, k, c, s, ratio):
    rng = np.random.default_rng(n + k)
    scores = rng.standard_normal((c, n)).astype(np.float32)
    idx, cnt = sa.topk_select(mx.array(scores), k, s=s, ratio=ratio, backend="reference")
    assert idx.shape == (c, k) and idx.dtype == mx.int32
    assert selection_lists(idx, cnt) == topk64(scores, k, s, ratio)
    assert np.all(np.array(idx)[np.arange(k)[None] >= np.array(cnt)[:, None]] == 0)


ATTN_CASES = [  # (nh, d, window, c, n, s, ratio, topk (0: all causal rows), decode)
    (3, 40, 8, 1, 9, 38, 4, 5, True),  # decode, selected rows
    (3, 40, 8, 1, 0, 2, 4, 0, True),  # decode, ring not full, no rows yet
    (2, 24, 5, 1, 6, 37, 6, 0, True),  # decode, HCA-like (all rows)
    (2, 24, 5, 7, 6, 30, 6, 0, False),  # prefill chunk, all causal rows
    (4, 16, 6, 9, 10, 31, 4, 4, False),  # prefill chunk longer than the window, selected
    (2, 16, 6, 5, 1, 0, 4, 0, False),  # prefill from position 0 (empty ring)
]


def _attn_case(case, seed):
    nh, d, w, c, n, s, ratio, k, decode = case
    q, keys, rows, sinks = attn_problem(nh, d, w, c, n, s, seed, decode)
    ring_last = s if decode else s - 1
    if k:
        rng = np.random.default_rng(seed + 1)
        sc = rng.standard_normal((c, n)).astype(np.float32)
        idx, cnt = sa.topk_select(mx.array(sc), k, s=s, ratio=ratio, backend="reference")
        sel = selection_lists(idx, cnt)
    else:
        idx = cnt = None
        sel = [list(range(lim)) for lim in limits(s, c, ratio, n)]
    return q, keys, rows, sinks, ring_last, idx, cnt, sel


@pytest.mark.parametrize(
    "case", ATTN_CASES, ids=lambda c: "nh{}_d{}_w{}_c{}_n{}_s{}_r{}_k{}_{}".format(*c[:8], "dec" if c[8] else "pre")
)
def test_reference_attention(case):
    nh, d, w, c, n, s, ratio, k, decode = case
    q, keys, rows, sinks, ring_last, idx, cnt, sel = _attn_case(case, seed=sum(case[:7]))
    want, bound = attend64(q, keys, rows, sel, sinks, s, ring_last, w, d**-0.5)
    got = sa.sparse_attention(
        mx.array(q),
        mx.array(keys),
        mx.array(rows),
        idx,
        cnt,
        mx.array(sinks),
        n=n,
        s=s,
        ring_last=ring_last,
        window=w,
        ratio=ratio,
        scale=d**-0.5,
        backend="reference",
    )
    check("attention", np.array(got), want, bound)


@pytest.mark.parametrize("kind", ["plain", "yarn"])
def test_reference_attend_at_with_output_rope(kind):
    """attend_at's reference face with `out_rope`: the attention, then the inverse rope at the
    position (what `Attention._output` did after it)."""
    case = (3, 40, 8, 1, 9, 38, 4, 5, True)
    nh, d, w, c, n, s, ratio, k, decode = case
    q, keys, rows, sinks, ring_last, idx, cnt, sel = _attn_case(case, seed=3)
    rope = make_rope(8, kind)
    got = sa.attend_at(
        mx.array(q), mx.array(keys), mx.array(rows), idx, cnt, mx.array(sinks), mx.array(s, mx.int32),
        ratio=ratio, scale=d**-0.5, backend="reference", out_rope=rope,
    )  # fmt: skip
    want, bound = rotate64(*attend64(q, keys, rows, sel, sinks, s, ring_last, w, d**-0.5), [s], rope)
    check("attention + rope", np.array(got), want, bound)


def test_score_layouts():
    assert sa.score_layout(512, 1) == "heads" and sa.score_layout(16384, 1) == "heads"
    assert sa.score_layout(1024, 512) == "rows"  # a prefill chunk
    assert [sa.score_rows(n, 1) for n in (512, 2048, 8192, 16384, 1 << 20)] == [2, 2, 8, 16, 64]
    assert [sa.attend_splits("cuda", 1, n) for n in (128, 144, 384, 640, 8320)] == [1, 1, 3, 4, 4]
    assert sa.attend_splits("metal", 1, 640) == 1 and sa.attend_splits("cuda", 64, 640) == 1


def test_step_metas_come_out_of_one_launch():
    """The decode step's kernel metas ([pos] * lead + constants) for one `pos` are views of one
    multiply-add (issue #13: was one launch per distinct meta, 4 per step); a meta that was not
    announced gets its values too (its own launch the first time), a new `pos` its own array."""
    from ds4mlx.bench.decode_profile import NO_LAUNCH, graph_primitives

    sa.expect_step(16, 0)
    sa.expect_step(16, 40, 40)
    keys = [(2, 16, 0, 1), (2, 16, 40, 1), (1, 40, 1)]
    late = (2, 16, 7 + int(np.random.randint(1 << 20)), 1)  # not announced
    for p in (37, 1234, 99):
        pos = mx.array(p, mx.int32)
        metas = [sa._meta_at(pos, *k) for k in keys]
        assert sa._meta_at(pos, 2, 16, 40, 1) is metas[1]  # the same view: no new launch
        ops = graph_primitives(metas)  # (before they are evaluated)
        assert {k: v for k, v in ops.items() if k not in NO_LAUNCH} == {"Add": 1, "Multiply": 1}
        if p != 99:  # the late key, then (known since) with the others
            metas.append(sa._meta_at(pos, *late))
        for (lead, *rest), m in zip([*keys, late], metas):
            assert m.tolist() == [p] * lead + rest
    assert sa._meta_at(5, 2, 16, 0, 1).tolist() == [5, 5, 16, 0, 1]  # a host position: a constant


def test_reference_attention_matches_mlx_sdpa_with_sinks():
    """The reference's sink convention is the one of mx.fast.scaled_dot_product_attention."""
    rng = np.random.default_rng(0)
    nh, d, L = 4, 32, 11
    q = mx.array(rng.standard_normal((1, nh, 1, d)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 1, L, d)).astype(np.float32))
    sinks = mx.array(rng.standard_normal(nh).astype(np.float32))
    want = mx.fast.scaled_dot_product_attention(q, k, k, scale=d**-0.5, sinks=sinks)
    got = sa.sparse_attention(
        q[0],
        k[0, 0],
        None,
        None,
        None,
        sinks,
        n=0,
        s=L - 1,
        ring_last=L - 1,
        window=L,
        ratio=4,
        scale=d**-0.5,
        backend="reference",
    )
    assert np.allclose(np.array(got), np.array(want[0]), atol=1e-5)


# ------------------------------------------------------------------ sources


@pytest.mark.parametrize("kind", ["index_score", "index_score_heads", "topk", "index_topk", "attend"])
def test_metal_and_cuda_share_one_description(kind):
    sec = dispatch.sections(sa.SOURCE)
    mh, mb = sa.kernel_sources(kind, "metal")
    ch, cb = sa.kernel_sources(kind, "cuda")
    assert sec["common"] in mh and sec["common"] in ch
    text = "".join(sec[k] for k in sa.INDEX_TOPK) if kind == "index_topk" else sec[kind]
    assert mb.endswith(text) and cb.endswith(text)
    for word in ("device ", "threadgroup ", "simd_sum", "as_type", " uint ", "metal::"):
        assert word not in ch + cb, word


# ------------------------------------------------------------------ the shared GPU text, compiled for the CPU


# attend's split merge on the CPU emulation: threadgroups run one after another, so the
# last split's ticket is its own; the tickets are an input written through a cast, as on CUDA
CPU_TICKETS = """#define DS4_DEVICE_TICKETS 1
static inline void ds4_device_fence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline uint32_t ds4_device_ticket(const uint32_t* p) {
    return __atomic_fetch_add(const_cast<uint32_t*>(p), 1u, __ATOMIC_ACQ_REL);
}
static inline void ds4_ticket_reset(const uint32_t* p) { __atomic_store_n(const_cast<uint32_t*>(p), 0u, __ATOMIC_SEQ_CST); }
static inline float ds4_load_cg(const float* p) { return *p; }
"""


def _emu(tmp_path, kind, **kw):
    sec = dispatch.sections(sa.SOURCE)
    header = sec["common"] + (CPU_TRIG + CPU_TICKETS + sa.ATTEND_ONE if kind == "attend" else "")
    return run_on_cpu(tmp_path, header, sec[kind], **kw)


@pytest.mark.parametrize("nh,di,n,c,s", [(5, 12, 70, 3, 280), (3, 9, 40, 4, 20), (16, 8, 33, 1, 140)])
@pytest.mark.slow_after(1)
def test_shared_index_score_text(nh, di, n, c, s, tmp_path):
    ratio, scale, threads, hg = 4, 0.25, 32, 4
    q, w, keys = index_problem(nh, di, n, c, s, seed=nh * di, cap=n + 5)
    got = _emu(
        tmp_path,
        "index_score",
        inputs={
            "q": q,
            "w": w,
            "keys": keys,
            "prm": np.array([scale], np.float32),
            "meta": np.array([s, n, c], np.int32),
        },
        outputs={"scores": ((c, n), np.float32)},
        consts={
            "TQ": np.float32,
            "TW": np.float32,
            "TK": np.float32,
            "NH": nh,
            "DI": di,
            "HG": hg,
            "RATIO": ratio,
            "THREADS": threads,
        },
        groups=(-(-n // threads), c, 1),
        threads=threads,
    )
    want, bound = scores64(q, w, keys, n, s, ratio, scale)
    check("scores", got["scores"], want, bound)


@pytest.mark.parametrize(
    "nh,di,n,c,s,rows", [(5, 12, 70, 3, 280, 4), (3, 40, 40, 2, 20, 2), (16, 8, 33, 1, 140, 8), (64, 128, 9, 1, 36, 2)]
)
@pytest.mark.slow_after(1)
def test_shared_index_score_heads_text(nh, di, n, c, s, rows, tmp_path):
    ratio, scale, threads = 4, 0.25, 64
    q, w, keys = index_problem(nh, di, n, c, s, seed=nh * di + 1, cap=n + 5)
    got = _emu(
        tmp_path,
        "index_score_heads",
        inputs={
            "q": q,
            "w": w,
            "keys": keys,
            "prm": np.array([scale], np.float32),
            "meta": np.array([s, n, c], np.int32),
        },
        outputs={"scores": ((c, n), np.float32)},
        consts={
            "TQ": np.float32,
            "TW": np.float32,
            "TK": np.float32,
            "NH": nh,
            "DI": di,
            "ROWS": rows,
            "RATIO": ratio,
            "THREADS": threads,
        },
        groups=(-(-n // rows), c, 1),
        threads=threads,
    )
    want, bound = scores64(q, w, keys, n, s, ratio, scale)
    check("scores", got["scores"], want, bound)


@pytest.mark.parametrize("n,k,c,s,ratio", [(300, 37, 4, 1190, 4), (90, 64, 5, 230, 3), (20, 8, 3, 40, 4)])
@pytest.mark.slow_after(1)
def test_shared_topk_text(n, k, c, s, ratio, tmp_path):
    rng = np.random.default_rng(n)
    scores = rng.standard_normal((c, n)).astype(np.float32)
    scores[0, ::7] = -scores[0, ::7] * 1e-3  # mixed signs and magnitudes
    got = _emu(
        tmp_path,
        "topk",
        inputs={"scores": scores, "meta": np.array([s, n, c], np.int32)},
        outputs={"idx": ((c, k), np.int32), "cnt": ((c,), np.int32)},
        consts={"TOPK": k, "RATIO": ratio, "THREADS": 64},
        groups=(1, c, 1),
        threads=64,
    )
    assert selection_lists(got["idx"], got["cnt"]) == topk64(scores, k, s, ratio)
    assert np.all(got["idx"][np.arange(k)[None] >= got["cnt"][:, None]] == 0)


def test_shared_topk_text_ties_take_lowest_indices(tmp_path):
    n, k = 200, 10
    scores = np.zeros((2, n), np.float32)
    scores[0, [5, 50, 150]] = 2.0  # 3 clear winners, then 197 tied zeros
    scores[1] = np.round(np.random.default_rng(1).standard_normal(n), 0)  # many ties in a few values
    got = _emu(
        tmp_path,
        "topk",
        inputs={"scores": scores, "meta": np.array([10**6, n, 2], np.int32)},
        outputs={"idx": ((2, k), np.int32), "cnt": ((2,), np.int32)},
        consts={"TOPK": k, "RATIO": 4, "THREADS": 64},
        groups=(1, 2, 1),
        threads=64,
    )
    lists = selection_lists(got["idx"], got["cnt"])
    assert lists[0] == [0, 1, 2, 3, 4, 5, 6, 7, 50, 150]
    order = sorted(range(n), key=lambda i: (-scores[1, i], i))[:k]  # value, then lowest index
    assert lists[1] == sorted(order)


def _emu_index_topk(tmp_path, q, w, keys, k, n, c, s, rows, threads, fused, tickets=None):
    """index_topk (one launch) or index_score_heads + topk (two) through the CPU emulation
    -> {"scores", "idx", "cnt"(, "tickets")}."""
    nh, _, di = q.shape
    ins = {"q": q, "w": w, "keys": keys, "prm": np.array([0.25], np.float32), "meta": np.array([s, n, c], np.int32)}
    consts = {"TQ": np.float32, "TW": np.float32, "TK": np.float32, "NH": nh, "DI": di, "ROWS": rows, "RATIO": 4}
    consts["THREADS"] = threads
    groups = (-(-n // rows), c, 1)
    if fused:
        sec = dispatch.sections(sa.SOURCE)
        return run_on_cpu(
            tmp_path,
            sec["common"] + CPU_TICKETS,
            "".join(sec[kk] for kk in sa.INDEX_TOPK),
            inputs={**ins, "tickets": tickets},
            outputs={"scores": ((c, n), np.float32), "idx": ((c, k), np.int32), "cnt": ((c,), np.int32)},
            consts={**consts, "TOPK": k},
            groups=groups,
            threads=threads,
            inout=("tickets",),
        )
    got = _emu(tmp_path / "s", "index_score_heads", inputs=ins, outputs={"scores": ((c, n), np.float32)},
               consts=consts, groups=groups, threads=threads)  # fmt: skip
    got.update(
        _emu(
            tmp_path / "k",
            "topk",
            inputs={"scores": got["scores"], "meta": ins["meta"]},
            outputs={"idx": ((c, k), np.int32), "cnt": ((c,), np.int32)},
            consts={"TOPK": k, "RATIO": 4, "THREADS": 2 * threads},  # (topk's own launch: twice the threads)
            groups=(1, c, 1),
            threads=2 * threads,
        )
    )
    return got


@pytest.mark.parametrize(
    "nh,di,n,c,s,rows,k",
    [
        (5, 12, 70, 3, 280, 4, 9),  # 3 queries: more live rows than k
        (16, 8, 33, 1, 60, 2, 20),  # fewer live rows (15) than k: all of them
        (3, 40, 300, 2, 1190, 8, 37),  # the second query has one live row more
        (12, 40, 200, 1, 10**6, 16, 64),  # ties: rounded keys give many equal scores
    ],
)
@pytest.mark.slow_after(1)
def test_shared_index_topk_text_equals_the_two_launches(nh, di, n, c, s, rows, k, tmp_path):
    """index_topk's text (index_score_heads + the hand-off + topk, the last threadgroup of a
    query running topk) gives the two launches' scores, idx and cnt bit for bit, with topk at
    half its own launch's threads; the tickets are zero again after the launch."""
    (tmp_path / "s").mkdir()
    (tmp_path / "k").mkdir()
    q, w, keys = index_problem(nh, di, n, c, s, seed=nh * di + n, cap=n + 5)
    if s == 10**6:
        q, w, keys = np.round(q), np.round(w), np.round(keys)  # integer sums: exact ties
    tickets = np.zeros(c + 2, np.uint32)
    got = _emu_index_topk(tmp_path, q, w, keys, k, n, c, s, rows, 64, fused=True, tickets=tickets)
    want = _emu_index_topk(tmp_path, q, w, keys, k, n, c, s, rows, 64, fused=False)
    for name in ("scores", "idx", "cnt"):
        assert np.array_equal(got[name], want[name]), name
    assert selection_lists(got["idx"], got["cnt"]) == topk64(want["scores"].astype(np.float64), k, s, 4)
    assert not got["tickets"].any()


@pytest.mark.parametrize("variant", ["one", "split3_rope"])
@pytest.mark.parametrize(
    "case", ATTN_CASES, ids=lambda c: "nh{}_d{}_w{}_c{}_n{}_s{}_r{}_k{}_{}".format(*c[:8], "dec" if c[8] else "pre")
)
@pytest.mark.slow_after(1)
def test_shared_attend_text(case, variant, tmp_path):
    """The attend text, one threadgroup per (head, query) and (split3_rope) the keys split
    across 3 threadgroups merged by the last, with the output's inverse rope."""
    nh, d, w, c, n, s, ratio, k, decode = case
    splits, rope = (3, make_rope(8, "yarn")) if variant == "split3_rope" else (1, None)
    threads = 128 if splits > 1 else 64  # the merge reuses the SIMD groups' slots: splits <= groups
    q, keys, rows, sinks, ring_last, idx, cnt, sel = _attn_case(case, seed=sum(case[:7]))
    if idx is None:
        idx_np, cnt_np, topk = np.zeros((1, 1), np.int32), np.zeros(1, np.int32), 1
    else:
        idx_np, cnt_np, topk = np.array(idx), np.array(cnt), k
    got = _emu(
        tmp_path,
        "attend",
        inputs={
            "q": q,
            "keys": keys,
            "rows": rows,
            "idx": idx_np,
            "cnt": cnt_np,
            "sinks": sinks,
            "rope": np.array(rope.periods) if rope else np.zeros(1, np.float32),
            "prm": np.array([d**-0.5, rope.attention_factor if rope else 1.0], np.float32),
            "meta": np.array([s, ring_last, keys.shape[0], n, c], np.int32),
            "tickets": np.zeros(nh * c + 3, np.uint32),  # the persistent buffer: zero at launch
        },
        outputs={
            "o": ((nh, c, d), np.float32),
            "part": ((nh * c * splits * (d + 2),), np.float32),
        },
        consts={
            "T": np.float32,
            "TK": np.float32,
            "TS": np.float32,
            "D": d,
            "W": w,
            "RATIO": ratio,
            "TOPK": topk,
            "THREADS": threads,
            "KB": 4,
            "SELECTED": idx is not None,
            "RD": rope.dims if rope else 0,
            "SPLIT": splits,
        },
        groups=(nh, c, splits),
        threads=threads,
        inout=("tickets",),
    )
    want, bound = attend64(q, keys, rows, sel, sinks, s, ring_last, w, d**-0.5)
    want, bound = rotate64(want, bound, s + np.arange(c), rope)
    check("attention", got["o"], want, bound)
    assert not got["tickets"].any()  # zero again after the launch: the last split reset its ticket


def _emulated_rows_kernel(tmp_path, launches):
    """A stand-in for sa._rows_kernel(n): attend's text with attend_rows' defines on the g++
    emulation, with the inputs, template and grid the module passes."""
    from test_kernel_emulation import emulated_launch

    sec = dispatch.sections(sa.SOURCE)
    header = sec["common"] + CPU_TRIG + CPU_TICKETS
    io = sa.attend_rows_io
    types = ("T", "TK", "TS")
    return lambda n: emulated_launch(
        tmp_path,
        launches,
        header + sa.attend_rows_defines(n),
        sec["attend"],
        io(n),
        float_consts=types,
        inout=("tickets",),
    )


@pytest.mark.parametrize("selected", [True, False])
@pytest.mark.parametrize("splits,rope_dims", [(1, 0), (3, 8)])
@pytest.mark.slow_after(1)
def test_attend_rows_wiring_on_the_cpu_emulation(selected, splits, rope_dims, tmp_path, monkeypatch):
    """attend_rows (session batching: B sessions' decode queries in one launch) through the
    module's own inputs, template and grid, the kernel run by the g++ emulation: row b equals
    attend_at's reference face on row b's own query, ring, rows, selection and position."""
    launches = []
    monkeypatch.setattr(sa, "_rows_kernel", _emulated_rows_kernel(tmp_path, launches))
    monkeypatch.setattr(sa, "_verified", lambda *a: True)
    monkeypatch.setattr(sa, "ATTN_THREADS", 128)  # 4 SIMD groups: the merge reuses their slots (splits <= 4)
    monkeypatch.setattr(sa, "ATTN_SPLIT_KEYS", 4)  # several key splits at these sizes
    monkeypatch.setattr(sa, "ATTN_SPLIT_MAX", splits)
    nh, d, w, ratio, k = 3, 24 + rope_dims, 8, 4, 5
    rope = make_rope(rope_dims, "yarn") if rope_dims else None
    qs, rings, rows, idxs, cnts, poss = [], [], [], [], [], []
    for b, (n, s) in enumerate([(9, 38), (12, 50), (7, 29)]):
        q, keys, r, sinks = attn_problem(nh, d, w, 1, n, s, seed=40 + b, decode=True)
        qs.append(mx.array(q)[None])
        rings.append(mx.array(keys)[None, None])
        rows.append(mx.array(r))
        poss.append(mx.array(s, mx.int32))
        if selected:
            sc = np.random.default_rng(b).standard_normal((1, r.shape[0])).astype(np.float32)
            i, c = sa.topk_select(mx.array(sc), k, s=s, ratio=ratio, backend="reference")
        else:
            i = c = None
        idxs.append(i)
        cnts.append(c)
    sinks = mx.array(sinks)
    kw = dict(ratio=ratio, scale=d**-0.5, out_rope=rope)
    got = sa.attend_rows(qs, rings, rows, idxs, cnts, sinks, poss, **kw, backend="cuda")
    assert got is not None and got.shape == (3, nh, 1, d)
    assert len(launches) == 1 and launches[0][1][1:] == (3, splits)
    for b in range(3):
        want = sa.attend_at(qs[b], rings[b], rows[b], idxs[b], cnts[b], sinks, poss[b], **kw, backend="reference")
        np.testing.assert_allclose(np.array(got[b : b + 1]), np.array(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rope_dims", [0, 8])
@pytest.mark.slow_after(1)
def test_attend_rows_self_test_passes_on_the_cpu_emulation(rope_dims, tmp_path, monkeypatch):
    """attend_rows' first-use self-test (what a GPU runs before the batched step uses it), with
    the kernel run by the g++ emulation: it passes, and fails for a kernel that swaps two rows."""
    launches = []
    emulated = _emulated_rows_kernel(tmp_path, launches)
    monkeypatch.setattr(sa, "_rows_kernel", emulated)
    monkeypatch.setattr(sa, "ATTN_THREADS", 128)
    rope = make_rope(rope_dims, "yarn") if rope_dims else None
    key = mx.random.split(mx.random.key(7), 6)
    assert sa._self_test("attend_rows", "cuda", rope) and len(launches) == 8  # (un)split x (un)selected x twice

    def swapped(n):
        launch = emulated(n)
        return lambda face, **kw: [launch(face, **kw)[0][::-1], None]

    monkeypatch.setattr(sa, "_rows_kernel", swapped)
    assert not sa._attend_rows_self_test("cuda", key, rope)


def _emulated_topk_rows_kernel(tmp_path, launches):
    """A stand-in for sa._topk_rows_kernel(n): index_topk's text with the rows' prologue on the
    g++ emulation (64 threads), with the inputs, template and grid the module passes."""
    from test_kernel_emulation import emulated_launch

    sec = dispatch.sections(sa.SOURCE)
    header = "#define DS4_QY 0u\n" + sec["common"] + CPU_TICKETS
    body = "".join(sec[kk] for kk in sa.INDEX_TOPK)

    def kernel(n):
        launch = emulated_launch(
            tmp_path, launches, header, sa.index_topk_rows_prologue(n) + body, sa.index_topk_rows_io(n),
            float_consts=("TQ", "TW", "TK"), inout=("tickets",),
        )  # fmt: skip

        def run(face, *, template, grid, threadgroup, **kw):
            template = [(k, 64 if k == "THREADS" else v) for k, v in template]
            return launch(face, template=template, grid=(grid[0] // threadgroup[0] * 64, *grid[1:]), threadgroup=(64, 1, 1), **kw)  # fmt: skip

        return run

    return kernel


@pytest.mark.slow  # ~80 s of CPU: three emulated launches and the self-test
def test_index_topk_rows_wiring_and_self_test_on_the_cpu_emulation(tmp_path, monkeypatch):
    """index_topk_rows (session batching: B sessions' indexer scores + top-k in one launch)
    through the module's own inputs, template and grid on the g++ emulation: each row's idx /
    cnt are index_topk's reference of that row (rows of different sizes: a row whose share of
    the grid is smaller returns early); its first-use self-test passes there."""
    launches = []
    monkeypatch.setattr(sa, "_topk_rows_kernel", _emulated_topk_rows_kernel(tmp_path, launches))
    monkeypatch.setattr(sa, "_verified", lambda *a: True)
    monkeypatch.setattr(sa, "index_topk_fuses", lambda face, n, c: True)
    nh, di, k = 5, 12, 9
    ns, poss = [70, 33, 50], [280, 140, 30]
    probs = [index_problem(nh, di, n, 1, s, seed=n, cap=n + 5) for n, s in zip(ns, poss)]
    qs, ws, keys = ([mx.array(p[i]) for p in probs] for i in range(3))
    got = sa.index_topk_rows(qs, ws, keys, k, ns=ns, poss=poss, ratio=4, scale=0.25, backend="cuda")
    assert got is not None and len(launches) == 1 and launches[0][1][1] == 3
    for b, (n, s) in enumerate(zip(ns, poss)):
        scores = sa.index_scores(qs[b], ws[b], keys[b], n=n, s=s, ratio=4, scale=0.25, backend="reference")
        want = sa.topk_select(scores, k, s=s, ratio=4, backend="reference")
        assert selection_lists(*got[b]) == selection_lists(*want)
    assert sa._index_topk_rows_self_test("cuda", mx.random.split(mx.random.key(7), 6))


def test_attend_rows_leaves_unlike_rows_to_the_caller(monkeypatch):
    """Rows that cannot share a launch (one selected, one not; another window; one row; the
    CPU) give None: the caller runs attend_at per row."""
    monkeypatch.setattr(sa, "_verified", lambda *a: True)
    q, ring = mx.zeros((1, 2, 1, 16)), mx.zeros((1, 1, 4, 16))
    rows, idx, cnt, pos = mx.zeros((6, 16)), mx.zeros((1, 2), mx.int32), mx.array([2], mx.int32), mx.array(9)
    kw = dict(ratio=4, scale=0.25, backend="cuda")
    sinks = mx.zeros((2,))
    assert sa.attend_rows([q, q], [ring, ring], [rows, rows], [idx, None], [cnt, None], sinks, [pos, pos], **kw) is None
    wide = mx.zeros((1, 1, 8, 16))
    assert sa.attend_rows([q, q], [ring, wide], [rows, rows], [idx, idx], [cnt, cnt], sinks, [pos, pos], **kw) is None
    assert sa.attend_rows([q], [ring], [rows], [idx], [cnt], sinks, [pos], **kw) is None
    kw["backend"] = "reference"
    assert sa.attend_rows([q, q], [ring, ring], [rows, rows], [idx, idx], [cnt, cnt], sinks, [pos, pos], **kw) is None


@pytest.mark.parametrize("behaviour", ["raise", "garbage"])
def test_bad_decode_variants_keep_the_verified_layout(behaviour, fake_gpu):
    """A face whose new decode variants fail their first-use self-test (simulated on the CPU)
    keeps index_score's rows layout, one threadgroup per head and the separate output rope."""
    fake_launches(fake_gpu, sa, behaviour)
    assert not sa._verified("index_heads", "metal")
    assert not sa._verified("attend_split", "metal")
    assert not sa._verified("attend_rope", "metal", make_rope(8, "yarn"))
    assert not sa._verified("index_topk", "metal")
    assert dispatch._self_tests[("sparse_attention.attend_rope", "metal")] is False


def test_index_topk_fuses_on_cuda_only(monkeypatch):
    """One launch on CUDA at decode once both self-tests passed; Metal (no device-wide fence
    here), prefill chunks (the 'rows' layout) and a failed self-test keep the two launches;
    the reference face's index_topk is topk_select(index_scores(...))."""
    verified = {"index_heads": True, "index_topk": True}
    monkeypatch.setattr(sa, "_verified", lambda kind, face, rope=None: verified[kind])
    assert sa.index_topk_fuses("cuda", 16384, 1) and sa.index_topk_fuses("cuda", 513, 1)
    assert not sa.index_topk_fuses("metal", 16384, 1) and not sa.index_topk_fuses("reference", 513, 1)
    assert not sa.index_topk_fuses("cuda", 1024, 512)  # a prefill chunk: the rows layout
    verified["index_topk"] = False
    assert not sa.index_topk_fuses("cuda", 513, 1)
    q, w, keys = index_problem(8, 16, 300, 2, 1000, seed=4, cap=303)
    args = (mx.array(q), mx.array(w), mx.array(keys))
    kw = dict(n=300, s=1000, ratio=4, scale=0.2, backend="reference")
    got = sa.index_topk(*args, 40, **kw)
    want = sa.topk_select(sa.index_scores(*args, **kw), 40, s=1000, ratio=4, backend="reference")
    assert all(np.array_equal(np.array(g), np.array(v)) for g, v in zip(got, want))


# ------------------------------------------------------------------ the model's fused path (reference faces), CPU

CONFIGS = [None, "long", "odd"]


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: c or "default")
def oracle_model(request, oracle):
    from ds4mlx.models.base import load_hf_dir

    folder = oracle("make_tiny_deepseek_v4.py", request.param)
    return load_hf_dir(str(folder)), dict(np.load(folder / "reference.npz"))


@pytest.fixture
def fused_reference(monkeypatch):
    monkeypatch.setattr(sa, "FORCE_FACE", "reference")


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_fused_path_matches_oracle_and_plain_graph(oracle_model, chunk, monkeypatch):
    """Chunked forward through the fused attention path (kernels' reference faces) equals
    the transformers oracle and the plain graph at every position (chunk 1 = decode)."""
    lm, ref = oracle_model
    ids = mx.array(ref["input_ids"].astype(np.int32))

    def run():
        cache = lm.model.make_cache()
        return np.concatenate(
            [np.array(lm.model(ids[:, i : i + chunk], cache)[0]) for i in range(0, ids.shape[1], chunk)]
        )

    plain = run()
    monkeypatch.setattr(sa, "FORCE_FACE", "reference")
    fused = run()
    assert float(np.abs(fused - ref["logits_full"][0]).max()) <= 1e-4
    assert float(np.abs(fused - plain).max()) <= 1e-4


# ------------------------------------------------------------------ GPU faces


def _gpu_face():
    face = dispatch.gpu_backend()
    if face is None:
        pytest.skip("no MLX GPU backend")
    return face


GPU_INDEX = [  # (nh, di, n, c, s, dtype)
    (64, 128, 513, 1, 2055, "bfloat16"),  # V4 Flash decode, just past index_topk rows
    (64, 128, 4096, 1, 16387, "bfloat16"),
    (64, 128, 16384, 1, 65539, "float32"),
    (64, 128, 1024, 512, 3584, "bfloat16"),  # a 512-token prefill chunk
    (5, 12, 70, 3, 280, "float32"),  # odd sizes
    (16, 8, 33, 8, 120, "float32"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["rows", "heads"])
@pytest.mark.parametrize("case", GPU_INDEX, ids=lambda c: "nh{}_di{}_n{}_c{}_s{}_{}".format(*c))
def test_gpu_index_scores_and_topk(case, layout):
    face = _gpu_face()
    nh, di, n, c, s, dtype = case
    dt = getattr(mx, dtype)
    q, w, keys = index_problem(nh, di, n, c, s, seed=n + c, cap=n + 77)
    qm, wm, km = (mx.array(a).astype(dt) for a in (q, w, keys))
    q32, w32, k32 = (np.array(a.astype(mx.float32)) for a in (qm, wm, km))
    scale = nh**-0.5 * di**-0.5
    want, bound = scores64(q32, w32, k32, n, s, 4, scale)
    got = sa.index_scores(qm, wm, km, n=n, s=s, ratio=4, scale=scale, backend=face, layout=layout)
    got_np = np.array(got)
    check("scores", got_np, want, bound)
    # top-k on the kernel's own scores: the reference picks the same rows (no ties in random data)
    k = min(512, max(1, n // 3))
    idx, cnt = sa.topk_select(got, k, s=s, ratio=4, backend=face)
    assert selection_lists(idx, cnt) == topk64(got_np, k, s, 4)


GPU_ATTN = [  # (nh, d, window, c, n, s, ratio, topk (0: all causal rows), decode, dtype)
    (64, 512, 128, 1, 2048, 8195, 4, 512, True, "bfloat16"),  # V4 Flash CSA decode
    (64, 512, 128, 1, 2048, 8195, 4, 512, True, "float32"),
    (64, 512, 128, 1, 64, 8195, 128, 0, True, "bfloat16"),  # V4 Flash HCA decode
    (64, 512, 128, 1, 100, 50, 4, 0, True, "bfloat16"),  # ring not yet full
    (64, 512, 128, 64, 1024, 4096, 4, 512, False, "bfloat16"),  # prefill chunk, CSA
    (64, 512, 128, 512, 32, 4096, 128, 0, False, "bfloat16"),  # prefill chunk, HCA
    (3, 40, 8, 9, 10, 31, 4, 4, False, "float32"),  # odd sizes
    (2, 24, 5, 1, 6, 37, 6, 0, True, "float32"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    GPU_ATTN,
    ids=lambda c: "nh{}_d{}_w{}_c{}_n{}_s{}_r{}_k{}_{}_{}".format(*c[:8], "dec" if c[8] else "pre", c[9]),
)
def test_gpu_attention_equals_reference(case):
    face = _gpu_face()
    nh, d, w, c, n, s, ratio, k, decode, dtype = case
    dt = getattr(mx, dtype)
    q, keys, rows, sinks, ring_last, idx, cnt, sel = _attn_case(case[:9], seed=c + n)
    qm, km, rm, sm = (mx.array(a).astype(dt) for a in (q, keys, rows, sinks))
    q32, k32, r32, s32 = (np.array(a.astype(mx.float32)) for a in (qm, km, rm, sm))
    want, bound = attend64(q32, k32, r32, sel, s32, s, ring_last, w, d**-0.5)
    got = sa.sparse_attention(
        qm, km, rm, idx, cnt, sm, n=n, s=s, ring_last=ring_last, window=w, ratio=ratio, scale=d**-0.5, backend=face
    )
    assert got.dtype == dt and got.shape == (nh, c, d)
    got = np.array(got.astype(mx.float32))
    if dt != mx.float32:  # one rounding of the result to bfloat16
        bound = bound + 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - 7)
    check("attention", got, want, bound)


GPU_DECODE = [  # (nh, d, window, n, pos, ratio, topk (0: every capacity row), splits, dtype)
    (64, 512, 128, 512, 2051, 4, 0, 4, "float32"),  # V4 Flash CSA at 2K: every row
    (64, 512, 128, 8192, 32771, 4, 512, 4, "bfloat16"),  # CSA at 32K: 512 selected rows
    (64, 512, 128, 8192, 32771, 4, 512, 1, "float32"),
    (64, 512, 128, 256, 32771, 128, 0, 3, "bfloat16"),  # HCA at 32K
    (64, 512, 128, 256, 70, 128, 0, 2, "float32"),  # ring not full, no live row yet
    (64, 512, 128, 0, 5000, 1, 0, 1, "float32"),  # sliding
    (3, 40, 8, 30, 123, 4, 6, 3, "float32"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_DECODE, ids=lambda c: "nh{}_d{}_w{}_n{}_p{}_r{}_k{}_s{}_{}".format(*c))
def test_gpu_attend_at_split_with_output_rope(case):
    """The decode attention as the compiled step runs it: ring + capacity rows (or the
    selected ones), the keys split across threadgroups, the output's inverse rope in the
    epilogue; against float64 math."""
    face = _gpu_face()
    nh, d, w, n, pos, ratio, k, splits, dtype = case
    dt = getattr(mx, dtype)
    rng = np.random.default_rng(n + pos)
    q = rng.standard_normal((nh, 1, d)).astype(np.float32)
    ring = rng.standard_normal((w, d)).astype(np.float32)
    rows = rng.standard_normal((max(n, 1), d)).astype(np.float32)
    sinks = rng.standard_normal(nh).astype(np.float32)
    live = min((pos + 1) // ratio, n)
    if k:
        idx = np.sort(rng.permutation(live)[:k]).astype(np.int32)[None]
        cnt, sel = np.array([k], np.int32), [idx[0].tolist()]
    else:
        idx = cnt = None
        sel = [list(range(live))]
    qm, rm, wm, sm = (mx.array(a).astype(dt) for a in (q, ring, rows, sinks))
    q32, r32, w32, s32 = (np.array(a.astype(mx.float32)) for a in (qm, rm, wm, sm))
    rope = make_rope(64 if d >= 64 else 8, "yarn")
    got = sa.attend_at(
        qm, rm, wm if n else None, None if idx is None else mx.array(idx), None if cnt is None else mx.array(cnt),
        sm, mx.array(pos, mx.int32), ratio=ratio, scale=d**-0.5, backend=face, out_rope=rope, splits=splits,
    )  # fmt: skip
    assert got.dtype == dt and got.shape == (nh, 1, d)
    want, bound = attend64(q32, r32, w32, sel, s32, pos, pos, w, d**-0.5)
    want, bound = rotate64(want, bound, [pos], rope)
    got = np.array(got.astype(mx.float32))
    if dt != mx.float32:  # one rounding of the result to bfloat16
        bound = bound + 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - 7)
    check("attention", got, want, bound)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in GPU_INDEX if sa.score_layout(c[2], c[3]) == "heads"] + [
    (64, 128, 16384, 1, 40003, "bfloat16"),  # V4 Flash at 40K: 10000 live rows of a 64K-context buffer
    (64, 128, 8192, 1, 2001, "bfloat16"),  # 500 live rows (<= k: every one) of 8192
], ids=lambda c: "nh{}_di{}_n{}_c{}_s{}_{}".format(*c))  # fmt: skip
def test_gpu_index_topk_one_launch_equals_two(case):
    """index_topk (one launch: the last threadgroup of a query runs the top-k) against
    index_score_heads + topk: the same scores, idx and cnt bit for bit, at V4 Flash's shapes
    (k = 512), each case three times (every launch needs the tickets the one before reset)."""
    face = _gpu_face()
    if face != "cuda":
        pytest.skip("index_topk needs a device-wide fence: CUDA only")
    nh, di, n, c, s, dtype = case
    dt = getattr(mx, dtype)
    q, w, keys = index_problem(nh, di, n, c, s, seed=n + c + 1, cap=n + 77)
    qm, wm, km = (mx.array(a).astype(dt) for a in (q, w, keys))
    k, scale = 512, nh**-0.5 * di**-0.5
    for _ in range(3):
        got = sa._launch_index_topk(face, qm, wm, km, k, n, s, 4, scale)
        scores = sa.index_scores(qm, wm, km, n=n, s=s, ratio=4, scale=scale, backend=face, layout="heads")
        want = [scores, *sa.topk_select(scores, k, s=s, ratio=4, backend=face)]
        for name, g, v in zip(("scores", "idx", "cnt"), got, want):
            assert np.array_equal(np.array(g), np.array(v)), name
        assert selection_lists(got[1], got[2]) == topk64(np.array(got[0]), k, s, 4)
    assert not any(np.array(b).any() for b in dispatch.ticket_buffers("index_topk"))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kind", ["index_heads", "index_topk", "attend_rope", "attend_split", "attend_rows", "index_topk_rows"]
)
def test_gpu_first_use_self_tests_pass(kind):
    face = _gpu_face()
    assert sa._self_test(kind, face, make_rope(8, "yarn") if kind in ("attend_rope", "attend_rows") else None)
    if kind == "attend_rows":  # the batched step's rows: with the output rope (V4) and without
        assert sa._self_test(kind, face, None)


@pytest.mark.gpu
def test_gpu_tiny_models_kernels_on_vs_off(oracle_model, monkeypatch):
    """Whole tiny models on the GPU, prefill chunks of 16 and decode (chunk 1): kernels
    (hyper-connections and sparse attention) on, and DS4MLX_KERNELS=reference, both equal
    the float32 oracle within the parity bound.  Needs full float32 matmuls
    (MLX_ENABLE_TF32=0, which conftest sets): under TF32 (~1e-3 relative) an indexer
    near-tie can flip a top-k selection and move logits by ~1 in either run (H200,
    2026-11-30: plain 0.93, kernels 0.34 under TF32; both <= 4e-5 without)."""
    _gpu_face()
    if os.environ.get("MLX_ENABLE_TF32") != "0":
        pytest.skip("needs MLX_ENABLE_TF32=0 (TF32 noise flips indexer near-ties)")
    lm, ref = oracle_model
    ids = mx.array(ref["input_ids"].astype(np.int32))

    def run(chunk):
        cache = lm.model.make_cache()
        return np.concatenate(
            [np.array(lm.model(ids[:, i : i + chunk], cache)[0]) for i in range(0, ids.shape[1], chunk)]
        )

    want = ref["logits_full"][0]
    monkeypatch.setenv("DS4MLX_SPARSE_ATTENTION", "1")  # both modules: hyper-connections and sparse attention
    for chunk in (1, 16):
        monkeypatch.setenv("DS4MLX_KERNELS", "reference")
        err_plain = float(np.abs(run(chunk) - want).max())
        monkeypatch.delenv("DS4MLX_KERNELS")
        err_kern = float(np.abs(run(chunk) - want).max())
        assert err_kern <= 1e-4 and err_plain <= 1e-4, (chunk, err_kern, err_plain)


# ------------------------------------------------------------------ the CUDA face, compiled by nvcc (no GPU)


NVCC_DTYPES = ["float32", "bfloat16"]
NVCC_KINDS = [
    ("index_score", False, 1),
    ("index_score_heads", False, 1),
    ("topk", False, 1),
    ("index_topk", False, 1),
    ("attend", True, 1),
    ("attend", False, 1),
    ("attend", True, 4),
]


@pytest.mark.parametrize("dtype", NVCC_DTYPES)
@pytest.mark.parametrize("kind,selected,split", NVCC_KINDS)
@pytest.mark.slow_after(1)
def test_cuda_face_compiles_with_nvcc(kind, selected, split, dtype, tmp_path):
    """The exact CUDA translation unit mx.fast.cuda_kernel builds at V4 Flash shapes, compiled
    for sm_90 (H200) by nvcc with warnings as errors (the g++ emulation checks the logic)."""
    from test_kernel_emulation import nvcc_compile

    family = [_cuda_source(*case, d) for case in NVCC_KINDS for d in NVCC_DTYPES]
    nvcc_compile(tmp_path, _cuda_source(kind, selected, split, dtype), family=family)


def _cuda_source(kind, selected, split, dtype):
    from test_kernel_emulation import mlx_cuda_source

    f, i = "float32", "int32"
    h, b = sa.kernel_sources(kind, "cuda")
    if kind == "index_topk":
        ins = {"q": dtype, "w": dtype, "keys": dtype, "prm": f, "meta": i, "tickets": "uint32"}
        outs = {"scores": f, "idx": i, "cnt": i}
        tmpl = _index_topk_template(dtype)
    elif kind == "index_score_heads":
        ins, outs = {"q": dtype, "w": dtype, "keys": dtype, "prm": f, "meta": i}, {"scores": f}
        tmpl = [
            ("TQ", dtype),
            ("TW", dtype),
            ("TK", dtype),
            ("NH", 64),
            ("DI", 128),
            ("ROWS", 8),
            ("RATIO", 4),
            ("THREADS", sa.SCORE_SPLIT_THREADS),
        ]
    elif kind == "index_score":
        ins, outs = {"q": dtype, "w": dtype, "keys": dtype, "prm": f, "meta": i}, {"scores": f}
        tmpl = [
            ("TQ", dtype),
            ("TW", dtype),
            ("TK", dtype),
            ("NH", 64),
            ("DI", 128),
            ("HG", sa.SCORE_HEADS),
            ("RATIO", 4),
            ("THREADS", sa.SCORE_THREADS),
        ]
    elif kind == "topk":
        ins, outs = {"scores": f, "meta": i}, {"idx": i, "cnt": i}
        tmpl = [("TOPK", 512), ("RATIO", 4), ("THREADS", sa.TOPK_THREADS)]
    else:
        ins = {"q": dtype, "keys": dtype, "rows": dtype, "idx": i, "cnt": i, "sinks": dtype, "rope": f, "prm": f}
        ins["meta"], ins["tickets"] = i, "uint32"
        outs = {"o": dtype, "part": f}
        tmpl = _attend_template(dtype, selected, split)
    return mlx_cuda_source(kind, h, b, ins, outs, tmpl)


def _index_topk_template(dtype: str) -> list:
    """index_topk's template arguments at V4 Flash shapes (64 heads of 128, top 512)."""
    types = [("TQ", dtype), ("TW", dtype), ("TK", dtype)]
    return types + [("NH", 64), ("DI", 128), ("ROWS", 16), ("RATIO", 4), ("THREADS", sa.SCORE_SPLIT_THREADS), ("TOPK", 512)]  # fmt: skip


def _attend_template(dtype: str, selected: bool, split: int) -> list:
    """attend's template arguments at V4 Flash shapes (CSA when selected, else HCA)."""
    return [
        ("T", dtype),
        ("TK", dtype),
        ("TS", dtype),
        ("D", 512),
        ("W", 128),
        ("RATIO", 4 if selected else 128),
        ("TOPK", 512 if selected else 1),
        ("THREADS", sa.ATTN_THREADS),
        ("KB", sa.ATTN_KEYS),
        ("SELECTED", selected),
        ("RD", 64),
        ("SPLIT", split),
    ]


def test_index_topk_rows_cuda_face_compiles_with_nvcc(tmp_path):
    """index_topk_rows for 4 rows at V4 Flash shapes (bfloat16 query and keys), compiled by
    nvcc for sm_90 with warnings as errors."""
    from test_kernel_emulation import mlx_cuda_source, nvcc_compile

    dt, n = "bfloat16", 4
    kern = sa._topk_rows_kernel(n)
    h, b = kern.source("cuda")
    ins = {name: ("int32" if name.startswith("meta") else dt) for name in kern.input_names}
    ins.update(prm="float32", tickets="uint32")
    outs = {name: "float32" for name in kern.output_names}
    outs.update(idx_rows="int32", cnt_rows="int32")
    tmpl = _index_topk_template(dt)
    nvcc_compile(tmp_path, mlx_cuda_source(f"index_topk_rows{n}", h, b, ins, outs, tmpl))


@pytest.mark.parametrize("selected,split", [(True, 4), (False, 1)])
@pytest.mark.slow_after(1)
def test_attend_rows_cuda_face_compiles_with_nvcc(selected, split, tmp_path):
    """attend_rows for 4 rows at V4 Flash shapes (bfloat16), the translation unit
    mx.fast.cuda_kernel builds, compiled by nvcc for sm_90 with warnings as errors."""
    from test_kernel_emulation import mlx_cuda_source, nvcc_compile

    dt, n = "bfloat16", 4
    kern = sa._rows_kernel(n)
    h, b = kern.source("cuda")
    types = {"q": dt, "keys": dt, "rows": dt, "idx": "int32", "cnt": "int32", "meta": "int32"}
    ins = {name: types[name.rsplit("_", 1)[0]] for name in kern.input_names[: 6 * n]}
    ins.update(sinks=dt, rope="float32", prm="float32", tickets="uint32")
    tmpl = _attend_template(dt, selected, split) + [("HEADS", 64)]
    nvcc_compile(tmp_path, mlx_cuda_source(f"attend_rows{n}", h, b, ins, {"o_rows": dt, "part": "float32"}, tmpl))
