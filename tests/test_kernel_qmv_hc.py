"""kernels/qmv_hc.py: the dense affine mat-vec and the next mHC site (hc_post + the next
hc_pre, the tail) in one launch, against the two calls it replaces (affine_qmv.qmv, then
hyper_connection.hc_post_pre) on the reference face: the shared text through the g++
emulation (the module's own plan, template and grid, 2-warp threadgroups), the CUDA
translation unit through nvcc at V4 Flash's o_b shape, the GPU face on a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_affine_qmv import _close as close_by_norm
from test_kernel_emulation import emulated_launch, mlx_cuda_source, nvcc_compile

from ds4mlx.kernels import affine_qmv as aq
from ds4mlx.kernels import dispatch, qmv_hc
from ds4mlx.kernels import hyper_connection as hck

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from launch_census import NARROW  # noqa: E402

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


def _emulate(tmp_path, monkeypatch, variant: str) -> list:
    """qmv_hc's `variant` launches on the g++ emulation: 2-warp threadgroups, a grid of a few of
    them (so a token's threadgroups hand the tail over), hc_pre's virtual threads 128; returns the
    launches' (template, grid)."""
    monkeypatch.setattr(aq, "WARPS", 2)
    monkeypatch.setattr(aq, "BLOCKS", 3)
    monkeypatch.setattr(hck, "PRE_THREADS", 128)
    launches = []
    header, body = qmv_hc.shared_text(variant)
    io = (qmv_hc.INPUTS if variant == "plain" else qmv_hc.DOWN_INPUTS, qmv_hc.OUTPUTS)
    floats = (*_FLOAT_CONSTS, "TS_A", "TS_B")
    launch = emulated_launch(tmp_path, launches, _CPU_EXTRA + header, body, io, float_consts=floats, inout=("tickets",))
    monkeypatch.setattr(qmv_hc, "_kernel", lambda v="plain": launch)
    return launches


@pytest.fixture
def emulated(tmp_path, monkeypatch):
    return _emulate(tmp_path, monkeypatch, "plain")


@pytest.mark.parametrize(
    "rows,n,d,k_dim,bits,norm,dtype",
    [
        (1, 4, 256, 512, 4, True, "float32"),
        (3, 4, 96, 512, 4, False, "float32"),
        (2, 3, 80, 512, 4, True, "bfloat16"),
        (4, 4, 512, 4096, 8, True, "float32"),
    ],
    ids=["one_row_norm", "three_rows", "bf16_n3_two_rows", "four_rows_k_slices"],
)
@pytest.mark.slow_after(1)
def test_shared_text_on_the_cpu_emulation(rows, n, d, k_dim, bits, norm, dtype, emulated):
    """Every output (the new streams, post', comb', the collapsed and normed vector) of the one
    launch equals the two calls on the reference face (float32 sums in another order; bfloat16:
    against the float32 reference on the same values, as MLX's CPU quantized matmul sums 16-bit
    x in 16 bits), for one token and several (the multi-row plan: each weight read once; the
    last case splits each row's K over the warps, KSL > 1, as the H100's 4-row plan at V4
    Flash's o_b shape does); the tickets are zero again after each launch."""
    args, nrm = site_inputs(rows, n, d, k_dim, getattr(mx, dtype), seed=rows, bits=bits)
    nrm = nrm if norm else None
    got = qmv_hc.qmv_hc_post_pre(*args, group_size=64, bits=bits, **SITE, norm=nrm, backend="cuda")
    f32norm = None if nrm is None else (nrm[0].astype(mx.float32), nrm[1])
    want = qmv_hc.qmv_hc_post_pre(*_f32(args), group_size=64, bits=bits, **SITE, norm=f32norm, backend="reference")
    assert len(emulated) == 1
    tmpl, grid = emulated[0]
    assert tmpl["XR"] == (rows if rows > 1 else 1) and grid[1] == tmpl["NBY"] == tmpl["PARTS"] > 1
    assert tmpl["KSL"] == (2 if k_dim == 4096 else 1)
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

    monkeypatch.setattr(qmv_hc, "_kernel", lambda variant="plain": streams_unchanged)
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


def assert_close_to_mlx(got, want, dtype: str) -> None:
    """The launch against the reference face (MLX's quantized_matmul, then hc_post_pre's ops).
    float32: elementwise.  bfloat16: relative to the whole output, test_affine_qmv's bar for
    affine_qmv against MLX: the launch's mat-vec dequantizes in float32, MLX's CUDA qmv into
    bf16 (o ~5e-3 apart by norm on the CPU model of both), so over 49k-65k stream values a few
    near-cancelling ones land past any elementwise bar that a one-row launch passes."""
    if dtype == "float32":
        assert dispatch.close_enough(got, want, rtol=1e-3, atol=1e-3)
    else:
        close_by_norm(got, want, mx.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_equals_reference_at_v4_flash_shape(rows, dtype):
    """V4 Flash's o_b site (8-bit [4096, 8192], 4 streams of 4096, the folded norm) on the CUDA
    face: elementwise against the two launches it replaces on the same face, and against the
    two calls on the reference face (`assert_close_to_mlx`); the tickets are zero afterwards."""
    if dispatch.gpu_backend() != "cuda":
        pytest.skip("the launch is CUDA's only")
    args, nrm = site_inputs(rows, 4, 4096, 8192, getattr(mx, dtype), bits=8)
    kw = dict(group_size=64, bits=8, **SITE, norm=nrm)
    got = qmv_hc.qmv_hc_post_pre(*args, **kw, backend="cuda")
    two = qmv_hc._two_calls(*args, backend="cuda", **kw)  # the two launches it replaces, same dequantization
    want = qmv_hc.qmv_hc_post_pre(*args, **kw, backend="reference")
    tol = 1e-3 if dtype == "float32" else 3e-2
    for name, g, t, w in zip(("streams", "post", "comb", "collapsed"), got, two, want):
        assert dispatch.close_enough(g, t, rtol=tol, atol=tol), name
        assert_close_to_mlx(g, w, dtype)
    assert all(not b.any().item() for b in dispatch.ticket_buffers(qmv_hc.TICKETS))
    assert qmv_hc._self_test("cuda")


# ------------------------------------------------------------------ the V4 decode step through the launch


class StandInLaunch:
    """`qmv_hc._kernel(variant)` for a faked CUDA face: each launch's outputs computed by the
    reference face (the two calls) from the very inputs and template the launch passes, so the
    CPU runs the model's compiled step through the GPU path's plumbing."""

    def __init__(self):
        self.calls = {"plain": 0, "down": 0}

    def __call__(self, variant="plain"):
        def launch(face, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            self.calls[variant] += 1
            names = qmv_hc.INPUTS if variant == "plain" else qmv_hc.DOWN_INPUTS
            a, t = dict(zip(names, inputs)), dict(template)
            assert t["PARTS"] == t["NBY"] == grid[1]
            assert any(a["tickets"] is b for b in dispatch.ticket_buffers(qmv_hc.TICKETS))
            if variant == "plain":
                assert t["MODE"] == 0 and t["DENSE"] and not t["NORM"]
                q = dict(group_size=t["GS"], bits=t["BITS"], backend="reference")
                o = aq.qmv(a["x"], a["w"], a["scales"], a["biases"], **q)
            else:
                assert t["MODE"] == 4
                n, k = output_shapes[0][0], t["KE_A"]
                h = a["x"].reshape(n, k, -1)
                q = dict(group_size=t["GS_A"], bits=t["BITS_A"], shared_group_size=t["GS_B"])
                q |= dict(shared_bits=t["BITS_B"], backend="reference")
                ids, wts = a["eids"].reshape(n, k), a["wts"].reshape(n, k)
                shared = (a["w2"], a["scales2"], a["biases2"])
                o = aq.gather_down_sum_shared(h, a["w"], a["scales"], a["biases"], ids, wts, a["x2"], shared, **q)
            eps = [float(v) for v in a["eps"].tolist()]
            norm = (a["nw"], eps[2]) if t["HC_NORM"] else None
            kw = dict(sinkhorn_iters=t["ITERS"], hc_eps=eps[0], norm_eps=eps[1], norm=norm, backend="reference")
            o = o.reshape(*a["hx"].shape[:-2], -1)
            ys, post, comb, hn = hck.hc_post_pre(a["hx"], o, a["post"], a["comb"], a["fn"], a["base"], a["scale"], **kw)
            out = [o.reshape(output_shapes[0]), ys, mx.zeros(output_shapes[2]), mx.zeros(output_shapes[3])]
            out += [post, comb, hn]
            assert [tuple(v.shape) for v in out] == [tuple(s) for s in output_shapes]
            assert [v.dtype for v in out] == list(output_dtypes)
            return out

        return launch


@pytest.fixture(scope="module")
def v4_model():
    from ds4mlx.bench.synthetic import build_synthetic_v4_flash

    return build_synthetic_v4_flash(layers=4, experts=16, overrides=NARROW)[0]  # CSA, HCA, 2 x SWA


def _steps(lm, ids, monkeypatch, how="compiled", prefill=5):
    from ds4mlx.runtime import stepper

    monkeypatch.setenv(stepper.MODE_ENV, how)
    stepper.forget(lm.model)
    s = lm.new_session(ctx=len(ids) + 80, chunk=7)
    s.prefill(ids[:prefill])
    try:
        return s, np.stack([np.array(s.decode(t)) for t in ids[prefill:]])
    finally:
        stepper.forget(lm.model)


def _fused(monkeypatch):
    """qmv_hc's launches on a faked CUDA face (its `auto_face`; the other kernels keep theirs),
    MODE 4's launch arguments as on CUDA (`affine_qmv.down_sum_shared_launch` of a caller's face)."""
    fake = StandInLaunch()
    monkeypatch.setattr(qmv_hc, "auto_face", lambda kernel, self_test: "cuda")
    monkeypatch.setattr(qmv_hc, "_kernel", fake)
    return fake


@pytest.mark.slow
def test_compiled_step_through_the_launch_matches_legacy(v4_model, monkeypatch):
    """The synthetic V4 Flash (8-bit o_b, MLX-affine experts) on a faked CUDA face for these
    launches: every layer's o_b, and every MoE's down but the last layer's, runs inside the next
    mHC site's launch, and over 64 decode steps the compiled step's logits equal those of the
    step without them (the same reference ops) and stay within 1e-4 of the legacy per-layer
    forward."""
    from ds4mlx.models import cache as row_cache

    monkeypatch.setattr(row_cache, "MIN_BUCKET", 4)
    monkeypatch.setattr(aq, "kernel_face", lambda *a, **k: "forced")  # the MoE's two launches (reference faces)
    ids = np.random.default_rng(3).integers(0, v4_model.model.args.vocab_size, 69).tolist()
    _, legacy = _steps(v4_model, ids, monkeypatch, "legacy")
    _, plain = _steps(v4_model, ids, monkeypatch)
    fake = _fused(monkeypatch)
    _, fused = _steps(v4_model, ids, monkeypatch)
    layers = len(v4_model.model.model.layers)
    plain_calls, down_calls = fake.calls["plain"], fake.calls["down"]
    assert plain_calls >= layers and plain_calls % layers == 0  # a launch per layer in each trace (bucket)
    assert down_calls == plain_calls // layers * (layers - 1)  # every MoE but the last layer's
    assert np.array_equal(fused, plain)
    assert float(np.abs(fused - legacy).max()) <= 1e-4


@pytest.mark.slow
def test_batched_rows_and_verify_chain_take_the_launch(v4_model, monkeypatch):
    """Session batching (3 sessions' step, stepper.step_rows) and a speculative verify of 3
    tokens (the chained rows) run o_b and the MoE's down inside the mHC launches too, with the
    logits of the same step without them."""
    from ds4mlx.runtime import stepper

    monkeypatch.setenv(stepper.MODE_ENV, "compiled")
    monkeypatch.setattr(aq, "kernel_face", lambda *a, **k: "forced")  # the MoE's two launches (reference faces)
    monkeypatch.setattr(qmv_hc, "AUTO_ROWS", 8)  # rows fused as once their GPU tests pass

    def run():
        stepper.forget(v4_model.model)
        sessions = []
        for b in range(3):
            s = v4_model.new_session(ctx=64)
            s.prefill([3 + b, 1, 4, 1, 5][: 3 + b])
            s.decode(2)  # the static step has run (stepper.supports_rows / supports_chain)
            sessions.append(s)
        ids = mx.array([[7, 8, 9]], mx.int32)
        assert stepper.supports_chain(v4_model.model)
        rows = stepper.step_rows(v4_model.model, [s.caches for s in sessions], ids, [len(s) for s in sessions])
        verify = sessions[0].verify([7, 8, 9])
        out = [np.stack([np.array(r.astype(mx.float32)) for r in rows]), np.array(verify.astype(mx.float32))]
        stepper.forget(v4_model.model)
        return out

    plain = run()
    fake = _fused(monkeypatch)
    fused = run()
    layers = len(v4_model.model.model.layers)
    plain_calls, down_calls = fake.calls["plain"], fake.calls["down"]
    assert plain_calls >= 3 * layers and plain_calls % layers == 0  # the one-row step's, the rows' and the chain's
    assert down_calls == plain_calls // layers * (layers - 1)
    for f, p in zip(fused, plain):
        assert np.array_equal(f, p)


# ------------------------------------------------------------------ MODE 4 (an MoE's down) and the next site


@pytest.fixture
def emulated_down(tmp_path, monkeypatch):
    return _emulate(tmp_path, monkeypatch, "down")


@pytest.mark.parametrize("tokens,norm,dtype", [(1, True, "float32"), (3, False, "float32"), (2, True, "bfloat16")])
@pytest.mark.slow_after(1)
def test_down_variant_on_the_cpu_emulation(tokens, norm, dtype, emulated_down):
    """MODE 4 (routed down + weighted sum + shared down) with the next site's hc_post and hc_pre
    tail in one launch equals the two calls on the reference face (bfloat16: against float32
    reference values, as above), one token and several (the shared expert multi-row)."""
    down, args, nrm = qmv_hc.down_problem(getattr(mx, dtype), tokens, seed=tokens)
    nrm = nrm if norm else None
    got = down.hc_post_pre(*args, **SITE, norm=nrm, backend="cuda")
    assert len(emulated_down) == 1 and emulated_down[0][1][1] == emulated_down[0][0]["PARTS"] > 1
    ref_args = qmv_hc.DownSumShared(tuple(_f32(down.args[:7])) + (tuple(_f32(down.args[7])),), down.kwargs, down.shape)
    f32norm = None if nrm is None else (nrm[0].astype(mx.float32), nrm[1])
    want = ref_args.hc_post_pre(*_f32(args), **SITE, norm=f32norm, backend="reference")
    tol = 1e-4 if dtype == "float32" else 2e-2
    for name, g, w in zip(("streams", "post", "comb", "collapsed"), got, want):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(np.array(g.astype(mx.float32)), np.array(w), rtol=tol, atol=tol, err_msg=name)


def test_down_self_test_passes_on_the_cpu_emulation_and_fails_a_wrong_kernel(emulated_down, monkeypatch):
    """The first-use self-test on the emulation (float32: the emulation holds 16-bit buffers as
    float32, and MLX's CPU reference sums 16-bit x in 16 bits) passes, and fails for a launch
    whose new streams miss the MoE's output."""
    monkeypatch.setattr(qmv_hc, "SELF_TEST_DTYPES", qmv_hc.SELF_TEST_DTYPES[:1])
    assert qmv_hc._down_self_test("cuda") and len(emulated_down) == 2
    launch = qmv_hc._kernel("down")

    def streams_unchanged(face, **kw):
        out = launch(face, **kw)
        return [kw["inputs"][len(aq.TWOBANK_INPUTS)] if i == 1 else o for i, o in enumerate(out)]

    monkeypatch.setattr(qmv_hc, "_kernel", lambda variant="plain": streams_unchanged)
    assert not qmv_hc._down_self_test("cuda")


@pytest.mark.parametrize("dt,rows", [("bfloat16", 1), ("float32", 1), ("bfloat16", 4)])
@pytest.mark.slow_after(1)
def test_down_variant_compiles_with_nvcc(dt, rows, tmp_path):
    """The down variant's CUDA translation unit at V4 Flash's MoE shape (6 of 256 experts, 2-bit
    [4096, 2048] routed downs, the 8-bit shared down, 4 streams of 4096), sm_90, warnings are errors."""
    x_dtype = getattr(mx, dt)
    tp = aq.twobank_rows_plan(4, rows, (4096, 2048, 2, 6, 2048, 8), x_dtype, "cuda") if rows > 1 else None
    tp = tp or aq.plan_down2(rows, 4096, 2048, 2, 6, 2048, 8, x_dtype=x_dtype, face="cuda")
    banks = (
        dict(mode=2, s_dtype=x_dtype, n_rows=4096, k_dim=2048, group_size=64, bits=2, ke=6),
        dict(mode=0, s_dtype=x_dtype, n_rows=4096, k_dim=2048, group_size=64, bits=8, dense=True, x_rows=rows),
    )
    tmpl = [(k, dt if k in ("T", "TS_A", "TS_B") else v) for k, v in aq.twobank_template(4, tp, x_dtype, banks)]
    f = "float32"
    tmpl += [("TP", f), ("TC", f), ("TW", dt), ("TB", f), ("TSC", f), ("HC", 4), ("ITERS", 20), ("HEAD", False)]
    tmpl += [("COLLAPSE", True), ("HC_NORM", True), ("VT", hck.PRE_THREADS), ("PARTS", tp.a.nby)]
    kinds = dict(w="uint32", w2="uint32", eids="int32", eids2="int32", wts=f, lim=f, lim2=f, post=f, comb=f)
    kinds |= dict(base=f, scale=f, eps=f, tickets="uint32")
    ins = {name: kinds.get(name, dt) for name in qmv_hc.DOWN_INPUTS}
    outs = {name: (f if name in ("part", "pre", "post2", "comb2") else dt) for name in qmv_hc.OUTPUTS}
    header, body = qmv_hc.kernel_sources("cuda", "down")
    nvcc_compile(tmp_path, mlx_cuda_source(f"affine_qmv2_down_hc_{dt}_{rows}", header, body, ins, outs, tmpl))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3])
def test_gpu_down_variant_equals_reference(tokens):
    if dispatch.gpu_backend() != "cuda":
        pytest.skip("the launch is CUDA's only")
    assert qmv_hc._down_self_test("cuda")
    for dt, tol in ((mx.float32, 1e-3), (mx.bfloat16, 3e-2)):
        down, args, nrm = qmv_hc.down_problem(dt, tokens, seed=5, d=4096)
        got = down.hc_post_pre(*args, **SITE, norm=nrm, backend="cuda")
        want = down.hc_post_pre(*args, **SITE, norm=nrm, backend="reference")
        assert all(dispatch.close_enough(g, w, rtol=tol, atol=tol) for g, w in zip(got, want))
    assert all(not b.any().item() for b in dispatch.ticket_buffers(qmv_hc.TICKETS))
