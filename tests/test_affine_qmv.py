"""Affine quantized mat-vec (ds4mlx.kernels.affine_qmv): the reference face against
numpy on the CPU, the shared GPU kernel text through the g++ threadgroup emulation
(every mode, bit width and group size, ragged shapes), the CUDA translation unit
through nvcc, and (``-m gpu``) the CUDA face against the reference on the H200."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from ds4mlx.bench.kernels import QMV_PLAN_VARIANTS
from ds4mlx.kernels import affine_qmv as aq
from ds4mlx.kernels import dispatch

# exactness claims are about MLX's CPU kernels; `gpu` tests keep the default device
pytestmark = pytest.mark.usefixtures("cpu_unless_gpu_test")


def quantized(rng, e, rows, k, gs, bits):
    """(w, scales, biases) as mx.quantize packs them, as numpy arrays, plus the float64 weights."""
    wf = mx.array((rng.standard_normal((e, rows, k)) * 0.05).astype(np.float32))
    wq, sc, bi = mx.quantize(wf, gs, bits)
    wq, sc, bi = np.array(wq), np.array(sc), np.array(bi)
    return wq, sc, bi, dequant(wq, sc, bi, gs, bits)


def dequant(wq, sc, bi, gs, bits):
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits).astype(np.uint32)
    q = (wq[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    q = q.reshape(*wq.shape[:-1], -1).astype(np.float64)
    s = np.repeat(sc.astype(np.float64), gs, axis=-1)
    b = np.repeat(bi.astype(np.float64), gs, axis=-1)
    return s * q + b


def bound(w, x, sc, gs, bits, sw):
    """The stated error of the kernel text for one output row set: float32 sums of |w x|
    terms, plus (SEG + 8) * 2^-23 * 2^SW * |scale| |x| per value for the level trick."""
    seg = min(128 // bits, gs)
    s = np.repeat(np.abs(sc.astype(np.float64)), gs, axis=-1)
    x = np.abs(x.astype(np.float64))
    return (w.shape[-1] + 8) * 2.0**-23 * (np.abs(w) @ x) + (seg + 8) * 2.0**-23 * 2.0**sw * (s @ x)


# ------------------------------------------------------------------ reference face (CPU)


@pytest.mark.parametrize("bits,gs", [(2, 32), (4, 64), (8, 128)])
def test_reference_matches_numpy(bits, gs):
    rng = np.random.default_rng(bits)
    wq, sc, bi, wd = quantized(rng, 3, 6, 256, gs, bits)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    h = rng.standard_normal((2, 2, 256)).astype(np.float32)
    ids = np.array([[0, 2], [1, 1]], np.int32)
    wts = np.array([[0.3, 0.7], [0.5, 0.5]], np.float32)
    A = lambda a: mx.array(a)  # noqa: E731
    y = aq.qmv(A(x), A(wq[0]), A(sc[0]), A(bi[0]), group_size=gs, bits=bits)
    np.testing.assert_allclose(np.array(y), x @ wd[0].T, rtol=1e-4, atol=1e-4)
    g = aq.gather_qmv(A(x), A(wq), A(sc), A(bi), A(ids), group_size=gs, bits=bits)
    np.testing.assert_allclose(np.array(g), np.einsum("tjrk,tk->tjr", wd[ids], x), rtol=1e-4, atol=1e-4)
    s = aq.gather_swiglu(A(x), A(wq), A(sc), A(bi), A(ids), limit=0.5, group_size=gs, bits=bits)
    gu = np.einsum("tjrk,tk->tjr", wd[ids], x)
    gt, up = np.minimum(gu[..., :3], 0.5), np.clip(gu[..., 3:6], -0.5, 0.5)
    np.testing.assert_allclose(np.array(s), gt / (1 + np.exp(-gt)) * up, rtol=1e-4, atol=1e-5)
    d = aq.gather_down_sum(A(h), A(wq), A(sc), A(bi), A(ids), A(wts), group_size=gs, bits=bits)
    want = np.einsum("tj,tjrk,tjk->tr", wts, wd[ids], h)
    np.testing.assert_allclose(np.array(d), want, rtol=1e-4, atol=1e-4)


def test_backend_is_reference_on_cpu():
    assert dispatch.backend() == "reference"


def test_supported_shapes():
    assert aq.supported(4096, 64, 2) and aq.supported(4096, 32, 4) and aq.supported(2048, 128, 8)
    assert not aq.supported(4096, 64, 3)  # 3-bit: not a 16-byte chunk of whole words
    assert not aq.supported(100, 32, 4)  # K not a multiple of the group
    assert not aq.supported(1 << 15, 64, 8, "metal")  # x does not fit the 32 KB of threadgroup memory


# ------------------------------------------------------------------ the shared text on the CPU (g++)

# the emulation prelude has float4 / uint4 (dispatch.PRELUDE's faces have float2 built in)
_CPU_EXTRA = "struct float2 { float x, y; };\n"


def run_text_on_cpu(tmp_path, mode, x, wq, sc, bi, eids, wts, lim, *, gs, bits, pl, warps, x_div=1, ke=1, dense=False):
    """The shared text with launch plan `pl` (aq.Plan) on `warps` warps, float32 x (dense: one
    matrix, wq [1, N, K/..], no ids read)."""
    from test_kernel_emulation import run_on_cpu

    e, n_rows, _ = wq.shape
    k_dim = x.shape[-1]
    out_rows = n_rows // 2 if mode == 1 else n_rows
    p = eids.size // ke
    opw = pl.rpw // 2 if mode == 1 else pl.rpw
    assert pl.nby * (warps // pl.ksplit) * pl.maxit >= (1 if mode == 2 else x_div) * -(-out_rows // opw)
    sec = dispatch.sections(aq.SOURCE)
    out = run_on_cpu(
        tmp_path,
        _CPU_EXTRA + sec["common"],
        aq.qmv_text(),
        inputs={
            "x": x,
            "w": wq.reshape(-1).astype(np.uint32),
            "scales": sc.reshape(-1).astype(np.float32),
            "biases": bi.reshape(-1).astype(np.float32),
            "eids": eids.reshape(-1).astype(np.int32),
            "wts": wts.reshape(-1).astype(np.float32),
            "lim": np.array([lim, 1.0, 0.0], np.float32),
            "nw": np.ones(1, np.float32),  # NORM 0: not read
        },
        outputs={"y": ((p, out_rows), np.float32)},
        consts={
            "T": np.float32,
            "TS": np.float32,
            "N_ROWS": n_rows,
            "K_DIM": k_dim,
            "BITS": bits,
            "GS": gs,
            "WARPS": warps,
            "KSPLIT": pl.ksplit,
            "RPW": pl.rpw,
            "MAXIT": pl.maxit,
            "NBY": pl.nby,
            "X_DIV": x_div,
            "MODE": mode,
            "KE": ke,
            "SW": pl.sw,
            "DENSE": int(dense),
            "NORM": 0,
            "XR": pl.xr,
            "KSL": pl.ksl,
            "XROWS": p if pl.xr > 1 else 0,
        },
        groups=(1, pl.nby, pl.nz),
        threads=32 * warps,
    )
    return out["y"]


def _plan(ksplit, rpw, maxit, nby, nz, sw, chunks, mode=0):
    lanes = 32 if mode == 2 else 32 * ksplit
    return aq.Plan(ksplit, -(-chunks // lanes), rpw, maxit, nby, nz, sw)


CPU_CASES = [
    # (bits, gs, E, rows, K, warps, ksplit, rpw, maxit, nby, sw): ragged rows and row tiles, 1..3
    # chunks per lane, split-K 1..4 (lanes past the row's end), several steps per warp
    (2, 32, 3, 5, 512, 2, 1, 2, 2, 1, 4),  # 8 chunks: 24 lanes idle; 2 steps, rows past the end
    (2, 64, 2, 9, 2048, 4, 2, 4, 1, 2, 4),  # split-K 2, one full step; 3 units on 4 warp rows
    (2, 128, 2, 4, 4608, 2, 2, 2, 1, 2, 8),  # split-K 2, 2.25 chunks a lane (a partial last one)
    (2, 64, 3, 21, 1024, 2, 1, 4, 3, 1, 8),  # many rows: 3 steps of 2 warps x 4 rows
    (4, 32, 3, 7, 384, 1, 1, 4, 2, 1, 4),
    (4, 64, 2, 6, 1024, 4, 1, 2, 1, 2, 8),  # 32 chunks, 4 warp rows, 2 threadgroups (one idle)
    (4, 128, 2, 3, 3072, 4, 4, 2, 1, 2, 4),  # split-K 4: 96 chunks on 128 lanes
    (8, 32, 2, 5, 256, 2, 2, 2, 3, 1, 8),  # split-K 2 with lanes idle, 3 steps
    (8, 64, 2, 3, 1024, 4, 2, 4, 1, 1, 8),
    (8, 128, 2, 17, 896, 2, 1, 2, 3, 2, 8),  # 2 threadgroups x 2 warps x 3 steps (rows past the end)
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "b{}_g{}_E{}_r{}_K{}_W{}_S{}_R{}_M{}_B{}_SW{}".format(*c))
@pytest.mark.slow_after(1)
def test_shared_text_plain_on_cpu(case, tmp_path):
    bits, gs, e, rows, k_dim, warps, ksplit, rpw, maxit, nby, sw = case
    rng = np.random.default_rng(rows * k_dim + bits)
    wq, sc, bi, wd = quantized(rng, e, rows, k_dim, gs, bits)
    ids = rng.integers(0, e, (2, 2)).astype(np.int32)
    xx = rng.standard_normal((4, k_dim)).astype(np.float32) * 3.0  # pair p reads x row p
    pl = _plan(ksplit, rpw, maxit, nby, 4, sw, k_dim * bits // 128)
    got = run_text_on_cpu(
        tmp_path, 0, xx, wq, sc, bi, ids, np.ones(1), 0.0, gs=gs, bits=bits, pl=pl, warps=warps, x_div=1
    ).reshape(2, 2, rows)
    for t in range(2):
        for j in range(2):
            w = wd[ids[t, j]]
            want = w @ xx[2 * t + j].astype(np.float64)
            err = np.abs(got[t, j] - want)
            assert np.all(err <= bound(w, xx[2 * t + j], sc[ids[t, j]], gs, bits, sw)), (t, j, err.max())


def test_shared_text_dense_on_cpu(tmp_path):
    """DENSE: one matrix for every x row, the ids never read (7 would be out of bounds:
    AddressSanitizer fails the run), split K over 4 warps, rows past the end."""
    bits, gs, rows, k_dim = 8, 64, 13, 2048
    rng = np.random.default_rng(4)
    wq, sc, bi, wd = quantized(rng, 1, rows, k_dim, gs, bits)
    x = rng.standard_normal((3, k_dim)).astype(np.float32)
    pl = _plan(4, 2, 2, 2, 3, 8, k_dim * bits // 128)  # 7 units on 2 threadgroups x 2 warp rows x 2 steps
    args = (x, wq, sc, bi, np.full(3, 7, np.int32), np.ones(1), 0.0)
    got = run_text_on_cpu(tmp_path, 0, *args, gs=gs, bits=bits, pl=pl, warps=8, dense=True)
    for t in range(3):
        err = np.abs(got[t] - wd[0] @ x[t].astype(np.float64))
        assert np.all(err <= bound(wd[0], x[t], sc[0], gs, bits, 8)), t


def test_shared_text_shared_x_on_cpu(tmp_path):
    """Pairs sharing an x row (X_DIV: a token's k experts in one threadgroup z slice, units
    over experts and rows; some warps' last step past the units), 8-bit slabs at 4 bits."""
    bits, gs, e, rows, k_dim = 4, 32, 4, 11, 640
    rng = np.random.default_rng(3)
    wq, sc, bi, wd = quantized(rng, e, rows, k_dim, gs, bits)
    ids = np.array([[3, 0, 2], [1, 1, 0]], np.int32)
    x = rng.standard_normal((2, k_dim)).astype(np.float32)
    pl = _plan(1, 4, 3, 2, 2, 8, k_dim * bits // 128)  # 3 x 3 units of 4 rows on 2 x 2 warps x 3 steps
    args = (x, wq, sc, bi, ids, np.ones(1), 0.0)
    got = run_text_on_cpu(tmp_path, 0, *args, gs=gs, bits=bits, pl=pl, warps=2, x_div=3).reshape(2, 3, rows)
    for t in range(2):
        for j in range(3):
            w = wd[ids[t, j]]
            err = np.abs(got[t, j] - w @ x[t].astype(np.float64))
            assert np.all(err <= bound(w, x[t], sc[ids[t, j]], gs, bits, 8)), (t, j)


@pytest.mark.parametrize("bits,gs", [(2, 64), (4, 32), (8, 64)])
@pytest.mark.slow_after(1)
def test_shared_text_swiglu_and_down_sum_on_cpu(bits, gs, tmp_path):
    rng = np.random.default_rng(bits * gs)
    k_dim, inter, e = 512, 6, 4
    wq, sc, bi, wd = quantized(rng, e, 2 * inter, k_dim, gs, bits)
    ids = np.array([[3, 1, 0]], np.int32)
    x = rng.standard_normal((1, k_dim)).astype(np.float32) * 4.0
    lim = 0.6
    (tmp_path / "s").mkdir()
    sw = 8 if bits == 8 else 4
    pl = _plan(1, 4, 3, 2, 1, sw, k_dim * bits // 128, mode=1)  # 3 experts x 3 units of 2 on 2 x 2 warps x 3 steps
    got = run_text_on_cpu(
        tmp_path / "s", 1, x, wq, sc, bi, ids, np.ones(1), lim, gs=gs, bits=bits, pl=pl, warps=2, x_div=3
    ).reshape(3, inter)
    for j in range(3):
        gu = wd[ids[0, j]] @ x[0].astype(np.float64)
        g, u = np.minimum(gu[:inter], lim), np.clip(gu[inter:], -lim, lim)
        np.testing.assert_allclose(got[j], g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-5)
    # down: 2 tokens x 3 experts, per-pair vectors, weighted sum in the kernel; the experts
    # two at a time (split 2: 2 steps, the second with one expert)
    wq, sc, bi, wd = quantized(rng, e, 5, k_dim, gs, bits)
    ids = np.array([[3, 1, 0], [2, 2, 1]], np.int32)
    h = rng.standard_normal((6, k_dim)).astype(np.float32)
    wts = rng.random((2, 3)).astype(np.float32)
    for ks, rpw, maxit, nby in ((2, 2, 3, 1), (1, 4, 1, 2)):
        d = tmp_path / f"d{ks}"
        d.mkdir()
        pl = _plan(ks, rpw, maxit, nby, 2, sw, k_dim * bits // 128, mode=2)
        got = run_text_on_cpu(d, 2, h, wq, sc, bi, ids, wts, 0.0, gs=gs, bits=bits, pl=pl, warps=2, ke=3)
        for t in range(2):
            want = sum(wts[t, j] * (wd[ids[t, j]] @ h[3 * t + j].astype(np.float64)) for j in range(3))
            tol = sum(bound(wd[ids[t, j]], h[3 * t + j], sc[ids[t, j]], gs, bits, sw) for j in range(3))
            assert np.all(np.abs(got[t] - want) <= tol), (ks, t)


@pytest.mark.parametrize(
    "mode,n_rows,k_dim,bits,pairs,x_div,ke",
    [(1, 4096, 4096, 2, 6, 6, 1), (2, 4096, 2048, 2, 1, 1, 6), (0, 512, 4096, 8, 1, 1, 1), (0, 4096, 8192, 8, 1, 1, 1)],
    ids=["moe_gate_up", "moe_down", "dense_512x4096", "dense_4096x8192"],
)
def test_plans_cover_every_row(mode, n_rows, k_dim, bits, pairs, x_div, ke):
    """The decode shapes' plans: every output row has a warp row and step, threadgroups about
    two per SM, threadgroup memory within the CUDA face's limit."""
    groups = pairs if mode == 2 else pairs // x_div
    pl = aq.plan(mode, n_rows, k_dim, bits, groups, x_div=x_div, ke=ke)
    opw = pl.rpw // 2 if mode == 1 else pl.rpw
    units = (1 if mode == 2 else x_div) * -(-(n_rows // 2 if mode == 1 else n_rows) // opw)
    assert pl.nby * (aq.WARPS // pl.ksplit) * pl.maxit >= units
    assert pl.ksplit * pl.nit * 32 >= (k_dim * bits // 128 if mode != 2 else pl.nit * 32)
    assert aq.BLOCKS // 2 <= pl.nby * pl.nz <= 2 * aq.BLOCKS
    assert pl.shared_bytes(bits) <= aq.SHARED_BYTES["cuda"]
    assert pl.maxit <= aq.MAXIT and pl.nit * pl.rpw <= aq.LPT


@pytest.mark.parametrize("face", ["cuda", "metal"])
@pytest.mark.parametrize("mode", [3, 4])
def test_twobank_rows_plans_read_the_shared_expert_once(mode, face):
    """V4 Flash's MoE at 2..10 tokens (n * top-6 <= MAX_PAIRS): the multi-row plans cover every
    token and row, keep both banks on one NBY (MODE 4: the same units too), fit the face's
    threadgroup memory, and read the shared expert once per slice of up to XR_MAX tokens (one
    slice up to 8 tokens on CUDA) instead of once per token."""
    hid, inter, k = 4096, 2048, 6
    shape = (2 * inter, hid, 2, k, 2 * inter, hid, 8) if mode == 3 else (hid, inter, 2, k, inter, 8)
    for n in range(2, aq.MAX_PAIRS // k + 1):
        tp = aq.twobank_rows_plan(mode, n, shape, mx.bfloat16, face)
        one = (aq.plan_gu2 if mode == 3 else aq.plan_down2)(n, *shape, face=face)
        b = tp.b
        assert 1 < b.xr <= aq.XR_MAX and b.nz * b.xr >= n > (b.nz - 1) * b.xr
        assert b.nz < (one.b.nz if mode == 3 else one.nz)  # fewer shared-expert reads than tokens
        assert face == "metal" or b.nz == -(-n // aq.XR_MAX)
        assert tp.nz == (n + b.nz if mode == 3 else b.nz) and tp.a.nby == b.nby
        assert tp.shared_bytes(2, 8, mode) <= aq.SHARED_BYTES[face]
        chunks_b = shape[5 if mode == 3 else 4] * 8 // 128
        assert b.ksplit * b.nit * b.ksl * 32 >= chunks_b  # K slices cover the shared expert's row
        out_b = inter if mode == 3 else hid  # MODE 3: gate / up pairs
        units = -(-out_b // (b.rpw // 2 if mode == 3 else b.rpw))
        assert b.nby * (aq.WARPS // b.ksplit) * b.maxit >= units
        if mode == 4:
            assert (tp.a.ksplit, tp.a.rpw, tp.a.maxit) == (b.ksplit, b.rpw, b.maxit)


def test_plan_on_the_cpu_emulation(tmp_path, monkeypatch):
    """A plan chosen by aq.plan (grid shrunk to a few threadgroups of 2 warps, so it takes
    several steps per warp) runs the gate_up mode right on the CPU."""
    monkeypatch.setattr(aq, "WARPS", 2)
    monkeypatch.setattr(aq, "BLOCKS", 2)
    bits, gs, k_dim, inter, e = 2, 64, 2048, 24, 5
    pl = aq.plan(1, 2 * inter, k_dim, bits, 1, x_div=4, x_dtype=mx.float32, face="cuda")
    assert pl.maxit > 1 and pl.sw == 4
    rng = np.random.default_rng(11)
    wq, sc, bi, wd = quantized(rng, e, 2 * inter, k_dim, gs, bits)
    ids = np.array([[4, 0, 2, 0]], np.int32)
    x = rng.standard_normal((1, k_dim)).astype(np.float32)
    got = run_text_on_cpu(tmp_path, 1, x, wq, sc, bi, ids, np.ones(1), 0.0, gs=gs, bits=bits, pl=pl, warps=2, x_div=4)
    for j in range(4):
        gu = wd[ids[0, j]] @ x[0].astype(np.float64)
        want = gu[:inter] / (1 + np.exp(-gu[:inter])) * gu[inter:]
        np.testing.assert_allclose(got[j], want, rtol=1e-4, atol=1e-5)


def _emulated_kernel(tmp_path, launches):
    """A stand-in for aq._kernel(): each launch runs the shared text through the g++
    emulation with the template, grid and inputs the module passes (T / TS as float32)."""
    from test_kernel_emulation import run_on_cpu

    sec = dispatch.sections(aq.SOURCE)

    def launch(face, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        consts = {k: (np.float32 if k in ("T", "TS") else v) for k, v in template}
        x, w, sc, bi, eids, wts, lim, nw = inputs
        xin = np.array(x.astype(mx.float32))  # bfloat16 values exactly
        d = tmp_path / f"launch{len(launches)}"
        d.mkdir()
        launches.append(consts)
        out = run_on_cpu(
            d,
            _CPU_EXTRA + sec["common"],
            aq.qmv_text(),
            inputs={
                "x": xin,
                "w": np.array(w).reshape(-1),
                "scales": np.array(sc.astype(mx.float32)).reshape(-1),
                "biases": np.array(bi.astype(mx.float32)).reshape(-1),
                "eids": np.array(eids).reshape(-1),
                "wts": np.array(wts).reshape(-1),
                "lim": np.array(lim),
                "nw": np.array(nw.astype(mx.float32)).reshape(-1),
            },
            outputs={"y": (tuple(output_shapes[0]), np.float32)},
            consts=consts,
            groups=(grid[0] // threadgroup[0], grid[1], grid[2]),
            threads=threadgroup[0],
        )
        return [mx.array(out["y"]).astype(output_dtypes[0])]

    return lambda: launch


@pytest.mark.slow
def test_launch_wiring_on_the_cpu_emulation(tmp_path, monkeypatch):
    """Every entry point through the module's own plan, template and grid, with the kernel
    run by the g++ emulation (2 warps, a grid of a few threadgroups so warps take several
    steps), against the reference face: dense with 3 x rows, gathered with shared and with
    per-pair x, the fused gate_up + SwiGLU and down + weighted sum, bfloat16 x."""
    launches = []
    monkeypatch.setattr(aq, "WARPS", 2)
    monkeypatch.setattr(aq, "BLOCKS", 3)
    monkeypatch.setattr(aq, "_kernel", _emulated_kernel(tmp_path, launches))
    rng = np.random.default_rng(5)
    k_dim, rows, e, gs, bits = 1024, 20, 4, 64, 2
    wq, sc, bi, _ = quantized(rng, e, rows, k_dim, gs, bits)
    wq, sc, bi = mx.array(wq), mx.array(sc), mx.array(bi)
    ids = mx.array([[3, 0, 1], [2, 2, 0]], dtype=mx.int32)
    x = mx.array(rng.standard_normal((2, k_dim)).astype(np.float32))
    h = mx.array(rng.standard_normal((2, 3, k_dim)).astype(np.float32))
    wts = mx.array(rng.random((2, 3)).astype(np.float32))
    kw = dict(group_size=gs, bits=bits)

    def both(fn, *a, tol=1e-4, **k):
        got = fn(*a, **kw, **k, backend="cuda")
        # the reference on the same values in float32 (MLX's CPU quantized matmul sums
        # bfloat16 in bfloat16: ~5 % off at K = 1024, far from the GPU's float32 sums)
        f32 = [v.astype(mx.float32) if v.dtype == mx.bfloat16 else v for v in a]
        want = fn(*f32, **kw, **k, backend="reference")
        assert got.shape == want.shape and got.dtype == a[0].dtype
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want), rtol=tol, atol=tol)

    both(aq.qmv, mx.concatenate([x, x[:1] * 2]), wq[1], sc[1], bi[1])
    nw = mx.array(1.0 + 0.2 * rng.standard_normal(k_dim).astype(np.float32))
    both(aq.qmv, mx.concatenate([x, x[:1] * 2]), wq[1], sc[1], bi[1], norm=(nw, 1e-6))  # the folded RMSNorm
    both(aq.gather_qmv, x, wq, sc, bi, ids)
    both(aq.gather_qmv, h, wq, sc, bi, ids)
    both(aq.gather_swiglu, x, wq, sc, bi, ids, limit=0.7)
    both(aq.gather_down_sum, h, wq, sc, bi, ids, wts)
    xb, hb = x.astype(mx.bfloat16), h.astype(mx.bfloat16)
    sb, bb = sc.astype(mx.bfloat16), bi.astype(mx.bfloat16)
    both(aq.gather_swiglu, xb, wq, sb, bb, ids, limit=0.7, tol=1e-2)
    both(aq.gather_down_sum, hb, wq, sb, bb, ids, wts, tol=1e-2)
    assert any(c["MAXIT"] > 1 for c in launches) and any(c["KSPLIT"] > 1 for c in launches)
    assert [c["SW"] for c in launches[-2:]] == [8, 8]  # bfloat16 x: the 8-bit slabs


# ------------------------------------------------------------------ the CUDA face, compiled by nvcc


# the decode shapes of V4 Flash (issue #13): (mode, rows, K, bits, group, threadgroup z slices, x_div, ke)
DECODE_SHAPES = {
    "moe_gate_up_2bit": (1, 4096, 4096, 2, 64, 1, 6, 1),
    "moe_down_sum_2bit": (2, 4096, 2048, 2, 64, 1, 1, 6),
    "dense_1024x4096_8bit": (0, 1024, 4096, 8, 64, 1, 1, 1),
    "dense_512x4096_8bit": (0, 512, 4096, 8, 64, 1, 1, 1),
    "dense_2048x4096_8bit": (0, 2048, 4096, 8, 64, 1, 1, 1),
    "dense_32768x1024_8bit": (0, 32768, 1024, 8, 64, 1, 1, 1),
    "dense_4096x8192_8bit": (0, 4096, 8192, 8, 64, 1, 1, 1),
    "grouped_8x1024x4096_8bit": (0, 1024, 4096, 8, 64, 8, 1, 1),
    "gather_4bit_g32": (0, 1024, 7168, 4, 32, 1, 6, 1),
}


NVCC_DTYPES = ["bfloat16", "float32"]
NVCC_SHAPES = [*sorted(DECODE_SHAPES), "dense_1024x4096_8bit+norm"]


@pytest.mark.parametrize("dt", NVCC_DTYPES)
@pytest.mark.parametrize("shape", NVCC_SHAPES)
@pytest.mark.slow_after(1)
def test_cuda_face_compiles_with_nvcc(dt, shape, tmp_path):
    """The CUDA translation unit MLX builds for each decode shape's plan compiles (sm_90,
    warnings are errors)."""
    from test_kernel_emulation import nvcc_compile

    family = [_cuda_source(d, sh) for sh in NVCC_SHAPES for d in NVCC_DTYPES]
    nvcc_compile(tmp_path, _cuda_source(dt, shape), family=family)


def _cuda_source(dt, shape):
    from test_kernel_emulation import mlx_cuda_source

    shape, norm = shape.split("+")[0], shape.endswith("+norm")  # the q_a norm folded into q_b
    mode, rows, k_dim, bits, gs, groups, x_div, ke = DECODE_SHAPES[shape]
    x_dtype = mx.bfloat16 if dt == "bfloat16" else mx.float32
    pl = aq.plan(mode, rows, k_dim, bits, groups, x_div=x_div, ke=ke, x_dtype=x_dtype)
    tmpl = [
        (k, dt if k in ("T", "TS") else v)
        for k, v in aq.template(
            mode,
            pl,
            x_dtype,
            x_dtype,
            n_rows=rows,
            k_dim=k_dim,
            group_size=gs,
            bits=bits,
            x_div=x_div,
            ke=ke,
            dense=shape.startswith("dense"),
            norm=norm,
        )
    ]
    header, body = aq.kernel_sources("cuda")
    return mlx_cuda_source(
        "affine_qmv",
        header,
        body,
        {"x": dt, "w": "uint32", "scales": dt, "biases": dt, "eids": "int32", "wts": "float32", "lim": "float32"}
        | {"nw": dt},
        {"y": dt},
        tmpl,
    )


# ------------------------------------------------------------------ the GPU face against the reference (H200)


def _gpu_face():
    face = dispatch.gpu_backend()
    if face is None:
        pytest.skip("no GPU")
    return face


# each distinct launch is one NVRTC compile on the device (seconds): few shapes, each a different
# bit width, group size, row count and K (a partial last step at 7168 4-bit)
GPU_SHAPES = [(2, 64, 4096, 4096), (4, 128, 1024, 7168), (8, 32, 129, 512)]


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "b{}_g{}_{}x{}".format(*s))
def test_gpu_dense_and_gather_equal_reference(shape, dt):
    face = _gpu_face()
    bits, gs, rows, k_dim = shape
    key = mx.random.key(rows + k_dim + bits)
    wf = mx.random.normal((4, rows, k_dim), key=key) * 0.02
    wq, sc, bi = mx.quantize(wf, gs, bits)
    sc, bi = sc.astype(dt), bi.astype(dt)
    for m in (1, 3, 8):
        x = mx.random.normal((m, k_dim), key=mx.random.key(m)).astype(dt)
        got = aq.qmv(x, wq[1], sc[1], bi[1], group_size=gs, bits=bits, backend=face)
        want = aq.qmv(x, wq[1], sc[1], bi[1], group_size=gs, bits=bits, backend="reference")
        _close(got, want, dt)
    ids = mx.array([[3, 0, 1, 1, 2, 0]], dtype=mx.int32)
    x = mx.random.normal((1, k_dim), key=key).astype(dt)
    _close(
        aq.gather_qmv(x, wq, sc, bi, ids, group_size=gs, bits=bits, backend=face),
        aq.gather_qmv(x, wq, sc, bi, ids, group_size=gs, bits=bits, backend="reference"),
        dt,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("bits,dt", [(2, mx.bfloat16), (4, mx.float32)], ids=["2bit_bf16", "4bit_f32"])
def test_gpu_moe_swiglu_and_down_sum_equal_reference(bits, dt):
    face = _gpu_face()
    key = mx.random.key(bits)
    e, hid, inter = 16, 4096, 2048
    wq, sc, bi = mx.quantize(mx.random.normal((e, 2 * inter, hid), key=key) * 0.02, 64, bits)
    dq, dsc, dbi = mx.quantize(mx.random.normal((e, hid, inter), key=key) * 0.02, 64, bits)
    ids = mx.array([[5, 0, 15, 7, 2, 9], [1, 1, 3, 4, 8, 12]], dtype=mx.int32)
    x = mx.random.normal((2, hid), key=key).astype(dt)
    wts = mx.softmax(mx.random.normal((2, 6), key=key), axis=-1)
    h = aq.gather_swiglu(x, wq, sc.astype(dt), bi.astype(dt), ids, limit=10.0, group_size=64, bits=bits, backend=face)
    h_ref = aq.gather_swiglu(
        x, wq, sc.astype(dt), bi.astype(dt), ids, limit=10.0, group_size=64, bits=bits, backend="reference"
    )
    _close(h, h_ref, dt)
    y = aq.gather_down_sum(h_ref, dq, dsc.astype(dt), dbi.astype(dt), ids, wts, group_size=64, bits=bits, backend=face)
    y_ref = aq.gather_down_sum(
        h_ref, dq, dsc.astype(dt), dbi.astype(dt), ids, wts, group_size=64, bits=bits, backend="reference"
    )
    _close(y, y_ref, dt)


def _close(got, want, dt):
    g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    assert np.all(np.isfinite(g))
    rel = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)
    # float32: summation order + the level trick (~1e-5); bfloat16: one rounding of the output
    assert rel < (2e-5 if dt == mx.float32 else 8e-3), rel


# ------------------------------------------------------------------ the modules that use it


def _switch_glu(bits=2, hidden=256, inter=128, experts=8, limit=7.0):
    from ds4mlx.models.layers import SwitchGLU

    glu = SwitchGLU(hidden, inter, experts, limit)
    glu.gate_up_proj.weight = mx.random.normal(glu.gate_up_proj.weight.shape, key=mx.random.key(1)) * 0.05
    glu.down_proj.weight = mx.random.normal(glu.down_proj.weight.shape, key=mx.random.key(2)) * 0.05
    glu.gate_up_proj = glu.gate_up_proj.to_quantized(64, bits)
    glu.down_proj = glu.down_proj.to_quantized(64, bits)
    return glu


def test_qmv_linear_is_quantized_linear_on_cpu():
    import mlx.nn as nn

    from ds4mlx.models.qmv_linear import QMVLinear, use_fast_qmv

    model = nn.Sequential(nn.Linear(256, 64), nn.Linear(64, 32, bias=False))
    nn.quantize(model, group_size=32, bits=4)
    x = mx.random.normal((3, 256), key=mx.random.key(3))
    want = model(x)
    names = sorted(k for k, _ in __import__("mlx.utils", fromlist=["tree_flatten"]).tree_flatten(model.parameters()))
    assert use_fast_qmv(model) == 2
    assert all(type(m) is QMVLinear for m in model.layers)
    assert (
        sorted(k for k, _ in __import__("mlx.utils", fromlist=["tree_flatten"]).tree_flatten(model.parameters()))
        == names
    )
    assert mx.array_equal(model(x), want).item()


def test_qmv_embedding_as_linear_on_cpu():
    import mlx.nn as nn

    from ds4mlx.models.qmv_linear import QMVEmbedding, use_fast_qmv

    model = nn.Sequential(nn.Embedding(64, 256))
    nn.quantize(model, group_size=64, bits=2)
    h = mx.random.normal((1, 2, 256), key=mx.random.key(3))
    ids = mx.array([[1, 5]])
    want_l, want_e = model.layers[0].as_linear(h), model.layers[0](ids)
    assert use_fast_qmv(model) == 1 and type(model.layers[0]) is QMVEmbedding
    assert mx.array_equal(model.layers[0].as_linear(h), want_l).item()
    assert mx.array_equal(model.layers[0](ids), want_e).item()


def test_moe_fused_path_wiring(monkeypatch):
    """The fused decode path (forced on, here run by the reference faces) computes what
    the unfused SwitchGLU + weighted sum computes, for [B, T, H] inputs."""
    glu = _switch_glu()
    x = mx.random.normal((1, 2, 256), key=mx.random.key(4))
    idx = mx.array([[[0, 3, 5], [7, 7, 1]]], dtype=mx.int32)
    w = mx.softmax(mx.random.normal((1, 2, 3), key=mx.random.key(5)), axis=-1)
    assert glu.fused_weighted(x, idx, w) is None  # CPU: no GPU face, the caller's own path
    want = (glu(x, idx) * w[..., None]).sum(axis=-2)
    monkeypatch.setattr(aq, "kernel_face", lambda *a, **k: "forced")
    got = glu.fused_weighted(x, idx, w)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
    # the per-expert projection alone (QuantizedSwitchLinear's decode path)
    gu = glu.gate_up_proj(mx.expand_dims(x, (-2, -3)), idx)
    monkeypatch.setattr(aq, "kernel_face", lambda *a, **k: None)
    assert mx.allclose(gu, glu.gate_up_proj(mx.expand_dims(x, (-2, -3)), idx), rtol=1e-5, atol=1e-6).item()


def test_shared_expert_swiglu_wiring(monkeypatch):
    """A (gate, up) pair of quantized linears as one gate_up + SwiGLU launch over a one-expert
    bank (forced on, run by the reference faces) equals clamped_swiglu(gate(x), up(x))."""
    import mlx.nn as nn

    from ds4mlx.models.fused import swiglu_of
    from ds4mlx.models.layers import clamped_swiglu

    gate, up = nn.Linear(256, 128, bias=False), nn.Linear(256, 128, bias=False)
    gate.weight = mx.random.normal(gate.weight.shape, key=mx.random.key(10)) * 0.2
    up.weight = mx.random.normal(up.weight.shape, key=mx.random.key(11)) * 0.2
    q_gate, q_up = (m.to_quantized(group_size=64, bits=8) for m in (gate, up))
    x = mx.random.normal((1, 1, 256), key=mx.random.key(12)) * 4
    calls = []
    real = aq.gather_swiglu
    monkeypatch.setattr(aq, "gather_swiglu", lambda *a, **k: calls.append(1) or real(*a, **k))
    for limit in (None, 1.5):
        want = clamped_swiglu(q_gate(x), q_up(x), limit)
        assert mx.array_equal(swiglu_of(q_gate, q_up)(x, limit), want).item()  # CPU: the plain expression
        with monkeypatch.context() as m:
            m.setattr(aq, "kernel_face", lambda *a, **k: "forced")
            got = swiglu_of(q_gate, q_up)(x, limit)
        assert got.shape == want.shape == (1, 1, 128)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
    assert len(calls) == 2  # one fused launch per forced call, none on the plain path


def test_grouped_linear_fused_path_wiring(monkeypatch):
    from ds4mlx.models.deepseek_v4 import GroupedLinear

    g = GroupedLinear(128, 8 * 32, 8)
    g.weight = mx.random.normal(g.weight.shape, key=mx.random.key(6)) * 0.05
    q = g.to_quantized(64, 8)
    x = mx.random.normal((1, 2, 8, 128), key=mx.random.key(7))
    want = q(x)
    monkeypatch.setattr(aq, "kernel_face", lambda *a, **k: "forced")
    got = q(x)
    assert got.shape == want.shape == (1, 2, 256)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2])
def test_gpu_modules_kernels_on_equal_off(bits):
    """SwitchGLU's fused path, QMVLinear and the grouped linear on the GPU face against
    the same modules with every kernel on its reference face."""
    import mlx.nn as nn

    from ds4mlx.models.deepseek_v4 import GroupedLinear
    from ds4mlx.models.qmv_linear import use_fast_qmv

    _gpu_face()
    glu = _switch_glu(bits, hidden=1024, inter=512, experts=16)
    x = mx.random.normal((1, 1, 1024), key=mx.random.key(8))
    idx = mx.array([[[0, 3, 5, 9, 15, 2]]], dtype=mx.int32)
    w = mx.softmax(mx.random.normal((1, 1, 6), key=mx.random.key(9)), axis=-1)
    got = glu.fused_weighted(x, idx, w)
    assert got is not None
    with dispatch.use_face("reference"):
        assert glu.fused_weighted(x, idx, w) is None
        want = (glu(x, idx) * w[..., None]).sum(axis=-2)
    _close(got, want, mx.float32)
    lin = nn.Sequential(nn.Linear(1024, 512))
    nn.quantize(lin, group_size=64, bits=bits)
    with dispatch.use_face("reference"):
        want = lin(x)
    use_fast_qmv(lin)
    _close(lin(x), want, mx.float32)
    g = GroupedLinear(512, 8 * 64, 8)
    g.weight = mx.random.normal(g.weight.shape, key=mx.random.key(10)) * 0.05
    q = g.to_quantized(64, bits)
    xg = mx.random.normal((1, 1, 8, 512), key=mx.random.key(11))
    with dispatch.use_face("reference"):
        want = q(xg)
    _close(q(xg), want, mx.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(QMV_PLAN_VARIANTS), ids=lambda v: v.replace(" ", "_").replace("/", "-"))
def test_gpu_launch_variants_equal_reference(variant, monkeypatch):
    """The plan variants bench_kernels --qmv-sweep times compute the same (the MoE modes and
    a split-K dense call, bfloat16)."""
    face = _gpu_face()
    for k, v in QMV_PLAN_VARIANTS[variant].items():
        monkeypatch.setattr(aq, k, v)
    for kind in ("moe_gate_up", "moe_down_sum", "dense_1024x4096"):
        got, want = _decode_call(kind, face, mx.bfloat16, experts=8)
        _close(got, want, mx.bfloat16)


def _decode_call(kind, face, dt, experts=16):
    """One of issue #13's decode-step calls (V4 Flash shapes; `experts` routed experts in the
    bank) on `face` and on the reference face."""
    key = mx.random.key(len(kind))
    rows, k_dim, bits = DECODE_CALLS[kind]
    e = experts if kind.startswith("moe") else (8 if kind.startswith("grouped") else 1)
    wq, sc, bi = mx.quantize(mx.random.normal((e, rows, k_dim), key=key) * k_dim**-0.5, 64, bits)
    sc, bi = sc.astype(dt), bi.astype(dt)
    kw = dict(group_size=64, bits=bits)
    ids = mx.array([[5, 0, experts - 1, 7, 2, 3]], dtype=mx.int32)
    if kind == "moe_gate_up":
        x = mx.random.normal((1, k_dim), key=key).astype(dt)
        fn = lambda b: aq.gather_swiglu(x, wq, sc, bi, ids, limit=10.0, **kw, backend=b)  # noqa: E731
    elif kind == "moe_down_sum":
        h = mx.random.normal((1, 6, k_dim), key=key).astype(dt)
        wts = mx.softmax(mx.random.normal((1, 6), key=key), axis=-1)
        fn = lambda b: aq.gather_down_sum(h, wq, sc, bi, ids, wts, **kw, backend=b)  # noqa: E731
    elif kind.startswith("grouped"):
        x = mx.random.normal((1, 8, k_dim), key=key).astype(dt)
        gids = mx.arange(8, dtype=mx.int32)[None]
        fn = lambda b: aq.gather_qmv(x, wq, sc, bi, gids, **kw, backend=b)  # noqa: E731
    else:
        x = mx.random.normal((1, k_dim), key=key).astype(dt)
        fn = lambda b: aq.qmv(x, wq[0], sc[0], bi[0], **kw, backend=b)  # noqa: E731
    return fn(face), fn("reference")


# (rows, K, bits) of the calls the brief measured in the compiled step (H200, 8 layers)
DECODE_CALLS = {
    "moe_gate_up": (4096, 4096, 2),  # 6 experts of [2 x 2048, 4096] + SwiGLU
    "moe_down_sum": (4096, 2048, 2),  # 6 experts of [4096, 2048] + the weighted sum
    "dense_1024x4096": (1024, 4096, 8),
    "dense_512x4096": (512, 4096, 8),
    "dense_2048x4096": (2048, 4096, 8),
    "dense_32768x1024": (32768, 1024, 8),
    "dense_4096x8192": (4096, 8192, 8),
    "grouped_8x1024x4096": (1024, 4096, 8),  # wo_a: 8 groups, one x each
}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(DECODE_CALLS))
def test_gpu_decode_calls_equal_reference(kind):
    """Each decode-step call of the brief, bfloat16 (the model's activations) on the GPU face
    against MLX's own ops; float32 too for the MoE gate_up and one split-K dense call."""
    face = _gpu_face()
    got, want = _decode_call(kind, face, mx.bfloat16)
    assert got.shape == want.shape and got.dtype == mx.bfloat16
    _close(got, want, mx.bfloat16)
    if kind in ("moe_gate_up", "dense_512x4096"):
        _close(*_decode_call(kind, face, mx.float32), mx.float32)


@pytest.mark.gpu
def test_gpu_self_tests_pass():
    """The first-use self-tests the models run (affine_qmv and affine_qmv.moe are in
    dispatch.UNVERIFIED_KERNELS until these GPU tests pass) accept the GPU face."""
    face = _gpu_face()
    assert aq._self_test(face)
    assert aq._moe_self_test(face)


# ------------------------------------------------------------------ kernels not yet GPU-verified: self-tested on CUDA too


@pytest.fixture
def fake_cuda(monkeypatch):
    """dispatch.backend() -> 'cuda' (a verified face); self-test cache cleared."""
    monkeypatch.delenv("DS4MLX_KERNELS", raising=False)
    monkeypatch.delenv("DS4MLX_KERNEL_SELFTEST", raising=False)
    monkeypatch.setattr(dispatch, "backend", lambda device=None: "cuda")
    monkeypatch.setattr(dispatch, "_self_tests", {})
    return monkeypatch


def _garbage_kernel(calls):
    def fake_kernel(*names):
        def launch(face, *, output_shapes, output_dtypes, **kw):
            calls.append(names[0] if names else "kernel")
            return [mx.full(s, 7.0, t) for s, t in zip(output_shapes, output_dtypes)]

        return launch

    return fake_kernel


def test_unverified_qmv_self_tests_on_cuda(fake_cuda):
    """An unverified kernel text (plain and MoE modes; both passed their GPU tests on the
    H200 on 2026-12-02, so listed here by hand) self-tests on CUDA at first use, and a
    failure sends the callers to their own (MLX) paths."""
    fake_cuda.setattr(dispatch, "UNVERIFIED_KERNELS", dispatch.UNVERIFIED_KERNELS | {"affine_qmv", "affine_qmv.moe"})
    calls = []
    fake_cuda.setattr(aq, "_kernel", _garbage_kernel(calls))
    glu = _switch_glu()
    x = mx.random.normal((1, 1, 256), key=mx.random.key(4))
    idx = mx.array([[[0, 3, 5]]], dtype=mx.int32)
    w = mx.softmax(mx.random.normal((1, 1, 3), key=mx.random.key(5)), axis=-1)
    assert aq.kernel_face(256, 64, 2) is None  # the plain self-test failed
    assert dispatch._self_tests[("affine_qmv", "cuda")] is False
    assert glu.fused_weighted(x, idx, w) is None
    # the plain mode passed (as it will once its GPU tests have run): the MoE modes still self-test
    fake_cuda.setattr(dispatch, "_self_tests", {("affine_qmv", "cuda"): True})
    assert glu.fused_weighted(x, idx, w) is None  # the MoE self-test failed: the caller's own path
    assert dispatch._self_tests[("affine_qmv.moe", "cuda")] is False


def test_unverified_twobank_rows_self_test_on_cuda(fake_cuda):
    """While unverified (its CUDA face passed its GPU tests on an H100; listed here as a new face
    would be), the multi-row shared expert self-tests at the first automatic call of more than one
    token; a failure keeps the one-row two-bank form (one shared-expert read per token), which
    stays on; once passed, the calls take the multi-row form."""
    fake_cuda.setattr(dispatch, "UNVERIFIED_KERNELS", dispatch.UNVERIFIED_KERNELS | {"affine_qmv.twobank_rows"})
    verified = {(k, "cuda"): True for k in ("affine_qmv", "affine_qmv.moe", "affine_qmv.twobank")}
    fake_cuda.setattr(dispatch, "_self_tests", dict(verified))
    launches = []

    def garbage(mode):
        def launch(face, *, template, output_shapes, output_dtypes, **kw):
            launches.append(dict(template))
            return [mx.full(s, 7.0, t) for s, t in zip(output_shapes, output_dtypes)]

        return launch

    fake_cuda.setattr(aq, "_twobank_kernel", garbage)
    rng = np.random.default_rng(3)
    wq, sc, bi, _ = quantized(rng, 4, 2 * 64, 512, 64, 2)
    sq, ssc, sbi, _ = quantized(rng, 1, 2 * 64, 512, 64, 8)
    A = mx.array
    x, ids = A(rng.standard_normal((2, 512)).astype(np.float32)), A(np.array([[0, 1], [2, 3]], np.int32))
    kw = dict(limit=None, group_size=64, bits=2, shared_limit=None, shared_group_size=64, shared_bits=8)
    for passed in (False, True):
        if passed:
            fake_cuda.setattr(dispatch, "_self_tests", verified | {("affine_qmv.twobank_rows", "cuda"): True})
        launches.clear()
        aq.gather_swiglu_shared(x, A(wq), A(sc), A(bi), ids, (A(sq[0]), A(ssc[0]), A(sbi[0])), **kw)
        assert dispatch._self_tests[("affine_qmv.twobank_rows", "cuda")] is passed
        assert launches[-1]["XR_B"] == (2 if passed else 1) and launches[-1]["NZ_A"] == 2


def test_unverified_hc_split_self_test_on_cuda(fake_cuda):
    from ds4mlx.kernels import hyper_connection as hck

    # passed its GPU tests on the H200 (2026-12-02): listed as unverified here to test the mechanism
    fake_cuda.setattr(dispatch, "UNVERIFIED_KERNELS", dispatch.UNVERIFIED_KERNELS | {"hyper_connection.split"})
    calls = []
    fake_cuda.setattr(hck, "_kernel", _garbage_kernel(calls))
    n, d = 4, 64
    x = mx.random.normal((1, 1, n, d), key=mx.random.key(1))
    fn = mx.random.normal(((2 + n) * n, n * d), key=mx.random.key(2)) * 0.05
    base, scale = mx.zeros(((2 + n) * n,)), mx.array([0.5, 1.0, 2.0])
    hck.hc_pre(x, fn, base, scale, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6)
    assert dispatch._self_tests[("hyper_connection.split", "cuda")] is False
    calls.clear()
    hck.hc_pre(x, fn, base, scale, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6)
    assert calls == ["hc_pre"]  # the one-launch path, no hc_dots


def test_metal_and_cuda_share_one_text():
    sec = dispatch.sections(aq.SOURCE)
    mh, mb = aq.kernel_sources("metal")
    ch, cb = aq.kernel_sources("cuda")
    assert mh.endswith(dispatch.compact(sec["common"])) and ch.endswith(dispatch.compact(sec["common"]))
    assert mb.endswith(dispatch.compact(aq.qmv_text())) and cb.endswith(dispatch.compact(aq.qmv_text()))
    assert "thread_position_in_threadgroup" in mb and "threadIdx" in cb
    for word in ("device ", "threadgroup ", "simd_sum", "as_type", "metal::"):
        assert word not in ch + cb, word
    for word in ("__shfl", "__syncthreads", "__uint_as_float", "threadIdx"):
        assert word not in mh + mb, word


def test_unverified_hc_post_pre_self_test_on_cuda(fake_cuda):
    from ds4mlx.kernels import hyper_connection as hck

    # passed its GPU tests on the H200 (2026-12-02): listed as unverified here to test the mechanism
    fake_cuda.setattr(dispatch, "UNVERIFIED_KERNELS", dispatch.UNVERIFIED_KERNELS | {"hyper_connection.post_pre"})
    calls = []
    fake_cuda.setattr(hck, "_kernel", _garbage_kernel(calls))
    n, d = 4, 64
    x = mx.random.normal((1, 1, n, d), key=mx.random.key(1))
    out = mx.random.normal((1, 1, d), key=mx.random.key(3))
    fn = mx.random.normal(((2 + n) * n, n * d), key=mx.random.key(2)) * 0.05
    base, scale = mx.zeros(((2 + n) * n,)), mx.array([0.5, 1.0, 2.0])
    post, comb = mx.ones((1, 1, n)), mx.ones((1, 1, n, n)) / n
    kw = dict(sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6)
    hck.hc_post_pre(x, out, post, comb, fn, base, scale, **kw)
    assert dispatch._self_tests[("hyper_connection.post_pre", "cuda")] is False
    calls.clear()
    hck.hc_post_pre(x, out, post, comb, fn, base, scale, **kw)
    assert "hc_post_dots" not in calls and calls[0] == "hc_post"  # hc_post, then hc_pre (no split either)


# ------------------------------------------------------------------ two weight banks in one launch (MODE 3 / 4)


def _emulated_twobank(tmp_path, launches):
    """A stand-in for aq._twobank_kernel(mode): each launch runs `aq.twobank_body(mode)` through
    the g++ emulation with the module's template, grid and inputs (T / TS_* as float32)."""
    from test_kernel_emulation import run_on_cpu

    sec = dispatch.sections(aq.SOURCE)

    def kernel(mode):
        def launch(face, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            consts = {k: (np.float32 if k in ("T", "TS_A", "TS_B") else v) for k, v in template}
            arrs = {}
            for name, a in zip(aq.TWOBANK_INPUTS, inputs):
                arrs[name] = np.array(a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a).reshape(-1)
            d = tmp_path / f"twobank{len(launches)}"
            d.mkdir()
            launches.append(consts)
            names = ["y", "y2"][: len(output_shapes)]
            out = run_on_cpu(
                d,
                _CPU_EXTRA + sec["common"],
                aq.twobank_body(mode),
                inputs=arrs,
                outputs={n: (tuple(s), np.float32) for n, s in zip(names, output_shapes)},
                consts=consts,
                groups=(grid[0] // threadgroup[0], grid[1], grid[2]),
                threads=threadgroup[0],
            )
            return [mx.array(out[n]).astype(t) for n, t in zip(names, output_dtypes)]

        return launch

    return kernel


def _swiglu64(gu, inter, lim):
    g, u = gu[..., :inter], gu[..., inter:]
    if lim:
        g, u = np.minimum(g, lim), np.clip(u, -lim, lim)
    return g / (1 + np.exp(-g)) * u, g, u


def _swiglu_bound(gu_err, g, u, h):
    """How far silu(g) * u moves for gate / up errors (|silu'| <= 1.1), plus its float32 rounding."""
    eg, eu = gu_err[..., : g.shape[-1]], gu_err[..., g.shape[-1] :]
    return 1.1 * eg * (np.abs(u) + eu) + np.abs(g / (1 + np.exp(-g))) * eu + 8 * 2.0**-23 * np.abs(h) + 1e-12


# (routed bits, gs, shared bits, gs, K, routed I, shared I2, H): 2-bit routed + 8-bit shared (V4
# Flash's formats), 4-bit + 8-bit, 8-bit + 4-bit; odd row counts in both banks
TWOBANK_CASES = [(2, 64, 8, 64, 1024, 5, 7, 13), (4, 32, 8, 128, 768, 9, 3, 11), (8, 128, 4, 64, 512, 3, 6, 6)]
# (case, tokens, XR_MAX): 2 tokens in every case (the shared expert multi-row: one slice of 2), one
# token (the one-row form), 3 and 8 (one slice; V4 Flash's formats, K slices of the shared x at 8),
# 5 in slices of 3 and 3 in slices of 2 (the last slice's rows past the tokens)
TWOBANK_TOKENS = [(c, 2, 8) for c in TWOBANK_CASES] + [(TWOBANK_CASES[0], n, 8) for n in (1, 3, 8)]
TWOBANK_TOKENS += [(TWOBANK_CASES[1], 3, 8), (TWOBANK_CASES[0], 5, 3), (TWOBANK_CASES[2], 3, 2)]


def _tokens_id(ct):
    return "b{}g{}+b{}g{}_K{}_I{}_I2{}_H{}".format(*ct[0]) + f"_n{ct[1]}_xr{ct[2]}"


def _twobank_ids(rng, n):
    """n tokens' top-3 of 4 experts (a repeat in the second token, as a routed top-k never has
    but the kernel must take)."""
    ids = np.stack([rng.permutation(4)[:3] for _ in range(n)]).astype(np.int32)
    if n > 1:
        ids[1] = [1, 1, 0]
    return ids


def _assert_shared_form(c, n, xr_max):
    """Bank B multi-row for n > 1 tokens (the fewest slices of at most xr_max tokens), the one-row
    form (bank B's ids read) for one."""
    xr = -(-n // -(-n // xr_max))
    assert (c["XR_B"], c["XROWS_B"]) == ((xr, n) if n > 1 else (1, 0))


@pytest.fixture
def emulated_twobank(tmp_path, monkeypatch):
    """aq's two-bank launches run by the g++ emulation on 2 warps and a few threadgroups (several
    steps per warp, split K), every launch's template recorded."""
    launches = []
    monkeypatch.setattr(aq, "WARPS", 2)
    monkeypatch.setattr(aq, "BLOCKS", 2)
    monkeypatch.setattr(aq, "_twobank_kernel", _emulated_twobank(tmp_path, launches))
    return launches


@pytest.mark.parametrize("case,n,xr_max", TWOBANK_TOKENS, ids=[_tokens_id(ct) for ct in TWOBANK_TOKENS])
@pytest.mark.slow_after(1)
def test_twobank_swiglu_on_cpu(case, n, xr_max, emulated_twobank, monkeypatch):
    """MODE 3 through the module's plan, template and grid, float32 x: the routed experts'
    gate_up + SwiGLU (k = 3 of 4 experts, n tokens) and the shared expert's (n > 1: multi-row,
    each of its weight loads used for the n tokens), each within the float32 bound of its own
    format, against float64 numpy; the routed outputs equal one launch per token bit for bit
    (their sums are the one-row form's)."""
    bits, gs, bits2, gs2, k_dim, inter, inter2, _ = case
    monkeypatch.setattr(aq, "XR_MAX", xr_max)
    rng = np.random.default_rng(k_dim + inter)
    wq, sc, bi, wd = quantized(rng, 4, 2 * inter, k_dim, gs, bits)
    sq, ssc, sbi, sd = quantized(rng, 1, 2 * inter2, k_dim, gs2, bits2)
    ids = _twobank_ids(rng, n)
    x = rng.standard_normal((n, k_dim)).astype(np.float32) * 3.0
    A = mx.array
    kw = dict(group_size=gs, bits=bits, shared_group_size=gs2, shared_bits=bits2)
    shared = (A(sq[0]), A(ssc[0]), A(sbi[0]))

    def launch(t0, t1):
        return aq.gather_swiglu_shared(
            A(x[t0:t1]), A(wq), A(sc), A(bi), A(ids[t0:t1]), shared, limit=0.8, shared_limit=None, **kw, backend="cuda"
        )

    h, hs = launch(0, n)
    assert h.shape == (n, 3, inter) and hs.shape == (n, inter2) and len(emulated_twobank) == 1
    c = emulated_twobank[0]
    assert (c["MODE"], c["MODE_A"], c["MODE_B"], c["NZ_A"], c["BITS_A"], c["BITS_B"]) == (3, 1, 1, n, bits, bits2)
    assert max(c["MAXIT_A"], c["MAXIT_B"]) > 1
    _assert_shared_form(c, n, xr_max)
    h, hs = np.array(h), np.array(hs)
    if n > 1:
        alone = np.concatenate([np.array(launch(t, t + 1)[0]) for t in (0, n - 1)])
        assert np.array_equal(h[[0, n - 1]], alone)
    for t in range(n):
        for j in range(3):
            w = wd[ids[t, j]]
            want, g, u = _swiglu64(w @ x[t].astype(np.float64), inter, 0.8)
            tol = _swiglu_bound(bound(w, x[t], sc[ids[t, j]], gs, bits, 4 if bits < 8 else 8), g, u, want)
            assert np.all(np.abs(h[t, j] - want) <= tol), (t, j)
        want, g, u = _swiglu64(sd[0] @ x[t].astype(np.float64), inter2, None)
        tol = _swiglu_bound(bound(sd[0], x[t], ssc[0], gs2, bits2, 4 if bits2 < 8 else 8), g, u, want)
        assert np.all(np.abs(hs[t] - want) <= tol), t


@pytest.mark.parametrize("case,n,xr_max", TWOBANK_TOKENS, ids=[_tokens_id(ct) for ct in TWOBANK_TOKENS])
@pytest.mark.slow_after(1)
def test_twobank_down_sum_on_cpu(case, n, xr_max, emulated_twobank, monkeypatch):
    """MODE 4 through the module's plan, template and grid, float32 x: the routed experts' down
    projections weighted and summed plus the shared expert's down (its own K and format; n > 1
    tokens: multi-row, bank A token by token, then bank B once for all), one output, within the
    sum of the banks' float32 bounds."""
    bits, gs, bits2, gs2, _, inter, inter2, hid = case
    monkeypatch.setattr(aq, "XR_MAX", xr_max)
    k_a, k_b = 128 * inter, 128 * inter2  # each a multiple of every group size and chunk
    rng = np.random.default_rng(hid + inter)
    wq, sc, bi, wd = quantized(rng, 4, hid, k_a, gs, bits)
    sq, ssc, sbi, sd = quantized(rng, 1, hid, k_b, gs2, bits2)
    ids = _twobank_ids(rng, n)
    h = rng.standard_normal((n, 3, k_a)).astype(np.float32)
    hs = rng.standard_normal((n, k_b)).astype(np.float32)
    wts = rng.random((n, 3)).astype(np.float32)
    A = mx.array
    kw = dict(group_size=gs, bits=bits, shared_group_size=gs2, shared_bits=bits2)
    y = aq.gather_down_sum_shared(
        A(h), A(wq), A(sc), A(bi), A(ids), A(wts), A(hs), (A(sq[0]), A(ssc[0]), A(sbi[0])), **kw, backend="cuda"
    )
    assert y.shape == (n, hid) and len(emulated_twobank) == 1
    c = emulated_twobank[0]
    assert (c["MODE"], c["MODE_A"], c["MODE_B"], c["DENSE_B"], c["KE_A"]) == (4, 2, 0, 1, 3)
    assert c["KSPLIT_A"] == c["KSPLIT_B"] and c["RPW_A"] == c["RPW_B"] and c["MAXIT_A"] == c["MAXIT_B"]
    _assert_shared_form(c, n, xr_max)
    y = np.array(y)
    for t in range(n):
        routed = [wts[t, j] * (wd[ids[t, j]] @ h[t, j].astype(np.float64)) for j in range(3)]
        shared = sd[0] @ hs[t].astype(np.float64)
        want = sum(routed) + shared
        sw, sw2 = (4 if bits < 8 else 8), (4 if bits2 < 8 else 8)
        tol = sum(bound(wd[ids[t, j]], h[t, j], sc[ids[t, j]], gs, bits, sw) for j in range(3))
        tol = (
            tol
            + bound(sd[0], hs[t], ssc[0], gs2, bits2, sw2)
            + 8 * 2.0**-23 * (sum(map(np.abs, routed)) + np.abs(shared))
        )
        assert np.all(np.abs(y[t] - want) <= tol), t


@pytest.mark.parametrize("blocks,n", [(2, 8), (16, 3)], ids=["steps_n8", "carry_n3"])
@pytest.mark.slow_after(1)
def test_twobank_rows_k_slices_on_cpu(blocks, n, emulated_twobank, monkeypatch):
    """The multi-row shared expert with its x in K slices (K = 4096 at 8 bits: XR rows of the whole
    K do not fit): several steps a warp (the slices' sums in threadgroup memory), and one unit a
    warp (BLOCKS 16: the sums carried over the slices in registers), MODE 3 and MODE 4, float32,
    against the reference face (MLX's float32 ops)."""
    monkeypatch.setattr(aq, "BLOCKS", blocks)
    rng = np.random.default_rng(blocks + n)
    k_dim, inter, inter2, hid = 4096, 5, 3, 13
    A = lambda a: mx.array(a)  # noqa: E731
    gu = [A(a) for a in quantized(rng, 4, 2 * inter, k_dim, 64, 2)[:3]]
    sgu = [A(a[0]) for a in quantized(rng, 1, 2 * inter2, k_dim, 64, 8)[:3]]
    dn = [A(a) for a in quantized(rng, 4, hid, 128 * inter, 64, 2)[:3]]
    sdn = [A(a[0]) for a in quantized(rng, 1, hid, k_dim, 64, 8)[:3]]
    ids = A(_twobank_ids(rng, n))
    x = A(rng.standard_normal((n, k_dim)).astype(np.float32))
    h = A(rng.standard_normal((n, 3, 128 * inter)).astype(np.float32))
    hs = A(rng.standard_normal((n, k_dim)).astype(np.float32))
    wts = A(rng.random((n, 3)).astype(np.float32))
    kw = dict(group_size=64, bits=2, shared_group_size=64, shared_bits=8)
    for b in ("cuda", "reference"):
        got = aq.gather_swiglu_shared(x, *gu, ids, tuple(sgu), limit=0.8, shared_limit=None, **kw, backend=b)
        got += (aq.gather_down_sum_shared(h, *dn, ids, wts, hs, tuple(sdn), **kw, backend=b),)
        if b == "cuda":
            emulated = got
    for g, w in zip(emulated, got):
        _close(g, w, mx.float32)
    c3, c4 = emulated_twobank
    for c in (c3, c4):
        _assert_shared_form(c, n, aq.XR_MAX)
        assert c["KSL_B"] > 1 and (c["MAXIT_B"] == 1) == (blocks == 16)


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 3])
def test_twobank_bfloat16_equals_the_two_launches_on_cpu(n, emulated_twobank):
    """bfloat16 x and scales (the decode step's types: 8-bit slabs), V4 Flash's formats (2-bit
    routed, 8-bit shared): MODE 3 and MODE 4 against their reference faces, which are the two
    launches' expressions (gather_swiglu + the one-expert gather_swiglu; gather_down_sum + qmv);
    one token, and 3 (the shared expert multi-row)."""
    rng = np.random.default_rng(21)
    k_dim, inter, e = 512, 9, 5
    wq, sc, bi, _ = quantized(rng, e, 2 * inter, k_dim, 64, 2)
    sq, ssc, sbi, _ = quantized(rng, 1, 2 * inter, k_dim, 64, 8)
    dq, dsc, dbi, _ = quantized(rng, e, k_dim, 128 * 3, 64, 2)  # down: H = 512 rows, K = I = 384
    tq, tsc, tbi, _ = quantized(rng, 1, k_dim, 128 * 3, 64, 8)
    bf = lambda a: mx.array(a).astype(mx.bfloat16)  # noqa: E731
    ids = mx.array([[4, 0, 2, 1], [1, 3, 0, 2], [2, 2, 4, 0]][:n], dtype=mx.int32)
    wts = mx.softmax(mx.array(rng.standard_normal((n, 4)).astype(np.float32)), axis=-1)
    x = bf(rng.standard_normal((n, k_dim)))
    kw = dict(group_size=64, bits=2, shared_group_size=64, shared_bits=8)
    routed, shared = (mx.array(wq), bf(sc), bf(bi)), (mx.array(sq[0]), bf(ssc[0]), bf(sbi[0]))
    for b in ("cuda", "reference"):
        h, hs = aq.gather_swiglu_shared(x, *routed, ids, shared, limit=10.0, shared_limit=10.0, **kw, backend=b)
        if b == "cuda":
            got = (h, hs)
    want_h = aq.gather_swiglu(x, *routed, ids, limit=10.0, group_size=64, bits=2, backend="reference")
    s = aq.gather_swiglu(x, shared[0][None], shared[1][None], shared[2][None], mx.zeros((n, 1), mx.int32),
                         limit=10.0, group_size=64, bits=8, backend="reference")  # fmt: skip
    assert mx.array_equal(h, want_h).item() and mx.array_equal(hs, s.reshape(n, inter)).item()  # the reference face
    # the GPU text against the reference on float32 copies (MLX's CPU bfloat16 matmul sums in bfloat16)
    f32 = lambda t: tuple(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a for a in t)  # noqa: E731
    rh, rhs = aq.gather_swiglu_shared(x.astype(mx.float32), *f32(routed), ids, f32(shared), limit=10.0,
                                      shared_limit=10.0, **kw, backend="reference")  # fmt: skip
    _close(got[0], rh, mx.bfloat16)
    _close(got[1], rhs, mx.bfloat16)
    assert got[0].dtype == got[1].dtype == mx.bfloat16
    hh = h.reshape(n, 4, inter)[..., :inter]
    hh = mx.concatenate([hh] * 43, axis=-1)[..., :384]  # an I of 384 from the SwiGLU outputs
    hs3 = mx.concatenate([hs] * 43, axis=-1)[..., :384]
    down, sdown = (mx.array(dq), bf(dsc), bf(dbi)), (mx.array(tq[0]), bf(tsc[0]), bf(tbi[0]))
    y = aq.gather_down_sum_shared(hh, *down, ids, wts, hs3, sdown, **kw, backend="cuda")
    y_ref = aq.gather_down_sum_shared(hh, *down, ids, wts, hs3, sdown, **kw, backend="reference")
    two = aq.gather_down_sum(hh, *down, ids, wts, group_size=64, bits=2, backend="reference") + aq.qmv(
        hs3, *sdown, group_size=64, bits=8, backend="reference"
    )
    assert mx.array_equal(y_ref, two).item()  # the reference face is the two launches' sum
    want = aq.gather_down_sum_shared(hh.astype(mx.float32), *f32(down), ids, wts, hs3.astype(mx.float32),
                                     f32(sdown), **kw, backend="reference")  # fmt: skip
    assert y.dtype == mx.bfloat16 and y.shape == (n, k_dim)
    _close(y, want, mx.bfloat16)
    assert [c["SW_A"] for c in emulated_twobank] == [8, 8]
    assert [c["XR_B"] for c in emulated_twobank] == [n, n]


# V4 Flash's MoE at decode: 256 experts of [2 x 2048, 4096] / [4096, 2048] 2-bit, top-6; the shared
# expert [2 x 2048, 4096] / [4096, 2048] 8-bit (group size 64)
V4_MOE = dict(hidden=4096, inter=2048, experts=256, k=6, bits=2, shared_bits=8, gs=64)


def _twobank_launch_source(mode, dt, n=1):
    """The CUDA translation unit MLX builds for MODE 3 / 4 at V4 Flash's decode shapes, n tokens
    (n > 1: the shared expert multi-row, as `_twobank_plan` picks it on CUDA)."""
    from test_kernel_emulation import mlx_cuda_source

    v = V4_MOE
    x_dtype = mx.bfloat16 if dt == "bfloat16" else mx.float32
    hid, inter, k, gs = v["hidden"], v["inter"], v["k"], v["gs"]
    bits, bits2 = v["bits"], v["shared_bits"]
    if mode == 3:
        shape = (2 * inter, hid, bits, k, 2 * inter, hid, bits2)
        banks = (
            dict(mode=1, s_dtype=x_dtype, n_rows=2 * inter, k_dim=hid, group_size=gs, bits=bits, x_div=k),
            dict(mode=1, s_dtype=x_dtype, n_rows=2 * inter, k_dim=hid, group_size=gs, bits=bits2, dense=n > 1),
        )
    else:
        shape = (hid, inter, bits, k, inter, bits2)
        banks = (
            dict(mode=2, s_dtype=x_dtype, n_rows=hid, k_dim=inter, group_size=gs, bits=bits, ke=k),
            dict(mode=0, s_dtype=x_dtype, n_rows=hid, k_dim=inter, group_size=gs, bits=bits2, dense=True),
        )
    banks[1]["x_rows"] = n
    tp = aq._twobank_plan(mode, n, shape, x_dtype, "cuda", "cuda")
    assert tp is not None and tp.b.xr == min(n, aq.XR_MAX)
    limit = aq.SHARED_BYTES["metal" if n == 1 else "cuda"]  # the one-row form fits Metal's 32 KB too
    assert tp.shared_bytes(bits, bits2, mode) <= limit
    tmpl = [(n, dt if n in ("T", "TS_A", "TS_B") else val) for n, val in aq.twobank_template(mode, tp, x_dtype, banks)]
    header, body = aq.twobank_sources("cuda", mode)
    types = {"x": dt, "w": "uint32", "scales": dt, "biases": dt, "eids": "int32", "wts": "float32", "lim": "float32"}
    types |= {"nw": "float32", "x2": dt, "w2": "uint32", "scales2": dt, "biases2": dt, "eids2": "int32"}
    types |= {"lim2": "float32"}
    outs = {"y": dt, "y2": dt} if mode == 3 else {"y": dt}
    return mlx_cuda_source(f"affine_qmv2_{mode}", header, body, types, outs, tmpl)


@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("dt", ["bfloat16", "float32"])
@pytest.mark.parametrize("mode", [3, 4])
@pytest.mark.slow_after(1)
def test_twobank_cuda_face_compiles_with_nvcc(mode, dt, n, tmp_path):
    """MODE 3 / 4's CUDA translation units at V4 Flash's shapes compile (sm_90, warnings are
    errors), one token (threadgroup memory within Metal's 32 KB too) and the multi-row shared
    expert's 3 and 8."""
    from test_kernel_emulation import nvcc_compile

    family = [_twobank_launch_source(*case) for case in itertools.product([3, 4], ["bfloat16", "float32"], [1, 3, 8])]
    nvcc_compile(tmp_path, _twobank_launch_source(mode, dt, n), family=family)


def test_twobank_texts_are_instances_of_the_plain_text():
    """MODE 3 / 4 are the plain kernel's sections per bank: no template constant of the plain
    kernel is left unsuffixed, bank B's buffers are its own, the plain kernel's text is unchanged
    by their sections, and both faces share the body."""
    import re

    for mode in (3, 4):
        body = aq.twobank_body(mode)
        words = set(re.findall(r"(?<![\w.])([A-Za-z_]\w*)", body))
        plain = {*aq.BANK_CONSTS, "NPAIR", "UNITS", "XSLOT", "GW"} - {"MODE"}  # MODE: the launch's, 3 or 4
        assert not words & plain, words & plain
        assert {"w2", "scales2", "biases2", "lim2", "tgz_A", "tgz_B"} <= words
        assert ("y2[" in body) == (mode == 3) and ("red2[at]" in body) == (mode == 4)  # MODE 4: B's own sums
        mh, mb = aq.twobank_sources("metal", mode)
        ch, cb = aq.twobank_sources("cuda", mode)
        assert (
            mb.endswith(body)
            and cb.endswith(body)
            and (mh, ch) == aq.kernel_sources("metal")[:1] + (aq.kernel_sources("cuda")[0],)
        )
        for word in ("__shfl", "__syncthreads", "threadIdx"):
            assert word not in mh + mb, word


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [mx.bfloat16, mx.float32], ids=["bf16", "f32"])
def test_gpu_twobank_v4_flash_shapes_equal_reference(dt):
    """MODE 3 and MODE 4 on the GPU face at V4 Flash's decode shapes (hidden 4096, intermediate
    2048, 256 experts top-6 2-bit, one 8-bit shared expert) against their reference faces (the two
    launches' expressions), one token and two; and the self-test the models run."""
    face = _gpu_face()
    gu, dn, sgu, sdn, kw = _v4_moe_banks(dt)
    hid, k = V4_MOE["hidden"], V4_MOE["k"]
    key = mx.random.key(13)
    for n in (1, 2):
        ids = mx.array([[5, 0, 255, 7, 2, 130], [1, 1, 3, 4, 8, 12]][:n], dtype=mx.int32)
        x = mx.random.normal((n, hid), key=mx.random.key(n)).astype(dt)
        wts = mx.softmax(mx.random.normal((n, k), key=key), axis=-1)
        got = aq.gather_swiglu_shared(x, *gu, ids, sgu, limit=10.0, shared_limit=10.0, **kw, backend=face)
        want = aq.gather_swiglu_shared(x, *gu, ids, sgu, limit=10.0, shared_limit=10.0, **kw, backend="reference")
        _close(got[0], want[0], dt)
        _close(got[1], want[1], dt)
        h, hs = want
        y = aq.gather_down_sum_shared(h, *dn, ids, wts, hs, sdn, **kw, backend=face)
        y_ref = aq.gather_down_sum_shared(h, *dn, ids, wts, hs, sdn, **kw, backend="reference")
        _close(y, y_ref, dt)
    assert aq._twobank_self_test(face)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [mx.bfloat16, mx.float32], ids=["bf16", "f32"])
def test_gpu_twobank_rows_v4_flash_shapes_equal_reference(dt):
    """MODE 3 and MODE 4 with the shared expert multi-row (its weights read once for the step's
    2, 3, 8 and 10 tokens: one slice, or two of 5) at V4 Flash's decode shapes, against the
    reference faces and against one launch per token (the one-row form); and the first-use
    self-test that keeps the form off until it passes (dispatch.UNVERIFIED_KERNELS)."""
    face = _gpu_face()
    gu, dn, sgu, sdn, kw = _v4_moe_banks(dt)
    hid, k, e = V4_MOE["hidden"], V4_MOE["k"], V4_MOE["experts"]
    for n in (2, 3, 8, 10):
        keys = mx.random.split(mx.random.key(20 + n), 3)
        ids = mx.random.randint(0, e, (n, k), key=keys[0]).astype(mx.int32)
        x = mx.random.normal((n, hid), key=keys[1]).astype(dt)
        wts = mx.softmax(mx.random.normal((n, k), key=keys[2]), axis=-1)
        lim = dict(limit=10.0, shared_limit=10.0)
        got = aq.gather_swiglu_shared(x, *gu, ids, sgu, **lim, **kw, backend=face)
        want = aq.gather_swiglu_shared(x, *gu, ids, sgu, **lim, **kw, backend="reference")
        each = [
            aq.gather_swiglu_shared(x[t : t + 1], *gu, ids[t : t + 1], sgu, **lim, **kw, backend=face) for t in range(n)
        ]
        for i in range(2):
            _close(got[i], want[i], dt)
            _close(got[i], mx.concatenate([o[i] for o in each]), dt)
        h, hs = want
        y = aq.gather_down_sum_shared(h, *dn, ids, wts, hs, sdn, **kw, backend=face)
        _close(y, aq.gather_down_sum_shared(h, *dn, ids, wts, hs, sdn, **kw, backend="reference"), dt)
        each = [
            aq.gather_down_sum_shared(
                h[t : t + 1], *dn, ids[t : t + 1], wts[t : t + 1], hs[t : t + 1], sdn, **kw, backend=face
            )
            for t in range(n)
        ]
        _close(y, mx.concatenate(each), dt)
    assert aq._twobank_rows_self_test(face)


def _v4_moe_banks(dt):
    """V4 Flash's MoE weights at decode (random): routed gate_up and down, the shared expert's,
    scales and biases in `dt`, and the two-bank calls' format keywords."""
    v = V4_MOE
    hid, inter, e, gs = v["hidden"], v["inter"], v["experts"], v["gs"]
    key = mx.random.key(13)

    def q(shape, bits, key=key):
        return mx.quantize(mx.random.normal(shape, key=key) * shape[-1] ** -0.5, gs, bits)

    def bank(shape, bits):
        """The routed banks ([gate; up] 256 x 4096 x 4096 is 2^32 values, down 2^31) in slices of 64
        experts: one float array of 2^31 or more values is past the 32-bit indexing of MLX's CUDA
        kernels (the launch failed: "cudaGraphAddKernelNode ... invalid argument", H200, 2026-12-02)."""
        parts = [q((shape[0] // 4, *shape[1:]), bits, part_key) for part_key in mx.random.split(key, 4)]
        return tuple(mx.concatenate(arrays) for arrays in zip(*parts))

    gu, dn = bank((e, 2 * inter, hid), v["bits"]), bank((e, hid, inter), v["bits"])
    sgu, sdn = q((2 * inter, hid), v["shared_bits"]), q((hid, inter), v["shared_bits"])
    cast = lambda t: (t[0], t[1].astype(dt), t[2].astype(dt))  # noqa: E731
    gu, dn, sgu, sdn = map(cast, (gu, dn, sgu, sdn))
    return gu, dn, sgu, sdn, dict(group_size=gs, bits=v["bits"], shared_group_size=gs, shared_bits=v["shared_bits"])


# ------------------------------------------------------------------ multi-row plain mode (XR x rows a threadgroup)


def _emulated_typed_kernel(tmp_path, launches):
    """A stand-in for aq._kernel() like `_emulated_kernel`, with the launch's own types: bfloat16 x,
    scales, norm weight and y run as the emulation's ds4_bf16 (rounded to nearest even, as the GPUs
    round), so the folded norm's roundings and the output's are the kernel's; each launch's
    template, grid and threadgroup recorded."""
    from test_kernel_emulation import run_on_cpu

    sec = dispatch.sections(aq.SOURCE)

    def host(a):
        return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).reshape(-1)

    def ctype(dt):
        return np.uint16 if dt == mx.bfloat16 else np.float32

    def launch(face, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        consts = {k: (ctype(v) if k in ("T", "TS") else v) for k, v in template}
        d = tmp_path / f"launch{len(launches)}"
        d.mkdir()
        launches.append({**dict(template), "grid": tuple(grid), "threadgroup": tuple(threadgroup)})
        names = ("x", "w", "scales", "biases", "eids", "wts", "lim", "nw")
        out = run_on_cpu(
            d,
            _CPU_EXTRA + sec["common"],
            aq.qmv_text(),
            inputs={n: host(a) for n, a in zip(names, inputs)},
            outputs={"y": (tuple(output_shapes[0]), ctype(output_dtypes[0]))},
            consts=consts,
            groups=(grid[0] // threadgroup[0], grid[1], grid[2]),
            threads=threadgroup[0],
        )
        y = mx.array(out["y"])
        return [y.view(mx.bfloat16) if output_dtypes[0] == mx.bfloat16 else y]

    return lambda: launch


# (x rows, bits, K, NORM, x dtype, XR_MAX, BLOCKS, the XR expected): every row count 1..8; 2, 4 and 8
# bits, K 1024 and 4096, with and without the folded norm, bfloat16 and float32 x; XR not dividing
# the rows (3 rows of XR 2, 7 of XR 4, 8 of XR 3: the last z slice's rows past the end read the last
# row and write nothing); x in K slices (K = 4096 beyond a few rows: KSL 2..4, with one unit a warp
# (CARRY, BLOCKS 32) and several (the sums in `red`, BLOCKS 2))
ROWS_CASES = [
    (1, 8, 4096, True, "bf16", 8, 2, 1),
    (2, 8, 4096, False, "bf16", 8, 32, 2),  # K slices, CARRY
    (3, 4, 1024, True, "f32", 8, 2, 3),
    (3, 8, 4096, False, "f32", 2, 2, 2),  # XR 2: z slices of 2 and 1; K slices, sums in red
    (4, 2, 4096, False, "bf16", 8, 2, 4),
    (5, 2, 1024, True, "f32", 8, 32, 5),
    (6, 4, 4096, False, "bf16", 8, 2, 6),
    (7, 8, 1024, True, "bf16", 4, 2, 4),  # XR 4: 4 and 3
    (8, 8, 4096, True, "bf16", 8, 32, 8),  # K slices, CARRY
    (8, 8, 4096, False, "f32", 8, 2, 8),  # K slices, sums in red
    (8, 8, 1024, False, "f32", 8, 32, 8),
    (8, 2, 1024, False, "bf16", 3, 2, 3),  # XR 3: 3, 3 and 2
    (8, 4, 4096, True, "f32", 8, 2, 8),
    (8, 2, 4096, True, "f32", 8, 2, 4),  # 2-bit: 9 KB of x a row and slice, XR 4 fits
    # a last K slice past the row's end (its lanes' chunks not staged, not summed)
    (5, 8, 2304, True, "bf16", 8, 2, 5),  # 144 chunks in 3 slices of 64
    (6, 4, 4608, False, "f32", 8, 32, 6),  # 144 chunks in 5 slices of 32, CARRY
]
_DT = {"bf16": mx.bfloat16, "f32": mx.float32}


@pytest.mark.parametrize("case", ROWS_CASES, ids=lambda c: "r{}_b{}_K{}_norm{:d}_{}_xrmax{}_blocks{}_xr{}".format(*c))
@pytest.mark.slow_after(1)
def test_rows_on_cpu(case, tmp_path, monkeypatch):
    """The multi-row plain mode through `qmv`'s own plan, template and grid (2 warps, so several
    steps per warp), the kernel text run by the g++ emulation in the launch's types: one launch
    with grid z = ceil(rows / XR), equal to the reference face within the file's tolerance
    (float32: summation order; bfloat16: an output rounding)."""
    rows, bits, k_dim, norm, dt, xr_max, blocks, xr = case
    dt = _DT[dt]
    launches = []
    monkeypatch.setattr(aq, "WARPS", 2)
    monkeypatch.setattr(aq, "BLOCKS", blocks)
    monkeypatch.setattr(aq, "XR_MAX", xr_max)
    monkeypatch.setattr(aq, "_kernel", _emulated_typed_kernel(tmp_path, launches))
    rng = np.random.default_rng(rows * 131 + bits * k_dim)
    n_rows, gs = 37, 64  # odd: a last unit past the end
    wq, sc, bi, _ = quantized(rng, 1, n_rows, k_dim, gs, bits)
    wq, sc, bi = mx.array(wq[0]), mx.array(sc[0]).astype(dt), mx.array(bi[0]).astype(dt)
    x = mx.array(rng.standard_normal((rows, k_dim)).astype(np.float32)).astype(dt)
    nw = mx.array(1.0 + 0.2 * rng.standard_normal(k_dim).astype(np.float32)).astype(dt)
    kw = dict(group_size=gs, bits=bits, norm=(nw, 1e-6) if norm else None)
    got = aq.qmv(x, wq, sc, bi, **kw, backend="cuda")
    assert got.shape == (rows, n_rows) and got.dtype == dt and len(launches) == 1
    c = launches[0]
    assert c["XR"] == xr and c["grid"][2] == -(-rows // xr) and c["NORM"] == int(norm)
    assert c["XROWS"] == (rows if xr > 1 else 0)
    if k_dim > 2048 and xr > 1:
        assert c["KSL"] > 1 and (c["MAXIT"] == 1) == (blocks == 32)  # K slices; CARRY or the sums in red
    # the reference on float32 copies (MLX's CPU quantized matmul sums bfloat16 in bfloat16)
    f32 = lambda a: a.astype(mx.float32)  # noqa: E731
    kw32 = dict(kw, norm=(f32(nw), 1e-6) if norm else None)
    want = aq.qmv(f32(x), wq, f32(sc), f32(bi), **kw32, backend="reference")
    _close(got, want, dt)


def _rows_launch(name, rows, dt, face="cuda"):
    """(CUDA translation unit, plan) of a `rows`-row dense call of DECODE_SHAPES[name] (or of
    ROWS_SHAPES[name]), planned for `face` by `aq.rows_plan`."""
    from test_kernel_emulation import mlx_cuda_source

    shape, norm = name.split("+")[0], name.endswith("+norm")
    n_rows, k_dim, bits, gs = ROWS_SHAPES.get(shape) or DECODE_SHAPES[shape][1:5]
    x_dtype = mx.bfloat16 if dt == "bfloat16" else mx.float32
    pl = aq.rows_plan(rows, n_rows, k_dim, bits, x_dtype, face)
    kw = dict(n_rows=n_rows, k_dim=k_dim, group_size=gs, bits=bits, dense=True, norm=norm, x_rows=rows)
    tmpl = [(k, dt if k in ("T", "TS") else v) for k, v in aq.template(0, pl, x_dtype, x_dtype, **kw)]
    header, body = aq.kernel_sources("cuda")
    types = {"x": dt, "w": "uint32", "scales": dt, "biases": dt, "eids": "int32", "wts": "float32"}
    types |= {"lim": "float32", "nw": dt}
    return mlx_cuda_source("affine_qmv_rows", header, body, types, {"y": dt}, tmpl), pl


# dense shapes beyond V4 Flash's 8-bit ones: (rows, K, bits, group size)
ROWS_SHAPES = {"dense_4096x4096_2bit": (4096, 4096, 2, 64), "dense_4096x4096_4bit": (4096, 4096, 4, 32)}
_DENSE_DECODE = sorted(k for k in DECODE_SHAPES if k.startswith("dense"))
ROWS_NVCC = [(s, 8) for s in [*_DENSE_DECODE, "dense_1024x4096_8bit+norm", *sorted(ROWS_SHAPES)]]
ROWS_NVCC += [("dense_1024x4096_8bit", 3), ("dense_4096x4096_2bit+norm", 5)]


def _ptx_shared_bytes(ptx: str) -> int:
    import re

    return sum(int(n) for n in re.findall(r"\.shared \.align \d+ \.b8 \S+\[(\d+)\]", ptx))


@pytest.mark.parametrize("dt", ["bfloat16", "float32"])
@pytest.mark.parametrize("name,rows", ROWS_NVCC, ids=lambda v: str(v))
@pytest.mark.slow_after(1)
def test_rows_cuda_face_compiles_with_nvcc(name, rows, dt, tmp_path):
    """The multi-row launches' CUDA translation units at the decode shapes compile (sm_90, warnings
    are errors), XR > 1, and their threadgroup arrays (read from the PTX) are within the plan's
    shared_bytes, itself within the CUDA face's 48 KB."""
    from test_kernel_emulation import nvcc_compile

    src, pl = _rows_launch(name, rows, dt)
    assert pl.xr > 1 and pl.nz == -(-rows // pl.xr)
    nvcc_compile(tmp_path, src)
    used = _ptx_shared_bytes((tmp_path / "kernel.ptx").read_text())
    assert 0 < used <= pl.shared_bytes(int(name.split("bit")[0].split("_")[-1])) <= aq.SHARED_BYTES["cuda"]


@pytest.mark.parametrize("name", ["dense_1024x4096_8bit+norm", "dense_4096x4096_2bit", "dense_32768x1024_8bit"])
@pytest.mark.slow_after(1)
def test_rows_metal_plans_within_32k(name, tmp_path):
    """Metal's 32 KB: the Metal face's multi-row plans, their arrays as the one text declares them
    (the CUDA translation unit of the same template, read from its PTX), within 32 KB."""
    from test_kernel_emulation import nvcc_compile

    src, pl = _rows_launch(name, 8, "bfloat16", face="metal")
    assert pl.xr > 1
    nvcc_compile(tmp_path, src)
    assert _ptx_shared_bytes((tmp_path / "kernel.ptx").read_text()) <= aq.SHARED_BYTES["metal"]


@pytest.mark.parametrize("face", ["metal", "cuda"])
def test_rows_plans_fit_and_cover(face):
    """Every dense shape (V4 Flash's decode calls, 2- and 4-bit ones, K 1024..8192), 2..8 rows, both
    dtypes: XR > 1 x rows a z slice, the z slices cover the rows (none empty), every output row has
    a warp row and step, the K slices cover K, threadgroup memory within the face's limit; 8-bit
    (V4 Flash's dense weights): all rows in one z slice on both faces."""
    shapes = [DECODE_SHAPES[k][1:5] for k in _DENSE_DECODE] + list(ROWS_SHAPES.values())
    shapes += [(1024, 1024, 2, 32), (7, 8192, 4, 128)]
    for n_rows, k_dim, bits, _ in shapes:
        for rows in range(2, 9):
            for dt in (mx.bfloat16, mx.float32):
                pl = aq.rows_plan(rows, n_rows, k_dim, bits, dt, face)
                assert 1 < pl.xr <= aq.XR_MAX and pl.nz == -(-rows // pl.xr) and (pl.nz - 1) * pl.xr < rows
                assert pl.shared_bytes(bits) <= aq.SHARED_BYTES[face], (n_rows, k_dim, bits, rows)
                assert pl.nby * (aq.WARPS // pl.ksplit) * pl.maxit * pl.rpw >= n_rows
                assert pl.ksl * pl.nit * pl.ksplit * 32 >= k_dim * bits // 128 > (pl.ksl - 1) * pl.nit * pl.ksplit * 32
                assert pl.nit * pl.rpw <= (aq.LPT if pl.xr <= 4 else aq.LPT // 2) and pl.maxit <= aq.MAXIT
                if bits == 8:
                    assert pl.xr == rows and pl.nz == 1


def _spy_kernel(launches):
    def fake_kernel():
        def launch(face, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            launches.append({**dict(template), "grid": tuple(grid)})
            return [mx.zeros(s, t) for s, t in zip(output_shapes, output_dtypes)]

        return launch

    return fake_kernel


@pytest.mark.parametrize("face", ["cuda", "metal"])
@pytest.mark.parametrize("kind", ["dense_1024x4096", "dense_32768x1024", "dense_4096x8192"])
def test_rows_entry_is_one_launch(kind, face, monkeypatch):
    """`qmv` (what QMVLinear calls) sends B = 1..8 rows of V4 Flash's dense decode calls as ONE
    launch with grid z = ceil(B / XR), XR = B (8-bit: one z slice), in the caller's shape (K = 8192 on
    Metal: not `supported`, one row of x does not fit 32 KB: MLX's own op, no launch)."""
    launches = []
    monkeypatch.setattr(aq, "_kernel", _spy_kernel(launches))
    n_rows, k_dim, bits = DECODE_CALLS[kind]
    if not aq.supported(k_dim, 64, bits, face):
        assert face == "metal" and k_dim == 8192
        pytest.skip("not supported on this face (one x row exceeds its threadgroup memory)")
    wq, sc, bi = mx.quantize(mx.zeros((n_rows, k_dim)), 64, bits)
    for b in range(1, 9):
        launches.clear()
        x = mx.zeros((b, 1, k_dim), mx.bfloat16)
        y = aq.qmv(x, wq, sc.astype(mx.bfloat16), bi.astype(mx.bfloat16), group_size=64, bits=bits, backend=face)
        assert y.shape == (b, 1, n_rows) and len(launches) == 1
        c = launches[0]
        assert (c["XR"], c["grid"][2], c["XROWS"]) == ((b, 1, b) if b > 1 else (1, 1, 0))


def test_rows_entry_tail_slices(monkeypatch):
    """Where XR rows do not fit (2-bit, K = 4096: 9 KB of x a row and slice), the fewest z slices:
    8 rows as XR 4 x 2 on CUDA, XR 3 x 3 (3, 3, 2) on Metal; one launch each."""
    launches = []
    monkeypatch.setattr(aq, "_kernel", _spy_kernel(launches))
    wq, sc, bi = mx.quantize(mx.zeros((4096, 4096)), 64, 2)
    x = mx.zeros((8, 4096), mx.bfloat16)
    for face, xr in (("cuda", 4), ("metal", 3)):
        launches.clear()
        aq.qmv(x, wq, sc, bi, group_size=64, bits=2, backend=face)
        assert len(launches) == 1 and launches[0]["XR"] == xr and launches[0]["grid"][2] == -(-8 // xr)


def test_rows_go_straight_to_the_kernel_once_verified(fake_cuda):
    """'affine_qmv.rows' passed its GPU tests (H100): no first-use self-test, XR rows a slice."""
    assert "affine_qmv.rows" not in dispatch.UNVERIFIED_KERNELS
    launches = []
    fake_cuda.setattr(aq, "_kernel", _spy_kernel(launches))
    wq, sc, bi = mx.quantize(mx.random.normal((64, 1024), key=mx.random.key(1)), 64, 8)
    aq.qmv(mx.random.normal((5, 1024), key=mx.random.key(2)), wq, sc, bi, group_size=64, bits=8)
    assert ("affine_qmv.rows", "cuda") not in dispatch._self_tests
    assert len(launches) == 1 and (launches[0]["XR"], launches[0]["grid"][2]) == (5, 1)


def test_unverified_rows_self_test_on_cuda(fake_cuda):
    """A multi-row kernel listed unverified (as 'affine_qmv.rows' was until its GPU tests passed):
    on CUDA its first use self-tests it; a failure sends the rows one a z slice (XR = 1, the
    verified kernel: still one launch), a pass sends XR rows a slice."""
    fake_cuda.setattr(dispatch, "UNVERIFIED_KERNELS", dispatch.UNVERIFIED_KERNELS | {"affine_qmv.rows"})
    launches = []
    fake_cuda.setattr(aq, "_kernel", _spy_kernel(launches))
    wq, sc, bi = mx.quantize(mx.random.normal((64, 1024), key=mx.random.key(1)), 64, 8)
    x = mx.random.normal((5, 1024), key=mx.random.key(2))
    aq.qmv(x, wq, sc, bi, group_size=64, bits=8)  # the self-test's launches (zeros: wrong), then the call's
    assert dispatch._self_tests[("affine_qmv.rows", "cuda")] is False
    assert (launches[-1]["XR"], launches[-1]["grid"][2]) == (1, 5)
    launches.clear()
    aq.qmv(x[:1], wq, sc, bi, group_size=64, bits=8)  # one row: no multi-row self-test needed
    assert (launches[-1]["XR"], launches[-1]["grid"][2]) == (1, 1)
    fake_cuda.setattr(dispatch, "_self_tests", {("affine_qmv.rows", "cuda"): True})
    launches.clear()
    aq.qmv(x, wq, sc, bi, group_size=64, bits=8)
    assert len(launches) == 1 and (launches[0]["XR"], launches[0]["grid"][2]) == (5, 1)


def test_rows_self_test_on_the_cpu_emulation(tmp_path, monkeypatch):
    """The first-use self-test of the multi-row mode passes on the g++ emulation of the text (it
    compares XR-row launches, K slices, a tail slice and the norm with the reference face; here the
    reference's bfloat16 mat-vec sums in float32, as MLX's GPU kernels do: its CPU kernel sums in
    bfloat16, up to ~1 off at K = 4096)."""
    launches = []
    monkeypatch.setattr(aq, "WARPS", 2)
    monkeypatch.setattr(aq, "BLOCKS", 2)
    monkeypatch.setattr(aq, "_kernel", _emulated_typed_kernel(tmp_path, launches))
    qmm = mx.quantized_matmul

    def qmm_f32(x, w, scales, biases, **kw):
        f32 = lambda a: a.astype(mx.float32)  # noqa: E731
        return qmm(f32(x), w, f32(scales), f32(biases), **kw).astype(x.dtype)

    monkeypatch.setattr(mx, "quantized_matmul", qmm_f32)
    # 37 weight rows at most (on 2 warps and 2 threadgroups: several steps a warp all the same)
    monkeypatch.setattr(aq, "_ROWS_SELF_TEST_CASES", [(*c[:-1], min(c[-1], 37)) for c in aq._ROWS_SELF_TEST_CASES])
    assert aq._rows_self_test("cuda")
    # one multi-row launch per case, then one launch per row (the self-test compares both)
    multi = [c for c in launches if c.get("XR", 1) > 1]
    assert len(multi) == len(aq._ROWS_SELF_TEST_CASES)
    assert len(launches) == len(multi) + sum(c[4] for c in aq._ROWS_SELF_TEST_CASES)
    assert any(c["KSL"] > 1 and c["MAXIT"] > 1 for c in multi) and any(c["XROWS"] % c["XR"] for c in multi)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [k for k in sorted(DECODE_CALLS) if k.startswith("dense")])
def test_gpu_rows_decode_calls_equal_reference(kind):
    """The multi-row plain mode on the GPU face at V4 Flash's dense decode shapes, 1..8 x rows in one
    launch (XR = rows, K slices), bfloat16 (float32 too at 1024 x 4096), the folded norm at 1024 x
    4096: against the reference face, and against one launch per row (XR = 1, the verified kernel)."""
    face = _gpu_face()
    n_rows, k_dim, bits = DECODE_CALLS[kind]
    key = mx.random.key(n_rows + k_dim)
    wq, sc, bi = mx.quantize(mx.random.normal((n_rows, k_dim), key=key) * k_dim**-0.5, 64, bits)
    for dt in (mx.bfloat16, mx.float32) if kind == "dense_1024x4096" else (mx.bfloat16,):
        s, b = sc.astype(dt), bi.astype(dt)
        nw = (1.0 + 0.2 * mx.random.normal((k_dim,), key=key)).astype(dt)
        for rows in range(1, 9) if dt == mx.bfloat16 else (3, 8):
            x = mx.random.normal((rows, k_dim), key=mx.random.key(rows)).astype(dt)
            norms = [None] + ([(nw, 1e-6)] if kind == "dense_1024x4096" and rows in (2, 5, 8) else [])
            for norm in norms:
                kw = dict(group_size=64, bits=bits, norm=norm)
                got = aq.qmv(x, wq, s, b, **kw, backend=face)
                assert got.shape == (rows, n_rows) and got.dtype == dt
                _close(got, aq.qmv(x, wq, s, b, **kw, backend="reference"), dt)
                each = mx.concatenate([aq.qmv(x[i : i + 1], wq, s, b, **kw, backend=face) for i in range(rows)])
                _close(got, each, dt)


@pytest.mark.gpu
def test_gpu_rows_self_test_passes():
    """The multi-row mode's first-use self-test (dispatch.UNVERIFIED_KERNELS 'affine_qmv.rows' until
    this file's GPU tests pass) accepts the GPU face."""
    assert aq._rows_self_test(_gpu_face())
