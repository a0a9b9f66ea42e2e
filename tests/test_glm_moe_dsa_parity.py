"""GLM 5.2 (transformers `glm_moe_dsa`) MLX graph against transformers (tiny random models,
float32, CPU).

Two oracle configurations (tests/oracle/make_tiny_glm_moe_dsa.py, default and `--config
alt`) together cover MLA with the token-level DSA indexer (top-8 of 40 and top-16 of 64
tokens), "shared" indexer layers (alternating, and a chain of two), partial and full
index-head rope, default rope and YaRN with mscale_all_dim, attention biases, dense and
MoE layers with group-limited sigmoid routing (2 groups keep 1, 4 groups keep 2).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from safetensors.numpy import load_file

from ds4mlx.models.base import LanguageModel, family_module, load_hf_dir
from ds4mlx.models.glm_moe_dsa import ModelArgs
from ds4mlx.models.mla import MLAAttention, MLACache

sys.path.insert(0, str(Path(__file__).parent))
from parity_helpers import chunked_logits, load_case, maxdiff  # noqa: E402

CONFIGS = [None, "alt"]
TOL = 1e-4
MIN_MARGIN = 3e-4
SCRIPT = "make_tiny_glm_moe_dsa.py"


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: c or "default")
def case(request, oracle):
    return load_case(oracle, SCRIPT, request.param)


def test_oracle_has_no_topk_near_ties(case):
    *_, summary = case
    margins = summary["min_topk_margin"]
    assert len(margins) >= 2, margins  # the indexer and the router were both exercised
    assert min(margins.values()) >= MIN_MARGIN, margins


def test_configs_cover_shared_indexers_and_sparsity(oracle):
    for name in CONFIGS:
        folder = oracle(SCRIPT, name)
        cfg = json.loads((folder / "config.json").read_text())
        T = np.load(folder / "reference.npz")["input_ids"].shape[1]
        assert "shared" in cfg["indexer_types"] and cfg["index_topk"] < T  # attention really is sparse
        assert {"dense", "sparse"} <= set(cfg["mlp_layer_types"])


def test_full_forward_matches_transformers(case):
    _, lm, ref, _ = case
    assert maxdiff(lm.logits(ref["input_ids"][0].tolist()), ref["logits_full"][0]) <= TOL


@pytest.mark.parametrize("chunk", [1, 3, 7, 13])
def test_chunked_forward_all_positions(case, chunk):
    """Every position's logits from a cached, chunked forward equal the full forward
    (chunk 1 is token-by-token decoding from an empty cache)."""
    _, lm, ref, _ = case
    assert maxdiff(chunked_logits(lm, ref["input_ids"][0].tolist(), chunk), ref["logits_full"][0]) <= TOL


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_both_mla_forms(case, monkeypatch, form, chunk):
    """The expanded (kv_b_proj on every cached latent) and absorbed (one latent head) MLA
    forms both match, for decode, short chunks and whole-sequence prefill."""
    _, lm, ref, _ = case
    monkeypatch.setattr(MLAAttention, "EXPAND_MIN_QUERIES", 1 if form == "expanded" else 10**9)
    assert maxdiff(chunked_logits(lm, ref["input_ids"][0].tolist(), chunk), ref["logits_full"][0]) <= TOL


@pytest.mark.parametrize("chunk", [3, 13])
def test_session_prefill_then_decode(case, chunk):
    """Chunked prefill of P tokens, then token-by-token decode: equal to the full forward and
    to the oracle's own stepwise decode."""
    _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()
    P, full = int(ref["stepwise_start"]), ref["logits_full"][0]
    s = lm.new_session(ctx=len(ids), chunk=chunk)
    assert maxdiff(s.prefill(ids[:P]), full[P - 1]) <= TOL
    steps = np.stack([s.decode(t) for t in ids[P:]])
    assert maxdiff(steps, full[P:]) <= TOL
    assert maxdiff(steps, ref["logits_stepwise"][0]) <= TOL
    assert s.tokens == ids


def test_incremental_last_token(case):
    _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()
    s = lm.new_session(ctx=len(ids), chunk=7)
    s.prefill(ids[:-1])
    assert maxdiff(s.decode(ids[-1]), ref["logits_incremental_last"][0]) <= TOL


def test_snapshot_restore_is_bit_exact(case):
    """snapshot -> decode; restore (fresh session, and rollback of the same one) -> decode gives
    bit-identical logits; the snapshot holds every layer's latent, rope-key and indexer rows."""
    _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()
    P = int(ref["stepwise_start"])
    s = lm.new_session(ctx=len(ids), chunk=7)
    s.prefill(ids[:P])
    for c, kind in zip(s._cache, lm.args.indexer_types):
        assert isinstance(c, MLACache)
        want = {"latent", "k_rope"} | ({"index_k"} if kind == "full" else set())
        assert set(c.state) == want and all(a.shape[1] == P for a in c.state.values())
    blob = s.snapshot()
    first = np.stack([s.decode(t) for t in ids[P:]])
    s.restore(blob)  # rollback
    again = np.stack([s.decode(t) for t in ids[P:]])
    fresh = lm.new_session(ctx=len(ids))
    fresh.restore(blob)
    assert fresh.tokens == ids[:P]
    other = np.stack([fresh.decode(t) for t in ids[P:]])
    assert np.array_equal(first, again) and np.array_equal(first, other)
    assert maxdiff(first, ref["logits_full"][0][P:]) <= TOL


def test_truncate_then_decode(case):
    _, lm, ref, _ = case
    ids = ref["input_ids"][0].tolist()
    P, full = int(ref["stepwise_start"]), ref["logits_full"][0]
    s = lm.new_session(ctx=len(ids), chunk=11)
    s.prefill(ids)
    s.truncate(P)
    assert len(s) == P and maxdiff(s.last_logits, full[P - 1]) <= TOL
    assert maxdiff(np.stack([s.decode(t) for t in ids[P:]]), full[P:]) <= TOL


def test_config_fields_match_transformers(case):
    folder, _, _, _ = case
    cfg = json.loads((folder / "config.json").read_text())
    args = ModelArgs.from_dict(cfg)
    for k in ("indexer_types", "mlp_layer_types", "layer_types", "head_dim", "rope_parameters"):
        assert getattr(args, k) == cfg[k], k
    assert family_module(cfg["model_type"]).Model is type(load_hf_dir(str(folder)).model)


def test_config_defaults_fold_like_transformers():
    transformers = pytest.importorskip("transformers")
    for kw in ({}, {"index_topk_pattern": "FSSF" * 20}, {"index_topk_freq": 3, "index_skip_topk_offset": 1}):
        hf = transformers.GlmMoeDsaConfig(num_hidden_layers=7, **kw)
        args = ModelArgs.from_dict({"num_hidden_layers": 7, **kw})
        assert args.indexer_types[:7] == hf.indexer_types[:7]
        assert args.mlp_layer_types == hf.mlp_layer_types and args.head_dim == hf.head_dim
    with pytest.raises(ValueError):
        ModelArgs.from_dict({"num_hidden_layers": 2, "indexer_types": ["shared", "full"]})


def test_per_expert_hub_names_load(oracle):
    """Per-expert `mlp.experts.<e>.{gate,up,down}_proj.weight` (hub checkpoints) are stacked
    into the fused layout; MTP layers beyond num_hidden_layers are dropped."""
    folder = oracle(SCRIPT, None)
    cfg = json.loads((folder / "config.json").read_text())
    fused = load_file(str(folder / "model.safetensors"))
    I = cfg["moe_intermediate_size"]
    split = {}
    for k, v in fused.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                split[f"{base}{e}.gate_proj.weight"] = v[e, :I]
                split[f"{base}{e}.up_proj.weight"] = v[e, I:]
        elif k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                split[f"{base}{e}.down_proj.weight"] = v[e]
        else:
            split[k] = v
    split[f"model.layers.{cfg['num_hidden_layers']}.eh_proj.weight"] = np.zeros((2, 2), np.float32)  # an MTP layer
    ids = np.load(folder / "reference.npz")["input_ids"][0].tolist()
    a = LanguageModel.from_config(cfg, fused).logits(ids)
    b = LanguageModel.from_config(cfg, split).logits(ids)
    assert np.array_equal(a, b)


def test_quantized_model_matches_dequantized_weights(oracle):
    """nn.quantize'd projections (the absorbed MLA form runs kv_b_proj as per-head quantized matmuls) compute what the
    float graph computes with the dequantized weights, in both MLA forms."""
    folder = oracle(SCRIPT, None)
    ids = np.load(folder / "reference.npz")["input_ids"][0].tolist()
    quant, dequant = load_hf_dir(str(folder)), load_hf_dir(str(folder))
    nn.quantize(quant.model, group_size=32, bits=4)
    shapes = {k: v.shape for k, v in tree_flatten(dequant.model.parameters())}
    updates = [
        (f"{path}.weight", mx.dequantize(m.weight, m.scales, m.biases, 32, 4).reshape(shapes[f"{path}.weight"]))
        for path, m in quant.model.named_modules()
        if type(m).__name__.startswith("Quantized")
    ]
    assert any("kv_b_proj" in p for p, _ in updates)
    dequant.model.load_weights(updates, strict=False)
    assert maxdiff(chunked_logits(quant, ids, 5), dequant.logits(ids)) <= TOL
    assert maxdiff(quant.logits(ids), dequant.logits(ids)) <= TOL


def test_demo_model_loads_and_decodes(tmp_path, monkeypatch):
    """`ds4mlx.load("demo:glm_moe_dsa")`: random weights, the DeepSeek tokenizer standing in for
    GLM's; prefill, decode, snapshot/restore."""
    import ds4mlx
    from ds4mlx.models.glm_moe_dsa import DEMO_CONFIG

    monkeypatch.setenv("DS4MLX_CACHE", str(tmp_path))
    model, tok = ds4mlx.load("demo:glm_moe_dsa")
    assert model.args.model_type == "glm_moe_dsa" and model.vocab_size == DEMO_CONFIG["vocab_size"]
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 2)
    s = model.new_session(ctx=128, chunk=5)
    last = s.prefill(ids)
    assert np.isfinite(last).all() and maxdiff(last, model.logits(ids)[-1]) <= TOL
    blob = s.snapshot()
    a = s.decode(int(np.argmax(last)))
    s.restore(blob)
    assert np.array_equal(s.decode(int(np.argmax(last))), a)
