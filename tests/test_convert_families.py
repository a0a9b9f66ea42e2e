"""`ds4mlx convert` and `ds4mlx.load` for the families other than DeepSeek V4.

Each family's demo HF folder (`ds4mlx.io.demo.demo_model_path`) is converted to a GGUF by
the CLI; the GGUF must load into a model whose float32 logits equal the HF folder's
bit for bit, and its metadata must give back the config.  The tensor layouts that ds4's
converters define (gguf-tools/deepseek41_quantize.py, glm53_quantize.py,
qwen38_quantize.py; llama.cpp's GLM-DSA for glm-dsa) are checked against the HF
arrays directly, and the family keys alone (without the config JSON, as in a GGUF
written by ds4) must rebuild the same model.  The tiny transformers oracles add the
variants the demos lack (attention biases, YaRN rope, tied embeddings, a sigmoid
output gate); they are used when cached or buildable, skipped otherwise.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import ds4mlx
from ds4mlx import gguf_families
from ds4mlx.cli.commands import main
from ds4mlx.gguf_families.base import (
    deinterleave_join,
    deinterleave_split,
    kv_b_join,
    kv_b_split,
    plus_one_join,
    plus_one_split,
    row_parts,
)
from ds4mlx.io.convert import write_gguf
from ds4mlx.io.demo import demo_model_path
from ds4mlx.io.weights import GGUFFile, read_weights

ARCH = {"deepseek_v41": "deepseek41", "glm_moe_dsa": "glm-dsa", "glm5_next": "glm5-next", "qwen4_exp": "qwen38-next"}
IDS = [0, 1, 5, 42, 100, 2000, 7, 129279, 3, 3, 17]  # a few tokens (the demos use the 129280-token vocabulary)
ORACLE_IDS = [0, 1, 5, 42, 100, 200, 7, 511, 3, 3, 17]  # the oracles have 512 tokens
ORACLES = [("make_tiny_glm_moe_dsa.py", "alt"), ("make_tiny_glm5_next.py", None), ("make_tiny_qwen4_exp.py", "long")]

_CONVERTED: dict = {}
_LOGITS: dict = {}
_GGUF: dict = {}


# end to end (servers, several processes or models, whole files): the slow tier, which CI runs second
pytestmark = pytest.mark.slow


def _gguf(path: Path) -> GGUFFile:
    """One parse per file (the header holds the 129k-token vocabulary)."""
    if str(path) not in _GGUF:
        _GGUF[str(path)] = GGUFFile(path)
    return _GGUF[str(path)]


def _convert(src: Path, out: Path, *extra: str) -> Path:
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=UserWarning, module=r"ds4mlx\.")  # nothing skipped
        assert main(["convert", str(src), str(out), *extra]) == 0
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (demo HF folder, its GGUF written by the CLI), built once per module."""

    def get(family: str) -> tuple[Path, Path]:
        if family not in _CONVERTED:
            src = Path(demo_model_path(family, quiet=True))
            out = tmp_path_factory.mktemp(f"conv_{family}") / f"{family}.gguf"
            _CONVERTED[family] = (src, _convert(src, out))
        return _CONVERTED[family]

    return get


def _hf_logits(src: Path, ids=IDS) -> np.ndarray:
    key = (str(src), tuple(ids))
    if key not in _LOGITS:
        model, _ = ds4mlx.load(src)
        _LOGITS[key] = model.logits(ids)
    return _LOGITS[key]


def _derived_logits(gguf: Path, ids) -> np.ndarray:
    """Logits of the model built from the family keys alone (the config JSON dropped)."""
    from ds4mlx.models.base import LanguageModel

    g = _gguf(gguf)
    fam = gguf_families.for_arch(g.metadata["general.architecture"])
    derived = fam.config_from_kv({k: v for k, v in g.metadata.items() if k != fam.config_key}, list(g.tensors))
    tensors, unknown = fam.from_gguf(derived, list(g.tensors), g.tensor)
    assert not unknown
    return LanguageModel.from_config(derived, tensors, dtype=mx.float32).logits(ids)


# ----------------------------------------------------------------------------- demo models
@pytest.mark.parametrize("family", list(ARCH))
def test_demo_gguf_logits_equal_hf_folder(family, converted):
    src, gguf = converted(family)
    model, tok = ds4mlx.load(gguf)
    assert model.config["model_type"] == json.loads((src / "config.json").read_text())["model_type"]
    assert {p.dtype for p in _float_params(model)} == {mx.float32}
    got = model.logits(IDS)
    want = _hf_logits(src)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got, want), f"max |diff| {np.abs(got - want).max()}"
    from ds4mlx.runtime.tokenizer import Tokenizer

    assert tok.encode("hello <think>") == Tokenizer.from_file(src / "tokenizer.json").encode("hello <think>")


def _float_params(model):
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(model.model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]


@pytest.mark.parametrize("family", list(ARCH))
def test_demo_gguf_metadata_round_trips_config(family, converted):
    src, gguf = converted(family)
    want = json.loads((src / "config.json").read_text())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=UserWarning, module=r"ds4mlx\.")  # every tensor has a name
        config, tensors, _ = read_weights(gguf)
    assert config == want
    meta = _gguf(gguf).metadata
    fam = gguf_families.for_arch(meta["general.architecture"])
    assert meta["general.architecture"] == ARCH[family] and fam.name == family
    assert json.loads(meta[fam.config_key]) == want
    n = want["num_hidden_layers"]
    count_key = "deepseek41.num_hidden_layers" if family == "deepseek_v41" else f"{ARCH[family]}.block_count"
    assert meta[count_key] == n
    names = list(_gguf(gguf).tensors)
    assert all(len(x.encode()) < 64 for x in names)
    assert all(fam.gguf_to_hf(x) is not None for x in names)
    assert {k for k in tensors if k.startswith("model.layers.")} and "model.embed_tokens.weight" in tensors


@pytest.mark.parametrize("family", list(ARCH))
def test_family_keys_alone_rebuild_the_demo_model(family, converted):
    """A GGUF without the config JSON (as ds4 writes them) still describes the model."""
    src, gguf = converted(family)
    assert np.array_equal(_derived_logits(gguf, IDS), _hf_logits(src))


# ----------------------------------------------------------------------------- ds4's layouts
def _hf(src: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(src / "model.safetensors"))


def _g(gguf: Path, name: str) -> np.ndarray:
    return np.asarray(_gguf(gguf).tensor(name))


def test_deepseek41_layout(converted):
    """deepseek41_quantize.py build_plan: names, 2-D attn_output_a, per-part expert banks."""
    src, gguf = converted("deepseek_v41")
    hf = _hf(src)
    o_a = hf["model.layers.1.self_attn.o_a_proj.weight"]  # mlx-lm [G, out, in]
    assert np.array_equal(_g(gguf, "blk.1.attn_output_a.weight"), o_a.reshape(-1, o_a.shape[-1]))
    assert np.array_equal(_g(gguf, "blk.1.indexer.attn_k.weight"), hf["model.layers.1.self_attn.indexer.k_proj.weight"])
    assert np.array_equal(
        _g(gguf, "blk.2.ffn_up_exps.weight"), hf["model.layers.2.mlp.experts.switch_mlp.up_proj.weight"]
    )
    assert np.array_equal(_g(gguf, "blk.0.hc_attn_fn.weight"), hf["model.layers.0.attn_hc.fn"])
    meta = _gguf(gguf).metadata
    assert meta["deepseek41.compress_ratios"] == [0, 4, 4, 4] and meta["deepseek41.kv_source_layer_ids"] == [1]
    assert meta["deepseek41.rope_scaling.factor"] == 16.0


def _kv_b_parts(kv_b: np.ndarray, heads: int, nope: int):
    per = kv_b.reshape(heads, -1, kv_b.shape[1])
    return per[:, :nope].transpose(0, 2, 1), per[:, nope:]


def test_glm_dsa_layout(converted):
    """llama.cpp / ds4 glm-dsa: kv_b split into attn_k_b [H, r, nope] and attn_v_b [H, v, r]."""
    src, gguf = converted("glm_moe_dsa")
    hf, cfg = _hf(src), json.loads((src / "config.json").read_text())
    k_b, v_b = _kv_b_parts(
        hf["model.layers.0.self_attn.kv_b_proj.weight"], cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
    )
    assert np.array_equal(_g(gguf, "blk.0.attn_k_b.weight"), k_b)
    assert np.array_equal(_g(gguf, "blk.0.attn_v_b.weight"), v_b)
    assert np.array_equal(
        _g(gguf, "blk.0.attn_kv_a_mqa.weight"), hf["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    )
    assert np.array_equal(_g(gguf, "blk.0.indexer.k_norm.bias"), hf["model.layers.0.self_attn.indexer.k_norm.bias"])
    gu = hf["model.layers.1.mlp.experts.gate_up_proj"]
    assert np.array_equal(_g(gguf, "blk.1.ffn_up_exps.weight"), gu[:, gu.shape[1] // 2 :])
    assert np.array_equal(_g(gguf, "blk.0.ffn_gate.weight"), hf["model.layers.0.mlp.gate_proj.weight"])
    meta = _gguf(gguf).metadata
    assert meta["glm-dsa.attention.key_length_mla"] == cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    assert (
        meta["glm-dsa.leading_dense_block_count"] == 1
        and meta["glm-dsa.attention.indexer.types"] == cfg["indexer_types"]
    )


def test_glm5_next_layout(converted):
    """glm53_quantize.py: kda_* (conv split q/k/v), o_proj by layer type, pooled indexer."""
    src, gguf = converted("glm5_next")
    hf, cfg = _hf(src), json.loads((src / "config.json").read_text())
    c = cfg["linear_num_heads"] * cfg["linear_head_dim"]
    conv = hf["model.layers.0.self_attn.conv1d.weight"]  # [3C, 1, K]
    for i, part in enumerate(("q", "k", "v")):
        assert np.array_equal(_g(gguf, f"blk.0.kda_{part}_conv.weight"), conv[i * c : (i + 1) * c])
    assert np.array_equal(_g(gguf, "blk.0.kda_output.weight"), hf["model.layers.0.self_attn.o_proj.weight"])
    assert np.array_equal(_g(gguf, "blk.1.attn_output.weight"), hf["model.layers.1.self_attn.o_proj.weight"])
    assert np.array_equal(_g(gguf, "blk.0.kda_dt_bias.weight"), hf["model.layers.0.self_attn.forget_gate.dt_bias"])
    assert np.array_equal(
        _g(gguf, "blk.1.indexer.pool_ape.weight"), hf["model.layers.1.self_attn.indexer.index_kpool_compress_ape"]
    )
    k_b, _ = _kv_b_parts(
        hf["model.layers.1.self_attn.kv_b_proj.weight"], cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
    )
    assert np.array_equal(_g(gguf, "blk.1.attn_k_b.weight"), k_b)
    meta = _gguf(gguf).metadata
    assert meta["glm5-next.layer_types"] == [0, 1, 1, 0] and meta["glm5-next.attention.indexer.pool_size"] == 16


def test_qwen38_next_layout(converted):
    """qwen38_quantize.py: q/gate de-interleaved, GDN qkv and conv split, norms stored as 1 + w."""
    src, gguf = converted("qwen4_exp")
    hf, cfg = _hf(src), json.loads((src / "config.json").read_text())
    nh, d = cfg["num_attention_heads"], cfg["head_dim"]
    qg = hf["model.layers.3.self_attn.q_proj.weight"].reshape(nh, 2 * d, -1)
    assert np.array_equal(_g(gguf, "blk.3.attn_q.weight"), qg[:, :d].reshape(nh * d, -1))
    assert np.array_equal(_g(gguf, "blk.3.attn_gate.weight"), qg[:, d:].reshape(nh * d, -1))
    k = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    qkv = hf["model.layers.0.linear_attn.in_proj_qkv.weight"]
    assert np.array_equal(_g(gguf, "blk.0.kda_k.weight"), qkv[k : 2 * k])
    assert np.array_equal(_g(gguf, "blk.0.kda_v_conv.weight"), hf["model.layers.0.linear_attn.conv1d.weight"][2 * k :])
    w = hf["model.layers.0.attn_hyper_connection.hc_norm.weight"]
    assert np.array_equal(_g(gguf, "blk.0.hc_attn_norm.weight"), w + np.float32(1))
    assert np.array_equal(_g(gguf, "output_hc_norm.weight"), hf["model.hyper_connection_mixer.hc_norm.weight"] + 1)
    assert np.array_equal(_g(gguf, "blk.0.kda_o_norm.weight"), hf["model.layers.0.linear_attn.norm.weight"])  # plain
    assert _g(gguf, "blk.0.ffn_gate_inp_shexp.weight").shape == (cfg["hidden_size"],)
    assert np.array_equal(
        _g(gguf, "blk.0.ple_token_embd.weight"), hf["model.layers.0.ple.ple_embedding.ngram_embedding.weight"]
    )
    meta = _gguf(gguf).metadata
    assert meta["qwen38-next.ple.layer"] == 0 and meta["qwen38-next.ple.layers"] == [0, 2]
    assert meta["qwen38-next.attention.rope_dimension_count"] == 16


# ----------------------------------------------------------------------------- oracle variants
@pytest.mark.parametrize("script,config", ORACLES, ids=[f"{s[10:-3]}-{c or 'default'}" for s, c in ORACLES])
def test_oracle_variants_convert_exactly(script, config, oracle, tmp_path):
    """Biases, YaRN rope (glm alt), tied embeddings + sigmoid output gate + 2 PLE layers
    (qwen long): GGUF logits equal the HF folder's, also from the family keys alone."""
    src = oracle(script, config)
    gguf = _convert(src, tmp_path / "o.gguf")
    want = _hf_logits(src, ORACLE_IDS)
    assert np.array_equal(ds4mlx.load(gguf)[0].logits(ORACLE_IDS), want)
    assert read_weights(gguf)[0] == json.loads((src / "config.json").read_text())
    assert np.array_equal(_derived_logits(gguf, ORACLE_IDS), want)


def test_f16_conversion_keeps_ds4s_f32_tensors(oracle, tmp_path):
    src = oracle("make_tiny_glm5_next.py", None)
    g = _gguf(_convert(src, tmp_path / "h.gguf", "--dtype", "f16"))
    types = {n: t.ggml_type.name for n, t in g.tensors.items()}
    assert types["blk.0.kda_q.weight"] == "F16" and types["blk.1.attn_k_b.weight"] == "F16"
    assert types["blk.0.kda_q_conv.weight"] == "F32" and types["blk.1.ffn_gate_inp.weight"] == "F32"
    assert types["blk.0.kda_a_log.weight"] == "F32"  # 1-D
    model = ds4mlx.load(g.path)[0]
    got = model.logits(ORACLE_IDS)
    assert np.abs(got - _hf_logits(src, ORACLE_IDS)).max() < 0.05


# ----------------------------------------------------------------------------- tables and transforms
@pytest.mark.parametrize("fam", gguf_families.FAMILIES, ids=lambda f: f.name)
def test_name_tables_are_one_to_one(fam):
    for rule in fam.top:
        gnames = fam.hf_to_gguf(rule.hf)
        assert gnames == rule.gguf and all(fam.gguf_to_hf(g) == rule.hf for g in gnames)
    for rule in fam.layer:
        hf = f"model.layers.123.{rule.hf}"
        gnames = fam.hf_to_gguf(hf)
        assert all(len(g.encode()) < 64 for g in gnames)
        assert all(fam.gguf_to_hf(g) == hf for g in gnames)
    gg = [g for r in fam.top for g in r.gguf] + [f"blk.9.{g}" for r in fam.layer for g in r.gguf]
    assert len(gg) == len(set(gg))


def test_dispatch():
    assert gguf_families.for_config({"model_type": "deepseek_v4"}) is gguf_families.DEEPSEEK_V4
    assert gguf_families.for_config({}) is gguf_families.DEEPSEEK_V4 is gguf_families.default()
    assert gguf_families.for_config({"model_type": "glm5_next"}) is gguf_families.GLM5_NEXT
    assert gguf_families.for_config({"model_type": "qwen4_exp_text"}) is gguf_families.QWEN4_EXP
    assert (
        gguf_families.for_arch("deepseek4") is gguf_families.DEEPSEEK_V4
        and gguf_families.for_arch("glm-dsa") is gguf_families.GLM_MOE_DSA
    )
    with pytest.raises(ValueError, match="no GGUF scheme for model_type 'llama'"):
        gguf_families.for_config({"model_type": "llama"})


def test_unknown_tensor_is_refused(tmp_path):
    from ds4mlx.models.glm_moe_dsa import DEMO_CONFIG

    with pytest.raises(ValueError, match="no glm-dsa GGUF name.*model.foo.weight"):
        write_gguf(tmp_path / "u.gguf", DEMO_CONFIG, {"model.foo.weight": np.zeros(3, np.float32)}, tokenizer=False)
    assert not (tmp_path / "u.gguf").exists()


def test_rearrangements_are_exact():
    from types import SimpleNamespace

    rng = np.random.default_rng(0)
    a = SimpleNamespace(num_attention_heads=3, qk_nope_head_dim=5, v_head_dim=4, head_dim=6)
    kv_b = rng.standard_normal((3 * 9, 7)).astype(np.float32)
    k_b, v_b = kv_b_split(kv_b, a)
    assert k_b.shape == (3, 7, 5) and v_b.shape == (3, 4, 7)
    assert np.array_equal(kv_b_join([k_b, v_b], a), kv_b)
    for q in (rng.standard_normal((3 * 12, 5)).astype(np.float32), rng.standard_normal(3 * 12).astype(np.float32)):
        parts = deinterleave_split(q, a)
        assert np.array_equal(parts[0], q.reshape(3, 2, 6, *q.shape[1:])[:, 0].reshape(18, *q.shape[1:]))
        assert np.array_equal(deinterleave_join(parts, a), q)
    split, join = row_parts(lambda args: (2, 2, 3))
    x = rng.standard_normal((7, 1, 4)).astype(np.float32)
    assert [p.shape[0] for p in split(x, a)] == [2, 2, 3] and np.array_equal(join(split(x, a), a), x)
    # ds4 stores Qwen's (1 + w) norm weights as 1 + w; read back as (1 + w) - 1, the
    # model's own 1 + w' is the same float32 for any w (random bit patterns, all ranges)
    w = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    w = np.concatenate([w[np.isfinite(w) & (np.abs(w) < 1e30)], np.float32([0, -0.5, -1, -2, 1e-30, 3e7])])
    s = plus_one_split(w, a)[0]
    assert np.array_equal(plus_one_join([s], a) + np.float32(1), s)


def test_cli_convert_unknown_family(tmp_path, capsys):
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1}))
    save_file({"model.embed_tokens.weight": np.zeros((4, 2), np.float32)}, str(tmp_path / "model.safetensors"))
    assert main(["convert", str(tmp_path), str(tmp_path / "o.gguf")]) == 1
    assert "no GGUF scheme for model_type 'llama'" in capsys.readouterr().err
    assert not (tmp_path / "o.gguf").exists()
