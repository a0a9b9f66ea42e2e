"""grouped_qmm's tensor-core variant (`mma=True`, kernels/mma_tile.py's tile API).

* the shared text (its `grouped_qmm_mma` section) compiled with g++, threadgroups emulated, the
  tile API given a CPU definition (each emulated lane holds a whole tile and computes the whole
  product, at CUDA's 16 x 16 x 16 and at Metal's 8 x 8 x 8): per type, partial row and token
  tiles, padding, an odd number of K chunks (Q8_0); against two oracles:
  - the product of the operands rounded to MT (float64): within the float32 summation bound
    ``K 2**-23 sum |w x|`` -- the rounding points themselves are checked;
  - the float32 reference face: within the stated bound ``(e + K 2**-22) sum |w x|`` (+ float16
    underflow), e = 2**-8 (bfloat16 operands) or 2**-11 (float16);
  and a one-hot x that reads every decoded weight back as MT, bit for bit;
* the CUDA face: no #include beyond MLX's preamble's (NVRTC's header set); compiled by
  nvcc for sm_90 at V4 Flash shapes into PTX mma.sync, no spills (the per-lane fragment
  offsets: tests/test_mma_fragments.py);
* the mode switch and the launch geometry; `-m gpu`: the GPU face at V4 Flash expert shapes
  for every type in float32 and bfloat16, and SwitchGLU under grouped_blocks_mma.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest
from test_grouped_qmm import (
    V4_FLASH_CASES,
    _k_for,
    bfloat16_case_on_cpu,
    cpu_case,
    dense,
    glu_on_gpu_vs_cpu,
    run_grouped_on_cpu,
    v4_flash_batches,
)
from test_quant_moe import experts

from ds4mlx.io.quant import QT, dequantize
from ds4mlx.kernels import dispatch, grouped_qmm, quant_moe
from ds4mlx.models import prefill_experts

TYPES = list(quant_moe.SUPPORTED)

pytestmark = pytest.mark.usefixtures("cpu_unless_gpu_test")


def cpu_tile_api(size: int) -> str:
    """The tile API for the g++ emulation: every lane of a SIMD group holds the whole tile
    (float32 values of the MT operands) and computes the whole product; the collective
    loads read, and stores write, the same values in every lane."""
    return (
        f"#define DS4_MMA_M {size}\n#define DS4_MMA_N {size}\n#define DS4_MMA_K {size}\n"
        + r"""
template <int R, int C> struct ds4_emu_tile { float v[R * C]; };
#define DS4_MMA_A ds4_emu_tile<DS4_MMA_M, DS4_MMA_K>
#define DS4_MMA_B ds4_emu_tile<DS4_MMA_K, DS4_MMA_N>
#define DS4_MMA_C ds4_emu_tile<DS4_MMA_M, DS4_MMA_N>
template <int R, int C> static inline void ds4_mma_zero(ds4_emu_tile<R, C>& t) {
    for (int i = 0; i < R * C; ++i) t.v[i] = 0.0f;
}
template <typename E> static inline void ds4_mma_load_a(DS4_MMA_A& a, const E* p, uint32_t ld) {
    for (int m = 0; m < DS4_MMA_M; ++m) for (int k = 0; k < DS4_MMA_K; ++k) a.v[m * DS4_MMA_K + k] = float(p[m * ld + k]);
}
template <typename E> static inline void ds4_mma_load_b(DS4_MMA_B& b, const E* p, uint32_t ld) {
    for (int k = 0; k < DS4_MMA_K; ++k) for (int n = 0; n < DS4_MMA_N; ++n) b.v[k * DS4_MMA_N + n] = float(p[n * ld + k]);
}
static inline void ds4_mma(DS4_MMA_C& c, const DS4_MMA_A& a, const DS4_MMA_B& b) {
    for (int m = 0; m < DS4_MMA_M; ++m) for (int n = 0; n < DS4_MMA_N; ++n) {
        float s = c.v[m * DS4_MMA_N + n];
        for (int k = 0; k < DS4_MMA_K; ++k) s += a.v[m * DS4_MMA_K + k] * b.v[k * DS4_MMA_N + n];
        c.v[m * DS4_MMA_N + n] = s;
    }
}
static inline void ds4_mma_store(float* p, const DS4_MMA_C& c, uint32_t ld) {
    for (int m = 0; m < DS4_MMA_M; ++m) for (int n = 0; n < DS4_MMA_N; ++n) p[m * ld + n] = c.v[m * DS4_MMA_N + n];
}
#define ds4_mma_barrier() ds4_warp_barrier()
static inline uint32_t ds4_mt_bits(ds4_bf16 v) { return v.bits; }
static inline uint32_t ds4_mt_bits(_Float16 v) { uint16_t u; std::memcpy(&u, &v, 2); return u; }
#define ds4_mma_bits(f) ds4_mt_bits(static_cast<MT>(f))
"""
    )


def run_mma_on_cpu(tmp_path, qtype, raw, x, eids, m_rows, lens=None, *, tile=16, out_dtype=np.float32):
    """The shared tensor-core text through `run_on_cpu`, launched as `grouped_qmm(mma=True)`
    launches it, on `cpu_tile_api(tile)`; x [B * M, K] float32 (MT float16) or bfloat16 bits
    as uint16 (MT bfloat16)."""
    return run_grouped_on_cpu(tmp_path, qtype, raw, x, eids, m_rows, lens, out_dtype, mma_api=cpu_tile_api(tile))


def to_operand(a: np.ndarray, bf16: bool) -> np.ndarray:
    """a rounded to MT (to nearest even), as float64."""
    if bf16:
        return np.array(mx.array(a.astype(np.float32)).astype(mx.bfloat16).astype(mx.float32)).astype(np.float64)
    return a.astype(np.float32).astype(np.float16).astype(np.float64)


def stated_bound(mag, k, bf16, wsum=0.0, xsum=0.0):
    """The module's bound against the float32 reference (before the output's rounding to T)."""
    e = 2.0**-8 if bf16 else 2.0**-11
    return (e + k * 2.0**-22) * mag + (0.0 if bf16 else 2.0**-24 * (wsum + xsum)) + 1e-30


def check_both(got, raw, qtype, x, eids, lens, bf16, out_rel=0.0):
    """got [B, M, N] against the rounded-operand oracle (summation bound) and the float32
    product (the stated bound); padding rows exactly 0."""
    e, rows, _ = raw.shape
    k = x.shape[-1]
    live = np.arange(x.shape[1])[None, :, None] < np.array(lens)[:, None, None]
    w = dequantize(raw, qtype, (e, rows, k))[eids]  # [B, N, K] float32
    xw = x * live
    wr, xr = to_operand(w, bf16), to_operand(xw, bf16)
    want_r = np.einsum("bmk,bnk->bmn", xr, wr)
    mag_r = np.einsum("bmk,bnk->bmn", np.abs(xr), np.abs(wr))
    got = got.reshape(want_r.shape).astype(np.float64)
    assert np.all(np.where(live, 0.0, got) == 0.0)
    bound = k * 2.0**-23 * mag_r + out_rel * np.abs(want_r) + 1e-30
    assert np.all(np.abs(got - want_r) <= bound), float(np.max(np.abs(got - want_r) / bound))
    want, mag = dense(raw, qtype, xw, eids)
    wsum = np.abs(w).sum(-1)[:, None, :]
    xsum = np.abs(xw).sum(-1)[:, :, None]
    bound = stated_bound(mag, k, bf16, wsum, xsum) + out_rel * np.abs(want)
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))


CPU_CASES = [
    # (E, rows, K, experts of the batches, M, live rows of the batches)
    (3, 130, 512, [2, 0, 2], 20, [20, 20, 20]),  # a second row tile of 2 rows; a token tile of 32 holding 20
    (2, 64, 256, [1, 0, 1], 70, [70, 9, 64]),  # two token tiles per batch (64 + 6); one live 16-row tile of 4;
    # a tile of padding only; half a row tile
    (4, 128, 768, [3, 1], 16, [16, 0]),  # one whole row tile, one 16-row token tile, 12 steps of K; an empty batch
]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    "case", CPU_CASES, ids=lambda c: f"E{c[0]}_r{c[1]}_K{c[2]}_B{len(c[3])}_M{c[4]}_live{sum(c[5])}"
)
@pytest.mark.slow_after(1)
def test_shared_text_compiled_for_cpu(qtype, case, tmp_path):
    """float32 x (float16 operands) at CUDA's tile shape; Q8_0's K is no multiple of 64 (an
    odd number of chunks: the last step's second half is zeros)."""
    raw, eids, x, m, lens = cpu_case(qtype, case)
    k = x.shape[-1]
    got = run_mma_on_cpu(tmp_path, qtype, raw, x.reshape(-1, k), eids, m, lens)
    check_both(got, raw, qtype, x, eids, lens, bf16=False)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.slow
def test_shared_text_at_metal_tile_shape(qtype, tmp_path):
    """The same text on 8 x 8 x 8 tiles (Metal's simdgroup matrices: two column tiles per SIMD
    group, two row tiles per token tile of 16), bfloat16 x and y."""
    e, rows, k, ids, m, lens = CPU_CASES[1]
    k = _k_for(qtype, k)
    raw = experts(qtype, e, rows, k, seed=3)
    eids = np.array(ids, np.int32)
    x = mx.random.normal((eids.size, m, k), key=mx.random.key(3)).astype(mx.bfloat16)
    bits = np.array(x.view(mx.uint16)).reshape(-1, k)
    got = run_mma_on_cpu(tmp_path, qtype, raw, bits, eids, m, lens, tile=8, out_dtype=np.uint16)
    got = np.array(mx.array(got).view(mx.bfloat16).astype(mx.float32))
    check_both(got, raw, qtype, np.array(x.astype(mx.float32)), eids, lens, bf16=True, out_rel=2.0**-8)


@pytest.mark.parametrize("qtype", [QT.IQ2_XXS, QT.Q2_K], ids=lambda t: t.name)
@pytest.mark.slow
def test_shared_text_bfloat16(qtype, tmp_path):
    """bfloat16 x and y at CUDA's tile shape: bfloat16 operands (x not rounded again), the
    float32 sums rounded once to bfloat16."""
    got, raw, eids, x = bfloat16_case_on_cpu(tmp_path, qtype, mma_api=cpu_tile_api(16))
    check_both(got, raw, qtype, x, eids, [x.shape[1]] * 2, bf16=True, out_rel=2.0**-8)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.slow_after(1)
def test_shared_text_decodes_into_operands_exactly(qtype, tmp_path):
    """One-hot x (token m of batch b is e_m): y[b, m, n] = W[eids[b]][n, m] rounded to float16,
    the staged operand itself, equal to the reference decoding rounded the same way."""
    k = 256 if qtype != QT.Q8_0 else 96
    raw = experts(qtype, 3, 5, k, seed=4)
    eids = np.array([2, 0], np.int32)
    x = np.tile(np.eye(k, dtype=np.float32), (eids.size, 1))
    got = run_mma_on_cpu(tmp_path, qtype, raw, x, eids, k).reshape(eids.size, k, 5)
    want = dequantize(raw, qtype, (3, 5, k))[eids].swapaxes(1, 2).astype(np.float16).astype(np.float32)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.slow_after(1)
def test_cuda_face_compiles_without_spills(qtype, dtype, tmp_path):
    """The CUDA unit mx.fast.cuda_kernel builds at V4 Flash's gate / up shape (2,048 rows of
    4,096 values, batches of 64 rows): PTX for sm_90 with warnings as errors, then ptxas for
    sm_90 reports no spill to local memory and fits 2 thread groups of 256 per SM (<= 128
    registers a thread)."""
    from test_kernel_emulation import mlx_cuda_source, nvcc_compile

    h, b = grouped_qmm.kernel_sources(qtype, "cuda", mma=True)
    k = 4096
    mt = "bfloat16" if dtype == "bfloat16" else "float16"
    tmpl = [("T", dtype), ("N_ROWS", 2048), ("K_DIM", k), ("ROW_BYTES", quant_moe.row_bytes(qtype, k))]
    tmpl += [("M_ROWS", 64), ("GQ_TM", 64), ("MT", mt)]
    ins = {"x": dtype, "w": "uint32", "eids": "int32", "lens": "int32"}
    src = mlx_cuda_source(f"grouped_qmm_mma_{qtype.name.lower()}", h, b, ins, {"y": dtype}, tmpl)
    src = src.replace("const uint32_t* w,", "const uint8_t* w,")
    nvcc_compile(tmp_path, src)
    ptx = (tmp_path / "kernel.ptx").read_text()
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{'bf16' if mt == 'bfloat16' else 'f16'}" in ptx
    cu = tmp_path / "kernel.cu"
    res = subprocess.run(
        [
            shutil.which("nvcc"),
            "-std=c++17",
            "-arch=sm_90",
            "-cubin",
            "-Xptxas",
            "-v",
            "-o",
            str(tmp_path / "k.cubin"),
            str(cu),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", res.stderr)]
    assert spills and not any(spills) and regs <= 128, res.stderr


def includes(src: str) -> set[str]:
    return {line.strip() for line in src.splitlines() if line.strip().startswith("#include")}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_cuda_face_includes_no_header(qtype):
    """MLX builds custom kernels with NVRTC against the pip CUDA headers, where <mma.h> wants
    a crt/mma.h they lack (the first H100 run's self-tests failed so): the CUDA face's own text
    includes no header beyond MLX's preamble's (cuda_bf16.h, cuda_fp16.h, ...)."""
    from test_kernel_emulation import MLX_CUDA_PREAMBLE

    h, b = grouped_qmm.kernel_sources(qtype, "cuda", mma=True)
    assert includes(h + b) <= includes(MLX_CUDA_PREAMBLE)


# --------------------------------------------------------------------------- launches, mode


def test_tokens_per_tile():
    want = [16, 16, 32, 48, 48, 64, 64, 64]
    assert [grouped_qmm.tokens_per_tile(m) for m in (1, 16, 17, 33, 48, 64, 65, 512)] == want


def test_launch_geometry_and_reference(monkeypatch):
    """mma=True launches grouped_qmm_mma with GQ_TM and MT (bfloat16 for bfloat16 x, else
    float16) over ceil(M / GQ_TM) token tiles per batch; its reference face is the float32 one."""
    launches = []

    def kernel(qtype, mma=False):
        def launch(face, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            launches.append((mma, dict(template), grid, threadgroup))
            x, w, eids, lens = inputs
            return [grouped_qmm.grouped_qmm(x, w, qtype, eids, lens, backend="reference").astype(output_dtypes[0])]

        return launch

    monkeypatch.setattr(grouped_qmm, "_kernel", kernel)
    blocks = quant_moe.random_gguf_blocks(QT.Q2_K, 3, 130, 256, seed=5)
    eids = mx.array([2, 0], dtype=mx.int32)
    for m, dt in ((20, mx.float32), (70, mx.bfloat16)):
        x = mx.random.normal((2, m, 256), key=mx.random.key(m)).astype(dt)
        got = grouped_qmm.grouped_qmm(x, blocks, QT.Q2_K, eids, backend="cuda", mma=True)
        want = grouped_qmm.grouped_qmm(x, blocks, QT.Q2_K, eids, backend="reference", mma=True)
        assert np.array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))
    assert [(mma, t["GQ_TM"], t["MT"], g, tg) for mma, t, g, tg in launches] == [
        (True, 32, mx.float16, (256, 2, 2), (256, 1, 1)),
        (True, 64, mx.bfloat16, (256, 2, 4), (256, 1, 1)),
    ]
    assert all("GQ_RM" not in t for _, t, _, _ in launches)


def test_bad_mma_face_falls_back(fake_gpu):
    """An unverified variant (UNVERIFIED_KERNELS) that fails its first-use self-test falls
    back to the reference; the float32 variant's choice is untouched."""
    assert set(grouped_qmm.MMA_KERNELS.values()) <= dispatch.UNVERIFIED_KERNELS

    def garbage(qtype, mma=False):
        def launch(face, *, output_shapes, output_dtypes, **kw):
            return [mx.full(s, 7.0, t) for s, t in zip(output_shapes, output_dtypes)]

        return launch

    fake_gpu.setattr(grouped_qmm, "_kernel", garbage)
    assert grouped_qmm.face(QT.Q2_K, mma=True) == "reference"
    assert dispatch._self_tests[("grouped_qmm_mma.Q2_K", "metal")] is False


def test_mode_switch(monkeypatch):
    monkeypatch.setenv(prefill_experts.ENV, "grouped_blocks_mma")
    assert prefill_experts.grouped_wanted(prefill_experts.MIN_PAIRS)
    assert prefill_experts.blocks_wanted() and prefill_experts.mma_wanted()
    monkeypatch.setenv(prefill_experts.ENV, "grouped_blocks")
    assert prefill_experts.blocks_wanted() and not prefill_experts.mma_wanted()
    monkeypatch.delenv(prefill_experts.ENV)
    assert not prefill_experts.mma_wanted()  # auto: not until a GPU measurement


def test_switch_glu_in_mma_mode_on_the_cpu(monkeypatch):
    """On the CPU the mode runs grouped_qmm's reference face (float32): the per-pair path's result."""
    from test_grouped_experts import GGUF_BANKS, _assert_close, _gguf_glu, _routing

    glu = _gguf_glu(GGUF_BANKS["ds4"], 256, 256, seed=5)
    x = mx.random.normal((1, 300, 256), key=mx.random.key(5)) * 0.3
    idx = _routing("hot", 300, 5)
    calls = []
    real = grouped_qmm.grouped_qmm
    monkeypatch.setattr(grouped_qmm, "grouped_qmm", lambda *a, **kw: calls.append(kw["mma"]) or real(*a, **kw))
    monkeypatch.setattr(prefill_experts, "MIN_PAIRS", 1)
    monkeypatch.setenv(prefill_experts.ENV, "gather_qmm")
    want = np.array(glu(x, idx)).astype(np.float64)
    monkeypatch.setenv(prefill_experts.ENV, "grouped_blocks_mma")
    got = np.array(glu(x, idx)).astype(np.float64)
    assert calls == [True] * 3  # gate, up, down
    _assert_close(want, got)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("case", V4_FLASH_CASES, ids=lambda c: f"{c[0].name}_r{c[1]}_K{c[2]}")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_gpu_equals_reference_at_v4_flash_shapes(case, dtype):
    """test_grouped_qmm's V4 Flash batches through the GPU face's tensor-core variant against
    the float32 reference face, within the stated bound (float16 operands for float32 x,
    bfloat16 for bfloat16 x); and its first-use self-test."""
    face = dispatch.gpu_backend()
    if face is None:
        pytest.skip("no MLX GPU backend")
    qtype, rows, k = case
    assert grouped_qmm._self_test(face, qtype, mma=True)
    v = v4_flash_batches(qtype, rows, k, dtype)
    got = grouped_qmm.grouped_qmm(v["x"], v["raw"], qtype, v["eids"], v["lengths"], backend=face, mma=True)
    assert got.dtype == dtype and got.shape == v["want"].shape
    bf16 = dtype == mx.bfloat16
    bound = stated_bound(v["mag"], k, bf16, v["wsum"], v["xsum"])
    bound += (2.0**-8 if bf16 else 0.0) * np.abs(v["want"])  # the output rounded to bfloat16
    got = np.array(got.astype(mx.float32)).astype(np.float64)
    assert np.all(np.abs(got - v["want"]) <= bound), float(np.max(np.abs(got - v["want"]) / bound))
    assert np.all(got[~v["live"]] == 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bank", ["ds4", "Q4_K"])
def test_gpu_switch_glu_in_mma_mode(monkeypatch, bank, dtype):
    got, want = glu_on_gpu_vs_cpu(monkeypatch, bank, dtype, "grouped_blocks_mma", mma=True)
    # float16 operands (float32 x): ~2**-11 a product; bfloat16: x, the SwiGLU output and y rounded to 8 bits
    assert np.abs(got - want).max() <= (2e-3 if dtype == mx.float32 else 3e-2) * np.abs(want).max()
