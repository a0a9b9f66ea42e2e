"""Quantized MoE: gathered mat-vec / mat-mul on GGUF blocks.

The reference face (MLX ops) is checked against the dense float32 computation
(numpy dequantization, then a matmul); the GPU faces (``-m gpu``) against the
reference on the same shapes.

Bound: both sides form the same products of identical float32 weights (decoding is
bit-exact) and differ only in summation order, so per output
``|a - b| <= K * 2**-23 * sum_h |w_h x_h|`` (the classic worst-case bound for two
orders of a K-term float32 sum, with the product roundings).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from test_quant import random_blocks  # noqa: E402  (tests/ is on sys.path under pytest)

from ds4mlx.io.quant import dequantize
from ds4mlx.kernels import dispatch
from ds4mlx.kernels import quant_moe as qm
from ds4mlx.kernels.activations import clamped_swiglu

TYPES = list(qm.SUPPORTED)
# MLX's CUDA backend multiplies float32 matrices in TF32 (inputs rounded to 10
# mantissa bits, seen on an H200: errors ~1e-3 relative): plain matmuls on a GPU
# get this extra relative allowance; the custom kernels do not need it.
TF32_REL = 2.0**-9


# exactness claims are about MLX's CPU kernels; `gpu` tests keep the default device
pytestmark = pytest.mark.usefixtures("cpu_unless_gpu_test")


def experts(qtype, e, rows, k, seed=0):
    rng = np.random.default_rng(seed)
    return random_blocks(qtype, (e, rows, k), rng, scale=0.01)


def dense(raw, qtype, x, ids):
    """float32 oracle: out[t, j, r] = W[ids[t, j]][r] . x[t(, j)]"""
    e, rows, _ = raw.shape
    k = x.shape[-1]
    w = dequantize(raw, qtype, (e, rows, k))
    wsel = w[ids]  # [T, k, rows, K]
    xx = x[:, None, :] if x.ndim == 2 else x  # [T, 1|k, K]
    out = np.einsum("tjrh,tjh->tjr", wsel.astype(np.float64), np.broadcast_to(xx, (*ids.shape, k)).astype(np.float64))
    mag = np.einsum("tjrh,tjh->tjr", np.abs(wsel).astype(np.float64), np.abs(np.broadcast_to(xx, (*ids.shape, k))))
    return out, mag


def check(got, want, mag, k, rel=0.0):
    got = np.asarray(got, dtype=np.float64)
    bound = k * 2.0**-23 * mag + rel * mag + 1e-30
    assert got.shape == want.shape
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))


# ------------------------------------------------------------------ reference decoding


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_mx_bit_exact(qtype):
    k = 768 if qtype != QT.Q8_0 else 96
    raw = experts(qtype, 3, 5, k, seed=1)
    want = dequantize(raw, qtype, raw.shape[:2] + (k,))
    got = np.array(qm.dequantize_mx(mx.array(raw), qtype, k))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    got2 = np.array(qm.gather_dequantize(mx.array(raw), qtype, [2, 0, 2], backend="reference"))
    assert np.array_equal(got2.view(np.uint32), want[[2, 0, 2]].view(np.uint32))


# ------------------------------------------------------------------ reference == dense float32

SHAPES = [
    # (E, rows, K, n_tok, k)
    (5, 7, 256, 3, 2),
    (1, 13, 512, 5, 1),  # one expert
    (4, 3, 768, 2, 4),  # all experts selected by every token, K = 3 blocks
    (9, 1, 256, 1, 8),  # one row, k = 8
    (8, 6, 512, 4, 6),
]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}_r{}_K{}_t{}_k{}".format(*s))
def test_reference_qmv_matches_dense(qtype, shape):
    e, rows, k, n_tok, top = shape
    if qtype == QT.Q8_0:
        k = k // 8 * 3  # odd number of 32-blocks
    rng = np.random.default_rng(sum(shape))
    raw = experts(qtype, e, rows, k, seed=e * rows)
    if e == 4 and top == 4:
        ids = np.stack([rng.permutation(4) for _ in range(n_tok)])
    else:
        ids = rng.integers(0, e, (n_tok, top))
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    want, mag = dense(raw, qtype, x, ids)
    got = qm.gather_qmv(mx.array(x), mx.array(raw), qtype, mx.array(ids), backend="reference")
    check(np.array(got), want, mag, k)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("top", range(1, 9))
def test_reference_k_1_to_8_per_expert_inputs(qtype, top):
    # the down projection: a different input vector per (token, selected expert)
    e, rows, n_tok = 8, 5, 3
    k = 256 if qtype != QT.Q8_0 else 64
    rng = np.random.default_rng(100 + top)
    raw = experts(qtype, e, rows, k, seed=top)
    ids = np.stack([rng.choice(e, top, replace=False) for _ in range(n_tok)])
    x = rng.standard_normal((n_tok, top, k)).astype(np.float32)
    want, mag = dense(raw, qtype, x, ids)
    got = qm.gather_qmv(mx.array(x), mx.array(raw), qtype, mx.array(ids), backend="reference")
    check(np.array(got), want, mag, k)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("per_pair", [False, True])
def test_reference_prefill_qmm_matches_dense(qtype, per_pair):
    e, rows, n_tok, top = 7, 9, 33, 3
    k = 512 if qtype != QT.Q8_0 else 160
    rng = np.random.default_rng(7)
    raw = experts(qtype, e, rows, k, seed=3)
    ids = rng.integers(0, e - 1, (n_tok, top))  # expert e-1 unused
    x = rng.standard_normal((n_tok, top, k) if per_pair else (n_tok, k)).astype(np.float32)
    want, mag = dense(raw, qtype, x, ids)
    # small dequant budget: experts are processed two at a time
    got = qm.gather_qmm(
        mx.array(x), mx.array(raw), qtype, mx.array(ids), backend="reference", max_dequant_bytes=2 * rows * k * 4
    )
    check(np.array(got), want, mag, k)
    auto = qm.gather_qmatmul(mx.array(x), mx.array(raw), qtype, mx.array(ids), backend="reference")
    check(np.array(auto), want, mag, k)


def test_output_dtype_follows_x():
    raw = experts(QT.Q4_K, 3, 4, 256)
    x = mx.random.normal((2, 256)).astype(mx.bfloat16)
    ids = mx.array([[0, 2], [1, 1]])
    out = qm.gather_qmv(x, mx.array(raw), QT.Q4_K, ids, backend="reference")
    assert out.dtype == mx.bfloat16 and out.shape == (2, 2, 4)
    out = qm.gather_qmm(x, mx.array(raw), "q4_k", ids, backend="reference")
    assert out.dtype == mx.bfloat16 and out.shape == (2, 2, 4)


def test_argument_checks():
    raw = mx.array(experts(QT.Q2_K, 2, 3, 256))
    with pytest.raises(ValueError):
        qm.gather_qmv(mx.zeros((2, 128)), raw, QT.Q2_K, mx.zeros((2, 1), mx.int32))
    with pytest.raises(ValueError):
        qm.gather_qmv(mx.zeros((2, 256)), raw, QT.Q6_K, mx.zeros((2, 1), mx.int32))
    with pytest.raises(ValueError):
        qm.gather_qmv(mx.zeros((2, 256)), raw.astype(mx.int8), QT.Q2_K, mx.zeros((2, 1), mx.int32))


# ------------------------------------------------------------------ dispatch and the two GPU faces


def test_backend_is_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("DS4MLX_KERNELS", raising=False)
    assert dispatch.backend(mx.cpu) == "reference"
    monkeypatch.setenv("DS4MLX_KERNELS", "reference")
    assert dispatch.backend() == "reference"
    monkeypatch.setenv("DS4MLX_KERNELS", "tpu")
    with pytest.raises(ValueError):
        dispatch.backend()


@pytest.mark.parametrize("kind", ["qmv", "dequant"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_metal_and_cuda_share_one_description(kind, qtype):
    sec = dispatch.sections(qm.SOURCE)
    mh, mb = qm.kernel_sources(kind, qtype, "metal")
    ch, cb = qm.kernel_sources(kind, qtype, "cuda")
    # shared code appears verbatim in both faces; only prelude and indexing differ
    for part in (sec["common"],):
        assert part in mh and part in ch
    assert mb.endswith(sec[kind]) and cb.endswith(sec[kind])
    assert f"ds4_chunk_{qtype.name.lower()}" in mh and f"ds4_chunk_{qtype.name.lower()}" in ch
    assert ("thread_position_in_grid" in mb or "threadgroup_position_in_grid" in mb) and "blockIdx" in cb
    # CUDA spelling: no Metal-only words outside the Metal prelude
    for word in ("device ", "threadgroup", "simd_sum", "as_type", " uint "):
        assert word not in ch + cb, word
    assert "0x" in mh and mh.count("ull") >= 256  # the IQ2_XXS lattice is inlined


GPU_SHAPES = SHAPES + [(256, 64, 4096, 1, 6), (16, 2048, 4096, 2, 6), (4, 4096, 2048, 1, 4)]


def _gpu_face():
    face = dispatch.gpu_backend()
    if face is None:
        pytest.skip("no MLX GPU backend")
    return face


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "E{}_r{}_K{}_t{}_k{}".format(*s))
def test_gpu_qmv_equals_reference(qtype, shape):
    face = _gpu_face()
    e, rows, k, n_tok, top = shape
    rng = np.random.default_rng(sum(shape))
    raw = mx.array(experts(qtype, e, rows, k, seed=5))
    ids = mx.array(rng.integers(0, e, (n_tok, top)))
    for x in (
        mx.array(rng.standard_normal((n_tok, k)).astype(np.float32)),
        mx.array(rng.standard_normal((n_tok, top, k)).astype(np.float32)),
    ):
        with mx.stream(mx.cpu):
            ref = np.array(qm.gather_qmv(x, raw, qtype, ids, backend="reference"))
            wabs = np.abs(np.array(qm.dequantize_mx(raw[ids.reshape(-1)], qtype, k)))
        got = np.array(qm.gather_qmv(x, raw, qtype, ids, backend=face))
        xx = np.abs(np.array(x))
        xx = xx[:, None, :] if xx.ndim == 2 else xx
        wabs = wabs.reshape(n_tok, top, rows, k)
        mag = np.einsum("tjrh,tjh->tjr", wabs, np.broadcast_to(xx, (n_tok, top, k)))
        check(got, ref.astype(np.float64), mag, k)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gpu_dequant_bit_exact_and_qmm(qtype):
    face = _gpu_face()
    e, rows, k = 6, 33, 512
    raw = mx.array(experts(qtype, e, rows, k, seed=9))
    want = dequantize(np.array(raw), qtype, (e, rows, k))
    got = np.array(qm.gather_dequantize(raw, qtype, [5, 0, 3], backend=face))
    assert np.array_equal(got.view(np.uint32), want[[5, 0, 3]].view(np.uint32))
    rng = np.random.default_rng(2)
    ids = rng.integers(0, e, (40, 4))
    x = rng.standard_normal((40, k)).astype(np.float32)
    ref, mag = dense(np.array(raw), qtype, x, ids)
    out = qm.gather_qmm(mx.array(x), raw, qtype, mx.array(ids), backend=face, max_dequant_bytes=2 * rows * k * 4)
    check(np.array(out), ref, mag, k, rel=TF32_REL)
    xp = rng.standard_normal((40, 4, k)).astype(np.float32)  # per-pair inputs (down projection)
    ref, mag = dense(np.array(raw), qtype, xp, ids)
    out = qm.gather_qmm(mx.array(xp), raw, qtype, mx.array(ids), backend=face)
    check(np.array(out), ref, mag, k, rel=TF32_REL)


V4_FLASH_DEQUANT = [(QT.IQ2_XXS, 2048, 4096), (QT.Q2_K, 4096, 2048)]  # gate / up, down: (type, rows, K)


@pytest.mark.gpu
@pytest.mark.parametrize("case", V4_FLASH_DEQUANT, ids=lambda c: f"{c[0].name}_r{c[1]}_K{c[2]}")
def test_gpu_dequant_bit_exact_at_v4_flash_shapes(case):
    """The prefill's dequantization at V4 Flash's shapes, as `grouped_experts.sliced_per_expert`
    runs it: 64 experts (an 8-expert bank, every expert once, then repeats) of [2048, 4096]
    IQ2_XXS or [4096, 2048] Q2_K, bit for bit against the MLX reference decoding on the CPU
    (== ds4mlx.io.quant.dequantize, test_dequantize_mx_bit_exact) rounded to bfloat16 / float16,
    and float32 for a few experts."""
    face = _gpu_face()
    qtype, rows, k = case
    e = 8
    raw = mx.array(experts(qtype, e, rows, k, seed=rows))
    rng = np.random.default_rng(k)
    ids = np.concatenate([np.arange(e)[::-1], rng.integers(0, e, 56)]).astype(np.int32)
    with mx.stream(mx.cpu):
        want32 = qm.dequantize_mx(raw, qtype, k)  # [E, rows, K] float32
        mx.eval(want32)
    for dt, n, bits in ((mx.bfloat16, 64, mx.uint16), (mx.float16, 64, mx.uint16), (mx.float32, 4, mx.uint32)):
        with mx.stream(mx.cpu):
            want = np.array(want32.astype(dt).view(bits))
        got = qm.gather_dequantize(raw, qtype, mx.array(ids[:n]), dt, backend=face)
        assert got.dtype == dt and got.shape == (n, rows, k)
        got = np.array(got.view(bits))
        bad = [i for i in range(n) if not np.array_equal(got[i], want[ids[i]])]
        assert not bad, f"{dt}: slices {bad[:8]} differ (experts {ids[bad[:8]].tolist()})"


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gpu_dequant_passes_its_first_use_self_test(qtype):
    assert qm._dequant_self_test(_gpu_face(), qtype)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gpu_bfloat16_activations(qtype):
    face = _gpu_face()
    e, rows, k = 8, 32, 1024
    raw = mx.array(experts(qtype, e, rows, k, seed=4))
    rng = np.random.default_rng(4)
    ids = mx.array(rng.integers(0, e, (3, 6)))
    x = mx.array(rng.standard_normal((3, k)).astype(np.float32)).astype(mx.bfloat16)
    ref = qm.gather_qmv(x.astype(mx.float32), raw, qtype, ids, backend="reference")
    got = qm.gather_qmv(x, raw, qtype, ids, backend=face)
    assert got.dtype == mx.bfloat16
    ref, got = np.array(ref), np.array(got.astype(mx.float32))
    assert np.allclose(got, ref, rtol=2**-7, atol=2**-7 * np.abs(ref).max())


# ------------------------------------------------------------------ the shared GPU code, compiled for the CPU
#
# The `common`, `qmv` and `dequant` sections are plain C++ apart from the prelude
# names; with a CPU prelude g++ runs the very text both GPU faces compile, so its
# decoding, indexing and threadgroup staging and barriers are checked here even
# without a GPU: whole threadgroups through tests/test_kernel_emulation.run_on_cpu
# (AddressSanitizer on).

# The quant_moe prelude names (see ds4mlx/kernels/metal/quant_moe.metal) that the generic emulation
# preludes lack.  The aligned loads abort on a misaligned address: the CPU would not.
CPU_NAMES = r"""
#define DEV
#define THR
#define SHR
#define CONSTANT static const
static inline float ds4_f16(uint16_t h) { _Float16 f; std::memcpy(&f, &h, 2); return (float)f; }
#ifndef DS4_HAVE_AS_FLOAT  // defined once when both emulation preludes are combined
#define DS4_HAVE_AS_FLOAT
static inline float ds4_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
#endif
static inline float ds4_flip(float x, uint32_t b) { uint32_t u; std::memcpy(&u, &x, 4); return ds4_as_float(u ^ (b << 31)); }
static inline uint32_t ds4_ld16(const uint8_t* p) {
    if ((uintptr_t)p & 1u) { std::fprintf(stderr, "misaligned ds4_ld16\n"); std::abort(); }
    uint16_t v; std::memcpy(&v, p, 2); return v;
}
static inline uint32_t ds4_ld32(const uint8_t* p) {
    if ((uintptr_t)p & 3u) { std::fprintf(stderr, "misaligned ds4_ld32\n"); std::abort(); }
    uint32_t v; std::memcpy(&v, p, 4); return v;
}
static inline uint32_t ds4_popcount(uint32_t v) { return (uint32_t)__builtin_popcount(v); }
static inline uint32_t ds4_magic_byte(uint32_t v, uint32_t i) { return 0x4B000000u | ((v >> (8u * i)) & 255u); }
"""


def run_dequant_on_cpu(tmp_path, qtype, raw, eids, out_dtype=np.float32):
    """The shared dequant text through `run_on_cpu`, launched as `gather_dequantize` launches
    it (whole thread groups of qm.DEQUANT_GROUP, CUDA's thread order: x fastest, so warp r of
    a group is its y = r), with the CUDA face's own index text; -> y [M, rows, K] (float32,
    or bfloat16 bits as uint16)."""
    from test_kernel_emulation import run_on_cpu

    _, rows, rb = raw.shape
    k = qm.check_blocks(mx.array(raw), qtype)[3]
    gx, gy, gz = qm.DEQUANT_GROUP
    header, _ = qm.kernel_sources("dequant", qtype, "cuda")
    header = header.replace(qm.CUDA_PRELUDE, CPU_NAMES)
    flat = np.ascontiguousarray(raw).reshape(-1)
    words = np.zeros(-(-flat.size // 4) * 4, np.uint8)
    words[: flat.size] = flat
    body = (
        "struct ds4_dim3 { uint32_t x, y, z; };\n"
        f"const ds4_dim3 threadIdx{{tid % {gx}u, tid / {gx}u, 0u}}, blockIdx{{tgx, tgy, tgz}}, "
        f"blockDim{{{gx}u, {gy}u, {gz}u}};\n"
        "const uint8_t* w = reinterpret_cast<const uint8_t*>(w_words);\n"
        + qm.CUDA_INDEX_DEQUANT
        + dispatch.sections(qm.SOURCE)["dequant"]
    )
    m = eids.size
    out = run_on_cpu(
        tmp_path,
        header,
        body,
        inputs={"w_words": words.view(np.uint32), "eids": eids.astype(np.int32).reshape(-1)},
        outputs={"y": ((m, rows, k), out_dtype)},
        consts={"T": out_dtype, "N_ROWS": rows, "K_DIM": k, "ROW_BYTES": rb},
        groups=(-(-(k // 32) // gx), -(-rows // gy), m),
        threads=gx * gy * gz,
    )
    return out["y"]


DEQUANT_CPU_CASES = [
    # (E, rows, K, ids, T): every value of y must be written, bit-exact
    (3, 5, 512, [2, 0], "float32"),  # 16 chunks: a partial warp (lanes 16-31 idle); 5 rows: 3 idle warps in group 2
    (3, 6, 2048, [1, 2, 1], "float32"),  # 64 chunks: whole warps only, as V4 Flash's K (4096 / 2048)
    (2, 3, 1280, [1, 0], "float32"),  # 40 chunks: a whole warp, then one of 8 chunks; 3 rows: 1 idle warp
    (2, 3, 1280, [1, 0], "bfloat16"),  # the same in a 16-bit T (MLX's round to nearest even)
]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("case", DEQUANT_CPU_CASES, ids=lambda c: "E{}_r{}_K{}_{}".format(*c[:3], c[4]))
@pytest.mark.slow_after(1)
def test_shared_dequant_compiled_for_cpu(qtype, case, tmp_path):
    e, rows, k, ids, dtype = case
    if qtype == QT.Q8_0 and k == 512:
        k = 96  # 3 chunks
    raw = experts(qtype, e, rows, k, seed=rows + k)
    eids = np.array(ids, np.int32)
    want = dequantize(raw, qtype, (e, rows, k))[eids]
    if dtype == "float32":
        got = run_dequant_on_cpu(tmp_path, qtype, raw, eids)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # decoding: bit-exact
    else:
        got = run_dequant_on_cpu(tmp_path, qtype, raw, eids, np.uint16)
        want16 = np.array(mx.array(want).astype(mx.bfloat16).view(mx.uint16))  # MLX's rounding (to even)
        assert np.array_equal(got, want16)


def test_dequant_self_tests_at_first_use(monkeypatch, caplog):
    """On CUDA (faked) the rewritten dequant kernel self-tests at first use, per GGUF type:
    a wrong kernel sends gather_dequantize (and the prefill through it) to the reference face
    with a warning, a right one is kept; launches come in whole (32, 4, 1) thread groups."""
    import logging

    # (GPU-verified on the H200, 2026-12-02: the self-test still runs for a kernel listed here)
    monkeypatch.setattr(dispatch, "UNVERIFIED_KERNELS", dispatch.UNVERIFIED_KERNELS | set(qm.DEQUANT_KERNELS.values()))
    for qtype in TYPES:
        assert qm._dequant_self_test("reference", qtype)  # valid inputs, a passing comparison
    monkeypatch.delenv("DS4MLX_KERNELS", raising=False)
    monkeypatch.delenv("DS4MLX_KERNEL_SELFTEST", raising=False)
    monkeypatch.setattr(dispatch, "backend", lambda device=None: "cuda")
    monkeypatch.setattr(dispatch, "_self_tests", {})
    grids = []

    def garbage(face, *, output_shapes, output_dtypes, **kw):
        return [mx.full(s, 7.0, t) for s, t in zip(output_shapes, output_dtypes)]

    def right(qtype):
        def launch(face, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            grids.append((grid, threadgroup))
            w, ids = inputs
            return [qm.dequantize_mx(w[ids], qtype, dict(template)["K_DIM"]).astype(output_dtypes[0])]

        return launch

    blocks = qm.random_gguf_blocks(QT.Q2_K, 4, 6, 512, seed=1)
    want = qm.gather_dequantize(blocks, QT.Q2_K, [3, 1], backend="reference")
    monkeypatch.setattr(qm, "_kernel", lambda kind, qtype: garbage)
    with caplog.at_level(logging.WARNING, logger="ds4mlx.kernels"):
        got = qm.gather_dequantize(blocks, QT.Q2_K, [3, 1])
    assert np.array_equal(np.array(got), np.array(want))
    assert dispatch._self_tests[("quant_moe.dequant.Q2_K", "cuda")] is False
    assert "quant_moe.dequant.Q2_K" in caplog.text and "failed its first-use self-test" in caplog.text
    monkeypatch.setattr(qm, "_kernel", lambda kind, qtype: right(qtype))
    blocks = qm.random_gguf_blocks(QT.IQ2_XXS, 4, 6, 512, seed=1)
    assert np.array_equal(
        np.array(qm.gather_dequantize(blocks, QT.IQ2_XXS, [3, 1])),
        np.array(qm.gather_dequantize(blocks, QT.IQ2_XXS, [3, 1], backend="reference")),
    )
    assert dispatch._self_tests[("quant_moe.dequant.IQ2_XXS", "cuda")] is True
    assert grids and all(g[0] % 32 == 0 and g[1] % 4 == 0 and tg == qm.DEQUANT_GROUP for g, tg in grids)
    assert ((32, 8, 2), (32, 4, 1)) in grids  # the 2 x 6 x 512 call: 16 chunks -> 32 threads, 6 rows -> 8


def run_qmv_on_cpu(tmp_path, qtype, raw, x, eids, x_div, warps, rpw):
    """The shared qmv text through `run_on_cpu`, launched as `gather_qmv` launches it
    (grid (32*warps, ceil(rows / (warps*rpw)), P)); x float32 [NX, K] -> y [P, rows]."""
    from test_kernel_emulation import run_on_cpu

    e, rows, rb = raw.shape
    k = x.shape[1]
    header, _ = qm.kernel_sources("qmv", qtype, "cuda")
    header = header.replace(qm.CUDA_PRELUDE, CPU_NAMES)
    # run_on_cpu takes 32-bit buffers: the blocks travel as (zero-padded) words
    flat = np.ascontiguousarray(raw).reshape(-1)
    words = np.zeros(-(-flat.size // 4) * 4, np.uint8)
    words[: flat.size] = flat
    body = (
        "const uint32_t pair = tgz;\n"
        "const uint8_t* w = reinterpret_cast<const uint8_t*>(w_words);\n" + dispatch.sections(qm.SOURCE)["qmv"]
    )
    p = eids.size
    out = run_on_cpu(
        tmp_path,
        header,
        body,
        inputs={"x": x.astype(np.float32), "w_words": words.view(np.uint32), "eids": eids.astype(np.int32).reshape(-1)},
        outputs={"y": ((p, rows), np.float32)},
        consts={
            "T": np.float32,
            "N_ROWS": rows,
            "K_DIM": k,
            "ROW_BYTES": rb,
            "WARPS": warps,
            "RPW": rpw,
            "X_DIV": x_div,
        },
        groups=(1, -(-rows // (warps * rpw)), p),
        threads=32 * warps,
    )
    return out["y"]


QMV_CPU_CASES = [
    # (E, rows, K, n_tok, k, x per pair, WARPS, RPW)
    (3, 5, 1024, 2, 2, False, 2, 2),  # 5 rows: last group half idle, a last warp row past the end; 2 steps
    (2, 7, 256, 1, 1, True, 1, 3),  # P = 1, RPW 3 (7 = 3 + 3 + 1); half a step (lanes 16-31 idle)
    (4, 3, 768, 3, 6, True, 2, 1),  # 18 pairs, 1.5 steps (IQ2_XXS rows only 2-byte aligned)
    (5, 17, 256, 2, 3, False, qm.QMV_WARPS, qm.QMV_ROWS_PER_WARP),  # the launch gather_qmv uses
]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("case", QMV_CPU_CASES, ids=lambda c: "E{}_r{}_K{}_t{}_k{}_pp{}_W{}_R{}".format(*c))
@pytest.mark.slow_after(1)
def test_shared_qmv_compiled_for_cpu(qtype, case, tmp_path):
    e, rows, k, n_tok, top, per_pair, warps, rpw = case
    if qtype == QT.Q8_0:
        k = 32 * (k // 64 + 1)  # an odd number of 32-blocks: a partial last step
    rng = np.random.default_rng(rows * k + top)
    raw = experts(qtype, e, rows, k, seed=rows + top)
    ids = rng.integers(0, e, (n_tok, top))
    x = rng.standard_normal((n_tok, top, k) if per_pair else (n_tok, k)).astype(np.float32)
    got = run_qmv_on_cpu(tmp_path, qtype, raw, x.reshape(-1, k), ids, 1 if per_pair else top, warps, rpw)
    want, mag = dense(raw, qtype, x, ids)
    check(got.reshape(n_tok, top, rows), want, mag, k)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.slow_after(1)
def test_shared_qmv_decodes_bit_exact(qtype, tmp_path):
    # one-hot x: pair p reads W[eids[p]][:, p], which must be the reference's weights exactly
    e, rows = 2, 3
    k = 256 if qtype != QT.Q8_0 else 96
    raw = experts(qtype, e, rows, k, seed=8)
    eids = np.arange(k, dtype=np.int32) % e
    got = run_qmv_on_cpu(tmp_path, qtype, raw, np.eye(k, dtype=np.float32), eids, 1, 1, 2)
    want = dequantize(raw, qtype, (e, rows, k))[eids, :, np.arange(k)]  # [P, rows]
    assert np.array_equal(got, want)


# ------------------------------------------------------------------ the CUDA face, compiled by nvcc (no GPU)


@pytest.mark.parametrize("kind", ["qmv", "dequant"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.slow_after(1)
def test_cuda_face_compiles_with_nvcc(kind, qtype, tmp_path):
    """The CUDA translation unit mx.fast.cuda_kernel builds, compiled for sm_90 (H200) by
    nvcc with warnings as errors (syntax and types; the g++ emulation checks the logic)."""
    from test_kernel_emulation import nvcc_compile

    family = [_cuda_source(k, t) for t in TYPES for k in ("qmv", "dequant")]
    nvcc_compile(tmp_path, _cuda_source(kind, qtype), family=family)


def _cuda_source(kind, qtype):
    from test_kernel_emulation import mlx_cuda_source

    h, b = qm.kernel_sources(kind, qtype, "cuda")
    k, rb = 4096, qm.row_bytes(qtype, 4096)
    tmpl = [("T", "bfloat16"), ("N_ROWS", 2048), ("K_DIM", k), ("ROW_BYTES", rb)]
    if kind == "qmv":
        ins = {"x": "bfloat16", "w": "uint32", "eids": "int32"}
        tmpl += [("WARPS", qm.QMV_WARPS), ("RPW", qm.QMV_ROWS_PER_WARP), ("X_DIV", 6)]
    else:
        ins = {"w": "uint32", "eids": "int32"}
    src = mlx_cuda_source(f"{kind}_{qtype.name.lower()}", h, b, ins, {"y": "bfloat16"}, tmpl)
    # the helper knows no uint8 buffers: w is declared as MLX declares it
    return src.replace("const uint32_t* w,", "const uint8_t* w,")


@pytest.mark.parametrize("qtype", [QT.IQ2_XXS, QT.Q2_K], ids=lambda t: t.name)
@pytest.mark.parametrize("budget_experts", [1, 3, 100])
def test_prefill_qmm_needs_no_host_sync(qtype, budget_experts):
    """The prefill path traces under mx.compile (a host sync, as the former grouping's
    np.array of the expert ids, cannot), for any dequant budget (experts per block),
    pre-sorted pairs or not, and agrees with the host-grouped baseline."""
    e, rows, n_tok, top, k = 7, 9, 40, 3, 256
    rng = np.random.default_rng(11)
    raw = mx.array(experts(qtype, e, rows, k, seed=5))
    ids = mx.array(rng.integers(0, e - 1, (n_tok, top)))  # expert e-1 unused
    x = mx.array(rng.standard_normal((n_tok, k)).astype(np.float32))
    budget = budget_experts * rows * k * 4
    base = np.array(qm.gather_qmm_host_grouped(x, raw, qtype, ids, backend="reference"))

    def grouped(x, ids):
        return qm.gather_qmm(x, raw, qtype, ids, backend="reference", max_dequant_bytes=budget)

    got = np.array(mx.compile(grouped)(x, ids))
    assert np.abs(got - base).max() <= 1e-4 * max(1.0, np.abs(base).max())
    # SwitchGLU's layout: one row per pair, already in expert order
    flat = ids.reshape(-1)
    order = mx.argsort(flat)
    xs = mx.repeat(x, top, axis=0)[order][None]  # [1, P, K]
    got_sorted = qm.gather_qmm(xs, raw, qtype, flat[order][None], backend="reference", sorted_indices=True)
    inv = np.argsort(np.array(order))
    assert np.abs(np.array(got_sorted)[0][inv].reshape(n_tok, top, rows) - base).max() <= 1e-4 * max(
        1.0, np.abs(base).max()
    )


def test_host_grouped_baseline_cannot_trace():
    """The check above means something: the host-grouped path fails under mx.compile."""
    raw = mx.array(experts(QT.Q2_K, 3, 4, 256))
    ids = mx.array([[0, 2], [1, 1]])
    x = mx.random.normal((2, 256))
    with pytest.raises(ValueError, match="during function transformations"):
        mx.compile(lambda x, ids: qm.gather_qmm_host_grouped(x, raw, QT.Q2_K, ids, backend="reference"))(x, ids)


def test_prefill_qmm_bfloat16_on_the_cpu():
    """bfloat16 activations at prefill size (the synthetic model's): computed in float32
    on the CPU (its gather_mm is float32-only), returned in bfloat16."""
    e, rows, n_tok, top, k = 5, 8, 30, 3, 256
    rng = np.random.default_rng(12)
    raw = mx.array(experts(QT.Q2_K, e, rows, k, seed=6))
    ids = mx.array(rng.integers(0, e, (n_tok, top)))
    x = mx.array(rng.standard_normal((n_tok, k)).astype(np.float32))
    want = np.array(qm.gather_qmm(x, raw, QT.Q2_K, ids, backend="reference"))
    got = qm.gather_qmm(x.astype(mx.bfloat16), raw, QT.Q2_K, ids, backend="reference")
    assert got.dtype == mx.bfloat16
    assert np.abs(np.array(got.astype(mx.float32)) - want).max() <= 2e-2 * max(1.0, np.abs(want).max())


# ------------------------------------------------------------------ the fused MoE decode modes
#
# gather_swiglu_blocks (gate + up + clamped SwiGLU) and gather_down_sum_blocks (down + the
# routing-weighted sum over k): their reference face is today's unfused expression; the shared
# text (qmv_swiglu / qmv_down_sum) runs on the CPU through g++ as qmv does above.


def unfused_swiglu(x, gate, up, qtype, ids, limit):
    """The model's expression before the fusion (SplitSwitchLinear, then SwitchGLU)."""
    g = qm.gather_qmatmul(x, gate, qtype, ids, backend="reference")
    u = qm.gather_qmatmul(x, up, qtype, ids, backend="reference")
    gu = mx.concatenate([g, u.astype(g.dtype)], axis=-1)
    i = gate.shape[1]
    return clamped_swiglu(gu[..., :i], gu[..., i:], limit)


def unfused_down_sum(h, down, qtype, ids, weights):
    """The V4 MoE's expression: each expert's output, times its weight, summed over k."""
    y = qm.gather_qmatmul(h, down, qtype, ids, backend="reference")
    return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


def _routing(e, n_tok, top, rng):
    """Expert ids [n_tok, top] and their weights (positive, summing to 1 per token)."""
    ids = mx.array(rng.integers(0, e, (n_tok, top)).astype(np.int32))
    w = rng.random((n_tok, top)).astype(np.float32)
    return ids, mx.array(w / w.sum(-1, keepdims=True))


def _moe_problem(qtype, e, inter, hidden, n_tok, top, seed, with_down=True):
    rng = np.random.default_rng(seed)
    gate, up = (mx.array(experts(qtype, e, inter, hidden, seed=seed + s)) for s in (1, 2))
    down = mx.array(experts(qtype, e, hidden, inter, seed=seed + 3)) if with_down else None
    ids, w = _routing(e, n_tok, top, rng)
    x = mx.array(rng.standard_normal((n_tok, hidden)).astype(np.float32))
    h = mx.array(rng.standard_normal((n_tok, top, inter)).astype(np.float32))
    return gate, up, down, ids, x, h, w


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("limit", [None, 0.0, -1.0, 0.02])
def test_reference_fused_modes_equal_unfused(qtype, limit):
    k = 256 if qtype != QT.Q8_0 else 96
    gate, up, down, ids, x, h, w = _moe_problem(qtype, 5, k, k, 3, 4, seed=4)
    got = qm.gather_swiglu_blocks(x, gate, up, qtype, ids, limit=limit, backend="reference")
    want = unfused_swiglu(x, gate, up, qtype, ids, limit if limit and limit > 0 else None)
    assert got.shape == (3, 4, k) and np.array_equal(np.array(got), np.array(want))
    got = qm.gather_down_sum_blocks(h, down, qtype, ids, w, backend="reference")
    want = unfused_down_sum(h, down, qtype, ids, w)
    assert got.shape == (3, k) and np.array_equal(np.array(got), np.array(want))
    if limit == 0.02:  # the clamp bites: some gate / up values lie beyond it
        g = np.array(qm.gather_qmv(x, gate, qtype, ids, backend="reference"))
        assert (np.abs(g) > limit).any() and (np.abs(g) < limit).any()


def test_fused_modes_argument_checks():
    gate, up, down, ids, x, h, w = _moe_problem(QT.Q2_K, 3, 256, 256, 2, 2, seed=1)
    with pytest.raises(ValueError):
        qm.gather_swiglu_blocks(x, gate, up[:, :128], QT.Q2_K, ids, limit=None)
    with pytest.raises(ValueError):
        qm.gather_swiglu_blocks(h, gate, up, QT.Q2_K, ids, limit=None)  # per-pair x: not a gate input
    with pytest.raises(ValueError):
        qm.gather_down_sum_blocks(x, down, QT.Q2_K, ids, w)
    with pytest.raises(ValueError):
        qm.gather_down_sum_blocks(h, down, QT.Q2_K, ids, w[:, :1])
    assert qm.moe_face(QT.Q2_K) is None  # the CPU: the reference face, no fused path


def run_fused_on_cpu(tmp_path, kind, qtype, x, banks, eids, extra, consts, groups):
    """A fused mode's shared text through `run_on_cpu` (the CPU prelude, whose ds4_exp is
    std::exp): `banks` name -> uint8 [E, rows, row_bytes] blocks (passed as 32-bit words)."""
    from test_kernel_emulation import run_on_cpu

    header, _ = qm.kernel_sources(kind, qtype, "cuda")
    header = header.replace(qm.CUDA_PRELUDE, CPU_NAMES).replace(qm.CUDA_PRELUDE_FUSED, "")
    body = "const uint32_t pair = tgz;\n"
    inputs = {"x": x.astype(np.float32)}
    for name, raw in banks.items():
        flat = np.ascontiguousarray(raw).reshape(-1)
        words = np.zeros(-(-flat.size // 4) * 4, np.uint8)
        words[: flat.size] = flat
        inputs[f"{name}_words"] = words.view(np.uint32)
        body += f"const uint8_t* {name} = reinterpret_cast<const uint8_t*>({name}_words);\n"
    inputs["eids"] = eids.astype(np.int32).reshape(-1)
    inputs.update(extra)
    rows = next(iter(banks.values())).shape[1]
    out = run_on_cpu(
        tmp_path,
        header,
        body + dispatch.sections(qm.SOURCE)[kind],
        inputs=inputs,
        outputs={"y": ((groups[2], rows), np.float32)},
        consts={"T": np.float32, "N_ROWS": rows, "K_DIM": x.shape[-1], "ROW_BYTES": next(iter(banks.values())).shape[2]}
        | consts,
        groups=groups,
        threads=32 * consts["WARPS"],
    )
    return out["y"]


def _bound(mags, k):
    """The float32 bound of the module docstring, for a sum of terms of magnitude `mags`."""
    return k * 2.0**-23 * mags + 1e-30


# (E, I, H, n_tok, k, WARPS, RPW): odd row counts leave SIMD groups past the last row,
# Q8_0's K below is an odd number of 32-blocks (a partial step)
FUSED_CPU_CASES = [
    (3, 5, 1024, 2, 2, 2, 2),
    (4, 7, 256, 1, 3, 1, 3),
    (5, 17, 512, 2, 3, qm.QMV_WARPS, qm.SWIGLU_RPW),  # the launch the module makes
]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("case", FUSED_CPU_CASES, ids=lambda c: "E{}_I{}_H{}_t{}_k{}_W{}_R{}".format(*c))
@pytest.mark.slow_after(1)
def test_shared_swiglu_compiled_for_cpu(qtype, case, tmp_path):
    e, inter, hidden, n_tok, top, warps, rpw = case
    if qtype == QT.Q8_0:
        hidden = 32 * (hidden // 64 + 1)
    gate, up, _, ids, x, _, _ = _moe_problem(qtype, e, inter, hidden, n_tok, top, seed=inter, with_down=False)
    g = np.array(qm.gather_qmv(x, gate, qtype, ids, backend="reference"))
    limit = float(np.quantile(np.abs(g), 0.5))  # the clamp bites on half the values
    for lim in (0.0, limit):
        got = run_fused_on_cpu(
            tmp_path,
            "qmv_swiglu",
            qtype,
            np.array(x),
            {"wg": np.array(gate), "wu": np.array(up)},
            np.array(ids),
            {"lim": np.array([lim], np.float32)},
            {"WARPS": warps, "RPW": rpw, "X_DIV": top},
            (1, -(-inter // (warps * rpw)), n_tok * top),
        ).reshape(n_tok, top, inter)
        # oracle: float64 gate / up rows, the SwiGLU in float64; the kernel's g and u are each
        # within the float32 bound, silu' < 1.1 and |clip(u)|, |silu(g)| bound the product's slope
        gw, gm = dense(np.array(gate), qtype, np.array(x), np.array(ids))
        uw, um = dense(np.array(up), qtype, np.array(x), np.array(ids))
        if lim:
            gw, uw = np.minimum(gw, lim), np.clip(uw, -lim, lim)
        want = gw / (1 + np.exp(-gw)) * uw
        bound = 1.1 * np.abs(uw) * _bound(gm, hidden) + np.abs(gw) * _bound(um, hidden) + 4 * 2.0**-23 * np.abs(want)
        assert np.all(np.abs(got - want) <= bound + 1e-12), float(np.max(np.abs(got - want) - bound))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("case", FUSED_CPU_CASES, ids=lambda c: "E{}_I{}_H{}_t{}_k{}_W{}_R{}".format(*c))
@pytest.mark.slow_after(1)
def test_shared_down_sum_compiled_for_cpu(qtype, case, tmp_path):
    e, inter, hidden, n_tok, top, warps, rpw = case
    if qtype == QT.Q8_0:
        hidden = 32 * (hidden // 64 + 1)
    # down: rows = the hidden size, K = the intermediate size; swap so K is the long axis
    rows, k_dim = inter, hidden
    rng = np.random.default_rng(rows)
    ids, w = _routing(e, n_tok, top, rng)
    down = experts(qtype, e, rows, k_dim, seed=rows + 9)
    h = rng.standard_normal((n_tok, top, k_dim)).astype(np.float32)
    got = run_fused_on_cpu(
        tmp_path,
        "qmv_down_sum",
        qtype,
        h.reshape(-1, k_dim),
        {"w": down},
        np.array(ids),
        {"wts": np.array(w).reshape(-1)},
        {"WARPS": warps, "RPW": rpw, "KE": top},
        (1, -(-rows // (warps * rpw)), n_tok),
    )
    per, mag = dense(down, qtype, h, np.array(ids))  # [n, k, rows] float64
    wf = np.array(w).astype(np.float64)[..., None]
    want = (per * wf).sum(axis=1)
    # each expert's sum within the float32 bound, then k weighted additions
    bound = (_bound(mag, k_dim + top + 2) * wf).sum(axis=1) + 1e-12
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))


@pytest.mark.parametrize("kind", qm.FUSED_KINDS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.slow_after(1)
def test_fused_cuda_face_compiles_with_nvcc(kind, qtype, tmp_path):
    """The fused modes' CUDA translation unit for V4 Flash's decode shapes (bfloat16 x,
    H = 4096, I = 2048, k = 6), compiled for sm_90 with warnings as errors."""
    from test_kernel_emulation import nvcc_compile

    family = [_fused_cuda_source(k, t) for t in TYPES for k in qm.FUSED_KINDS]
    nvcc_compile(tmp_path, _fused_cuda_source(kind, qtype), family=family)


def _fused_cuda_source(kind, qtype):
    from test_kernel_emulation import mlx_cuda_source

    h, b = qm.kernel_sources(kind, qtype, "cuda")
    if kind == "qmv_swiglu":
        k, rows = 4096, 2048
        ins = {"x": "bfloat16", "wg": "uint32", "wu": "uint32", "eids": "int32", "lim": "float32"}
        extra = [("RPW", qm.SWIGLU_RPW), ("X_DIV", 6)]
    else:
        k, rows = 2048, 4096
        ins = {"x": "bfloat16", "w": "uint32", "eids": "int32", "wts": "float32"}
        extra = [("RPW", qm.DOWN_SUM_RPW), ("KE", 6)]
    tmpl = [("T", "bfloat16"), ("N_ROWS", rows), ("K_DIM", k), ("ROW_BYTES", qm.row_bytes(qtype, k))]
    tmpl += [("WARPS", qm.QMV_WARPS), *extra]
    src = mlx_cuda_source(f"{kind}_{qtype.name.lower()}", h, b, ins, {"y": "bfloat16"}, tmpl)
    for name in ("w", "wg", "wu"):  # the helper knows no uint8 buffers: declared as MLX declares them
        src = src.replace(f"const uint32_t* {name},", f"const uint8_t* {name},")
    return src


@pytest.mark.parametrize("kind", qm.FUSED_KINDS)
def test_fused_metal_and_cuda_share_one_text(kind):
    sec = dispatch.sections(qm.SOURCE)
    mh, mb = qm.kernel_sources(kind, QT.IQ2_XXS, "metal")
    ch, cb = qm.kernel_sources(kind, QT.IQ2_XXS, "cuda")
    for part in (sec["common"], sec["fused"]):
        assert part in mh and part in ch
    assert mb.endswith(sec[kind]) and cb.endswith(sec[kind])
    assert "precise::exp" in mh and "expf" in ch
    for word in ("device ", "threadgroup", "simd_sum", "as_type", "metal::"):
        assert word not in ch + cb, word


# ------------------------------------------------------------------ the fused path in the model's decode step


class FusedStandIn:
    """Takes a fused launch's call (inputs, template, grid, output shapes) and computes its
    output with the reference face from those very inputs: the CPU runs the model's compiled
    step through the GPU path's plumbing (as tests/test_kernel_compressor_step.py does)."""

    def __init__(self, kind, qtype, calls):
        self.kind, self.qtype, self.calls = kind, qtype, calls

    def __call__(self, face, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        self.calls[self.kind] += 1
        t = dict(template)
        assert threadgroup == (32 * t["WARPS"], 1, 1) and grid[0] == threadgroup[0]
        assert grid[1] == -(-t["N_ROWS"] // (t["WARPS"] * t["RPW"]))
        if self.kind == "qmv_swiglu":
            x2, wg, wu, eids, lim = inputs
            ids = eids.reshape(x2.shape[0], t["X_DIV"])
            out = qm.gather_swiglu_blocks(x2, wg, wu, self.qtype, ids, limit=lim.item(), backend="reference")
            out = out.reshape(eids.shape[0], t["N_ROWS"])
        else:
            x2, w, eids, wts = inputs
            n, k = grid[2], t["KE"]
            h = x2.reshape(n, k, t["K_DIM"])
            out = qm.gather_down_sum_blocks(
                h, w, self.qtype, eids.reshape(n, k), wts.reshape(n, k), backend="reference"
            )
        assert [tuple(out.shape)] == [tuple(s) for s in output_shapes] and out.dtype == output_dtypes[0]
        return [out]


def test_compiled_gguf_step_through_the_fused_launches_matches_legacy(monkeypatch):
    """The narrow synthetic V4 Flash with ds4's GGUF experts: the compiled decode step with the
    fused modes (faked GPU face: the stand-in above) against the legacy step's unfused
    expression (the reference face), logits within 1e-4 over several tokens."""
    from collections import Counter

    from test_launch_census import NARROW

    from ds4mlx.bench.synthetic import build_synthetic_v4_flash
    from ds4mlx.runtime import stepper

    lm, _, _ = build_synthetic_v4_flash(layers=4, experts=16, overrides=NARROW, expert_format="gguf")
    ids = [7, 100, 31, 2048, 5, 77, 901, 12, 3000, 64]

    def decode(how):
        monkeypatch.setenv(stepper.MODE_ENV, how)
        stepper.forget(lm.model)
        s = lm.new_session(ctx=64)
        s.prefill(ids[:4])
        return np.stack([s.decode(t) for t in ids[4:]])

    legacy = decode("legacy")
    calls = Counter()
    real = qm._kernel
    monkeypatch.setattr(qm, "_moe_face", lambda backend, qtype: "cuda" if backend is None else backend)
    monkeypatch.setattr(
        qm,
        "_kernel",
        lambda kind, qtype: FusedStandIn(kind, qtype, calls) if kind in qm.FUSED_KINDS else real(kind, qtype),
    )
    try:
        compiled = decode("compiled")
    finally:
        stepper.forget(lm.model)
    assert calls["qmv_swiglu"] >= 4 and calls["qmv_swiglu"] == calls["qmv_down_sum"]  # every layer, fused
    assert np.abs(legacy).max() > 1e-2  # logits that say something
    assert float(np.abs(compiled - legacy).max()) <= 1e-4


def test_fused_modes_self_test_at_first_use(monkeypatch, caplog):
    """On CUDA (faked) the fused modes self-test at first use, per GGUF type: a wrong kernel
    sends the model back to its unfused path with a warning, a right one is kept."""
    import logging
    from collections import Counter

    monkeypatch.setattr(dispatch, "UNVERIFIED_KERNELS", dispatch.UNVERIFIED_KERNELS | set(qm.MOE_KERNELS.values()))
    monkeypatch.delenv("DS4MLX_KERNELS", raising=False)
    monkeypatch.delenv("DS4MLX_KERNEL_SELFTEST", raising=False)
    monkeypatch.setattr(dispatch, "backend", lambda device=None: "cuda")
    monkeypatch.setattr(dispatch, "_self_tests", {})
    real = qm._kernel

    def garbage(face, *, output_shapes, output_dtypes, **kw):
        return [mx.full(s, 7.0, t) for s, t in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(qm, "_kernel", lambda kind, qtype: garbage if kind in qm.FUSED_KINDS else real(kind, qtype))
    with caplog.at_level(logging.WARNING, logger="ds4mlx.kernels"):
        assert qm.moe_face(QT.Q2_K) is None
    assert dispatch._self_tests[("quant_moe.moe.Q2_K", "cuda")] is False
    assert "quant_moe.moe.Q2_K" in caplog.text and "failed its first-use self-test" in caplog.text
    calls = Counter()
    monkeypatch.setattr(
        qm,
        "_kernel",
        lambda kind, qtype: FusedStandIn(kind, qtype, calls) if kind in qm.FUSED_KINDS else real(kind, qtype),
    )
    assert qm.moe_face(QT.IQ2_XXS) == "cuda" and calls["qmv_swiglu"] and calls["qmv_down_sum"]
    assert dispatch._self_tests[("quant_moe.moe.IQ2_XXS", "cuda")] is True


# ------------------------------------------------------------------ the fused modes on a GPU (pytest -m gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tok", [1, 3])
def test_gpu_fused_modes_equal_reference(qtype, n_tok):
    """V4 Flash's decode shapes (H 4096, I 2048, k 6) against the reference face on the CPU,
    float32 within the bounds of the g++ tests; bfloat16 within a few of its ulps; and the
    first-use self-test accepts the face."""
    face = _gpu_face()
    gate, up, down, ids, x, h, w = _moe_problem(qtype, 16, 2048, 4096, n_tok, 6, seed=n_tok)
    with mx.stream(mx.cpu):
        gw, gm = dense(np.array(gate), qtype, np.array(x), np.array(ids))
        uw, um = dense(np.array(up), qtype, np.array(x), np.array(ids))
        per, mag = dense(np.array(down), qtype, np.array(h), np.array(ids))
    got = np.array(qm.gather_swiglu_blocks(x, gate, up, qtype, ids, limit=None, backend=face))
    want = gw / (1 + np.exp(-gw)) * uw
    bound = 1.1 * np.abs(uw) * _bound(gm, 4096) + np.abs(gw) * _bound(um, 4096) + 4 * 2.0**-23 * np.abs(want)
    assert np.all(np.abs(got - want) <= bound + 1e-12)
    wf = np.array(w).astype(np.float64)[..., None]
    got = np.array(qm.gather_down_sum_blocks(h, down, qtype, ids, w, backend=face))
    assert np.all(np.abs(got - (per * wf).sum(axis=1)) <= (_bound(mag, 2048 + 8) * wf).sum(axis=1) + 1e-12)
    xb, hb = x.astype(mx.bfloat16), h.astype(mx.bfloat16)
    for fn, args in ((qm.gather_swiglu_blocks, (xb, gate, up)), (qm.gather_down_sum_blocks, (hb, down))):
        kw = dict(limit=0.05) if fn is qm.gather_swiglu_blocks else {}
        extra = () if kw else (w,)
        got = fn(*args, qtype, ids, *extra, **kw, backend=face)
        with mx.stream(mx.cpu):
            ref = np.array(fn(*args, qtype, ids, *extra, **kw, backend="reference").astype(mx.float32))
        assert got.dtype == mx.bfloat16
        assert np.allclose(np.array(got.astype(mx.float32)), ref, rtol=2**-6, atol=2**-6 * np.abs(ref).max())
    assert qm._moe_self_test(face, qtype)
