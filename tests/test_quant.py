"""GGUF quant types: reference dequantization, exact MLX repacking, quantizers."""

from __future__ import annotations

import gguf.quants
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from ds4mlx.io.quant import (
    DS4_TYPES,
    MLX_EXACT_TYPES,
    NATIVE_TYPES,
    as_qtype,
    byte_shape,
    dequantize,
    ksigns_iq2xs,
    pack_mlx,
    repack_for_mlx,
    row_bytes,
    unpack_mlx,
)
from ds4mlx.io.quantize import quantize

# Offsets of the fp16 fields inside one block, per type.
F16_FIELDS = {
    QT.Q8_0: (0,),
    QT.Q4_0: (0,),
    QT.Q4_1: (0, 2),
    QT.Q5_0: (0,),
    QT.Q5_1: (0, 2),
    QT.Q2_K: (80, 82),
    QT.Q3_K: (108,),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
    QT.IQ2_XXS: (0,),
}


def random_blocks(qtype, shape, rng, scale=0.02):
    """Random GGUF bytes for a tensor of `shape`; fp16 block scales kept finite."""
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    nblocks = int(np.prod(shape)) // elems
    raw = rng.integers(0, 256, size=(nblocks, nbytes), dtype=np.uint8)
    for off in F16_FIELDS.get(qtype, ()):
        v = (rng.standard_normal(nblocks) * scale).astype("<f2")
        raw[:, off : off + 2] = v.view(np.uint8).reshape(nblocks, 2)
    return raw.reshape(byte_shape(qtype, shape))


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# exactness claims are about MLX's CPU kernels; `gpu` tests keep the default device
pytestmark = pytest.mark.usefixtures("cpu_unless_gpu_test")


# ------------------------------------------------------------------ dequantize == gguf-py, bit for bit

ALL_TYPES = sorted(set(NATIVE_TYPES) | {QT.Q3_K, QT.Q5_K, QT.Q6_K, QT.Q5_0, QT.Q5_1}, key=int)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_dequantize_matches_gguf_bit_for_bit(qtype, seed):
    rng = np.random.default_rng(seed)
    shape = (3, 5, 512)
    raw = random_blocks(qtype, shape, rng)
    ours = dequantize(raw, qtype, shape)
    assert ours.shape == shape and ours.dtype == np.float32
    with np.errstate(all="ignore"):
        ref = gguf.quants.dequantize(raw.reshape(15, -1), qtype).reshape(shape)
    assert np.array_equal(bits(ours), bits(ref))


def test_ds4_types_are_native():
    # every type ds4's files use has its own vectorised implementation here
    assert set(DS4_TYPES) <= set(NATIVE_TYPES)
    assert {QT.F32, QT.F16, QT.Q8_0, QT.Q2_K, QT.Q4_K, QT.IQ2_XXS} <= set(DS4_TYPES)


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.IQ2_XXS, QT.Q4_K, QT.Q8_0], ids=lambda t: t.name)
def test_dequantize_accepts_flat_and_byte_shaped_input(qtype):
    rng = np.random.default_rng(3)
    raw = random_blocks(qtype, (4, 256), rng)
    a = dequantize(raw, qtype, (4, 256))
    b = dequantize(raw.reshape(-1), qtype, (4, 256))
    c = dequantize(raw.reshape(2, 2, -1), qtype.name.lower(), [2, 2, 256])
    assert np.array_equal(bits(a), bits(b)) and np.array_equal(bits(a.reshape(2, 2, 256)), bits(c))
    with pytest.raises(ValueError):
        dequantize(raw[:, :-1], qtype, (4, 256))


def test_qtype_names_and_sizes():
    assert as_qtype("iq2_xxs") is QT.IQ2_XXS and as_qtype(12) is QT.Q4_K and as_qtype(QT.Q2_K) is QT.Q2_K
    assert row_bytes(QT.Q2_K, 4096) == 16 * 84 and row_bytes("q4_k", 512) == 288
    assert row_bytes(QT.IQ2_XXS, 2048) == 8 * 66
    with pytest.raises(ValueError):
        row_bytes(QT.Q4_K, 100)
    with pytest.raises(ValueError):
        as_qtype("q9_z")


def test_ksigns_table_has_even_parity():
    k = ksigns_iq2xs()
    assert k.shape == (128,)
    assert all(bin(int(v)).count("1") % 2 == 0 for v in k)
    assert np.array_equal(k & 127, np.arange(128))


# ------------------------------------------------------------------ exact MLX repacks


@pytest.mark.parametrize("qtype", MLX_EXACT_TYPES, ids=lambda t: t.name)
def test_repack_is_exact(qtype):
    import mlx.core as mx

    rng = np.random.default_rng(7)
    shape = (2, 6, 512)
    raw = random_blocks(qtype, shape, rng)
    ref = dequantize(raw, qtype, shape)
    w_q, scales, biases, gs, nbits = repack_for_mlx(raw, qtype, shape)
    assert gs == 32 and w_q.dtype == mx.uint32 and scales.dtype == mx.float32
    assert w_q.shape == (2, 6, 512 * nbits // 32) and scales.shape == biases.shape == (2, 6, 16)
    got = np.array(mx.dequantize(w_q, scales, biases, group_size=gs, bits=nbits))
    # Equal as floats everywhere; bit for bit except the sign of zero: with d < 0,
    # Q8_0 / Q4_0 give -0.0 (d * 0) where MLX gives +0.0 (d*128 + -128*d).
    assert np.array_equal(got, ref)
    nonzero = ref != 0
    assert np.array_equal(bits(got)[nonzero], bits(ref)[nonzero])
    if qtype in (QT.Q4_1, QT.Q4_K):
        assert np.array_equal(bits(got), bits(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", MLX_EXACT_TYPES, ids=lambda t: t.name)
def test_repack_is_exact_on_gpu(qtype):
    import mlx.core as mx

    from ds4mlx.kernels.dispatch import gpu_backend

    if gpu_backend() is None:
        pytest.skip("no MLX GPU backend")
    rng = np.random.default_rng(7)
    shape = (2, 6, 512)
    raw = random_blocks(qtype, shape, rng)
    ref = dequantize(raw, qtype, shape)
    w_q, scales, biases, gs, nbits = repack_for_mlx(raw, qtype, shape)
    got = np.array(mx.dequantize(w_q, scales, biases, group_size=gs, bits=nbits, stream=mx.gpu))
    assert np.array_equal(got, ref)


def test_repack_q4k_quantized_matmul_matches_reference():
    import mlx.core as mx

    rng = np.random.default_rng(8)
    raw = random_blocks(QT.Q4_K, (24, 512), rng)
    ref = dequantize(raw, QT.Q4_K, (24, 512))
    w_q, s, b, gs, nbits = repack_for_mlx(raw, QT.Q4_K, (24, 512))
    x = rng.standard_normal((3, 512)).astype(np.float32)
    got = np.array(mx.quantized_matmul(mx.array(x), w_q, s, b, transpose=True, group_size=gs, bits=nbits))
    want = x @ ref.T
    bound = 1e-5 * (np.abs(x) @ np.abs(ref).T) + 1e-6
    assert np.all(np.abs(got - want) <= bound)


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.IQ2_XXS, QT.Q6_K, QT.Q3_K, QT.F16], ids=lambda t: t.name)
def test_repack_refuses_inexact_types(qtype):
    rng = np.random.default_rng(9)
    raw = random_blocks(qtype, (2, 256), rng)
    assert repack_for_mlx(raw, qtype, (2, 256)) is None


def test_repack_float16_only_when_parameters_are_exact():
    import mlx.core as mx

    rng = np.random.default_rng(10)
    raw = random_blocks(QT.Q8_0, (4, 256), rng)
    r = repack_for_mlx(raw, QT.Q8_0, (4, 256), dtype=mx.float16)
    assert r is not None and r[1].dtype == mx.float16  # d and -128 d are fp16 values
    # Q4_K's d * sc needs up to 17 significant bits: no exact float16 form
    assert repack_for_mlx(random_blocks(QT.Q4_K, (4, 256), rng), QT.Q4_K, (4, 256), dtype=mx.float16) is None
    # float16 parameters are exact, but MLX evaluates scale*q + bias in float16:
    # each value is within two float16 roundings of the reference.
    ref = dequantize(raw, QT.Q8_0, (4, 256))
    got = np.array(mx.dequantize(r[0], r[1], r[2], group_size=32, bits=8).astype(mx.float32))
    s = np.repeat(np.array(r[1].astype(mx.float32)), 32, axis=-1)
    b = np.repeat(np.array(r[2].astype(mx.float32)), 32, axis=-1)
    assert np.all(np.abs(got - ref) <= 2.0**-10 * (np.abs(ref - b) + np.abs(b)))
    del s


@pytest.mark.parametrize("nbits", [2, 4, 8])
def test_pack_mlx_matches_mx_quantize_layout(nbits):
    import mlx.core as mx

    w = mx.random.normal((3, 128), key=mx.random.key(nbits))
    w_q, s, b = mx.quantize(w, group_size=32, bits=nbits)
    q = unpack_mlx(np.array(w_q), nbits)
    assert np.array_equal(pack_mlx(q, nbits), np.array(w_q))
    deq = np.repeat(np.array(s), 32, -1) * q + np.repeat(np.array(b), 32, -1)
    assert np.allclose(deq, np.array(mx.dequantize(w_q, s, b, group_size=32, bits=nbits)), atol=1e-6)


# ------------------------------------------------------------------ quantizers


def test_q8_0_quantize_matches_gguf_bit_for_bit():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((8, 512)) * rng.uniform(0.01, 3, (8, 1))).astype(np.float32)
    x[0, :32] = 0  # an all-zero block
    assert np.array_equal(quantize(x, QT.Q8_0), gguf.quants.quantize(x, QT.Q8_0))


# relative RMS error on Gaussian weights (measured: Q8_0 .005, Q4_0 .087, Q4_1 .079,
# Q4_K .072, Q2_K .30, IQ2_XXS .333); bounds leave a little room.
QUALITY = {QT.Q8_0: 0.007, QT.Q4_0: 0.10, QT.Q4_1: 0.09, QT.Q4_K: 0.08, QT.Q2_K: 0.32, QT.IQ2_XXS: 0.35}


@pytest.mark.parametrize("qtype", list(QUALITY), ids=lambda t: t.name)
def test_quantize_roundtrip_quality(qtype):
    rng = np.random.default_rng(12)
    x = rng.standard_normal((16, 1024)).astype(np.float32) * 0.05
    raw = quantize(x, qtype)
    assert raw.dtype == np.uint8 and raw.shape == byte_shape(qtype, x.shape)
    y = dequantize(raw, qtype, x.shape)
    rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2))
    assert rel < QUALITY[qtype], rel


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q2_K, QT.IQ2_XXS], ids=lambda t: t.name)
def test_quantize_edge_blocks(qtype):
    x = np.zeros((4, 256), dtype=np.float32)
    x[1] = 1.0  # constant
    x[2] = -np.linspace(0.1, 2, 256)  # all negative
    x[3, ::17] = 5.0  # sparse spikes
    raw = quantize(x, qtype)
    y = dequantize(raw, qtype, x.shape)
    assert np.all(np.isfinite(y))
    assert np.array_equal(y[0], np.zeros(256, np.float32))
    for r in (1, 2, 3):
        # IQ2_XXS has no zero level (magnitudes 1, 3.125, 5.375 x scale): the zeros
        # between the spikes of row 3 cost it more
        limit = 0.75 if (qtype == QT.IQ2_XXS and r == 3) else 0.5
        assert np.sqrt(np.mean((y[r] - x[r]) ** 2)) <= limit * np.sqrt(np.mean(x[r] ** 2))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q2_K, QT.IQ2_XXS], ids=lambda t: t.name)
def test_importance_lowers_weighted_error(qtype):
    rng = np.random.default_rng(13)
    x = rng.standard_normal((32, 512)).astype(np.float32)
    imp = np.ones(512, np.float32)
    imp[::4] = 30.0  # every 4th column matters more (it varies inside sub-blocks)
    plain = dequantize(quantize(x, qtype), qtype, x.shape)
    weighted = dequantize(quantize(x, qtype, importance=imp), qtype, x.shape)
    err = lambda y: float(np.sum(imp * (y - x) ** 2))  # noqa: E731
    assert err(weighted) < err(plain)


# ------------------------------------------------------------------ `ds4mlx quantize`


def _tiny_model(path, hidden=256, inter=256, experts=4, seed=0):
    from ds4mlx.io.convert import write_gguf

    rng = np.random.default_rng(seed)
    config = {
        "model_type": "deepseek_v4",
        "vocab_size": 512,
        "hidden_size": hidden,
        "moe_intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "q_lora_rank": 64,
        "o_groups": 1,
        "o_lora_rank": 32,
        "n_routed_experts": experts,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
    }
    tensors = {
        "model.layers.0.mlp.experts.gate_up_proj": rng.standard_normal((experts, 2 * inter, hidden)).astype(np.float32)
        * 0.02,
        "model.layers.0.mlp.experts.down_proj": rng.standard_normal((experts, hidden, inter)).astype(np.float32) * 0.02,
        "model.layers.0.self_attn.q_a_proj.weight": rng.standard_normal((64, hidden)).astype(np.float32) * 0.02,
        "model.layers.0.input_layernorm.weight": np.ones(hidden, np.float32),
    }
    write_gguf(path, config, tensors, tokenizer=False)
    return tensors


@pytest.mark.parametrize(
    "experts,types,limit",
    [
        ("iq2_xxs", (QT.IQ2_XXS, QT.IQ2_XXS, QT.Q2_K), 0.36),
        ("q4_k", (QT.Q4_K,) * 3, 0.08),
        ("mlx4", (QT.Q4_1,) * 3, 0.09),
        ("mlx2", (QT.Q4_1,) * 3, 0.40),
    ],
)
def test_quantize_cli_roundtrip(tmp_path, experts, types, limit):
    import mlx.core as mx

    from ds4mlx.cli.commands import main
    from ds4mlx.io.quant import QuantizedTensor
    from ds4mlx.io.weights import read_weights

    src, dst = tmp_path / "in.gguf", tmp_path / "out.gguf"
    orig = _tiny_model(src)
    extra = ["--dense", "q8_0"] if experts == "q4_k" else []
    assert main(["quantize", str(src), str(dst), "--experts", experts, "-q", *extra]) == 0
    config, tensors, _ = read_weights(dst)
    assert config["hidden_size"] == 256 and config["n_routed_experts"] == 4
    gu = orig["model.layers.0.mlp.experts.gate_up_proj"]
    want = {"gate_proj": gu[:, :256], "up_proj": gu[:, 256:], "down_proj": orig["model.layers.0.mlp.experts.down_proj"]}
    for (part, w), qt in zip(want.items(), types):
        t = tensors[f"model.layers.0.mlp.experts.{part}"]
        assert isinstance(t, QuantizedTensor) and t.qtype == qt and tuple(t.shape) == w.shape
        y = t.dequantize()
        assert np.sqrt(np.mean((y - w) ** 2) / np.mean(w**2)) < limit
        if experts.startswith("mlx"):
            r = repack_for_mlx(t.raw, t.qtype, t.shape, dtype=mx.float16)
            assert r is not None and r[4] == int(experts[-1]) and r[3] == 32
    qa = tensors["model.layers.0.self_attn.q_a_proj.weight"]
    if experts == "q4_k":
        assert isinstance(qa, QuantizedTensor) and qa.qtype == QT.Q8_0
    else:
        assert not isinstance(qa, QuantizedTensor)
    assert np.array_equal(np.asarray(tensors["model.layers.0.input_layernorm.weight"]), np.ones(256, np.float32))


def test_quantize_cli_requantizes_quantized_input(tmp_path):
    from ds4mlx.cli.commands import main
    from ds4mlx.io.weights import read_weights

    src, mid, dst = tmp_path / "in.gguf", tmp_path / "q4.gguf", tmp_path / "q2.gguf"
    _tiny_model(src, seed=1)
    assert main(["quantize", str(src), str(mid), "--experts", "q4_k", "-q"]) == 0
    assert main(["quantize", str(mid), str(dst), "--experts", "q2_k", "--down", "q4_k", "-q"]) == 0
    _, tensors, _ = read_weights(dst)
    assert tensors["model.layers.0.mlp.experts.gate_proj"].qtype == QT.Q2_K
    assert tensors["model.layers.0.mlp.experts.down_proj"].qtype == QT.Q4_K


def test_quantize_cli_errors(tmp_path, capsys):
    from ds4mlx.cli.commands import main

    src = tmp_path / "in.gguf"
    _tiny_model(src, hidden=64, inter=64)
    assert main(["quantize", str(src), str(tmp_path / "o.gguf"), "--experts", "q4_k", "-q"]) == 1
    assert "multiple of 256" in capsys.readouterr().err
    # a broken input is one line + exit 2 on every command (modelfile.py)
    assert main(["quantize", str(tmp_path / "missing.gguf"), str(tmp_path / "o.gguf"), "--experts", "q4_k"]) == 2
    (tmp_path / "exists.gguf").write_bytes(b"")
    assert main(["quantize", str(src), str(tmp_path / "exists.gguf"), "--experts", "q4_k"]) == 1


@pytest.mark.parametrize("name", ["IQ2_XXS", "Q2_K"])
def test_random_block_bytes_are_finite_blocks_of_the_given_scale(name):
    """The file writers' random expert blocks (tools/ssd_bench.py): every block decodes to
    finite values bounded by its f16 scale, and the same seed gives the same bytes."""
    from ds4mlx.io.quant import QT, dequantize, random_block_bytes

    shape = (3, 8, 512)
    raw = random_block_bytes(name, shape, np.random.default_rng(5), scale=1e-3)
    assert raw.dtype == np.uint8 and raw.shape == byte_shape(QT[name], shape)
    assert np.array_equal(raw, random_block_bytes(name, shape, np.random.default_rng(5), scale=1e-3))
    w = dequantize(raw, QT[name], shape)
    assert np.isfinite(w).all() and 0 < np.abs(w).max() < 1e-3 * 256  # IQ2_XXS: |w| <= d * 15.5 / 4 * 43
