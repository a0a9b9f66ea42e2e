"""Grouped quantized matmul on GGUF blocks (kernels/grouped_qmm.py): prefill's per-expert GEMMs.

* the reference face (dequantize + float32 matmul) against numpy's float64 product;
* the shared Metal / CUDA text compiled with g++ (threadgroups emulated,
  tests/test_kernel_emulation.run_on_cpu) against the reference, per type: partial row and
  token tiles, several token tiles per batch, bfloat16 x, and a one-hot x that reads every
  decoded weight back bit for bit; the CUDA face compiled by nvcc at V4 Flash shapes;
* first-use self-test (a wrong face falls back to the reference with a warning, a right one
  is kept; the launch geometry; batches over CUDA's grid-z limit in several launches);
* DS4MLX_PREFILL_EXPERTS=grouped_blocks: SwitchGLU through it equals the per-pair path, and
  the V4 tiny oracle quantized to GGUF experts (IQ2_XXS gate / up, Q2_K down) prefills to the
  same logits within 1e-4, with the kernel text itself (emulated) in the model;
* `-m gpu`: the GPU face against the reference at V4 Flash expert shapes.

Bound: both sides sum the same float32 products (decoding is bit-exact) in other orders, so per
output ``|a - b| <= K * 2**-23 * sum_k |w_k x_k|`` (test_quant_moe's bound).
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from test_quant_moe import CPU_NAMES, check, experts

from ds4mlx.io.quant import QT, dequantize
from ds4mlx.kernels import dispatch, grouped_qmm, mma_tile, quant_moe
from ds4mlx.models import grouped_experts, prefill_experts

TYPES = list(quant_moe.SUPPORTED)

pytestmark = pytest.mark.usefixtures("cpu_unless_gpu_test")


def dense(raw, qtype, x, eids):
    """float64 oracle of y[b] = x[b] @ W[eids[b]].T, and sum |w x| per output (the bound's scale)."""
    e, rows, _ = raw.shape
    k = x.shape[-1]
    w = dequantize(raw, qtype, (e, rows, k))[eids].astype(np.float64)  # [B, N, K]
    xx = x.astype(np.float64)
    return np.einsum("bmk,bnk->bmn", xx, w), np.einsum("bmk,bnk->bmn", np.abs(xx), np.abs(w))


def _k_for(qtype, k):
    return k if qtype != QT.Q8_0 else k - 32 * 3  # Q8_0: a K that is no multiple of 256


# --------------------------------------------------------------------------- reference face


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_reference_equals_dense(qtype):
    k = _k_for(qtype, 512)
    raw = experts(qtype, 4, 37, k, seed=1)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 9, k)).astype(np.float32)
    eids = np.array([3, 0, 3, 1, 2], np.int32)
    got = grouped_qmm.grouped_qmm(mx.array(x), mx.array(raw), qtype, mx.array(eids), backend="reference")
    want, mag = dense(raw, qtype, x, eids)
    assert got.dtype == mx.float32
    check(np.array(got), want, mag, k)


def test_argument_checks():
    raw = mx.array(experts(QT.Q2_K, 2, 4, 256))
    with pytest.raises(ValueError, match="x must be"):
        grouped_qmm.grouped_qmm(mx.zeros((2, 3, 128)), raw, QT.Q2_K, mx.array([0, 1]))
    with pytest.raises(ValueError, match="experts must be"):
        grouped_qmm.grouped_qmm(mx.zeros((2, 3, 256)), raw, QT.Q2_K, mx.array([0]))
    with pytest.raises(ValueError, match="quantized MoE supports"):
        grouped_qmm.grouped_qmm(mx.zeros((2, 3, 256)), raw, QT.Q5_0, mx.array([0, 1]))
    assert grouped_qmm.grouped_qmm(mx.zeros((0, 3, 256)), raw, QT.Q2_K, mx.zeros((0,), mx.int32)).shape == (0, 3, 4)


def test_tokens_per_warp():
    assert [grouped_qmm.tokens_per_warp(m) for m in (1, 8, 9, 16, 20, 64, 512)] == [1, 1, 2, 2, 3, 8, 8]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_metal_and_cuda_share_one_text(qtype):
    sec = dispatch.sections(grouped_qmm.SOURCE)
    mh, mb = grouped_qmm.kernel_sources(qtype, "metal")
    ch, cb = grouped_qmm.kernel_sources(qtype, "cuda")
    common = dispatch.sections(quant_moe.SOURCE)["common"]
    for part in (common, sec["helpers"]):  # the block decoders are quant_moe's, written once
        assert part in mh and part in ch
    assert mb.endswith(sec["grouped_qmm"]) and cb.endswith(sec["grouped_qmm"])
    assert f"#define DS4_CHUNK ds4_chunk_{qtype.name.lower()}" in mh + ch
    assert "threadgroup_position_in_grid" in mb and "blockIdx" in cb
    for word in ("device ", "threadgroup", "simd_sum", "as_type"):
        assert word not in ch + cb, word


# --------------------------------------------------------------------------- the shared text on the CPU


def run_grouped_on_cpu(tmp_path, qtype, raw, x, eids, m_rows, lens=None, out_dtype=np.float32, mma_api=None):
    """The shared text through `run_on_cpu`, launched as `grouped_qmm` launches it;
    x [B * M, K] float32 (or bfloat16 bits as uint16), lens [B] (default M) -> y [B * M, N].
    `mma_api`: the tensor-core variant (`mma=True`) on this CPU definition of the tile API
    in place of CUDA's (MT: bfloat16 for bfloat16 x, else float16)."""
    from test_kernel_emulation import run_on_cpu

    _, rows, rb = raw.shape
    k = x.shape[-1]
    mma = mma_api is not None
    header, _ = grouped_qmm.kernel_sources(qtype, "cuda", mma)
    header = header.replace(quant_moe.CUDA_PRELUDE, CPU_NAMES)
    if mma:
        mt = "ds4_bf16" if x.dtype == np.uint16 else "_Float16"
        header = f"using MT = {mt};\n" + header.replace(mma_tile.PRELUDE["cuda"], mma_api)
        tm = grouped_qmm.tokens_per_tile(m_rows)
        tile_const = {"GQ_TM": tm}
    else:
        tm = 8 * grouped_qmm.tokens_per_warp(m_rows)
        tile_const = {"GQ_RM": tm // 8}
    flat = np.ascontiguousarray(raw).reshape(-1)
    words = np.zeros(-(-flat.size // 4) * 4, np.uint8)  # run_on_cpu takes 32-bit buffers
    words[: flat.size] = flat
    body = (
        "const uint8_t* w = reinterpret_cast<const uint8_t*>(w_words);\n"
        + dispatch.sections(grouped_qmm.SOURCE)["grouped_qmm_mma" if mma else "grouped_qmm"]
    )
    n_batch = eids.size
    out = run_on_cpu(
        tmp_path,
        header,
        body,
        inputs={
            "x": x,
            "w_words": words.view(np.uint32),
            "eids": eids.astype(np.int32).reshape(-1),
            "lens": np.full(eids.size, m_rows, np.int32) if lens is None else np.asarray(lens, np.int32),
        },
        outputs={"y": ((n_batch * m_rows, rows), out_dtype)},
        consts={"T": x.dtype, "N_ROWS": rows, "K_DIM": k, "ROW_BYTES": rb, "M_ROWS": m_rows, **tile_const},
        groups=(1, -(-rows // grouped_qmm.TILE_N), n_batch * -(-m_rows // tm)),
        threads=grouped_qmm.THREADS,
    )
    return out["y"]


CPU_CASES = [
    # (E, rows, K, experts of the batches, M, live rows of the batches)
    (3, 130, 512, [2, 0, 2], 20, [20, 20, 20]),  # a second row tile of 2 rows; a token tile of 24 holding 20
    (2, 64, 256, [1, 0, 1], 70, [70, 9, 64]),  # two token tiles per batch (64 + 6); padding: a SIMD
    # group partly live, idle groups, a tile of padding only; half a row tile
    (4, 128, 768, [3, 1], 16, [16, 0]),  # one whole row tile, 2 tokens per SIMD group, 24 steps of K; an empty batch
]


def cpu_case(qtype, case):
    """A case (E, rows, K, experts, M, live rows) of the emulated tests: (raw blocks, experts,
    x [B, M, K] float32 with nonzero padding rows, M, live rows); K fitted to `qtype`."""
    e, rows, k, ids, m, lens = case
    k = _k_for(qtype, k)
    raw = experts(qtype, e, rows, k, seed=rows + k)
    eids = np.array(ids, np.int32)
    return raw, eids, np.random.default_rng(m).standard_normal((eids.size, m, k)).astype(np.float32), m, lens


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    "case", CPU_CASES, ids=lambda c: f"E{c[0]}_r{c[1]}_K{c[2]}_B{len(c[3])}_M{c[4]}_live{sum(c[5])}"
)
@pytest.mark.slow_after(1)
def test_shared_text_compiled_for_cpu(qtype, case, tmp_path):
    raw, eids, x, m, lens = cpu_case(qtype, case)
    k = x.shape[-1]
    got = run_grouped_on_cpu(tmp_path, qtype, raw, x.reshape(-1, k), eids, m, lens)
    live = np.arange(m)[None, :, None] < np.array(lens)[:, None, None]
    want, mag = dense(raw, qtype, x * live, eids)
    check(got.reshape(want.shape), want, mag, k)  # padding rows: exactly 0
    ref = grouped_qmm.grouped_qmm(
        mx.array(x), mx.array(raw), qtype, mx.array(eids), mx.array(lens, dtype=mx.int32), backend="reference"
    )
    check(got.reshape(want.shape), np.array(ref).astype(np.float64), 2 * mag, k)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.slow_after(1)
def test_shared_text_decodes_bit_exact(qtype, tmp_path):
    """One-hot x (token m of batch b is e_m): y[b, m, n] = W[eids[b]][n, m], the decoded
    weight itself, which must equal the reference decoding bit for bit (up to a zero's sign)."""
    k = 256 if qtype != QT.Q8_0 else 96
    raw = experts(qtype, 3, 5, k, seed=4)
    eids = np.array([2, 0], np.int32)
    x = np.tile(np.eye(k, dtype=np.float32), (eids.size, 1))
    got = run_grouped_on_cpu(tmp_path, qtype, raw, x, eids, k).reshape(eids.size, k, 5)
    want = dequantize(raw, qtype, (3, 5, k))[eids].swapaxes(1, 2)
    # bit for bit, but for the sign of a zero weight (0 + -0 is +0): compared as floats
    assert np.array_equal(got, want) and np.array_equal(
        got.view(np.uint32) & 0x7FFFFFFF, want.view(np.uint32) & 0x7FFFFFFF
    )


def bfloat16_case_on_cpu(tmp_path, qtype, mma_api=None):
    """bfloat16 x [2, 24, 512] (2 batches of 40 rows) through `run_grouped_on_cpu`:
    (y [2, 24, 40] as float32, raw blocks, experts, x as float32)."""
    k, m = 512, 24
    raw = experts(qtype, 2, 40, k, seed=7)
    eids = np.array([1, 0], np.int32)
    x = mx.random.normal((2, m, k), key=mx.random.key(7)).astype(mx.bfloat16)
    bits = np.array(x.view(mx.uint16)).reshape(-1, k)
    got = run_grouped_on_cpu(tmp_path, qtype, raw, bits, eids, m, out_dtype=np.uint16, mma_api=mma_api)
    got = np.array(mx.array(got).view(mx.bfloat16).astype(mx.float32)).reshape(2, m, 40)
    return got, raw, eids, np.array(x.astype(mx.float32))


@pytest.mark.parametrize("qtype", [QT.IQ2_XXS, QT.Q2_K], ids=lambda t: t.name)
@pytest.mark.slow
def test_shared_text_bfloat16(qtype, tmp_path):
    """bfloat16 x and y: float32 sums rounded once to bfloat16 (within one bfloat16 step of
    the reference face's float32 result rounded the same way)."""
    got, raw, eids, x = bfloat16_case_on_cpu(tmp_path, qtype)
    k = x.shape[-1]
    want, mag = dense(raw, qtype, x, eids)
    assert np.all(np.abs(got - want) <= 2.0**-8 * np.abs(want) + k * 2.0**-22 * mag)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.slow_after(1)
def test_cuda_face_compiles_with_nvcc(qtype, dtype, tmp_path):
    """The CUDA unit mx.fast.cuda_kernel builds, at V4 Flash's gate / up shape (2,048 rows of
    4,096 values, batches of 64 rows), compiled for sm_90 by nvcc, warnings as errors."""
    from test_kernel_emulation import nvcc_compile

    family = [_cuda_source(t, d) for t in TYPES for d in ("bfloat16", "float32")]
    nvcc_compile(tmp_path, _cuda_source(qtype, dtype), family=family)


def _cuda_source(qtype, dtype):
    from test_kernel_emulation import mlx_cuda_source

    h, b = grouped_qmm.kernel_sources(qtype, "cuda")
    k = 4096
    tmpl = [("T", dtype), ("N_ROWS", 2048), ("K_DIM", k), ("ROW_BYTES", quant_moe.row_bytes(qtype, k))]
    tmpl += [("M_ROWS", 64), ("GQ_RM", 8)]
    ins = {"x": dtype, "w": "uint32", "eids": "int32", "lens": "int32"}
    src = mlx_cuda_source(f"grouped_qmm_{qtype.name.lower()}", h, b, ins, {"y": dtype}, tmpl)
    return src.replace("const uint32_t* w,", "const uint8_t* w,")


# --------------------------------------------------------------------------- self-test, launches


def _reference_launch(qtype, launches):
    """A stand-in for the kernel's launch computing the reference face (a right face)."""

    def launch(face, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        launches.append((dict(template), grid, threadgroup))
        x, w, eids, lens = inputs
        return [grouped_qmm.grouped_qmm(x, w, qtype, eids, lens, backend="reference").astype(output_dtypes[0])]

    return launch


def test_bad_face_falls_back_and_good_face_is_kept(fake_gpu, caplog):
    blocks = quant_moe.random_gguf_blocks(QT.Q2_K, 3, 6, 256, seed=2)
    x = mx.random.normal((2, 5, 256), key=mx.random.key(2))
    eids = mx.array([2, 1], dtype=mx.int32)
    want = grouped_qmm.grouped_qmm(x, blocks, QT.Q2_K, eids, backend="reference")

    def garbage(face, *, output_shapes, output_dtypes, **kw):
        return [mx.full(s, 7.0, t) for s, t in zip(output_shapes, output_dtypes)]

    fake_gpu.setattr(grouped_qmm, "_kernel", lambda qtype, mma=False: garbage)
    with caplog.at_level(logging.WARNING, logger="ds4mlx.kernels"):
        got = grouped_qmm.grouped_qmm(x, blocks, QT.Q2_K, eids)
    assert np.array_equal(np.array(got), np.array(want))
    assert "grouped_qmm.Q2_K" in caplog.text and "failed its first-use self-test" in caplog.text
    launches = []
    fake_gpu.setattr(grouped_qmm, "_kernel", lambda qtype, mma=False: _reference_launch(qtype, launches))
    assert grouped_qmm.face(QT.IQ2_XXS) == "metal"
    assert dispatch._self_tests[("grouped_qmm.IQ2_XXS", "metal")] is True
    # the self-test's launches: 130 rows -> 2 row tiles; M 20 -> 3 tokens per SIMD group, 1 tile; M 70 -> 2 tiles
    assert {(t["M_ROWS"], t["GQ_RM"], g, tg) for t, g, tg in launches} == {
        (20, 3, (256, 2, 3), (256, 1, 1)),
        (70, 8, (256, 2, 6), (256, 1, 1)),
    }


def test_every_type_s_cuda_face_is_verified_by_its_gpu_tests():
    # the `pytest -m gpu` tests below passed on an H100 for every type: no first-use self-test on CUDA
    assert not set(grouped_qmm.GROUPED_KERNELS.values()) & dispatch.UNVERIFIED_KERNELS


def test_grid_z_limit_splits_launches(monkeypatch):
    launches = []
    monkeypatch.setattr(grouped_qmm, "_kernel", lambda qtype, mma=False: _reference_launch(qtype, launches))
    monkeypatch.setattr(grouped_qmm, "MAX_GRID_Z", 5)  # 2 token tiles per batch: 2 batches a launch
    blocks = quant_moe.random_gguf_blocks(QT.IQ2_XXS, 4, 8, 256, seed=3)
    x = mx.random.normal((5, 70, 256), key=mx.random.key(3))
    eids = mx.array([3, 0, 1, 1, 2], dtype=mx.int32)
    got = grouped_qmm.grouped_qmm(x, blocks, QT.IQ2_XXS, eids, backend="cuda")
    want = grouped_qmm.grouped_qmm(x, blocks, QT.IQ2_XXS, eids, backend="reference")
    assert [g[2] for _, g, _ in launches] == [4, 4, 2]
    assert np.array_equal(np.array(got), np.array(want))


# --------------------------------------------------------------------------- the prefill mode


def test_mode_switch(monkeypatch):
    monkeypatch.setenv(prefill_experts.ENV, "grouped_blocks")
    assert prefill_experts.grouped_wanted(prefill_experts.MIN_PAIRS) and prefill_experts.blocks_wanted()
    assert not prefill_experts.grouped_wanted(prefill_experts.MIN_PAIRS - 1)
    monkeypatch.setenv(prefill_experts.ENV, "grouped")
    assert not prefill_experts.blocks_wanted()
    monkeypatch.delenv(prefill_experts.ENV)
    assert not prefill_experts.blocks_wanted()  # auto: not until a GPU measurement


@pytest.mark.parametrize("bank", ["ds4", "Q4_K", "Q8_0"])
def test_switch_glu_through_blocks_equals_todays_path(monkeypatch, bank):
    from test_grouped_experts import GGUF_BANKS, _assert_close, _gguf_glu, _routing

    glu = _gguf_glu(GGUF_BANKS[bank], 256, 256, seed=5)
    x = mx.random.normal((1, 300, 256), key=mx.random.key(5)) * 0.3
    idx = _routing("hot", 300, 5)
    for qtype in set(GGUF_BANKS[bank]):  # first-use self-tests run before the recording
        grouped_qmm.face(qtype)
    calls = []
    real = grouped_qmm.grouped_qmm
    monkeypatch.setattr(grouped_qmm, "grouped_qmm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(prefill_experts, "MIN_PAIRS", 1)
    monkeypatch.setenv(prefill_experts.ENV, "gather_qmm")
    want = np.array(glu(x, idx)).astype(np.float64)
    monkeypatch.setenv(prefill_experts.ENV, "grouped_blocks")
    got = np.array(glu(x, idx)).astype(np.float64)
    assert len(calls) == 3  # gate, up, down
    _assert_close(want, got)


@pytest.fixture(scope="module")
def v4_gguf(oracle, tmp_path_factory):
    """The V4 tiny oracle's config, hidden = moe_intermediate = 256 (GGUF rows of whole
    blocks), its experts quantized as ds4's files (IQ2_XXS gate / up, Q2_K down)."""
    import json

    import ds4mlx
    from ds4mlx.cli.commands import main
    from ds4mlx.io.convert import write_gguf
    from ds4mlx.io.demo import demo_weights

    tmp = tmp_path_factory.mktemp("grouped_qmm")
    cfg = json.loads((oracle("make_tiny_deepseek_v4.py", None) / "config.json").read_text())
    cfg.update(hidden_size=256, moe_intermediate_size=256)
    src, out = tmp / "wide.gguf", tmp / "wide-iq2_xxs.gguf"
    write_gguf(str(src), cfg, demo_weights(cfg, seed=1), tokenizer=False, dtype="f32")
    assert main(["quantize", str(src), str(out), "--experts", "iq2_xxs", "-q"]) == 0
    lm, _ = ds4mlx.load(str(out), verbose=False)
    ids = np.random.default_rng(0).integers(2, min(lm.vocab_size, 4000), 40).tolist()
    return lm, ids


def _prefill_logits(monkeypatch, lm, ids, mode, chunks=(7, 40)):
    from parity_helpers import chunked_logits

    monkeypatch.setattr(prefill_experts, "MIN_PAIRS", 1)
    monkeypatch.setenv(prefill_experts.ENV, mode)
    return {chunk: chunked_logits(lm, ids, chunk) for chunk in chunks}


def test_v4_gguf_prefill_unchanged_in_blocks_mode(monkeypatch, v4_gguf):
    lm, ids = v4_gguf
    want = _prefill_logits(monkeypatch, lm, ids, "gather_qmm")
    got = _prefill_logits(monkeypatch, lm, ids, "grouped_blocks")
    for chunk in want:
        assert np.isfinite(got[chunk]).all()
        assert np.abs(got[chunk] - want[chunk]).max() <= 1e-4


@pytest.mark.slow
def test_v4_gguf_prefill_through_the_kernel_text(monkeypatch, v4_gguf, tmp_path):
    """The same, every grouped_qmm launch run by the shared text itself (g++, emulated;
    chunks of 20 and 40 tokens: batches of 16 and 32 rows)."""
    lm, ids = v4_gguf
    want = _prefill_logits(monkeypatch, lm, ids, "gather_qmm", (20, 40))
    launches = []

    def kernel(qtype, mma=False):
        def launch(face, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            x, w, eids, lens = (np.array(a) for a in inputs)
            t = dict(template)
            assert x.dtype == np.float32 and threadgroup == (grouped_qmm.THREADS, 1, 1)
            d = tmp_path / f"launch{len(launches)}"
            d.mkdir()
            launches.append(grid)
            y = run_grouped_on_cpu(d, qtype, w, x.reshape(-1, t["K_DIM"]), eids, t["M_ROWS"], lens)
            return [mx.array(y).reshape(output_shapes[0]).astype(output_dtypes[0])]

        return launch

    monkeypatch.setattr(grouped_qmm, "_kernel", kernel)
    monkeypatch.setattr(grouped_qmm, "face", lambda qtype, mma=False: "cuda")
    got = _prefill_logits(monkeypatch, lm, ids, "grouped_blocks", (20, 40))
    assert {g[2] for g in launches} and all(g[:2] == (grouped_qmm.THREADS, 2) for g in launches)
    for chunk in want:
        assert np.abs(got[chunk] - want[chunk]).max() <= 1e-4


# --------------------------------------------------------------------------- GPU


V4_FLASH_CASES = [(QT.IQ2_XXS, 2048, 4096), (QT.Q2_K, 4096, 2048), (QT.Q4_K, 2048, 4096), (QT.Q8_0, 4096, 2048)]


def v4_flash_batches(qtype, rows, k, dtype) -> dict:
    """V4 Flash experts (256 experts, hidden 4,096, moe_intermediate 2,048, top-6): a 2,048-token
    chunk's grouped layout (12,288 pairs, one hot expert), 40 of its batches (hot and cold
    experts, their padding rows): the launch's arguments (x, raw, eids, lengths), the reference
    face's float32 product (`want`, on the CPU), |x| |W|^T (`mag`), the rows' sums of |W|
    (`wsum` [B, 1, N]) and |x| (`xsum` [B, M, 1]), and the live rows (`live` [B, M])."""
    rng = np.random.default_rng(rows)
    routing = np.argsort(rng.random((2048, 256)), axis=-1)[:, :6]
    routing[:, 0] = 7  # a hot expert: several batches of one expert
    lay = grouped_experts.layout(np.bincount(routing.reshape(-1), minlength=256))
    pick = np.concatenate([np.arange(8), rng.choice(lay.batches, 32, replace=False)])
    raw = quant_moe.random_gguf_blocks(qtype, 256, rows, k, seed=3)
    eids = mx.array(lay.experts[pick])
    x = (mx.random.normal((pick.size, lay.cap, k), key=mx.random.key(4)) * 0.5).astype(dtype)
    lengths = mx.array(lay.lengths[pick])  # the layout's padding rows: zeros, no product
    with mx.stream(mx.cpu):
        want = np.array(grouped_qmm.grouped_qmm(x.astype(mx.float32), raw, qtype, eids, lengths, backend="reference"))
        w = np.abs(np.array(quant_moe.dequantize_mx(raw[eids], qtype, k)))
    xa = np.abs(np.array(x.astype(mx.float32)))
    live = np.arange(lay.cap)[None, :] < lay.lengths[pick][:, None]
    return {
        "x": x,
        "raw": raw,
        "eids": eids,
        "lengths": lengths,
        "want": want,
        "mag": xa @ w.swapaxes(1, 2),
        "wsum": w.sum(-1)[:, None, :],
        "xsum": xa.sum(-1)[:, :, None],
        "live": live,
    }


@pytest.mark.gpu
@pytest.mark.parametrize("case", V4_FLASH_CASES, ids=lambda c: f"{c[0].name}_r{c[1]}_K{c[2]}")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_gpu_equals_reference_at_v4_flash_shapes(case, dtype):
    """`v4_flash_batches` through the GPU face against the reference face (float32 on the
    CPU), and the face's first-use self-test."""
    face = dispatch.gpu_backend()
    if face is None:
        pytest.skip("no MLX GPU backend")
    qtype, rows, k = case
    assert grouped_qmm._self_test(face, qtype)
    v = v4_flash_batches(qtype, rows, k, dtype)
    got = grouped_qmm.grouped_qmm(v["x"], v["raw"], qtype, v["eids"], v["lengths"], backend=face)
    assert got.dtype == dtype and got.shape == v["want"].shape
    got = np.array(got.astype(mx.float32)).astype(np.float64)
    rel = 0.0 if dtype == mx.float32 else 2.0**-8  # the output rounded to bfloat16
    assert np.all(np.abs(got - v["want"]) <= k * 2.0**-23 * v["mag"] + rel * np.abs(v["want"]) + 1e-30)


def glu_on_gpu_vs_cpu(monkeypatch, bank, dtype, mode, mma=False):
    """SwitchGLU at V4-like proportions (64 experts, top-6, 512 -> 256 -> 512; a 2,048-token
    chunk, one hot expert): (on the GPU under DS4MLX_PREFILL_EXPERTS=`mode`, as float64; the
    per-pair path on the CPU in float32), asserting every projection was one grouped_qmm launch
    of the GPU face (`mma`: its tensor-core variant)."""
    from test_grouped_experts import GGUF_BANKS, _gguf_glu, _routing

    face = dispatch.gpu_backend()
    if face is None:
        pytest.skip("no MLX GPU backend")
    gpu = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        glu = _gguf_glu(GGUF_BANKS[bank], 512, 256, 11, 64)
        x = mx.random.normal((1, 2048, 512), key=mx.random.key(12))
        idx = _routing("hot", 2048, 12, 64, 6)
        monkeypatch.setenv(prefill_experts.ENV, "gather_qmm")
        want = np.array(glu(x, idx)).astype(np.float64)
    finally:
        mx.set_default_device(gpu)
    for qtype in set(GGUF_BANKS[bank]):  # first-use self-tests run before the recording
        assert grouped_qmm.face(qtype, mma) == face
    calls = []
    real = grouped_qmm.grouped_qmm
    monkeypatch.setattr(
        grouped_qmm,
        "grouped_qmm",
        lambda *a, **kw: calls.append((kw["backend"], kw.get("mma", False))) or real(*a, **kw),
    )
    monkeypatch.setenv(prefill_experts.ENV, mode)
    got = glu(x.astype(dtype), idx)
    assert got.dtype == dtype and calls == [(face, mma)] * 3
    return np.array(got.astype(mx.float32)).astype(np.float64), want


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bank", ["ds4", "Q4_K"])
def test_gpu_switch_glu_in_blocks_mode(monkeypatch, bank, dtype):
    got, want = glu_on_gpu_vs_cpu(monkeypatch, bank, dtype, "grouped_blocks")
    # float32: summation order only; bfloat16: x, the SwiGLU output and y rounded to 8 bits
    assert np.abs(got - want).max() <= (1e-4 if dtype == mx.float32 else 3e-2) * np.abs(want).max()
