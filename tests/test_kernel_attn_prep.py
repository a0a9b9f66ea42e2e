"""The decode attention's prologue in one launch (ds4mlx/kernels/attn_prep.py).

CPU: the reference face against the graph the decode step ran before (RMSNorm, rope,
slice update, the indexer query's rope), with plain and YaRN ropes, host and array
positions; the shared GPU kernel text compiled with g++ (emulated threadgroups,
test_kernel_emulation.py) against the reference face; the CUDA translation unit compiled
by nvcc.  GPU (``-m gpu``): the GPU face against the reference at V4 Flash shapes, its
first-use self-test, and the compiled decode step of the tiny oracle models with every
decode kernel on against the reference faces.

Stated bound (float32): the kernel norms and ropes in float32 and rounds once; the graph
rounds after each op.  |d| <= 8 u |y| + 1e-6 per value in float32 (u = 2**-23: the sum of
squares in another order, rsqrt, sin / cos of the same float32 angle, the rotation); in
bfloat16 two ulps of the output (one rounding more or less on the way).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_kernel_emulation import run_on_cpu  # noqa: E402  (tests/ is on sys.path under pytest)
from test_kernel_selftest import fake_launches

from ds4mlx.kernels import attn_prep as ap
from ds4mlx.kernels import dispatch
from ds4mlx.models.layers import RoPE, attention_factor_from_params, default_inv_freq, inv_freq_from_params

# the face helpers of the CPU emulation (the GPU faces get them from attn_prep.TRIG and
# sparse_attention.TICKETS)
CPU_TRIG = (
    "static inline float ds4_sin(float x) { return std::sin(x); }\n"
    "static inline float ds4_cos(float x) { return std::cos(x); }\n"
)


# exactness claims are about MLX's CPU kernels; `gpu` tests keep the default device
pytestmark = pytest.mark.usefixtures("cpu_unless_gpu_test")


def make_rope(dims: int, kind: str) -> RoPE:
    """A plain rope (attention factor 1: RoPE's full-width path) or V4's YaRN one (factor 16:
    the partial path with the attention factor)."""
    if kind == "plain":
        return RoPE(dims, default_inv_freq(dims, 10000.0))
    params = {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0, "original_max_position_embeddings": 65536}
    return RoPE(dims, inv_freq_from_params(dims, params, 1 << 20), attention_factor_from_params(params, 1 << 20))


def problem(nh, d, nhi, di, w, seed, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    arrs = {
        "q_b": rng.standard_normal((1, 1, nh * d)) * 2.0,
        "kv": rng.standard_normal((1, 1, d)) * 3.0,
        "kv_w": 1.0 + 0.2 * rng.standard_normal(d),
        "iq": rng.standard_normal((1, 1, max(nhi, 1) * di)),
        "ring": rng.standard_normal((1, 1, w, d)),
    }
    out = {k: mx.array(v.astype(np.float32)) for k, v in arrs.items()}
    for k in ("q_b", "kv", "iq", "ring"):
        out[k] = out[k].astype(dtype)
    return out


def old_graph(p, pos, rope, eps, nh, nhi):
    """What `Attention._step_attend` and `CompressorBranch.step_select` ran before attn_prep."""
    d = p["ring"].shape[-1]
    q = p["q_b"].reshape(1, 1, nh, d).swapaxes(1, 2)
    q = rope(mx.fast.rms_norm(q, None, eps), offset=pos)
    kv = rope(mx.fast.rms_norm(p["kv"], p["kv_w"].astype(p["kv"].dtype), eps)[:, None], offset=pos)
    w = p["ring"].shape[2]
    ring = mx.slice_update(p["ring"], kv.astype(p["ring"].dtype), (pos % w).reshape(1), axes=(2,))
    iq = None
    if nhi:
        di = p["iq"].shape[-1] // nhi
        iq = rope(p["iq"].reshape(1, 1, nhi, di).swapaxes(1, 2), offset=pos)
    return q, ring, iq


def bound(want: np.ndarray) -> np.ndarray:
    return 8 * 2.0**-23 * np.abs(want) + 1e-6


# ------------------------------------------------------------------ reference face vs the old graph


@pytest.mark.parametrize("kind", ["plain", "yarn"])
@pytest.mark.parametrize("pos", [0, 5, 37])
def test_reference_is_the_old_graph(kind, pos):
    nh, d, nhi, di, w = 3, 40, 2, 16, 8
    rope = make_rope(8, kind)
    p = problem(nh, d, nhi, di, w, seed=pos)
    for at in (pos, mx.array(pos, mx.int32)):
        got = ap.attn_prep(
            p["q_b"], p["kv"], p["kv_w"], p["ring"], at, rope, 1e-6, p["iq"], heads=nh, index_heads=nhi,
            backend="reference",
        )  # fmt: skip
        want = old_graph(p, mx.array(pos, mx.int32), rope, 1e-6, nh, nhi)
        for g, x in zip(got, want):
            assert g.shape == x.shape and g.dtype == x.dtype
            assert np.array_equal(np.array(g), np.array(x))
    q, ring, iq = ap.attn_prep(p["q_b"], p["kv"], p["kv_w"], p["ring"], pos, rope, 1e-6, heads=nh, backend="reference")
    assert iq is None


def test_fusable_widths():
    assert ap.fusable(make_rope(64, "yarn"), 512, 128)
    assert not ap.fusable(make_rope(8, "plain"), 41)  # odd head: a rope pair would straddle lanes
    assert not ap.fusable(make_rope(8, "plain"), 6)


# ------------------------------------------------------------------ sources


def test_metal_and_cuda_share_one_description():
    sec = dispatch.sections(ap.SOURCE)
    mh, mb = ap.kernel_sources("metal")
    ch, cb = ap.kernel_sources("cuda")
    assert mb.endswith(sec["attn_prep"]) and cb.endswith(sec["attn_prep"])
    for word in ("device ", "threadgroup ", "simd_sum", "as_type", " uint ", "metal::"):
        assert word not in ch + cb, word
    assert "ds4_sin" in mh and "ds4_sin" in ch


# ------------------------------------------------------------------ the shared GPU text, compiled for the CPU


def emulate(tmp_path, p, pos, rope, eps, nh, nhi, threads=64, per=4):
    """Run the kernel text on the CPU with the launch `attn_prep` makes (fewer threads)."""
    d, w = p["ring"].shape[-1], p["ring"].shape[2]
    di = p["iq"].shape[-1] // max(nhi, 1)
    warps = threads // 32
    row_tgs = -(-(nh + 1 + nhi) // warps)
    copy_tgs = -(-(w * d) // (threads * per))
    f = lambda a: np.array(a.astype(mx.float32)).reshape(-1)  # noqa: E731
    freqs = np.array(rope.periods) if rope.dims else np.zeros(1, np.float32)
    sec = dispatch.sections(ap.SOURCE)
    out = run_on_cpu(
        tmp_path,
        CPU_TRIG + ap.ONE,
        sec["attn_prep"],
        inputs={
            "q": f(p["q_b"]),
            "kv": f(p["kv"]),
            "kv_w": f(p["kv_w"]),
            "iq": f(p["iq"]),
            "ring": f(p["ring"]),
            "freqs": freqs.astype(np.float32),
            "prm": np.array([eps, rope.attention_factor], np.float32),
            "meta": np.array([pos], np.int32),
        },
        outputs={
            "q_out": ((nh * d,), np.float32),
            "ring_out": ((w * d,), np.float32),
            "iq_out": ((max(nhi, 1) * di,), np.float32),
        },
        consts={
            "TQ": np.float32,
            "TKV": np.float32,
            "TWN": np.float32,
            "TI": np.float32,
            "TR": np.float32,
            "NH": nh,
            "D": d,
            "NHI": nhi,
            "DI": di,
            "W": w,
            "RD": rope.dims,
            "THREADS": threads,
            "PER": per,
        },
        groups=(row_tgs + copy_tgs, 1, 1),
        threads=threads,
    )
    return out["q_out"], out["ring_out"], out["iq_out"]


EMU_CASES = [  # (nh, d, rope dims, nhi, di, window, pos, rope kind)
    (3, 40, 8, 2, 16, 8, 37, "yarn"),  # past the ring's first lap, attention factor
    (3, 40, 8, 2, 16, 8, 3, "plain"),  # ring not full yet
    (5, 72, 16, 0, 2, 5, 12, "yarn"),  # no indexer (sliding / HCA); more pairs than a lane's first round
    (2, 16, 16, 3, 16, 4, 9, "plain"),  # rope on every channel
    (2, 24, 0, 1, 8, 4, 6, "plain"),  # no rope
]


@pytest.mark.parametrize("case", EMU_CASES, ids=lambda c: "nh{}_d{}_rd{}_nhi{}_di{}_w{}_p{}_{}".format(*c))
@pytest.mark.slow_after(1)
def test_shared_text_matches_reference(case, tmp_path):
    nh, d, rd, nhi, di, w, pos, kind = case
    rope = make_rope(rd, kind) if rd else RoPE(0, mx.zeros((0,)))
    p = problem(nh, d, nhi, di, w, seed=nh * d + pos)
    q, ring, iq = emulate(tmp_path, p, pos, rope, 1e-6, nh, nhi)
    want = ap.attn_prep(
        p["q_b"], p["kv"], p["kv_w"], p["ring"], pos, rope, 1e-6, p["iq"] if nhi else None, heads=nh,
        index_heads=nhi, backend="reference",
    )  # fmt: skip
    wq, wring = np.array(want[0]).reshape(-1), np.array(want[1]).reshape(-1)
    assert np.all(np.abs(q - wq) <= bound(wq))
    assert np.all(np.abs(ring - wring) <= bound(wring))  # every slot: the copy and the new row
    if nhi:
        wi = np.array(want[2]).reshape(-1)
        assert np.all(np.abs(iq - wi) <= bound(wi))


# ------------------------------------------------------------------ the CUDA face, compiled by nvcc (no GPU)


@pytest.mark.parametrize(
    "act,ring,nhi", [("float32", "float32", 64), ("bfloat16", "bfloat16", 64), ("float32", "bfloat16", 0)]
)
@pytest.mark.slow_after(1)
def test_cuda_face_compiles_with_nvcc(act, ring, nhi, tmp_path):
    """The exact CUDA translation unit mx.fast.cuda_kernel builds at V4 Flash shapes (64 heads
    of 512, indexer 64 x 128, window 128, rope 64), compiled for sm_90 with warnings as errors."""
    from test_kernel_emulation import mlx_cuda_source, nvcc_compile

    h, b = ap.kernel_sources("cuda")
    f = "float32"
    ins = {"q": act, "kv": act, "kv_w": f, "iq": act, "ring": ring, "freqs": f, "prm": f, "meta": "int32"}
    outs = {"q_out": act, "ring_out": ring, "iq_out": act}
    nvcc_compile(tmp_path, mlx_cuda_source("attn_prep", h, b, ins, outs, _nvcc_template(act, f, ring, nhi)))


def _nvcc_template(act: str, weight: str, ring: str, nhi: int) -> list:
    """attn_prep's template arguments at V4 Flash shapes (64 heads of 512, indexer nhi x 128,
    window 128, rope 64)."""
    types = [("TQ", act), ("TKV", act), ("TWN", weight), ("TI", act), ("TR", ring)]
    sizes = [("NH", 64), ("D", 512), ("NHI", nhi), ("DI", 128), ("W", 128), ("RD", 64)]
    return types + sizes + [("THREADS", ap.THREADS), ("PER", ap.COPY_PER)]


# ------------------------------------------------------------------ GPU faces


def _emulated_rows_kernel(tmp_path, launches, chain: bool = False):
    """A stand-in for ap._rows_kernel(n) (chain: ap._chain_kernel(n)): the kernel's text with the
    rows' (the chain's) defines on the g++ emulation, with the inputs, template and grid the
    module passes."""
    from test_kernel_emulation import emulated_launch

    body = dispatch.sections(ap.SOURCE)["attn_prep"]
    types = ("TQ", "TKV", "TWN", "TI", "TR")
    io = ap.chain_io if chain else ap.rows_io
    return lambda n: emulated_launch(
        tmp_path, launches, CPU_TRIG + ap.rows_defines(n, chain=chain), body, io(n), float_consts=types
    )


@pytest.mark.parametrize("nhi", [2, 0])
@pytest.mark.parametrize("rd,kind", [(8, "yarn"), (0, "plain")])
@pytest.mark.slow_after(1)
def test_rows_wiring_on_the_cpu_emulation(nhi, rd, kind, tmp_path, monkeypatch):
    """attn_prep_rows (session batching: B sessions' tokens of a layer in one launch) through
    the module's own inputs, template and grid, the kernel run by the g++ emulation: row b
    equals the reference on row b's own projections, ring and position."""
    launches = []
    monkeypatch.setattr(ap, "_rows_kernel", _emulated_rows_kernel(tmp_path, launches))
    monkeypatch.setattr(ap, "THREADS", 64)
    rope = make_rope(rd, kind) if rd else RoPE(0, mx.zeros((0,)))
    nh, d, di, w, n = 3, 40, 16, 8, 3
    k = mx.random.split(mx.random.key(3), 5)
    q_b, kv = mx.random.normal((1, n, nh * d), key=k[0]), mx.random.normal((1, n, d), key=k[1])
    iq = mx.random.normal((1, n, nhi * di), key=k[2]) if nhi else None
    weight = 1.0 + 0.1 * mx.random.normal((d,), key=k[3])
    rings = [mx.random.normal((1, 1, w, d), key=kk) for kk in mx.random.split(k[4], n)]
    poss = mx.array([37, 3, 12], mx.int32)
    got = ap.attn_prep_rows(q_b, kv, weight, rings, poss, rope, 1e-6, iq, heads=nh, index_heads=nhi, backend="cuda")
    assert got is not None and len(launches) == 1 and launches[0][1][1] == n
    for b in range(n):
        row = slice(b, b + 1)
        ib = None if iq is None else iq[:, row]
        want = ap.reference(
            q_b[:, row], kv[:, row], weight, rings[b], poss[b], rope, 1e-6, ib, heads=nh, index_heads=nhi
        )
        mine = [got[0][row], got[1][b]] + ([got[2][row]] if nhi else [])
        assert nhi or got[2] is None
        for g, w_ in zip(mine, want):
            assert g.shape == w_.shape
            np.testing.assert_allclose(np.array(g), np.array(w_), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chain", [False, True], ids=["rows", "chain"])
def test_rows_and_chain_self_tests_on_the_cpu_emulation(chain, tmp_path, monkeypatch):
    """The rows and chain variants' first-use self-tests on the emulation: each passes, and
    fails for a kernel that gives every row (every token) row 0's (the first token's) ring
    (a chain's token t must see the ring the tokens before it left)."""
    kernel, self_test = ("_chain_kernel", ap._chain_self_test) if chain else ("_rows_kernel", ap._rows_self_test)
    launches = []
    emulated = _emulated_rows_kernel(tmp_path, launches, chain)
    monkeypatch.setattr(ap, kernel, emulated)
    monkeypatch.setattr(ap, "THREADS", 64)
    rope = make_rope(8, "yarn")
    assert self_test("cuda", rope) and launches

    def same_ring(n):
        launch = emulated(n)

        def run(face, **kw):
            out = launch(face, **kw)
            return [out[0], *[out[1]] * n, out[-1]]

        return run

    monkeypatch.setattr(ap, kernel, same_ring)
    assert not self_test("cuda", rope)


@pytest.mark.parametrize("nhi", [64, 0])
@pytest.mark.slow_after(1)
def test_rows_cuda_face_compiles_with_nvcc(nhi, tmp_path):
    """attn_prep_rows for 4 rows at V4 Flash shapes (bfloat16), compiled by nvcc for sm_90 with
    warnings as errors."""
    _nvcc_compile_multi(ap._rows_kernel, "rows", nhi, tmp_path)


def _nvcc_compile_multi(make_kernel, kind: str, nhi: int, tmp_path):
    """nvcc (sm_90, warnings are errors) on the rows or chain kernel for 4 rows / tokens at V4
    Flash shapes, bfloat16."""
    from test_kernel_emulation import mlx_cuda_source, nvcc_compile

    dt, n = "bfloat16", 4
    kern = make_kernel(n)
    h, b = kern.source("cuda")
    ins = {name: dt for name in kern.input_names}
    ins.update(freqs="float32", prm="float32", poss="int32")
    tmpl = _nvcc_template(dt, dt, dt, nhi)
    nvcc_compile(tmp_path, mlx_cuda_source(f"attn_prep_{kind}{n}", h, b, ins, {o: dt for o in kern.output_names}, tmpl))


def _chain_problem(n, nh, d, nhi, di, w, seed):
    k = mx.random.split(mx.random.key(seed), 5)
    q_b, kv = mx.random.normal((1, n, nh * d), key=k[0]), mx.random.normal((1, n, d), key=k[1])
    iq = mx.random.normal((1, n, nhi * di), key=k[2]) if nhi else None
    weight = 1.0 + 0.1 * mx.random.normal((d,), key=k[3])
    return q_b, kv, weight, mx.random.normal((1, 1, w, d), key=k[4]), iq


@pytest.mark.parametrize("nhi", [2, 0])
@pytest.mark.parametrize("n,start", [(4, 37), (3, 2), (5, 3)])  # wraps the ring of 8; first lap; wraps at 5 / 8
@pytest.mark.slow_after(1)
def test_chain_wiring_on_the_cpu_emulation(nhi, n, start, tmp_path, monkeypatch):
    """attn_prep_chain (a verify's T tokens of one session in one launch) through the module's
    own inputs, template and grid, the kernel run by the g++ emulation: token t's query, indexer
    query and ring equal the reference attn_prep of token t over the ring token t - 1 left."""
    launches = []
    monkeypatch.setattr(ap, "_chain_kernel", _emulated_rows_kernel(tmp_path, launches, chain=True))
    monkeypatch.setattr(ap, "THREADS", 64)
    rope = make_rope(8, "yarn")
    nh, d, di, w = 3, 40, 16, 8
    q_b, kv, weight, ring, iq = _chain_problem(n, nh, d, nhi, di, w, seed=n + start)
    poss = mx.arange(start, start + n, dtype=mx.int32)
    kw = dict(heads=nh, index_heads=nhi)
    got = ap.attn_prep_chain(q_b, kv, weight, ring, poss, rope, 1e-6, iq, **kw, backend="cuda")
    assert got is not None and len(launches) == 1 and launches[0][1][1] == n
    assert nhi or got[2] is None
    for t, want in enumerate(ap.chain_reference(q_b, kv, weight, ring, poss, rope, 1e-6, iq, **kw)):
        row = slice(t, t + 1)
        mine = [got[0][row], got[1][t]] + ([got[2][row]] if nhi else [])
        for g, w_ in zip(mine, want):
            assert g.shape == w_.shape
            np.testing.assert_allclose(np.array(g), np.array(w_), rtol=1e-5, atol=1e-5)


def test_chain_declines_what_one_launch_cannot_take():
    """One token, or more tokens than the ring has slots (two would share one): None, the
    caller's per-token launches."""
    rope = make_rope(8, "yarn")
    for n, w in ((1, 8), (5, 4)):
        q_b, kv, weight, ring, _ = _chain_problem(n, 3, 40, 0, 16, w, seed=1)
        poss = mx.arange(9, 9 + n, dtype=mx.int32)
        assert ap.attn_prep_chain(q_b, kv, weight, ring, poss, rope, 1e-6, heads=3, backend="cuda") is None


@pytest.mark.parametrize("nhi", [64, 0])
@pytest.mark.slow_after(1)
def test_chain_cuda_face_compiles_with_nvcc(nhi, tmp_path):
    """attn_prep_chain for 4 tokens at V4 Flash shapes (bfloat16), compiled by nvcc for sm_90
    with warnings as errors."""
    _nvcc_compile_multi(ap._chain_kernel, "chain", nhi, tmp_path)


def _gpu_face():
    face = dispatch.gpu_backend()
    if face is None:
        pytest.skip("no MLX GPU backend")
    return face


GPU_CASES = [  # (nh, d, rope dims, nhi, di, window, pos, dtype, ring dtype)
    (64, 512, 64, 64, 128, 128, 2049, "float32", "float32"),  # V4 Flash CSA layer
    (64, 512, 64, 64, 128, 128, 32771, "bfloat16", "bfloat16"),
    (64, 512, 64, 0, 128, 128, 70, "float32", "bfloat16"),  # sliding / HCA, ring not full
    (3, 40, 8, 2, 16, 8, 37, "float32", "float32"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "nh{}_d{}_rd{}_nhi{}_di{}_w{}_p{}_{}_{}".format(*c))
def test_gpu_face_matches_reference(case):
    face = _gpu_face()
    nh, d, rd, nhi, di, w, pos, dtype, rdt = case
    rope = make_rope(rd, "yarn")
    p = problem(nh, d, nhi, di, w, seed=pos, dtype=getattr(mx, dtype))
    p["ring"] = p["ring"].astype(getattr(mx, rdt))
    at = mx.array(pos, mx.int32)
    args = (p["q_b"], p["kv"], p["kv_w"], p["ring"], at, rope, 1e-6, p["iq"] if nhi else None)
    got = ap.attn_prep(*args, heads=nh, index_heads=nhi, backend=face)
    # the kernel computes in float32 and rounds once, so its reference is the float32 graph
    # on the same (bfloat16) inputs; the bfloat16 graph rounds after every op, and where the
    # rope's rotation cancels its error is relative to the inputs, not to the output (the
    # bfloat16 case at position 32771 exceeded two output ulps of it on 2026-12-02)
    f32 = tuple(a.astype(mx.float32) if isinstance(a, mx.array) and a.dtype == mx.bfloat16 else a for a in args)
    with mx.stream(mx.cpu):
        want = ap.attn_prep(*f32, heads=nh, index_heads=nhi, backend="reference")
    for g, x in zip(got, want):
        if x is None:
            assert g is None
            continue
        assert g.shape == x.shape
        g32, x32 = np.array(g.astype(mx.float32)), np.array(x.astype(mx.float32))
        tol = bound(x32)
        if rd:  # the angle pos / period in float32 is itself off by up to one ulp of pos (2**-8 at
            # 32771), which a rotation turns into that many radians of the row's largest value
            ulp_pos = 2.0 ** (np.floor(np.log2(max(pos, 1))) - 23)
            tol = tol + ulp_pos * np.max(np.abs(x32), axis=-1, keepdims=True)
        if g.dtype == mx.bfloat16:  # plus the one rounding to bfloat16: half an ulp, one allowed
            tol = tol + 2.0 ** (np.floor(np.log2(np.maximum(np.abs(x32), 1e-30))) - 7)
        else:
            assert x.dtype == mx.float32
        excess = np.abs(g32 - x32) - tol
        assert np.all(excess <= 0), (float(np.max(excess)), int(np.sum(excess > 0)), x32.size)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["plain", "yarn"])
@pytest.mark.parametrize(
    "self_test", ["_self_test", "_rows_self_test", "_chain_self_test"], ids=["one", "rows", "chain"]
)
def test_gpu_self_tests_pass(self_test, kind):
    """attn_prep's first-use self-tests, the rows' and the chain's (each of those stays in
    dispatch.UNVERIFIED_KERNELS until this passes on the device), accept the GPU face."""
    face = _gpu_face()
    assert getattr(ap, self_test)(face, make_rope(64, kind))


@pytest.mark.gpu
def test_gpu_chain_matches_reference_at_v4_shapes():
    """attn_prep_chain of 4 tokens at V4 Flash's sliding-layer shapes (64 heads of 512, window
    128, rope 64) across the ring's wrap, against the float32 reference chain."""
    face = _gpu_face()
    rope, n = make_rope(64, "yarn"), 4
    q_b, kv, weight, ring, _ = _chain_problem(n, 64, 512, 0, 128, 128, seed=5)
    poss = mx.arange(2046, 2046 + n, dtype=mx.int32)  # slots 126, 127, 0, 1
    got = ap.attn_prep_chain(q_b, kv, weight, ring, poss, rope, 1e-6, heads=64, backend=face)
    with mx.stream(mx.cpu):
        want = ap.chain_reference(q_b, kv, weight, ring, poss, rope, 1e-6, heads=64)
    ulp_pos = 2.0 ** (np.floor(np.log2(2049)) - 23)  # the float32 angle's error (test_gpu_face_matches_reference)
    for t, (wq, wring, _) in enumerate(want):
        for g, x in ((got[0][t : t + 1], wq), (got[1][t], wring)):
            x32 = np.array(x)
            tol = bound(x32) + ulp_pos * np.max(np.abs(x32), axis=-1, keepdims=True)
            assert np.all(np.abs(np.array(g) - x32) <= tol)


# ------------------------------------------------------------------ first-use self-test (a simulated GPU face, CPU)


@pytest.mark.parametrize("behaviour", ["raise", "garbage"])
def test_bad_face_falls_back_to_reference(fake_gpu, behaviour, caplog):
    import logging

    fake_launches(fake_gpu, ap, behaviour)
    rope = make_rope(8, "yarn")
    p = problem(3, 40, 2, 16, 8, seed=1)
    args = (p["q_b"], p["kv"], p["kv_w"], p["ring"], mx.array(13, mx.int32), rope, 1e-6, p["iq"])
    with caplog.at_level(logging.WARNING, logger="ds4mlx.kernels"):
        got = ap.attn_prep(*args, heads=3, index_heads=2)  # automatic face
    want = ap.attn_prep(*args, heads=3, index_heads=2, backend="reference")
    for g, x in zip(got, want):
        assert np.array_equal(np.array(g), np.array(x))
    assert "attn_prep" in caplog.text and "failed its first-use self-test" in caplog.text
    assert dispatch._self_tests[("attn_prep", "metal")] is False


# ------------------------------------------------------------------ the compiled decode step on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["long", "odd"])
def test_gpu_compiled_decode_kernels_on_vs_reference(config, oracle, monkeypatch):
    """The tiny oracle models' compiled decode step (64+ steps across the window, compression
    boundaries, top-k selection and bucket resizes) with every decode kernel on (attn_prep,
    index_score_heads, the split attend with its rope epilogue, hyper-connections, ...) and
    with the reference faces: both within 1e-4 of each other and of the transformers oracle.
    Needs MLX_ENABLE_TF32=0 (conftest sets it): TF32 noise flips indexer near-ties."""
    import os

    from parity_helpers import load_case, maxdiff

    from ds4mlx.models import cache as row_cache
    from ds4mlx.runtime import stepper

    _gpu_face()
    if os.environ.get("MLX_ENABLE_TF32") != "0":
        pytest.skip("needs MLX_ENABLE_TF32=0")
    monkeypatch.setattr(row_cache, "MIN_BUCKET", 4)
    monkeypatch.setenv(stepper.MODE_ENV, "compiled")
    _, lm, ref, _ = load_case(oracle, "make_tiny_deepseek_v4.py", config)
    ids = ref["input_ids"][0].tolist()

    def run(face):
        stepper.forget(lm.model)
        with dispatch.use_face(face):
            s = lm.new_session(ctx=len(ids) + 80, chunk=7)
            s.prefill(ids[:5])
            out = np.stack([s.decode(t) for t in ids[5:]])
        stepper.forget(lm.model)
        return out

    on, off = run(None), run("reference")
    assert maxdiff(on, off) <= 1e-4
    assert maxdiff(on, ref["logits_full"][0][5:]) <= 1e-4
