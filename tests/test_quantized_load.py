"""`ds4mlx quantize` -> `ds4mlx.load`: quantized GGUFs load as quantized modules.

For each recipe the loaded model is compared with the float model built from the
*dequantized* weights of the same file (`QuantizedTensor.dequantize`, the gguf-py
reference): same logits up to float32 summation order.  Bound: TOL = 1e-4 on
logits of magnitude ~4-6 (measured on the CPU: 0.0 for full forwards, where
MLX's quantized matmuls and the quant_moe reference face dequantize exactly and
then multiply like the float graph; a session's decode agrees with the float
model's decode to 0.0 and with full forwards to ~5e-6, the same as float models).

Sources (K-quant / IQ2_XXS rows need multiples of 256 values, the tiny oracle's
hidden size is 64 and the demo's 128):
  oracle    the tiny transformers oracle (tests/conftest.py), 64 / 32 wide:    mlx2, mlx4, --dense q8_0
  wide      the oracle's config with hidden = moe_intermediate = 256,
            random weights:                                                    iq2_xxs, q2_k, q4_k (+ q8_0)
  demo      the built-in demo model (real vocabulary and tokenizer):         mlx2, mlx4 (+ q8_0)
  demo256   the demo config with hidden = moe_intermediate = 256 (slow):       iq2_xxs + q8_0, and
            `ds4mlx generate` on it
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import ds4mlx
import ds4mlx.io.quant
from ds4mlx.cli.commands import main
from ds4mlx.io.loader import load
from ds4mlx.io.quant import QT, QuantizedTensor
from ds4mlx.io.weights import read_weights
from ds4mlx.models import quantized
from ds4mlx.models.base import LanguageModel
from ds4mlx.models.layers import QuantizedSwitchLinear, SwitchLinear
from ds4mlx.models.quantized import GGUFSwitchLinear, SplitSwitchLinear

TOL = 1e-4
WIDE = dict(hidden_size=256, moe_intermediate_size=256)

# recipe -> (gate, up, down): ("gguf", qtype) kept as blocks, ("mlx", bits) repacked
RECIPES = {
    "iq2_xxs": (("gguf", QT.IQ2_XXS), ("gguf", QT.IQ2_XXS), ("gguf", QT.Q2_K)),
    "q2_k": (("gguf", QT.Q2_K),) * 3,
    "q4_k": (("gguf", QT.Q4_K),) * 3,
    "mlx4": (("mlx", 4),) * 3,
    "mlx2": (("mlx", 2),) * 3,
}
DENSE_Q8 = (
    "self_attn.q_a_proj",
    "self_attn.q_b_proj",
    "self_attn.kv_proj",
    "self_attn.o_b_proj",
    "mlp.shared_experts.gate_proj",
    "mlp.shared_experts.up_proj",
    "mlp.shared_experts.down_proj",
)

CASES = [
    ("oracle", "mlx4", True),
    ("oracle", "mlx2", False),
    ("wide", "iq2_xxs", False),
    ("wide", "q2_k", True),
    ("wide", "q4_k", False),
    ("demo", "mlx4", True),
    ("demo", "mlx2", False),
    pytest.param(("demo256", "iq2_xxs", True), marks=pytest.mark.slow),
]


# end to end (servers, several processes or models, whole files): the slow tier, which CI runs second
pytestmark = pytest.mark.slow


def _maxdiff(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


# --------------------------------------------------------------------------- sources


_built: dict = {}


def _source(name: str, oracle, tmp_root) -> str:
    if name in _built:
        return _built[name]
    from ds4mlx.io.convert import write_gguf
    from ds4mlx.io.demo import DEMO_CONFIG, demo_model_path, demo_weights

    if name == "oracle":
        path = str(oracle("make_tiny_deepseek_v4.py", None))  # an HF folder: quantize reads it directly
    elif name == "wide":
        cfg = json.loads((oracle("make_tiny_deepseek_v4.py", None) / "config.json").read_text())
        cfg.update(WIDE)
        path = str(tmp_root / "wide.gguf")
        write_gguf(path, cfg, demo_weights(cfg, seed=1), tokenizer=False, dtype="f32")
    elif name == "demo":
        path = demo_model_path(quiet=True)
    elif name == "demo256":
        from ds4mlx.runtime.tokenizer import Tokenizer

        cfg = dict(DEMO_CONFIG, **WIDE)
        path = str(tmp_root / "demo256.gguf")
        write_gguf(path, cfg, demo_weights(cfg, seed=3), tokenizer=Tokenizer.default(), dtype="f16")
    else:
        raise AssertionError(name)
    _built[name] = path
    return path


def dequantized_float_model(path) -> LanguageModel:
    """The float32 model of a GGUF's weights, every quantized tensor dequantized by
    the reference (`QuantizedTensor.dequantize`), split experts fused."""
    config, tensors, _ = read_weights(path)
    w = {k: v.dequantize() if isinstance(v, QuantizedTensor) else v for k, v in tensors.items()}
    for key in [k for k in w if k.endswith("mlp.experts.gate_proj")]:
        prefix = key[: -len("gate_proj")]
        w[prefix + "gate_up_proj"] = np.concatenate([w.pop(key), w.pop(prefix + "up_proj")], axis=1)
    return LanguageModel.from_config(config, w, dtype=mx.float32)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join([c[0], c[1]] + (["q8_0"] if c[2] else [])))
def case(request, oracle, tmp_path_factory):
    source, recipe, dense = request.param
    tmp = tmp_path_factory.mktemp("qload")
    src = _source(source, oracle, tmp_path_factory.getbasetemp())
    out = tmp / f"{source}-{recipe}.gguf"
    args = ["quantize", src, str(out), "--experts", recipe, "-q"] + (["--dense", "q8_0"] if dense else [])
    assert main(args) == 0
    calls = Counter()
    real = ds4mlx.io.quant.dequantize

    def counting(*a, **k):
        calls["dequantize"] += 1
        return real(*a, **k)

    with pytest.MonkeyPatch.context() as mp:  # count reference dequantizations during the load
        mp.setattr(ds4mlx.io.quant, "dequantize", counting)
        lm, _ = ds4mlx.load(out)
    ref = dequantized_float_model(out)
    rng = np.random.default_rng(0)
    ids = rng.integers(2, min(lm.vocab_size, 4000), 48).tolist()
    return dict(
        source=source,
        recipe=recipe,
        dense=dense,
        path=out,
        lm=lm,
        ref=ref,
        ids=ids,
        dequantize_calls=calls["dequantize"],
    )


# --------------------------------------------------------------------------- round trip


def test_logits_equal_dequantized_float_model(case):
    lm, ref, ids = case["lm"], case["ref"], case["ids"]
    got, want = lm.logits(ids), ref.logits(ids)
    assert np.isfinite(got).all()
    assert _maxdiff(got, want) <= TOL


def test_session_prefill_and_decode(case):
    """Chunked prefill (a 36-token chunk: 72 (token, expert) pairs, the sorted
    gather / kernel mat-mul path; then 4 tokens: mat-vec), then decode steps."""
    lm, ref, ids = case["lm"], case["ref"], case["ids"]
    full = ref.logits(ids)
    s, r = lm.new_session(ctx=64, chunk=36), ref.new_session(ctx=64, chunk=36)
    assert _maxdiff(s.prefill(ids[:40]), r.prefill(ids[:40])) <= TOL
    steps = np.stack([s.decode(t) for t in ids[40:]])
    ref_steps = np.stack([r.decode(t) for t in ids[40:]])
    assert _maxdiff(steps, ref_steps) <= TOL
    assert _maxdiff(steps, full[40:]) <= TOL
    assert s.tokens == ids


def test_no_full_dequantization(case):
    """The modules hold the quantized forms: GGUF blocks (the file's bytes) for
    Q2_K / IQ2_XXS, MLX affine arrays for the exact types; no float expert bank,
    and the load never called the reference dequantization."""
    lm, recipe = case["lm"], case["recipe"]
    assert case["dequantize_calls"] == 0
    _, tensors, _ = read_weights(case["path"], with_tokenizer=False)
    args = lm.args
    gate_k, up_k, down_k = RECIPES[recipe]
    for i, layer in enumerate(lm.model.layers):
        ex = layer.mlp.experts
        name = f"model.layers.{i}.mlp.experts."
        if gate_k[0] == "gguf":
            assert isinstance(ex.gate_up_proj, SplitSwitchLinear)
            for part, kind in (("gate_proj", gate_k), ("up_proj", up_k)):
                m = getattr(ex.gate_up_proj, part)
                assert isinstance(m, GGUFSwitchLinear) and m.qtype == kind[1]
                assert m.weight.dtype == mx.uint8 and m.weight.nbytes == tensors[name + part].nbytes
        else:
            m = ex.gate_up_proj
            assert type(m) is QuantizedSwitchLinear and m.bits == gate_k[1] and m.group_size == 32
            assert m.weight.shape[:2] == (args.n_routed_experts, 2 * args.moe_intermediate_size)
        d = ex.down_proj
        if down_k[0] == "gguf":
            assert isinstance(d, GGUFSwitchLinear) and d.qtype == down_k[1]
            assert d.weight.nbytes == tensors[name + "down_proj"].nbytes
        else:
            assert type(d) is QuantizedSwitchLinear and d.bits == down_k[1]
        for sub in DENSE_Q8:
            mod = layer
            for part in sub.split("."):
                mod = getattr(mod, part)
            assert (isinstance(mod, nn.QuantizedLinear) and mod.bits == 8) if case["dense"] else type(mod) is nn.Linear
        o_a = type(layer.self_attn.o_a_proj).__name__
        assert o_a == ("QuantizedGroupedLinear" if case["dense"] else "GroupedLinear")
    if not args.tie_word_embeddings:
        assert isinstance(lm.model.lm_head, nn.QuantizedLinear) == case["dense"]
    # no float array as large as one expert bank anywhere in the model
    bank = args.n_routed_experts * args.moe_intermediate_size * args.hidden_size
    floats = [
        k
        for k, v in tree_flatten(lm.model.parameters())
        if mx.issubdtype(v.dtype, mx.floating) and v.size >= bank and "embed" not in k and "lm_head" not in k
    ]
    assert floats == []


def test_generate_cli_runs(case):
    if case["source"] not in ("demo", "demo256") or (case["source"] == "demo" and case["recipe"] != "mlx4"):
        pytest.skip("one generate run per tokenizer-bearing model")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ds4mlx.cli",
            "generate",
            "-m",
            str(case["path"]),
            "-p",
            "Hi",
            "-n",
            "4",
            "--temp",
            "0",
            "--ctx",
            "256",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "generated 4 tokens" in proc.stderr


# --------------------------------------------------------------------------- modules


def _blocks(qtype, shape, seed=0):
    from ds4mlx.io.quantize import quantize

    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) / 16
    qt = QuantizedTensor(raw=quantize(w, qtype), qtype=qtype, shape=shape)
    return qt, qt.dequantize()


@pytest.mark.parametrize("qtype", [QT.IQ2_XXS, QT.Q2_K])
def test_gguf_switch_linear_call_shapes(qtype):
    """The three ways SwitchGLU calls an expert projection: token vector shared by
    its k experts (gate/up), one vector per (token, expert) (down), and the sorted
    flat form of prefill; each equal to SwitchLinear with the dequantized weights."""
    E, out, K = 4, 32, 256
    qt, w = _blocks(qtype, (E, out, K))
    g = GGUFSwitchLinear(mx.array(qt.raw), qtype, K)
    f = SwitchLinear(K, out, E)
    f.weight = mx.array(w)
    rng = np.random.default_rng(1)
    idx = mx.array(rng.integers(0, E, (1, 5, 3)).astype(np.int32))
    shared = mx.array(rng.standard_normal((1, 5, 1, 1, K)).astype(np.float32))
    per = mx.array(rng.standard_normal((1, 5, 3, 1, K)).astype(np.float32))
    flat = mx.array(rng.standard_normal((70, 1, K)).astype(np.float32))
    fidx = mx.array(np.sort(rng.integers(0, E, 70)).astype(np.int32))
    for x, i in ((shared, idx), (per, idx), (flat, fidx)):
        got, want = g(x, i), f(x, i)
        assert got.shape == want.shape and got.dtype == x.dtype
        assert _maxdiff(got, want) <= 1e-5 * max(1.0, float(mx.abs(want).max()))


def test_split_switch_linear_equals_fused():
    E, inter, K = 3, 16, 256
    qg, wg = _blocks(QT.IQ2_XXS, (E, inter, K), 2)
    qu, wu = _blocks(QT.Q2_K, (E, inter, K), 3)
    split = SplitSwitchLinear(
        GGUFSwitchLinear(mx.array(qg.raw), qg.qtype, K), GGUFSwitchLinear(mx.array(qu.raw), qu.qtype, K)
    )
    fused = SwitchLinear(K, 2 * inter, E)
    fused.weight = mx.array(np.concatenate([wg, wu], axis=1))
    x = mx.array(np.random.default_rng(4).standard_normal((2, 1, 1, K)).astype(np.float32))
    i = mx.array([[0, 2], [1, 1]], dtype=mx.int32)
    assert _maxdiff(split(x, i), fused(x, i)) <= 1e-5


def test_mixed_types_and_fallbacks(oracle, tmp_path_factory, tmp_path, caplog):
    """Every kind of tensor in one file: Q8_0 embedding (QuantizedEmbedding), Q4_0
    grouped o_a_proj, IQ2_XXS gate + Q8_0 up (kernel + MLX: a split pair), and the
    fallbacks, logged and dequantized at load: Q2_K dense projection, Q8_0 router
    (no quantized module), Q5_0 experts (neither exact nor a kernel type)."""
    from ds4mlx.io.convert import write_gguf
    from ds4mlx.io.quantize import quantize

    src = _source("wide", oracle, tmp_path_factory.getbasetemp())
    config, tensors, _ = read_weights(src)
    tensors = dict(tensors)

    def q(name, qtype, arr=None):
        a = np.asarray(tensors.pop(name) if arr is None else arr, np.float32)
        tensors[name] = QuantizedTensor(
            raw=quantize(a, qtype) if qtype != QT.Q5_0 else _gguf_q(a, qtype), qtype=qtype, shape=a.shape
        )

    q("model.embed_tokens.weight", QT.Q8_0)
    q("model.layers.0.self_attn.o_a_proj.weight", QT.Q4_0)
    q("model.layers.0.self_attn.q_a_proj.weight", QT.Q2_K)
    q("model.layers.2.mlp.gate.weight", QT.Q8_0)
    gu = np.asarray(tensors.pop("model.layers.3.mlp.experts.gate_up_proj"))
    half = gu.shape[1] // 2
    q("model.layers.3.mlp.experts.gate_proj", QT.IQ2_XXS, gu[:, :half])
    q("model.layers.3.mlp.experts.up_proj", QT.Q8_0, gu[:, half:])
    q("model.layers.3.mlp.experts.down_proj", QT.Q5_0)
    path = tmp_path / "mixed.gguf"
    write_gguf(path, config, tensors, tokenizer=False, dtype="f32")

    with caplog.at_level(logging.WARNING, logger="ds4mlx.quantized"):
        lm, _ = ds4mlx.load(path)
    warned = " ".join(r.getMessage() for r in caplog.records)
    for name in ("q_a_proj", "mlp.gate.weight", "experts.down_proj"):
        assert name in warned
    m = lm.model
    assert isinstance(m.model.embed_tokens, nn.QuantizedEmbedding) and m.model.embed_tokens.bits == 8
    assert type(m.layers[0].self_attn.o_a_proj).__name__ == "QuantizedGroupedLinear"
    assert m.layers[0].self_attn.o_a_proj.bits == 4
    assert type(m.layers[0].self_attn.q_a_proj) is nn.Linear
    gate_up = m.layers[3].mlp.experts.gate_up_proj
    assert isinstance(gate_up, SplitSwitchLinear) and isinstance(gate_up.gate_proj, GGUFSwitchLinear)
    assert type(gate_up.up_proj) is QuantizedSwitchLinear and gate_up.up_proj.bits == 8
    assert type(m.layers[3].mlp.experts.down_proj) is SwitchLinear
    ids = list(range(2, 50))
    assert _maxdiff(lm.logits(ids), dequantized_float_model(path).logits(ids)) <= TOL


def _gguf_q(a, qtype):
    import gguf.quants

    return np.asarray(gguf.quants.quantize(a.reshape(-1, a.shape[-1]), qtype)).reshape(*a.shape[:-1], -1)


def test_16bit_load_runs(oracle, tmp_path_factory, tmp_path):
    """A 16-bit load (what a GPU gets): scales in that dtype, outputs in that dtype,
    prefill (kernel mat-mul) and decode (mat-vec) run.  Not compared tightly: MLX's
    CPU quantized matmul accumulates 16-bit inputs in 16 bits."""
    src = _source("wide", oracle, tmp_path_factory.getbasetemp())
    out = tmp_path / "w.gguf"
    assert main(["quantize", src, str(out), "--experts", "iq2_xxs", "--dense", "q8_0", "-q"]) == 0
    lm, _ = load(out, dtype=mx.bfloat16)
    assert lm.model.layers[0].self_attn.q_a_proj.scales.dtype == mx.bfloat16
    s = lm.new_session(ctx=64, chunk=36)
    s.prefill(list(range(2, 38)))
    y = s.step(7)
    assert y.dtype == mx.bfloat16 and np.isfinite(np.array(y.astype(mx.float32))).all()


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "mlx2", "mlx4"])
@pytest.mark.parametrize("chunk", [1 << 24, 300])
def test_repack_equals_reference_bit_for_bit(kind, chunk, monkeypatch):
    """`models.quantized.repack` (MLX ops, chunked) == `quant.repack_for_mlx` (numpy)."""
    from ds4mlx.io.quant import repack_for_mlx
    from ds4mlx.io.quantize import quantize, quantize_expert_tensor
    from ds4mlx.models import quantized

    monkeypatch.setattr(quantized, "REPACK_CHUNK_VALUES", chunk)  # 300: one row per step
    w = np.random.default_rng(5).standard_normal((3, 40, 256)).astype(np.float32)
    if kind.startswith("mlx"):
        qt = quantize_expert_tensor(w, ("mlx", int(kind[-1])))
    else:
        qt = QuantizedTensor(raw=quantize(w, QT[kind]), qtype=QT[kind], shape=w.shape)
    got, want = quantized.repack(qt), repack_for_mlx(qt.raw, qt.qtype, qt.shape)
    assert got[3:] == want[3:] and got[4] == {"mlx2": 2, "Q8_0": 8}.get(kind, 4)
    for a, b in zip(got[:3], want[:3]):
        a, b = np.array(a), np.array(b)
        assert a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_experts_as_blocks_option(oracle, tmp_path_factory, tmp_path, monkeypatch):
    """Q4_K experts stay in the file's blocks (quant_moe) by default, Q8_0 experts are
    repacked to MLX 8-bit; DS4MLX_GGUF_EXPERTS=blocks keeps the Q8_0 ones as blocks too,
    =repack repacks the Q4_K ones as well (float32 scales, F16 weights kept as stored).
    Same logits every way."""
    src = _source("wide", oracle, tmp_path_factory.getbasetemp())
    out = tmp_path / "q4k.gguf"
    assert main(["quantize", src, str(out), "--experts", "q4_k", "--down", "q8_0", "-q"]) == 0
    ids = list(range(2, 42))
    want = dequantized_float_model(out).logits(ids)
    for mode, dtype, gate_up, down in (
        ("auto", "auto", SplitSwitchLinear, QuantizedSwitchLinear),
        ("blocks", "auto", SplitSwitchLinear, GGUFSwitchLinear),
        ("repack", None, QuantizedSwitchLinear, QuantizedSwitchLinear),
    ):
        monkeypatch.setenv("DS4MLX_GGUF_EXPERTS", mode)
        lm, _ = load(out, dtype=dtype, verbose=False)
        ex = lm.model.layers[2].mlp.experts
        assert type(ex.gate_up_proj) is gate_up and type(ex.down_proj) is down
        if gate_up is SplitSwitchLinear:
            assert ex.gate_up_proj.gate_proj.qtype == QT.Q4_K
        else:
            assert ex.gate_up_proj.bits == 4 and ex.gate_up_proj.scales.dtype == mx.float32
        assert _maxdiff(lm.logits(ids), want) <= TOL
    monkeypatch.setenv("DS4MLX_GGUF_EXPERTS", "fast")
    with pytest.raises(ValueError, match="DS4MLX_GGUF_EXPERTS must be one of auto, blocks, repack"):
        load(out, verbose=False)


# --------------------------------------------------------------------------- exact scales


def _held_values(mod) -> np.ndarray:
    """The float32 weights a module computes with: affine levels times its scales plus its
    biases (in float32, as the kernels and MLX's promotion to float32 activations compute
    them), GGUF blocks decoded by the reference face, or the float weight itself."""
    from ds4mlx.kernels import quant_moe

    if isinstance(mod, GGUFSwitchLinear):
        return np.array(quant_moe.dequantize_mx(mod.weight, mod.qtype, mod.input_dims))
    if hasattr(mod, "scales"):
        s, b = mod.scales.astype(mx.float32), mod.biases.astype(mx.float32)
        return np.array(mx.dequantize(mod.weight, s, b, group_size=mod.group_size, bits=mod.bits))
    return np.array(mod.weight.astype(mx.float32))


EXACT_CASES = {  # (GGUF type, the weights' stored type) -> (experts' form, dense form, scales' type)
    (QT.Q8_0, "float16"): ("mlx", "mlx", mx.float16),
    (QT.Q8_0, "bfloat16"): ("mlx", "mlx", mx.float32),
    (QT.Q4_0, "float16"): ("mlx", "mlx", mx.float16),
    (QT.Q4_1, "float16"): ("mlx", "mlx", mx.float16),
    (QT.Q4_1, "bfloat16"): ("mlx", "mlx", mx.float32),
    (QT.Q4_K, "float16"): ("blocks", "mlx", mx.float32),
    (QT.Q4_K, "bfloat16"): ("blocks", "mlx", mx.float32),
    (QT.Q2_K, "float16"): ("blocks", "dequantized", mx.float32),
    (QT.IQ2_XXS, "float16"): ("blocks", "dequantized", mx.float32),
}


@pytest.mark.parametrize("qtype,stored", list(EXACT_CASES), ids=lambda v: getattr(v, "name", v))
def test_every_gguf_type_kept_exactly(qtype, stored):
    """Under the float32 activation policy with 16-bit float weights (`dtype=None`, a GPU),
    every GGUF type is installed as a module whose weights decode to the reference
    `dequantize` bit for bit, as routed experts and as a dense linear: kept as blocks,
    repacked with scales in the stored 16-bit type only where that type holds them
    exactly (else float32), or dequantized to float32.  Before: every repack stored its
    scales in the stored type (Q4_K in float16: 17-bit products rounded)."""
    from ds4mlx.io.quantize import quantize
    from ds4mlx.models.quantized import dense_path, expert_path, install_quantized

    E, out, K = 3, 32, 256
    rng = np.random.default_rng(7)
    w3 = (rng.standard_normal((E, out, K)) / 8).astype(np.float32)
    quant = quantize if qtype in (QT.Q8_0, QT.Q4_K, QT.Q2_K, QT.IQ2_XXS) else _gguf_q
    bank = QuantizedTensor(raw=quant(w3, qtype), qtype=qtype, shape=w3.shape)
    dense = QuantizedTensor(raw=quant(w3[0], qtype), qtype=qtype, shape=w3[0].shape)
    root = nn.Module()
    root.experts, root.proj = SwitchLinear(K, out, E), nn.Linear(K, out, bias=False)
    dt = getattr(mx, stored)
    floats, owned = install_quantized(root, {"experts.weight": bank, "proj.weight": dense}, None, stored=dt)
    root.load_weights(list(floats.items()) + list(owned.items()))
    experts_form, dense_form, scales = EXACT_CASES[(qtype, stored)]
    for mod, qt, form, how in (
        (root.experts, bank, experts_form, expert_path(qtype, dt, True)),
        (root.proj, dense, dense_form, dense_path(qtype, dt, True)),
    ):
        assert how.form == form and how.exact
        if form == "mlx":
            assert mod.scales.dtype == scales and mod.biases.dtype == scales
        elif form == "dequantized":
            assert mod.weight.dtype == mx.float32
        got, want = _held_values(mod), qt.dequantize()
        assert got.shape == want.shape and np.array_equal(got, want)  # bit for bit (+0.0 == -0.0)
    assert all("rounded" not in line for line in quantized.paths_of(root))


def test_16bit_scales_exact_only_where_they_fit():
    """Which 16-bit repacks are exact (the reason for the table above): Q8_0 / Q4_0 / Q4_1
    scales fit float16, Q4_K's do not (`repack` refuses to round them under the exact
    policy and rounds them only when asked: an explicit --dtype float16); bfloat16 holds
    no Q8_0 scale; a Q8_0 scale past float16's range is refused, not made infinite."""
    from ds4mlx.io.quantize import quantize

    w = (np.random.default_rng(8).standard_normal((2, 16, 256)) / 8).astype(np.float32)
    qt = {t: QuantizedTensor(raw=quantize(w, t), qtype=t, shape=w.shape) for t in (QT.Q8_0, QT.Q4_K)}
    assert quantized.repack(qt[QT.Q8_0], mx.float16)[1].dtype == mx.float16
    with pytest.raises(ValueError, match="float16 exactly"):
        quantized.repack(qt[QT.Q4_K], mx.float16)
    with pytest.raises(ValueError, match="bfloat16 exactly"):
        quantized.repack(qt[QT.Q8_0], mx.bfloat16)
    rounded = quantized.repack(qt[QT.Q4_K], mx.float16, exact=False)
    assert rounded[1].dtype == mx.float16
    assert "rounded to float16" in quantized.dense_path(QT.Q4_K, mx.float16, False).describe()
    big = qt[QT.Q8_0].raw.copy()
    big[..., 0:2] = np.frombuffer(np.float16(1024).tobytes(), np.uint8)  # d = 1024: -128 d overflows float16
    with pytest.raises(ValueError, match="--dtype float32"):
        quantized.repack(QuantizedTensor(raw=big, qtype=QT.Q8_0, shape=w.shape), mx.float16)
