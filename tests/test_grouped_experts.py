"""Routed experts at prefill as per-expert batched GEMMs (models/grouped_experts.py, #14).

* `layout`: every sorted pair lands on exactly one padded row of a batch of its own
  expert, padding rows point at the zero row, experts without pairs get no batch, and
  the padded rows stay within the stated bound 3 P + 47 E.
* SwitchGLU through the grouped path equals SwitchGLU through today's path (per-pair
  `gather_qmm` / `quant_moe.gather_qmm`, DS4MLX_PREFILL_EXPERTS=gather_qmm) within float32
  rounding, on random tiny banks: float, MLX affine 2 / 4 / 8 bits, each GGUF type
  (Q8_0, Q2_K, Q4_K, IQ2_XXS, and ds4's IQ2_XXS gate / up + Q2_K down split), for chunks
  of 1, 7, 512 and 4,096 tokens, with random routing, empty experts, and one expert
  taking every token (more rows than the largest cap: several batches of one expert).
* Whole models: the five families' tiny oracle models (V4's hash-routed layers included)
  prefilled in chunks of 7 and 512 through the grouped path stay within 1e-4 of transformers.
* The switch: `auto` keeps today's path on the CPU, decode-sized calls never group,
  a traced call (mx.compile) falls back, an unknown value is an error.
* `-m gpu`: the GPU's grouped path (16-bit tensor-core GEMMs) against the CPU's
  reference path at V4-like proportions.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from parity_helpers import chunked_logits, load_case, maxdiff  # tests/ is on sys.path under pytest
from test_quant import random_blocks

from ds4mlx.io.quant import QT
from ds4mlx.kernels import dispatch
from ds4mlx.models import grouped_experts, prefill_experts
from ds4mlx.models.layers import SwitchGLU
from ds4mlx.models.quantized import GGUFSwitchLinear, SplitSwitchLinear

# exactness claims are about MLX's CPU kernels; `gpu` tests keep the default device
pytestmark = pytest.mark.usefixtures("cpu_unless_gpu_test")


# --------------------------------------------------------------------------- layout


def _check_layout(counts):
    counts = np.asarray(counts)
    P, E = int(counts.sum()), counts.size
    lay = grouped_experts.layout(counts)
    cap, B = lay.cap, lay.batches
    assert cap in grouped_experts.CAPS
    assert lay.rows.shape == (B * cap,) and lay.dest.shape == (P,)
    # every sorted pair fills exactly the padded row that dest names, and nothing else does
    real = lay.rows < P
    assert real.sum() == P
    assert np.array_equal(lay.rows[lay.dest], np.arange(P))
    assert np.all(lay.rows[~real] == P)
    # each batch's live rows come first, lengths counts them (grouped_qmm skips the rest)
    live = np.arange(cap)[None, :] < lay.lengths[:, None]
    assert np.array_equal(real.reshape(B, cap), live)
    # a batch holds rows of its own expert only (sorted pairs of expert e: start_e .. start_e + n_e)
    start = np.cumsum(counts) - counts
    e_of_sorted = np.repeat(np.arange(E), counts)
    assert np.array_equal(lay.experts[lay.dest // cap], e_of_sorted)
    assert set(lay.experts.tolist()) == set(np.nonzero(counts)[0].tolist())  # empty experts: no batch
    assert np.all(np.diff(lay.experts) >= 0)
    # the stated memory bound
    assert B * cap <= 3 * P + 47 * E
    return lay, start


@pytest.mark.parametrize(
    "counts",
    [
        [0, 0, 0, 0],
        [5, 0, 3, 0, 0, 1],
        [48] * 256,
        [4096] + [0] * 15,
        [1] * 7 + [0] * 9,
        list(np.random.default_rng(3).poisson(48, 256)),
        [10_000, 3, 0, 700, 64, 65],
    ],
    ids=["empty", "sparse", "uniform", "one-expert", "ones", "poisson", "skewed"],
)
def test_layout_places_every_pair_once(counts):
    _check_layout(counts)


def test_layout_splits_a_hot_expert_into_batches():
    lay, _ = _check_layout([4096] + [0] * 15)
    assert lay.cap == max(grouped_experts.CAPS) and lay.batches == 4096 // lay.cap
    assert np.all(lay.experts == 0)


def test_cap_follows_the_counts():
    assert grouped_experts.choose_cap(np.array([3, 1, 0, 2])) == 16
    # V4 Flash, 2,048-token chunk, uniform routing: batches of 64 rows (one qmm tile)
    assert grouped_experts.choose_cap(np.random.default_rng(0).poisson(48, 256)) == 64


# --------------------------------------------------------------------------- SwitchGLU


E, TOP = 16, 4


def _routing(kind: str, T: int, seed: int, n_exp: int = E, top: int = TOP) -> mx.array:
    """[1, T, top] distinct experts per token."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        idx = np.argsort(rng.random((T, n_exp)), axis=-1)[:, :top]
    elif kind == "empty":  # only experts 2, 5, 11, 12, 14 are ever chosen
        used = np.array([2, 5, 11, 12, 14])
        idx = used[np.argsort(rng.random((T, used.size)), axis=-1)[:, :top]]
    elif kind == "hot":  # expert 3 in every token's slots (slot 1), the rest random
        rest = 1 + np.argsort(rng.random((T, n_exp - 1)), axis=-1)[:, : top - 1]
        rest = np.where(rest == 3, 0, rest)
        idx = np.concatenate([rest[:, :1], np.full((T, 1), 3), rest[:, 1:]], axis=1)
    else:
        raise AssertionError(kind)
    assert all(len(set(r)) == top for r in idx.tolist())
    return mx.array(idx[None].astype(np.int32))


def _both(monkeypatch, glu, x, idx):
    """(today's path, the grouped path) of one SwitchGLU call, as float64."""
    monkeypatch.setattr(prefill_experts, "MIN_PAIRS", 1)  # group every chunk size, 1 token too
    monkeypatch.setenv(prefill_experts.ENV, "gather_qmm")
    want = glu(x, idx)
    monkeypatch.setenv(prefill_experts.ENV, "grouped")
    got = glu(x, idx)
    assert got.shape == want.shape == (*idx.shape, x.shape[-1])
    assert got.dtype == x.dtype
    return np.array(want).astype(np.float64), np.array(got).astype(np.float64)


def _float_glu(H: int, inter: int, seed: int, n_exp: int = E) -> SwitchGLU:
    glu = SwitchGLU(H, inter, n_exp, limit=10.0)
    glu.gate_up_proj.weight = mx.random.normal((n_exp, 2 * inter, H), key=mx.random.key(seed)) / np.sqrt(H)
    glu.down_proj.weight = mx.random.normal((n_exp, H, inter), key=mx.random.key(seed + 1)) / np.sqrt(inter)
    return glu


CHUNKS = [1, 7, 512, 4096]
ROUTINGS = ["random", "empty", "hot"]


def _assert_close(want, got, rel=2e-6):
    """float32 rounding: two summation orders of the same float32 products, and the
    SwiGLU of values that differ by that much (bound relative to the largest output)."""
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= rel * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("bits", [None, 2, 4, 8], ids=["float", "mlx2", "mlx4", "mlx8"])
def test_affine_and_float_banks_equal_todays_path(monkeypatch, bits, chunk, routing):
    H, inter = 128, 64
    glu = _float_glu(H, inter, seed=bits or 0)
    if bits:
        nn.quantize(glu, group_size=64, bits=bits)
    x = mx.random.normal((1, chunk, H), key=mx.random.key(chunk))
    want, got = _both(monkeypatch, glu, x, _routing(routing, chunk, chunk + (bits or 0)))
    _assert_close(want, got)


@pytest.mark.parametrize("via_dequant", [False, True], ids=["gather_qmm", "dequant-slices"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_bf16_scales_affine_bank(monkeypatch, bits, via_dequant):
    """bf16 scales and biases (as a bf16 model's banks) under float32 activations, through
    gather_qmm with M = cap or through dequantized slices (AFFINE_VIA_DEQUANT): today's
    path computes in float32, so must both (no bf16 rounding of the weights)."""
    glu = _float_glu(128, 64, seed=bits)
    nn.quantize(glu, group_size=64, bits=bits)
    for proj in (glu.gate_up_proj, glu.down_proj):
        proj.scales, proj.biases = proj.scales.astype(mx.bfloat16), proj.biases.astype(mx.bfloat16)
    monkeypatch.setattr(grouped_experts, "AFFINE_VIA_DEQUANT", via_dequant)
    x = mx.random.normal((1, 512, 128), key=mx.random.key(bits))
    want, got = _both(monkeypatch, glu, x, _routing("hot", 512, bits))
    _assert_close(want, got)


def _gguf_glu(qtypes, H: int, inter: int, seed: int, n_exp: int = E) -> SwitchGLU:
    """Random GGUF banks with small block scales (outputs of order 1: float16 on a GPU holds them)."""
    gate_t, up_t, down_t = qtypes
    rng = np.random.default_rng(seed)

    def bank(qtype, rows, k):
        return GGUFSwitchLinear(mx.array(random_blocks(qtype, (n_exp, rows, k), rng, scale=0.002)), qtype, k)

    glu = SwitchGLU(H, inter, n_exp, limit=10.0)
    glu.gate_up_proj = SplitSwitchLinear(bank(gate_t, inter, H), bank(up_t, inter, H))
    glu.down_proj = bank(down_t, H, inter)
    return glu


GGUF_BANKS = {
    "Q8_0": (QT.Q8_0,) * 3,
    "Q2_K": (QT.Q2_K,) * 3,
    "Q4_K": (QT.Q4_K,) * 3,
    "IQ2_XXS": (QT.IQ2_XXS,) * 3,
    "ds4": (QT.IQ2_XXS, QT.IQ2_XXS, QT.Q2_K),  # ds4's 2-bit files
}


# every bank at 1, 7 and 512 tokens with each routing; at 4,096 tokens (~10 s per case on
# this CPU, most of it today's path) with the hot expert, the routing that splits batches
GGUF_CASES = [(c, r) for c in CHUNKS[:-1] for r in ROUTINGS] + [pytest.param(CHUNKS[-1], "hot", marks=pytest.mark.slow)]


@pytest.mark.parametrize("chunk,routing", GGUF_CASES)
@pytest.mark.parametrize("bank", list(GGUF_BANKS))
def test_gguf_banks_equal_todays_path(monkeypatch, bank, chunk, routing):
    H, inter = 256, 256
    glu = _gguf_glu(GGUF_BANKS[bank], H, inter, seed=7)
    x = mx.random.normal((1, chunk, H), key=mx.random.key(chunk + 1)) * 0.3
    want, got = _both(monkeypatch, glu, x, _routing(routing, chunk, chunk))
    _assert_close(want, got)


def test_gguf_slices_of_one_expert_equal_one_slice(monkeypatch):
    """MAX_SLICE_BYTES down to one expert per dequantized slice: the same result."""
    glu = _gguf_glu(GGUF_BANKS["ds4"], 256, 256, seed=3)
    x = mx.random.normal((1, 300, 256), key=mx.random.key(3)) * 0.3
    idx = _routing("hot", 300, 3)
    want, whole = _both(monkeypatch, glu, x, idx)
    monkeypatch.setattr(grouped_experts, "MAX_SLICE_BYTES", 1)
    sliced = np.array(glu(x, idx)).astype(np.float64)
    assert np.array_equal(sliced, whole)
    _assert_close(want, sliced)


# --------------------------------------------------------------------------- whole models

FAMILIES = [  # tests/test_prefill_parity.py's: V4's has hash-routed layers (1 and 3)
    ("make_tiny_deepseek_v4.py", "long"),
    ("probe_mlx_deepseek_v41.py", "mixed"),
    ("make_tiny_glm_moe_dsa.py", "alt"),
    ("make_tiny_glm5_next.py", "long"),
    ("make_tiny_qwen4_exp.py", "long"),
]


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f[0].removeprefix("make_tiny_").removesuffix(".py"))
def test_families_prefill_through_grouped_experts(monkeypatch, oracle, fam):
    """Every MoE layer (hash-routed too) through the grouped path: chunked prefill still
    equals transformers' full forward within the parity bound (1e-4)."""
    _, lm, ref, _ = load_case(oracle, *fam)
    calls = _spy(monkeypatch)
    monkeypatch.setattr(prefill_experts, "MIN_PAIRS", 1)
    monkeypatch.setenv(prefill_experts.ENV, "grouped")
    ids = ref["input_ids"][0].tolist()
    for chunk in (7, 512):
        assert maxdiff(chunked_logits(lm, ids, chunk), ref["logits_full"][0]) <= 1e-4
    assert calls


# --------------------------------------------------------------------------- the switch


def _spy(monkeypatch):
    calls = []
    real = grouped_experts.switch_glu

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(grouped_experts, "switch_glu", spy)
    return calls


def test_auto_keeps_todays_path_on_the_cpu(monkeypatch):
    glu = _float_glu(128, 64, 1)
    nn.quantize(glu, group_size=64, bits=4)
    calls = _spy(monkeypatch)
    monkeypatch.delenv(prefill_experts.ENV, raising=False)
    x = mx.random.normal((1, 512, 128), key=mx.random.key(1))
    mx.eval(glu(x, _routing("random", 512, 1)))  # 2,048 pairs >= MIN_PAIRS
    assert calls == []
    monkeypatch.setenv(prefill_experts.ENV, "grouped")
    mx.eval(glu(x, _routing("random", 512, 1)))
    assert calls == [1]


def test_small_calls_never_group(monkeypatch):
    """Decode and small chunks (< MIN_PAIRS pairs) keep today's kernels in every mode."""
    glu = _float_glu(128, 64, 2)
    calls = _spy(monkeypatch)
    monkeypatch.setenv(prefill_experts.ENV, "grouped")
    T = prefill_experts.MIN_PAIRS // TOP - 1
    mx.eval(glu(mx.random.normal((1, T, 128), key=mx.random.key(2)), _routing("random", T, 2)))
    assert calls == []


def test_traced_call_falls_back(monkeypatch):
    """Inside mx.compile the counts cannot be read: today's path, the same result."""
    glu = _float_glu(128, 64, 4)
    nn.quantize(glu, group_size=64, bits=2)
    x = mx.random.normal((1, 300, 128), key=mx.random.key(4))
    idx = _routing("random", 300, 4)
    want, _ = _both(monkeypatch, glu, x, idx)  # leaves the mode at "grouped", MIN_PAIRS at 1
    got = mx.compile(lambda a, i: glu(a, i))(x, idx)
    assert np.array_equal(np.array(got).astype(np.float64), want)


def test_unknown_mode_is_an_error(monkeypatch):
    monkeypatch.setenv(prefill_experts.ENV, "fast")
    with pytest.raises(ValueError, match=prefill_experts.ENV):
        prefill_experts.grouped_wanted(prefill_experts.MIN_PAIRS)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("bank", ["float", "mlx2", "mlx4", "mlx8", "ds4", "Q4_K"])
def test_gpu_grouped_equals_cpu_reference(monkeypatch, bank, dtype):
    """The GPU's grouped path (16-bit GEMMs: gather_qmm with M = cap, dequantized
    slices + cuBLAS batched) vs today's path on the CPU in float32, one 2,048-token
    chunk at V4-like proportions (64 experts, top-6, 512 -> 256 -> 512), one hot expert."""
    if dispatch.gpu_backend() is None:
        pytest.skip("no MLX GPU backend")
    H, inter, T, n_exp = 512, 256, 2048, 64
    gpu = mx.default_device()
    mx.set_default_device(mx.cpu)  # the reference: today's path, CPU faces, float32
    try:
        if bank == "float" or bank.startswith("mlx"):
            glu = _float_glu(H, inter, 11, n_exp)
            if bank != "float":
                nn.quantize(glu, group_size=64, bits=int(bank[3:]))
        else:
            glu = _gguf_glu(GGUF_BANKS[bank], H, inter, 11, n_exp)
        x = mx.random.normal((1, T, H), key=mx.random.key(12))
        idx = _routing("hot", T, 12, n_exp, 6)
        monkeypatch.setenv(prefill_experts.ENV, "gather_qmm")
        want = np.array(glu(x, idx)).astype(np.float64)
    finally:
        mx.set_default_device(gpu)
    monkeypatch.setenv(prefill_experts.ENV, "auto")  # on a GPU: grouped from MIN_PAIRS pairs
    calls = _spy(monkeypatch)
    got = glu(x.astype(dtype), idx)
    assert got.dtype == dtype and calls == [1]
    got = np.array(got.astype(mx.float32)).astype(np.float64)
    assert np.isfinite(got).all()
    # 16-bit operands (8-bit mantissa for bf16) over K = 512 / 256 terms
    assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()


def test_compute_dtype_without_scales():
    """GGUF banks have no affine scales: compute_dtype(x, None) must not compare an MLX
    Dtype with None (that raised TypeError on the H200, the one path the CPU never runs)."""
    from ds4mlx.models import grouped_experts as ge

    assert ge.compute_dtype(mx.bfloat16) == mx.bfloat16
    assert ge.compute_dtype(mx.float32, None) == ge.GPU_DTYPE
    assert ge.compute_dtype(mx.float32, mx.bfloat16) == mx.bfloat16
