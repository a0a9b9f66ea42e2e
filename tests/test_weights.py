"""Weights I/O: HF folder and ds4 GGUF reading, `ds4mlx convert`, name/metadata tables.

Oracle: the tiny transformers deepseek_v4 model (tests/oracle/make_tiny_deepseek_v4.py),
whose model.safetensors holds the HF in-memory names.  Expected GGUF names, ggml
shapes and metadata key types are the ones antirez/ds4 `ds4.c` requires
(`weights_bind`, `weights_validate_layout`, `config_validate_model`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from ds4mlx.gguf_families import deepseek_v4 as names
from ds4mlx.io.convert import write_gguf
from ds4mlx.io.mapped import LazyTensor
from ds4mlx.io.quant import MXTensor, QuantizedTensor
from ds4mlx.io.weights import GGUFFile, SafetensorsFile, read_weights


@pytest.fixture(scope="session")
def oracle_dir() -> Path:
    """The oracle's folder: conftest's cached build of the same script (the parity tests use
    it too; nothing here writes into it)."""
    from conftest import build_oracle

    return build_oracle("make_tiny_deepseek_v4.py")


@pytest.fixture(scope="session")
def oracle(oracle_dir):
    from safetensors.numpy import load_file

    raw_cfg = json.loads((oracle_dir / "config.json").read_text())
    return raw_cfg, load_file(str(oracle_dir / "model.safetensors"))


@pytest.fixture(scope="session")
def converted(oracle_dir, tmp_path_factory) -> Path:
    """The oracle converted with the CLI entry point (default tokenizer, f32)."""
    from ds4mlx.io import convert

    out = tmp_path_factory.mktemp("conv") / "tiny.gguf"
    parser = argparse.ArgumentParser()
    convert.add_arguments(parser)
    assert convert.run(parser.parse_args([str(oracle_dir), str(out)])) == 0
    return out


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _materialize(b):
    """What the loader would read: LazyTensor / MXTensor values in numpy."""
    if isinstance(b, LazyTensor):
        return b.load()
    if isinstance(b, MXTensor):
        return b.dequantize()
    return b


def _assert_same(a, b, key=""):
    b = _materialize(b)
    assert isinstance(b, np.ndarray), key
    assert a.dtype == b.dtype and a.shape == b.shape, (key, a.dtype, b.dtype, a.shape, b.shape)
    assert np.array_equal(_bits(a), _bits(b)), key


# ----------------------------------------------------------------------------- HF folder
def test_read_hf_folder(oracle_dir, oracle):
    raw_cfg, sd = oracle
    cfg, tensors, tok = read_weights(oracle_dir)
    assert tok is None  # the oracle folder has no tokenizer.json
    assert set(tensors) == set(sd)
    for k, v in sd.items():
        _assert_same(v, tensors[k], k)
    assert tensors["model.layers.0.mlp.gate.tid2eid"].dtype == np.int64
    assert cfg == names.normalize_config(raw_cfg)
    for k in (
        "hidden_size",
        "layer_types",
        "mlp_layer_types",
        "compress_rates",
        "rope_parameters",
        "initializer_range",
    ):
        assert cfg[k] == raw_cfg[k], k


def test_normalize_config_matches_transformers(oracle):
    transformers = pytest.importorskip("transformers")
    raw_cfg, _ = oracle
    legacy = {
        "model_type": "deepseek_v4",
        "num_hidden_layers": 43,
        "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
        "num_hash_layers": 3,
        "qk_rope_head_dim": 64,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8"},
    }
    for raw in (raw_cfg, legacy):
        ref = transformers.DeepseekV4Config(**raw).to_dict()
        ours = names.normalize_config(raw)
        for k in names.CONFIG_FIELDS:
            want = ref[k]
            if k == "rope_parameters":
                want = {t: {a: b for a, b in d.items() if a != "type"} for t, d in want.items()}
            assert ours[k] == want, k


# ----------------------------------------------------------------------------- GGUF round trip
def test_convert_roundtrip_bit_identical(converted, oracle_dir, oracle):
    raw_cfg, sd = oracle
    cfg_hf, t_hf, _ = read_weights(oracle_dir)
    cfg, tensors, tok = read_weights(converted)
    assert set(tensors) == set(sd)
    for k, v in sd.items():
        _assert_same(v, tensors[k], k)
    assert cfg == cfg_hf
    from ds4mlx.runtime.tokenizer import Tokenizer

    d = Tokenizer.default()
    assert tok is not None and tok.tokens == d.tokens and tok.special_ids == d.special_ids
    text = "<｜User｜>hi 你好</｜DSML｜parameter>  x"
    assert tok.encode(text) == d.encode(text)


def test_gguf_tensors_are_mmap_views(converted):
    _, tensors, _ = read_weights(converted, with_tokenizer=False)
    w = tensors["model.layers.0.self_attn.q_a_proj.weight"]
    assert not w.flags.owndata and not w.flags.writeable
    emb = tensors["model.embed_tokens.weight"]
    assert not emb.flags.owndata


EXPECTED_LAYER = (
    "hc_attn_fn hc_attn_scale hc_attn_base attn_norm attn_q_a attn_q_a_norm attn_q_b attn_kv attn_kv_a_norm "
    "attn_sinks attn_output_a attn_output_b hc_ffn_fn hc_ffn_scale hc_ffn_base ffn_norm ffn_gate_inp "
    "ffn_gate_exps ffn_up_exps ffn_down_exps ffn_gate_shexp ffn_up_shexp ffn_down_shexp"
).split()
COMPRESSOR = "attn_compressor_ape attn_compressor_kv attn_compressor_gate attn_compressor_norm".split()
INDEXER = (
    "indexer.attn_q_b indexer.proj indexer_compressor_ape indexer_compressor_kv "
    "indexer_compressor_gate indexer_compressor_norm"
).split()


def test_gguf_names_and_shapes_are_ds4s(converted, oracle):
    """Tensor names (ds4.c weights_bind) and ggml ne (ds4.c weights_validate_layout)."""
    raw_cfg, _ = oracle
    c = names.normalize_config(raw_cfg)
    g = GGUFFile(converted)
    H, V, hc = c["hidden_size"], c["vocab_size"], c["hc_mult"]
    hc_dim, mix = H * hc, 2 * hc + hc * hc
    hd, nh, E, I = c["head_dim"], c["num_attention_heads"], c["n_routed_experts"], c["moe_intermediate_size"]
    ql, og, ol = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    ne = {n: ti.ne for n, ti in g.tensors.items()}
    types = {n: ti.ggml_type.name for n, ti in g.tensors.items()}
    expected = {
        "token_embd.weight": (H, V),
        "output_hc_base.weight": (hc,),
        "output_hc_fn.weight": (hc_dim, hc),
        "output_hc_scale.weight": (1,),
        "output_norm.weight": (H,),
        "output.weight": (H, V),
    }
    for i, (lt, mt) in enumerate(zip(c["layer_types"], c["mlp_layer_types"])):
        b = f"blk.{i}."
        ratio = {names.SWA: 0, **c["compress_rates"]}[lt]
        coff = 2 if ratio == 4 else 1  # ds4: ratio-4 (CSA) compressors are twice as wide
        expected.update(
            {
                b + "hc_attn_fn.weight": (hc_dim, mix),
                b + "hc_attn_scale.weight": (3,),
                b + "hc_attn_base.weight": (mix,),
                b + "attn_norm.weight": (H,),
                b + "attn_q_a.weight": (H, ql),
                b + "attn_q_a_norm.weight": (ql,),
                b + "attn_q_b.weight": (ql, nh * hd),
                b + "attn_kv.weight": (H, hd),
                b + "attn_kv_a_norm.weight": (hd,),
                b + "attn_sinks.weight": (nh,),
                b + "attn_output_a.weight": (hd * (nh // og), og * ol),
                b + "attn_output_b.weight": (og * ol, H),
                b + "hc_ffn_fn.weight": (hc_dim, mix),
                b + "hc_ffn_scale.weight": (3,),
                b + "hc_ffn_base.weight": (mix,),
                b + "ffn_norm.weight": (H,),
                b + "ffn_gate_inp.weight": (H, E),
                b + "ffn_gate_exps.weight": (H, I, E),
                b + "ffn_up_exps.weight": (H, I, E),
                b + "ffn_down_exps.weight": (I, H, E),
                b + "ffn_gate_shexp.weight": (H, I),
                b + "ffn_up_shexp.weight": (H, I),
                b + "ffn_down_shexp.weight": (I, H),
            }
        )
        if ratio:
            w = coff * hd
            expected.update(
                {
                    b + "attn_compressor_ape.weight": (w, ratio),
                    b + "attn_compressor_kv.weight": (H, w),
                    b + "attn_compressor_gate.weight": (H, w),
                    b + "attn_compressor_norm.weight": (hd,),
                }
            )
        if lt == names.CSA:
            ih, idim = c["index_n_heads"], c["index_head_dim"]
            expected.update(
                {
                    b + "indexer.attn_q_b.weight": (ql, ih * idim),
                    b + "indexer.proj.weight": (H, ih),
                    b + "indexer_compressor_ape.weight": (2 * idim, ratio),
                    b + "indexer_compressor_kv.weight": (H, 2 * idim),
                    b + "indexer_compressor_gate.weight": (H, 2 * idim),
                    b + "indexer_compressor_norm.weight": (idim,),
                }
            )
        if mt == "hash_moe":
            expected[b + "ffn_gate_tid2eid.weight"] = (c["num_experts_per_tok"], V)
        else:
            expected[b + "exp_probs_b.bias"] = (E,)
    assert ne == expected
    assert types["blk.0.ffn_gate_tid2eid.weight"] == "I32"
    assert {t for n, t in types.items() if "tid2eid" not in n} == {"F32"}


def test_gguf_metadata_keys_and_types(oracle):
    """Every key ds4.c config_validate_model reads, with the GGUF type it accepts."""
    gguf = pytest.importorskip("gguf")
    raw_cfg, sd = oracle
    meta = _check_metadata_types(gguf, names.normalize_config(raw_cfg), sd)
    assert meta["deepseek4.attention.compress_ratios"] == [0, 4, 8, 4]
    assert meta["deepseek4.hash_layer_count"] == 2


def _check_metadata_types(gguf, cfg, sd):
    import tempfile

    V = gguf.GGUFValueType
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.gguf"
        write_gguf(p, cfg, sd, tokenizer=False)
        r = gguf.GGUFReader(str(p))
        fields = {k: f for k, f in r.fields.items()}
        u32 = (
            "block_count embedding_length vocab_size attention.head_count attention.head_count_kv "
            "attention.key_length attention.value_length rope.dimension_count attention.q_lora_rank "
            "attention.output_lora_rank attention.output_group_count expert_count expert_used_count "
            "expert_feed_forward_length expert_shared_count hash_layer_count attention.sliding_window "
            "attention.indexer.head_count attention.indexer.key_length attention.indexer.top_k "
            "hyper_connection.count hyper_connection.sinkhorn_iterations"
        ).split()
        f32 = (
            "rope.freq_base rope.scaling.factor rope.scaling.yarn_beta_fast rope.scaling.yarn_beta_slow "
            "attention.compress_rope_freq_base expert_weights_scale attention.layer_norm_rms_epsilon "
            "hyper_connection.epsilon"
        ).split()
        for k in u32:
            assert fields[f"deepseek4.{k}"].types == [V.UINT32], k
        for k in f32:
            assert fields[f"deepseek4.{k}"].types == [V.FLOAT32], k
        assert fields["deepseek4.expert_weights_norm"].types == [V.BOOL]
        assert fields["deepseek4.attention.compress_ratios"].types == [V.ARRAY, V.INT32]
        assert fields["deepseek4.swiglu_clamp_exp"].types == [V.ARRAY, V.FLOAT32]
        assert fields["deepseek4.rope.scaling.original_context_length"].types[0] in (V.UINT32, V.UINT64)
        assert fields["general.architecture"].contents() == "deepseek4"
        return {k: f.contents() for k, f in fields.items() if not k.startswith("GGUF.")}


def test_flash_config_metadata_values_match_ds4_constants():
    """A DeepSeek-V4-Flash hub config.json maps to exactly the values ds4.c
    config_validate_model / validate_compress_ratio_metadata expect."""
    flash = {
        "model_type": "deepseek_v4",
        "vocab_size": 129280,
        "hidden_size": 4096,
        "num_hidden_layers": 43,
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "n_routed_experts": 256,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "num_hash_layers": 3,
        "sliding_window": 128,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
        "qk_rope_head_dim": 64,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "max_position_embeddings": 1048576,
        "scoring_func": "sqrtsoftplus",
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    }
    kv = {k: v for k, v, _ in names.config_to_gguf_kv(flash)}
    want = {
        "block_count": 43,
        "embedding_length": 4096,
        "vocab_size": 129280,
        "attention.head_count": 64,
        "attention.key_length": 512,
        "attention.head_count_kv": 1,
        "attention.value_length": 512,
        "rope.dimension_count": 64,
        "attention.output_group_count": 8,
        "attention.q_lora_rank": 1024,
        "attention.output_lora_rank": 1024,
        "expert_count": 256,
        "expert_used_count": 6,
        "expert_feed_forward_length": 2048,
        "expert_shared_count": 1,
        "hash_layer_count": 3,
        "attention.sliding_window": 128,
        "attention.indexer.head_count": 64,
        "attention.indexer.key_length": 128,
        "attention.indexer.top_k": 512,
        "hyper_connection.count": 4,
        "hyper_connection.sinkhorn_iterations": 20,
        "rope.scaling.original_context_length": 65536,
        "rope.freq_base": 10000.0,
        "rope.scaling.factor": 16.0,
        "rope.scaling.yarn_beta_fast": 32.0,
        "rope.scaling.yarn_beta_slow": 1.0,
        "attention.compress_rope_freq_base": 160000.0,
        "expert_weights_scale": 1.5,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "hyper_connection.epsilon": 1e-6,
        "expert_weights_norm": True,
        "expert_gating_func": 4,
    }
    for k, v in want.items():
        assert kv[f"deepseek4.{k}"] == v, k
    # ds4.c ds4_layer_compress_ratio: 0 for il < 2, then 4 (even) / 128 (odd)
    assert kv["deepseek4.attention.compress_ratios"] == [0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(43)]
    assert kv["deepseek4.swiglu_clamp_exp"] == [10.0] * 43
    assert names.OVERRIDES_KEY not in kv  # everything fits ds4's own keys
    # and back
    meta = {k: (names.to_f32(v) if isinstance(v, float) else v) for k, v in kv.items()}
    assert names.config_from_gguf_kv(meta) == names.normalize_config(flash)


def test_dtype_f16_bf16(oracle, tmp_path):
    raw_cfg, sd = oracle
    torch = pytest.importorskip("torch")
    for dt in ("f16", "bf16"):
        p = tmp_path / f"{dt}.gguf"
        write_gguf(p, raw_cfg, sd, tokenizer=False, dtype=dt)
        _, t, _ = read_weights(p)
        g = GGUFFile(p)
        for k, v in sd.items():
            got = t[k]
            if v.dtype == np.int64:
                _assert_same(v, got, k)
            elif v.ndim < 2:
                _assert_same(v, got, k)  # 1-D stays F32
            elif dt == "f16":
                _assert_same(v.astype(np.float16), got, k)
            else:
                want = torch.from_numpy(np.ascontiguousarray(v)).to(torch.bfloat16).float().numpy()
                _assert_same(want, got, k)
        tname = "blk.0.attn_q_a.weight"
        assert g.tensors[tname].ggml_type.name == dt.upper()


def test_quantized_tensors_roundtrip(oracle, tmp_path):
    """QuantizedTensor values are written as their bytes and read back as views;
    quantized experts come back split (gate_proj / up_proj)."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    raw_cfg, sd = oracle
    Q = gguf.GGMLQuantizationType.Q8_0
    tensors = dict(sd)
    qexp = {}
    for i in range(raw_cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}.mlp.experts."
        gu = tensors.pop(pre + "gate_up_proj")
        half = gu.shape[1] // 2
        for name, arr in (
            ("gate_proj", gu[:, :half]),
            ("up_proj", gu[:, half:]),
            ("down_proj", tensors[pre + "down_proj"]),
        ):
            arr = np.ascontiguousarray(arr)
            q = QuantizedTensor(raw=quantize(arr, Q), qtype=Q, shape=arr.shape)
            tensors[pre + name] = qexp[pre + name] = q
    q_attn = np.ascontiguousarray(sd["model.layers.1.self_attn.q_b_proj.weight"])
    tensors["model.layers.1.self_attn.q_b_proj.weight"] = qexp["model.layers.1.self_attn.q_b_proj.weight"] = (
        QuantizedTensor(raw=quantize(q_attn, Q), qtype=Q, shape=q_attn.shape)
    )
    p = tmp_path / "q.gguf"
    write_gguf(p, raw_cfg, tensors, tokenizer=False)
    _, back, _ = read_weights(p)
    for k, q in qexp.items():
        got = back[k]
        assert isinstance(got, QuantizedTensor), k
        assert got.qtype == Q and tuple(got.shape) == tuple(q.shape), k
        assert np.array_equal(got.raw, q.raw), k
        assert not got.raw.flags.owndata
        ref = dequantize(q.raw, Q)
        try:
            deq = got.dequantize()
        except ImportError:
            pytest.skip("ds4mlx.io.quant not available")
        assert deq.dtype == np.float32 and deq.shape == tuple(q.shape)
        assert np.array_equal(deq, ref), k
    assert not any(k.endswith("gate_up_proj") for k in back)


# ----------------------------------------------------------------------------- hub naming
def _hub_name(hf: str) -> str:
    for h, _, c in names.TOP_LEVEL:
        if h == hf:
            return c
    i, rest = hf[len("model.layers.") :].split(".", 1)
    for h, _, c in names.LAYER:
        if h == rest:
            return f"layers.{i}.{c}"
    raise KeyError(hf)


def test_hub_checkpoint_naming_sharded(oracle_dir, oracle, tmp_path):
    """deepseek-ai hub names (per-expert w1/w2/w3, attn.wq_a, ...), sharded with an
    index: renamed, experts stacked and fused, MTP kept."""
    from safetensors.numpy import save_file

    raw_cfg, sd = oracle
    hub = {}
    for k, v in sd.items():
        if k.endswith("gate_up_proj") or k.endswith("experts.down_proj"):
            i = k.split(".")[2]
            if k.endswith("gate_up_proj"):
                half = v.shape[1] // 2
                for x in range(v.shape[0]):
                    hub[f"layers.{i}.ffn.experts.{x}.w1.weight"] = np.ascontiguousarray(v[x, :half])
                    hub[f"layers.{i}.ffn.experts.{x}.w3.weight"] = np.ascontiguousarray(v[x, half:])
            else:
                for x in range(v.shape[0]):
                    hub[f"layers.{i}.ffn.experts.{x}.w2.weight"] = np.ascontiguousarray(v[x])
            continue
        hub[_hub_name(k)] = v
    hub["mtp.0.enorm.weight"] = np.ones(4, np.float32)
    keys = sorted(hub)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for fn, ks in shards.items():
        save_file({k: hub[k] for k in ks}, str(tmp_path / fn))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: fn for fn, ks in shards.items() for k in ks}})
    )
    (tmp_path / "config.json").write_text(json.dumps(raw_cfg))
    cfg, tensors, _ = read_weights(tmp_path)
    assert set(tensors) == set(sd) | {"mtp.0.enorm.weight"}  # MTP kept for speculative decoding
    for k, v in sd.items():
        _assert_same(v, tensors[k], k)
    _assert_same(hub["mtp.0.enorm.weight"], tensors["mtp.0.enorm.weight"])


@pytest.mark.parametrize("with_f64", [False, True])
def test_hf_folder_bf16_fp8(oracle, tmp_path, with_f64):
    """BF16 tensors come back as float32, an FP8 E4M3 weight with its UE8M0
    `.scale` is dequantized (numpy has neither dtype: the bits are read through
    mlx, or, when the file holds F64 that mlx cannot load, safetensors.deserialize)."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("torch without float8_e8m0fnu")
    from safetensors.torch import save_file

    raw_cfg, sd = oracle
    fp8 = "model.layers.1.self_attn.q_b_proj.weight"
    out = {}
    want = {}
    for k, v in sd.items():
        t = torch.from_numpy(np.ascontiguousarray(v))
        if k == fp8:
            q = t.to(torch.float8_e4m3fn)
            rows, cols = -(-v.shape[0] // 128), -(-v.shape[1] // 128)
            e = torch.arange(rows * cols, dtype=torch.uint8).reshape(rows, cols) + 125
            out[k], out[k[: -len(".weight")] + ".scale"] = q, e.view(torch.float8_e8m0fnu)
            s = np.repeat(np.repeat(2.0 ** (e.numpy().astype(np.float32) - 127), 128, 0), 128, 1)
            want[k] = q.float().numpy() * s[: v.shape[0], : v.shape[1]]
        elif v.dtype == np.float32 and v.ndim >= 2:
            out[k] = t.to(torch.bfloat16)
            want[k] = out[k].float().numpy()
        else:
            out[k], want[k] = t, v
    if with_f64:
        out["extra.unused"] = torch.zeros(3, dtype=torch.float64)
    save_file(out, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(raw_cfg))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the extra F64 tensor is skipped with a warning
        _, tensors, _ = read_weights(tmp_path)
    assert set(tensors) == set(sd)
    for k, v in want.items():
        _assert_same(v, tensors[k], k)


def test_fp8_fp4_dequant():
    torch = pytest.importorskip("torch")
    from ds4mlx.io.weights import dequant_fp4, dequant_fp8

    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 384)).astype(np.float32) * 3
    q = torch.from_numpy(w).to(torch.float8_e4m3fn)
    scale_e = rng.integers(120, 134, size=(2, 3)).astype(np.uint8)  # UE8M0
    got = dequant_fp8(q.view(torch.uint8).numpy(), scale_e)
    s = np.repeat(np.repeat(2.0 ** (scale_e.astype(np.float32) - 127), 128, 0), 128, 1)
    assert np.array_equal(got, q.float().numpy() * s)

    codes = rng.integers(0, 16, size=(4, 64)).astype(np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.int8)
    sc = rng.integers(125, 130, size=(4, 2)).astype(np.uint8)
    table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    want = table[codes] * np.repeat(2.0 ** (sc.astype(np.float32) - 127), 32, 1)
    assert np.array_equal(dequant_fp4(packed, sc), want)


# ----------------------------------------------------------------------------- errors
def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 definitely not gguf" * 10)
    with pytest.raises(ValueError, match="not a GGUF"):
        read_weights(p)
    e = tmp_path / "empty.gguf"
    e.write_bytes(b"")
    with pytest.raises(ValueError, match="not a GGUF"):
        read_weights(e)


def test_truncated_gguf(converted, tmp_path):
    data = converted.read_bytes()
    for cut in (10, 200, len(data) // 3, len(data) - 100):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="truncated|corrupt"):
            read_weights(p)


def test_wrong_arch_gguf(tmp_path):
    import gguf

    p = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'llama'"):
        read_weights(p)


def test_folder_errors(tmp_path, oracle):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_weights(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_weights(tmp_path / "missing")
    (tmp_path / "config.json").write_text(json.dumps(oracle[0]))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        read_weights(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 20)
    with pytest.raises(ValueError, match="safetensors"):
        read_weights(tmp_path)
    (tmp_path / "config.json").write_text("{bad json")
    with pytest.raises(ValueError, match="invalid JSON"):
        read_weights(tmp_path)


def test_truncated_safetensors(oracle_dir, tmp_path):
    import shutil

    shutil.copy(oracle_dir / "config.json", tmp_path / "config.json")
    data = (oracle_dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        read_weights(tmp_path)
    assert SafetensorsFile(oracle_dir / "model.safetensors").keys()


def test_cli_convert_errors(tmp_path, capsys):
    from ds4mlx.cli.commands import main

    assert main(["convert", str(tmp_path), str(tmp_path / "o.gguf")]) == 2  # a broken input: exit 2 (#28)
    err = capsys.readouterr().err
    assert "no config.json" in err
    assert not (tmp_path / "o.gguf").exists()


def test_cli_convert_refuses_overwrite(converted, oracle_dir, capsys):
    from ds4mlx.cli.commands import main

    assert main(["convert", str(oracle_dir), str(converted)]) == 1
    assert "exists" in capsys.readouterr().err


def test_write_rejects_unknown_tensor(oracle, tmp_path):
    raw_cfg, sd = oracle
    with pytest.raises(ValueError, match="no ds4 GGUF name"):
        write_gguf(tmp_path / "u.gguf", raw_cfg, {**sd, "model.foo.weight": np.zeros(3, np.float32)}, tokenizer=False)
    assert not (tmp_path / "u.gguf").exists()


def test_name_tables_are_bijective():
    hf = [h for h, _, _ in names.TOP_LEVEL] + [f"model.layers.7.{h}" for h, _, _ in names.LAYER]
    g = [names.hf_to_gguf(h) for h in hf]
    assert None not in g and len(set(g)) == len(g)
    assert [names.gguf_to_hf(x) for x in g] == hf
    for h, _, c in names.LAYER:
        if c is not None:
            assert names.hub_to_hf(f"layers.7.{c}") == f"model.layers.7.{h}"
    assert names.hf_to_gguf("model.layers.3.mlp.experts.gate_up_proj") is None


def test_reader_array_fast_path_gives_the_librarys_fields(tmp_path):
    """`_GGUFReader` parses arrays of strings / scalars in one pass: the same fields (offsets,
    parts as views of the same bytes, data indices, types) as gguf's per-element recursion."""
    import gguf

    from ds4mlx.io import weights

    class LibraryParse(weights._GGUFReader):
        _get_field_parts = gguf.GGUFReader._get_field_parts

    path = tmp_path / "a.gguf"
    w = gguf.GGUFWriter(str(path), "deepseek4")
    w.add_array("t.strings", ["", "a", "héllo", "x" * 300])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_string("t.one", "one")
    w.add_tensor("w", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got, want = weights._GGUFReader(path), LibraryParse(path)
    assert list(got.fields) == list(want.fields)
    for k, g in got.fields.items():
        f = want.fields[k]
        assert (g.offset, g.name, g.data, g.types) == (f.offset, f.name, f.data, f.types), k
        assert len(g.parts) == len(f.parts), k
        for a, b in zip(g.parts, f.parts):
            assert (type(a), a.dtype, a.shape, a.tobytes()) == (type(b), b.dtype, b.shape, b.tobytes()), k
            base_a, base_b = (r._mapped.__array_interface__["data"][0] for r in (got, want))
            assert a.__array_interface__["data"][0] - base_a == b.__array_interface__["data"][0] - base_b, k
    assert got.fields["t.strings"].contents() == ["", "a", "héllo", "x" * 300]
    assert got.fields["t.ints"].contents() == [1, -2, 3] and "t.nested" in got.fields
