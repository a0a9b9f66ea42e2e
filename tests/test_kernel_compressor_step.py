"""One decode token through one compressor in one launch (ds4mlx/kernels/compressor_step.py).

CPU: the reference face (what the CPU runs) against the model's dynamic `Compressor.pool`
fed one token at a time (bit for bit, float32 and bfloat16) and against a float64 oracle;
the shared GPU kernel text compiled with g++ (emulated threadgroups,
test_kernel_emulation.py) against the reference face and the oracle; the CUDA face
compiled by nvcc; the compiled decode step of the tiny V4 models with a stand-in for the
launch (the kernel's inputs and outputs as `_launch` passes them) against the legacy path.
GPU (``-m gpu``): the GPU face against the reference face at V4 Flash shapes, and the
tiny models' compiled decode with the kernel on and off.

Stated bounds (float32, u = 2**-23): the window buffers, the overlap rows and every row
but the pooled one are copies (equal); the pooled row is within
``2e-5 * max(1, max |row|)`` of the float64 oracle (softmax and a sum of at most 256
terms in float32, the RMSNorm, cos / sin within a few ulps; the rope angle is computed
in float32 as MLX does, by both).
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_kernel_emulation import run_on_cpu  # noqa: E402  (tests/ is on sys.path under pytest)

from ds4mlx.kernels import compressor_step as cs
from ds4mlx.kernels import dispatch
from ds4mlx.models import cache as row_cache
from ds4mlx.models.deepseek_v4 import Compressor, CompressorState
from ds4mlx.models.layers import RMSNorm, RoPE
from ds4mlx.runtime import stepper

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import load_case, maxdiff  # noqa: E402

ROW_TOL = 2e-5


# exactness claims are about MLX's CPU kernels; `gpu` tests keep the default device
pytestmark = pytest.mark.usefixtures("cpu_unless_gpu_test")


def _np(a) -> np.ndarray:
    return np.array(a.astype(mx.float32))


# ------------------------------------------------------------------ float64 oracle


def oracle64(kv, gate, pos, state, bias, weight, eps, periods, rope_dims, mscale, m):
    """The step in float64 from float32 arrays (numpy): (new state list, pooled row).
    The gate + bias sum and the rope angle are float32, as the graph computes them."""
    overlap = len(state) == 5
    st = [np.asarray(a, np.float32)[0] if a.ndim == 3 else np.asarray(a, np.float32) for a in state]
    buf_kv, buf_gate, rows = st[0].copy(), st[1].copy(), st[-1].copy()
    d = rows.shape[-1]
    b, w0 = pos % m, pos // m
    buf_kv[b], buf_gate[b] = np.ravel(kv), np.ravel(gate)
    g32 = buf_gate + np.asarray(bias, np.float32)  # float32, as the graph's add
    new = [buf_kv.copy(), buf_gate.copy()]
    if overlap:
        ov_kv, ov_gate = st[2], st[3]
        win_kv = np.concatenate([ov_kv, buf_kv[:, d:]]).astype(np.float64)
        win_g = np.concatenate([ov_gate, g32[:, d:]]).astype(np.float64)
        done = b == m - 1
        new += [buf_kv[:, :d].copy() if done else ov_kv, g32[:, :d].copy() if done else ov_gate]
    else:
        win_kv, win_g = buf_kv.astype(np.float64), g32.astype(np.float64)
    e = np.exp(win_g - win_g.max(axis=0))
    row = ((e / e.sum(axis=0)) * win_kv).sum(axis=0)
    row = row / np.sqrt(np.mean(row**2) + eps) * np.asarray(weight, np.float64)
    nope = d - rope_dims
    theta = (np.float32(m) * np.float32(w0) * (np.float32(1.0) / np.asarray(periods, np.float32))).astype(np.float64)
    x1, x2 = row[nope::2].copy(), row[nope + 1 :: 2].copy()
    row[nope::2] = (x1 * np.cos(theta) - x2 * np.sin(theta)) * mscale
    row[nope + 1 :: 2] = (x1 * np.sin(theta) + x2 * np.cos(theta)) * mscale
    if w0 < rows.shape[0] and b == m - 1:  # an incomplete window's row is not live: kept
        rows[w0] = row
    return new + [rows], row


def check_step(got, want, pos, m, what):
    """Every array equal but the pooled row, that one within ROW_TOL * max(1, max |row|)."""
    w0 = pos // m
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g, np.float64).reshape(np.shape(w)), np.asarray(w, np.float64)
        if i < len(got) - 1:
            assert np.array_equal(g, w), (what, i)
            continue
        live = np.arange(w.shape[0]) != w0
        assert np.array_equal(g[live], w[live]), (what, "rows")
        if w0 < w.shape[0]:
            err = np.abs(g[w0] - w[w0]).max()
            assert err <= ROW_TOL * max(1.0, np.abs(w[w0]).max()), (what, float(err))


# ------------------------------------------------------------------ problems

CASES = [  # (name, ratio, dim, rope dims, overlap, cap, attention factor)
    *cs.self_test_cases(),
    ("hca_wide", 16, 96, 32, False, 4, 1.0),  # more channels than the emulation's 64 threads
]
POSITIONS = ["start", "middle", "end", "last_row", "first_window"]


def position(ratio, cap, where) -> int:
    w0 = {"last_row": cap - 1, "first_window": 0}.get(where, 1)
    b = {"start": 0, "middle": ratio // 2, "end": ratio - 1}.get(where, ratio - 1)
    return w0 * ratio + b


def problem(case, dtype=mx.float32, seed=0, fresh_overlap=False):
    _, ratio, dim, rope_dims, overlap, cap, mscale = case
    kv, gate, state, bias, norm, rope = cs.random_problem(ratio, dim, rope_dims, overlap, cap, mscale, dtype, seed)
    if overlap and fresh_overlap:  # the state before any window: zeros / -inf (CompressorState.init)
        state[2] = mx.zeros_like(state[2])
        state[3] = mx.full(state[3].shape, -mx.inf, dtype)
    return kv, gate, state, bias, norm, rope


def _oracle(case, kv, gate, pos, state, bias, norm, rope):
    _, ratio, _, rope_dims, _, _, mscale = case
    f = [np.array(a) for a in (kv, gate, bias, norm.weight, rope.periods)]
    return oracle64(f[0], f[1], pos, [np.array(a) for a in state], f[2], f[3], norm.eps, f[4], rope_dims, mscale, ratio)


# ------------------------------------------------------------------ the reference face


@pytest.mark.parametrize("overlap", [True, False], ids=["csa", "hca"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_face_equals_the_dynamic_pool(overlap, dtype):
    """Token by token through three windows and a half: the step's buffers, overlap rows and
    completed rows equal the dynamic path's (`Compressor.pool`, chunks of one) bit for bit."""
    ratio, dim, hidden = 4, 32, 24
    dt = getattr(mx, dtype)
    inv = 1.0 / (10000.0 ** (mx.arange(0, 8, 2, dtype=mx.float32) / 8))
    comp = Compressor(hidden, dim, ratio, overlap, 1e-6, RoPE(8, inv))
    key = mx.random.key(3)
    comp.position_bias = mx.random.normal(comp.position_bias.shape, key=key) * 0.3
    comp.kv_norm.weight = 1.0 + 0.1 * mx.random.normal((dim,), key=key)
    comp.set_dtype(dt)
    dyn, st = CompressorState(ratio, dim, overlap), CompressorState(ratio, dim, overlap)
    dyn.init(dt)
    st.init(dt)
    xs = mx.random.normal((1, 3 * ratio + 2, hidden), key=mx.random.key(4)).astype(dt)
    for t in range(xs.shape[1]):
        x = xs[:, t : t + 1]
        live = comp.pool(comp.kv_proj(x), comp.gate_proj(x), dyn, t)
        st.reserve(t // ratio + 1)
        new, rows, valid = comp.pool_step(
            comp.kv_proj(x), comp.gate_proj(x), mx.array(t, mx.int32), iter(st.static_arrays())
        )
        st.take_static(iter(new))
        n = (t + 1) // ratio
        assert live.shape[1] == n and np.array_equal(_np(rows[:, :n]), _np(live)), t
        assert np.array_equal(np.array(valid), np.arange(rows.shape[1]) < n)
        for a, b in (
            (st.buf_kv, dyn.buf_kv),
            (st.buf_gate, dyn.buf_gate),
            (st.ov_kv, dyn.ov_kv),
            (st.ov_gate, dyn.ov_gate),
        ):
            if a is not None:
                assert np.array_equal(_np(a), _np(b)), t


@pytest.mark.parametrize("where", POSITIONS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_reference_face_against_float64(case, where):
    kv, gate, state, bias, norm, rope = problem(case, fresh_overlap=where == "first_window")
    pos = position(case[1], case[5], where)
    got = cs.compressor_step(
        kv,
        gate,
        mx.array(pos, mx.int32),
        state,
        position_bias=bias,
        norm=norm,
        rope=rope,
        ratio=case[1],
        backend="reference",
    )
    want, _ = _oracle(case, kv, gate, pos, state, bias, norm, rope)
    check_step([np.array(g)[0] for g in got], want, pos, case[1], "reference")


# ------------------------------------------------------------------ sources


def test_metal_and_cuda_share_one_description():
    common, body = cs.shared_text()
    mh, mb = cs.kernel_sources("metal")
    ch, cb = cs.kernel_sources("cuda")
    assert mh.endswith(common) and ch.endswith(common)
    assert mb.endswith(body) and cb.endswith(body)
    for word in ("device ", "threadgroup ", "simd_sum", "as_type", " uint ", "metal::"):
        assert word not in cb, word  # the common section names metal:: only under __METAL_VERSION__
    assert "//" not in common + body and len(ch) + len(cb) < 7000  # hashed on every launch: kept short


def test_compact_keeps_code_and_drops_comments():
    text = '  a = b; // why\n\n    // a note\n#if X\n  s = "//"; // kept: a quote on the line\n'
    assert cs.compact(text) == 'a = b;\n#if X\ns = "//"; // kept: a quote on the line\n'


def test_verified_after_its_gpu_tests_passed():
    # the H200 ran this file's GPU tests on 2026-12-02 (70 face cases, the self-test, the
    # tiny models' compiled decode): the kernel no longer self-tests at first use
    assert "compressor_step" not in dispatch.UNVERIFIED_KERNELS


# ------------------------------------------------------------------ the shared GPU text, compiled for the CPU


def _emulate(tmp_path, case, kv, gate, pos, state, bias, norm, rope, threads=64, per=2):
    _, ratio, dim, rope_dims, overlap, cap, mscale = case
    common, body = cs.shared_text()
    f32 = [np.array(a, np.float32) for a in state]
    dummy = np.zeros(1, np.float32)
    units = (cap * dim + 2 * ratio * (2 if overlap else 1) * dim) * 4 // 16
    groups = 1 + -(-units // (threads * per))
    ov_shape = (ratio, dim) if overlap else (1,)
    out = run_on_cpu(
        tmp_path,
        common,
        body,
        inputs={
            "buf_kv": f32[0],
            "buf_gate": f32[1],
            "ov_kv": f32[2] if overlap else dummy,
            "ov_gate": f32[3] if overlap else dummy,
            "rows": f32[-1],
            "kv": np.array(kv),
            "gate": np.array(gate),
            "bias": np.array(bias),
            "weight": np.array(norm.weight),
            "periods": np.array(rope.periods),
            "prm": np.array([norm.eps, mscale], np.float32),
            "meta": np.array([cap], np.int32),
            "pos": np.array([pos], np.int32),
        },
        outputs={
            "buf_kv_out": (f32[0].shape[1:], np.float32),
            "buf_gate_out": (f32[1].shape[1:], np.float32),
            "ov_kv_out": (ov_shape, np.float32),
            "ov_gate_out": (ov_shape, np.float32),
            "rows_out": ((cap, dim), np.float32),
        },
        consts={
            "T": np.float32,
            "TK": np.float32,
            "TG": np.float32,
            "TB": np.float32,
            "TW": np.float32,
            "M": ratio,
            "D": dim,
            "OVERLAP": overlap,
            "ROPE": rope_dims,
            "THREADS": threads,
            "PER": per,
        },
        groups=(groups, 1, 1),
        threads=threads,
    )
    names = ["buf_kv_out", "buf_gate_out"] + (["ov_kv_out", "ov_gate_out"] if overlap else []) + ["rows_out"]
    return [out[n] for n in names]


EMU_RUNS = [  # (case index, where): both layouts, a yarn attention factor, every position kind
    (0, "end"),
    (0, "first_window"),
    (1, "middle"),
    (2, "start"),
    (3, "last_row"),
]


@pytest.mark.parametrize("ci,where", EMU_RUNS, ids=lambda v: str(v))
@pytest.mark.slow_after(1)
def test_shared_text_against_reference_and_float64(ci, where, tmp_path):
    case = CASES[ci]
    kv, gate, state, bias, norm, rope = problem(case, seed=ci, fresh_overlap=where == "first_window")
    pos = position(case[1], case[5], where)
    got = _emulate(tmp_path, case, kv, gate, pos, state, bias, norm, rope)
    want, _ = _oracle(case, kv, gate, pos, state, bias, norm, rope)
    check_step(got, want, pos, case[1], "emulated")
    ref = cs.reference(
        kv, gate, mx.array(pos, mx.int32), state, position_bias=bias, norm=norm, rope=rope, ratio=case[1]
    )
    check_step(got, [np.array(r)[0] for r in ref], pos, case[1], "emulated vs reference")


def _emulated_rows_kernel(tmp_path, launches):
    """A stand-in for cs._rows_kernel(n): the kernel's text with the rows' defines on the g++
    emulation, with the inputs, template and grid the module passes."""
    from test_kernel_emulation import emulated_launch

    common, body = cs.shared_text()

    def grid_x(template, gx):  # the emulation's state is float32: a 16-bit state's copy groups cover half of it
        return 1 + (gx - 1) * (4 // template["T"].size)

    types = ("T", "TK", "TG", "TB", "TW")
    return lambda n: emulated_launch(
        tmp_path, launches, cs.rows_defines(n) + common, body, cs.rows_io(n), float_consts=types, grid_x=grid_x
    )


@pytest.mark.parametrize("ci", [0, 1, 2])
@pytest.mark.slow_after(1)
def test_rows_wiring_on_the_cpu_emulation(ci, tmp_path, monkeypatch):
    """compressor_step_rows (session batching: B sessions' compressors of one layer in one
    launch) through the module's own inputs, template and grid, the kernel run by the g++
    emulation: row b equals the reference face on row b's own buffers (capacities differ),
    token and position (a window's end, its middle, its start)."""
    launches = []
    monkeypatch.setattr(cs, "_rows_kernel", _emulated_rows_kernel(tmp_path, launches))
    monkeypatch.setattr(cs, "THREADS", 64)
    monkeypatch.setattr(cs, "PER", 2)
    _, ratio, dim, rope_dims, overlap, cap, mscale = CASES[ci]
    probs = [
        cs.random_problem(ratio, dim, rope_dims, overlap, cap + 2 * i, mscale, mx.float32, seed=i) for i in range(3)
    ]
    ps = [ratio * (cap - 1) + ratio - 1, ratio + ratio // 2, 2 * ratio]
    _, _, _, bias, norm, rope = probs[0]
    kw = dict(position_bias=bias, norm=norm, rope=rope, ratio=ratio)
    kvs, gates, states = [p[0] for p in probs], [p[1] for p in probs], [p[2] for p in probs]
    got = cs.compressor_step_rows(kvs, gates, mx.array(ps, mx.int32), states, **kw, backend="cuda")
    assert got is not None and len(launches) == 1 and launches[0][1][1] == 3
    for g, kv, gate, st, p in zip(got, kvs, gates, states, ps):
        want = cs.reference(kv, gate, mx.array(p, mx.int32), st, **kw)
        assert len(g) == len(want)
        for a, w in zip(g, want):
            assert a.shape == w.shape
            np.testing.assert_allclose(np.array(a), np.array(w), rtol=1e-5, atol=1e-5)


def test_rows_self_test_passes_on_the_cpu_emulation(tmp_path, monkeypatch):
    """The rows variant's first-use self-test on the emulation: it passes, and fails for a
    kernel that hands row 0's state to row 1."""
    launches = []
    emulated = _emulated_rows_kernel(tmp_path, launches)
    monkeypatch.setattr(cs, "_rows_kernel", emulated)
    monkeypatch.setattr(cs, "THREADS", 64)
    monkeypatch.setattr(cs, "PER", 2)
    assert cs._rows_self_test("cuda") and launches

    def crossed(n):
        launch = emulated(n)

        def run(face, **kw):
            out = launch(face, **kw)
            return [out[i - 1] if i % n == 1 and out[i - 1].shape == out[i].shape else o for i, o in enumerate(out)]

        return run

    monkeypatch.setattr(cs, "_rows_kernel", crossed)
    assert not cs._rows_self_test("cuda")


# ------------------------------------------------------------------ the CUDA face, compiled by nvcc (no GPU)


NVCC_SHAPES = [(4, 512, True), (4, 128, True), (128, 512, False)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ratio,dim,overlap", NVCC_SHAPES)
@pytest.mark.slow_after(1)
def test_cuda_face_compiles_with_nvcc(ratio, dim, overlap, dtype, tmp_path):
    """The CUDA translation unit mx.fast.cuda_kernel builds at V4 Flash shapes (attention and
    indexer compressors of CSA, HCA), projections in float32, for sm_90 with warnings as errors."""
    from test_kernel_emulation import nvcc_compile

    family = [_cuda_source(*shape, d) for shape in NVCC_SHAPES for d in ("float32", "bfloat16")]
    nvcc_compile(tmp_path, _cuda_source(ratio, dim, overlap, dtype), family=family)


def _cuda_source(ratio, dim, overlap, dtype):
    from test_kernel_emulation import mlx_cuda_source

    f, i = "float32", "int32"
    h, b = cs.kernel_sources("cuda")
    ins = {n: dtype for n in ("buf_kv", "buf_gate", "ov_kv", "ov_gate", "rows")}
    ins.update(kv=f, gate=f, bias=dtype, weight=dtype, periods=f, prm=f, meta=i, pos=i)
    outs = {n: dtype for n in cs.OUTPUTS}
    tmpl = [
        ("T", dtype),
        ("TK", f),
        ("TG", f),
        ("TB", dtype),
        ("TW", dtype),
        ("M", ratio),
        ("D", dim),
        ("OVERLAP", overlap),
        ("ROPE", 64),
        ("THREADS", cs.THREADS),
        ("PER", cs.PER),
    ]
    return mlx_cuda_source("compressor_step", h, b, ins, outs, tmpl)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.slow_after(1)
def test_rows_cuda_face_compiles_with_nvcc(overlap, tmp_path):
    """compressor_step_rows for 4 rows at V4 Flash shapes (bfloat16 state, float32
    projections), compiled by nvcc for sm_90 with warnings as errors."""
    from test_kernel_emulation import mlx_cuda_source, nvcc_compile

    dt, f, n = "bfloat16", "float32", 4
    h, b = cs.kernel_sources("cuda", cs.rows_defines(n))
    in_names, out_names = cs.rows_io(n)
    kinds = {"kv": f, "gate": f, "meta": "int32"}
    ins = {name: kinds.get(name.rsplit("_", 1)[0], dt) for name in in_names[: 8 * n]}
    ins.update(bias=dt, weight=dt, periods=f, prm=f, poss="int32")
    tmpl = [
        ("T", dt),
        ("TK", f),
        ("TG", f),
        ("TB", dt),
        ("TW", dt),
        ("M", 4 if overlap else 128),
        ("D", 512),
        ("OVERLAP", overlap),
        ("ROPE", 64),
        ("THREADS", cs.THREADS),
        ("PER", cs.PER),
    ]
    nvcc_compile(tmp_path, mlx_cuda_source(f"compressor_step_rows{n}", h, b, ins, {o: dt for o in out_names}, tmpl))


# ------------------------------------------------------------------ the compiled decode step through the launch


class StandInKernel:
    """Takes `_launch`'s call (inputs, template, grid, output shapes) and computes its
    outputs with the reference face from those very inputs: the CPU runs the model's
    compiled step through the GPU path's plumbing."""

    def __init__(self):
        self.calls = 0

    def __call__(self, face, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        self.calls += 1
        buf_kv, buf_gate, ov_kv, ov_gate, rows, kv, gate, bias, weight, periods, prm, meta, pos = inputs
        t = dict(template)
        assert t["T"] == rows.dtype and t["M"] == bias.shape[0] and t["D"] == rows.shape[-1]
        assert int(meta[0].item()) == rows.shape[-2] and threadgroup == (cs.THREADS, 1, 1)
        assert grid[0] == cs.groups(rows.shape[-2], t["M"], t["D"], t["OVERLAP"], rows.dtype.size) * cs.THREADS
        state = [buf_kv, buf_gate, *([ov_kv, ov_gate] if t["OVERLAP"] else []), rows]
        norm = RMSNorm(t["D"], float(prm[0].item()))
        norm.weight = weight
        rope = RoPE(t["ROPE"], 1.0 / periods, float(prm[1].item()))
        out = cs.reference(kv, gate, pos, state, position_bias=bias, norm=norm, rope=rope, ratio=t["M"])
        if not t["OVERLAP"]:
            out = [out[0], out[1], mx.zeros((1,), rows.dtype), mx.zeros((1,), rows.dtype), out[2]]
        assert [tuple(o.shape) for o in out] == [tuple(s) for s in output_shapes]
        return out


@pytest.fixture
def fake_cuda(monkeypatch):
    """dispatch.backend() -> 'cuda'; the self-test cache cleared; compressor_step listed as
    unverified again (it passed its GPU tests), so the first-use self-test runs."""
    monkeypatch.setattr(dispatch, "UNVERIFIED_KERNELS", dispatch.UNVERIFIED_KERNELS | {"compressor_step"})
    monkeypatch.delenv("DS4MLX_KERNELS", raising=False)
    monkeypatch.delenv("DS4MLX_KERNEL_SELFTEST", raising=False)
    monkeypatch.setattr(dispatch, "backend", lambda device=None: "cuda")
    monkeypatch.setattr(dispatch, "_self_tests", {})
    return monkeypatch


def _garbage(face, *, output_shapes, output_dtypes, **kw):
    return [mx.full(s, 7.0, t) for s, t in zip(output_shapes, output_dtypes)]


@pytest.mark.parametrize("kernel,passes", [(_garbage, False), (StandInKernel(), True)], ids=["wrong", "right"])
def test_first_use_self_test_decides_the_face(fake_cuda, kernel, passes):
    """A wrong GPU face fails its self-test: the reference result, and the face is not used
    again; a right one passes and keeps launching."""
    fake_cuda.setattr(cs, "_kernel", lambda: kernel)
    case = CASES[0]
    kv, gate, state, bias, norm, rope = problem(case)
    pos = mx.array(position(case[1], case[5], "end"), mx.int32)
    kw = dict(position_bias=bias, norm=norm, rope=rope, ratio=case[1])
    got = cs.compressor_step(kv, gate, pos, state, **kw)
    want = cs.reference(kv, gate, pos, state, **kw)
    assert dispatch._self_tests[("compressor_step", "cuda")] is passes
    assert all(np.allclose(_np(g), _np(w), atol=1e-5) for g, w in zip(got, want))


@pytest.fixture(scope="module", params=["long", "odd"])
def v4_case(request, oracle):
    return load_case(oracle, "make_tiny_deepseek_v4.py", request.param)


def _decode(lm, ids, monkeypatch, how="compiled", prefill=5):
    monkeypatch.setenv(stepper.MODE_ENV, how)
    s = lm.new_session(ctx=len(ids) + 80, chunk=7)
    s.prefill(ids[:prefill])
    return np.stack([s.decode(t) for t in ids[prefill:]])


def test_compiled_step_through_the_launch_matches_legacy(v4_case, monkeypatch):
    """Every compressor of the tiny V4 models goes through `_launch` (a stand-in kernel on
    the CPU) in the compiled step; logits within 1e-4 of the legacy path over buckets."""
    _, lm, ref, _ = v4_case
    monkeypatch.setattr(row_cache, "MIN_BUCKET", 4)
    ids = ref["input_ids"][0].tolist()
    legacy = _decode(lm, ids, monkeypatch, "legacy")
    fake = StandInKernel()
    stepper.forget(lm.model)
    monkeypatch.setattr(cs, "_face", lambda backend: "cuda" if backend is None else backend)
    monkeypatch.setattr(cs, "_kernel", lambda: fake)
    try:
        compiled = _decode(lm, ids, monkeypatch)
    finally:
        stepper.forget(lm.model)
    types = lm.model.args.layer_types
    per_trace = sum({"compressed_sparse_attention": 2, "heavily_compressed_attention": 1}.get(t, 0) for t in types)
    assert per_trace and fake.calls % per_trace == 0 and fake.calls >= per_trace
    assert maxdiff(compiled, legacy) <= 1e-4
    assert maxdiff(compiled, ref["logits_full"][0][5:]) <= 1e-4


# ------------------------------------------------------------------ GPU faces


def _gpu_face():
    face = dispatch.gpu_backend()
    if face is None:
        pytest.skip("no MLX GPU backend")
    return face


GPU_CASES = [  # V4 Flash: the CSA attention compressor, the indexer's, HCA; caps of two buckets
    ("csa", 4, 512, 64, True, 1024, 1.0),
    ("index", 4, 128, 64, True, 256, 1.0),
    ("hca", 128, 512, 64, False, 256, 1.0),
    ("yarn", 4, 512, 64, True, 512, 0.8),
    *cs.self_test_cases(),
]


@pytest.mark.gpu
@pytest.mark.parametrize("where", POSITIONS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c[0])
def test_gpu_face_equals_reference(case, dtype, where):
    """The GPU face against the reference face (MLX ops on the same device): copies equal,
    the pooled row within float32 rounding (float32), or (bfloat16) four ulps of its largest
    entry: a sum in another order may flip a rounding of the pooled value, and the norm, the
    weight and the rope each round again."""
    face = _gpu_face()
    dt = getattr(mx, dtype)
    kv, gate, state, bias, norm, rope = problem(case, dt, seed=7, fresh_overlap=where == "first_window")
    ratio = case[1]
    pos = position(ratio, case[5], where)
    p = mx.array(pos, mx.int32)
    kw = dict(position_bias=bias, norm=norm, rope=rope, ratio=ratio)
    assert cs.supported(state, kv, gate, bias, rope)
    got = [_np(a) for a in cs.compressor_step(kv, gate, p, state, **kw, backend=face)]
    want = [_np(a) for a in cs.compressor_step(kv, gate, p, state, **kw, backend="reference")]
    w0 = pos // ratio
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape
        if i < len(got) - 1:
            assert np.array_equal(g, w), i
            continue
        live = np.arange(w.shape[1]) != w0
        assert np.array_equal(g[:, live], w[:, live])
        top = max(1.0, float(np.abs(w[0, w0]).max()))
        tol = ROW_TOL * top if dt == mx.float32 else 2.0**-5 * top  # bf16: 4 ulps of the largest entry
        assert float(np.abs(g[0, w0] - w[0, w0]).max()) <= tol


@pytest.mark.gpu
def test_gpu_self_test_passes():
    face = _gpu_face()
    assert cs._self_test(face)


@pytest.mark.gpu
def test_gpu_rows_self_test_passes():
    """compressor_step_rows (dispatch.UNVERIFIED_KERNELS until this passes on the device)."""
    face = _gpu_face()
    assert cs._rows_self_test(face)


@pytest.mark.gpu
def test_gpu_tiny_models_compiled_decode_kernel_on_vs_off(v4_case, monkeypatch):
    """The tiny V4 models' compiled decode on the GPU with the compressor kernel on and off
    (the reference face), every other kernel as the device picks: both within 1e-4 of the
    float32 oracle (MLX_ENABLE_TF32=0, as conftest sets)."""
    face = _gpu_face()
    _, lm, ref, _ = v4_case
    monkeypatch.setattr(row_cache, "MIN_BUCKET", 4)
    ids = ref["input_ids"][0].tolist()
    want = ref["logits_full"][0][5:]
    errs = []
    for chosen in (face, "reference"):
        stepper.forget(lm.model)
        monkeypatch.setattr(cs, "_face", lambda backend, c=chosen: c if backend is None else backend)
        errs.append(maxdiff(_decode(lm, ids, monkeypatch), want))
    stepper.forget(lm.model)
    assert max(errs) <= 1e-4, errs
