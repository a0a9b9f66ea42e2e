"""Fused hyper-connection kernels (ds4mlx/kernels/hyper_connection.py).

CPU: the reference face (`ds4mlx.kernels.hyper_connection_reference.hc_pre` / `hc_head` / `hc_post`)
against float64 math, and the shared GPU kernel text compiled with g++ (threadgroups
emulated, see test_kernel_emulation.py) against the same float64 math.
The decode tails (hc_dots_pre / hc_post_dots_pre: the split projection and hc_pre's work in
one launch) through the emulation: bit for bit the two-launch path, near the reference
face, tickets zeroed; the tiny V4 models' compiled decode through stand-in launches.
GPU (``-m gpu``): the CUDA / Metal face against the reference face run on the CPU; the
tails bit for bit the two launches.

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

import itertools
import os
import re

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


def _body(kind):
    """The shared text of a kernel of hyper_connection._KINDS: its sections in order."""
    sec = dispatch.sections(hck.SOURCE)
    return "".join(sec[s] for s in hck._KINDS[kind][0])


@pytest.mark.parametrize("kind", list(hck._KINDS))
def test_metal_and_cuda_share_one_description(kind):
    sec = dispatch.sections(hck.SOURCE)
    mh, mb = hck.kernel_sources(kind, "metal")
    ch, cb = hck.kernel_sources(kind, "cuda")
    assert mh.endswith(sec["common"]) and ch.endswith(sec["common"])
    assert mb.endswith(_body(kind)) and cb.endswith(_body(kind))
    assert "thread_position_in_threadgroup" in mb and "threadIdx" in cb
    cuda = re.sub(r"#if defined\(__METAL_VERSION__\).*?#elif", "", ch + cb, flags=re.S)  # (Metal's branch)
    for word in ("device ", "threadgroup ", "simd_sum", "as_type", " uint ", "metal::"):
        assert word not in cuda, word


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
        _body("hc_pre"),
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
@pytest.mark.slow_after(1)
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
@pytest.mark.slow_after(1)
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
@pytest.mark.slow_after(1)
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
@pytest.mark.slow_after(1)
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


# ------------------------------------------------------------------ the decode split in one launch (the tails)


def _bf16(a):
    """float32 values -> their bfloat16 bits (uint16, the emulation's ds4_bf16)."""
    return np.array(mx.array(np.asarray(a, np.float32)).astype(mx.bfloat16).view(mx.uint16))


def _values(a):
    """An emulation output as float32 (bfloat16 bits decoded)."""
    a = np.asarray(a)
    return np.array(mx.array(a).view(mx.bfloat16).astype(mx.float32)) if a.dtype == np.uint16 else a


def _emulate(tmp_path, kind, inputs, outputs, consts, groups, threads, inout=()):
    (tmp_path / kind).mkdir()
    sec = dispatch.sections(hck.SOURCE)
    return run_on_cpu(
        tmp_path / kind,
        sec["common"],
        _body(kind),
        inputs=inputs,
        outputs=outputs,
        consts=consts,
        groups=groups,
        threads=threads,
        inout=inout,
    )


def run_site_on_cpu(tmp_path, site, *, tail, threads, vt, per=2):
    """One decode mHC site through the emulation, launched as hyper_connection launches it:
    `tail` = hc_dots_pre / hc_post_dots_pre (one launch, `threads` threads, hc_pre's order of
    `vt` threads), else today's two (hc_dots / hc_post_dots on `threads`, then hc_pre on
    `vt`).  -> outputs by name ("y": the new streams, "c": the collapsed vector, "pre",
    "post", "comb", "part"; "tickets": the ticket buffer after the launch)."""
    x, fn, base, scale, mode, w, prev = (site[k] for k in ("x", "fn", "base", "scale", "mode", "w", "prev"))
    nt, n, d = x.shape
    head = mode == "head"
    m = n if head else (2 + n) * n
    parts = -(-(n * d) // (threads * per))
    t = np.uint16 if x.dtype == np.uint16 else np.float32
    f32 = np.float32
    eps = np.array([HC_EPS, NORM_EPS, RMS_EPS if w is not None else 0.0], f32)
    core_in = {"base": base, "scale": scale, "eps": eps, "nw": w if w is not None else np.zeros(1, f32)}
    core_c = {"TB": f32, "TS": f32, "ITERS": 20, "HEAD": head, "COLLAPSE": mode != "mix", "NORM": w is not None}
    small = [((1,) if head else s, f32) for s in ((nt, n), (nt, n), (nt, n, n))]
    coll = ((nt, d) if mode != "mix" else (1,), t)
    dots_c = {"T": t, "TW": fn.dtype.type, "HC": n, "D": d, "THREADS": threads, "PER": per, "PARTS": parts}
    grid = (parts, nt, 1)
    part = ((nt, parts, m + 1), f32)
    if prev is not None:  # hc_post of the previous site first: prev = (out, post, comb, out2 or None)
        out, post, comb, out2 = prev
        post_in = {"x": x, "o": out, "post": post, "comb": comb, "fn": fn, "o2": out2 if out2 is not None else out}
        dots_c.update(TP=f32, TC=f32, ADD2=out2 is not None)
    if tail:
        tickets = np.zeros(nt + 3, np.uint32)
        consts = {**dots_c, **core_c, "VT": vt}
        if prev is None:
            got = _emulate(
                tmp_path,
                "hc_dots_pre",
                {"x": x, "fn": fn, **core_in, "tickets": tickets},
                dict(zip(["part", "pre", "post", "comb", "y"], [part, *small, coll])),
                consts,
                grid,
                threads,
                inout=("tickets",),
            )
            got["c"] = got.pop("y")
            return got
        got = _emulate(
            tmp_path,
            "hc_post_dots_pre",
            {**post_in, **core_in, "tickets": tickets},
            dict(zip(["y", "part", "pre", "post2", "comb2", "h"], [((nt, n, d), t), part, *small, coll])),
            consts,
            grid,
            threads,
            inout=("tickets",),
        )
        for a, b in (("post2", "post"), ("comb2", "comb"), ("h", "c")):
            got[b] = got.pop(a)
        return got
    if prev is None:
        first = _emulate(
            tmp_path, "hc_dots", {"x": x, "fn": fn}, {"part": part}, {**dots_c, "HEAD": head}, grid, threads
        )
    else:
        first = _emulate(tmp_path, "hc_post_dots", post_in, {"y": ((nt, n, d), t), "part": part}, dots_c, grid, threads)
        x = first["y"]
    got = _emulate(
        tmp_path,
        "hc_pre",
        {"x": x, "fn": fn, **core_in, "part": first["part"]},
        dict(zip(["pre", "post", "comb", "y"], [*small, coll])),
        {"T": t, "TW": fn.dtype.type, "HC": n, "D": d, "THREADS": vt, "PARTS": parts, **core_c},
        (nt, 1, 1),
        vt,
    )
    got["c"] = got.pop("y")
    return {**first, **got}


TAIL_CASES = [  # (n, d, tokens, dtype, mode, folded norm, ADD2, after hc_post)
    (4, 4096, 1, "float32", "pre", True, True, True),  # V4 Flash decode: hc_post_pre, both folds
    (4, 4096, 1, "bfloat16", "pre", True, False, False),  # ... a plain hc_pre (the first site)
    (4, 4096, 2, "bfloat16", "pre", True, True, True),
    (3, 100, 3, "float32", "pre", False, False, True),  # odd sizes
    (2, 37, 2, "bfloat16", "pre", False, True, True),
    (5, 33, 2, "float32", "pre", True, False, False),  # the largest n (M + 1 = 36 > 32 threads)
    (4, 40, 2, "float32", "head", False, False, False),  # hc_head
    (3, 50, 1, "bfloat16", "mix", False, False, False),  # hc_mix (V4.1)
]


def tail_site(case, seed=0):
    """(numpy inputs of the emulation, the same as MLX arrays for the reference face)."""
    n, d, nt, dtype, mode, norm, add2, post = case
    rng = np.random.default_rng(seed + n * d + nt)
    x, fn, base, scale = make_inputs(n, d, (nt,), seed=seed + n + d, head=mode == "head")
    w = (1.0 + 0.25 * rng.standard_normal(d)).astype(np.float32) if norm else None
    prev = None
    if post:
        out, out2 = (rng.standard_normal((nt, d)).astype(np.float32) for _ in range(2))
        p = (rng.random((nt, n)) * 2).astype(np.float32)
        c = rng.random((nt, n, n)).astype(np.float32)
        prev = (out, p, c, out2 if add2 else None)
    bf = dtype == "bfloat16"
    cast = (lambda a: a if a is None else _bf16(a)) if bf else (lambda a: a)
    emu = dict(x=cast(x), fn=cast(fn), base=base, scale=scale, mode=mode, w=cast(w))
    emu["prev"] = None if prev is None else (cast(prev[0]), prev[1], prev[2], cast(prev[3]))
    dt = getattr(mx, dtype)
    arr = {k: (None if v is None else mx.array(v).astype(dt)) for k, v in (("x", x), ("fn", fn), ("w", w))}
    arr.update(base=mx.array(base), scale=mx.array(scale), mode=mode)
    arr["prev"] = (
        None
        if prev is None
        else (
            mx.array(prev[0]).astype(dt),
            mx.array(prev[1]),
            mx.array(prev[2]),
            None if prev[3] is None else mx.array(prev[3]).astype(dt),
        )
    )
    return emu, arr


def reference_site(a):
    """The site on the reference face -> {"y" (post_pre), "pre" (mix), "post", "comb", "c"}."""
    kw = dict(sinkhorn_iters=20, hc_eps=HC_EPS, norm_eps=NORM_EPS, backend="reference")
    norm = None if a["w"] is None else (a["w"], RMS_EPS)
    x, fn, base, scale = a["x"], a["fn"], a["base"], a["scale"]
    if a["mode"] == "head":
        return {"c": hck.hc_head(x, fn, base, scale, hc_eps=HC_EPS, norm_eps=NORM_EPS, backend="reference")}
    if a["mode"] == "mix":
        return dict(zip(("pre", "post", "comb"), hck.hc_mix(x, fn, base, scale, **kw)))
    if a["prev"] is None:
        return dict(zip(("post", "comb", "c"), hck.hc_pre(x, fn, base, scale, **kw, norm=norm)))
    out, post, comb, out2 = a["prev"]
    got = hck.hc_post_pre(x, out, post, comb, fn, base, scale, **kw, norm=norm, out2=out2)
    return dict(zip(("y", "post", "comb", "c"), got))


@pytest.mark.parametrize("case", TAIL_CASES, ids=lambda c: "n{}_d{}_t{}_{}_{}_norm{}_add2{}_post{}".format(*c))
@pytest.mark.slow_after(1)
def test_shared_tail_text_equals_two_launches_and_reference(case, tmp_path):
    """hc_dots_pre / hc_post_dots_pre through the emulation: every output bit for bit the
    two-launch path's (hc_dots / hc_post_dots, then hc_pre with vt threads), within the
    self-tests' tolerance of the reference face; the tickets are zero again afterwards."""
    emu, arr = tail_site(case)
    n = case[0]
    threads = 64 if (2 + n) * n + 1 > 32 else 32
    vt = 4 * threads if case[1] >= 4096 else 2 * threads  # hc_pre's 512 = 2 x 256: NV > 1 either way
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = run_site_on_cpu(tmp_path / "one", emu, tail=True, threads=threads, vt=vt)
    two = run_site_on_cpu(tmp_path / "two", emu, tail=False, threads=threads, vt=vt)
    assert not one.pop("tickets").any()
    assert one.keys() == two.keys()
    for k in one:
        np.testing.assert_array_equal(one[k], two[k], err_msg=k)
    tol = 1e-4 if case[3] == "float32" else 2e-2
    for k, want in reference_site(arr).items():
        got = _values(one[k])
        want = np.array(want.astype(mx.float32))
        assert got.shape == want.shape, k
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=k)


# ------------------------------------------------------------------ the compiled decode step through the tails


class StandInKernels:
    """`hyper_connection._kernel(kind)` for a faked GPU face: each launch's outputs computed by
    the reference face from the very inputs and template the launch passes (by the kernel's
    input names), so the CPU runs the models' compiled step through the GPU path's plumbing.
    The split's separate launches (hc_dots, hc_post_dots) must not come: the tails replace them."""

    def __init__(self):
        self.calls = {}

    def __call__(self, kind):
        def launch(face, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            self.calls[kind] = self.calls.get(kind, 0) + 1
            a, t = dict(zip(hck._KINDS[kind][1], inputs)), dict(template)
            x = a["x"]  # [..., n, d]: the launches read rows flat and keep the caller's shape
            n, d = x.shape[-2], x.shape[-1]
            nt = x.size // (n * d)
            assert t["T"] == x.dtype and t["HC"] == n and t["D"] == d
            if kind in ("hc_dots_pre", "hc_post_dots_pre"):
                parts = -(-(n * d) // (hck.DOTS_THREADS * hck.DOTS_PER))
                assert t["PARTS"] == parts and t["VT"] == hck.PRE_THREADS and t["THREADS"] == hck.DOTS_THREADS
                assert grid == (parts * hck.DOTS_THREADS, nt, 1) and threadgroup == (hck.DOTS_THREADS, 1, 1)
                assert any(a["tickets"] is b for b in dispatch.ticket_buffers(hck.TICKETS))
            else:
                assert kind in ("hc_pre", "hc_post") and t.get("PARTS", 0) == 0, kind
            if kind in ("hc_post", "hc_post_dots_pre"):
                o = a["o"] + a["o2"] if t["ADD2"] else a["o"]
                x = reference.hc_post(x, o, a["post"], a["comb"])
                if kind == "hc_post":
                    return [x]
            eps = [float(v) for v in a["eps"].tolist()]
            kw = dict(hc_eps=eps[0], norm_eps=eps[1])
            dummy = [mx.zeros(s, dt) for s, dt in zip(output_shapes[-4:], output_dtypes[-4:])]
            if t["HEAD"]:
                site = [*dummy[:3], reference.hc_head(x, a["fn"], a["base"], a["scale"], **kw)]
            else:
                pre, post, comb = reference.hc_mix(x, a["fn"], a["base"], a["scale"], sinkhorn_iters=t["ITERS"], **kw)
                y = reference.hc_collapse(x, pre) if t["COLLAPSE"] else dummy[3]
                site = [pre, post, comb, mx.fast.rms_norm(y, a["nw"], eps[2]) if t["NORM"] else y]
            parts = {"hc_dots_pre": [mx.zeros(output_shapes[0])], "hc_post_dots_pre": [x, mx.zeros(output_shapes[1])]}
            out = parts.get(kind, []) + site
            assert [tuple(o.shape) for o in out] == [tuple(s) for s in output_shapes], kind
            assert [o.dtype for o in out] == list(output_dtypes), kind
            return out

        return launch


@pytest.fixture(scope="module", params=["long", "odd"])
def v4_case(request):
    from parity_helpers import load_case

    return load_case(request.getfixturevalue("oracle"), "make_tiny_deepseek_v4.py", request.param)


def _decode(lm, ids, monkeypatch, how="compiled", prefill=5):
    from ds4mlx.runtime import stepper

    monkeypatch.setenv(stepper.MODE_ENV, how)
    s = lm.new_session(ctx=len(ids) + 80, chunk=7)
    s.prefill(ids[:prefill])
    return np.stack([s.decode(t) for t in ids[prefill:]])


def test_compiled_step_through_the_tails_matches_legacy(v4_case, monkeypatch):
    """The tiny V4 models' mHC sites on a faked CUDA face (stand-in launches computing the
    reference face): every decode site is one launch (hc_dots_pre / hc_post_dots_pre, no
    hc_dots / hc_post_dots), and the compiled step's logits stay within 1e-4 of the legacy path."""
    from ds4mlx.models import cache as row_cache
    from ds4mlx.runtime import stepper

    _, lm, ref, _ = v4_case
    monkeypatch.setattr(row_cache, "MIN_BUCKET", 4)
    ids = ref["input_ids"][0].tolist()
    legacy = _decode(lm, ids, monkeypatch, "legacy")
    fake = StandInKernels()
    stepper.forget(lm.model)
    monkeypatch.setattr(hck, "auto_face", lambda kernel, self_test: "cuda")  # this module's faces only
    monkeypatch.setattr(hck, "_kernel", fake)
    try:
        compiled = _decode(lm, ids, monkeypatch)
    finally:
        stepper.forget(lm.model)
    assert fake.calls.get("hc_post_dots_pre", 0) > 0 and fake.calls.get("hc_dots_pre", 0) > 0
    assert set(fake.calls) <= {"hc_dots_pre", "hc_post_dots_pre", "hc_pre", "hc_post"}
    assert float(np.abs(compiled - legacy).max()) <= 1e-4
    assert float(np.abs(compiled - ref["logits_full"][0][5:]).max()) <= 1e-4


def test_unverified_tail_falls_back_to_two_launches(monkeypatch):
    """On a (faked) CUDA face a wrong tail fails its first-use self-test: the decode split
    then runs as today's two launches; Metal never takes the tails."""
    monkeypatch.delenv("DS4MLX_KERNELS", raising=False)
    monkeypatch.delenv("DS4MLX_KERNEL_SELFTEST", raising=False)
    monkeypatch.setattr(dispatch, "backend", lambda device=None: "cuda")
    monkeypatch.setattr(dispatch, "_self_tests", {})
    # (GPU-verified on the H200, 2026-12-02: the self-test still runs for a kernel listed here)
    monkeypatch.setattr(dispatch, "UNVERIFIED_KERNELS", dispatch.UNVERIFIED_KERNELS | {"hyper_connection.tail"})
    calls = []

    def garbage(kind):
        def launch(face, *, output_shapes, output_dtypes, **kw):
            calls.append(kind)
            return [mx.full(s, 7.0, t) for s, t in zip(output_shapes, output_dtypes)]

        return launch

    monkeypatch.setattr(hck, "_kernel", garbage)
    x, fn, base, scale = (mx.array(a) for a in make_inputs(4, 64, (1, 1), seed=2))
    kw = dict(sinkhorn_iters=20, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    hck.hc_pre(x, fn, base, scale, **kw)
    assert dispatch._self_tests[("hyper_connection.tail", "cuda")] is False
    calls.clear()
    hck.hc_pre(x, fn, base, scale, **kw)
    assert calls == ["hc_dots", "hc_pre"]
    assert not hck._tail("metal", True)


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


def _cuda_face():
    face = _gpu_face()
    if face != "cuda":
        pytest.skip("the one-launch tails run on CUDA only")
    return face


@pytest.mark.gpu
def test_gpu_tail_self_test_passes():
    assert hck._tail_self_test(_cuda_face())


TAIL_GPU_CASES = [  # (n, d, tokens, dtype)
    (4, 4096, 1, "bfloat16"),  # V4 Flash decode
    (4, 4096, 1, "float32"),
    (4, 4096, 16, "bfloat16"),  # SPLIT_TOKENS: the most the tails take
    (3, 4095, 3, "float32"),  # odd sizes
    (2, 1000, 7, "bfloat16"),
    (5, 33, 2, "float32"),  # the largest n
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", TAIL_GPU_CASES, ids=lambda c: "n{}_d{}_T{}_{}".format(*c))
def test_gpu_tails_equal_two_launches(case, monkeypatch):
    """hc_pre (with and without the folded norm), hc_mix, hc_head and hc_post_pre (with and
    without both folds) at decode: the one-launch tails bit for bit the two-launch path (the
    same sums in the same order), three times in a row (each launch must leave its tickets
    zeroed for the next: a stale one hands a token's work to the wrong threadgroup)."""
    face = _cuda_face()
    n, d, nt, dtype = case
    dt = getattr(mx, dtype)
    x, fn, base, scale = (mx.array(a) for a in make_inputs(n, d, (1, nt), seed=nt + d))
    x, fn = x.astype(dt), fn.astype(dt)
    out, out2 = ((mx.random.normal((1, nt, d), key=mx.random.key(k)) * 0.5).astype(dt) for k in (1, 2))
    w = 1.0 + 0.1 * mx.random.normal((d,), key=mx.random.key(3))
    kw = dict(sinkhorn_iters=20, hc_eps=HC_EPS, norm_eps=NORM_EPS, backend=face)
    post, comb, _ = hck.hc_pre(x, fn, base, scale, **{**kw, "backend": "reference"})

    def run():
        got = [
            *hck.hc_pre(x, fn, base, scale, **kw, norm=(w, RMS_EPS)),
            *hck.hc_pre(x, fn, base, scale, **kw),
            *hck.hc_mix(x, fn, base, scale, **kw),  # (two launches either way: its tail is off)
            hck.hc_head(x, fn[:n], base[:n], scale[:1], hc_eps=HC_EPS, norm_eps=NORM_EPS, backend=face),
            *hck.hc_post_pre(x, out, post, comb, fn, base, scale, **kw, norm=(w, RMS_EPS), out2=out2),
            *hck.hc_post_pre(x, out, post, comb, fn, base, scale, **kw),
        ]
        mx.eval(got)
        return got

    one = [run() for _ in range(3)]
    assert not any(mx.any(b).item() for b in dispatch.ticket_buffers(hck.TICKETS))
    monkeypatch.setattr(hck, "_tail", lambda face, chosen: False)
    two = run()
    for got in one:
        for i, (g, want) in enumerate(zip(got, two)):
            assert g.dtype == want.dtype and g.shape == want.shape, i
            assert mx.array_equal(g, want).item(), i


@pytest.mark.gpu
def test_gpu_tiny_models_compiled_decode_tails_on_vs_off(v4_case, monkeypatch):
    """The tiny V4 models' compiled decode on the GPU with the automatic faces: the tails
    (after their first-use self-test) within 1e-4 of the two-launch path."""
    from ds4mlx.runtime import stepper

    face = _cuda_face()
    _, lm, ref, _ = v4_case
    ids = ref["input_ids"][0].tolist()
    stepper.forget(lm.model)
    try:
        on = _decode(lm, ids, monkeypatch)
        assert hck._tail(face, False)  # the self-test passed: the step ran the tails
        stepper.forget(lm.model)
        monkeypatch.setattr(hck, "_tail", lambda face, chosen: False)
        off = _decode(lm, ids, monkeypatch)
    finally:
        stepper.forget(lm.model)
    assert float(np.abs(on - off).max()) <= 1e-4


# ------------------------------------------------------------------ the CUDA face, compiled by nvcc (no GPU)


NVCC_KINDS = [
    ("hc_pre", "pre"),
    ("hc_pre", "head"),
    ("hc_pre", "mix"),
    ("hc_post", ""),
    ("hc_dots", "pre"),
    ("hc_dots", "head"),
    ("hc_post_dots", ""),
    ("hc_dots_pre", "pre"),
    ("hc_dots_pre", "head"),
    ("hc_dots_pre", "mix"),
    ("hc_post_dots_pre", ""),
]
NVCC_DTYPES = ["float32", "bfloat16"]


@pytest.mark.parametrize("dtype", NVCC_DTYPES)
@pytest.mark.parametrize("kind,mode", NVCC_KINDS)
@pytest.mark.slow_after(1)
def test_cuda_face_compiles_with_nvcc(kind, mode, dtype, tmp_path):
    """The exact CUDA translation unit mx.fast.cuda_kernel builds, compiled for sm_90 (H200)
    by nvcc with warnings as errors (syntax and types; the g++ emulation checks the logic)."""
    from test_kernel_emulation import nvcc_compile

    family = [_cuda_source(k, m, d) for (k, m), d in itertools.product(NVCC_KINDS, NVCC_DTYPES)]
    nvcc_compile(tmp_path, _cuda_source(kind, mode, dtype), family=family)


def _cuda_source(kind, mode, dtype):
    from test_kernel_emulation import mlx_cuda_source

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
    elif kind == "hc_post":
        ins, outs = {"x": dtype, "o": dtype, "post": f, "comb": f, "o2": dtype}, {"y": dtype}
        tmpl = [("T", dtype), ("TP", f), ("TC", f), ("HC", 4), ("D", 4096), ("THREADS", hck.POST_THREADS)]
        tmpl.append(("ADD2", True))
    else:  # the tails: hc_dots / hc_post_dots, then hc_pre's work, with both folds
        core = {"base": f, "scale": f, "eps": f, "nw": dtype, "tickets": "uint32"}
        small = {"pre": f, "post": f, "comb": f}
        dots = [("T", dtype), ("TW", dtype), ("HC", 4), ("D", 4096), ("THREADS", hck.DOTS_THREADS)]
        dots += [("PER", hck.DOTS_PER), ("PARTS", 32), ("TB", f), ("TS", f), ("ITERS", 20)]
        dots += [("HEAD", mode == "head"), ("COLLAPSE", mode != "mix"), ("NORM", mode != "head")]
        dots += [("VT", hck.PRE_THREADS)]
        if kind == "hc_dots_pre":
            ins, outs, tmpl = {"x": dtype, "fn": dtype, **core}, {"part": f, **small, "y": dtype}, dots
        else:
            ins = {"x": dtype, "o": dtype, "post": f, "comb": f, "fn": dtype, "o2": dtype, **core}
            outs = {"y": dtype, "part": f, "pre": f, "post2": f, "comb2": f, "h": dtype}
            tmpl = dots + [("TP", f), ("TC", f), ("ADD2", True)]
        assert list(ins) == hck._KINDS[kind][1] and list(outs) == hck._KINDS[kind][2]
    return mlx_cuda_source(kind, h, b, ins, outs, tmpl)


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


def test_ticket_buffers_differ_between_consecutive_launches():
    """MLX orders a graph's launches by data only: two independent launches of one owner may
    run at once, so consecutive launches never share a ticket buffer (dispatch.TICKET_RING
    apart they do: more than one graph's ops)."""
    first = [dispatch.tickets("test.ring", 3, 8) for _ in range(dispatch.TICKET_RING)]
    assert len({id(b) for b in first}) == dispatch.TICKET_RING
    assert all(b.shape == (8,) and not mx.any(b).item() for b in first)
    again = dispatch.tickets("test.ring", 20, 8)  # the ring comes round, grown to the new size
    assert again.shape == (20,) and again is not first[0]
    assert dispatch.tickets("test.ring", 3, 8) is first[1]
    assert dispatch.TICKET_RING > int(os.environ.get("MLX_MAX_OPS_PER_BUFFER", "400"))
