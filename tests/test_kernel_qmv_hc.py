"""kernels/qmv_hc.py: the dense affine mat-vec and the next mHC site (hc_post + the next
hc_pre, the tail) in one launch, against the two calls it replaces (affine_qmv.qmv, then
hyper_connection.hc_post_pre) on the reference face: the shared text through the g++
emulation (the module's own plan, template and grid, 2-warp threadgroups), the CUDA
translation unit through nvcc at V4 Flash's o_b shape, the GPU face on a GPU."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_kernel_emulation import emulated_launch, mlx_cuda_source, nvcc_compile

from ds4mlx.kernels import affine_qmv as aq
from ds4mlx.kernels import dispatch
from ds4mlx.kernels import hyper_connection as hck
from ds4mlx.kernels import qmv_hc

pytestmark = pytest.mark.usefixtures("cpu_unless_gpu_test")

_CPU_EXTRA = "struct float2 { float x, y; };\n"  # the emulation prelude has float4 / uint4 only
_FLOAT_CONSTS = ("T", "TS", "TP", "TC", "TW", "TB", "TSC")
SITE = dict(sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6)


def site_inputs(rows: int, n: int, d: int, k_dim: int, dtype, seed: int = 0, bits: int = 4, gs: int = 64):
    """(x, w, scales, biases, streams, post, comb, fn, base, scale, norm) of one site."""
    key = mx.random.key(seed)
    k = mx.random.split(key, 8)
    wq, sc, bi = mx.quantize(mx.random.normal((d, k_dim), key=k[0]) * 0.05, group_size=gs, bits=bits)
    x = mx.random.normal((1, rows, k_dim), key=k[1]).astype(dtype)
    st = (mx.random.normal((1, rows, n, d), key=k[2]) * 0.5).astype(dtype)
    post = mx.random.uniform(shape=(1, rows, n), key=k[3]) * 2
    comb = mx.random.uniform(shape=(1, rows, n, n), key=k[4])
    fn = mx.random.normal(((2 + n) * n, n * d), key=k[5]) * (n * d) ** -0.5
    base, scale = mx.random.normal(((2 + n) * n,), key=k[6]) * 0.1, mx.array([0.5, 1.0, 2.0])
    norm = ((1.0 + 0.2 * mx.random.normal((d,), key=k[7])).astype(dtype), 1e-6)
    return (x, wq, sc.astype(dtype), bi.astype(dtype), st, post, comb, fn.astype(dtype), base, scale), norm


def _f32(args):
    return tuple(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a for a in args)


@pytest.fixture
def emulated(tmp_path, monkeypatch):
    """qmv_hc's launches on the g++ emulation: 2-warp threadgroups, a grid of a few of them (so
    a token's threadgroups hand the tail over), hc_pre's virtual threads 128."""
    monkeypatch.setattr(aq, "WARPS", 2)
    monkeypatch.setattr(aq, "BLOCKS", 3)
    monkeypatch.setattr(hck, "PRE_THREADS", 128)
    launches = []
    header, body = qmv_hc.shared_text()
    launch = emulated_launch(
        tmp_path,
        launches,
        _CPU_EXTRA + header,
        body,
        (qmv_hc.INPUTS, qmv_hc.OUTPUTS),
        float_consts=_FLOAT_CONSTS,
        inout=("tickets",),
    )
    monkeypatch.setattr(qmv_hc, "_kernel", lambda: launch)
    return launches


@pytest.mark.parametrize(
    "rows,n,d,norm,dtype",
    [(1, 4, 256, True, "float32"), (3, 4, 96, False, "float32"), (2, 3, 80, True, "bfloat16")],
    ids=["one_row_norm", "three_rows", "bf16_n3_two_rows"],
)
@pytest.mark.slow_after(1)
def test_shared_text_on_the_cpu_emulation(rows, n, d, norm, dtype, emulated):
    """Every output (the new streams, post', comb', the collapsed and normed vector) of the one
    launch equals the two calls on the reference face (float32 sums in another order; bfloat16:
    against the float32 reference on the same values, as MLX's CPU quantized matmul sums 16-bit
    x in 16 bits), for one token and several (the multi-row plan: each weight read once); the
    tickets are zero again after each launch."""
    args, nrm = site_inputs(rows, n, d, 512, getattr(mx, dtype), seed=rows)
    nrm = nrm if norm else None
    got = qmv_hc.qmv_hc_post_pre(*args, group_size=64, bits=4, **SITE, norm=nrm, backend="cuda")
    f32norm = None if nrm is None else (nrm[0].astype(mx.float32), nrm[1])
    want = qmv_hc.qmv_hc_post_pre(*_f32(args), group_size=64, bits=4, **SITE, norm=f32norm, backend="reference")
    assert len(emulated) == 1
    tmpl, grid = emulated[0]
    assert tmpl["XR"] == (rows if rows > 1 else 1) and grid[1] == tmpl["NBY"] == tmpl["PARTS"] > 1
    tol = 1e-4 if dtype == "float32" else 2e-2
    for name, g, w in zip(("streams", "post", "comb", "collapsed"), got, want):
        assert g.shape == w.shape and g.dtype == (args[4].dtype if name in ("streams", "collapsed") else mx.float32)
        np.testing.assert_allclose(np.array(g.astype(mx.float32)), np.array(w), rtol=tol, atol=tol, err_msg=name)


def test_self_test_passes_on_the_cpu_emulation_and_fails_a_wrong_kernel(emulated, monkeypatch):
    """The first-use self-test on the emulation passes, and fails for a launch whose new
    streams miss the mat-vec's output (the streams as they came in)."""
    assert qmv_hc._self_test("cuda") and emulated
    launch = qmv_hc._kernel()

    def streams_unchanged(face, **kw):
        out = launch(face, **kw)
        return [kw["inputs"][8] if i == 1 else o for i, o in enumerate(out)]

    monkeypatch.setattr(qmv_hc, "_kernel", lambda: streams_unchanged)
    assert not qmv_hc._self_test("cuda")


def test_reference_face_is_the_two_calls():
    """On the reference face (and for any case the launch does not take) the result is
    affine_qmv.qmv then hc_post_pre, bit for bit."""
    args, nrm = site_inputs(2, 4, 64, 256, mx.float32)
    got = qmv_hc.qmv_hc_post_pre(*args, group_size=64, bits=4, **SITE, norm=nrm, backend="reference")
    x, w, s, b, st, post, comb, fn, base, scale = args
    o = aq.qmv(x, w, s, b, group_size=64, bits=4, backend="reference")
    want = hck.hc_post_pre(st, o, post, comb, fn, base, scale, **SITE, norm=nrm, backend="reference")
    for g, w_ in zip(got, want):
        assert np.array_equal(np.array(g), np.array(w_))


def test_metal_and_cuda_share_one_text():
    metal, cuda = qmv_hc.kernel_sources("metal"), qmv_hc.kernel_sources("cuda")
    shared_h, shared_b = qmv_hc.shared_text()
    assert metal[0].endswith(shared_h) and cuda[0].endswith(shared_h)
    assert metal[1].endswith(shared_b) and cuda[1].endswith(shared_b)


# ------------------------------------------------------------------ the CUDA face, compiled by nvcc (no GPU)


@pytest.mark.parametrize("dt,rows", [("bfloat16", 1), ("float32", 1), ("bfloat16", 4)])
@pytest.mark.slow_after(1)
def test_cuda_face_compiles_with_nvcc(dt, rows, tmp_path):
    """The CUDA translation unit at V4 Flash's o_b shape (8-bit [4096, 8192], group 64, 4 streams
    of 4096, the folded norm) for one token and a 4-row plan, sm_90, warnings are errors."""
    x_dtype = getattr(mx, dt)
    d, k_dim = 4096, 8192
    pl = aq.rows_plan(rows, d, k_dim, 8, x_dtype, "cuda") if rows > 1 else aq.plan(0, d, k_dim, 8, 1, x_dtype=x_dtype)
    tmpl = aq.template(0, pl, x_dtype, x_dtype, n_rows=d, k_dim=k_dim, group_size=64, bits=8, dense=True, x_rows=rows)
    f = "float32"
    tmpl = [(k, dt if k in ("T", "TS") else v) for k, v in tmpl]
    tmpl += [("TP", f), ("TC", f), ("TW", dt), ("TB", f), ("TSC", f), ("HC", 4), ("ITERS", 20), ("HEAD", False)]
    tmpl += [("COLLAPSE", True), ("HC_NORM", True), ("VT", hck.PRE_THREADS), ("PARTS", pl.nby)]
    kinds = dict(w="uint32", eids="int32", wts=f, lim=f, post=f, comb=f, base=f, scale=f, eps=f, tickets="uint32")
    ins = {name: kinds.get(name, dt) for name in qmv_hc.INPUTS}
    outs = {name: (f if name in ("part", "pre", "post2", "comb2") else dt) for name in qmv_hc.OUTPUTS}
    header, body = qmv_hc.kernel_sources("cuda")
    nvcc_compile(tmp_path, mlx_cuda_source(f"affine_qmv_hc_{dt}_{rows}", header, body, ins, outs, tmpl))


# ------------------------------------------------------------------ the GPU face against the reference


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_equals_reference_at_v4_flash_shape(rows, dtype):
    """V4 Flash's o_b site (8-bit [4096, 8192], 4 streams of 4096, the folded norm) on the CUDA
    face against the two calls on the reference face; the tickets are zero afterwards."""
    if dispatch.gpu_backend() != "cuda":
        pytest.skip("the launch is CUDA's only")
    args, nrm = site_inputs(rows, 4, 4096, 8192, getattr(mx, dtype), bits=8)
    got = qmv_hc.qmv_hc_post_pre(*args, group_size=64, bits=8, **SITE, norm=nrm, backend="cuda")
    want = qmv_hc.qmv_hc_post_pre(*args, group_size=64, bits=8, **SITE, norm=nrm, backend="reference")
    tol = 1e-3 if dtype == "float32" else 3e-2
    for g, w in zip(got, want):
        assert dispatch.close_enough(g, w, rtol=tol, atol=tol)
    assert all(not b.any().item() for b in dispatch.ticket_buffers(qmv_hc.TICKETS))
    assert qmv_hc._self_test("cuda")
