"""Fused hyper-connection kernels (ds4mlx/kernels/hyper_connection.py).

CPU: the reference face (`ds4mlx.kernels.hyper_connection_reference.hc_pre` / `hc_head` / `hc_post`)
against float64 math, and the shared GPU kernel text compiled with g++ (threadgroups
emulated, see test_kernel_emulation.py) against the same float64 math.
GPU (``-m gpu``): the CUDA / Metal face against the reference face run on the CPU.

Stated bounds (float32 math; K = n*d, mag_r = sum_k |fn_rk * y_k| with y the
RMS-normed streams):
  mix_r        |d| <= (K + 8) * 2**-23 * mag_r =: e_r     (two summation orders, norm
                                                            before / after the sum)
  pre_i        |d| <= |scale0| e_i / 4 + 2**-21            (sigmoid slope <= 1/4)
  post_i       |d| <= |scale1| e_i / 2 + 2**-21
  comb_ij      |d| <= 4 |scale2| max_r e_r + 2**-17        (Sinkhorn: relative input
               perturbation d moves entries (all <= 1) by <= ~2d; 2*iters normalisations
               of a few roundings each)
  collapsed_c  |d| <= sum_i |d pre_i| |x_ic| + (n+2) 2**-24 sum_i |pre_i x_ic|  (+1 ulp of T)
  hc_post      |d| <= 2**-p (|post_k out_c| + sum_j |comb_jk x_jc|) * 2   (p = 23 for
               float32, 8 for bfloat16: the same roundings as the reference graph,
               summation order aside)
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_kernel_emulation import run_on_cpu  # noqa: E402  (tests/ is on sys.path under pytest)

from ds4mlx.kernels import dispatch
from ds4mlx.kernels import hyper_connection as hck
from ds4mlx.kernels import hyper_connection_reference as reference

U = 2.0**-23


# exactness claims are about MLX's CPU kernels; `gpu` tests keep the default device
pytestmark = pytest.mark.usefixtures("cpu_unless_gpu_test")


# ------------------------------------------------------------------ float64 oracle and bounds


def make_inputs(n, d, lead, seed, head=False):
    rng = np.random.default_rng(seed)
    k = n * d
    m = n if head else (2 + n) * n
    x = rng.standard_normal((*lead, n, d)).astype(np.float32)
    fn = (rng.standard_normal((m, k)) * 2.0 / np.sqrt(k)).astype(np.float32)
    base = rng.standard_normal(m).astype(np.float32)
    scale = (np.array([0.7]) if head else np.array([0.7, 1.3, 2.5])).astype(np.float32)
    return x, fn, base, scale


def sinkhorn64(logits, iters, eps):
    z = logits - logits.max(axis=-1, keepdims=True)
    c = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True) + eps
    c = c / (c.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        c = c / (c.sum(axis=-2, keepdims=True) + eps)
    return c


def oracle(x, fn, base, scale, iters, hc_eps, norm_eps, head=False):
    """float64 (post, comb, collapsed) and the bounds of the module docstring."""
    n, d = x.shape[-2:]
    lead = x.shape[:-2]
    x64 = x.astype(np.float64)
    flat = x64.reshape(*lead, n * d)
    r = 1.0 / np.sqrt((flat**2).mean(axis=-1, keepdims=True) + norm_eps)
    y = flat * r
    fn64 = fn.astype(np.float64)
    mix = y @ fn64.T
    e = (n * d + 8) * U * (np.abs(y) @ np.abs(fn64).T)
    sig = lambda v: 1.0 / (1.0 + np.exp(-v))  # noqa: E731
    s = scale.astype(np.float64)
    b = base.astype(np.float64)
    pre = sig(mix[..., :n] * s[0] + b[:n]) + hc_eps
    e_pre = abs(s[0]) * e[..., :n] / 4 + 2.0**-21
    coll = (pre[..., None] * x64).sum(axis=-2)
    e_coll = (e_pre[..., None] * np.abs(x64)).sum(axis=-2) + (n + 2) * 2.0**-24 * (pre[..., None] * np.abs(x64)).sum(
        axis=-2
    )
    if head:
        return dict(collapsed=(coll, e_coll))
    pre_pair = (pre, e_pre)
    post = 2.0 * sig(mix[..., n : 2 * n] * s[1] + b[n : 2 * n])
    e_post = abs(s[1]) * e[..., n : 2 * n] / 2 + 2.0**-21
    logits = (mix[..., 2 * n :] * s[2] + b[2 * n :]).reshape(*lead, n, n)
    comb = sinkhorn64(logits, iters, hc_eps)
    e_comb = np.broadcast_to((4 * abs(s[2]) * e[..., 2 * n :].max(axis=-1) + 2.0**-17)[..., None, None], comb.shape)
    return dict(pre=pre_pair, post=(post, e_post), comb=(comb, e_comb), collapsed=(coll, e_coll))


def check(name, got, want, bound, extra=0.0):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = np.abs(got - want)
    lim = bound + extra
    assert np.all(err <= lim), (name, float(np.max(err / lim)))


def ulp(v, dtype):
    """One unit in the last place of |v| rounded to `dtype` (float32 / bfloat16)."""
    p = 23 if dtype == mx.float32 else 7
    return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(v), 1e-30))) - p)


CASES = [  # (n, d, lead, iters)
    (4, 64, (1, 1), 20),
    (3, 33, (1, 3), 20),
    (2, 7, (2,), 5),
    (4, 4096, (1, 1), 20),  # V4 Flash: hidden 4096, hc_mult 4, 20 iterations
    (4, 96, (1, 8), 1),  # one Sinkhorn iteration
]
HC_EPS, NORM_EPS = 1e-6, 1e-6
RMS_EPS = 1e-6  # the layer norm folded into hc_pre (NORM)


# ------------------------------------------------------------------ reference face vs float64


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: "n{}_d{}_lead{}_it{}".format(c[0], c[1], "x".join(map(str, c[2])), c[3])
)
def test_reference_hc_pre_matches_float64(case):
    n, d, lead, iters = case
    x, fn, base, scale = make_inputs(n, d, lead, seed=n * d)
    want = oracle(x, fn, base, scale, iters, HC_EPS, NORM_EPS)
    post, comb, coll = hck.hc_pre(
        mx.array(x),
        mx.array(fn),
        mx.array(base),
        mx.array(scale),
        sinkhorn_iters=iters,
        hc_eps=HC_EPS,
        norm_eps=NORM_EPS,
        backend="reference",
    )
    for name, got in (("post", post), ("comb", comb), ("collapsed", coll)):
        check(name, np.array(got), *want[name])


def test_reference_hc_mix_matches_float64():
    n, d, iters = 4, 48, 20
    x, fn, base, scale = make_inputs(n, d, (1, 2), seed=9)
    want = oracle(x, fn, base, scale, iters, HC_EPS, NORM_EPS)
    got = hck.hc_mix(
        mx.array(x),
        mx.array(fn),
        mx.array(base),
        mx.array(scale),
        sinkhorn_iters=iters,
        hc_eps=HC_EPS,
        norm_eps=NORM_EPS,
        backend="reference",
    )
    for name, g in zip(("pre", "post", "comb"), got):
        check(name, np.array(g), *want[name])


def test_reference_hc_head_and_post_match_float64():
    n, d = 3, 40
    x, fn, base, scale = make_inputs(n, d, (1, 4), seed=3, head=True)
    want = oracle(x, fn, base, scale, 0, HC_EPS, NORM_EPS, head=True)
    got = hck.hc_head(
        mx.array(x),
        mx.array(fn),
        mx.array(base),
        mx.array(scale),
        hc_eps=HC_EPS,
        norm_eps=NORM_EPS,
        backend="reference",
    )
    check("head", np.array(got), *want["collapsed"])
    rng = np.random.default_rng(4)
    out = rng.standard_normal((1, 4, d)).astype(np.float32)
    post = rng.random((1, 4, n)).astype(np.float32) * 2
    comb = rng.random((1, 4, n, n)).astype(np.float32)
    got = np.array(hck.hc_post(mx.array(x), mx.array(out), mx.array(post), mx.array(comb), backend="reference"))
    want, mag = post_oracle(x, out, post, comb)
    check("hc_post", got, want, 2 * U * mag)


def post_oracle(x, out, post, comb):
    x64, o64, p64, c64 = (a.astype(np.float64) for a in (x, out, post, comb))
    want = p64[..., None] * o64[..., None, :] + np.einsum("...jk,...jc->...kc", c64, x64)
    mag = np.abs(p64[..., None] * o64[..., None, :]) + np.einsum("...jk,...jc->...kc", np.abs(c64), np.abs(x64))
    return want, mag


# ------------------------------------------------------------------ dispatch, sources


def test_backend_reference_on_cpu_returns_layers_functions(monkeypatch):
    monkeypatch.delenv("DS4MLX_KERNELS", raising=False)
    assert dispatch.backend(mx.cpu) == "reference"
    x, fn, base, scale = (mx.array(a) for a in make_inputs(2, 16, (1, 2), seed=1))
    a = hck.hc_pre(x, fn, base, scale, sinkhorn_iters=3, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    b = reference.hc_pre(x, fn, base, scale, sinkhorn_iters=3, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    for u, v in zip(a, b):
        assert np.array_equal(np.array(u), np.array(v))


@pytest.mark.parametrize("kind", ["hc_pre", "hc_dots", "hc_post_dots", "hc_post"])
def test_metal_and_cuda_share_one_description(kind):
    sec = dispatch.sections(hck.SOURCE)
    mh, mb = hck.kernel_sources(kind, "metal")
    ch, cb = hck.kernel_sources(kind, "cuda")
    assert mh.endswith(sec["common"]) and ch.endswith(sec["common"])
    assert mb.endswith(sec[kind]) and cb.endswith(sec[kind])
    assert "thread_position_in_threadgroup" in mb and "threadIdx" in cb
    for word in ("device ", "threadgroup ", "simd_sum", "as_type", " uint ", "metal::"):
        assert word not in ch + cb, word


# ------------------------------------------------------------------ the shared GPU text, compiled for the CPU

EMU_CASES = [
    (4, 64, 2, 20, "pre", False),
    (3, 33, 3, 7, "pre", False),
    (2, 5, 1, 20, "pre", False),
    (4, 40, 2, 0, "head", False),
    (3, 50, 2, 20, "mix", False),
    # the decode split: hc_dots over threadgroups, then hc_pre adds the partial sums
    (4, 96, 2, 20, "pre", True),
    (3, 33, 3, 7, "pre", True),
    (4, 40, 2, 0, "head", True),
    (3, 50, 1, 20, "mix", True),
]


def run_dots_on_cpu(tmp_path, x, fn, n, d, nt, head, threads=32, per=2):
    """hc_dots through the emulation, launched as hyper_connection._pre_launch launches it."""
    sec = dispatch.sections(hck.SOURCE)
    m = n if head else (2 + n) * n
    parts = -(-(n * d) // (threads * per))
    (tmp_path / "dots").mkdir()
    got = run_on_cpu(
        tmp_path / "dots",
        sec["common"],
        sec["hc_dots"],
        inputs={"x": x, "fn": fn},
        outputs={"part": ((nt, parts, m + 1), np.float32)},
        consts={
            "T": np.float32,
            "TW": np.float32,
            "HC": n,
            "D": d,
            "THREADS": threads,
            "PER": per,
            "PARTS": parts,
            "HEAD": head,
        },
        groups=(parts, nt, 1),
        threads=threads,
    )
    return got["part"], parts


def run_pre_on_cpu(tmp_path, x, fn, base, scale, part, parts, *, iters=20, mode="pre", norm=None, threads=64):
    """hc_pre through the emulation (float32), launched as hyper_connection._pre_launch
    launches it; `norm` = the layer norm's weight (NORM, eps RMS_EPS) or None."""
    nt, n, d = x.shape
    head = mode == "head"
    outs = {
        "pre": ((1,) if head else (nt, n), np.float32),
        "post": ((1,) if head else (nt, n), np.float32),
        "comb": ((1,) if head else (nt, n, n), np.float32),
        "y": ((nt, d) if mode != "mix" else (1,), np.float32),
    }
    sec = dispatch.sections(hck.SOURCE)
    return run_on_cpu(
        tmp_path,
        sec["common"],
        sec["hc_pre"],
        inputs={
            "x": x,
            "fn": fn,
            "base": base,
            "scale": scale,
            "eps": np.array([HC_EPS, NORM_EPS, RMS_EPS if norm is not None else 0.0], np.float32),
            "part": part,
            "nw": norm if norm is not None else np.zeros(1, np.float32),
        },
        outputs=outs,
        consts={
            "T": np.float32,
            "TW": np.float32,
            "TB": np.float32,
            "TS": np.float32,
            "HC": n,
            "D": d,
            "THREADS": threads,
            "ITERS": max(iters, 1),
            "HEAD": head,
            "COLLAPSE": mode != "mix",
            "PARTS": parts,
            "NORM": norm is not None,
        },
        groups=(nt, 1, 1),
        threads=threads,
    )


@pytest.mark.parametrize("case", EMU_CASES, ids=lambda c: "n{}_d{}_t{}_it{}_{}_split{}".format(*c))
def test_shared_hc_pre_text_compiled_for_cpu(case, tmp_path):
    n, d, nt, iters, mode, split = case
    head = mode == "head"
    x, fn, base, scale = make_inputs(n, d, (nt,), seed=11 + n, head=head)
    part, parts = run_dots_on_cpu(tmp_path, x, fn, n, d, nt, head) if split else (np.zeros(1, np.float32), 0)
    got = run_pre_on_cpu(tmp_path, x, fn, base, scale, part, parts, iters=iters, mode=mode)
    want = oracle(x, fn, base, scale, iters, HC_EPS, NORM_EPS, head=head)
    if mode != "mix":
        check("collapsed", got["y"], *want["collapsed"])
    else:
        assert np.isnan(got["y"]).all()  # the dummy is never written
    if not head:
        for name in ("pre", "post", "comb"):
            check(name, got[name], *want[name])


def rms_normed(y, w, eps=RMS_EPS):
    """numpy RMSNorm of the collapsed rows (float64)."""
    y = np.asarray(y, np.float64)
    return y / np.sqrt((y * y).mean(axis=-1, keepdims=True) + eps) * np.asarray(w, np.float64)


@pytest.mark.parametrize("n,d,nt,split", [(4, 64, 1, False), (3, 100, 2, True), (4, 257, 1, True)])
def test_shared_hc_pre_text_with_the_folded_norm(n, d, nt, split, tmp_path):
    """NORM: the kernel's collapsed output is RMS-normed with the layer norm's weight,
    equal to normalising the unnormed kernel output (same text, NORM off) in float64."""
    x, fn, base, scale = make_inputs(n, d, (nt,), seed=23 + n)
    w = 1.0 + 0.25 * np.random.default_rng(5).standard_normal(d).astype(np.float32)
    part, parts = run_dots_on_cpu(tmp_path, x, fn, n, d, nt, False) if split else (np.zeros(1, np.float32), 0)
    got = {}
    for norm in (False, True):
        (tmp_path / str(norm)).mkdir()
        got[norm] = run_pre_on_cpu(tmp_path / str(norm), x, fn, base, scale, part, parts, norm=w if norm else None)
    want = rms_normed(got[False]["y"], w)
    np.testing.assert_allclose(got[True]["y"], want, rtol=2e-6, atol=2e-6)
    for name in ("pre", "post", "comb"):  # the norm changes nothing else
        np.testing.assert_array_equal(got[True][name], got[False][name])


def test_reference_face_folded_norm_is_the_layer_norm():
    """hc_pre / hc_post_pre with `norm` on the reference face: exactly RMSNorm(collapsed)."""
    from ds4mlx.models.layers import RMSNorm

    x, fn, base, scale = (mx.array(a) for a in make_inputs(4, 64, (1, 1), seed=3))
    out = mx.random.normal((1, 1, 64), key=mx.random.key(1))
    norm = RMSNorm(64, RMS_EPS)
    norm.weight = 1.0 + 0.1 * mx.random.normal((64,), key=mx.random.key(2))
    kw = dict(sinkhorn_iters=20, hc_eps=HC_EPS, norm_eps=NORM_EPS, backend="reference")
    post, comb, y = hck.hc_pre(x, fn, base, scale, **kw)
    got = hck.hc_pre(x, fn, base, scale, **kw, norm=(norm.weight, norm.eps))
    assert mx.array_equal(got[2], norm(y)) and mx.array_equal(got[0], post)
    a = hck.hc_post_pre(x, out, post, comb, fn, base, scale, **kw)
    b = hck.hc_post_pre(x, out, post, comb, fn, base, scale, **kw, norm=(norm.weight, norm.eps))
    assert mx.array_equal(b[3], norm(a[3])) and mx.array_equal(b[0], a[0])
    out2 = mx.random.normal((1, 1, 64), key=mx.random.key(3))  # an MoE's second half, added first
    got = hck.hc_post(x, out, post, comb, out2=out2, backend="reference")
    assert mx.array_equal(got, hck.hc_post(x, out + out2, post, comb, backend="reference"))
    c = hck.hc_post_pre(x, out, post, comb, fn, base, scale, **kw, out2=out2)
    d = hck.hc_post_pre(x, out + out2, post, comb, fn, base, scale, **kw)
    assert all(mx.array_equal(u, v) for u, v in zip(c, d))


@pytest.mark.parametrize("n,d,nt,add2", [(4, 48, 2, False), (3, 50, 1, False), (4, 48, 2, True)])
def test_shared_hc_post_dots_then_pre_compiled_for_cpu(n, d, nt, add2, tmp_path):
    """hc_post_dots (the new streams and their partial projection in one pass) then hc_pre
    on its partial sums: hc_post's rounding and hc_pre's results of those streams."""
    rng = np.random.default_rng(n * d)
    x, fn, base, scale = make_inputs(n, d, (nt,), seed=3 + n)
    out = rng.standard_normal((nt, d)).astype(np.float32)
    post = (rng.random((nt, n)) * 2).astype(np.float32)
    comb = rng.random((nt, n, n)).astype(np.float32)
    out2 = rng.standard_normal((nt, d)).astype(np.float32)  # ADD2: the site's output is out + out2
    sec = dispatch.sections(hck.SOURCE)
    threads, per = 32, 2
    m = (2 + n) * n
    parts = -(-(n * d) // (threads * per))
    (tmp_path / "pd").mkdir()
    got = run_on_cpu(
        tmp_path / "pd",
        sec["common"],
        sec["hc_post_dots"],
        inputs={"x": x, "o": out, "post": post, "comb": comb, "fn": fn, "o2": out2},
        outputs={"y": ((nt, n, d), np.float32), "part": ((nt, parts, m + 1), np.float32)},
        consts={
            "T": np.float32,
            "TP": np.float32,
            "TC": np.float32,
            "TW": np.float32,
            "HC": n,
            "D": d,
            "THREADS": threads,
            "PER": per,
            "PARTS": parts,
            "ADD2": add2,
        },
        groups=(parts, nt, 1),
        threads=threads,
    )
    want_y, mag = post_oracle(x, out + out2 if add2 else out, post, comb)
    check("hc_post_dots y", got["y"], want_y, 2 * U * mag)
    y = got["y"]
    (tmp_path / "pre").mkdir()
    pre = run_pre_on_cpu(tmp_path / "pre", y, fn, base, scale, got["part"], parts)
    want = oracle(y, fn, base, scale, 20, HC_EPS, NORM_EPS)
    check("collapsed", pre["y"], *want["collapsed"])
    for name in ("pre", "post", "comb"):
        check(name, pre[name], *want[name])


def test_reference_hc_post_pre_is_post_then_pre():
    x, fn, base, scale = (mx.array(a) for a in make_inputs(4, 16, (1, 2), seed=4))
    out = mx.random.normal((1, 2, 16), key=mx.random.key(1))
    post, comb, _ = hck.hc_pre(x, fn, base, scale, sinkhorn_iters=20, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    got = hck.hc_post_pre(x, out, post, comb, fn, base, scale, sinkhorn_iters=20, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    y = hck.hc_post(x, out, post, comb)
    want = (y, *hck.hc_pre(y, fn, base, scale, sinkhorn_iters=20, hc_eps=HC_EPS, norm_eps=NORM_EPS))
    assert all(mx.array_equal(g, w).item() for g, w in zip(got, want))


@pytest.mark.parametrize("add2", [False, True])
def test_shared_hc_post_text_compiled_for_cpu(add2, tmp_path):
    n, d, nt = 3, 70, 2
    rng = np.random.default_rng(5)
    x = rng.standard_normal((nt, n, d)).astype(np.float32)
    out = rng.standard_normal((nt, d)).astype(np.float32)
    out2 = rng.standard_normal((nt, d)).astype(np.float32)
    post = (rng.random((nt, n)) * 2).astype(np.float32)
    comb = rng.random((nt, n, n)).astype(np.float32)
    sec = dispatch.sections(hck.SOURCE)
    threads = 32
    got = run_on_cpu(
        tmp_path,
        sec["common"],
        sec["hc_post"],
        inputs={"x": x, "o": out, "post": post, "comb": comb, "o2": out2},
        outputs={"y": ((nt, n, d), np.float32)},
        consts={
            "T": np.float32,
            "TP": np.float32,
            "TC": np.float32,
            "HC": n,
            "D": d,
            "THREADS": threads,
            "ADD2": add2,
        },
        groups=(-(-d // threads), n, nt),
        threads=threads,
    )
    want, mag = post_oracle(x, out + out2 if add2 else out, post, comb)
    check("hc_post", got["y"], want, 2 * U * mag)


# ------------------------------------------------------------------ GPU faces


def _gpu_face():
    face = dispatch.gpu_backend()
    if face is None:
        pytest.skip("no MLX GPU backend")
    return face


GPU_CASES = [  # (n, d, T, iters, x dtype, fn dtype)
    (4, 4096, 1, 20, "bfloat16", "bfloat16"),  # V4 Flash decode (synthetic model: bf16 fn)
    (4, 4096, 1, 20, "float32", "float32"),
    (4, 4096, 8, 20, "bfloat16", "float32"),
    (4, 4096, 512, 20, "bfloat16", "bfloat16"),  # a prefill chunk
    (3, 4095, 5, 20, "float32", "float32"),  # odd sizes
    (2, 1000, 7, 20, "float32", "bfloat16"),
    (4, 64, 2, 1, "float32", "float32"),
    (5, 33, 3, 9, "float32", "float32"),  # the largest n the kernel takes
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "n{}_d{}_T{}_it{}_{}_{}".format(*c))
def test_gpu_hc_pre_equals_reference(case):
    face = _gpu_face()
    n, d, nt, iters, xdt, wdt = case
    xdt, wdt = getattr(mx, xdt), getattr(mx, wdt)
    x, fn, base, scale = make_inputs(n, d, (1, nt), seed=nt + n)
    xm, fm = mx.array(x).astype(xdt), mx.array(fn).astype(wdt)
    x32, f32 = np.array(xm.astype(mx.float32)), np.array(fm.astype(mx.float32))
    want = oracle(x32, f32, base, scale, iters, HC_EPS, NORM_EPS)
    with mx.stream(mx.cpu):
        ref = hck.hc_pre(
            xm,
            fm,
            mx.array(base),
            mx.array(scale),
            sinkhorn_iters=iters,
            hc_eps=HC_EPS,
            norm_eps=NORM_EPS,
            backend="reference",
        )
        ref = [np.array(r.astype(mx.float32)) for r in ref]
    got = hck.hc_pre(
        xm, fm, mx.array(base), mx.array(scale), sinkhorn_iters=iters, hc_eps=HC_EPS, norm_eps=NORM_EPS, backend=face
    )
    assert got[2].dtype == xdt and got[0].dtype == mx.float32 and got[1].dtype == mx.float32
    got = [np.array(g.astype(mx.float32)) for g in got]
    for i, name in enumerate(("post", "comb", "collapsed")):
        val, bound = want[name]
        extra = ulp(val, xdt) if name == "collapsed" else 0.0
        # kernel and reference each within the bound of the float64 value: within twice of each other
        check(name, got[i], ref[i].astype(np.float64), 2 * bound, 2 * extra)
        check(name + " (vs float64)", got[i], val, bound, extra)


@pytest.mark.gpu
@pytest.mark.parametrize("n,d,nt", [(4, 4096, 1), (4, 4096, 512), (3, 100, 6)])
def test_gpu_hc_mix_equals_reference(n, d, nt):
    face = _gpu_face()
    x, fn, base, scale = make_inputs(n, d, (1, nt), seed=8)
    want = oracle(x, fn, base, scale, 20, HC_EPS, NORM_EPS)
    got = hck.hc_mix(
        mx.array(x),
        mx.array(fn),
        mx.array(base),
        mx.array(scale),
        sinkhorn_iters=20,
        hc_eps=HC_EPS,
        norm_eps=NORM_EPS,
        backend=face,
    )
    for name, g in zip(("pre", "post", "comb"), got):
        check(name, np.array(g), *want[name])


@pytest.mark.gpu
@pytest.mark.parametrize("n,d,nt", [(4, 4096, 1), (3, 100, 6)])
def test_gpu_hc_head_equals_reference(n, d, nt):
    face = _gpu_face()
    x, fn, base, scale = make_inputs(n, d, (1, nt), seed=7, head=True)
    want, bound = oracle(x, fn, base, scale, 0, HC_EPS, NORM_EPS, head=True)["collapsed"]
    got = hck.hc_head(
        mx.array(x), mx.array(fn), mx.array(base), mx.array(scale), hc_eps=HC_EPS, norm_eps=NORM_EPS, backend=face
    )
    check("head", np.array(got), want, bound)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n,d,nt", [(4, 4096, 1), (4, 4096, 8), (3, 4095, 3), (2, 17, 2)])
def test_gpu_hc_post_equals_reference(dtype, n, d, nt):
    face = _gpu_face()
    dt = getattr(mx, dtype)
    rng = np.random.default_rng(n * d + nt)
    x = mx.array(rng.standard_normal((1, nt, n, d)).astype(np.float32)).astype(dt)
    out = mx.array(rng.standard_normal((1, nt, d)).astype(np.float32)).astype(dt)
    post = mx.array((rng.random((1, nt, n)) * 2).astype(np.float32))
    comb = mx.array(rng.random((1, nt, n, n)).astype(np.float32))
    with mx.stream(mx.cpu):
        ref = np.array(hck.hc_post(x, out, post, comb, backend="reference").astype(mx.float32))
    got = hck.hc_post(x, out, post, comb, backend=face)
    assert got.dtype == dt and got.shape == x.shape
    got = np.array(got.astype(mx.float32))
    _, mag = post_oracle(
        np.array(x.astype(mx.float32)),
        np.array(out.astype(mx.float32)),
        np.array(post.astype(dt).astype(mx.float32)),
        np.array(comb.astype(dt).astype(mx.float32)),
    )
    p = 23 if dt == mx.float32 else 8
    check("hc_post", got, ref.astype(np.float64), 2 * 2.0**-p * (mag + np.abs(ref)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_hc_post_pre_equals_reference(dtype):
    face = _gpu_face()
    dt = getattr(mx, dtype)
    assert hck._post_pre_self_test(face)
    x, fn, base, scale = (mx.array(a) for a in make_inputs(4, 4096, (1, 1), seed=9))
    x, out = x.astype(dt), mx.random.normal((1, 1, 4096), key=mx.random.key(2)).astype(dt)
    post, comb, _ = hck.hc_pre(
        x, fn, base, scale, sinkhorn_iters=20, hc_eps=HC_EPS, norm_eps=NORM_EPS, backend="reference"
    )
    kw = dict(sinkhorn_iters=20, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    got = hck.hc_post_pre(x, out, post, comb, fn, base, scale, **kw, backend=face)
    y = hck.hc_post(x, out, post, comb, backend="reference")
    want = (y, *hck.hc_pre(y, fn, base, scale, **kw, backend="reference"))
    tol = 1e-4 if dt == mx.float32 else 2e-2
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert mx.allclose(g.astype(mx.float32), w.astype(mx.float32), rtol=tol, atol=tol).item()


# ------------------------------------------------------------------ the CUDA face, compiled by nvcc (no GPU)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "kind,mode",
    [
        ("hc_pre", "pre"),
        ("hc_pre", "head"),
        ("hc_pre", "mix"),
        ("hc_post", ""),
        ("hc_dots", "pre"),
        ("hc_dots", "head"),
        ("hc_post_dots", ""),
    ],
)
def test_cuda_face_compiles_with_nvcc(kind, mode, dtype, tmp_path):
    """The exact CUDA translation unit mx.fast.cuda_kernel builds, compiled for sm_90 (H200)
    by nvcc with warnings as errors (syntax and types; the g++ emulation checks the logic)."""
    from test_kernel_emulation import mlx_cuda_source, nvcc_compile

    f = "float32"
    h, b = hck.kernel_sources(kind, "cuda")
    if kind == "hc_pre":
        ins = {"x": dtype, "fn": dtype, "base": f, "scale": f, "eps": f, "part": f, "nw": dtype}
        outs = {"pre": f, "post": f, "comb": f, "y": dtype}
        tmpl = [
            ("T", dtype),
            ("TW", dtype),
            ("TB", f),
            ("TS", f),
            ("HC", 4),
            ("D", 4096),
            ("THREADS", hck.PRE_THREADS),
            ("ITERS", 20),
            ("HEAD", mode == "head"),
            ("COLLAPSE", mode != "mix"),
            ("PARTS", 32 if mode == "pre" else 0),
            ("NORM", mode == "pre"),
        ]
    elif kind == "hc_post_dots":
        ins, outs = {"x": dtype, "o": dtype, "post": f, "comb": f, "fn": dtype, "o2": dtype}, {"y": dtype, "part": f}
        tmpl = [
            ("T", dtype),
            ("TP", f),
            ("TC", f),
            ("TW", dtype),
            ("HC", 4),
            ("D", 4096),
            ("THREADS", hck.DOTS_THREADS),
            ("PER", hck.DOTS_PER),
            ("PARTS", 32),
            ("ADD2", True),
        ]
    elif kind == "hc_dots":
        ins, outs = {"x": dtype, "fn": dtype}, {"part": f}
        tmpl = [
            ("T", dtype),
            ("TW", dtype),
            ("HC", 4),
            ("D", 4096),
            ("THREADS", hck.DOTS_THREADS),
            ("PER", hck.DOTS_PER),
            ("PARTS", 32),
            ("HEAD", mode == "head"),
        ]
    else:
        ins, outs = {"x": dtype, "o": dtype, "post": f, "comb": f, "o2": dtype}, {"y": dtype}
        tmpl = [("T", dtype), ("TP", f), ("TC", f), ("HC", 4), ("D", 4096), ("THREADS", hck.POST_THREADS)]
        tmpl.append(("ADD2", True))
    nvcc_compile(tmp_path, mlx_cuda_source(kind, h, b, ins, outs, tmpl))


@pytest.mark.gpu
@pytest.mark.parametrize("xdt", ["float32", "bfloat16"])
def test_gpu_folded_norm_equals_reference(xdt):
    """hc_pre / hc_post_pre with the folded RMSNorm: GPU face vs the reference face
    (reference hc_pre, then mx.fast.rms_norm), V4 Flash decode shapes."""
    face = _gpu_face()
    dt = getattr(mx, xdt)
    x, fn, base, scale = (mx.array(a) for a in make_inputs(4, 4096, (1, 1), seed=9))
    x, fn = x.astype(dt), fn.astype(mx.bfloat16)
    out = (mx.random.normal((1, 1, 4096), key=mx.random.key(4)) * 0.5).astype(dt)
    w = 1.0 + 0.1 * mx.random.normal((4096,), key=mx.random.key(8))
    kw = dict(sinkhorn_iters=20, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    tol = 1e-3 if dt == mx.float32 else 3e-2
    for fun, args in ((hck.hc_pre, (x, fn, base, scale)), (hck.hc_post_pre, None)):
        if args is None:
            post, comb, _ = hck.hc_pre(x, fn, base, scale, **kw, backend="reference")
            args = (x, out, post, comb, fn, base, scale)
        got = fun(*args, **kw, backend=face, norm=(w, RMS_EPS))[-1]
        with mx.stream(mx.cpu):
            want = fun(*args, **kw, backend="reference", norm=(w, RMS_EPS))[-1]
        assert got.dtype == dt
        np.testing.assert_allclose(
            np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), rtol=tol, atol=tol
        )
    out2 = (mx.random.normal((1, 1, 4096), key=mx.random.key(5)) * 0.5).astype(dt)  # ADD2
    post, comb, _ = hck.hc_pre(x, fn, base, scale, **kw, backend="reference")
    got = [hck.hc_post(x, out, post, comb, backend=face, out2=out2)]
    got.append(hck.hc_post_pre(x, out, post, comb, fn, base, scale, **kw, backend=face, out2=out2)[0])
    with mx.stream(mx.cpu):
        want = hck.hc_post(x, out + out2, post, comb, backend="reference")
    for g in got:
        np.testing.assert_allclose(
            np.array(g.astype(mx.float32)), np.array(want.astype(mx.float32)), rtol=tol, atol=tol
        )
