"""kernels/qmv_hc_route.py: o_b's mat-vec, the FFN site's mHC work and the MoE router in one
launch, against the calls it replaces (qmv_hc_post_pre, then moe_route.router) on the reference
face: the shared text through the g++ emulation (the module's own plan, template and grid,
2-warp threadgroups, a few of them per token), the CUDA translation unit through nvcc at V4
Flash's shape, the GPU face on a GPU, and V4's decode steps through the launch (V4.1 and GLM
run no qmv_hc site: their layers keep their launches)."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_kernel_emulation import emulated_launch, mlx_cuda_source, nvcc_compile

from ds4mlx.kernels import affine_qmv as aq
from ds4mlx.kernels import dispatch, moe_route, qmv_hc, qmv_hc_route
from ds4mlx.kernels import hyper_connection as hck

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from launch_census import NARROW  # noqa: E402

pytestmark = pytest.mark.usefixtures("cpu_unless_gpu_test")

_CPU_EXTRA = "struct float2 { float x, y; };\n"  # the emulation prelude has float4 / uint4 only
_FLOAT_CONSTS = ("T", "TS", "TP", "TC", "TW", "TB", "TSC")


@pytest.fixture
def emulated(tmp_path, monkeypatch):
    """The launch on the g++ emulation: 2-warp threadgroups, a grid of a few of them (so the
    token's threadgroups hand the tail over), hc_pre's virtual threads 128."""
    monkeypatch.setattr(aq, "WARPS", 2)
    monkeypatch.setattr(aq, "BLOCKS", 3)
    monkeypatch.setattr(hck, "PRE_THREADS", 128)
    launches = []
    header, body = qmv_hc_route.shared_text()
    io = (qmv_hc_route.INPUTS, qmv_hc_route.OUTPUTS)
    launch = emulated_launch(
        tmp_path, launches, _CPU_EXTRA + header, body, io, float_consts=_FLOAT_CONSTS, inout=("tickets",)
    )
    monkeypatch.setattr(qmv_hc_route, "_kernel", lambda: launch)
    return launches


def _f32(args):
    """The problem's arrays in float32 (the emulation computes 16-bit inputs in float32)."""
    *site, router = args
    site = [a.astype(mx.float32) if a.dtype == mx.bfloat16 else a for a in site]
    return (*site, router)


@pytest.mark.parametrize("hashed", [False, True], ids=["topk_bias", "hashed"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.slow_after(1)
def test_shared_text_on_the_cpu_emulation(hashed, dtype, emulated):
    """The site's outputs and the routing (experts and weights) of the one launch equal the calls
    it replaces on the reference face (float32 sums in another order; bfloat16 inputs against the
    float32 reference on the same values, as the emulation computes them), with the token's work
    spread over several threadgroups; the tickets are zero again afterwards."""
    args, kw = qmv_hc_route.self_test_problem(getattr(mx, dtype), hashed=hashed, e=48, k=6)
    got = qmv_hc_route.qmv_hc_post_pre_route(*args, **kw, backend="cuda")
    f32 = _f32(args)
    kw32 = dict(kw, norm=(kw["norm"][0].astype(mx.float32), kw["norm"][1]))
    want = qmv_hc_route.qmv_hc_post_pre_route(*f32, **kw32, backend="reference")
    assert len(emulated) == 1
    tmpl, grid = emulated[0]
    assert grid[1] == tmpl["NBY"] == tmpl["PARTS"] > 1 and tmpl["RE"] == 48 and tmpl["RHASH"] == hashed
    tol = 1e-4 if dtype == "float32" else 2e-2  # bfloat16: the streams come back rounded
    for name, g, w in zip(("streams", "post", "comb", "collapsed"), got[:4], want[:4]):
        np.testing.assert_allclose(np.array(g.astype(mx.float32)), np.array(w), rtol=tol, atol=tol, err_msg=name)
    assert got[4].dtype == mx.int32 and got[4].shape == (1, 1, 6) and got[5].shape == (1, 1, 6)
    assert moe_route.same_routing(got[4:], want[4:], atol=1e-5, rtol=1e-4)


def test_self_test_passes_on_the_cpu_emulation_and_fails_a_wrong_kernel(emulated, monkeypatch):
    """The first-use self-test on the emulation passes, and fails for a launch that picks other
    experts."""
    assert qmv_hc_route._self_test("cuda") and emulated
    launch = qmv_hc_route._kernel()

    def wrong_experts(face, **kw):
        out = launch(face, **kw)
        i, e = qmv_hc_route.OUTPUTS.index("ridx"), dict(kw["template"])["RE"]
        return [(o + 1) % e if j == i else o for j, o in enumerate(out)]

    monkeypatch.setattr(qmv_hc_route, "_kernel", lambda: wrong_experts)
    assert not qmv_hc_route._self_test("cuda")


def test_reference_face_is_the_calls_it_replaces():
    """On the reference face (and for any case the launch does not take) the result is
    qmv_hc_post_pre, then moe_route.router of its collapsed output, bit for bit."""
    args, kw = qmv_hc_route.self_test_problem()
    got = qmv_hc_route.qmv_hc_post_pre_route(*args, **kw, backend="reference")
    *site, router = args
    out = qmv_hc.qmv_hc_post_pre(*site, **kw, backend="reference")
    want = (*out, *router.route(out[3], backend="reference"))
    for g, w in zip(got, want):
        assert np.array_equal(np.array(g), np.array(w))


def test_launch_takes_one_token_on_cuda_only():
    args, kw = qmv_hc_route.self_test_problem()
    x, w, _, b, st, _, _, fn, _, _, router = args
    q = dict(group_size=64, bits=4)
    assert qmv_hc_route._takes("cuda", x, w, b, st, fn, router, kw["norm"], **q)
    assert not qmv_hc_route._takes("metal", x, w, b, st, fn, router, kw["norm"], **q)
    assert not qmv_hc_route._takes("cuda", x, w, b, st, fn, router, None, **q)  # no norm: no router input
    x2, st2 = mx.concatenate([x, x], axis=1), mx.concatenate([st, st], axis=1)
    assert not qmv_hc_route._takes("cuda", x2, w, b, st2, fn, router, kw["norm"], **q)  # two tokens


def test_metal_and_cuda_share_one_text():
    metal, cuda = qmv_hc_route.kernel_sources("metal"), qmv_hc_route.kernel_sources("cuda")
    shared_h, shared_b = qmv_hc_route.shared_text()
    assert metal[0].endswith(shared_h) and cuda[0].endswith(shared_h)
    assert metal[1].endswith(shared_b) and cuda[1].endswith(shared_b)
    # the plain qmv_hc text has no router piece
    assert "rpart" not in qmv_hc.shared_text()[1] and "rpart" in shared_b


# ------------------------------------------------------------------ the CUDA face, compiled by nvcc (no GPU)


@pytest.mark.parametrize("dt,rw", [("bfloat16", "bfloat16"), ("float32", "float32"), ("float32", "bfloat16")])
@pytest.mark.slow_after(1)
def test_cuda_face_compiles_with_nvcc(dt, rw, tmp_path):
    """The CUDA translation unit at V4 Flash's shape (8-bit o_b [4096, 8192], group 64, 4 streams of
    4096, the folded norm, 256 experts, 6 a token, the bias), one token, sm_90, warnings are errors."""
    x_dtype = getattr(mx, dt)
    d, k_dim = 4096, 8192
    pl = aq.plan(0, d, k_dim, 8, 1, x_dtype=x_dtype)
    tmpl = aq.template(0, pl, x_dtype, x_dtype, n_rows=d, k_dim=k_dim, group_size=64, bits=8, dense=True, x_rows=1)
    f = "float32"
    tmpl = [(k, dt if k in ("T", "TS") else v) for k, v in tmpl]
    tmpl += [("TP", f), ("TC", f), ("TW", dt), ("TB", f), ("TSC", f), ("HC", 4), ("ITERS", 20), ("HEAD", False)]
    tmpl += [("COLLAPSE", True), ("HC_NORM", True), ("VT", hck.PRE_THREADS), ("PARTS", pl.nby)]
    route = moe_route.launch_template(256, 6, "sqrtsoftplus", True, mx.zeros((256,)), None, 1, 1)
    tmpl += [("R" + k, v) for k, v in route if k not in ("THREADS", "TB")]
    kinds = dict(w="uint32", eids="int32", wts=f, lim=f, post=f, comb=f, base=f, scale=f, eps=f, tickets="uint32")
    kinds |= dict(rw=rw, rbias=f, rtable="int32", rids="int32", rprm=f)
    ins = {name: kinds.get(name, dt) for name in qmv_hc_route.INPUTS}
    floats = ("part", "pre", "post2", "comb2", "rwts", "rpart")
    outs = {name: (f if name in floats else "int32" if name == "ridx" else dt) for name in qmv_hc_route.OUTPUTS}
    header, body = qmv_hc_route.kernel_sources("cuda")
    nvcc_compile(tmp_path, mlx_cuda_source(f"affine_qmv_hc_route_{dt}_{rw}", header, body, ins, outs, tmpl))


# ------------------------------------------------------------------ the GPU face against the reference


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hashed", [False, True], ids=["topk_bias", "hashed"])
def test_gpu_equals_reference_at_v4_flash_shape(rows, dtype, hashed):
    """V4 Flash's o_b site (8-bit [4096, 8192], 4 streams of 4096, the folded norm) and its router
    (256 experts, 6 a token, float32 weight) on the CUDA face against the calls on the reference
    face; several rows run those calls (the launch takes one token); the tickets are zero afterwards."""
    if dispatch.gpu_backend() != "cuda":
        pytest.skip("the launch is CUDA's only")
    from test_kernel_qmv_hc import assert_close_to_mlx, site_inputs

    site, norm = site_inputs(rows, 4, 4096, 8192, getattr(mx, dtype), bits=8)
    keys = mx.random.split(mx.random.key(5), 3)
    rw = mx.random.normal((256, 4096), key=keys[0]) * 4096**-0.5
    if hashed:
        table = mx.random.randint(0, 256, (64, 6), key=keys[1]).astype(mx.int32)
        router = qmv_hc_route.SiteRouter(rw, 6, "sqrtsoftplus", 1.5, table=table, ids=mx.arange(rows)[None] % 64)
    else:
        router = qmv_hc_route.SiteRouter(rw, 6, "sqrtsoftplus", 1.5, bias=mx.random.uniform(shape=(256,), key=keys[2]))
    kw = dict(group_size=64, bits=8, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6, norm=norm)
    got = qmv_hc_route.qmv_hc_post_pre_route(*site, router, **kw, backend="cuda")
    want = qmv_hc_route.qmv_hc_post_pre_route(*site, router, **kw, backend="reference")
    for g, w in zip(got[:4], want[:4]):
        assert_close_to_mlx(g, w, dtype)
    # bfloat16: a logit may land a bf16 step away (moe_route's fold self-test allows the same)
    assert moe_route.same_routing(got[4:], want[4:], atol=1e-4, rtol=1e-4 if dtype == "float32" else 1e-2)
    assert all(not b.any().item() for b in dispatch.ticket_buffers(qmv_hc.TICKETS))
    assert qmv_hc_route._self_test("cuda")


# ------------------------------------------------------------------ the decode steps through the launch


class StandInLaunch:
    """`qmv_hc_route._kernel()` for a faked CUDA face: each launch's outputs computed by the
    reference face (the calls it replaces) from the very inputs and template the launch passes,
    so the CPU runs the model's compiled step through the GPU path's plumbing."""

    def __init__(self):
        self.calls = 0

    def __call__(self):
        def launch(face, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            self.calls += 1
            a, t = dict(zip(qmv_hc_route.INPUTS, inputs)), dict(template)
            assert t["PARTS"] == t["NBY"] == grid[1] and t["MODE"] == 0 and t["XR"] == 1 and t["HC_NORM"]
            o = aq.qmv(
                a["x"], a["w"], a["scales"], a["biases"], group_size=t["GS"], bits=t["BITS"], backend="reference"
            )
            eps = [float(v) for v in a["eps"].tolist()]
            kw = dict(sinkhorn_iters=t["ITERS"], hc_eps=eps[0], norm_eps=eps[1], norm=(a["nw"], eps[2]))
            o = o.reshape(*a["hx"].shape[:-2], -1)
            ys, post, comb, hn = hck.hc_post_pre(
                a["hx"], o, a["post"], a["comb"], a["fn"], a["base"], a["scale"], **kw, backend="reference"
            )
            sel = (
                dict(table=a["rtable"], ids=a["rids"]) if t["RHASH"] else dict(bias=a["rbias"] if t["RBIAS"] else None)
            )
            score = moe_route.SCORES[t["RSCORE"]]
            scaling = float(a["rprm"].item())
            idx, wts = moe_route.router(
                hn, a["rw"], k=t["RK"], score=score, scaling=scaling, backend="reference", **sel
            )
            out = [o.reshape(output_shapes[0]), ys, mx.zeros(output_shapes[2]), mx.zeros(output_shapes[3])]
            out += [post, comb, hn, idx.astype(mx.int32), wts, mx.zeros(output_shapes[-1])]
            assert [tuple(v.shape) for v in out] == [tuple(s) for s in output_shapes]
            assert [v.dtype for v in out] == list(output_dtypes)
            return out

        return launch


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [mx.float32, None], ids=["float32", "weights_as_stored"])
def test_compiled_step_through_the_launch_matches_legacy(dtype, monkeypatch):
    """The synthetic V4 Flash (8-bit o_b, MLX-affine experts, hashed and top-k routed layers) on a
    faked CUDA face for this launch and qmv_hc's: every layer's router runs inside its o_b launch,
    and over 64 decode steps the compiled step's logits equal those of the step without it (the
    same reference ops) and stay within 1e-4 of the legacy per-layer forward; float32 activations
    and the synthetic's own (`dtype=None`: its 16-bit weights as stored)."""
    from test_kernel_qmv_hc import StandInLaunch as SiteStandIn
    from test_kernel_qmv_hc import _steps

    from ds4mlx.bench.synthetic import build_synthetic_v4_flash
    from ds4mlx.models import cache as row_cache
    from ds4mlx.models.layers import set_activation_dtype

    lm = build_synthetic_v4_flash(layers=4, experts=16, overrides=NARROW)[0]  # CSA, HCA, 2 x SWA
    if dtype is not None:
        set_activation_dtype(lm.model, dtype)
    monkeypatch.setattr(row_cache, "MIN_BUCKET", 4)
    monkeypatch.setattr(aq, "kernel_face", lambda *a, **k: "forced")  # the MoE's two launches (reference faces)
    ids = np.random.default_rng(3).integers(0, lm.model.args.vocab_size, 69).tolist()
    _, legacy = _steps(lm, ids, monkeypatch, "legacy")
    monkeypatch.setattr(qmv_hc, "auto_face", lambda kernel, self_test: "cuda")
    monkeypatch.setattr(qmv_hc, "_kernel", SiteStandIn())
    _, plain = _steps(lm, ids, monkeypatch)
    fake = StandInLaunch()
    monkeypatch.setattr(qmv_hc_route, "auto_face", lambda kernel, self_test: "cuda")
    monkeypatch.setattr(qmv_hc_route, "_kernel", fake)
    _, fused = _steps(lm, ids, monkeypatch)
    layers = len(lm.model.model.layers)
    assert fake.calls >= layers and fake.calls % layers == 0  # a launch per layer in each trace (bucket)
    assert np.array_equal(fused, plain)
    assert float(np.abs(fused - legacy).max()) <= 1e-4  # (0.0 on the CPU, both dtypes)
